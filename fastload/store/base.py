"""The one read interface every store backend implements.

A store holds one split of a dataset: ``len(store)`` samples, each an image (encoded file bytes, or
the already *loaded* RGB array for decoded stores) plus its labels and original shape. Engines only
ever talk to this interface, so that files, LMDB, packed disk, shared memory and GPU stores are
interchangeable.

Stores are safe to hand to worker processes: handles (LMDB environments, memory maps) are opened
lazily and re-opened when ``os.getpid()`` changes, and pickling drops them.
"""
from __future__ import annotations

import abc
import os
from typing import TYPE_CHECKING, Any, Callable, Iterable, NamedTuple, Protocol, Sequence, Union

import numpy as np

from fastload.data.images import (
    CorruptImageError,
    LoadRule,
    ShrinkFilter,
    decode_image,
    decode_image_reduced,
    jpeg_is_complete,
    loaded_shape,
    probe_header,
    resize_to,
    rule_shrink,
)
from fastload.data.labels import FlatLabels, ImageLabels

if TYPE_CHECKING:  # torch is needed only by stores whose images live on a device
    import torch

Sample = Union[bytes, np.ndarray]

# Bumped whenever the LMDB layout changes incompatibly; open refuses other versions.
SCHEMA_VERSION = 1
# The same for packed (disk/ram) stores, whose version also says what their pixels mean. 2: loaded
# sizes are YOLOv9's truncated ``int(w0 * r)`` (1 rounded them: some images were one pixel larger than
# the official loader's) and ``meta["shrink"]`` names the filter images were shrunk with.
PACKED_SCHEMA = 2
#: What a layout's schema number grows by when its store carries label points (segments, keypoints, OBB corners:
#: ``meta["geometry"]``, :func:`geometry_meta`). A store without points keeps its layout's schema, byte for byte
#: what it was, so every fastload reads it; one with points has the next number, which an older fastload refuses
#: as newer (it would drop the points and fail their checksums) and this one reads.
GEOMETRY_STEP = 1


class StoreError(RuntimeError):
    """A store cannot be opened or read (missing, wrong kind, damaged); the message names the path."""


def check_schema(path: object, meta: dict[str, Any], layout: str, version: int = SCHEMA_VERSION, *,
                 older: str | None = None) -> None:
    """Refuse metadata of another layout or schema ``version`` (``version + GEOMETRY_STEP`` for a store whose
    ``meta["geometry"]`` says it carries label points), saying whether fastload or the store is the older;
    ``older``: why this version cannot read a store of an older schema (said when it is)."""
    schema = meta.get("schema")
    if meta.get("geometry"):
        version += GEOMETRY_STEP
    if meta.get("layout") == layout and schema == version:
        return
    if meta.get("layout") == layout and isinstance(schema, int) and schema > version:
        raise StoreError(
            f"{path}: written by a newer fastload (store schema {schema}, this version reads {version}); "
            f"upgrade fastload, or convert the dataset again with this version"
        )
    if meta.get("layout") == layout and isinstance(schema, int) and older is not None:
        raise StoreError(f"{path} was written by an older fastload ({older}); convert the dataset again "
                         f"(`fastload convert ... --to {meta.get('kind', layout)}`)")
    raise StoreError(f"{path}: {layout} store schema {schema!r} is not the supported {version}; convert the dataset again")


class IncompleteStoreError(StoreError):
    """The store was never finished (interrupted conversion): no commit marker."""


#: What made a record unusable (:attr:`DamagedRecordError.kind`): its stored checksum does not match
#: (lmdb: the image bytes; disk/ram: the decoded pixels; labels included), its image cannot be decoded
#: (truncated, damaged), or its bytes cannot be read at all (a vanished file, a missing LMDB value).
DAMAGE_KINDS = ("checksum", "decode", "read")


