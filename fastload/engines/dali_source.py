"""The DALI engine's per-sample source: records -> the arrays its graph consumes (runs in DALI workers).

:class:`SampleSource` is the callback of a parallel, per-sample ``fn.external_source``. For sample
``i`` of DALI epoch ``k`` it reads the plan the engine wrote for that epoch (``plan_k.npz``: our
epoch number and the ordered loader indices), draws the record with the same
:class:`~fastload.augment.params.ParamSampler` as every other engine (with ``partners="batch"``
from the composition of the sample's batch, which the plan gives), moves the boxes with
:func:`fastload.augment.boxes.transform_labels` and emits the images and, per tile slot, the
numbers that place one:

* ``partners="dataset"``: every slot carries its own image (encoded bytes, or the loaded array for
  decoded stores), so the graph decodes every tile;
* ``partners="batch"``: the sample carries only its own image, decoded once; a slot carries the
  position in the batch of the sample whose image it draws, and the graph gathers it with
  ``fn.permute_batch`` (as DALI's own YOLO mosaic example builds its mosaics).

Damaged records: each record is the sampler's
:meth:`~fastload.augment.params.ParamSampler.first_usable` draw, whose every image this source could
fetch (LMDB bytes checked against their crc, header and JPEG end marker; disk/ram pixels against their
checksum on first read); the errors of the damaged records this worker met first go to the engine in
the ``damaged`` output (JSON of :meth:`~fastload.store.base.DamagedRecordError.fields`), which warns,
counts, or raises them (``strict``) in the consumer. With ``partners="batch"`` a sample whose own image
is damaged emits a placeholder as its own image: no usable record of the batch reads it. An encoded
image that passes those checks but that DALI's decoder rejects still fails the pipeline.

The graph (:mod:`fastload.engines.dali_graph`) has a fixed number of slots: unused ones carry
weight 0 (and, with ``"dataset"``, a tiny placeholder image).

Matrices are emitted in DALI's ``warp_affine`` convention (destination -> source, pixel centres at
``+0.5``): ``T(+0.5) @ inv(M) @ T(-0.5)`` of the OpenCV-convention matrix.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import cv2
import numpy as np

from fastload.augment.boxes import transform_labels
from fastload.augment.functional import tiles
from fastload.augment.functional.tiles import DrawMethod
from fastload.augment.params import ImageParams, ParamSampler, SampleParams, TileParams, shapes_to_array, translation
from fastload.store.base import DamagedRecords, Store

__all__ = ["SampleSource", "TileSlots", "write_plan", "HEAD", "PLACEMENT", "n_outputs"]

_HALF = translation(0.5, 0.5)
_MINUS_HALF = translation(-0.5, -0.5)
#: per sample, first: the record's numbers (``decodes``: dataset images this sample makes the graph decode;
#: ``attempt``: the record's replacement attempt, 0 for its own draw; ``damaged``: JSON bytes of the
#: damaged records' error fields this worker met first while drawing it)
HEAD = ("index", "boxes", "shapes", "out_hw", "fill", "ratio", "flip_lr", "flip_ud", "gain", "decodes", "attempt",
        "damaged")
#: per slot, after its image (``"dataset"``: image, loaded size) or its batch position (``"batch"``)
PLACEMENT = ("part_box", "crop_box", "part_m", "crop_m", "kind", "weight")


@dataclass(frozen=True)
class TileSlots:
    """How many tile slots the graph has for the main image and for the mixup partner."""

    main: int
    mixup: int

    @property
    def total(self) -> int:
        return self.main + self.mixup


def _placeholder_image(encoded: bool) -> np.ndarray:
    """An 8x8 grey image for unused slots: JPEG bytes (encoded stores) or an HWC array."""
    px = np.full((8, 8, 3), 114, np.uint8)
    if not encoded:
        return px
    ok, buf = cv2.imencode(".jpg", px)
    assert ok
    return np.frombuffer(buf.tobytes(), np.uint8)


def _dali_matrix(dst_to_src: np.ndarray) -> np.ndarray:
    """OpenCV-convention destination -> source 3x3 matrix as DALI's ``[2, 3]`` float32 (affine part)."""
    m = _HALF @ dst_to_src @ _MINUS_HALF
    return np.ascontiguousarray(m[:2], np.float32)


