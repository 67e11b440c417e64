"""Runs the references' segment, pose and obb label code on fastload's records: the oracle of
tests/test_augment_geometry.py and benchmarks/geometry_cost.py.

* :func:`recording_draws`: fastload's sampler, with its mosaic centre, tile offsets and eight perspective draws
  kept per composed image (the draws the references must be given).
* YOLOv9: :func:`official_segment_modules` imports ``utils.segment`` from a copy of the official repository (GPL-3.0,
  ../shared/upstream/yolov9); :func:`official_segment_sample` calls its ``LoadImagesAndLabelsAndMasks.__getitem__``
  on a stand-in dataset (the labels, grey images of the loaded sizes) with the ``random`` of its modules answering
  fastload's draws, so its own load_mosaic, random_perspective, segment2box, box_candidates, polygons2masks(_overlap)
  and flips build the sample; its ``copy_paste`` (``utils/augmentations.py``) picks its ``random.sample`` by fastload's
  selection keys (the candidates of smallest key, in key order), and :func:`official_segment_pixels` gives its
  image for real loaded images.
* Ultralytics 8.4 (installed, AGPL-3.0): :func:`ultralytics_sample` runs its label preparation
  (``YOLODataset.update_labels_info``), ``Mosaic`` label steps, ``RandomPerspective.apply_instances`` with fastload's
  matrix and scale, ``MixUp``, ``RandomFlip``, ``LetterBox`` and ``Format``, and ``CopyPaste`` (flip mode) where the
  record has copy-paste, on a canvas of real pixels when given (:func:`ultralytics_canvas`).

Nothing here is copied from either: it calls them.
"""
from __future__ import annotations

import shutil
import sys
from contextlib import contextmanager
from pathlib import Path
from types import MethodType, SimpleNamespace
from typing import Any, Callable, Iterator, Sequence

import cv2
import numpy as np

from fastload.augment import params as params_module
from fastload.augment.hyp import load_hyp
from fastload.augment.params import ImageParams, ParamSampler, SampleParams, translation

Labels = Sequence[tuple[np.ndarray, np.ndarray, np.ndarray]]


# ----------------------------------------------------------------------------------------- fastload's draws
class _Recorder:
    """A generator stand-in that returns the real generator's values and keeps them."""

    def __init__(self, rng: np.random.Generator) -> None:
        self.rng, self.values = rng, []

    def uniform(self, *a):
        v = self.rng.uniform(*a)
        self.values.append(v)
        return v

    def random(self, *a):
        v = self.rng.random(*a)
        self.values.append(v)
        return v


@contextmanager
def recording_draws() -> Iterator[Callable[[ParamSampler, int, int], tuple[SampleParams, list[dict]]]]:
    """``sample(sampler, epoch, index) -> (record, draws)``: per composed image (main, then mixup) a dict with
    ``"u"`` (the eight perspective draws) and, for a mosaic, ``"centre"`` (its two draws) and ``"offsets"`` (each
    tile's canvas offset). The sampler's pieces are wrapped while the context is open."""
    log: list[dict] = []
    place, persp = params_module._mosaic4_placements, ParamSampler._perspective

    def spy_place(rng, s, hw):
        rec = _Recorder(rng)
        out = place(rec, s, hw)
        log.append({"centre": rec.values, "offsets": [o for crop, o in out if crop is not None]})
        return out

    def spy_persp(self, rng, canvas_hw, out_hw):
        rec = _Recorder(rng)
        out = persp(self, rec, canvas_hw, out_hw)
        if log and "u" not in log[-1]:
            log[-1]["u"] = rec.values[0].tolist()
        else:
            log.append({"u": rec.values[0].tolist()})
        return out

    def sample(sampler: ParamSampler, epoch: int, index: int) -> tuple[SampleParams, list[dict]]:
        log.clear()
        return sampler.sample(epoch, index), list(log)

    params_module._mosaic4_placements = spy_place
    ParamSampler._perspective = spy_persp  # type: ignore[method-assign]
    try:
        yield sample
    finally:
        params_module._mosaic4_placements = place
        ParamSampler._perspective = persp  # type: ignore[method-assign]