class DamagedRecordError(StoreError):
    """One record of a store failed its check at load time; the message is one line naming the store,
    the record (its index in that store, as ``fastload verify`` numbers them) and its source file.

    The fields (``path``, ``record``, ``file``, ``kind``: one of :data:`DAMAGE_KINDS`, ``reason``) cross
    process boundaries as :meth:`fields` (plain values, no pickle) and come back with :meth:`from_fields`.
    """

    def __init__(self, path: str | None, record: int, file: str, kind: str, reason: str, store_kind: str = "") -> None:
        self.path = str(path) if path else f"the {store_kind or 'in-memory'} store"
        self.record = int(record)
        self.file = str(file)
        self.kind = kind
        self.reason = reason
        self.store_kind = store_kind
        if store_kind == "files":  # no stored checksum to verify: the source image itself is bad
            hint = "replace the image or remove it from the dataset"
        elif store_kind == "stream":  # the bucket's copy is bad: verify on the store's own URL cannot run
            hint = "upload the store again (`fastload convert DATA.yaml --out URL --force`)"
        else:
            hint = f"check the store with `fastload verify {self.path}`"
        super().__init__(f"{self.path}, record {self.record} ({self.file}): {reason}; {hint}")

    def fields(self) -> list[Any]:
        """The error as plain values (for a worker's message to the consumer)."""
        return [self.path, self.record, self.file, self.kind, self.reason, self.store_kind]

    @classmethod
    def from_fields(cls, fields: list[Any]) -> "DamagedRecordError":
        return cls(*fields)

    def __reduce__(self) -> tuple[Any, ...]:
        # Ray ships an actor's exception to the caller by pickling it: rebuild it from its fields
        return (type(self), tuple(self.fields()))


class DamagedRecords:
    """The damaged records one rendering process met, for engines that skip them (``strict=False``).

    :meth:`load_into` loads a record through the engine's own loader, remembers a record whose
    :class:`DamagedRecordError` it caught (it is never read again in this process) and keeps the error's
    fields until :meth:`take_found` hands them to the consumer, once; with ``strict`` it raises instead.
    """

    def __init__(self, strict: bool) -> None:
        self.strict = bool(strict)
        self.indices: set[int] = set()  # loader indices found damaged
        self._found: list[list[Any]] = []  # DamagedRecordError.fields() not yet reported

    def load_into(self, i: int, images: dict[int, Any], load: Callable[[int], Any]) -> bool:
        """Put ``load(i)`` into ``images`` (unless there already); False when record ``i`` is damaged."""
        if i in images:
            return True
        if i in self.indices:
            return False
        try:
            images[i] = load(i)
        except DamagedRecordError as e:
            if self.strict:
                raise
            self.indices.add(i)
            self._found.append(e.fields())
            return False
        return True

    def load_all(self, sources: Iterable[int], images: dict[int, Any], load: Callable[[int], Any]) -> bool:
        """:meth:`load_into` for each of ``sources`` (the images one record reads) until one is damaged:
        True when all of them are in ``images``, so the record can be drawn."""
        return all(self.load_into(i, images, load) for i in sources)

    def take_found(self) -> list[list[Any]]:
        """The fields of the damaged records met since the last call."""
        found, self._found = self._found, []
        return found


class ResidentImages(NamedTuple):
    """Loaded images held in device memory (``store="gpu"``), as HWC pixel rows in one tensor.

    Image ``i`` (a store index) is ``pixels[offsets[i] : offsets[i] + h * w]`` with ``(h, w) = hw[i]``.
    """

    pixels: "torch.Tensor"  # uint8 [P, 3] on device
    offsets: np.ndarray  # int64 [N] first pixel row of every image
    hw: np.ndarray  # int64 [N, 2] loaded (h, w) of every image
    device: "torch.device"


class Shards(NamedTuple):
    """How a store read in shards wants its samples visited (:func:`fastload.order.shard_permutation`): the shard
    of every sample, and how many consecutive shards an epoch shuffles together."""

    ids: np.ndarray  # int64 [n]
    window: int


