"""Flips of HWC images, in place."""
from __future__ import annotations

import cv2
import numpy as np

__all__ = ["flip_inplace"]


def flip_inplace(img: np.ndarray, flip_ud: bool, flip_lr: bool) -> np.ndarray:
    """Flip an HWC image in place (``cv2.flip`` swaps rows / columns pairwise, so src == dst is safe)."""
    if flip_ud and flip_lr:
        cv2.flip(img, -1, dst=img)
    elif flip_ud:
        cv2.flip(img, 0, dst=img)
    elif flip_lr:
        cv2.flip(img, 1, dst=img)
    return img