def write_plan(directory: str | os.PathLike, k: int, epoch: int, indices: np.ndarray, n: int, mosaic_closed: bool) -> None:
    """The plan of DALI epoch ``k``: our epoch number, the ordered loader indices padded to whole
    batches, how many of them are real (``n``; the rest repeat the last one) and the mosaic switch."""
    d = Path(directory)
    tmp = d / f"plan_{k}.tmp.npz"
    np.savez(tmp, indices=np.asarray(indices, np.int64), meta=np.frombuffer(
        json.dumps({"epoch": int(epoch), "n": int(n), "mosaic_closed": bool(mosaic_closed)}).encode(), np.uint8))
    os.replace(tmp, d / f"plan_{k}.npz")


def _tile_slot(tile: TileParams, out_hw: tuple[int, int], loaded_hw: tuple[int, int]) -> tuple[np.ndarray, ...] | None:
    """(part box, crop box, part matrix, crop matrix, kind) of one tile; None when it draws nothing.

    Boxes are int32 ``(y0, x0, h, w)`` in the loaded image. ``kind`` 0: an axis-aligned tile drawn
    like the reference's kernel (part sampled with clamped edges, written on the output pixels
    whose nearest source pixel lies in the crop): its scaled warp (the part is the crop, the
    exact matrix) or its exact-scale resize (the rounded source span); 1: a warped tile
    (BORDER_TRANSPARENT: the coverage of the crop weights the blend with what is already there).
    """
    m = tile.matrix
    x0, y0, x1, y1 = tile.crop
    crop_box = np.array([y0, x0, y1 - y0, x1 - x0], np.int32)
    crop_inv = np.linalg.inv(m @ translation(x0, y0))  # output px -> crop px
    plan = tiles.tile_plan(tile, loaded_hw, out_hw, tiles.check_axis_kernel(None))
    if plan.method is DrawMethod.SKIP:
        return None  # no output pixel samples inside the crop: the reference draws nothing
    if plan.method is DrawMethod.WARP:
        return crop_box, crop_box, _dali_matrix(crop_inv), _dali_matrix(crop_inv), np.array([1.0], np.float32)
    if plan.method is DrawMethod.SCALED_WARP:
        return crop_box, crop_box, _dali_matrix(crop_inv), _dali_matrix(crop_inv), np.array([0.0], np.float32)
    xs, ys = plan.xs, plan.ys
    a, b = float(m[0, 0]), float(m[1, 1])
    px0, py0 = max(xs.s0, 0), max(ys.s0, 0)
    part_box = np.array([py0, px0, max(ys.s1 - py0, 1), max(xs.s1 - px0, 1)], np.int32)
    # output X (resized-part index j = X - d0 + j0) samples source s0 + (j + 0.5) / a - 0.5
    inv = np.eye(3)
    inv[0, 0], inv[1, 1] = 1.0 / a, 1.0 / b
    inv[0, 2] = xs.s0 - px0 + (xs.j0 - xs.d0 + 0.5) / a - 0.5
    inv[1, 2] = ys.s0 - py0 + (ys.j0 - ys.d0 + 0.5) / b - 0.5
    return part_box, crop_box, _dali_matrix(inv), _dali_matrix(crop_inv), np.array([0.0], np.float32)