class ReadAhead(Protocol):
    """Fetches what an epoch's order needs next while the loader renders (:meth:`Store.read_ahead`)."""

    def reached(self, position: int) -> None:
        """The consumer has been handed the first ``position`` samples of the order."""

    def stop(self) -> None:
        """End the fetching (the epoch ended or was abandoned); returns once nothing is being fetched."""


class Store(abc.ABC):
    """One split of a dataset, readable by index.

    Attributes every backend sets:
      kind: ``files | lmdb | disk | ram | gpu``.
      decoded: True when :meth:`read_image` returns the loaded RGB HWC uint8 array at ``imgsz``;
        False when it returns the encoded file bytes.
      imgsz: the long side of decoded images, ``None`` for encoded stores.
      load_rule: the loaded-image rule (:data:`fastload.data.images.LoadRule`) a decoded store's images were
        made with, ``None`` for encoded stores (they are resized to whichever rule :meth:`load` is asked for).
      labels: ``float32 [n, 5]`` (cls, xc, yc, w, h) per sample, normalised to the original image (a
        :class:`~fastload.data.labels.FlatLabels`, whose ``points`` hold segment / pose / OBB geometry where the
        store has it).
      shapes: ``int32 [N, 2]`` original ``(h0, w0)`` after EXIF orientation.
      im_files: the source image path per sample (for ``paths`` in batches and error messages).
      names: class names.
      meta: JSON-able metadata (schema version, counts, creation options...).
      path: where the store lives (``None`` for in-memory stores).
    """

    kind: str = ""
    decoded: bool = False
    imgsz: int | None = None
    load_rule: LoadRule | None = None
    path: str | None = None

    def __init__(self) -> None:
        self.labels: list[np.ndarray] = []
        self.shapes: np.ndarray = np.zeros((0, 2), np.int32)
        self.im_files: list[str] = []
        self.names: list[str] = []
        self.meta: dict[str, Any] = {}
        self._pid = os.getpid()

    # -- the interface -------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self.im_files)

    @abc.abstractmethod
    def read_image(self, i: int) -> Sample:
        """Sample ``i``: encoded bytes (``decoded=False``) or the loaded RGB array (``decoded=True``)."""

    def close(self) -> None:
        """Release handles. Idempotent; the store may be re-opened lazily by a later read."""

    def resident_images(self) -> ResidentImages | None:
        """The loaded images already in device memory (``store="gpu"``), else None (the default)."""
        return None

    def shards(self) -> Shards | None:
        """The shard layout of a store read in shards (``stream``), else None (the default: any order costs
        the same)."""
        return None

    def read_ahead(self, indices: np.ndarray) -> ReadAhead | None:
        """Start fetching the samples ``indices`` (an epoch's order) ahead of the reads, for a store whose reads
        wait on a download (``stream``); None (the default): the store has nothing to fetch."""
        return None

    # -- helpers shared by all backends ----------------------------------------------------------
    def load(self, i: int, imgsz: int | None = None, *, reduced: bool = False,
             shrink: ShrinkFilter = "area", decoder: str | None = None, rule: LoadRule = "yolov9") -> np.ndarray:
        """The loaded RGB HWC uint8 image ``i`` whose long side is ``imgsz`` (default: the store's).

        The result always has exactly ``fastload.data.images.loaded_shape(h0, w0, imgsz, rule)``, the shape
        the augmentation sampler planned with, also when the stored bytes were re-encoded smaller.
        ``reduced``: a JPEG whose stored long side is at least twice ``imgsz`` is decoded at 1/2, 1/4
        or 1/8 scale by the DCT (still >= ``imgsz``) before the same final resize: cheaper, pixels
        within a few grey levels of the full decode (``benchmarks/reduced_decode.py`` measures both).
        ``decoder``: an encoded store's JPEG decoder (:data:`fastload.data.images.JPEG_DECODERS`; None: the
        process's choice, :func:`fastload.data.images.jpeg_decoder`). ``shrink``: the filter when the image shrinks, ``"area"`` (YOLOv9 validation) or ``"linear"``
        (YOLOv9 training). A decoded store returns its stored pixels at its own ``imgsz`` whatever
        ``shrink`` says: they were shrunk once, with the filter its ``meta["shrink"]`` records. ``rule``: the
        loaded-image rule (:data:`fastload.data.images.LoadRule`; Ultralytics' always resizes with INTER_LINEAR);
        a decoded store made with another rule raises :class:`StoreError` (:meth:`check_load_rule`).
        """
        target = imgsz or self.imgsz
        if self.load_rule is not None and rule != self.load_rule:
            self.check_load_rule(rule)
        sample = self.read_image(i)
        try:
            if isinstance(sample, np.ndarray):
                img = sample
            elif reduced and target is not None:
                img = decode_image_reduced(bytes(sample), target, self.im_files[i], decoder=decoder)
            else:
                img = decode_image(bytes(sample), self.im_files[i], decoder=decoder)
        except CorruptImageError as e:
            raise self.damaged(i, "decode", e.reason) from None
        if target is None:
            return img
        h0, w0 = (int(v) for v in self.shapes[i])
        # YOLOv9 decides between enlarging and shrinking from the original size
        return resize_to(img, loaded_shape(h0, w0, target, rule), enlarge=max(h0, w0) < target,
                         shrink=rule_shrink(shrink, rule))

    def check_load_rule(self, rule: LoadRule) -> None:
        """Refuse, with one line, a decoded store whose images were loaded by another rule than ``rule``
        (their sizes and filter differ: serving them would be silently wrong)."""
        if self.load_rule is not None and rule != self.load_rule:
            raise StoreError(
                f"{self.path}: this {self.kind} store holds images loaded by the {self.load_rule} rule, and the "
                f"{rule} rule was asked for; convert again with `fastload convert --load-rule {rule}` (or use the "
                f"image files)")

    def read_encoded(self, i: int) -> bytes:
        """Encoded store: the bytes of image ``i`` after the checks that need no decode (the stored
        checksum where there is one, a readable header, a JPEG's end-of-image marker), for engines that
        decode elsewhere (on a device, in a DALI graph). Raises :class:`DamagedRecordError`."""
        buf = bytes(self.read_image(i))
        try:
            fmt = probe_header(buf, self.im_files[i])[0]
        except CorruptImageError as e:
            raise self.damaged(i, "decode", e.reason) from None
        if fmt == "jpeg" and not jpeg_is_complete(buf):
            raise self.damaged(i, "decode", "truncated JPEG (no end-of-image marker after the last scan)")
        return buf

    def damaged(self, i: int, kind: str, reason: str) -> DamagedRecordError:
        """The error for record ``i`` of this store (``kind``: one of :data:`DAMAGE_KINDS`)."""
        return DamagedRecordError(self.path, i, self.im_files[i], kind, reason, self.kind)

    def nbytes(self, i: int) -> int:
        """Bytes of sample ``i`` as stored (for throughput figures)."""
        sample = self.read_image(i)
        return sample.nbytes if isinstance(sample, np.ndarray) else len(sample)

    def check_index(self, i: int) -> int:
        """Normalise ``i`` (negative allowed) and raise IndexError naming the store when out of range."""
        n = len(self)
        j = int(i) + n if int(i) < 0 else int(i)
        if not 0 <= j < n:
            raise IndexError(f"sample {i} out of range for {self.kind} store of {n} samples ({self.path})")
        return j

    def _forked(self) -> bool:
        """True once in a process other than the one that opened the handles (fork/spawn worker)."""
        return os.getpid() != self._pid

    # -- context manager / pickling ----------------------------------------------------------------
    def __enter__(self) -> "Store":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __getstate__(self) -> dict[str, Any]:
        # Handles never cross processes; subclasses list theirs in _handles and re-open lazily.
        state = self.__dict__.copy()
        for name in self._handles():
            state[name] = None
        return state

    def _handles(self) -> tuple[str, ...]:
        return ()

    def __repr__(self) -> str:
        size = f", imgsz={self.imgsz}" if self.imgsz else ""
        return f"{type(self).__name__}(kind={self.kind!r}, n={len(self)}{size}, path={self.path!r})"


