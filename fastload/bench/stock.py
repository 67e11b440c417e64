"""The stock YOLOv9 training loader, re-implemented clean-room: the baseline fastload is measured against.

Written from the documented behaviour of YOLOv9's ``LoadImagesAndLabels`` (``load_image``,
``load_mosaic``, ``random_perspective``, ``box_candidates``, ``mixup``, ``augment_hsv``,
``letterbox``, ``collate_fn``), never from its code: every sample decodes the images it draws from
their files, pastes them on a 2s x 2s canvas, warps the canvas with one ``warpAffine`` (or
``warpPerspective``), applies HSV through three LUTs and flips; batches are collated afresh.

* :class:`StockAugmenter` draws its own random numbers (``random`` + ``np.random`` style, from a
  private generator) exactly like the stock code; the parity tests compare distributions with it.
* :class:`StockDataset` / :func:`stock_loader`: "the stock loader" of ``fastload demo`` and of
  ``benchmarks/loader_throughput.py``, in a torch DataLoader as the official trainer runs it.

The pieces (``letterbox``, ``warp``, ``warp_boxes``, ``augment_hsv``...) are also the oracle the tests
replay fastload's records with (``tests/reference/stock_replay.py``).
"""
from __future__ import annotations

import math
import random
from pathlib import Path
from typing import Any, Callable, Sequence

import cv2
import numpy as np
import torch
from PIL import Image

from fastload.augment.hyp import load_hyp
from fastload.data.images import loaded_shape

FILL = 114


# --------------------------------------------------------------------------------- stock pieces
def letterbox(im: np.ndarray, new_shape: int | tuple[int, int], color: int = FILL, auto: bool = False,
              scaleup: bool = True, stride: int = 32) -> tuple[np.ndarray, tuple[float, float], tuple[float, float]]:
    """Resize keeping aspect, pad to ``new_shape``; returns (image, (r, r), (dw, dh))."""
    shape = im.shape[:2]
    if isinstance(new_shape, int):
        new_shape = (new_shape, new_shape)
    r = min(new_shape[0] / shape[0], new_shape[1] / shape[1])
    if not scaleup:
        r = min(r, 1.0)
    new_unpad = int(round(shape[1] * r)), int(round(shape[0] * r))
    dw, dh = new_shape[1] - new_unpad[0], new_shape[0] - new_unpad[1]
    if auto:
        dw, dh = np.mod(dw, stride), np.mod(dh, stride)
    dw /= 2
    dh /= 2
    if shape[::-1] != new_unpad:
        im = cv2.resize(im, new_unpad, interpolation=cv2.INTER_LINEAR)
    top, bottom = int(round(dh - 0.1)), int(round(dh + 0.1))
    left, right = int(round(dw - 0.1)), int(round(dw + 0.1))
    im = cv2.copyMakeBorder(im, top, bottom, left, right, cv2.BORDER_CONSTANT, value=(color, color, color))
    return im, (r, r), (dw, dh)


def box_candidates(box1: np.ndarray, box2: np.ndarray, wh_thr: float = 2, ar_thr: float = 100,
                   area_thr: float = 0.1, eps: float = 1e-16) -> np.ndarray:
    """box1/box2: [4, n] xyxy before (scaled) / after the warp."""
    w1, h1 = box1[2] - box1[0], box1[3] - box1[1]
    w2, h2 = box2[2] - box2[0], box2[3] - box2[1]
    ar = np.maximum(w2 / (h2 + eps), h2 / (w2 + eps))
    return (w2 > wh_thr) & (h2 > wh_thr) & (w2 * h2 / (w1 * h1 + eps) > area_thr) & (ar < ar_thr)


