"""``fastload.loader()``: a YOLOv9-compatible training and validation loader in one call.

It ties the packages together: a store (``fastload.store.open_store``), the augmentation sampler
(``fastload.augment.params.ParamSampler``), the epoch order (:mod:`fastload.order`) and an engine
(``cpu``, ``gpu``, ``dali`` or ``ray``, :mod:`fastload.engines.factory`) that renders the batches.
"""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import logging
import os
import warnings
from typing import Any, Callable, Iterator, Literal, NamedTuple, Sequence

import numpy as np
import torch

from fastload import order as _order
from fastload.augment.hyp import load_hyp
from fastload.augment.params import (
    PARTNERS, RECIPES, ParamSampler, Partners, Recipe, image_of, per_index_shapes, recent_window, rect_batch_shapes,
    visit_ids,
)
from fastload.data.images import loaded_shapes
from fastload.data.labels import FlatLabels, label_paths
from fastload.engines.base import TASKS, Batch, Engine, EngineSettings, HostRenderOptions, HSVMode, Layout, Task
from fastload.engines.factory import SAMPLE_ID_ENGINES, engine_class, resolve_options
from fastload.engines.shm_cache import (ENTRY_LOCKS, CacheKeep, decoded_set_bytes, planned_cache_bytes,
                                       planned_turnover_slots)
from fastload.store.base import Shards, Store
from fastload.store.factory import open_store
from fastload.store.kinds import store_kind
from fastload.store.space import fmt_bytes
from fastload.store.view import StoreView

LOG = logging.getLogger(__name__)

STATE_FORMAT = "fastload.loader-state/1"
# what a loader state records of the loader that saved it, with what a mismatch means; a state whose values
# differ is refused: the remaining batches would not be the interrupted epoch's
_STATE_IDENTITY = {
    "images": "the number of images",
    "dataset": "the dataset (digest of its image file names and sizes)",
    "seed": "the seed",
    "world_size": "the world size",
    "batch_size": "the batch size",
    "shuffle": "shuffle",
    "drop_last": "drop_last",
    "rect": "rect",
    "augmentation": "the augmentation (digest of imgsz, augment and hyp)",
    "partners": "partners",
}


#: Who chose where a loader's mosaic partners come from (:class:`PartnerPlan`, ``loader.stats()["partners_by"]``):
#: ``"caller"``: ``loader(partners=...)``; ``"engine"``: the engine's default, with nothing to fit in a decoded
#: cache (a decoded store, an engine or platform without the cache, ``decode_cache_mb=0``) or no partners to draw
#: (validation, rect batches);
#: ``"shards"``: a store read in shards, which holds a few at a time: ``"batch"``; ``"cache-fits"``: the
#: decoded set fits the machine's decoded-image cache: the engine's default (``"dataset"``, YOLOv9's draw:
#: after the first epoch partners cost no decode); ``"cache-too-small"``: it does not: ``"batch"`` (each
#: batch decodes its own images once: about 1 decode per output image instead of 4.6).
PartnersBy = Literal["caller", "engine", "shards", "cache-fits", "cache-too-small"]


class PartnerPlan(NamedTuple):
    """Where a loader draws mosaic partners from (``partners``), who chose it (``by``) and why, in words
    (``why``, for the loader's one-line summary)."""

    partners: Partners
    by: PartnersBy
    why: str

    def __str__(self) -> str:
        return f"partners={self.partners} ({self.why})"


class CachePlan(NamedTuple):
    """What a loader's decoded-image cache keeps of a dataset larger than it (``keep``,
    :data:`~fastload.engines.shm_cache.CacheKeep`; None: the loader has no decoded cache), who chose it (``by``:
    ``"caller"``, ``engine_options={"decode_cache_keep": ...}``; ``"planned"``: :func:`loader`) and why, in words.
    It changes which reads decode, never the batches."""

    keep: CacheKeep | None
    by: Literal["caller", "planned"]
    why: str

    def __str__(self) -> str:
        return f"decode cache keeps the {self.keep} images ({self.why})"


def _cache_budget(options: Any, view: StoreView) -> int:
    """The decoded cache bound a loader plans by: 0 without a decoded cache (a decoded store, an engine or platform
    without one, ``decode_cache_mb=0``)."""
    cached = isinstance(options, HostRenderOptions) and not view.decoded and ENTRY_LOCKS
    return planned_cache_bytes(options.decode_cache_mb) if cached else 0


def _cache_plan(options: Any, view: StoreView, imgsz: int, recipe: Recipe, partners: PartnerPlan,
                settings: EngineSettings, window: int | None, *, training: bool) -> CachePlan:
    """What the decoded cache keeps: ``"latest"`` (it turns over in epoch order) where partners are the epoch
    order's recent images (``partners="recent"``), the decoded set exceeds the cache and the cache's ring holds
    every image a partner can be (the window and the batches rendered at once); else ``"first"`` (a uniform
    draw, a batch's own images or one read per epoch gain nothing from a turnover, which costs a lock per hit)."""
    asked = getattr(options, "decode_cache_keep", None)
    if asked is not None:
        return CachePlan(asked, "caller", "asked for")
    budget = _cache_budget(options, view)
    if budget <= 0:
        return CachePlan(None, "planned", "no decoded-image cache")
    need = decoded_set_bytes(view, imgsz, recipe)
    if need <= budget:
        return CachePlan("first", "planned", f"the decoded set, {fmt_bytes(need)}, fits the decode cache")
    if not training or partners.partners != "recent" or window is None:
        return CachePlan("first", "planned", f"partners={partners.partners} do not draw from the recent images")
    slots = planned_turnover_slots(view, imgsz, recipe, budget)
    # a partner is one of the last `window` images of the order; the batches rendered at once are decoded meanwhile
    reach = window + (max(settings.workers, 1) * settings.prefetch + 1) * settings.batch_size
    if slots < reach:
        return CachePlan("first", "planned", f"its {slots} slots would not hold the {reach} recent images partners "
                                             f"come from")
    return CachePlan("latest", "planned", f"partners=recent, the decoded set, {fmt_bytes(need)}, exceeds the decode "
                                          f"cache, {fmt_bytes(budget)}, whose {slots} slots hold the {reach} recent "
                                          f"images partners come from")


