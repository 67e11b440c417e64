"""``fastload monitor``: sample GPU (NVML) and CPU / process-tree use while a job runs.

- :mod:`fastload.monitor.sampler`: one reading per interval (NVML import guarded, psutil).
- :mod:`fastload.monitor.run`: the sampling loop, CSV, signal forwarding, summary and verdict.
- :mod:`fastload.monitor.plot`: the time-series PNG.
"""
from __future__ import annotations

from fastload.monitor.run import MonitorResult, format_summary, monitor, summarise

__all__ = ["MonitorResult", "format_summary", "monitor", "summarise"]