def split_labels(flat: np.ndarray, counts: np.ndarray, points: np.ndarray | None = None,
                 point_counts: np.ndarray | None = None) -> FlatLabels:
    """Concatenated ``float32 [M, 5]`` labels with each sample's count as a sequence of per-sample views (no copy,
    no object per sample); with ``float32 [P, D]`` points and each row's ``point_counts`` where the store has them."""
    flat = np.asarray(flat, np.float32).reshape(-1, 5)
    counts = np.asarray(counts, np.int64)
    if int(counts.sum()) != len(flat):
        raise StoreError(f"label counts sum to {int(counts.sum())} but {len(flat)} label rows are stored")
    if points is None or point_counts is None:
        return FlatLabels(flat, np.concatenate([[0], np.cumsum(counts)]))
    point_counts = np.asarray(point_counts, np.int64)
    if len(point_counts) != len(flat) or int(point_counts.sum()) != len(points):
        raise StoreError(f"point counts of {len(point_counts)} rows sum to {int(point_counts.sum())}, but {len(flat)} "
                         f"label rows and {len(points)} points are stored")
    try:
        return FlatLabels(flat, np.concatenate([[0], np.cumsum(counts)]), points,
                          np.concatenate([[0], np.cumsum(point_counts)]))
    except ValueError as e:  # points of the wrong shape
        raise StoreError(str(e)) from None