class SampleSource:
    """Picklable per-sample callback for ``fn.external_source(parallel=True, batch=False)``.

    Args:
        store: the loader's store view (re-opens its handles lazily in each worker).
        sampler: the parameter sampler (a copy lives in every worker; the plan carries mosaic state).
        plan_dir: where the engine writes ``plan_<k>.npz`` before DALI epoch ``k``.
        slots: tile slots of the graph.
        imgsz: loaded long side.
        encoded: emit encoded bytes (decoded by DALI) instead of loaded arrays.
        batch_size: samples per DALI batch (a batch's composition decides ``partners="batch"`` records).
    """

    def __init__(self, store: Store, sampler: ParamSampler, plan_dir: str, slots: TileSlots, imgsz: int, encoded: bool,
                 batch_size: int) -> None:
        self.store = store
        self.sampler = sampler
        self.plan_dir = str(plan_dir)
        self.slots = slots
        self.imgsz = int(imgsz)
        self.encoded = bool(encoded)
        self.batch_size = int(batch_size)
        self.by_batch = sampler.partners == "batch"
        self._plan: tuple[int, int, int, np.ndarray] | None = None  # (dali epoch, our epoch, real count, indices)
        self._positions: tuple[tuple[int, int], dict[int, int]] | None = None  # ((dali epoch, batch), index -> position)
        self._placeholder: np.ndarray | None = None
        self.damaged = DamagedRecords(strict=False)  # the engine raises in the consumer under strict

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["damaged"] = DamagedRecords(strict=False)  # each worker process remembers its own
        return state

    def _epoch_plan(self, k: int) -> tuple[int, int, np.ndarray]:
        if self._plan is None or self._plan[0] != k:
            with np.load(Path(self.plan_dir) / f"plan_{k}.npz", allow_pickle=False) as z:
                meta = json.loads(bytes(z["meta"]).decode())
                indices = z["indices"].astype(np.int64)
            if meta["mosaic_closed"]:  # this worker's sampler copy follows the engine's (idempotent)
                self.sampler.close_mosaic()
            self._plan = (k, int(meta["epoch"]), int(meta["n"]), indices)
        return self._plan[1], self._plan[2], self._plan[3]

    def _image(self, i: int) -> np.ndarray:
        """Loader index ``i`` as the graph takes it (checked encoded bytes, or the loaded array); raises
        :class:`~fastload.store.base.DamagedRecordError` for a damaged record."""
        if self.encoded:
            return np.frombuffer(self.store.read_encoded(i), np.uint8)
        return np.ascontiguousarray(self.store.load(i, self.imgsz, rule=self.sampler.load_rule))

    def _usable(self, images: dict[int, np.ndarray]) -> Callable[[SampleParams], bool]:
        return lambda record: self.damaged.load_all(record.sources, images, self._image)

    def _slots(self, image: ImageParams | None, n: int, positions: dict[int, int] | None, own: int,
               images: dict[int, np.ndarray]) -> tuple[list[np.ndarray], int]:
        """The slots of one composed image (per drawn tile its image or batch position, and its
        placement) and how many of them draw a tile."""
        out: list[np.ndarray] = []
        tiles = image.tiles if image is not None else ()
        if len(tiles) > n:
            raise ValueError(f"a record has {len(tiles)} tiles but the DALI graph was built with {n} slots")
        loaded = self.sampler.loaded_shapes
        used = 0
        for tile in tiles:
            hw = (int(loaded[tile.src][0]), int(loaded[tile.src][1]))
            slot = _tile_slot(tile, image.out_hw, hw)  # type: ignore[union-attr]
            if slot is None:
                continue
            if positions is not None:
                out.append(np.array(positions[tile.src], np.int32))
            else:
                out += [images[tile.src], np.array(hw, np.float32)]
            out += list(slot) + [np.array([1.0], np.float32)]
            used += 1
        box = np.array([0, 0, 8, 8], np.int32)
        eye = _dali_matrix(np.eye(3))
        for _ in range(n - used):
            if positions is not None:  # any valid position: the weight is 0
                out.append(np.array(own, np.int32))
            else:
                if self._placeholder is None:
                    self._placeholder = _placeholder_image(self.encoded)
                out += [self._placeholder, np.array([8.0, 8.0], np.float32)]
            out += [box, box, eye, eye, np.array([0.0], np.float32), np.array([0.0], np.float32)]
        return out, used

    def record_arrays(self, rec: SampleParams, images: dict[int, np.ndarray], positions: dict[int, int] | None = None,
                      own: int = 0, own_index: int = 0) -> list[np.ndarray]:
        """Everything the graph needs for one record, in output order (see :func:`n_outputs`).

        ``images``: what :meth:`_image` gave for the record's sources (and, with ``partners="batch"``, for
        this sample's own image when it is not damaged). ``positions`` (``partners="batch"``): batch
        position of every loader index of the batch; ``own``: this sample's position; ``own_index``: its
        loader index, whose image it emits for the batch to gather.
        """
        oh, ow = rec.image.out_hw
        main, used = self._slots(rec.image, self.slots.main, positions, own, images)
        mixup, used_mixup = self._slots(rec.mixup, self.slots.mixup, positions, own, images)
        if positions is not None:  # the graph decodes this sample's own image, once
            decodes = int(self.encoded)
            if own_index in images:
                own_image = [images[own_index], np.array(self.sampler.loaded_shapes[own_index], np.float32)]
            else:  # damaged: no usable record of the batch reads it
                if self._placeholder is None:
                    self._placeholder = _placeholder_image(self.encoded)
                own_image = [self._placeholder, np.array([8.0, 8.0], np.float32)]
        else:  # the graph decodes the image of every slot that draws a tile
            decodes = (used + used_mixup) if self.encoded else 0
            own_image = []
        head = [
            np.array([rec.index], np.int64),
            np.ascontiguousarray(transform_labels(rec, self.store.labels), np.float32).reshape(-1, 5),
            shapes_to_array(rec.shapes),
            np.array([float(oh), float(ow)], np.float32),
            np.array([float(rec.image.fill)], np.float32),
            np.array([rec.mixup_ratio if rec.mixup is not None else 1.0], np.float32),
            np.array([int(rec.flip_lr)], np.int32),
            np.array([int(rec.flip_ud)], np.int32),
            np.array(rec.hsv_gain, np.float32),
            np.array([decodes], np.int32),
            np.array([rec.attempt], np.int32),
            np.frombuffer(json.dumps(self.damaged.take_found()).encode(), np.uint8),
        ]
        return head + own_image + main + mixup

    def _batch_positions(self, k: int, b: int, batch: np.ndarray) -> dict[int, int]:
        """Loader index -> its first position in batch ``b`` of DALI epoch ``k`` (kept for the next sample)."""
        if self._positions is None or self._positions[0] != (k, b):
            pos: dict[int, int] = {}
            for p, i in enumerate(batch.tolist()):
                pos.setdefault(int(i), p)
            self._positions = ((k, b), pos)
        return self._positions[1]

    def __call__(self, info: Any) -> list[np.ndarray]:
        k = int(info.epoch_idx)
        epoch, n, indices = self._epoch_plan(k)
        j = int(info.idx_in_epoch)
        if j >= len(indices):
            raise StopIteration
        index = int(indices[j])
        images: dict[int, np.ndarray] = {}
        if not self.by_batch:
            return self.record_arrays(self.sampler.first_usable(epoch, index, self._usable(images)), images)
        b = j // self.batch_size
        start = b * self.batch_size
        batch = indices[start : start + self.batch_size]
        real = indices[start : min(start + self.batch_size, n)]  # the padding repeats an index: not a partner
        self.damaged.load_into(index, images, self._image)  # emitted for the batch to gather, unless damaged
        rec = self.sampler.first_usable(epoch, index, self._usable(images), real)
        return self.record_arrays(rec, images, self._batch_positions(k, b, batch), j - start, index)


def n_outputs(slots: TileSlots, by_batch: bool) -> int:
    """Number of arrays the source emits per sample: ``HEAD``, then with ``partners="batch"`` the
    sample's image and loaded size, then per slot its image and loaded size (``"dataset"``) or its
    batch position (``"batch"``) followed by ``PLACEMENT``."""
    per_slot = (1 if by_batch else 2) + len(PLACEMENT)
    return len(HEAD) + (2 if by_batch else 0) + per_slot * slots.total
