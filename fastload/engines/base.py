"""The contract every augmentation engine implements, and the small pieces engines share.

An engine turns a list of dataset indices into YOLOv9 batches. It never decides *what* to draw:
the :class:`~fastload.augment.params.ParamSampler` does (one record per output sample, a pure
function of ``(seed, epoch, index)``); engines only apply records, so the CPU, PyTorch and DALI
engines produce the same boxes for the same seed. The loader owns the order
(:func:`fastload.order.epoch_indices`) and hands each engine a :class:`~fastload.store.view.StoreView`
(the store as the loader sees it: after ``min_items`` filtering and ``single_cls``).

What an engine is told comes in two parts:

* :class:`EngineSettings`: the settings every engine honours in the same way (or refuses with an
  :class:`EngineOptionError` naming the engine and the setting);
* the engine's own options, a frozen dataclass declared beside it (``CPUOptions``,
  ``TorchGPUOptions``, ``DALIOptions``) whose fields document themselves.

Derived data (loaded shapes, the largest output size, the loaded-image rule, the filter loaded images shrink
with: :attr:`Engine.shrink`) is read from the sampler, the same way by every engine; the world size comes
with the settings.

The last steps of every batch are shared (:meth:`Engine.iter_batches`): HSV gains an engine left
unapplied are applied to the whole batch (``hsv_on="consumer"``, by
:func:`~fastload.augment.functional.torch_ops.apply_hsv_batch`) or handed to the caller
(``hsv_on="defer"``: :attr:`Engine.hsv_gains`), and ``imgs`` gets the memory order ``layout`` asks for.
"""
from __future__ import annotations

import abc
import importlib
import itertools
import warnings
from dataclasses import dataclass
from typing import Any, ClassVar, Generator, Iterator, Literal, NamedTuple, Sequence, get_args

import numpy as np
import torch

from fastload.augment.functional.tiles import AXIS_KERNELS, AxisKernel
from fastload.augment.functional.torch_ops import apply_hsv_batch
from fastload.augment.params import ParamSampler, Partners
from fastload.augment.task_labels import TaskLabels
from fastload.data.images import JPEG_DECODERS, ShrinkFilter, shrink_filter
from fastload.engines.shm_cache import CACHE_KEEPS, CacheKeep
from fastload.store.base import DAMAGE_KINDS, DamagedRecordError, ReadAhead, Store
from fastload.store.kinds import STORE_KINDS

HSVMode = Literal["worker", "consumer", "defer"]
HSV_MODES: tuple[str, ...] = get_args(HSVMode)
Layout = Literal["nhwc", "nchw"]
LAYOUTS: tuple[str, ...] = get_args(Layout)
#: What a loader's batches carry beside the boxes: nothing (``"detect"``), instance masks (``"segment"``),
#: keypoints (``"pose"``) or oriented boxes (``"obb"``); :data:`BATCH_TYPES` names each task's batch.
Task = Literal["detect", "segment", "pose", "obb"]
TASKS: tuple[str, ...] = get_args(Task)
_MEMORY_FORMAT = {"nhwc": torch.channels_last, "nchw": torch.contiguous_format}


class WorkerError(RuntimeError):
    """An engine's worker (a CPU worker process, a Ray render actor) died, hung or raised an exception that is
    not fastload's; the message is one line saying which one, on which batch, and why.

    Attributes:
        worker_exception: the qualified name of the exception the worker raised (``"builtins.ZeroDivisionError"``);
            None when the worker died or gave no answer.
        worker_traceback: that exception's traceback in the worker (also a note on this error, so a logged or
            uncaught error shows it); None when ``worker_exception`` is.
    """

    worker_exception: str | None = None
    worker_traceback: str | None = None


