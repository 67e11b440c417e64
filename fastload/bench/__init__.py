"""``fastload bench``: measure each stage of the data path on the user's own data and name the bottleneck.

- :mod:`fastload.bench.ceilings`: machine ceilings (memcpy, raw sequential read, cores, RAM).
- :mod:`fastload.bench.pagecache`: drop a dataset's pages from the cache (cold reads) and check it.
- :mod:`fastload.bench.decoders`: the decoders compared (cv2, PIL, torchvision, turbojpeg, reduced DCT).
- :mod:`fastload.bench.stages`: one timed function per stage (read, decode, augment, loader).
- :mod:`fastload.bench.analysis`: ceilings per store, the bottleneck and its sentence.
- :mod:`fastload.bench.run`: :func:`run_bench`, the orchestration and the JSON document.
- :mod:`fastload.bench.report` / :mod:`fastload.bench.plot`: the text table and the PNG chart.
"""
from __future__ import annotations

from fastload.bench.run import BenchResult, run_bench
from fastload.bench.stages import STAGES, Measurement

__all__ = ["BenchResult", "Measurement", "STAGES", "run_bench"]
