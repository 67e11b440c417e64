"""Augmentation parameter records and the one place where they are sampled.

A :class:`SampleParams` record says everything an engine needs to draw one output sample:
which loaded images go where (:class:`TileParams`: a crop and a matrix), the optional mixup
image, the HSV gains and the flips.  :class:`ParamSampler` draws records with YOLOv9's distributions
(``LoadImagesAndLabels.__getitem__``, ``load_mosaic``, ``load_mosaic9``, ``random_perspective``,
``mixup``, ``augment_hsv``, ``letterbox``), or Ultralytics' (the second :data:`Recipe`), from a generator seeded by
``SeedSequence([seed, epoch, index])`` only, so a record is a pure function of those three numbers
(with ``partners="batch"``: and of the batch the index belongs to, itself a pure function of the
seed, the epoch, the rank, the world size and the batch size; with ``partners="recent"``: and of the epoch
order, a function of the same numbers) and every engine (CPU workers, torch,
DALI) draws the same sample for the same index.

Coordinates: "loaded" pixels are those of the image resized to ``imgsz`` on its long side
(:func:`fastload.data.images.loaded_shape`); matrices are float64 3x3 in the OpenCV warpAffine
convention (integer coordinates are pixel centres; source -> destination).
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Callable, Literal, Mapping, NamedTuple, Sequence, get_args

import numpy as np

from fastload.augment.hyp import load_hyp
from fastload.data.images import LoadRule

__all__ = [
    "Partners",
    "PARTNERS",
    "recent_window",
    "Recipe",
    "RECIPES",
    "Rect",
    "TileParams",
    "CopyPaste",
    "ImageParams",
    "SampleParams",
    "ParamSampler",
    "make_rng",
    "rect_batch_shapes",
    "per_index_shapes",
    "translation",
    "shapes_to_array",
    "shapes_from_array",
    "visit_ids",
    "image_of",
    "MAX_REPLACEMENTS",
    "Letterbox",
    "letterbox_fit",
]

#: How many replacement draws :meth:`ParamSampler.first_usable` makes for one sample before giving up
#: (each is uniform over the dataset, or the batch: only a mostly damaged dataset or batch gets there).
MAX_REPLACEMENTS = 64
# A spawn key keeps the replacement draws apart from the sample streams (SeedSequence([seed, epoch,
# index])) and from the epoch order (fastload.order's own key).
_REPLACEMENT_STREAM = (0x7265706C61,)  # "repla"
# Copy-paste selection keys come from a stream of their own too, so switching copy-paste on moves no other draw.
_PASTE_STREAM = (0x7061737465,)  # "paste"

#: Where a mosaic's partners (and the mixup image with its partners) are drawn from:
#: ``"dataset"``: uniformly from the whole dataset (YOLOv9's ``random.choices(self.indices, k=3)``);
#: ``"batch"``: uniformly from the images of the sample's own batch, so that a batch reads only its
#: own ``B`` source images (one decode each) instead of about ``4.6 B``;
#: ``"recent"``: uniformly from the images of the last ``window`` positions of the rank's epoch order up to
#: the sample's own (its own image included; at an epoch's start the previous epoch's last ones): Ultralytics'
#: buffer of recently loaded images (without ``cache="ram"``) as a pure function of the seed and the epoch
#: order, where Ultralytics' depends on which worker loaded what. The mixup image itself stays uniform
#: over the dataset, as Ultralytics draws it.
Partners = Literal["dataset", "batch", "recent"]
PARTNERS: tuple[str, ...] = get_args(Partners)


def recent_window(n: int, batch_size: int) -> int:
    """The ``partners="recent"`` window of Ultralytics 8.4: its buffer keeps ``min(n, 8 * batch, 1000)``
    images less the one it drops when that length is reached, so a sample draws from at most that many
    minus one recently loaded images (its own included)."""
    return max(1, min(int(n), 8 * int(batch_size), 1000) - 1)

#: Whose augmentation distributions :class:`ParamSampler` draws (both with the hyp dict's values):
#: ``"yolov9"``: YOLOv9's ``LoadImagesAndLabels`` (the sample's own image shuffled among its mosaic
#: partners, mixup only of two mosaics, a non-mosaic sample letterboxed before its random perspective,
#: multiplicative hue); ``"ultralytics"``: Ultralytics 8.4's ``v8_transforms`` (its own image always the
#: top-left tile, mixup of any sample with a partner that is a mosaic with the mosaic probability, a
#: non-mosaic sample's loaded image warped about its centre straight into the output, additive hue with
#: saturation 0 kept at 0: :attr:`SampleParams.hsv_rule`).
Recipe = Literal["yolov9", "ultralytics"]
RECIPES: tuple[str, ...] = get_args(Recipe)


class Rect(NamedTuple):
    """A half-open pixel rectangle ``[x0, x1) x [y0, y1)``: the one rectangle convention of the
    augmentation code (crops, the output rectangle a tile owns, the box of drawn pixels)."""

    x0: int
    y0: int
    x1: int
    y1: int


def make_rng(seed: int, epoch: int, index: int) -> np.random.Generator:
    """The generator of one sample: ``Generator(PCG64(SeedSequence([seed, epoch, index])))``."""
    return np.random.Generator(np.random.PCG64(np.random.SeedSequence([int(seed), int(epoch), int(index)])))


_IDENTITY = np.eye(3)


def translation(tx: float, ty: float) -> np.ndarray:
    """3x3 float64 translation matrix."""
    m = _IDENTITY.copy()  # half the cost of np.eye, called some twenty times per segment sample
    m[0, 2] = tx
    m[1, 2] = ty
    return m


@dataclass(frozen=True, eq=False)
class TileParams:
    """One loaded image drawn into the output.

    Attributes:
        src: dataset index of the loaded image.
        crop: the visible part of the loaded image, in its pixels.
        matrix: float64 [3, 3], loaded-image pixel -> output pixel (warpAffine convention; the
            last row is ``(0, 0, 1)`` unless the sample uses perspective). Read-only.
        src_hw: ``(h, w)`` of the loaded image (boxes are normalised to it); set by the sampler.
        box_matrix: the matrix boxes move with when it is not ``matrix`` (same convention), else None.
            Validation letterboxes: YOLOv9 moves the pixels by the rounded pad ``round(dw - 0.1)`` but
            the boxes by the float pad ``dw`` (and its ``shapes`` entry, which val.py maps predictions
            back with, holds ``dw``), so validation targets follow the boxes' rule to stay the official ones.
        offset: ``(ox, oy)``, where the loaded image's pixel ``(0, 0)`` sits on the reference's canvas (the mosaic
            canvas; ``(0, 0)`` for an image that is its own canvas): ``matrix`` is the canvas's warp times this
            translation. Set by the sampler only for images with copy-paste (:class:`CopyPaste`), else None.
    """

    src: int
    crop: Rect
    matrix: np.ndarray
    src_hw: tuple[int, int] | None = None
    box_matrix: np.ndarray | None = None
    offset: tuple[int, int] | None = None

    def __post_init__(self) -> None:
        m = np.array(self.matrix, dtype=np.float64).reshape(3, 3)
        m.setflags(write=False)
        object.__setattr__(self, "matrix", m)
        if self.box_matrix is not None:
            b = np.array(self.box_matrix, dtype=np.float64).reshape(3, 3)
            b.setflags(write=False)
            object.__setattr__(self, "box_matrix", b)
        object.__setattr__(self, "src", int(self.src))
        object.__setattr__(self, "crop", Rect(*(int(v) for v in self.crop)))
        if self.src_hw is not None:
            object.__setattr__(self, "src_hw", (int(self.src_hw[0]), int(self.src_hw[1])))
        if self.offset is not None:
            object.__setattr__(self, "offset", (int(self.offset[0]), int(self.offset[1])))

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, TileParams):
            return NotImplemented
        return (
            self.src == other.src
            and self.crop == other.crop
            and self.src_hw == other.src_hw
            and self.offset == other.offset
            and np.array_equal(self.matrix, other.matrix)
            and (self.box_matrix is None) == (other.box_matrix is None)
            and (self.box_matrix is None or np.array_equal(self.box_matrix, other.box_matrix))
        )

    def __hash__(self) -> int:
        return hash((self.src, self.crop, self.src_hw, self.offset, self.matrix.tobytes()))

    @property
    def is_affine(self) -> bool:
        """True when the matrix has no perspective part."""
        return bool(self.matrix[2, 0] == 0.0 and self.matrix[2, 1] == 0.0 and self.matrix[2, 2] == 1.0)

    @property
    def is_axis_aligned(self) -> bool:
        """True for scale + translation only (no rotation, shear or perspective)."""
        return self.is_affine and self.matrix[0, 1] == 0.0 and self.matrix[1, 0] == 0.0


@dataclass(frozen=True)
class CopyPaste:
    """Copy-paste of one composed image (the segment task; hyp ``copy_paste``), done on the reference's canvas
    before its random perspective: instances are mirrored left-right across the canvas and pasted, with their
    pixels, where their mirrored box overlaps every original box by an intersection over that box's area below 0.3
    (:func:`fastload.augment.geometry.paste_selection`). Its tiles carry their canvas offsets (``TileParams.offset``).

    Attributes:
        recipe: whose copy-paste (the sampler's recipe: which candidates, and how the pixel mask is filled).
        fraction: the fraction ``p`` of those candidates pasted: ``round(p * candidates)`` of them.
        canvas_hw: the canvas ``(h, w)`` (YOLOv9's and Ultralytics' mosaic: ``2 imgsz`` square; Ultralytics' sample
            without mosaic: its loaded image); instances mirror across ``x -> w - x``, pixels ``x -> w - 1 - x``.
        keys: ``"yolov9"``: one uniform key per label row of the image's tiles (tile order, then row order); the
            candidates with the smallest keys are pasted, smallest first (a uniform subset in a uniform order:
            YOLOv9's ``random.sample``). ``"ultralytics"``: None (it pastes the candidates of least overlap first,
            no random draw).
    """

    fraction: float
    canvas_hw: tuple[int, int]
    recipe: Recipe
    keys: tuple[float, ...] | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "fraction", float(self.fraction))
        object.__setattr__(self, "canvas_hw", (int(self.canvas_hw[0]), int(self.canvas_hw[1])))
        if self.keys is not None:
            object.__setattr__(self, "keys", tuple(float(k) for k in self.keys))


@dataclass(frozen=True)
class ImageParams:
    """One composed image (the main image of a sample, or its mixup partner).

    Attributes:
        tiles: drawn in order (a later tile covers an earlier one where they overlap).
        out_hw: output ``(h, w)``.
        fill: value of output pixels no tile covers (YOLOv9: 114).
        candidate_scale: the linear factor YOLOv9's ``box_candidates`` applies to a box before the
            random perspective (its scale draw times the letterbox ratio): a box is kept when its
            transformed area exceeds 10 % of (loaded-pixel area * candidate_scale**2). ``None``:
            no candidate filter (no random perspective ran, i.e. validation).
        copy_paste: the image's copy-paste (:class:`CopyPaste`), None without (always None unless the sampler
            was built with ``copy_paste``).
    """

    tiles: tuple[TileParams, ...]
    out_hw: tuple[int, int]
    fill: int = 114
    candidate_scale: float | None = None
    copy_paste: CopyPaste | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "tiles", tuple(self.tiles))
        object.__setattr__(self, "out_hw", (int(self.out_hw[0]), int(self.out_hw[1])))


@dataclass(frozen=True)
class SampleParams:
    """Everything needed to draw output sample ``index`` of ``epoch``.

    Attributes:
        index: dataset index of the sample (its labels' owner in validation/letterbox mode).
        epoch: epoch the record was drawn for.
        image: the main composed image.
        mixup: the mixup partner (YOLOv9: a second mosaic; Ultralytics: a mosaic or a centred warp) or None.
        mixup_ratio: weight of ``image`` in ``image * r + mixup * (1 - r)`` (YOLOv9: Beta(32, 32)).
        hsv_gain: ``(gh, gs, gv)`` gains of OpenCV's 8-bit H, S, V (1 = unchanged); ``hsv_rule`` says
            how the hue gain applies.
        hsv_rule: the recipe whose HSV tables the gains go through: ``"yolov9"`` (``H * gh``) or
            ``"ultralytics"`` (``H + 180 (gh - 1)``, saturation 0 stays 0): see
            :func:`fastload.augment.functional.color.hsv_luts`.
        flip_ud / flip_lr: flips, applied last.
        mosaic: whether ``image`` is a mosaic.
        shapes: YOLOv9's shapes entry: None for mosaic samples, else
            ``((h0, w0), ((h / h0, w / w0), (padw, padh)))`` (pad 0 for the ``"ultralytics"`` recipe's
            non-mosaic training samples, which no letterbox places).
        attempt: 0 for the sample's own draw; ``k`` for its ``k``-th replacement draw
            (:meth:`ParamSampler.replacement`: an image an earlier draw read was damaged).
    """

    index: int
    epoch: int
    image: ImageParams
    mixup: ImageParams | None = None
    mixup_ratio: float = 1.0
    hsv_gain: tuple[float, float, float] = (1.0, 1.0, 1.0)
    hsv_rule: Recipe = "yolov9"
    flip_ud: bool = False
    flip_lr: bool = False
    mosaic: bool = False
    shapes: Any = None
    attempt: int = 0

    @property
    def out_hw(self) -> tuple[int, int]:
        """Output ``(h, w)`` of the sample."""
        return self.image.out_hw

    @property
    def sources(self) -> tuple[int, ...]:
        """Every loaded-image index the sample reads (main tiles first, then mixup tiles)."""
        tiles = self.image.tiles + (self.mixup.tiles if self.mixup is not None else ())
        return tuple(t.src for t in tiles)


def shapes_to_array(shapes: Any) -> np.ndarray:
    """A YOLOv9 ``shapes`` entry as ``float64 [6]`` ``(h0, w0, h / h0, w / w0, padw, padh)``, all NaN
    for ``None`` (a mosaic sample): how the entry crosses a process boundary (CPU workers, DALI)."""
    if shapes is None:
        return np.full(6, np.nan)
    (h0, w0), ((rh, rw), (pw, ph)) = shapes
    return np.array([h0, w0, rh, rw, pw, ph], np.float64)


def shapes_from_array(a: np.ndarray) -> Any:
    """The YOLOv9 ``shapes`` entry back from :func:`shapes_to_array`'s six floats."""
    a = np.asarray(a, np.float64).reshape(6)
    if math.isnan(a[0]):
        return None
    return ((int(a[0]), int(a[1])), ((float(a[2]), float(a[3])), (float(a[4]), float(a[5]))))


# ----------------------------------------------------------------------------------------- rect shapes
def rect_batch_shapes(
    shapes: np.ndarray, batch_size: int, imgsz: int, stride: int = 32, pad: float = 0.5
) -> tuple[np.ndarray, np.ndarray]:
    """YOLOv9's rectangular-batch plan.

    Args:
        shapes: int [N, 2] original ``(h, w)``.
    Returns:
        ``(order, batch_shapes)``: dataset indices sorted by aspect ratio h/w (batch ``k`` holds
        ``order[k*batch_size:(k+1)*batch_size]``) and int64 [nb, 2] ``(h, w)`` per batch,
        ``ceil(imgsz * r / stride + pad) * stride`` with r from the batch's min/max aspect.
    """
    shapes = np.asarray(shapes, dtype=np.float64).reshape(-1, 2)
    if len(shapes) == 0:
        return np.zeros(0, np.int64), np.zeros((0, 2), np.int64)
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    ar = shapes[:, 0] / shapes[:, 1]
    order = ar.argsort()  # same (default) sort as YOLOv9, so ties land in the same order
    ar = ar[order]
    nb = (len(ar) + batch_size - 1) // batch_size
    ratios = np.ones((nb, 2))
    for b in range(nb):
        chunk = ar[b * batch_size : (b + 1) * batch_size]
        lo, hi = chunk.min(), chunk.max()
        if hi < 1:  # all landscape: full width, height hi
            ratios[b] = (hi, 1.0)
        elif lo > 1:  # all portrait: full height, width 1/lo
            ratios[b] = (1.0, 1.0 / lo)
    batch_shapes = (np.ceil(ratios * imgsz / stride + pad).astype(np.int64)) * stride
    return order.astype(np.int64), batch_shapes


def per_index_shapes(order: np.ndarray, batch_shapes: np.ndarray, batch_size: int) -> np.ndarray:
    """int64 [N, 2]: the rect batch shape of every dataset index (``rect_shapes`` of the sampler)."""
    out = np.zeros((len(order), 2), np.int64)
    out[np.asarray(order)] = np.asarray(batch_shapes)[np.arange(len(order)) // batch_size]
    return out


# ----------------------------------------------------------------------------------------- sample ids
def visit_ids(images: np.ndarray, n: int) -> np.ndarray:
    """Sample ids for an ordered list of image indices that may repeat: ``k * n + i`` for the
    ``(k + 1)``-th visit of image ``i`` (``int64``, same length and order).

    YOLOv9's ``--image-weights`` draws an epoch's images with replacement. The first visit of an image
    keeps its index as id (a list without repeats comes back unchanged); :meth:`ParamSampler.sample`
    seeds its draws with the id, so every repeat gets its own augmentation, and the ids depend only on
    the list, not on which process renders it.
    """
    images = np.asarray(images, np.int64).reshape(-1)
    if len(images) and (images.min() < 0 or images.max() >= n):
        raise ValueError(f"image indices must be in [0, {n}), got {int(images.min())}..{int(images.max())}")
    by_image = np.argsort(images, kind="stable")
    ranked = images[by_image]
    starts = np.r_[0, np.flatnonzero(np.diff(ranked)) + 1] if len(images) else np.zeros(0, np.int64)
    run_start = np.repeat(starts, np.diff(np.r_[starts, len(images)]))
    visit = np.empty(len(images), np.int64)
    visit[by_image] = np.arange(len(images)) - run_start
    return visit * n + images


def image_of(ids: np.ndarray, n: int) -> np.ndarray:
    """The image index of each sample id from :func:`visit_ids` (an id below ``n`` is the image)."""
    return np.asarray(ids, np.int64) % n


# ----------------------------------------------------------------------------------------- sampler
class ParamSampler:
    """Draws :class:`SampleParams` with YOLOv9's augmentation distributions.

    Args:
        loaded_shapes: int [N, 2] ``(h, w)`` of every image after the long-side resize to ``imgsz``.
        hyp: hyp dict / yaml / None (see :func:`fastload.augment.hyp.load_hyp`).
        imgsz: training image size ``s`` (mosaic output is ``s x s``).
        augment: False for validation (letterbox only, no random draws used).
        seed: base seed; records depend on ``(seed, epoch, index)`` only.
        rect_shapes: int [N, 2] per-index batch shape ``(h, w)`` (rect mode: letterbox into it;
            mosaic is off as in YOLOv9). See :func:`rect_batch_shapes` / :func:`per_index_shapes`.
        mosaic9: use YOLOv9's 9-tile mosaic instead of the 4-tile one.
        orig_shapes: int [N, 2] original ``(h0, w0)`` for the ``shapes`` entry (default: loaded).
        partners: where mosaic partners and the mixup image come from (:data:`Partners`):
            ``"dataset"`` (YOLOv9: uniform over all ``N`` images, with replacement, the sample's
            own image included) or ``"batch"`` (uniform over the ``B`` images of the sample's batch,
            with replacement, its own image included). Each image's expected number of uses per
            epoch is the same either way (a batch is a uniform sample of the dataset); what changes
            is which images share a batch: its tiles come from its ``B`` images only. Letterbox
            samples (validation, rect, closed mosaic) draw no partners and are the same either way.
            ``"recent"`` (uniform over the images of the last ``window`` positions of ``epoch_order(epoch)`` up
            to the sample's own, crossing into the previous epoch's order at an epoch's start: Ultralytics'
            buffer, :func:`recent_window`; the mixup image stays uniform over the dataset).
        recipe: whose distributions to draw (:data:`Recipe`): ``"yolov9"`` or ``"ultralytics"``.
        epoch_order: ``partners="recent"``: the function (picklable, pure) giving the order of image indices
            this rank visits in an epoch, e.g. :class:`fastload.order.EpochOrder`; every image it renders
            must be in it. ``window``: the positions the partners come from.
        copy_paste: the fraction of candidate instances each copy-paste image pastes (hyp ``copy_paste``; 0: no
            copy-paste, the records are exactly those of a sampler built without it; 0 without ``augment``). A loader
            sets it for the segment task only: YOLOv9 pastes on every mosaic (the main one and the mixup partner),
            Ultralytics on every training image (mosaic or not, its mixup partner too) (:class:`CopyPaste`). Switching
            it on adds the optional fields (``ImageParams.copy_paste``, ``TileParams.offset``) and moves no other draw.
        instances: int [N], the label rows of every image (``recipe="yolov9"`` with ``copy_paste``: one selection key
            is drawn per row of a mosaic's tiles); the labels the records are applied with must have these counts.
    """

    def __init__(
        self,
        loaded_shapes: np.ndarray,
        hyp: str | Mapping[str, Any] | None,
        imgsz: int,
        *,
        augment: bool = True,
        seed: int = 0,
        rect_shapes: np.ndarray | None = None,
        mosaic9: bool = False,
        orig_shapes: np.ndarray | None = None,
        partners: Partners = "dataset",
        recipe: Recipe = "yolov9",
        epoch_order: Callable[[int], np.ndarray] | None = None,
        window: int | None = None,
        copy_paste: float = 0.0,
        instances: Sequence[int] | np.ndarray | None = None,
    ) -> None:
        if partners not in PARTNERS:
            raise ValueError(f"partners must be one of {', '.join(PARTNERS)}, got {partners!r}")
        if partners == "recent" and (epoch_order is None or window is None or window < 1):
            raise ValueError("partners='recent' draws from the last `window` images of the epoch order: pass "
                             f"epoch_order= and window= >= 1 (see recent_window), got {epoch_order!r} and {window!r}")
        self.epoch_order = epoch_order
        self.window = None if window is None else int(window)
        self._positions: dict[int, tuple[np.ndarray, np.ndarray]] = {}  # epoch -> (order, first position of each image)
        if recipe not in RECIPES:
            raise ValueError(f"recipe must be one of {', '.join(RECIPES)}, got {recipe!r}")
        if recipe == "ultralytics" and mosaic9:
            raise ValueError("recipe='ultralytics' has no 9-tile mosaic (Ultralytics' detection mosaic has 4 tiles)")
        self.recipe: Recipe = recipe
        self.partners: Partners = partners
        self.loaded_shapes = np.asarray(loaded_shapes, dtype=np.int64).reshape(-1, 2)
        if len(self.loaded_shapes) == 0:
            raise ValueError("ParamSampler needs at least one image")
        if (self.loaded_shapes < 1).any():
            bad = int(np.nonzero((self.loaded_shapes < 1).any(1))[0][0])
            raise ValueError(f"loaded shape of index {bad} is {tuple(self.loaded_shapes[bad])}; sizes must be >= 1")
        self.hyp = load_hyp(hyp)
        self.imgsz = int(imgsz)
        self.augment = bool(augment)
        self.seed = int(seed)
        self.mosaic9 = bool(mosaic9)
        n = len(self.loaded_shapes)
        self.rect_shapes = None if rect_shapes is None else np.asarray(rect_shapes, np.int64).reshape(-1, 2)
        if self.rect_shapes is not None and len(self.rect_shapes) != n:
            raise ValueError(f"rect_shapes has {len(self.rect_shapes)} rows for {n} images")
        self.orig_shapes = self.loaded_shapes if orig_shapes is None else np.asarray(orig_shapes, np.int64).reshape(-1, 2)
        if len(self.orig_shapes) != n:
            raise ValueError(f"orig_shapes has {len(self.orig_shapes)} rows for {n} images")
        # YOLOv9: ``self.mosaic = self.augment and not self.rect``; mixup only happens inside mosaic.
        # Ultralytics: mosaic and mixup are both off without augmentation or with rect batches.
        self.mosaic_prob = self.hyp["mosaic"] if (self.augment and self.rect_shapes is None) else 0.0
        self.mixup_prob = self.hyp["mixup"] if (recipe == "yolov9" or (self.augment and self.rect_shapes is None)) else 0.0
        if not 0.0 <= float(copy_paste) <= 1.0:
            raise ValueError(f"copy_paste is the fraction of candidate instances pasted, in [0, 1]; got {copy_paste!r}")
        self.copy_paste = float(copy_paste) if self.augment else 0.0  # (like mosaic: a training augmentation)
        if self.copy_paste and self.mosaic9:
            raise ValueError("copy_paste with mosaic9: YOLOv9's segment loader has no 9-tile mosaic; use the 4-tile one")
        self.instances: np.ndarray | None = None
        if self.copy_paste and recipe == "yolov9":
            if instances is None:
                raise ValueError("copy_paste with recipe='yolov9' draws one selection key per label row: pass instances= "
                                 "(the label rows of every image)")
            self.instances = np.asarray(instances, np.int64).reshape(-1)
            if len(self.instances) != n or (self.instances < 0).any():
                raise ValueError(f"instances must hold {n} row counts >= 0 (one per image), got {len(self.instances)} "
                                 f"values, smallest {self.instances.min(initial=0)}")

    def __len__(self) -> int:
        return len(self.loaded_shapes)

    @property
    def load_rule(self) -> LoadRule:
        """The loaded-image rule of the recipe (:data:`fastload.data.images.LoadRule`, the recipe's name): the
        sizes ``loaded_shapes`` must have been computed with and the filter engines resize with."""
        return self.recipe

    def close_mosaic(self) -> None:
        """Turn mosaic (and with it mixup and copy-paste) off for the remaining epochs (YOLOv9 ``--close-mosaic``;
        Ultralytics' ``close_mosaic`` sets its ``copy_paste`` to 0 too)."""
        self.mosaic_prob = 0.0
        self.mixup_prob = 0.0
        self.copy_paste = 0.0

    @property
    def max_out_hw(self) -> tuple[int, int]:
        """The largest output ``(h, w)`` a record of this sampler can have (engines size buffers by it):
        the largest rect batch shape in rect mode, else ``imgsz`` square (a mosaic of odd ``imgsz`` is
        one pixel larger: the canvas is ``2 * imgsz`` minus ``imgsz // 2`` on each side)."""
        if self.rect_shapes is not None:
            return int(self.rect_shapes[:, 0].max()), int(self.rect_shapes[:, 1].max())
        side = self.imgsz
        if self.mosaic_prob > 0:
            side = max(side, 2 * self.imgsz - 2 * (self.imgsz // 2))
        return side, side

    @property
    def draws_mosaics(self) -> bool:
        """True while records can be mosaics (training without rect, mosaic probability > 0): the only
        records that have partners."""
        return self.mosaic_prob > 0

    # -- the record --------------------------------------------------------------------------------
    def sample_batch(self, epoch: int, indices: Sequence[int] | np.ndarray) -> list[SampleParams]:
        """The records of one batch, in order: what every engine calls per batch.

        ``indices`` are image indices or sample ids (:func:`visit_ids`). With ``partners="batch"``
        the partners of each record are drawn from the batch's images (its composition, the same for
        any number of workers); with ``"dataset"`` this is ``[sample(epoch, i) for i in indices]``.
        """
        batch = np.asarray(indices, np.int64).reshape(-1)
        pool = batch if self.partners == "batch" else None
        return [self.sample(epoch, i, batch=pool) for i in batch.tolist()]

    def recent(self, epoch: int, index: int) -> np.ndarray:
        """``partners="recent"``: the images sample ``index`` draws its mosaic partners from, those of the
        ``window`` positions of the epoch order that end at its own (its first, when the order repeats it);
        positions before the epoch's first are the previous epoch's last (none before epoch 0)."""
        order, first = self._epoch_positions(epoch)
        if not 0 <= index < len(first) or first[index] < 0:
            raise IndexError(f"image {index} is not in the epoch order of epoch {epoch} (partners='recent' draws "
                             f"from the order's recent images)")
        end = int(first[index]) + 1
        start = end - int(self.window)  # type: ignore[arg-type]  # set with partners="recent"
        if start >= 0 or epoch <= 0:
            return order[max(start, 0):end]
        before = self._epoch_positions(epoch - 1)[0]
        return np.concatenate([before[max(len(before) + start, 0):], order[:end]])

    def _epoch_positions(self, epoch: int) -> tuple[np.ndarray, np.ndarray]:
        """The epoch's order and the first position of every image in it (-1: absent), kept for two epochs."""
        if epoch not in self._positions:
            n = len(self.loaded_shapes)
            order = np.asarray(self.epoch_order(epoch)).reshape(-1)  # type: ignore[misc]
            if len(order) and (order.min() < 0 or order.max() >= n):
                raise ValueError(f"partners='recent': the epoch order holds sample ids or indices outside "
                                 f"[0, {n}); it must list image indices")
            # Two epochs of an order and its positions live in every worker: 4-byte entries halve them.
            index_type = np.int32 if max(n, len(order)) < 2**31 else np.int64
            order = order.astype(index_type, copy=False)
            first = np.full(n, -1, index_type)
            images, at = np.unique(order, return_index=True)
            first[images] = at
            while len(self._positions) >= 2:
                del self._positions[min(self._positions)]
            self._positions[epoch] = (order, first)
        return self._positions[epoch]

    def sample(self, epoch: int, index: int, batch: Sequence[int] | np.ndarray | None = None) -> SampleParams:
        """The record of output sample ``index`` in ``epoch`` (pure function of seed, epoch, index and,
        with ``partners="batch"``, of ``batch``).

        ``index`` is an image index, or a sample id ``k * n + i`` from :func:`visit_ids`
        (the ``(k + 1)``-th visit of image ``i`` in an epoch that repeats images): the draws are
        seeded by the id, the record's ``index`` is the image. ``batch``: the indices (or ids) of the
        batch the sample belongs to, whose images the partners are drawn from with
        ``partners="batch"`` (required then; ignored with ``"dataset"``). Engines call
        :meth:`sample_batch`.
        """
        sample_id = self._sample_id(index)
        n = len(self.loaded_shapes)
        return self._record(make_rng(self.seed, epoch, sample_id), epoch, sample_id % n, sample_id % n,
                            self._pool(epoch, sample_id, batch), self._paste_rng(epoch, sample_id, 0))

    def replacement(self, epoch: int, index: int, attempt: int, batch: Sequence[int] | np.ndarray | None = None) -> SampleParams:
        """The ``attempt``-th (>= 1) replacement record of output sample ``index``: drawn when an image that
        sample's earlier draws read is damaged (the engines skip it), so the epoch keeps its length.

        A pure function of ``(seed, epoch, index, attempt)`` (and of ``batch`` with ``partners="batch"``):
        its image is uniform over the dataset (with ``partners="batch"``: over the batch's images, so every
        source of a batch's records stays one of its own images), drawn from ``SeedSequence([seed, epoch,
        index, attempt])`` under a spawn key of its own, which then draws the rest of the record as
        :meth:`sample` does; in rect mode it is letterboxed into the sample's own rect shape. Every engine
        and any number of workers therefore replace a damaged sample identically.
        """
        if attempt < 1:
            raise ValueError(f"a replacement draw is attempt 1 or later, got {attempt}")
        sample_id = self._sample_id(index)
        n = len(self.loaded_shapes)
        ss = np.random.SeedSequence([self.seed, int(epoch), sample_id, int(attempt)], spawn_key=_REPLACEMENT_STREAM)
        rng = np.random.Generator(np.random.PCG64(ss))
        pool = self._pool(epoch, sample_id, batch)
        image = self._draw(rng, n, self._image_pool(pool), 1)[0]
        record = self._record(rng, epoch, image, sample_id % n, pool, self._paste_rng(epoch, sample_id, attempt))
        return dataclasses.replace(record, attempt=int(attempt))

    def first_usable(self, epoch: int, index: int, usable: Callable[[SampleParams], bool],
                     batch: Sequence[int] | np.ndarray | None = None, *, record: SampleParams | None = None) -> SampleParams:
        """The record an engine renders for output sample ``index``: :meth:`sample`'s when ``usable`` accepts
        it, else the first of the :meth:`replacement` draws it accepts (engines pass a ``usable`` that loads
        the record's images and says False when one of them is damaged). ``record``: the sample's own draw
        when the engine has it already (from :meth:`sample_batch`). Raises ``RuntimeError`` after
        :data:`MAX_REPLACEMENTS` refused draws."""
        if record is None:
            record = self.sample(epoch, index, batch)
        attempt = 0
        while not usable(record):
            attempt += 1
            if attempt > MAX_REPLACEMENTS:
                raise RuntimeError(f"sample {index} of epoch {epoch}: {MAX_REPLACEMENTS} replacement draws all read "
                                   f"damaged images; check the store with `fastload verify`")
            record = self.replacement(epoch, index, attempt, batch)
        return record

    def _paste_rng(self, epoch: int, sample_id: int, attempt: int) -> np.random.Generator | None:
        """The generator of a record's copy-paste keys (``"yolov9"`` with ``copy_paste`` only): ``SeedSequence([seed,
        epoch, id, attempt])`` under a spawn key of its own, apart from every other draw."""
        if self.instances is None:
            return None
        ss = np.random.SeedSequence([self.seed, int(epoch), int(sample_id), int(attempt)], spawn_key=_PASTE_STREAM)
        return np.random.Generator(np.random.PCG64(ss))

    def _pasted(self, image: ImageParams, canvas_hw: tuple[int, int], paste_rng: np.random.Generator | None
                ) -> ImageParams:
        """``image`` (its tiles made with their canvas offsets) with its copy-paste (:class:`CopyPaste`)."""
        keys = None
        if self.recipe == "yolov9":
            rows = int(sum(int(self.instances[t.src]) for t in image.tiles))  # type: ignore[index]  # set with copy_paste
            keys = paste_rng.random(rows).tolist()  # type: ignore[union-attr]
        return dataclasses.replace(image, copy_paste=CopyPaste(self.copy_paste, canvas_hw, self.recipe, keys))

    def _sample_id(self, index: int) -> int:
        sample_id = int(index)
        if sample_id < 0:
            raise IndexError(f"index {sample_id} out of range for {len(self.loaded_shapes)} images")
        return sample_id

    def _pool(self, epoch: int, sample_id: int, batch: Sequence[int] | np.ndarray | None) -> np.ndarray | None:
        """The image indices mosaic partners are drawn from (``partners="batch"``: the batch's, ``"recent"``: the
        window's), None for the whole dataset."""
        if self.partners == "recent":
            return self.recent(epoch, sample_id) if self.draws_mosaics else None
        if self.partners != "batch":
            return None
        if batch is None:
            raise ValueError("partners='batch' draws from the sample's batch: pass batch= (or use sample_batch)")
        pool = np.asarray(batch, np.int64).reshape(-1)
        if len(pool) == 0 or pool.min() < 0:
            raise IndexError(f"batch indices must be image indices or sample ids (>= 0), got {pool.tolist()}")
        return image_of(pool, len(self.loaded_shapes))

    def _image_pool(self, pool: np.ndarray | None) -> np.ndarray | None:
        """Where a whole image is drawn from (a mixup image, a replacement): the batch with ``partners="batch"``
        (every source a batch's own image), else the dataset (Ultralytics draws its mixup image there)."""
        return pool if self.partners == "batch" else None

    def _record(self, rng: np.random.Generator, epoch: int, index: int, shape_of: int, pool: np.ndarray | None,
                paste_rng: np.random.Generator | None) -> SampleParams:
        """The record of image ``index`` drawn from ``rng``; ``shape_of``: the index whose rect shape it fills;
        ``paste_rng``: the copy-paste keys' generator (:meth:`_paste_rng`)."""
        n = len(self.loaded_shapes)
        hyp = self.hyp
        ultralytics = self.recipe == "ultralytics"
        mosaic = self._draws_mosaic(rng)
        mixup, ratio, shapes = None, 1.0, None
        if mosaic:
            image = self._mosaic(rng, index, pool, paste_rng)
            if not ultralytics and self.mixup_prob > 0 and rng.random() < self.mixup_prob:
                mixup = self._mosaic(rng, self._draw(rng, n, self._image_pool(pool), 1)[0], pool, paste_rng)
                ratio = float(rng.beta(32.0, 32.0))
        elif ultralytics and self.augment:
            image, shapes = self._centred(rng, index, shape_of)
        else:
            image, shapes = self._letterbox(rng, index, shape_of)
        if ultralytics and self.mixup_prob > 0 and rng.random() < self.mixup_prob:
            # Ultralytics' MixUp follows every sample; its partner (uniform over the dataset) goes through
            # the same mosaic-or-not and random perspective as a sample of its own
            partner = self._draw(rng, n, self._image_pool(pool), 1)[0]
            mixup = (self._mosaic(rng, partner, pool, paste_rng) if self._draws_mosaic(rng)
                     else self._centred(rng, partner, partner)[0])
            ratio = float(rng.beta(32.0, 32.0))
        gain = (1.0, 1.0, 1.0)
        flip_ud = flip_lr = False
        if self.augment:
            hsv = (hyp["hsv_h"], hyp["hsv_s"], hyp["hsv_v"])
            if any(hsv):
                g = rng.uniform(-1.0, 1.0, 3) * np.asarray(hsv) + 1.0
                gain = (float(g[0]), float(g[1]), float(g[2]))
            flip_ud = bool(rng.random() < hyp["flipud"])
            flip_lr = bool(rng.random() < hyp["fliplr"])
        return SampleParams(
            index=index, epoch=int(epoch), image=image, mixup=mixup, mixup_ratio=ratio,
            hsv_gain=gain, hsv_rule=self.recipe, flip_ud=flip_ud, flip_lr=flip_lr, mosaic=mosaic, shapes=shapes,
        )

    def _draws_mosaic(self, rng: np.random.Generator) -> bool:
        """Whether a (main or mixup) image is a mosaic: one draw against the mosaic probability."""
        return bool(self.augment and self.mosaic_prob > 0 and rng.random() < self.mosaic_prob)

    # -- pieces ------------------------------------------------------------------------------------
    def _perspective(self, rng: np.random.Generator, canvas_hw: tuple[int, int], out_hw: tuple[int, int]) -> tuple[np.ndarray, float]:
        """YOLOv9 ``random_perspective`` matrix ``M = T @ S @ R @ P @ C`` and its scale draw."""
        hyp = self.hyp
        ch, cw = canvas_hw
        oh, ow = out_hw
        c = translation(-cw / 2, -ch / 2)  # canvas centre to the origin
        # The eight uniform draws in one call: ``rng.uniform(lo, hi)`` is exactly
        # ``lo + (hi - lo) * next_double``, and ``rng.random(8)`` yields the same eight doubles as
        # eight scalar draws, so the record is unchanged (tested) at a fraction of the call overhead.
        u = rng.random(8).tolist()

        def draw(k: int, lo: float, hi: float) -> float:
            return lo + (hi - lo) * u[k]

        p = np.eye(3)
        p[2, 0] = draw(0, -hyp["perspective"], hyp["perspective"])
        p[2, 1] = draw(1, -hyp["perspective"], hyp["perspective"])
        angle = draw(2, -hyp["degrees"], hyp["degrees"])
        scale = draw(3, 1 - hyp["scale"], 1 + hyp["scale"])
        r = np.eye(3)  # cv2.getRotationMatrix2D(center=(0, 0), angle, scale)
        alpha, beta = scale * math.cos(math.radians(angle)), scale * math.sin(math.radians(angle))
        r[0, :2] = (alpha, beta)
        r[1, :2] = (-beta, alpha)
        sh = np.eye(3)
        sh[0, 1] = math.tan(math.radians(draw(4, -hyp["shear"], hyp["shear"])))
        sh[1, 0] = math.tan(math.radians(draw(5, -hyp["shear"], hyp["shear"])))
        t = translation(
            draw(6, 0.5 - hyp["translate"], 0.5 + hyp["translate"]) * ow,
            draw(7, 0.5 - hyp["translate"], 0.5 + hyp["translate"]) * oh,
        )
        return t @ sh @ r @ p @ c, float(scale)

    @staticmethod
    def _draw(rng: np.random.Generator, n: int, pool: np.ndarray | None, k: int) -> list[int]:
        """``k`` image indices, uniform with replacement: over the dataset (``pool`` None) or over ``pool``."""
        if pool is None:
            return rng.integers(0, n, k).tolist()
        return pool[rng.integers(0, len(pool), k)].tolist()

    def _mosaic(self, rng: np.random.Generator, index: int, pool: np.ndarray | None,
                paste_rng: np.random.Generator | None) -> ImageParams:
        n = len(self.loaded_shapes)
        s = self.imgsz
        k = 9 if self.mosaic9 else 4
        srcs = np.array([index] + self._draw(rng, n, pool, k - 1), np.int64)
        if self.recipe == "yolov9":
            rng.shuffle(srcs)  # YOLOv9 shuffles the sample's own image among its partners (Ultralytics: top left)
        hw = [(h, w) for h, w in self.loaded_shapes[srcs].tolist()]
        placements = _mosaic9_placements(rng, s, hw) if self.mosaic9 else _mosaic4_placements(rng, s, hw)
        canvas = 2 * s
        # YOLOv9: random_perspective border = -s // 2 on each side; Ultralytics: its output size is imgsz
        out = canvas - 2 * (s // 2) if self.recipe == "yolov9" else s
        m, scale = self._perspective(rng, (canvas, canvas), (out, out))
        shown = [(int(src), shape, crop, offset) for src, shape, (crop, offset) in zip(srcs, hw, placements) if crop is not None]
        # the canvas offsets only where copy-paste reads them: made once here, not replaced into copies of the tiles
        image = ImageParams(tuple(TileParams(src, crop, m @ translation(*offset), shape,
                                             offset=offset if self.copy_paste else None)
                                  for src, shape, crop, offset in shown), (out, out), 114, scale)
        if self.copy_paste:
            image = self._pasted(image, (canvas, canvas), paste_rng)
        return image

    def _out_hw(self, shape_of: int) -> tuple[int, int]:
        """A non-mosaic sample's output ``(h, w)``: its rect batch shape, else ``imgsz`` square."""
        if self.rect_shapes is not None:
            return int(self.rect_shapes[shape_of][0]), int(self.rect_shapes[shape_of][1])
        return self.imgsz, self.imgsz

    def _centred(self, rng: np.random.Generator, index: int, shape_of: int) -> tuple[ImageParams, Any]:
        """Ultralytics' non-mosaic training sample: no letterbox, its random perspective warps the loaded
        image about its centre straight into the output (boxes filtered against the scale draw alone)."""
        h, w = self.loaded_shapes[index].tolist()
        hw = (h, w)
        out_hw = self._out_hw(shape_of)
        m, scale = self._perspective(rng, hw, out_hw)
        h0, w0 = (int(v) for v in self.orig_shapes[index])
        shapes = ((h0, w0), ((hw[0] / h0, hw[1] / w0), (0.0, 0.0)))
        image = ImageParams((TileParams(index, (0, 0, hw[1], hw[0]), m, hw, offset=(0, 0) if self.copy_paste else None),),
                            out_hw, 114, scale)
        if self.copy_paste:  # Ultralytics' CopyPaste runs on every training image, its loaded image the canvas
            image = self._pasted(image, hw, None)
        return image, shapes

    def _letterbox(self, rng: np.random.Generator, index: int, shape_of: int) -> tuple[ImageParams, Any]:
        h, w = (int(v) for v in self.loaded_shapes[index])
        oh, ow = self._out_hw(shape_of)
        lb, r, (dw, dh), (left, top) = letterbox_fit((h, w), (oh, ow), scaleup=self.augment)  # YOLOv9: scaleup=augment
        cand = box = None
        if self.augment:
            m, scale = self._perspective(rng, (oh, ow), (oh, ow))
            lb = m @ lb
            cand = scale * r
        else:  # validation boxes: x * r + pad in edge coordinates (see TileParams.box_matrix)
            if self.recipe == "ultralytics":  # Ultralytics moves them by the pixels' integer pad
                dw, dh = float(left), float(top)
            box = np.array([[r, 0.0, 0.5 * (r - 1) + dw], [0.0, r, 0.5 * (r - 1) + dh], [0.0, 0.0, 1.0]])
        h0, w0 = (int(v) for v in self.orig_shapes[index])
        shapes = ((h0, w0), ((h / h0, w / w0), (dw, dh)))
        return ImageParams((TileParams(index, (0, 0, w, h), lb, (h, w), box),), (oh, ow), 114, cand), shapes


class Letterbox(NamedTuple):
    """YOLOv9's ``letterbox(auto=False)`` of one image (:func:`letterbox_fit`)."""

    matrix: np.ndarray  # the pixels: float64 3x3, centre convention (resize, then the integer border)
    r: float  # the ratio
    pad: tuple[float, float]  # (dw, dh): the float pad YOLOv9 moves labels by (x * r + dw)
    border: tuple[int, int]  # (left, top) = round(pad - 0.1): where the pixels start


def letterbox_fit(hw: tuple[int, int], out_hw: tuple[int, int], scaleup: bool) -> Letterbox:
    """YOLOv9's letterbox of a loaded ``(h, w)`` image into ``out_hw`` (``cv2.resize`` to ``round(w * r) x
    round(h * r)``, then the border); ``scaleup=False`` keeps ``r <= 1``."""
    h, w = hw
    oh, ow = out_hw
    r = min(oh / h, ow / w)
    if not scaleup:
        r = min(r, 1.0)
    nw, nh = int(round(w * r)), int(round(h * r))
    dw, dh = (ow - nw) / 2, (oh - nh) / 2
    top, left = int(round(dh - 0.1)), int(round(dw - 0.1))
    sx, sy = nw / w, nh / h
    # cv2.resize maps pixel centres x -> sx * (x + 0.5) - 0.5; then the border offset.
    lb = np.array([[sx, 0.0, 0.5 * (sx - 1) + left], [0.0, sy, 0.5 * (sy - 1) + top], [0.0, 0.0, 1.0]])
    return Letterbox(lb, r, (dw, dh), (left, top))


Placement = tuple[Rect | None, tuple[int, int]]


def _mosaic4_placements(rng: np.random.Generator, s: int, hw: Sequence[tuple[int, int]]) -> list[Placement]:
    """YOLOv9 ``load_mosaic`` tile layout on the 2s x 2s canvas around a random centre.

    Returns per tile ``(crop in loaded px, (ox, oy) canvas offset of the loaded image)``.
    """
    border = -(s // 2)
    yc = int(rng.uniform(-border, 2 * s + border))
    xc = int(rng.uniform(-border, 2 * s + border))
    out: list[Placement] = []
    for i, (h, w) in enumerate(hw):
        if i == 0:  # top left: bottom-right corner at the centre
            xa0, ya0, xa1, ya1 = max(xc - w, 0), max(yc - h, 0), xc, yc
            xb0, yb0 = w - (xa1 - xa0), h - (ya1 - ya0)
        elif i == 1:  # top right
            xa0, ya0, xa1, ya1 = xc, max(yc - h, 0), min(xc + w, 2 * s), yc
            xb0, yb0 = 0, h - (ya1 - ya0)
        elif i == 2:  # bottom left
            xa0, ya0, xa1, ya1 = max(xc - w, 0), yc, xc, min(2 * s, yc + h)
            xb0, yb0 = w - (xa1 - xa0), 0
        else:  # bottom right
            xa0, ya0, xa1, ya1 = xc, yc, min(xc + w, 2 * s), min(2 * s, yc + h)
            xb0, yb0 = 0, 0
        crop = Rect(xb0, yb0, xb0 + (xa1 - xa0), yb0 + (ya1 - ya0))
        out.append((crop if xa1 > xa0 and ya1 > ya0 else None, (xa0 - xb0, ya0 - yb0)))
    return out


def _mosaic9_placements(rng: np.random.Generator, s: int, hw: Sequence[tuple[int, int]]) -> list[Placement]:
    """YOLOv9 ``load_mosaic9``: nine tiles on a 3s x 3s canvas, then a random 2s x 2s window."""
    rects = []
    h0 = w0 = hp = wp = 0
    for i, (h, w) in enumerate(hw):
        if i == 0:  # centre
            h0, w0 = h, w
            c = (s, s, s + w, s + h)
        elif i == 1:  # top
            c = (s, s - h, s + w, s)
        elif i == 2:  # top right
            c = (s + wp, s - h, s + wp + w, s)
        elif i == 3:  # right
            c = (s + w0, s, s + w0 + w, s + h)
        elif i == 4:  # bottom right
            c = (s + w0, s + hp, s + w0 + w, s + hp + h)
        elif i == 5:  # bottom
            c = (s + w0 - w, s + h0, s + w0, s + h0 + h)
        elif i == 6:  # bottom left
            c = (s + w0 - wp - w, s + h0, s + w0 - wp, s + h0 + h)
        elif i == 7:  # left
            c = (s - w, s + h0 - h, s, s + h0)
        else:  # top left
            c = (s - w, s + h0 - hp - h, s, s + h0 - hp)
        rects.append(c)
        hp, wp = h, w
    yc = int(rng.uniform(0, s))
    xc = int(rng.uniform(0, s))
    out: list[Placement] = []
    for (x0, y0, x1, y1) in rects:
        # visible = tile rect clipped to the 3s canvas (YOLOv9 clips at 0) and to the window
        vx0, vy0 = max(x0, 0, xc), max(y0, 0, yc)
        vx1, vy1 = min(x1, 3 * s, xc + 2 * s), min(y1, 3 * s, yc + 2 * s)
        crop = Rect(vx0 - x0, vy0 - y0, vx1 - x0, vy1 - y0)
        out.append((crop if vx1 > vx0 and vy1 > vy0 else None, (x0 - xc, y0 - yc)))
    return out
