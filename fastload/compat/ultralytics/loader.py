"""Ultralytics' train and validation loaders, built by :func:`fastload.loader` from the trainer's arguments.

Nothing here imports ``ultralytics``: :func:`build_loader` reads the trainer's argument namespace and
returns an :class:`UltralyticsLoader`, which yields Ultralytics' batch dict and answers what its trainer
and validator ask a loader and its dataset. :mod:`fastload.compat.ultralytics.trainer` plugs it in.
"""
from __future__ import annotations

import logging
import math
import os
from dataclasses import dataclass
from typing import Any, Iterator, Mapping, Sequence, overload

import cv2
import numpy as np
import torch

from fastload.augment.hyp import AUGMENT_KEYS
from fastload.compat.batch_log import BatchLog
from fastload.compat.ranks import shard_of
from fastload.compat.stores import open_split_store, split_config
from fastload.compat.ultralytics.options import OWNER, UltralyticsOptions
from fastload.data.device import resolve_device
from fastload.data.labels import FlatLabels
from fastload.engines.base import Batch, Layout
from fastload.engines.factory import engine_class
from fastload.fastloader import FastLoader
from fastload.fastloader import loader as make_loader
from fastload.store.base import Store
from fastload.store.view import StoreView

LOG = logging.getLogger(__name__)


class UnsupportedArgument(ValueError):
    """A trainer argument fastload cannot honour: one line naming it, its value and what to do instead."""


@dataclass(frozen=True)
class LoaderRequest:
    """One loader the trainer or validator asks for (``get_dataloader``'s arguments and the model's stride)."""

    img_path: Any
    batch_size: int
    mode: str  # "train" (augmented, shuffled) or "val"
    rect: bool
    stride: int
    rank: int = -1
    device: torch.device | None = None  # the trainer's device


def _arg(args: Any, name: str, default: Any = None) -> Any:
    return getattr(args, name, default)


def _fraction(args: Any, mode: str) -> float | int:
    """The share of a split's images Ultralytics uses: ``fraction`` for training (a list: one per split)."""
    value = _arg(args, "fraction", 1.0)
    if isinstance(value, (list, tuple)):
        k = 0 if mode == "train" else 1
        value = value[k] if k < len(value) else 1.0
    elif mode != "train":
        value = 1.0
    if not isinstance(value, bool) and value == 1:  # 1 means every image, as 1.0 (not one image)
        value = 1.0
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0 or (
            isinstance(value, float) and value > 1):
        raise UnsupportedArgument(f"{OWNER}: fraction={value!r} must be a share in (0, 1] or an image count >= 1")
    return value


#: The Ultralytics tasks fastload's loaders serve: the model's task picks the trainer, validator and batch dict.
TASKS: tuple[str, ...] = ("detect", "segment", "pose", "obb")


def served_task(task: Any) -> str:
    """The model's ``task`` (None: detect) if fastload serves it, else a one-line refusal."""
    task = task or "detect"
    if task == "classify":
        raise UnsupportedArgument(f"{OWNER}: task='classify': classification reads whole images from class folders, "
                                  "not YOLO labels; use Ultralytics' own loader (drop trainer=/validator=)")
    if task not in TASKS:
        raise UnsupportedArgument(f"{OWNER}: task={task!r}: fastload serves {', '.join(TASKS)}; use Ultralytics' "
                                  "own loader for it")
    return str(task)