@dataclass(frozen=True)
class WorkerFailure:
    """An exception a worker process or render actor raised, as the plain values that cross to the consumer (no
    pickle): its class's ``module`` and ``qualname``, its one-line ``message`` (``str(exc)``) and the
    ``traceback`` text. :meth:`exception` turns it back into what the consumer raises."""

    module: str
    qualname: str
    message: str
    traceback: str

    @classmethod
    def of(cls, exc: BaseException, traceback_text: str) -> "WorkerFailure":
        # a file name's undecodable bytes (surrogate escapes) cannot be encoded for the consumer: shown escaped
        def sendable(text: str) -> str:
            return text.encode("utf-8", "backslashreplace").decode("utf-8")

        return cls(type(exc).__module__, type(exc).__qualname__, sendable(str(exc)), sendable(traceback_text))

    def fields(self) -> list[str]:
        """The failure as plain values (for a worker's message to the consumer)."""
        return [self.module, self.qualname, self.message, self.traceback]

    @classmethod
    def from_fields(cls, fields: Sequence[str]) -> "WorkerFailure":
        return cls(*(str(f) for f in fields))

    def exception(self, worker: str, task: str) -> Exception:
        """The error to raise in the consumer for this failure of ``worker`` (e.g. ``"fastload worker 1 (pid 42)"``)
        on ``task`` (e.g. ``"batch 3"``).

        A fastload exception comes back as its own type with the same message, the one line the consumer would
        have raised rendering in-process, where its class rebuilds that message from it alone (``cls(message)``);
        anything else (another library's or Python's exception, a fastload class that needs more than a message)
        becomes a one-line :class:`WorkerError` naming the worker, the task and the exception. Either way the
        worker's traceback is kept: ``worker_traceback``, and a note that Python's traceback display and logging
        show (the command lines print only the line, unless ``--debug``)."""
        exc = self._rebuilt()
        if exc is None:
            name = self.qualname if self.module == "builtins" else f"{self.module}.{self.qualname}"
            line = " ".join(self.message.split())  # the message of a foreign exception may span lines
            exc = WorkerError(f"{worker} failed on {task}: {name}" + (f": {line}" if line else ""))
            exc.worker_exception = f"{self.module}.{self.qualname}"
        return with_worker_traceback(exc, worker, task, self.traceback)

    def _rebuilt(self) -> Exception | None:
        """The fastload exception of this class and message, or None where it cannot be rebuilt faithfully."""
        if self.module != "fastload" and not self.module.startswith("fastload."):
            return None  # only fastload's own classes are trusted to be rebuilt from a name
        try:
            found: Any = importlib.import_module(self.module)
            for part in self.qualname.split("."):
                found = getattr(found, part)
        except (ImportError, AttributeError):
            return None
        if not (isinstance(found, type) and issubclass(found, Exception)):
            return None
        try:
            exc = found(self.message)
        except Exception:  # a class whose constructor takes other arguments
            return None
        # a class that builds its message from its arguments would not say the same thing
        return exc if str(exc) == self.message else None


def with_worker_traceback(exc: Exception, worker: str, task: str, traceback_text: str) -> Exception:
    """``exc``, raised in the consumer for what ``worker`` met on ``task``, with the traceback it had there kept on it:
    ``worker_traceback``, and a note that Python's traceback display and logging show."""
    exc.worker_traceback = traceback_text  # type: ignore[attr-defined]
    # what add_note() sets (Python 3.11+, which displays it; 3.10 has neither and ignores the attribute)
    exc.__notes__ = [f"raised by {worker} on {task}; its traceback there:\n{traceback_text.rstrip()}"]
    return exc


class DamagedRecordWarning(UserWarning):
    """A damaged record was skipped (``loader(strict=False)``): said once per record, by the consumer."""


class EngineOptionError(TypeError, ValueError):
    """An option an engine does not take, or a value it cannot honour; the message names both.

    A ``TypeError`` (like an unexpected keyword) and a ``ValueError`` (like a bad value) at once.
    """