def _partner_plan(asked: Partners | None, cls: type[Engine], options: Any, view: StoreView, imgsz: int,
                  recipe: Recipe, shards: Shards | None, *, training: bool) -> PartnerPlan:
    """The plan of ``loader(partners=asked)``: a function of the arguments, the store and this machine's decoded
    cache bound (:func:`~fastload.engines.shm_cache.planned_cache_bytes`: the same on every rank of a machine)."""
    if asked is not None:
        return PartnerPlan(asked, "caller", "asked for")
    if not training:  # validation or rect batches draw no partners: the plan changes nothing
        return PartnerPlan(cls.default_partners, "engine", "no partners drawn")
    if shards is not None:
        return PartnerPlan("batch", "shards", "a store read in shards")
    budget = _cache_budget(options, view)
    if budget <= 0:
        what = "a decoded store" if view.decoded else "no decoded-image cache"
        return PartnerPlan(cls.default_partners, "engine", f"the {cls.name} engine's default, {what}")
    need = decoded_set_bytes(view, imgsz, recipe)
    if need <= budget:
        return PartnerPlan(cls.default_partners, "cache-fits",
                           f"the decoded set, {fmt_bytes(need)}, fits the decode cache, {fmt_bytes(budget)}")
    return PartnerPlan("batch", "cache-too-small",
                       f"the decoded set, {fmt_bytes(need)}, exceeds the decode cache, {fmt_bytes(budget)}")


def _digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()[:16]


def _table_digest(table: np.ndarray | None) -> str | None:
    """What a state records of an image table (``dataset.indices``); None: no table, the plain order."""
    return None if table is None else _digest(np.ascontiguousarray(table, "<i8").tobytes())


class _Progress:
    """One iteration's place in its epoch: ``position`` batches delivered so far, of the order drawn with
    ``table`` (the image table when the iteration began)."""

    def __init__(self, epoch: int, position: int, table: np.ndarray | None) -> None:
        self.epoch = epoch
        self.position = position
        self.table = table

    def delivered(self, batch: Batch) -> Batch:
        """Count ``batch`` as delivered (mapped over the engine's batches: it keeps no reference to one)."""
        self.position += 1
        return batch

    @functools.cached_property
    def table_digest(self) -> str | None:
        return _table_digest(self.table)


class LoaderDataset:
    """What the YOLOv9 trainer reads from ``dataset`` (``loader.dataset``); no ``__getitem__`` pixels.

    Attributes:
        labels: ``float32 [n, 5]`` (cls, xc, yc, w, h) per image, after ``min_items`` / ``single_cls``.
        shapes: ``int [N, 2]`` original image sizes as **(w, h)**, YOLOv9's order (``hw`` has (h, w)).
        im_files, label_files: source image and label path per image.
        n: number of images; names: class names.
        indices: YOLOv9's image table, ``range(n)`` unless set: ``dataset.indices = table`` (what
            ``--image-weights`` does before every epoch) draws image ``table[p]`` at every position ``p``
            of the epochs that follow (see :meth:`FastLoader.set_image_table`).
        batch_shapes: rect mode's ``int [nb, 2]`` (h, w) per batch, else None.
        mosaic: YOLOv9's switch; ``dataset.mosaic = False`` closes mosaic (as ``--close-mosaic`` does).
    """

    def __init__(self, owner: "FastLoader", view: StoreView, *, img_size: int, augment: bool, hyp: dict,
                 rect: bool, stride: int, pad: float, batch_shapes: np.ndarray | None) -> None:
        self._owner = owner
        self.labels = view.labels
        self.hw = np.asarray(view.shapes, np.int64)
        self.shapes = self.hw[:, ::-1].copy()
        self._view = view
        self.n = len(view)
        self.names = list(view.names)
        self.img_size = img_size
        self.augment = augment
        self.hyp = hyp
        self.rect = rect
        self.stride = stride
        self.pad = pad
        self.batch_shapes = batch_shapes

    @functools.cached_property
    def im_files(self) -> list[str]:
        """The image file of each image (made when first read: N strings the trainer seldom needs; the store keeps
        them as one blob)."""
        return list(self._view.im_files)

    @functools.cached_property
    def label_files(self) -> list[str]:
        """The label file of each image (made when first read: N strings the trainer seldom needs)."""
        return label_paths(self.im_files)

    @functools.cached_property
    def segments(self) -> tuple[list, ...]:
        """Per image, the polygon of each label row (``float32 [k, 2]`` normalised, as YOLOv9's ``dataset.segments``;
        a box row has none, as there) where the labels have polygons; else an empty list per image (made when first
        read)."""
        labels = self.labels
        if not isinstance(labels, FlatLabels) or labels.points is None or labels.points.shape[1] != 2:
            return tuple([] for _ in range(self.n))
        out = []
        for i in range(self.n):
            _, points, offsets = labels.image(i)
            bounds = offsets.tolist()
            out.append([points[a:b] for a, b in zip(bounds[:-1], bounds[1:]) if b > a])
        return tuple(out)

    def __len__(self) -> int:
        return self.n

    @property
    def indices(self) -> Sequence[int]:
        table = self._owner.image_table
        return range(self.n) if table is None else table.tolist()

    @indices.setter
    def indices(self, value: Sequence[int] | np.ndarray | None) -> None:
        self._owner.set_image_table(value)

    @property
    def mosaic(self) -> bool:
        return not self._owner.mosaic_closed and self.augment and not self.rect

    @mosaic.setter
    def mosaic(self, value: bool) -> None:
        if not value:
            self._owner.close_mosaic()
        elif self._owner.mosaic_closed:
            raise ValueError("mosaic cannot be switched back on once closed; build a new loader")

    def __getitem__(self, i: int) -> Any:
        raise TypeError(
            "fastload renders whole batches; iterate the loader instead of indexing its dataset "
            "(dataset exposes labels, shapes, im_files, label_files, n, names)"
        )


class _EpochSampler:
    """``loader.sampler``: YOLOv9 calls ``train_loader.sampler.set_epoch(epoch)`` under DDP."""

    def __init__(self, owner: "FastLoader") -> None:
        self._owner = owner

    def set_epoch(self, epoch: int) -> None:
        self._owner.set_epoch(epoch)

    def __len__(self) -> int:
        return len(self._owner.epoch_order(self._owner.epoch))

    def __iter__(self) -> Iterator[int]:
        """The image indices of the current epoch, in order (this rank's part)."""
        return iter(image_of(self._owner.epoch_order(self._owner.epoch), self._owner.n).tolist())