def perspective_matrix(canvas_hw: tuple[int, int], out_hw: tuple[int, int], hyp: dict, rnd: random.Random) -> tuple[np.ndarray, float]:
    """``M = T @ S @ R @ P @ C`` of ``random_perspective`` (draw order as in the stock code)."""
    C = np.eye(3)
    C[0, 2] = -canvas_hw[1] / 2
    C[1, 2] = -canvas_hw[0] / 2
    P = np.eye(3)
    P[2, 0] = rnd.uniform(-hyp["perspective"], hyp["perspective"])
    P[2, 1] = rnd.uniform(-hyp["perspective"], hyp["perspective"])
    R = np.eye(3)
    a = rnd.uniform(-hyp["degrees"], hyp["degrees"])
    s = rnd.uniform(1 - hyp["scale"], 1 + hyp["scale"])
    R[:2] = cv2.getRotationMatrix2D(angle=a, center=(0, 0), scale=s)
    S = np.eye(3)
    S[0, 1] = math.tan(rnd.uniform(-hyp["shear"], hyp["shear"]) * math.pi / 180)
    S[1, 0] = math.tan(rnd.uniform(-hyp["shear"], hyp["shear"]) * math.pi / 180)
    T = np.eye(3)
    T[0, 2] = rnd.uniform(0.5 - hyp["translate"], 0.5 + hyp["translate"]) * out_hw[1]
    T[1, 2] = rnd.uniform(0.5 - hyp["translate"], 0.5 + hyp["translate"]) * out_hw[0]
    return T @ S @ R @ P @ C, s


def warp(img: np.ndarray, M: np.ndarray, out_hw: tuple[int, int]) -> np.ndarray:
    """The stock pixel warp of ``random_perspective``."""
    if M[2, 0] != 0 or M[2, 1] != 0:
        return cv2.warpPerspective(img, M, dsize=(out_hw[1], out_hw[0]), borderValue=(FILL, FILL, FILL))
    return cv2.warpAffine(img, M[:2], dsize=(out_hw[1], out_hw[0]), borderValue=(FILL, FILL, FILL))


def warp_boxes(targets: np.ndarray, M: np.ndarray, s: float, out_hw: tuple[int, int]) -> np.ndarray:
    """The stock box part of ``random_perspective``: targets [n, 5] (cls, xyxy px) -> kept, moved."""
    n = len(targets)
    if not n:
        return targets
    xy = np.ones((n * 4, 3))
    xy[:, :2] = targets[:, [1, 2, 3, 4, 1, 4, 3, 2]].reshape(n * 4, 2)
    xy = xy @ M.T
    xy = (xy[:, :2] / xy[:, 2:3] if (M[2, 0] != 0 or M[2, 1] != 0) else xy[:, :2]).reshape(n, 8)
    x, y = xy[:, [0, 2, 4, 6]], xy[:, [1, 3, 5, 7]]
    new = np.concatenate((x.min(1), y.min(1), x.max(1), y.max(1))).reshape(4, n).T
    new[:, [0, 2]] = new[:, [0, 2]].clip(0, out_hw[1])
    new[:, [1, 3]] = new[:, [1, 3]].clip(0, out_hw[0])
    keep = box_candidates(box1=targets[:, 1:5].T * s, box2=new.T, area_thr=0.10)
    out = targets[keep].copy()
    out[:, 1:5] = new[keep]
    return out


def augment_hsv(im: np.ndarray, gains: Sequence[float], bgr: bool = False) -> None:
    """HSV gains through three LUTs, in place (RGB by default; ``bgr=True`` as the stock code)."""
    r = np.asarray(gains, dtype=np.float64)
    to_hsv, from_hsv = (cv2.COLOR_BGR2HSV, cv2.COLOR_HSV2BGR) if bgr else (cv2.COLOR_RGB2HSV, cv2.COLOR_HSV2RGB)
    hue, sat, val = cv2.split(cv2.cvtColor(im, to_hsv))
    x = np.arange(0, 256, dtype=r.dtype)
    lut_hue = ((x * r[0]) % 180).astype(np.uint8)
    lut_sat = np.clip(x * r[1], 0, 255).astype(np.uint8)
    lut_val = np.clip(x * r[2], 0, 255).astype(np.uint8)
    im_hsv = cv2.merge((cv2.LUT(hue, lut_hue), cv2.LUT(sat, lut_sat), cv2.LUT(val, lut_val)))
    cv2.cvtColor(im_hsv, from_hsv, dst=im)


def mixup_pixels(im: np.ndarray, im2: np.ndarray, r: float) -> np.ndarray:
    return (im * r + im2 * (1 - r)).astype(np.uint8)