@dataclass(frozen=True, kw_only=True)
class HostRenderOptions:
    """The options of the engines that run the host renderer (:class:`~fastload.engines.cpu_render.BatchRenderer`)
    in other processes (``cpu``, ``ray``), shared by their options classes, which document them; keyword-only.
    A subclass names its engine in ``engine`` (for messages) and checks its own fields in ``__post_init__``
    before calling this one."""

    engine: ClassVar[str] = ""
    timeout: float = 0.0
    decode_cache_mb: int | None = None
    decode_cache_keep: CacheKeep | None = None
    decode_scale: Literal["full", "reduced"] = "full"
    axis_kernel: AxisKernel | None = None
    jpeg_decoder: str | None = None

    def __post_init__(self) -> None:
        if self.timeout < 0:
            raise self.bad(f"timeout must be >= 0, got {self.timeout}")
        if self.decode_cache_mb is not None and self.decode_cache_mb < 0:
            raise self.bad(f"decode_cache_mb must be None or >= 0, got {self.decode_cache_mb}")
        if self.decode_cache_keep is not None and self.decode_cache_keep not in CACHE_KEEPS:
            raise self.bad(f"decode_cache_keep must be None or one of {', '.join(CACHE_KEEPS)}, got {self.decode_cache_keep!r}")
        if self.decode_scale not in ("full", "reduced"):
            raise self.bad(f"decode_scale must be 'full' or 'reduced', got {self.decode_scale!r}")
        if self.jpeg_decoder is not None and self.jpeg_decoder not in JPEG_DECODERS:
            raise self.bad(f"jpeg_decoder must be None or one of {', '.join(JPEG_DECODERS)}, got {self.jpeg_decoder!r}")
        if self.axis_kernel is not None and self.axis_kernel not in AXIS_KERNELS:
            raise self.bad(f"axis_kernel must be None or one of {', '.join(AXIS_KERNELS)}, got {self.axis_kernel!r}")

    def bad(self, what: str) -> EngineOptionError:
        """The error for an option value this engine cannot take."""
        return EngineOptionError(f"engine {self.engine!r}: {what}")


@dataclass(frozen=True)
class EngineSettings:
    """The settings every engine honours the same way (``loader()``'s common keywords).

    What each engine does with each setting, and which values it refuses, is one table: docs/design.md
    ("fastload.engines and fastload.fastloader"), which ``tests/test_settings_table.py`` holds to the engines'
    declarations (:attr:`Engine.renderers`, :attr:`Engine.min_workers`, :attr:`Engine.min_prefetch`,
    :attr:`Engine.hsv_modes`, :attr:`Engine.accepts_gpu_store`).

    Attributes:
        batch_size: samples per batch; ``iter_batches`` cuts its indices into chunks of this size
            (the last one may be smaller).
        workers: the engine's host-side worker processes (0: none, or rendering in the calling process).
        device: where ``imgs`` and ``targets`` are delivered (``None``: the engine's default: the CPU for
            engines that render on the host, the current CUDA device, else the CPU, for those that render
            on a device; :attr:`Engine.renders_on`).
        hsv_on: ``"worker"``: HSV is applied by the engine while it renders; ``"consumer"``: applied to
            the whole batch on ``device`` when it is delivered, in the consumer's thread; ``"defer"``: not
            applied; :attr:`Engine.hsv_gains` holds the latest batch's gains.
        layout: memory order of ``imgs`` (always shaped ``[B, 3, H, W]``): ``"nhwc"``: channels-last
            (``imgs.is_contiguous(memory_format=torch.channels_last)``); ``"nchw"``: contiguous.
        prefetch: batches prepared ahead of the one being consumed.
        world_size: ranks of the job (the Ray engine's default actor count splits the cluster's CPUs
            between the ranks).
        strict: a record that fails its check at load time (:class:`~fastload.store.base.DamagedRecordError`)
            stops the loader with that one-line error; False (the default): it is skipped, warned once and
            counted in :meth:`Engine.stats`, and every sample that reads it is drawn again
            (:meth:`~fastload.augment.params.ParamSampler.first_usable`).
        task: what the batches carry beside the boxes (:data:`TASKS`; :data:`BATCH_TYPES`); an engine renders the
            tasks it declares (:attr:`Engine.tasks`) and refuses the others.
        mask_ratio: ``"segment"``: masks are ``1 / mask_ratio`` of the output size on each side.
        overlap_mask: ``"segment"``: one overlap mask per image (instance ``k`` of the image, in the targets' order,
            is the value ``k + 1``), else one mask per instance.
    """

    batch_size: int
    workers: int = 0
    device: str | torch.device | None = None
    hsv_on: HSVMode = "worker"
    layout: Layout = "nhwc"
    prefetch: int = 2
    world_size: int = 1
    strict: bool = False
    task: Task = "detect"
    mask_ratio: int = 4
    overlap_mask: bool = True

    def __post_init__(self) -> None:
        if self.batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {self.batch_size}")
        if self.workers < 0:
            raise ValueError(f"workers must be >= 0, got {self.workers}")
        if self.hsv_on not in HSV_MODES:
            raise ValueError(f"hsv_on must be one of {', '.join(HSV_MODES)}, got {self.hsv_on!r}")
        if self.layout not in LAYOUTS:
            raise ValueError(f"layout must be one of {', '.join(LAYOUTS)}, got {self.layout!r}")
        if self.prefetch < 0:
            raise ValueError(f"prefetch must be >= 0, got {self.prefetch}")
        if self.world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {self.world_size}")
        if self.task not in TASKS:
            raise ValueError(f"task must be one of {', '.join(TASKS)}, got {self.task!r}")
        if isinstance(self.mask_ratio, bool) or not isinstance(self.mask_ratio, (int, np.integer)) or self.mask_ratio < 1:
            raise ValueError(f"mask_ratio must be an integer >= 1, got {self.mask_ratio!r}")


