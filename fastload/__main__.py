import sys

from fastload.cli import main

sys.exit(main())