# ----------------------------------------------------------------------------------------- YOLOv9
class _Script:
    """A ``random`` module stand-in answering from queues (fastload's draws)."""

    def __init__(self, **queues: list) -> None:
        self.q = {k: list(v) for k, v in queues.items()}

    def random(self):
        return self.q["random"].pop(0)

    def uniform(self, a, b):
        if "u" in self.q:  # random_perspective's draws: the same expression as fastload's
            return a + (b - a) * self.q["u"].pop(0)
        return self.q["uniform"].pop(0)

    def choices(self, seq, k):
        return self.q["choices"].pop(0)

    def randint(self, a, b):
        return self.q["randint"].pop(0)

    def sample(self, population, k):  # copy_paste's pick: fastload's keys of the next copy-paste image
        keys = self.q["keys"].pop(0)
        return sorted(population, key=lambda j: keys[j])[:k]


@contextmanager
def official_segment_modules(upstream: Path, workdir: Path) -> Iterator[SimpleNamespace]:
    """``utils.segment.dataloaders`` (``dl``) and ``utils.segment.augmentations`` (``aug``) of a copy of the official
    repository's ``utils`` in ``workdir``, imported into this process and removed from ``sys.modules`` after."""
    root = workdir / "yolov9"
    shutil.copytree(upstream / "utils", root / "utils")
    before = set(sys.modules)
    # utils/general.py replaces cv2.imread / imwrite / imshow with its own (imwrite(path, im): no params) for the
    # whole process: the later tests of this pytest worker must get OpenCV's back
    opencv = {name: getattr(cv2, name) for name in ("imread", "imwrite", "imshow")}
    sys.path.insert(0, str(root))
    try:
        import utils.segment.augmentations as seg_aug  # official code: on sys.path above
        import utils.segment.dataloaders as seg_dl  # official code: on sys.path above
        for name, function in opencv.items():
            setattr(cv2, name, function)
        yield SimpleNamespace(dl=seg_dl, aug=seg_aug, general=sys.modules["utils.general"],
                              base_aug=sys.modules["utils.augmentations"])
    finally:
        for name, function in opencv.items():
            setattr(cv2, name, function)
        sys.path.remove(str(root))
        for name in set(sys.modules) - before:
            if name == "utils" or name.startswith(("utils.", "models")):
                del sys.modules[name]


def official_segment_sample(y9: SimpleNamespace, shapes: np.ndarray, labels: Labels, hyp: dict, rec: SampleParams,
                            draws: list[dict], *, imgsz: int, mask_ratio: int, overlap: bool, augment: bool
                            ) -> tuple[np.ndarray, np.ndarray]:
    """``(targets [n, 6], masks)`` of ``LoadImagesAndLabelsAndMasks.__getitem__`` for ``rec`` and its ``draws``."""
    return _official_getitem(y9, shapes, labels, hyp, rec, draws, imgsz=imgsz, mask_ratio=mask_ratio, overlap=overlap,
                             augment=augment)[1:]


def official_segment_pixels(y9: SimpleNamespace, get_image: Callable[[int], np.ndarray], labels: Labels, hyp: dict,
                            rec: SampleParams, draws: list[dict], *, imgsz: int) -> np.ndarray:
    """The HWC image of ``LoadImagesAndLabelsAndMasks.__getitem__`` for ``rec`` and its ``draws`` on the loaded images
    ``get_image(i)`` (channels as given; hyp without HSV and mixup: those draw from numpy's global generator)."""
    shapes = np.array([get_image(i).shape[:2] for i in range(len(labels))])
    img = _official_getitem(y9, shapes, labels, hyp, rec, draws, imgsz=imgsz, mask_ratio=4, overlap=False, augment=True,
                            get_image=get_image)[0]
    return np.ascontiguousarray(img.transpose(1, 2, 0)[..., ::-1])  # (its CHW conversion reverses the channels)