class Batch(NamedTuple):
    """One YOLOv9 batch; unpacks as ``imgs, targets, paths, shapes``.

    imgs: ``uint8 [B, 3, H, W]`` RGB in the memory order of the engine's ``layout``.
    targets: ``float32 [N, 6]`` rows ``(index in batch, cls, xc, yc, w, h)`` normalised to ``W, H``.
    paths: the source image path of every sample.
    shapes: per sample ``None`` (mosaic) or ``((h0, w0), ((h / h0, w / w0), (padw, padh)))``.
    """

    imgs: torch.Tensor
    targets: torch.Tensor
    paths: tuple[str, ...]
    shapes: tuple[Any, ...]


class SegmentBatch(NamedTuple):
    """A ``task="segment"`` batch; unpacks as ``imgs, targets, paths, shapes, masks`` (the official YOLOv9
    ``LoadImagesAndLabelsAndMasks.collate_fn``'s).

    imgs, targets, paths, shapes: as :class:`Batch`; with overlap masks each image's targets are ordered by
    decreasing mask area, as the official loader reorders them.
    masks: ``overlap_mask=True``: ``[B, H / r, W / r]``, the value ``k + 1`` where the image's ``k``-th instance (in
    the targets' order) is the smallest one covering the pixel, 0 elsewhere; ``False``: ``[N, H / r, W / r]`` 0/1,
    one per target row. ``r`` is ``mask_ratio``. ``uint8`` (``int32`` when an image has more than 255 instances),
    ``float32`` when an image of the batch has no polygon: no instance, or box rows only (kept by YOLOv9's validation
    with one mask per instance); the official collate's concatenation promotes its empty float masks.
    """

    imgs: torch.Tensor
    targets: torch.Tensor
    paths: tuple[str, ...]
    shapes: tuple[Any, ...]
    masks: torch.Tensor


class PoseBatch(NamedTuple):
    """A ``task="pose"`` batch; unpacks as ``imgs, targets, paths, shapes, keypoints``.

    keypoints: ``float32 [N, K, 3]`` ``(x, y, visibility)``, x and y normalised to ``W, H``, one per target row
    (flipped keypoints reordered through the data yaml's ``flip_idx``).
    """

    imgs: torch.Tensor
    targets: torch.Tensor
    paths: tuple[str, ...]
    shapes: tuple[Any, ...]
    keypoints: torch.Tensor