def check_arguments(args: Any, data: Mapping[str, Any], mode: str, opts: UltralyticsOptions) -> None:
    """Refuse, in one line, a trainer argument that a fastload loader would not honour."""
    def refuse(what: str, why: str) -> None:
        raise UnsupportedArgument(f"{OWNER}: {what}: {why}")

    task = served_task(_arg(args, "task"))
    if task == "pose" and not data.get("kpt_shape"):
        refuse("task='pose'", f"the data yaml {data.get('yaml_file') or ''} has no kpt_shape: [K, D]")
    if int(data.get("channels", 3)) != 3:
        refuse(f"channels={data.get('channels')}", "fastload delivers 3-channel RGB images")
    imgsz = _arg(args, "imgsz", 640)
    if isinstance(imgsz, bool) or not isinstance(imgsz, int):
        refuse(f"imgsz={imgsz!r}", "one integer size is supported (the long side; training batches are square)")
    if mode != "train":
        return
    for name in ("cutmix", "bgr"):
        if float(_arg(args, name, 0.0) or 0.0) > 0:
            refuse(f"{name}={_arg(args, name)}", "not implemented in fastload's augmentation; set it to 0")
    if float(_arg(args, "copy_paste", 0.0) or 0.0) > 0:
        if task != "segment":  # Ultralytics pastes an obb set's corners too; fastload pastes segment instances only
            refuse(f"copy_paste={_arg(args, 'copy_paste')}", f"fastload pastes the instances of segment sets only "
                   f"(task={task!r}); set it to 0")
        if _arg(args, "copy_paste_mode", "flip") != "flip":
            refuse(f"copy_paste_mode={_arg(args, 'copy_paste_mode')!r}", "fastload implements the 'flip' mode only")
    if _arg(args, "augmentations"):
        refuse("augmentations=[...]", "custom Albumentations transforms are not applied by fastload; drop them")


def _labels_view(base: Store, args: Any, mode: str) -> StoreView:
    """The images and labels Ultralytics' dataset would hold: the first ``fraction`` of the sorted images,
    labels of ``classes`` only, every class 0 with ``single_cls`` (array operations on the packed labels: no
    object per image)."""
    fraction = _fraction(args, mode)
    n = len(base)
    count = fraction if isinstance(fraction, int) else max(1, round(n * fraction))
    keep = np.arange(min(count, n), dtype=np.int64)
    # array operations on the packed labels (their points with them): no object per image
    flat = FlatLabels.from_arrays(base.labels)
    flat = flat if len(keep) == len(flat) else flat.subset(keep)
    classes = _arg(args, "classes")
    if classes is not None:
        flat = flat.keep_rows(np.isin(flat.rows[:, 0], np.asarray(classes, np.float32).reshape(-1)))
    if _arg(args, "single_cls", False):
        rows = flat.rows.copy()
        rows[:, 0] = 0
        flat = FlatLabels(rows, flat.offsets, flat.points, flat.point_offsets)
    return StoreView(base, keep, flat)


