"""``python -m fastload.compat.yolov9 SCRIPT.py [official flags] [--fastload-* flags]``."""
from fastload.compat.yolov9.launcher import main

raise SystemExit(main())