class OBBBatch(NamedTuple):
    """A ``task="obb"`` batch; unpacks as ``imgs, targets, paths, shapes, obb``.

    obb: ``float32 [N, 5]`` ``(xc, yc, w, h, angle)``, one per target row: the minimum-area rectangle of each
    oriented box, normalised to ``W, H``, ``w`` the longer side, the angle in radians in ``[-pi/4, 3pi/4)``
    (:func:`fastload.augment.geometry.obb_xywhr`); ``targets`` hold the boxes around them.
    """

    imgs: torch.Tensor
    targets: torch.Tensor
    paths: tuple[str, ...]
    shapes: tuple[Any, ...]
    obb: torch.Tensor


#: The batch type of each task.
BATCH_TYPES: dict[str, type] = {"detect": Batch, "segment": SegmentBatch, "pose": PoseBatch, "obb": OBBBatch}


def task_batch(task: Task, imgs: torch.Tensor, targets: torch.Tensor, paths: tuple[str, ...], shapes: tuple[Any, ...],
               extra: torch.Tensor | None) -> Any:
    """The batch of ``task`` (:data:`BATCH_TYPES`): ``extra`` is its fifth field (None for ``"detect"``)."""
    if task == "detect":
        return Batch(imgs, targets, paths, shapes)
    if extra is None:
        raise ValueError(f"a {task} batch needs its {BATCH_TYPES[task]._fields[-1]}")
    return BATCH_TYPES[task](imgs, targets, paths, shapes, extra)


def task_labels(store: Store, settings: EngineSettings) -> TaskLabels:
    """What ``settings.task``'s batches carry, with the store's keypoint shape and flip order (``meta["geometry"]``,
    the data yaml's ``kpt_shape`` / ``flip_idx``)."""
    geometry = store.meta.get("geometry") or {}
    kpt_shape, flip_idx = geometry.get("kpt_shape"), geometry.get("flip_idx")
    return TaskLabels(settings.task, int(settings.mask_ratio), bool(settings.overlap_mask),
                      int(kpt_shape[0]) if kpt_shape else 0, tuple(int(v) for v in flip_idx) if flip_idx else None)


class Rendered(NamedTuple):
    """What an engine's :meth:`Engine._render_batches` yields: a batch and the HSV gains it left
    unapplied (``float32 [B, 3]`` on the host; None when applied already)."""

    batch: Batch
    hsv_gains: torch.Tensor | None


