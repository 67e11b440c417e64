"""The one place a ``device`` argument becomes a :class:`torch.device` (the GPU and DALI engines, the GPU
store, the YOLOv9 compat layer)."""
from __future__ import annotations

import torch

__all__ = ["resolve_device"]


def resolve_device(device: str | torch.device | None, who: str, *, instead: str = "device='cpu'") -> torch.device:
    """``device`` resolved: ``None`` is the current CUDA device when CUDA is available, else the CPU; a CUDA
    device without an index is the current one. Asking for CUDA where there is none raises a RuntimeError
    naming ``who`` (e.g. ``"engine='gpu'"``) and what to use ``instead``."""
    if device is None:
        return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    dev = torch.device(device)
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError(f"{who} with device={str(device)!r}: CUDA is not available (no CUDA GPU is visible to "
                               f"torch {torch.__version__}); use {instead}")
        if dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
    return dev