def _official_getitem(y9: SimpleNamespace, shapes: np.ndarray, labels: Labels, hyp: dict, rec: SampleParams,
                      draws: list[dict], *, imgsz: int, mask_ratio: int, overlap: bool, augment: bool,
                      get_image: Callable[[int], np.ndarray] | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    if get_image is None:
        def get_image(i: int) -> np.ndarray:
            return np.full((*shapes[i], 3), 114, np.uint8)
    ds = SimpleNamespace(
        indices=np.arange(len(shapes)), n=len(shapes), img_size=imgsz, mosaic_border=[-imgsz // 2, -imgsz // 2],
        hyp=load_hyp(hyp), mosaic=augment, augment=augment, rect=False,
        labels=[lab[0].copy() for lab in labels],
        segments=[[pts[a:b].copy() for a, b in zip(off[:-1], off[1:])] for _, pts, off in labels],
        im_files=[f"{i}.jpg" for i in range(len(shapes))], overlap=overlap, downsample_ratio=mask_ratio,
        albumentations=lambda im, lb: (im, lb),
        load_image=lambda i: (get_image(i).copy(), tuple(shapes[i]), tuple(shapes[i])),
    )
    ds.load_mosaic = MethodType(y9.dl.LoadImagesAndLabelsAndMasks.load_mosaic, ds)
    images = [rec.image] + ([rec.mixup] if rec.mixup is not None else [])
    queue: dict[str, list] = {"random": [0.0 if rec.mosaic else 1.0], "uniform": [], "choices": [], "randint": []}
    if rec.mosaic:
        queue["random"].append(0.0 if rec.mixup is not None else 1.0)
        for k, image in enumerate(images):
            queue["uniform"] += draws[k]["centre"]
            queue["choices"].append([t.src for t in image.tiles[1:]])
            if k:
                queue["randint"].append(image.tiles[0].src)
    queue["random"] += [0.0 if rec.flip_ud else 0.999, 0.0 if rec.flip_lr else 0.999]
    # copy_paste draws only for an image with instances
    keys = [image.copy_paste.keys for image in images if image.copy_paste is not None and image.copy_paste.keys]
    stdlib = y9.dl.random, y9.aug.random, y9.base_aug.random
    y9.dl.random, y9.aug.random = _Script(**queue), _Script(u=[v for entry in draws for v in entry["u"]])
    y9.base_aug.random = _Script(keys=keys)
    try:
        index = rec.image.tiles[0].src if rec.mosaic else rec.index
        img, targets, _, _, masks = y9.dl.LoadImagesAndLabelsAndMasks.__getitem__(ds, index)
    finally:
        y9.dl.random, y9.aug.random, y9.base_aug.random = stdlib
    return img.numpy(), targets.numpy(), masks.numpy()


# ----------------------------------------------------------------------------------------- Ultralytics
def ultralytics_modules() -> SimpleNamespace:
    from ultralytics.data import augment
    from ultralytics.data.dataset import YOLODataset

    return SimpleNamespace(aug=augment, YOLODataset=YOLODataset)


def ultralytics_label(u: SimpleNamespace, task: str, lab: tuple[np.ndarray, np.ndarray, np.ndarray],
                      hw: tuple[int, int]) -> dict:
    """One image's label dict as Ultralytics' dataset hands it to its transforms (segments resampled)."""
    rows, pts, off = lab
    polys = [pts[a:b] for a, b in zip(off[:-1].tolist(), off[1:].tolist())]
    fake = SimpleNamespace(use_obb=task == "obb", use_segments=task == "segment", format_class=u.aug.Format)
    label = {"img": np.full((*hw, 3), 114, np.uint8), "cls": rows[:, :1].copy(), "bboxes": rows[:, 1:5].copy(),
             "segments": [] if task == "pose" else [p.copy() for p in polys], "normalized": True, "bbox_format": "xywh",
             "keypoints": np.stack(polys).copy() if task == "pose" else None, "resized_shape": tuple(hw),
             "ori_shape": tuple(hw), "im_file": ""}
    return u.YOLODataset.update_labels_info(fake, label)


def ultralytics_canvas(image: ImageParams, get_image: Callable[[int], np.ndarray]) -> np.ndarray:
    """The canvas Ultralytics warps for ``image``: its mosaic (each tile's crop at its canvas offset on grey) or its
    loaded image; the record must have copy-paste (its tiles carry their offsets)."""
    assert image.copy_paste is not None, "the record has no copy-paste (its tiles carry no canvas offset)"
    canvas = np.full((*image.copy_paste.canvas_hw, 3), image.fill, np.uint8)
    for tile in image.tiles:
        (x0, y0, x1, y1), (ox, oy) = tile.crop, tile.offset
        canvas[y0 + oy:y1 + oy, x0 + ox:x1 + ox] = get_image(tile.src)[y0:y1, x0:x1]
    return canvas


def _ultralytics_image(u: SimpleNamespace, task: str, make_label: Callable[[int, tuple[int, int]], dict],
                       image: ImageParams, draws: dict, imgsz: int, canvas: np.ndarray | None = None) -> dict:
    """One composed image through Ultralytics' label steps with fastload's placement and matrix (and its CopyPaste
    where the record has copy-paste, on ``canvas`` when given: the pasted canvas comes back as ``"canvas"``)."""
    s = imgsz
    if "offsets" in draws:  # a mosaic
        ox, oy = draws["offsets"][0]
        m = image.tiles[0].matrix @ translation(-ox, -oy)
        patches = [u.aug.Mosaic._update_labels(make_label(tile.src, tile.src_hw), ox, oy, tile.src_hw)
                   for tile, (ox, oy) in zip(image.tiles, draws["offsets"])]
        out = u.aug.Mosaic(SimpleNamespace(cache="ram", use_obb=task == "obb"), imgsz=s)._cat_labels(patches)
        orig: tuple[int, int] = (2 * s, 2 * s)
    else:
        tile = image.tiles[0]
        m, out, orig = tile.matrix, make_label(tile.src, tile.src_hw), tile.src_hw  # type: ignore[assignment]
    out["img"] = np.full((*orig, 3), 114, np.uint8) if canvas is None else canvas.copy()
    if image.copy_paste is not None:
        out = u.aug.CopyPaste(p=image.copy_paste.fraction, mode="flip")(out)
    pasted = out["img"]
    rp = u.aug.RandomPerspective(preserve_obb=task == "obb")
    out = rp.apply_instances(out, {"M": m.astype(np.float32), "scale": image.candidate_scale, "orig_shape": orig,
                                   "size": (s, s)})
    out["img"] = np.full((s, s, 3), 114, np.uint8)
    out["canvas"] = pasted
    return out


def ultralytics_sample(u: SimpleNamespace, task: str, make_label: Callable[[int, tuple[int, int]], dict],
                       rec: SampleParams, draws: list[dict], *, imgsz: int, mask_ratio: int, overlap: bool,
                       augment: bool, flip_idx: Sequence[int] | None = None) -> dict[str, Any]:
    """Ultralytics' formatted sample (``Format``'s dict: cls, bboxes, masks / keypoints) for ``rec`` and its
    ``draws``; ``make_label(index, loaded_hw)``: the label dict of an image (:func:`ultralytics_label`)."""
    s = imgsz
    if augment:
        out = _ultralytics_image(u, task, make_label, rec.image, draws[0], s)
        if rec.mixup is not None:
            out["mix_labels"] = [_ultralytics_image(u, task, make_label, rec.mixup, draws[1], s)]
            out = u.aug.MixUp(SimpleNamespace(cache="ram")).apply_instances(out, {})
        for flag, direction in ((rec.flip_ud, "vertical"), (rec.flip_lr, "horizontal")):
            if flag:
                flip = u.aug.RandomFlip(1.0, direction, list(flip_idx) if flip_idx is not None else None)
                out = flip.apply_instances(out, {"flip": True, "h": s, "w": s, "direction": direction,
                                                 "flip_idx": flip.flip_idx})
    else:
        tile = rec.image.tiles[0]
        out = u.aug.LetterBox(new_shape=(s, s), scaleup=False)(make_label(tile.src, tile.src_hw))
    fmt = u.aug.Format(bbox_format="xywh", normalize=True, return_mask=task == "segment", return_keypoint=task == "pose",
                       return_obb=task == "obb", mask_ratio=mask_ratio, mask_overlap=overlap, batch_idx=True)
    return fmt.apply_instances(out, fmt.get_params(out))