def _workers(args: Any, opts: UltralyticsOptions, req: LoaderRequest, n: int, batch_size: int) -> int:
    """Ultralytics' worker count (trainer: ``workers``, validation: twice that, never more than the batches);
    the gpu engine has no worker processes."""
    if opts.num_workers is not None:
        return opts.num_workers
    if engine_class(opts.engine).renderers != "workers":  # no worker processes (gpu: one host thread)
        return 0
    device = req.device
    nd = torch.cuda.device_count() if device is not None and device.type == "cuda" else 0
    workers = int(_arg(args, "workers", 8)) * (1 if req.mode == "train" else 2)
    batches = math.ceil(n / batch_size)
    return min((os.cpu_count() or 1) // max(nd, 1), workers, 0 if batches <= 1 else batches)


def _device(opts: UltralyticsOptions, req: LoaderRequest) -> torch.device | None:
    """Where batches go: the trainer's CUDA device (``auto``; None, the CPU without a copy, elsewhere) or as asked."""
    if opts.device is None:
        return None
    if opts.device == "auto":
        return req.device if req.device is not None and req.device.type == "cuda" else None
    return resolve_device(opts.device, OWNER, instead="fastload_device=None")


def _layout(args: Any, req: LoaderRequest) -> Layout:
    """The memory order of the model's input: channels-last where Ultralytics' trainer makes the model
    channels-last (a CUDA device, its ``channels_last`` argument not False), wherever fastload delivers the
    batch (a channels-last batch is a view of the rendered pixels: no transposing copy)."""
    on_cuda = req.device is not None and req.device.type == "cuda"
    return "nhwc" if on_cuda and _arg(args, "channels_last", None) is not False else "nchw"


def build_loader(args: Any, data: Mapping[str, Any], req: LoaderRequest, opts: UltralyticsOptions) -> "UltralyticsLoader":
    """The fastload loader Ultralytics' ``get_dataloader`` returns for ``req``, from the trainer's ``args``
    (its argument namespace) and ``data`` (its checked data dict: ``names``, ``nc``, ``channels``)."""
    augment = req.mode == "train"
    check_arguments(args, data, req.mode, opts)
    imgsz = int(args.imgsz)
    cache = _arg(args, "cache", False)
    cache = "ram" if cache is True else (str(cache).lower() if cache else "")
    if cache not in ("", "ram", "disk"):
        raise UnsupportedArgument(f"{OWNER}: cache={args.cache!r}: choose ram, disk or False")
    # validation is always Ultralytics' letterbox (boxes moved by the integer pad), whatever trains
    recipe = opts.recipe if augment else "ultralytics"
    if cache == "disk" and opts.store == "auto":
        rule = "" if recipe == "yolov9" else f" --load-rule {recipe}"
        raise UnsupportedArgument(
            f"{OWNER}: cache='disk' reads fastload's packed disk store: make it once with `fastload convert "
            f"{data.get('yaml_file') or 'data.yaml'} --to disk --imgsz {imgsz}{rule} --out DIR` and pass "
            "fastload_store='DIR/data.yaml' (or FASTLOAD_STORE)")
    names = data.get("names") or {}
    names = [names[k] for k in sorted(names)] if isinstance(names, Mapping) else list(names)
    task = served_task(_arg(args, "task"))
    kpt_shape = data.get("kpt_shape")  # pose rows are read as boxes + keypoints whatever the task
    cfg = split_config(req.img_path, owner=OWNER, names=names, nc=int(data.get("nc") or len(names) or 1),
                       kpt_shape=kpt_shape, flip_idx=data.get("flip_idx") if kpt_shape else None)
    base = open_split_store(cfg, kind=cache or "auto", imgsz=imgsz, store=opts.store, owner=OWNER, load_rule=recipe)
    try:
        view = _labels_view(base, args, req.mode)
        batch_size = max(1, min(int(req.batch_size), len(view)))
        device = _device(opts, req)
        chosen = opts.loader_keywords(augment=augment, rect=req.rect, device=device)
        if chosen["partners"] is None and recipe == "ultralytics" and augment and not req.rect and float(args.mosaic) > 0:
            # Ultralytics' own rule: partners from its buffer of recently loaded images, from the dataset with cache="ram"
            chosen["partners"] = "dataset" if cache == "ram" else "recent"
        rank, world = shard_of(req.rank)
        # the trainer's copy_paste (segment only, refused above 0 for the other tasks), not YOLOv9's default (0.3)
        hyp = {k: float(getattr(args, k)) for k in AUGMENT_KEYS} | {"copy_paste": float(_arg(args, "copy_paste", 0) or 0)}
        fl = make_loader(
            view,
            imgsz=imgsz,
            batch_size=batch_size,
            hyp=hyp,
            augment=augment,
            workers=_workers(args, opts, req, len(view), batch_size),
            shuffle=augment and not req.rect,
            rect=req.rect,
            stride=int(req.stride),
            pad=(0.0 if augment else 0.5) if req.rect else None,  # Ultralytics pads rect batch shapes only
            seed=int(args.seed) if opts.seed is None else opts.seed,
            rank=rank,
            world_size=world,
            drop_last=augment and bool(_arg(args, "compile", False)),
            layout=_layout(args, req),
            recipe=recipe,
            **_task_keywords(task, args),
            **chosen,
        )
    except BaseException:
        base.close()
        raise
    summary = (f"fastload: {'' if task == 'detect' else task + ' '}{fl.n} images, {len(fl)} batches of {batch_size}, "
               f"{fl.num_workers} workers, {base.kind} store, {opts.engine} engine, HSV {_hsv_place(fl, augment)}, batches on "
               f"{device if device is not None else 'cpu'}, {recipe} recipe"
               + (f" (mosaic partners: {fl.engine.sampler.partners})" if fl.engine.sampler.draws_mosaics else "")
               + (f", {fl.cache_plan}" if fl.cache_plan.keep == "latest" else ""))
    LOG.info("%s %s loader: %s", OWNER, req.mode, summary)
    source: Any = BatchLog(fl, opts.batch_log, prefix=req.mode) if opts.batch_log else fl
    return UltralyticsLoader(fl, source, view, summary=summary, task=task, data=data,
                             overlap_mask=bool(_arg(args, "overlap_mask", True)))


def _task_keywords(task: str, args: Any) -> dict[str, Any]:
    """:func:`fastload.loader`'s task keywords: none for detection (its batches as they always were); a segment
    loader's masks at Ultralytics' ``mask_ratio``, overlapping (``overlap_mask``) or one per instance."""
    if task == "detect":
        return {}
    if task == "segment":
        return {"task": task, "mask_ratio": int(_arg(args, "mask_ratio", 4)),
                "overlap_mask": bool(_arg(args, "overlap_mask", True))}
    return {"task": task}


def _hsv_place(fl: FastLoader, augment: bool) -> str:
    """Where the loader applies HSV, for the summary: the engine's resolved ``hsv_on`` (the option given may be None)."""
    if not augment:
        return "off"
    return {"worker": "in the workers", "consumer": "on the consumer", "defer": "deferred"}[fl.engine.settings.hsv_on]


class UltralyticsLabels(Sequence[dict]):
    """``dataset.labels`` as Ultralytics reads it, one dict per image, made when read from the packed labels
    (``flat``, :class:`~fastload.data.labels.FlatLabels`) and the images' sizes: a million images cost no million
    dicts up front. ``labels[i]``: ``im_file``, ``shape`` (h, w), ``cls`` float32 [n, 1], ``bboxes`` float32
    [n, 4] normalised xywh (read-only views), ``segments`` (segment, obb: one float32 [k, 2] normalised polygon
    per instance), ``keypoints`` (pose: float32 [n, K, 3] normalised, else None), ``normalized``, ``bbox_format``.
    ``flat`` is public: the trainer counts classes and plots labels from its rows.
    """

    def __init__(self, flat: FlatLabels, hw: np.ndarray, im_files: Sequence[str], task: str = "detect",
                 kpt_shape: Sequence[int] | None = None) -> None:
        self.flat = flat
        self.hw = hw
        self.im_files = im_files
        self.task = task
        self.kpt_shape = None if kpt_shape is None else (int(kpt_shape[0]), int(kpt_shape[1]))

    def __len__(self) -> int:
        return len(self.flat)

    @overload
    def __getitem__(self, i: int) -> dict[str, Any]: ...

    @overload
    def __getitem__(self, i: slice) -> list[dict[str, Any]]: ...

    def __getitem__(self, i: int | slice) -> dict[str, Any] | list[dict[str, Any]]:
        if isinstance(i, slice):
            return [self[k] for k in range(*i.indices(len(self)))]
        rows, points, offsets = self.flat.image(i)  # checks the index
        h, w = (int(v) for v in self.hw[i])
        segments: list[np.ndarray] = []
        keypoints = None
        if points is not None and offsets is not None:
            if self.task == "pose" and self.kpt_shape is not None:  # (an image without rows: [0, K, 3])
                keypoints = points.reshape(len(rows), self.kpt_shape[0], points.shape[1])
            elif self.task in ("segment", "obb"):
                segments = [points[a:b] for a, b in zip(offsets[:-1].tolist(), offsets[1:].tolist())]
        return _label_dict(self.im_files[i], (h, w), rows[:, 0:1], rows[:, 1:5], segments, keypoints)

    def __iter__(self) -> Iterator[dict[str, Any]]:
        if self.flat.points is not None:
            return (self[k] for k in range(len(self)))
        # Ultralytics' trainer walks every image's dict (its max_det check): one pass over plain lists and the
        # packed columns, the dicts made one at a time
        return self._walk()

    def _walk(self) -> Iterator[dict[str, Any]]:
        rows, bounds = self.flat.rows, self.flat.offsets.tolist()
        cls, boxes = rows[:, 0:1], rows[:, 1:5]
        for f, a, b, hw in zip(self.im_files, bounds[:-1], bounds[1:], self.hw.tolist()):
            yield _label_dict(f, tuple(hw), cls[a:b], boxes[a:b])


def _label_dict(im_file: str, shape: tuple[int, int], cls: np.ndarray, boxes: np.ndarray,
                segments: list[np.ndarray] | None = None, keypoints: np.ndarray | None = None) -> dict[str, Any]:
    """One image's label dict as Ultralytics' dataset holds it (``cls`` [n, 1], ``boxes`` [n, 4] xywh)."""
    return {"im_file": im_file, "shape": shape, "cls": cls, "bboxes": boxes, "segments": segments or [],
            "keypoints": keypoints, "normalized": True, "bbox_format": "xywh"}


class UltralyticsDataset:
    """``loader.dataset`` as Ultralytics' trainer and validator read it.

    ``labels``: one dict per image (:class:`UltralyticsLabels`, made when read): its label plots, class counts
    and ``max_det`` check. ``im_files``, ``len()``, ``mosaic`` and ``close_mosaic(hyp)`` (what its
    ``close_mosaic`` epochs call) switch fastload's mosaic and mixup off. ``use_segments``, ``use_keypoints``,
    ``use_obb`` and ``data`` (``kpt_shape``, ``flip_idx``, ``names``) as Ultralytics' dataset has them. No
    ``__getitem__``: fastload renders whole batches.
    """

    def __init__(self, fl: FastLoader, view: StoreView, task: str = "detect",
                 data: Mapping[str, Any] | None = None) -> None:
        self._fl = fl
        ds = fl.dataset
        self.im_files = ds.im_files
        self.data = dict(data or {})
        self.labels = UltralyticsLabels(FlatLabels.from_arrays(ds.labels), ds.hw, ds.im_files, task,
                                        self.data.get("kpt_shape"))
        self.ni = len(self.im_files)
        self.imgsz = ds.img_size
        self.augment = ds.augment
        self.rect = ds.rect
        self.batch_shapes = ds.batch_shapes
        self.names = list(view.names)
        self.task = task
        self.use_segments, self.use_keypoints, self.use_obb = (task == "segment", task == "pose", task == "obb")

    def __len__(self) -> int:
        return self.ni

    @property
    def mosaic(self) -> bool:
        return self._fl.dataset.mosaic

    @mosaic.setter
    def mosaic(self, value: bool) -> None:
        self._fl.dataset.mosaic = value

    def close_mosaic(self, hyp: Any = None) -> None:
        """Mosaic and mixup off from the next batch on (Ultralytics' ``close_mosaic`` epochs); ``hyp`` is the
        trainer's argument copy, which Ultralytics' own dataset rebuilds its transforms from."""
        self._fl.close_mosaic()


class ImageSizes(Mapping[str, tuple[int, int]]):
    """The original (h, w) of an image by its path, for the batch dict's ``ori_shape``, without a dict of every
    path: a sorted array of the paths' hashes, each checked against the path it names."""

    def __init__(self, im_files: Sequence[str], hw: np.ndarray) -> None:
        self._im_files = im_files
        self._hw = hw
        hashes = np.fromiter((hash(f) for f in im_files), np.int64, len(im_files))
        self._order = np.argsort(hashes, kind="stable")
        self._hashes = hashes[self._order]

    def __getitem__(self, path: str) -> tuple[int, int]:
        h = hash(path)
        k = int(np.searchsorted(self._hashes, h))
        while k < len(self._hashes) and self._hashes[k] == h:  # equal hashes: the path that matches
            i = int(self._order[k])
            if self._im_files[i] == path:
                return int(self._hw[i, 0]), int(self._hw[i, 1])
            k += 1
        raise KeyError(path)

    def __len__(self) -> int:
        return len(self._im_files)

    def __iter__(self) -> Iterator[str]:
        return iter(self._im_files)


class UltralyticsLoader:
    """What Ultralytics' trainer and validator use of a loader, fed by a :class:`~fastload.fastloader.FastLoader`.

    Iterating yields Ultralytics' batch dict (:func:`to_batch_dict`); ``len()`` (batches per epoch),
    ``batch_size``, ``drop_last``, ``num_workers``, ``sampler`` (``len()``: this rank's images of the
    epoch; ``set_epoch(epoch)`` under DDP), ``dataset`` (:class:`UltralyticsDataset`), ``reset()`` and
    ``close()``.
    """

    def __init__(self, fl: FastLoader, source: Any, view: StoreView, *, summary: str = "", task: str = "detect",
                 data: Mapping[str, Any] | None = None, overlap_mask: bool = True) -> None:
        self.loader = fl
        self.summary = summary  # one line for the trainer's log
        self.task = task
        self.overlap_mask = overlap_mask  # segment: the masks' form (Ultralytics' overlap_mask)
        self._source = source  # fl, or fl seen through the batch log
        self._view = view
        self.dataset = UltralyticsDataset(fl, view, task, data)
        self.sampler = fl.sampler
        self.batch_size = fl.batch_size
        self.drop_last = fl.drop_last
        self._hw0 = ImageSizes(fl.dataset.im_files, fl.dataset.hw)

    @property
    def num_workers(self) -> int:
        return self.loader.num_workers

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self) -> Iterator[dict[str, Any]]:
        for batch in self._source:
            yield to_batch_dict(batch, self._hw0, self.task, self.overlap_mask)

    def reset(self) -> None:
        """Nothing to rebuild: a closed mosaic reaches fastload's workers with their next batch, and batches of
        the next epoch rendered ahead with mosaic are dropped, not delivered (Ultralytics restarts its workers)."""

    def close(self) -> None:
        """Stop the workers and release the store (a ram store's shared memory goes with its last user)."""
        self.loader.close()
        self._view.close()

    def stats(self) -> dict[str, Any]:
        """fastload's counters (:meth:`fastload.fastloader.FastLoader.stats`)."""
        return self.loader.stats()