def xywhn2xyxy(x: np.ndarray, w: float, h: float, padw: float = 0, padh: float = 0) -> np.ndarray:
    y = np.copy(x)
    y[:, 0] = w * (x[:, 0] - x[:, 2] / 2) + padw
    y[:, 1] = h * (x[:, 1] - x[:, 3] / 2) + padh
    y[:, 2] = w * (x[:, 0] + x[:, 2] / 2) + padw
    y[:, 3] = h * (x[:, 1] + x[:, 3] / 2) + padh
    return y


def xyxy2xywhn(x: np.ndarray, w: int, h: int, eps: float = 1e-3) -> np.ndarray:
    x = x.copy()
    x[:, [0, 2]] = x[:, [0, 2]].clip(0, w - eps)
    x[:, [1, 3]] = x[:, [1, 3]].clip(0, h - eps)
    y = np.copy(x)
    y[:, 0] = ((x[:, 0] + x[:, 2]) / 2) / w
    y[:, 1] = ((x[:, 1] + x[:, 3]) / 2) / h
    y[:, 2] = (x[:, 2] - x[:, 0]) / w
    y[:, 3] = (x[:, 3] - x[:, 1]) / h
    return y


def finish_labels(labels: np.ndarray, out_hw: tuple[int, int], flip_ud: bool, flip_lr: bool) -> np.ndarray:
    """xyxy px -> xywhn (clip eps), then flips: the tail of the stock ``__getitem__``."""
    labels = np.asarray(labels, np.float64).reshape(-1, 5).copy()
    if len(labels):
        labels[:, 1:5] = xyxy2xywhn(labels[:, 1:5], w=out_hw[1], h=out_hw[0])
        if flip_ud:
            labels[:, 2] = 1 - labels[:, 2]
        if flip_lr:
            labels[:, 1] = 1 - labels[:, 1]
    return labels.astype(np.float32)