class Engine(abc.ABC):
    """Applies sampled augmentation records to images and collates YOLOv9 batches.

    Subclasses set :attr:`name`, :attr:`Options` (their frozen options dataclass) and declare what they
    can do (below; :attr:`default_partners` with the reason for it in their docstring); the base class
    refuses the settings the declarations rule out, an engine refuses in ``__init__`` (with :meth:`_refuse`)
    any other it cannot honour. They implement :meth:`_render_batches`, drawing each batch's records with
    :meth:`~fastload.augment.params.ParamSampler.sample_batch` and adding the images they decode to
    :attr:`decodes`; they may extend :meth:`stats`, :meth:`close_mosaic`, :meth:`expect_next` and
    :meth:`_release`.

    The declarations are what the loader, ``fastload bench``, the YOLOv9 compat layer and the contract test
    read (none of them compares engine names): :attr:`renderers`, :attr:`min_workers`, :attr:`min_prefetch`,
    :attr:`renders_on`, :attr:`accepts_gpu_store`, :attr:`hsv_modes`, :attr:`takes_sample_ids`,
    :attr:`default_workers`,
    :attr:`default_partners`, :attr:`requires`, :attr:`tasks`.

    ``shrink`` is the filter images from encoded stores are shrunk to their loaded size with, as
    YOLOv9's ``load_image`` picks it: ``"linear"`` when the sampler augments (training), ``"area"``
    otherwise (validation). Decoded stores hold pixels shrunk once, at conversion.

    Args:
        store: the loader's store view (indices are loader indices).
        sampler: the parameter sampler, built for the same indices.
        settings: the common settings.
        options: the engine's own options (None: the defaults).
    """

    name: ClassVar[str] = ""
    Options: ClassVar[type]
    # what renders the batches on the host, and how many: "workers" (loader(workers=N), processes), "actors"
    # (the engine option of that name), None (nothing: workers must be 0)
    renderers: ClassVar[Literal["workers", "actors"] | None] = "workers"
    min_workers: ClassVar[int] = 0  # fewer workers are refused
    min_prefetch: ClassVar[int] = 0  # a smaller prefetch is refused
    # where pixels are drawn: "host" (delivered on the CPU unless a device is given, so hsv_on="consumer"
    # without a GPU device runs HSV in the consumer's thread on the host) or "device" (a CUDA device by default)
    renders_on: ClassVar[Literal["host", "device"]] = "host"
    accepts_gpu_store: ClassVar[bool] = False  # a store not on the host (store="gpu": device memory) can be drawn from
    # the hsv_on values it honours, its default first (loader(hsv_on=None)); the others are refused
    hsv_modes: ClassVar[tuple[str, ...]] = HSV_MODES
    default_workers: ClassVar[int] = 0  # loader(workers=None) means this
    default_partners: ClassVar[Partners] = "dataset"  # loader(partners=None) means this
    # True when iter_batches also takes sample ids (fastload.augment.params.visit_ids): an epoch that
    # shows an image more than once, each visit with its own draws (YOLOv9's --image-weights)
    takes_sample_ids: ClassVar[bool] = False
    requires: ClassVar[str | None] = None  # the optional package (a module name) the engine needs, if any
    # the loader tasks it renders (EngineSettings.task); the others are refused, naming the engines that render them
    tasks: ClassVar[tuple[str, ...]] = ("detect",)

    @classmethod
    def renderer_keywords(cls, n: int) -> dict[str, Any]:
        """The ``loader()`` keywords that ask this engine for ``n`` renderers (none where it has none)."""
        if cls.renderers is None:
            return {}
        if cls.renderers == "workers":
            return {"workers": n}
        return {"engine_options": {cls.renderers: n}}

    def __init__(self, store: Store, sampler: ParamSampler, settings: EngineSettings, options: Any = None) -> None:
        if options is None:
            options = self.Options()
        if not isinstance(options, self.Options):
            raise EngineOptionError(f"engine {self.name!r} takes {self.Options.__name__} options, got {type(options).__name__}")
        self.store = store
        self.sampler = sampler
        self.shrink: ShrinkFilter = shrink_filter(sampler.augment, sampler.load_rule)
        self.settings = settings
        self.options = options
        self.batch_size = int(settings.batch_size)
        self.workers = int(settings.workers)
        self.device = torch.device(settings.device) if settings.device is not None else None
        self.hsv_gains: torch.Tensor | None = None
        self.mosaic_closed = False
        self.decodes = 0  # encoded images decoded (JPEG/PNG -> pixels) for the batches rendered so far
        self.copied = 0  # batches delivered as copies because the caller held every spare slot (stats())
        self._delivered = [0, 0]  # batches, images
        self._damaged: dict[tuple[str, int], str] = {}  # (store path, record) -> damage kind, as reported
        self._redrawn = 0  # samples of the delivered batches drawn again because of a damaged record
        self._closed = False
        self._refuse_undeclared(store)

    def _refuse_undeclared(self, store: Store) -> None:
        """Refuse the settings and the store this engine's declarations rule out."""
        if self.workers and self.renderers != "workers":
            self._refuse("workers", self.workers, f"its renderers are set by {self.Options.__name__}({self.renderers}=N)"
                         if self.renderers else "it has no worker processes; leave workers unset (or 0)")
        if self.workers < self.min_workers:
            self._refuse("workers", self.workers, f"it renders in worker processes (at least {self.min_workers})")
        if self.settings.hsv_on not in self.hsv_modes:
            self._refuse("hsv_on", self.settings.hsv_on, f"it applies HSV only as {' or '.join(map(repr, self.hsv_modes))}")
        if self.settings.prefetch < self.min_prefetch:
            self._refuse("prefetch", self.settings.prefetch, f"it keeps at least {self.min_prefetch} batch in flight")
        if self.settings.task not in self.tasks:
            able = list(dict.fromkeys(c.name for c in _engine_classes() if c.name and self.settings.task in c.tasks))
            self._refuse("task", self.settings.task, f"it renders {' and '.join(self.tasks)} batches only; engine"
                         f"{'s' * (len(able) > 1)} {' or '.join(map(repr, able))} render{'s' * (len(able) == 1)} "
                         f"{self.settings.task} batches")
        kind = STORE_KINDS.get(store.kind)  # (a store of no registered kind, such as a test's, is on the host)
        if kind is not None and not kind.on_host and not self.accepts_gpu_store:
            raise ValueError(f"engine={self.name!r} cannot use store={store.kind!r} (its images live in device memory, "
                             f"which this engine does not read); use store='ram'/'disk'/'lmdb', or engine='gpu' with "
                             f"store='gpu'")

    def _refuse(self, setting: str, value: Any, why: str) -> None:
        """Raise the error of a setting this engine cannot honour."""
        raise EngineOptionError(f"engine {self.name!r} cannot take {setting}={value!r}: {why}")

    # -- the interface ---------------------------------------------------------------------------
    def iter_batches(self, epoch: int, indices: np.ndarray) -> Iterator[Batch]:
        """Yield the batches of ``indices`` (loader indices, already ordered and sharded) for ``epoch``;
        an engine whose :attr:`takes_sample_ids` is True also takes sample ids there."""
        self._check_open()
        return self._finished(self._render_batches(int(epoch), np.asarray(indices, np.int64)))

    @abc.abstractmethod
    def _render_batches(self, epoch: int, indices: np.ndarray) -> Generator[Rendered, None, None]:
        """The engine's work: render the batches of ``indices`` in order (called eagerly by
        :meth:`iter_batches`, so set-up such as stopping an abandoned epoch happens at once)."""

    def _finished(self, rendered: Generator[Rendered, None, None]) -> Iterator[Batch]:
        try:
            # starmap, not a for loop: this frame keeps no reference to the batch it yielded last, which
            # would hold that batch's shared-memory slot after the caller dropped it
            yield from itertools.starmap(self._finish, rendered)
        finally:  # an abandoned iteration stops the engine's work at once
            rendered.close()

    def _finish(self, batch: Batch, gains: torch.Tensor | None) -> Batch:
        """The steps every engine shares: HSV as ``hsv_on`` says, ``imgs`` in ``layout``'s memory order."""
        imgs = batch.imgs
        if gains is not None:
            if self.settings.hsv_on == "defer":
                self.hsv_gains = gains
            elif bool((gains != 1).any()):
                imgs = apply_hsv_batch(imgs, gains, rule=self.sampler.recipe)
        imgs = imgs.contiguous(memory_format=_MEMORY_FORMAT[self.settings.layout])
        self._delivered[0] += 1
        self._delivered[1] += len(batch.paths)
        return batch._replace(imgs=imgs)

    def _note_damage(self, found: Sequence[Sequence[Any]], replaced: int) -> None:
        """Take a delivered batch's damage report (its renderer's newly damaged records, as
        :meth:`DamagedRecordError.fields`, and how many of its samples were drawn again): each record is
        warned about once per loader, here in the consumer, whichever worker or actor met it."""
        for fields in found:
            err = DamagedRecordError.from_fields(list(fields))
            if (err.path, err.record) in self._damaged:
                continue
            self._damaged[(err.path, err.record)] = err.kind
            warnings.warn(f"fastload: skipped damaged record: {err} (its samples are drawn again; strict=True stops "
                          f"instead)", DamagedRecordWarning, stacklevel=3)
        self._redrawn += int(replaced)

    def read_ahead(self, indices: np.ndarray) -> ReadAhead | None:
        """Start fetching what the loader's order ``indices`` (store indices) needs next, for a store whose reads wait
        on a download (:meth:`Store.read_ahead <fastload.store.base.Store.read_ahead>`); None when nothing is
        fetched. The default: the store's own read-ahead, in this process."""
        return self.store.read_ahead(indices)

    def expect_next(self, epoch: int, indices: np.ndarray) -> None:
        """A hint, given before an iteration: the one after it will most likely be
        ``iter_batches(epoch, indices)``. An engine may start rendering those batches while the
        current epoch ends (the same batches it would render later) and must drop that work when the
        next call differs. The default ignores the hint.
        """

    def close_mosaic(self) -> None:
        """Mosaic and mixup off from now on (YOLOv9 ``--close-mosaic``).

        Takes effect from the next batch the engine plans; an engine whose records are drawn in
        other processes overrides this to tell them (or reads :attr:`mosaic_closed` when it plans).
        """
        self.sampler.close_mosaic()
        self.mosaic_closed = True

    def stats(self) -> dict[str, Any]:
        """Counters. Every engine: ``engine`` (its name), ``batches`` and ``images`` delivered since it
        was built, ``worker_pids`` (its worker processes; ``[]`` where it has none it can name),
        ``partners`` (the sampler's), ``decodes`` (encoded images decoded to render the batches so
        far: 0 for decoded stores, and for images a decoded-image cache served) and
        ``decodes_per_image`` (``decodes / images``; about 4.6 with scratch-high and
        ``partners="dataset"`` without a cache, at most 1 with ``partners="batch"``),
        ``batches_copied``: batches that engines delivering views of reused shared-memory slots (``cpu``,
        ``ray`` with ``delivery="auto"``) delivered through a copy instead, because the caller still held
        the batches of every spare slot (their ``keep`` option); always 0 for ``gpu`` and ``dali``, whose
        batches are fresh tensors. A held batch never changes either way; the common loop copies none.
        Damaged records skipped so far (``strict=False``): ``damaged_records`` (how many),
        ``damaged_record_ids`` (their record numbers in the store, sorted, as ``fastload verify`` numbers
        them), ``damaged_by_kind`` (``{"checksum": n, "decode": n, "read": n}``) and ``replaced_samples``
        (samples of the delivered batches drawn again because an image they read was damaged).
        Engines add their own keys (see each engine's docstring)."""
        images = self._delivered[1]
        kinds = list(self._damaged.values())
        return {"engine": self.name, "batches": self._delivered[0], "images": images, "worker_pids": [],
                "partners": self.sampler.partners, "decodes": self.decodes,
                "decodes_per_image": self.decodes / images if images else 0.0, "batches_copied": self.copied,
                "damaged_records": len(self._damaged),
                "damaged_record_ids": sorted(record for _, record in self._damaged),
                "damaged_by_kind": {k: kinds.count(k) for k in DAMAGE_KINDS},
                "replaced_samples": self._redrawn}

    def _check_open(self) -> None:
        """Raise if :meth:`close` ran (its workers, buffers or pipeline are gone)."""
        if self._closed:
            raise RuntimeError(f"this {self.name or type(self).__name__} engine was closed")

    def close(self) -> None:
        """Release workers, buffers and device memory. Idempotent: :meth:`_release` runs once."""
        if self._closed:
            return
        self._closed = True
        self._release()

    def _release(self) -> None:
        """The engine's own clean-up, called once by :meth:`close`."""

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# -- helpers shared by engines ------------------------------------------------------------------


def _engine_classes() -> list[type[Engine]]:
    """Every engine class defined so far (subclasses of subclasses included), in definition order."""
    found, todo = [], list(Engine.__subclasses__())
    while todo:
        cls = todo.pop(0)
        found.append(cls)
        todo.extend(cls.__subclasses__())
    return found


def chunks(indices: np.ndarray, batch_size: int) -> list[np.ndarray]:
    """Consecutive batches of ``indices``; the last may be shorter."""
    indices = np.asarray(indices, np.int64)
    return [indices[i : i + batch_size] for i in range(0, len(indices), batch_size)]


def collate_targets(labels: Sequence[np.ndarray]) -> np.ndarray:
    """YOLOv9 ``targets``: ``float32 [N, 6]`` with the sample's position in the batch prepended."""
    rows = [
        np.concatenate([np.full((len(lb), 1), k, np.float32), np.asarray(lb, np.float32).reshape(-1, 5)], 1)
        for k, lb in enumerate(labels)
        if len(lb)
    ]
    return np.concatenate(rows, 0) if rows else np.zeros((0, 6), np.float32)