def to_batch_dict(batch: Batch, hw0: Mapping[str, tuple[int, int]], task: str = "detect",
                  overlap_mask: bool = True) -> dict[str, Any]:
    """Ultralytics' batch dict from a fastload batch ``(imgs, targets, paths, shapes[, task's labels])``.

    ``img`` uint8 [B, 3, H, W] RGB; ``cls`` float32 [N, 1]; ``bboxes`` float32 [N, 4] normalised xywh;
    ``batch_idx`` float32 [N]; per image ``im_file``, ``ori_shape`` (h0, w0), ``resized_shape`` (H, W, what
    Ultralytics' last geometric step leaves: the batch's size) and ``ratio_pad`` (``((h / h0, w / w0),
    (left, top))``, the letterbox's integer pad; None for a mosaic sample, which Ultralytics gives none).
    ``hw0``: the original (h0, w0) of every image file. By ``task``, from the batch's fifth field:

    * ``segment``: ``masks`` as fastload built them at ``mask_ratio`` (``overlap_mask``: [B, h, w], instance
      ``k + 1`` of each image where it is the smallest covering one, the instances in decreasing mask area as the
      targets are; else [N, h, w] 0/1), and ``sem_masks`` float32 [B, h, w], the class of each pixel's smallest
      covering instance, as Ultralytics' ``Format`` derives it (what a semantic head's loss reads);
    * ``pose``: ``keypoints`` float32 [N, K, 3] (x, y normalised, visibility);
    * ``obb``: ``bboxes`` float32 [N, 5] normalised ``xywhr`` (angle in radians) instead of the upright box.
    """
    imgs, targets, paths, shapes = batch[:4]
    out_hw = (int(imgs.shape[2]), int(imgs.shape[3]))
    ratio_pad: list[Any] = []
    for entry in shapes:
        if entry is None:
            ratio_pad.append(None)
            continue
        (h0, w0), ((rh, rw), (dw, dh)) = entry
        # YOLOv9's entry holds the float pad; the pixels (and Ultralytics' ratio_pad) moved by round(pad - 0.1)
        ratio_pad.append(((float(rh), float(rw)), (int(round(dw - 0.1)), int(round(dh - 0.1)))))
    out = {
        "img": imgs,
        "cls": targets[:, 1:2].contiguous(),
        "bboxes": targets[:, 2:6].contiguous(),
        "batch_idx": targets[:, 0].contiguous(),
        "im_file": tuple(paths),
        "ori_shape": tuple(hw0[p] for p in paths),
        "resized_shape": tuple(out_hw for _ in paths),
        "ratio_pad": tuple(ratio_pad),
    }
    if task == "segment":
        masks = torch.as_tensor(batch[4])
        out["masks"] = masks
        out["sem_masks"] = semantic_masks(masks, out["cls"], out["batch_idx"], len(paths), overlap_mask)
    elif task == "pose":
        out["keypoints"] = torch.as_tensor(batch[4])
    elif task == "obb":
        out["bboxes"] = torch.as_tensor(batch[4])
    return out