# --------------------------------------------------------------------------- stock with own draws
class StockAugmenter:
    """The stock ``__getitem__`` logic with its own random draws.

    Args:
        get_image: loaded image (HWC uint8, any channel order) of an index.
        labels: normalised [n, 5] labels per index.
        loaded_shapes: int [N, 2] loaded (h, w).
        rect_shapes: per-index rect batch shape (h, w) or None.
    """

    def __init__(self, get_image: Callable[[int], np.ndarray], labels: Sequence[np.ndarray], loaded_shapes: np.ndarray,
                 imgsz: int, hyp: dict | None = None, *, augment: bool = True, seed: int = 0,
                 rect_shapes: np.ndarray | None = None, bgr: bool = False) -> None:
        self.get_image = get_image
        self.labels = [np.asarray(x, np.float64).reshape(-1, 5) for x in labels]
        self.shapes = np.asarray(loaded_shapes).reshape(-1, 2)
        self.img_size = imgsz
        self.hyp = load_hyp(hyp)
        self.augment = augment
        self.rect_shapes = rect_shapes
        self.mosaic = augment and rect_shapes is None
        self.mosaic_border = [-imgsz // 2, -imgsz // 2]
        self.indices = list(range(len(self.shapes)))
        self.rnd = random.Random(seed)
        self.nprng = np.random.default_rng(seed)
        self.bgr = bgr
        self.last: dict[str, Any] = {}  # what the last call drew, for distribution tests

    def load_mosaic(self, index: int) -> tuple[np.ndarray, np.ndarray]:
        s = self.img_size
        yc, xc = (int(self.rnd.uniform(-x, 2 * s + x)) for x in self.mosaic_border)
        self.last.setdefault("centres", []).append((xc, yc))
        indices = [index] + self.rnd.choices(self.indices, k=3)
        self.rnd.shuffle(indices)
        img4 = None
        labels4 = []
        for i, idx in enumerate(indices):
            img = self.get_image(idx)
            h, w = img.shape[:2]
            if i == 0:
                img4 = np.full((s * 2, s * 2, img.shape[2]), FILL, dtype=np.uint8)
                x1a, y1a, x2a, y2a = max(xc - w, 0), max(yc - h, 0), xc, yc
                x1b, y1b, x2b, y2b = w - (x2a - x1a), h - (y2a - y1a), w, h
            elif i == 1:
                x1a, y1a, x2a, y2a = xc, max(yc - h, 0), min(xc + w, s * 2), yc
                x1b, y1b, x2b, y2b = 0, h - (y2a - y1a), min(w, x2a - x1a), h
            elif i == 2:
                x1a, y1a, x2a, y2a = max(xc - w, 0), yc, xc, min(s * 2, yc + h)
                x1b, y1b, x2b, y2b = w - (x2a - x1a), 0, w, min(y2a - y1a, h)
            else:
                x1a, y1a, x2a, y2a = xc, yc, min(xc + w, s * 2), min(s * 2, yc + h)
                x1b, y1b, x2b, y2b = 0, 0, min(w, x2a - x1a), min(y2a - y1a, h)
            img4[y1a:y2a, x1a:x2a] = img[y1b:y2b, x1b:x2b]
            padw, padh = x1a - x1b, y1a - y1b
            lab = self.labels[idx].copy()
            if lab.size:
                lab[:, 1:] = xywhn2xyxy(lab[:, 1:], w, h, padw, padh)
            labels4.append(lab)
        labels4 = np.concatenate(labels4, 0)
        np.clip(labels4[:, 1:], 0, 2 * s, out=labels4[:, 1:])
        out_hw = (2 * s + 2 * self.mosaic_border[0], 2 * s + 2 * self.mosaic_border[1])
        M, sc = perspective_matrix(img4.shape[:2], out_hw, self.hyp, self.rnd)
        return warp(img4, M, out_hw), warp_boxes(labels4, M, sc, out_hw)

    def __call__(self, index: int) -> tuple[np.ndarray, np.ndarray, Any]:
        """(image HWC, labels float32 [n, 5] xywhn, shapes) of ``index``."""
        hyp = self.hyp
        self.last = {}
        mosaic = self.mosaic and self.rnd.random() < hyp["mosaic"]
        self.last["mosaic"] = mosaic
        self.last["mixup"] = False
        if mosaic:
            img, labels = self.load_mosaic(index)
            shapes = None
            if self.rnd.random() < hyp["mixup"]:
                img2, labels2 = self.load_mosaic(self.rnd.choice(self.indices))
                r = self.nprng.beta(32.0, 32.0)
                img = mixup_pixels(img, img2, r)
                labels = np.concatenate((labels, labels2), 0)
                self.last["mixup"] = True
                self.last["mixup_ratio"] = r
        else:
            img = self.get_image(index)
            h, w = img.shape[:2]
            shape = tuple(self.rect_shapes[index]) if self.rect_shapes is not None else self.img_size
            img, ratio, pad = letterbox(img, shape, auto=False, scaleup=self.augment)
            shapes = (h, w), ((1.0, 1.0), pad)
            labels = self.labels[index].copy()
            if labels.size:
                labels[:, 1:] = xywhn2xyxy(labels[:, 1:], ratio[0] * w, ratio[1] * h, padw=pad[0], padh=pad[1])
            if self.augment:
                M, sc = perspective_matrix(img.shape[:2], img.shape[:2], hyp, self.rnd)
                img, labels = warp(img, M, img.shape[:2]), warp_boxes(labels, M, sc, img.shape[:2])
        flip_ud = flip_lr = False
        if self.augment:
            if hyp["hsv_h"] or hyp["hsv_s"] or hyp["hsv_v"]:
                gains = self.nprng.uniform(-1, 1, 3) * [hyp["hsv_h"], hyp["hsv_s"], hyp["hsv_v"]] + 1
                augment_hsv(img, gains, bgr=self.bgr)
                self.last["gains"] = gains
            flip_ud = self.rnd.random() < hyp["flipud"]
            flip_lr = self.rnd.random() < hyp["fliplr"]
            if flip_ud:
                img = np.flipud(img)
            if flip_lr:
                img = np.fliplr(img)
        self.last["flip_ud"], self.last["flip_lr"] = flip_ud, flip_lr
        return img, finish_labels(labels, img.shape[:2], flip_ud, flip_lr), shapes


# ------------------------------------------------------------------------------- the stock loader
class StockDataset(torch.utils.data.Dataset):
    """"The stock loader": files decoded with ``cv2.imread`` (BGR) on every access, resized to
    ``imgsz``, augmented by :class:`StockAugmenter` with its own draws, BGR->RGB CHW at the end.

    Args:
        im_files: image paths.
        labels: per-image normalised [n, 5] labels.
        imgsz: training size.
        hyp: hyp dict / yaml / None.
        augment: training (True) or validation (False).
        seed: seeds this dataset's generator (each worker reseeds from torch's worker seed).
        rect_shapes: per-index rect batch shape for validation.
        loaded_shapes: int [N, 2] loaded (h, w) at ``imgsz`` (default: read from each file's header).
        cache_ram: YOLOv9's ``--cache ram``: every loaded image decoded once, in the main process, before
            the workers fork; samples then only augment.
    """

    def __init__(self, im_files: Sequence[str | Path], labels: Sequence[np.ndarray], imgsz: int = 640,
                 hyp: dict | str | None = None, *, augment: bool = True, seed: int = 0,
                 rect_shapes: np.ndarray | None = None, loaded_shapes: np.ndarray | None = None,
                 cache_ram: bool = False) -> None:
        self.im_files = [str(f) for f in im_files]
        self.imgsz = imgsz
        self.augment = augment
        if loaded_shapes is None:
            loaded_shapes = np.array([self._probe(f) for f in self.im_files], np.int64).reshape(-1, 2)
        self.aug = StockAugmenter(self.load_image, labels, loaded_shapes, imgsz, load_hyp(hyp), augment=augment,
                                  seed=seed, rect_shapes=rect_shapes, bgr=True)
        self.ims: list[np.ndarray] | None = None
        if cache_ram:
            self.ims = [self.load_image(i) for i in range(len(self.im_files))]

    def _probe(self, f: str) -> tuple[int, int]:
        with Image.open(f) as im:
            w0, h0 = im.size
        return loaded_shape(h0, w0, self.imgsz)

    def load_image(self, i: int) -> np.ndarray:
        if self.ims is not None:
            return self.ims[i]
        im = cv2.imread(self.im_files[i])
        if im is None:
            raise FileNotFoundError(f"image not found or unreadable: {self.im_files[i]}")
        h0, w0 = im.shape[:2]
        r = self.imgsz / max(h0, w0)
        if r != 1:
            h, w = loaded_shape(h0, w0, self.imgsz)
            interp = cv2.INTER_LINEAR if (self.augment or r > 1) else cv2.INTER_AREA
            im = cv2.resize(im, (w, h), interpolation=interp)
        return im

    def __len__(self) -> int:
        return len(self.im_files)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor, str, Any]:
        info = torch.utils.data.get_worker_info()
        if info is not None and getattr(self, "_worker_seeded", None) != info.id:
            self.aug.rnd.seed(info.seed)
            self.aug.nprng = np.random.default_rng(info.seed % 2**32)
            self._worker_seeded = info.id
        img, labels, shapes = self.aug(index)
        nl = len(labels)
        labels_out = torch.zeros((nl, 6))
        if nl:
            labels_out[:, 1:] = torch.from_numpy(labels)
        img = np.ascontiguousarray(img.transpose((2, 0, 1))[::-1])  # HWC BGR -> CHW RGB
        return torch.from_numpy(img), labels_out, self.im_files[index], shapes

    @staticmethod
    def collate_fn(batch: list) -> tuple[torch.Tensor, torch.Tensor, tuple, tuple]:
        im, label, path, shapes = zip(*batch)
        for i, lb in enumerate(label):
            lb[:, 0] = i
        return torch.stack(im, 0), torch.cat(label, 0), path, shapes


def _one_opencv_thread(_worker_id: int) -> None:
    """YOLOv9 runs ``cv2.setNumThreads(0)`` when its utils are imported; its loader workers inherit it."""
    cv2.setNumThreads(0)


def stock_loader(dataset: StockDataset, *, batch_size: int, workers: int, shuffle: bool = True) -> torch.utils.data.DataLoader:
    """``dataset`` in a torch DataLoader as the official trainer runs it: ``workers`` persistent worker
    processes, OpenCV single-threaded in each, a fresh collate per batch."""
    return torch.utils.data.DataLoader(dataset, batch_size=batch_size, shuffle=shuffle, num_workers=workers,
                                       collate_fn=StockDataset.collate_fn, persistent_workers=workers > 0,
                                       worker_init_fn=_one_opencv_thread)