def join_labels(labels: Sequence[np.ndarray | ImageLabels]) -> FlatLabels:
    """Concatenate per-sample labels (rows, or rows with points: :meth:`FlatLabels.image`) into one
    :class:`FlatLabels`."""
    images = [lb if isinstance(lb, ImageLabels) else ImageLabels(lb, None, None) for lb in labels]
    if all(im.points is None for im in images):
        return FlatLabels.from_arrays([im.rows for im in images])
    return FlatLabels.from_arrays([im.rows for im in images], [im.points for im in images],
                                  [im.point_offsets for im in images])


def label_arrays(labels: FlatLabels) -> dict[str, np.ndarray]:
    """What a store writes of ``labels``: ``labels`` float32 [M, 5] and ``label_counts`` int32 [N], plus, with
    points, ``points`` float32 [P, D] and ``point_counts`` int32 [M] (:func:`split_labels` reads them back)."""
    out = {"labels": labels.rows, "label_counts": labels.counts.astype(np.int32)}
    if labels.points is not None:
        out.update(points=labels.points, point_counts=labels.point_counts.astype(np.int32))  # type: ignore[union-attr]
    return out


def geometry_meta(labels: FlatLabels, kpt_shape: Sequence[int] | None,
                  flip_idx: Sequence[int] | None) -> dict[str, Any]:
    """``{"geometry": ...}`` for a store's metadata when its labels carry points, else ``{}``: the task the points
    serve (``pose`` with ``kpt_shape``; ``obb`` when every polygon has 4 corners; else ``segment``), their dimension,
    and the data yaml's ``kpt_shape`` / ``flip_idx``."""
    if labels.points is None:
        return {}
    counts = labels.point_counts
    polygons = counts[counts > 0] if counts is not None else counts
    task = "pose" if kpt_shape is not None else "obb" if len(polygons) and (polygons == 4).all() else "segment"
    geometry: dict[str, Any] = {"task": task, "point_dim": int(labels.points.shape[1])}
    if kpt_shape is not None:
        geometry["kpt_shape"] = [int(v) for v in kpt_shape]
        if flip_idx is not None:
            geometry["flip_idx"] = [int(v) for v in flip_idx]
    return {"geometry": geometry}