def semantic_masks(masks: torch.Tensor, cls: torch.Tensor, batch_idx: torch.Tensor, batch_size: int,
                   overlap: bool) -> torch.Tensor:
    """float32 [B, h, w]: per pixel the class of its smallest covering instance, Ultralytics' ``sem_masks``.

    ``masks``: ``overlap`` masks [B, h, w] (instance ``k + 1``; ``cls`` in that order per image) or one mask per
    instance [N, h, w]. As Ultralytics' ``Format``: an overlap pixel no instance covers holds the image's last
    instance's class (its loss ignores uncovered pixels), a per-instance one 0; an image without instances 0.
    Masks on the CPU are mapped with numpy: torch's intra-op threads in a consumer whose cores the loader's workers
    keep busy waited ~100x the work for each lookup (benchmarks/task_loaders.py); elsewhere with torch on their device.
    """
    if masks.device.type == "cpu":
        return torch.from_numpy(_semantic_masks_host(masks.numpy(), cls.numpy().reshape(-1),
                                                     batch_idx.numpy().astype(np.intp), batch_size, overlap))
    return _semantic_masks_device(masks, cls, batch_idx, batch_size, overlap)


def _semantic_masks_host(masks: np.ndarray, cls: np.ndarray, owner: np.ndarray, batch_size: int,
                         overlap: bool) -> np.ndarray:
    """:func:`semantic_masks` of numpy arrays (``cls`` [N], ``owner`` each instance's image)."""
    out = np.zeros((batch_size, *masks.shape[-2:]), np.float32)
    for b in range(batch_size):
        mine = cls[owner == b]
        if not len(mine):
            continue
        if overlap:  # value v reads class v - 1; 0 (uncovered) the last one's, as an index of -1 would
            lut = np.concatenate([mine[-1:], mine]).astype(np.float32)
            if masks.dtype == np.uint8:  # one table lookup per pixel (cv2.LUT: 256 entries)
                cv2.LUT(masks[b], np.pad(lut, (0, 256 - len(lut))), dst=out[b])
            else:
                out[b] = lut[masks[b].astype(np.intp)]
            continue
        inst = masks[owner == b]
        areas = inst.sum(axis=(1, 2))
        key = np.where(inst.astype(bool), areas[:, None, None], areas.max() + 1)
        out[b] = mine[key.argmin(0)] * inst.any(0)  # argmin: the first of equal areas, as torch's min
    return out


def _semantic_masks_device(masks: torch.Tensor, cls: torch.Tensor, batch_idx: torch.Tensor, batch_size: int,
                           overlap: bool) -> torch.Tensor:
    """:func:`semantic_masks` with torch, on the masks' device."""
    out = torch.zeros((batch_size, *masks.shape[-2:]), dtype=torch.float32, device=masks.device)
    owner = batch_idx.to(masks.device).long()
    flat_cls = cls.to(masks.device).reshape(-1)
    for b in range(batch_size):
        mine = flat_cls[owner == b]
        if not len(mine):
            continue
        if overlap:
            out[b] = mine[masks[b].long() - 1]
            continue
        inst = masks[owner == b]
        areas = inst.sum(dim=(1, 2))
        key = torch.where(inst.bool(), areas[:, None, None], areas.max() + 1)
        out[b] = mine[key.min(0).indices] * inst.any(0)
    return out