class FastLoader:
    """Iterable of YOLOv9 batches ``(imgs, targets, paths, shapes)``; build it with :func:`loader`.

    ``len(loader)`` is the number of batches per epoch for this rank. Iterating runs the current
    epoch; when an iteration ends the epoch advances by one unless :meth:`set_epoch` is called
    (as the YOLOv9 trainer does under DDP). Use as a context manager or call :meth:`close` to stop
    the workers (they also stop with the process). :meth:`state_dict` / :meth:`load_state_dict` resume a run
    in the middle of an epoch (docs/loader.md, "Resuming mid-epoch"). :attr:`plan` (a :class:`PartnerPlan`) says
    where mosaic partners come from and why, :attr:`cache_plan` (a :class:`CachePlan`) what the decoded cache keeps;
    ``repr(loader)`` is the loader's one-line summary, the plans included (the cache's when it turns over).
    """

    def __init__(self, *, engine: Engine, dataset: Callable[[FastLoader], LoaderDataset], store: Store, n: int,
                 batch_size: int, seed: int, shuffle: bool, rank: int, world_size: int, drop_last: bool,
                 rect_batches: list[np.ndarray] | None, close_mosaic_epochs: int, epochs: int | None,
                 plan: PartnerPlan, cache_plan: CachePlan, owns_store: bool = True,
                 shards: Shards | None = None) -> None:
        self.engine = engine
        self.plan = plan  # where mosaic partners come from (the sampler's), who chose it and why
        # what the decoded cache keeps of a dataset larger than it (the engine's), who chose it and why
        self.cache_plan = cache_plan
        self.store = store
        # a store the caller passed in stays open (a ram store's shared-memory hold is theirs)
        self._owns_store = bool(owns_store)
        self.n = n
        self.batch_size = batch_size
        self.seed = seed
        self.shuffle = shuffle
        self.rank = rank
        self.world_size = world_size
        self.drop_last = drop_last
        self._rect_batches = rect_batches
        self.close_mosaic_epochs = close_mosaic_epochs
        self.epochs = epochs
        self.epoch = 0
        self.mosaic_closed = False
        self.image_table: np.ndarray | None = None  # set_image_table()
        # a store read in shards: the order visits them shard by shard
        self._order = _epoch_order(n, batch_size, shards, seed=seed, shuffle=shuffle, rank=rank,
                                   world_size=world_size, drop_last=drop_last)
        self.sampler = _EpochSampler(self)
        self._epoch_set = False
        self.closed = False  # True once close() ran: iterating then raises
        self.dataset = dataset(self)  # built with its owner, whose image table and mosaic state it shows
        self._running: _Progress | None = None  # the latest iteration, until it ends or the epoch is set
        self._resume: tuple[int, int, str | None] | None = None  # load_state_dict(): (epoch, position, table)

    # -- order --------------------------------------------------------------------------------------------
    def epoch_order(self, epoch: int) -> np.ndarray:
        """What the engine renders in ``epoch`` on this rank, in order: image indices, or sample ids
        (:func:`~fastload.augment.params.visit_ids`) when an image table repeats images."""
        if self._rect_batches is not None:
            return np.concatenate(self._rect_batches) if self._rect_batches else np.zeros(0, np.int64)
        idx = self._order(epoch)
        if self.image_table is not None:  # positions -> the images drawn there, each visit its own draws
            idx = visit_ids(self.image_table[idx], self.n)
        return idx

    def set_image_table(self, images: Sequence[int] | np.ndarray | None) -> None:
        """Draw image ``images[p]`` wherever position ``p`` comes up, from the next iteration on.

        This is YOLOv9's ``dataset.indices``, which ``--image-weights`` replaces before every epoch with
        ``random.choices(range(n), weights, k=n)``: the order (shuffle, DDP shards) still runs over the
        ``n`` positions and each position shows the image the table holds there. An image that appears
        several times gets its own augmentation draws each time (:func:`~fastload.augment.params.visit_ids`),
        so batches stay a function of the seed, the epoch and the table, for any number of workers.
        Mosaic partners are drawn from all images, as without a table (YOLOv9 draws them from the
        table); with ``partners="batch"`` from the images the batch shows. ``None`` or ``range(n)``
        restores the plain order. Needs an engine that takes sample ids
        (:attr:`~fastload.engines.base.Engine.takes_sample_ids`: ``cpu``, ``ray``); not with ``rect``
        (YOLOv9's own loader cannot collate rect images taken out of their batches either).
        """
        if images is None:
            self.image_table = None
            return
        table = np.asarray(images, np.int64).reshape(-1)
        if len(table) != self.n:
            raise ValueError(f"dataset.indices needs one image index per position ({self.n}), got {len(table)}")
        if len(table) and (table.min() < 0 or table.max() >= self.n):
            raise ValueError(f"dataset.indices holds indices outside [0, {self.n})")
        if np.array_equal(table, np.arange(self.n)):
            self.image_table = None
            return
        if self._rect_batches is not None:
            raise ValueError("dataset.indices (--image-weights) cannot reorder rect batches; drop --rect or the weights")
        if self.engine.sampler.partners == "recent":  # its window is computed from the order without a table
            raise ValueError("dataset.indices (--image-weights) changes the images of the epoch order that "
                             "partners='recent' draws mosaic partners from; use partners='dataset' or 'batch'")
        if not self.engine.takes_sample_ids:
            able = " or ".join(map(repr, SAMPLE_ID_ENGINES))
            raise ValueError(f"dataset.indices (--image-weights) needs engine={able}, this loader uses {self.engine.name!r}")
        self.image_table = table

    def __len__(self) -> int:
        if self._rect_batches is not None:
            return len(self._rect_batches)
        ws = self.world_size
        m = (self.n // ws if self.drop_last else -(-self.n // ws)) if ws > 1 else self.n
        return m // self.batch_size if self.drop_last else -(-m // self.batch_size)

    # -- epoch state ----------------------------------------------------------------------------------------
    def set_epoch(self, epoch: int) -> None:
        """Select the epoch the next iteration runs (its shuffle, its augmentation draws).

        Every rank must call it with the same value. With ``close_mosaic=N`` and ``epochs=E`` given
        to :func:`loader`, mosaic closes automatically from epoch ``E - N`` on.
        """
        epoch = int(epoch)
        if self._resume is not None and self._resume[0] != epoch:
            if self._resume[1]:
                raise ValueError(f"set_epoch({epoch}): the loader state loaded resumes epoch {self._resume[0]} at batch "
                                 f"{self._resume[1]}; resume the run at that epoch (or build a new loader)")
            self._resume = None  # a state saved at an epoch's start holds nothing but its epoch
        self.epoch = epoch
        self._epoch_set = True
        self._running = None
        if self.close_mosaic_epochs and self.epochs is not None and self.epoch >= self.epochs - self.close_mosaic_epochs:
            self.close_mosaic()

    def close_mosaic(self) -> None:
        """Switch mosaic and mixup off for all following batches (YOLOv9 ``--close-mosaic``)."""
        if self.mosaic_closed:
            return
        self.mosaic_closed = True
        self.engine.close_mosaic()

    @property
    def num_workers(self) -> int:
        """Worker processes rendering batches (0: the calling process); DataLoader's name, read by YOLOv9."""
        return int(self.engine.workers)

    # -- iteration ------------------------------------------------------------------------------------------
    def __iter__(self) -> Iterator[Batch]:
        if self.closed:
            raise RuntimeError("this loader was closed")
        epoch = self.epoch
        if self.close_mosaic_epochs and self.epochs is not None and epoch >= self.epochs - self.close_mosaic_epochs:
            self.close_mosaic()
        self._epoch_set = False
        order = self.epoch_order(epoch)
        progress = self._running = _Progress(epoch, self._resume_position(), self.image_table)
        # workers that finish this epoch's last batches may start the next one (small datasets:
        # otherwise they idle while the consumer finishes the epoch and asks for the next)
        self.engine.expect_next(epoch + 1, self.epoch_order(epoch + 1))
        # a resumed epoch: the engine is given the remaining batches only, so none before them is rendered
        # (every batch is a function of the seed, the epoch and its indices, not of its place in the call)
        remaining = order[progress.position * self.batch_size:]
        # a store streamed from object storage downloads what comes next while these batches render
        ahead = self.engine.read_ahead(image_of(remaining, self.n))
        try:
            for k, batch in enumerate(self.engine.iter_batches(epoch, remaining)):
                yield progress.delivered(batch)
                if ahead is not None:
                    ahead.reached((k + 1) * self.batch_size)
        finally:
            if ahead is not None:
                ahead.stop()
        if self._running is progress:
            self._running = None
        if not self._epoch_set:  # plain `for epoch: for batch in loader` loops get a new shuffle each time
            self.epoch = epoch + 1

    def _resume_position(self) -> int:
        """The batches of this epoch to skip: those a loaded state says were delivered, else none."""
        resume, self._resume = self._resume, None
        if resume is None:
            return 0
        epoch, position, table_digest = resume
        # checked here, not on load: a trainer sets the epoch's image table (--image-weights) after loading
        if position and _table_digest(self.image_table) != table_digest:
            raise ValueError(f"the order of epoch {epoch} differs from the one the loader state was saved in: another "
                             "image table (dataset.indices, --image-weights) than the saved run's; cannot resume at "
                             f"batch {position}")
        return position

    # -- checkpointing --------------------------------------------------------------------------------------
    @functools.cached_property
    def _identity(self) -> dict[str, Any]:
        """What a state must match to resume this loader (``_STATE_IDENTITY``); computed once."""
        ds = self.dataset
        # file names and original sizes, not the folders: a dataset may move (another mount on another node)
        names = "\0".join(os.path.basename(f) for f in self.engine.store.im_files).encode()  # no list kept
        augmentation = json.dumps({"imgsz": ds.img_size, "augment": ds.augment, "hyp": ds.hyp}, sort_keys=True,
                                  default=str)
        return {"images": self.n, "dataset": _digest(names + np.ascontiguousarray(ds.hw, "<i8").tobytes()), "seed": self.seed,
                "world_size": self.world_size, "batch_size": self.batch_size, "shuffle": self.shuffle,
                "drop_last": self.drop_last, "rect": self._rect_batches is not None,
                "augmentation": _digest(augmentation.encode()), "partners": self.engine.sampler.partners}

    def state_dict(self) -> dict[str, Any]:
        """Where the run is, as a small JSON-able dict (torchdata's ``StatefulDataLoader`` convention).

        ``epoch`` and ``position`` (batches of that epoch delivered so far, by the iteration in progress or
        the latest one left unfinished; 0 between epochs), the loader's identity (image count and a digest
        of the image file names and sizes, seed, world size, batch size, shuffle, drop_last, rect, a digest of the
        augmentation settings, partners), the mosaic state, ``rank`` and ``batches`` (for information) and
        ``image_table``, a digest of the epoch's image table (``dataset.indices``; None: none). Save it with the model
        (every rank's is the same but for ``rank``) and hand it to :meth:`load_state_dict` of a loader
        built with the same arguments.
        """
        if self._running is not None:
            progress = self._running
            epoch, position = progress.epoch, progress.position
            table_digest = progress.table_digest
        elif self._resume is not None:
            epoch, position, table_digest = self._resume
        else:
            epoch, position, table_digest = self.epoch, 0, _table_digest(self.image_table)
        return {"format": STATE_FORMAT, "epoch": epoch, "position": position, "batches": len(self),
                "rank": self.rank, **self._identity, "mosaic_closed": self.mosaic_closed,
                "image_table": table_digest}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue where :meth:`state_dict` was taken: the next iteration runs the rest of its epoch.

        It yields exactly the batches an uninterrupted loader would have delivered after ``position``, and
        renders none before them (each batch is a function of the seed, the epoch and its indices); the
        epochs after it are as usual. A trainer that calls :meth:`set_epoch` must call it with the saved
        epoch first. A state of another dataset, seed, world size, batch size, image table or augmentation is
        refused with a ``ValueError`` saying which differs; a state of another rank is taken (every rank
        is at the same place).
        """
        if not isinstance(state, dict) or state.get("format") != STATE_FORMAT:
            got = state.get("format") if isinstance(state, dict) else type(state).__name__
            raise ValueError(f"not a fastload loader state: format {got!r}, expected {STATE_FORMAT!r}")
        missing = [k for k in ("epoch", "position", "mosaic_closed", "image_table", *_STATE_IDENTITY) if k not in state]
        if missing:
            raise ValueError(f"fastload loader state without {', '.join(missing)}")
        for key, what in _STATE_IDENTITY.items():
            if state[key] != self._identity[key]:
                # a planned plan follows this machine's decoded cache, which may hold more or less than the saved run's
                planned = key == "partners" and self.plan.by != "caller"
                how = f"pass partners={state[key]!r}" if planned else "build the loader as the saved run did"
                raise ValueError(f"loader state from another run: {what} differs (saved {state[key]!r}, this loader "
                                 f"{self._identity[key]!r}); {how}")
        epoch, position = int(state["epoch"]), int(state["position"])
        if epoch < 0 or not 0 <= position <= len(self):
            raise ValueError(f"loader state at epoch {epoch}, batch {position}: outside 0..{len(self)} batches per epoch")
        if self.mosaic_closed and not state["mosaic_closed"]:
            raise ValueError("loader state saved with mosaic on, and this loader has closed it; build a new loader")
        if state["mosaic_closed"]:
            self.close_mosaic()
        self.epoch, self._epoch_set, self._running = epoch, False, None
        self._resume = (epoch, position, state["image_table"])

    @property
    def hsv_gains(self) -> torch.Tensor | None:
        """``hsv_on="defer"``: the HSV gains of the latest batch, ``float32 [B, 3]`` on the CPU (every
        engine), to apply with ``fastload.apply_hsv_batch(imgs, loader.hsv_gains)``; None before the
        first batch."""
        return self.engine.hsv_gains

    def stats(self) -> dict[str, Any]:
        """Counters for benchmarks: ``store`` (its kind) plus the engine's :meth:`~fastload.engines.base.Engine.stats`
        (every engine: ``engine``, ``batches``, ``images``, ``worker_pids``, ``partners`` (who chose them:
        ``partners_by``, :data:`PartnersBy`), ``decode_cache_keep`` (what the decoded cache keeps, who chose it:
        ``decode_cache_keep_by``, :class:`CachePlan`), ``decodes``,
        ``decodes_per_image``, ``batches_copied``, the damaged records skipped: ``damaged_records``, ``damaged_record_ids``,
        ``damaged_by_kind``, ``replaced_samples``; the CPU engine adds its decoded cache's hits/misses and
        machine-wide state and the next epoch's batches rendered early, used / dropped)."""
        return {"store": self.store.kind, **self.engine.stats(), "partners_by": self.plan.by,
                "decode_cache_keep": self.cache_plan.keep, "decode_cache_keep_by": self.cache_plan.by}

    def close(self) -> None:
        """Stop workers and release buffers, and the store if :func:`loader` opened it. Idempotent."""
        if self.closed:
            return
        self.closed = True
        self.engine.close()
        if self._owns_store:
            self.store.close()

    def __enter__(self) -> "FastLoader":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        task = self.engine.settings.task
        return (f"FastLoader(engine={self.engine.name}, store={self.store.kind}, "
                + ("" if task == "detect" else f"task={task}, ")
                + f"n={self.n}, batch_size={self.batch_size}, batches={len(self)}, rank={self.rank}/{self.world_size}"
                + (f", {self.plan}" if self.engine.sampler.draws_mosaics else "")
                + (f", {self.cache_plan})" if self.cache_plan.keep == "latest" else ")"))


def _epoch_order(n: int, batch_size: int, shards: Shards | None, **settings) -> _order.EpochOrder:
    """The order of these settings; a store read in shards visits them shard by shard."""
    if shards is None:
        return _order.EpochOrder(n, batch_size, **settings)
    return _order.EpochOrder(n, batch_size, **settings, shards=shards.ids, window=shards.window)


def _resolve_world(rank: int, world_size: int | None) -> tuple[int, int]:
    if world_size is None:
        if rank < 0:
            return -1, 1
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            return rank, torch.distributed.get_world_size()
        return rank, int(os.environ.get("WORLD_SIZE", "1"))
    return rank, int(world_size)


def _filter(labels: Sequence[np.ndarray], min_items: int, single_cls: bool) -> tuple[np.ndarray, FlatLabels]:
    """The images with at least ``min_items`` labels, and their labels (every class 0 with ``single_cls``)."""
    flat = FlatLabels.from_arrays(labels)
    keep = np.flatnonzero(flat.counts >= min_items) if min_items > 0 else np.arange(len(flat), dtype=np.int64)
    out = flat if len(keep) == len(flat) else flat.subset(keep)
    if single_cls:
        rows = out.rows.copy()
        rows[:, 0] = 0
        out = FlatLabels(rows, out.offsets, out.points, out.point_offsets)
    return keep, out


def _check_task_options(task: str, recipe: str, mask_ratio: int | None, overlap_mask: bool | None) -> None:
    """Refuse a task fastload does not know, one its recipe has no reference for, and mask options without masks."""
    if task not in TASKS:
        raise ValueError(f"task must be one of {', '.join(TASKS)}, got {task!r}")
    for name, value in (("mask_ratio", mask_ratio), ("overlap_mask", overlap_mask)):
        if value is not None and task != "segment":
            raise ValueError(f"{name}={value!r} applies to task='segment' only (task={task!r}); leave it unset")
    if task in ("pose", "obb") and recipe == "yolov9":
        raise ValueError(f"task={task!r} needs recipe='ultralytics' (the official YOLOv9 repository has no {task} "
                         f"loader to follow)")


def _check_task_labels(task: str, store: StoreView, recipe: str, augment: bool, overlap_mask: bool) -> None:
    """Refuse labels without what ``task`` reads: polygons (segment), keypoints (pose), 4-corner polygons (obb); and
    rows without points (label files of box rows only) in a segment or obb set, where the reference fails on them."""
    if task == "detect":
        return
    labels, geometry = store.labels, store.meta.get("geometry") or {}
    dim = None if labels.points is None else labels.points.shape[1]
    if task == "pose":
        if dim != 3 or not geometry.get("kpt_shape"):
            raise ValueError(f"task='pose' needs keypoint labels (kpt_shape in the data yaml); {store.base!r} has "
                             f"{'none' if dim is None else 'polygons'}")
        return
    if dim != 2:
        what = "box rows only" if dim is None else "keypoints (task='pose')"
        raise ValueError(f"task={task!r} needs polygon labels (class x1 y1 x2 y2 ...); {store.base!r} has {what}")
    counts = labels.point_counts
    if counts is None:
        return

    def label_file(row: int) -> str:
        return label_paths([store.im_files[int(np.searchsorted(labels.offsets, row, side="right") - 1)]])[0]

    pointless = np.flatnonzero(counts == 0)
    # YOLOv9's validation with one mask per instance keeps such a row's box with an empty mask (so does fastload);
    # its training (random_perspective) and overlap masks fail on it, Ultralytics refuses the set (YOLODataset)
    if len(pointless) and not (recipe == "yolov9" and not augment and not overlap_mask):
        reference = ("Ultralytics refuses such a set" if recipe == "ultralytics" else
                     "the official YOLOv9 loader fails on it in training and with overlap masks")
        raise ValueError(f"task={task!r} needs a polygon on every row; {label_file(int(pointless[0]))} has box rows "
                         f"only ({reference}): give its objects as polygons, or train task='detect'")
    if task == "obb" and (counts != 4).any():
        row = int(np.flatnonzero(counts != 4)[0])
        raise ValueError(f"task='obb' needs 4-corner polygons (class x1 y1 ... x4 y4); "
                         f"{label_file(row)} has a row of {int(counts[row])} points")


def loader(
    data: Any,
    split: str = "train",
    imgsz: int = 640,
    batch_size: int = 16,
    *,
    hyp: Any = None,
    augment: bool = True,
    store: str | Store = "auto",
    engine: str = "cpu",
    workers: int | None = None,
    shuffle: bool = True,
    rect: bool = False,
    stride: int = 32,
    pad: float | None = None,
    seed: int = 0,
    rank: int = -1,
    world_size: int | None = None,
    close_mosaic: int = 0,
    epochs: int | None = None,
    min_items: int = 0,
    single_cls: bool = False,
    drop_last: bool = False,
    device: str | torch.device | None = None,
    hsv_on: HSVMode | None = None,
    layout: Layout = "nhwc",
    prefetch: int = 2,
    partners: Partners | None = None,
    strict: bool = False,
    recipe: Recipe = "yolov9",
    task: Task = "detect",
    mask_ratio: int | None = None,
    overlap_mask: bool | None = None,
    engine_options: Any = None,
) -> FastLoader:
    """Build a YOLOv9-compatible loader.

    Iterating yields YOLOv9 batches ``(imgs, targets, paths, shapes)``: ``imgs`` uint8
    ``[B, 3, H, W]`` RGB, ``targets`` float32 ``[N, 6]`` (index in batch, cls, xc, yc, w, h)
    normalised, ``paths`` tuple of str, ``shapes`` tuple (None for mosaic samples, else
    ``((h0, w0), ((h / h0, w / w0), (padw, padh)))``); with ``task`` other than ``"detect"`` a fifth field,
    the masks, keypoints or oriented boxes (:data:`~fastload.engines.base.BATCH_TYPES`). A batch is the caller's while it holds any
    tensor of it: it never changes, on every engine (docs/loader.md, "Batches are yours to keep").

    The keywords up to ``strict`` mean the same for every engine (an engine that cannot honour
    one refuses it with :class:`~fastload.engines.base.EngineOptionError`); what only one engine
    has goes in ``engine_options``.

    Args:
        data: a ``data.yaml`` path, a dict with the same keys, a ``DataConfig`` or an open ``Store``
            (then ``split`` and ``store`` are ignored), or ``s3://bucket/prefix[/data.yaml]``: one of the split's
            uploaded stores streamed in shards, as ``upload_kind="auto"`` picks it: the ``disk`` store when the
            upload holds one at ``imgsz``, else the ``encoded`` store (docs/object-storage.md; the kind read, the
            cache and retry options through ``open_store(url, split, kind="stream", upload_kind=..., cache_dir=...,
            cache_bytes=..., retry_seconds=...)`` passed as ``data``; the retry budget's default is
            ``$FASTLOAD_RETRY_SECONDS``, else 600 s).
            A ``Store`` passed in (here or as ``store``) stays open when the loader closes: it is the
            caller's to close.
        split: ``train``, ``val`` or ``test``.
        imgsz: output size (long side of loaded images; training batches are imgsz x imgsz).
        batch_size: images per batch (per rank).
        hyp: augmentation hyper-parameters: yaml path, dict or None (YOLOv9 ``hyp.scratch-high``).
        augment: apply training augmentation (mosaic, mixup, perspective, HSV, flips). False:
            letterbox only (validation). The loaded image is the ``recipe``'s (its loaded-image rule:
            :data:`fastload.data.images.LoadRule`). As in YOLOv9's ``load_image``, every engine shrinks images
            from encoded stores (files, lmdb) with INTER_LINEAR in training and INTER_AREA in
            validation; decoded stores (disk, ram, gpu) of that rule hold images shrunk once, with INTER_AREA
            (disk/ram record it: ``store.meta["shrink"]``). ``recipe="ultralytics"``: sizes rounded up and
            INTER_LINEAR always, as Ultralytics' ``load_image``; a decoded store must have been made with that rule
            (``fastload convert --load-rule ultralytics``; a ram store built on demand has a segment per rule).
        store: ``auto`` (the fastest store ``fastload convert`` recorded for this split and imgsz:
            ram > disk > lmdb > files), one of ``files | lmdb | disk | ram``, ``gpu`` (decoded images
            resident on ``device``; ``engine="gpu"`` only), or a ``Store``.
        engine: ``cpu`` (worker processes), ``gpu`` (PyTorch on ``device``), ``dali`` or ``ray``
            (Ray actors on the machines of a Ray cluster: ``pip install "fastload[ray]"``).
        workers: the engine's worker processes, persistent across epochs: ``cpu``: render
            processes (0: render in the calling process); ``dali``: external-source processes
            (>= 1); ``gpu``: none (0); ``ray``: none (0; its actors: ``RayOptions(actors=N)``).
            ``None``: the engine's default (8 for cpu and dali, 0 for gpu and ray).
        shuffle: new permutation every epoch (a function of ``seed`` and the epoch). Ignored in rect mode.
        rect: validation-style rectangular batches: images sorted by aspect ratio, each batch
            letterboxed to its own ``stride``-multiple shape, no shuffle, no mosaic.
        stride: model stride: ``imgsz`` must be a multiple of it, and rect batch shapes are.
        pad: rect shape padding in strides (YOLOv9 validation uses 0.5; ``None``: 0); only with ``rect=True``
            (refused without it: nothing else is padded).
        seed: seed of the order and of every augmentation draw; the same seed gives the same batches
            whatever the number of workers.
        rank, world_size: DDP sharding like ``DistributedSampler``: each rank gets a disjoint, equally
            sized part of every epoch. ``rank=-1``: not distributed. ``world_size=None``: taken from
            ``torch.distributed`` (or ``$WORLD_SIZE``) when ``rank >= 0``.
        close_mosaic: switch mosaic/mixup off for the last ``close_mosaic`` epochs; needs ``epochs``
            and works through :meth:`FastLoader.set_epoch` (or call ``loader.close_mosaic()`` yourself).
        epochs: total epochs of the run (only used by ``close_mosaic``).
        min_items: drop images with fewer labels than this.
        single_cls: map every class to 0.
        drop_last: drop the last incomplete batch (and, under DDP, the tail instead of padding).
        device: where batches are delivered (``None``: the CPU for ``engine="cpu"``, else the current
            CUDA device, or the CPU without one). The CPU engine copies each batch there.
        hsv_on: where the HSV augmentation happens, the same for every engine: ``"worker"`` (by the
            engine while it renders), ``"consumer"`` (on the whole batch on ``device`` as it is
            delivered, by :func:`fastload.apply_hsv_batch`; nearly free on a GPU) or ``"defer"`` (not
            applied: after each batch ``loader.hsv_gains`` holds its ``float32 [B, 3]`` gains on the
            CPU, e.g. ``imgs = fastload.apply_hsv_batch(imgs.to(dev), loader.hsv_gains)``). HSV is a
            large share of a sample's CPU cost (``benchmarks/loader_throughput.py`` prints the loader
            with HSV in the workers and deferred side by side). ``None``: the engine's default, the first of
            its :attr:`~fastload.engines.base.Engine.hsv_modes` (``"worker"`` for cpu, gpu and ray;
            ``"consumer"`` for dali, which refuses ``"worker"``: its graph has no HSV step).
        layout: memory order of ``imgs``, the same for every engine: ``"nhwc"`` (channels-last; the
            engines produce HWC pixels, so this costs no copy) or ``"nchw"`` (contiguous; one
            transposing copy per image).
        prefetch: batches prepared ahead of the one being consumed (per worker for ``cpu``; by the
            background thread for ``gpu``, 0: none; DALI's queue depth, >= 1, for ``dali``; per actor,
            >= 1, for ``ray``).
        partners: where a mosaic's three partners (and the mixup image with its partners) come from:
            ``"dataset"`` (YOLOv9: drawn uniformly from all images) or ``"batch"`` (drawn uniformly
            from the images of the same batch, so a batch decodes each of its ``B`` images once,
            about 1 decode per output image instead of 4.6; each image's expected uses per epoch
            are unchanged, but a batch's tiles come from its own ``B`` images only). ``None``: planned
            (:class:`PartnerPlan`, shown in ``repr(loader)`` and ``stats()["partners_by"]``): the engine's
            default (``"dataset"`` for ``cpu``, ``gpu`` and ``ray``, ``"batch"`` for ``dali``; each engine's
            docstring says why), but ``"batch"`` for a store streamed from object storage (it holds only a few
            shards at a time) and, for the engines with a decoded-image cache (``cpu``, ``ray``) on an encoded
            store, when the dataset's loaded pixels at ``imgsz`` exceed what the cache can hold
            (``decode_cache_mb``, within 9/10 of the shared-memory filesystem): with YOLOv9's draw that cache
            would serve few partners and every output image would cost about 4.6 decodes. ``"recent"``:
            Ultralytics' buffer (without ``cache="ram"``): drawn uniformly from the images of the last
            ``min(n, 8 * batch_size, 1000) - 1`` positions of this rank's epoch order up to the sample's own (a
            function of the seed and the order, whatever the workers; not with an image table). Only training batches with mosaic have partners: passing
            ``"batch"`` or ``"recent"`` to a loader that draws no mosaic (``augment=False``, ``rect=True``, hyp
            ``mosaic: 0``) raises ``ValueError``.
        strict: what a record that fails its check at load time does (an LMDB crc mismatch, a truncated or
            undecodable image, a disk/ram record whose pixels no longer match their checksum, checked on
            its first read in each process). False (the default): it is skipped: warned once (a
            ``DamagedRecordWarning`` naming ``<store path>, record N (<source file>)``), counted in
            :meth:`FastLoader.stats` (``damaged_records``, ``damaged_record_ids``, ``damaged_by_kind``,
            ``replaced_samples``), and every sample that reads it is drawn again with a replacement draw
            that depends only on ``(seed, epoch, index, attempt)``, so batches stay the same for any
            worker count. True: the loader raises that one-line
            :class:`~fastload.store.base.DamagedRecordError` (a ``StoreError``) instead, from any worker.
        recipe: whose augmentation distributions the training batches are drawn with, with ``hyp``'s values
            (:data:`~fastload.augment.params.Recipe`): ``"yolov9"`` or ``"ultralytics"`` (Ultralytics 8.4's
            ``v8_transforms``, with its loaded image; docs/ultralytics.md says what of it is implemented). Its additive-hue HSV has
            numpy and torch kernels: ``engine="dali"`` and ``hsv_on="defer"`` (whose caller applies YOLOv9's
            rule) raise ``ValueError``.
        task: what the batches carry beside the boxes, read from the labels' points (docs/loader.md, "Tasks"):
            ``"detect"`` (:class:`~fastload.engines.base.Batch`), ``"segment"`` (polygon labels;
            :class:`~fastload.engines.base.SegmentBatch`, masks as the official YOLOv9 segment loader collates
            them), ``"pose"`` (keypoint labels, ``kpt_shape`` in the data yaml; ``recipe="ultralytics"``;
            :class:`~fastload.engines.base.PoseBatch`) or ``"obb"`` (4-corner polygon labels;
            ``recipe="ultralytics"``; :class:`~fastload.engines.base.OBBBatch`). Boxes of the other tasks are
            re-derived from their moved points, as the references do. Engines without the task refuse it
            (:attr:`~fastload.engines.base.Engine.tasks`: ``cpu`` renders every task).
        mask_ratio: ``task="segment"`` only: masks are ``1 / mask_ratio`` of the image on each side (``None``: 4, the
            official ``--mask-ratio``).
        overlap_mask: ``task="segment"`` only: one overlap mask per image (``None``: True) or one per instance
            (False: the official ``--no-overlap``).
        engine_options: what only the chosen engine has: a :class:`~fastload.CPUOptions`,
            :class:`~fastload.TorchGPUOptions`, :class:`~fastload.DALIOptions` or
            :class:`~fastload.RayOptions`, or a dict of its
            fields (e.g. ``{"decode_cache_mb": 0}`` for ``engine="cpu"``). ``None``: the defaults.

    Returns a :class:`FastLoader`; ``loader.dataset`` exposes ``labels``, ``shapes``, ``im_files``,
    ``label_files``, ``n``, ``names`` for the trainer.
    """
    cls = engine_class(engine)
    options = resolve_options(engine, engine_options)
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    if isinstance(imgsz, bool) or not isinstance(imgsz, (int, np.integer)) or imgsz < stride or imgsz % stride:
        # a model concatenates feature maps of stride 8..stride: other sizes fail in its forward pass
        near = max(stride, round(float(imgsz) / stride) * stride) if isinstance(imgsz, (int, float, np.number)) else 640
        raise ValueError(f"imgsz must be a positive multiple of the stride {stride}, got {imgsz!r}; use e.g. {near}")
    if pad is not None and not rect:
        raise ValueError(f"pad={pad!r} pads rect batch shapes and applies only with rect=True; leave it unset")
    pad = 0.0 if pad is None else float(pad)
    hsv_on = cls.hsv_modes[0] if hsv_on is None else hsv_on
    if workers is not None and workers < 0:
        raise ValueError(f"workers must be >= 0 (0 renders in the calling process), got {workers}")
    if hsv_on == "consumer" and cls.renders_on == "host" and (device is None or torch.device(device).type == "cpu"):
        warnings.warn("fastload.loader: hsv_on='consumer' without a GPU device applies HSV in the main process "
                      "with torch ops (slow on a CPU); use hsv_on='worker' there")
    if recipe not in RECIPES:
        raise ValueError(f"recipe must be one of {', '.join(RECIPES)}, got {recipe!r}")
    if augment and recipe == "ultralytics" and hsv_on == "defer":  # apply_hsv_batch's caller would not know the rule
        raise ValueError(f"recipe='ultralytics' (additive-hue HSV) is applied in the workers or on the consumer, "
                         f"not deferred (hsv_on={hsv_on!r})")
    _check_task_options(task, recipe, mask_ratio, overlap_mask)
    rank, world_size = _resolve_world(rank, world_size)
    settings = EngineSettings(batch_size=batch_size, workers=cls.default_workers if workers is None else int(workers),
                              device=device, hsv_on=hsv_on, layout=layout, prefetch=prefetch, world_size=world_size,
                              strict=bool(strict), task=task, mask_ratio=4 if mask_ratio is None else mask_ratio,
                              overlap_mask=True if overlap_mask is None else bool(overlap_mask))
    if partners is not None and partners not in PARTNERS:
        raise ValueError(f"partners must be None or one of {', '.join(PARTNERS)}, got {partners!r}")
    owns_store = not isinstance(data, Store) and not isinstance(store, Store)
    if isinstance(data, Store):
        base = data
    elif isinstance(store, Store):
        base = store
    else:
        # a store in device memory is filled on the loader's device
        on_device = store != "auto" and not store_kind(store).on_host
        base = open_store(data, split=split, kind=store, imgsz=imgsz, load_rule=recipe,
                          **({"device": device} if on_device else {}))
    try:
        base.check_load_rule(recipe)  # a decoded store passed in must hold the recipe's loaded images
        keep_idx, labels = _filter(base.labels, int(min_items), bool(single_cls))
        if len(keep_idx) == 0:
            raise ValueError(f"no images left in {base!r} (min_items={min_items})")
        view = StoreView(base, keep_idx, labels)
        _check_task_labels(task, view, recipe, bool(augment), settings.overlap_mask)
        if single_cls:
            view.names = ["item"]
        hyp_d = load_hyp(hyp)
        flips = float(hyp_d["fliplr"]) > 0 or float(hyp_d["flipud"]) > 0
        if task == "pose" and augment and flips and not (view.meta.get("geometry") or {}).get("flip_idx"):
            # as Ultralytics' v8_transforms: a flip without flip_idx would swap the body's sides
            warnings.warn("fastload.loader: the data yaml has no flip_idx for its keypoints; fliplr and flipud set "
                          "to 0.0 (as Ultralytics)")
            hyp_d = {**hyp_d, "fliplr": 0.0, "flipud": 0.0}
        # copy-paste (hyp copy_paste) pastes segment instances: the segment task's training samples only, as both
        # references (a detection loader with the same hyp draws none)
        paste = {}
        if task == "segment" and augment and not rect and float(hyp_d.get("copy_paste", 0.0)) > 0:
            paste = {"copy_paste": float(hyp_d["copy_paste"]), "instances": view.labels.counts}
        loaded_hw = loaded_shapes(view.shapes, imgsz, recipe)

        rect_batches = batch_shapes = rect_shapes = None
        if rect:
            if shuffle and split == "train":
                LOG.info("rect batches are not shuffled")
            order_idx, batch_shapes = rect_batch_shapes(view.shapes, batch_size, imgsz, stride=stride, pad=pad)
            rect_shapes = per_index_shapes(order_idx, batch_shapes, batch_size)
            rect_batches = _order.rect_order(order_idx, batch_size, rank=rank, world_size=world_size)
        shards = None if rect else view.shards()
        # training batches draw partners (the ultralytics recipe's mixup too, with mosaic 0); rect ones never do
        plan = _partner_plan(partners, cls, options, view, imgsz, recipe, shards, training=augment and not rect)
        recent = {}
        if plan.partners == "recent":  # the window runs over the epoch order this rank renders (FastLoader.epoch_order)
            recent = {"epoch_order": _epoch_order(len(view), batch_size, shards, seed=seed, shuffle=shuffle and not rect,
                                                  rank=rank, world_size=world_size, drop_last=drop_last),
                      "window": recent_window(len(view), batch_size)}
        sampler = ParamSampler(loaded_hw, hyp_d, imgsz, augment=augment, seed=seed, rect_shapes=rect_shapes,
                               orig_shapes=view.shapes, partners=plan.partners, recipe=recipe,
                               **recent, **paste)
        if partners in ("batch", "recent") and not sampler.draws_mosaics:
            raise ValueError(f"partners={partners!r} applies to mosaic training batches only, and this loader draws no "
                             f"mosaic (augment={augment}, rect={rect}, hyp mosaic={hyp_d['mosaic']}); leave partners unset")
        cache_plan = _cache_plan(options, view, imgsz, recipe, plan, settings, recent.get("window"),
                                 training=sampler.draws_mosaics)
        if cache_plan.by == "planned" and cache_plan.keep is not None:
            options = dataclasses.replace(options, decode_cache_keep=cache_plan.keep)
        eng = cls(view, sampler, settings, options)
    except BaseException:
        if owns_store:
            base.close()
        raise
    dataset = functools.partial(LoaderDataset, view=view, img_size=imgsz, augment=augment, hyp=hyp_d, rect=rect,
                                stride=stride, pad=pad, batch_shapes=batch_shapes)
    fl = FastLoader(engine=eng, dataset=dataset, store=base, n=len(view), batch_size=batch_size, seed=seed,
                    shuffle=shuffle and not rect, rank=rank, world_size=world_size, drop_last=drop_last,
                    rect_batches=rect_batches, close_mosaic_epochs=int(close_mosaic), epochs=epochs,
                    owns_store=owns_store, shards=shards, plan=plan, cache_plan=cache_plan)
    if plan.by == "cache-too-small" or cache_plan.keep == "latest":
        LOG.info("fastload: %r", fl)
    if close_mosaic and epochs is None:
        warnings.warn("fastload.loader: close_mosaic needs epochs=...; call loader.close_mosaic() yourself")
    return fl
