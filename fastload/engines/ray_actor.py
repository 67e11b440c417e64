"""What runs inside the Ray actors of ``engine="ray"``: open the store from its path, render batches with
the CPU engine's renderer, hand them back through Ray's object store.

The module needs no Ray to import: :class:`~fastload.engines.ray_engine.RayEngine` wraps
:class:`RenderActor` with ``ray.remote`` when it starts its pool, and Ray imports this module by name on
every node (so fastload must be installed there, the same version as in the training process).

Each actor opens the store itself (:class:`StoreSpec`: kind, path, imgsz, and the loader's view of it) and
builds a :class:`~fastload.engines.cpu_render.BatchRenderer` with the loader's
:class:`~fastload.augment.params.ParamSampler`, so a batch is the same pure function of
``(seed, epoch, indices)`` as on ``engine="cpu"`` (with either ``partners``: the sampler carries it). An
encoded store (files, lmdb) is read through the node's decoded-image cache
(:mod:`~fastload.engines.shm_cache`), which every actor of every loader on that node shares, as the CPU
engine's workers share the machine's. An actor on the consumer's own node renders into the consumer's
shared-memory slots (:mod:`~fastload.engines.ray_slots`) when the task names one, and returns only the
small parts; elsewhere the batch goes back through the object store. A store it cannot open is reported, not raised, by
:meth:`RenderActor.hello` (an exception in an actor's constructor would kill it for good, with Ray's
wrapping around the message), and so is a decoded cache it cannot open; :meth:`RenderActor.render`
raises that same message if asked to render.
"""
from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import cv2
import numpy as np

from fastload._version import __version__
from fastload.augment.functional.tiles import AxisKernel
from fastload.augment.params import ParamSampler, shapes_to_array
from fastload.data.images import ShrinkFilter
from fastload.engines.cpu_render import BatchRenderer, batch_view
from fastload.engines.ray_slots import SlotFile, map_slot_file
from fastload.engines.shm_cache import open_decode_cache
from fastload.store.base import DamagedRecordError, ReadAhead, Store, StoreError, split_labels
from fastload.store.factory import open_path, open_store
from fastload.store.files import FileStore
from fastload.store.view import StoreView

if TYPE_CHECKING:  # annotations only: an actor process never needs torch, which engines.base imports
    from fastload.engines.base import Layout


@dataclass(frozen=True)
class StoreSpec:
    """How an actor opens the loader's store and rebuilds the loader's view of it.

    Attributes:
        kind: the loader's store kind (``files``, ``lmdb``, ``disk`` or ``ram``).
        path: the store folder the actor opens (lmdb, encoded, disk, ram; a ram segment or a staged copy must
            exist on the actor's node); for ``files``, the dataset's first source folder (for messages).
        imgsz: the long side of the store's decoded images (decoded stores), else None.
        n_base: samples in the store (a store with another count is another store).
        base_indices: ``int64 [n]`` store sample of every loader index.
        label_rows, label_counts: the loader's labels (after ``min_items`` / ``single_cls``), concatenated.
        shapes: ``int32 [n, 2]`` original ``(h0, w0)`` of every loader index (checked against the opened store).
        im_files: the image file of every loader index (what a ``files`` store reads; else only for paths).
        names: class names.
        stream: a store streamed from object storage: its ``description`` (URL, split, build, cache settings),
            from which each actor opens it into its own node's cache; None for a store opened from ``path``.
    """

    kind: str
    path: str | None
    imgsz: int | None
    n_base: int
    base_indices: np.ndarray
    label_rows: np.ndarray
    label_counts: np.ndarray
    shapes: np.ndarray
    im_files: tuple[str, ...]
    names: tuple[str, ...]
    stream: dict[str, Any] | None = None


@dataclass(frozen=True)
class RenderSpec:
    """How the actor renders: the renderer's settings and the largest batch it must hold."""

    hsv_in_worker: bool
    layout: Layout
    decode_scale: str
    decode_cache_mb: int | None
    axis_kernel: AxisKernel
    shrink: ShrinkFilter
    max_batch_bytes: int
    threads: int
    strict: bool
    jpeg_decoder: str | None = None
    decode_cache_keep: str | None = None


def node_name() -> str:
    """This machine as error messages name it: host name and, inside Ray, the node's IP address."""
    try:  # Ray is present in every actor process; the engine's own process may name itself without it
        import ray

        ip = ray.util.get_node_ip_address()
    except Exception:
        ip = None
    host = socket.gethostname()
    return f"{host} ({ip})" if ip and ip != host else host


def _node_id() -> str | None:
    """This process's Ray node id (None outside Ray)."""
    try:  # Ray, an optional dependency, is present in every actor process; this module imports without it
        import ray

        return ray.get_runtime_context().get_node_id()
    except Exception:
        return None


def versions() -> dict[str, str]:
    """The versions that decide a rendered batch's pixels (the engine compares its actors' with its own)."""
    return {"fastload": __version__, "numpy": np.__version__, "opencv": cv2.__version__}


def open_view(spec: StoreSpec) -> Store:
    """The loader's view of its store, opened on this node; StoreError says what does not match."""
    labels = split_labels(spec.label_rows, spec.label_counts)
    if spec.kind == "files":
        store: Store = FileStore(spec.im_files, labels, spec.shapes, spec.names, path=spec.path)
        try:
            store.read_image(0)  # the images are on this node's filesystem (a missing mount fails here)
        except DamagedRecordError:
            if not Path(spec.im_files[0]).parent.is_dir():
                raise
            # one unreadable image: the renderer's to skip (or to raise under strict), not the actor's start
        return store
    if spec.stream is not None:
        base = _open_stream(spec.stream)
    elif spec.path is None:
        raise StoreError(f"the loader's {spec.kind} store has no path to open")
    else:
        base = open_path(spec.path, kind="auto", imgsz=spec.imgsz)
    try:
        if base.decoded != (spec.imgsz is not None) or len(base) != spec.n_base:
            raise StoreError(f"it holds {len(base)} {'decoded' if base.decoded else 'encoded'} samples, the loader's "
                             f"{spec.kind} store {spec.n_base} {'decoded' if spec.imgsz else 'encoded'} ones")
        view = StoreView(base, spec.base_indices, labels)
        if not np.array_equal(view.shapes, spec.shapes):
            raise StoreError("its image sizes differ from the loader's store: another dataset, or another version of it")
        try:
            view.read_image(0)
        except DamagedRecordError:  # a damaged record is the renderer's to skip (or to raise under strict)
            pass
        return view
    except BaseException:
        base.close()
        raise


def _open_stream(description: dict[str, Any]) -> Store:
    """A streamed store opened as the loader opened it (into this node's cache; the engine asks one actor per node
    other than the loader's to read ahead: :meth:`RenderActor.read_ahead`), refused when the URL now holds another
    upload."""
    opts = {k: v for k, v in description.items() if k not in ("url", "split", "imgsz", "build")}
    store = open_store(description["url"], description["split"], kind="stream", imgsz=description["imgsz"], **opts)
    if store.build != description["build"]:
        store.close()
        raise StoreError(f"{description['url']} now holds another upload (build {store.build}) than the loader "
                         f"opened (build {description['build']}); build the loader again")
    return store


class RenderActor:
    """One render process on a Ray node (the engine starts ``actors`` of them with ``ray.remote``).

    Args:
        spec: the store to open.
        sampler: the loader's parameter sampler (Ray ships it to the actor; mosaic state comes with each task).
        render: the renderer's settings.
    """

    def __init__(self, spec: StoreSpec, sampler: ParamSampler, render: RenderSpec) -> None:
        # the actor's CPU share is its parallelism; OpenCV's own thread pool would oversubscribe the node
        cv2.setNumThreads(render.threads if render.threads > 1 else 0)
        self.where = node_name()
        self.error: str | None = None
        self.renderer: BatchRenderer | None = None
        self.buffer = np.empty(0, np.uint8)
        self.slots: np.ndarray | None = None  # the consumer's slots, when this actor runs on its node
        self._ahead: ReadAhead | None = None  # this node's read-ahead of a streamed store, when the engine asked
        try:
            store = open_view(spec)
        except Exception as e:
            self.error = (f"engine 'ray': the render actor on node {self.where} cannot open the {spec.kind} store at "
                          f"{spec.path}: {e}")
            return
        try:
            cache = open_decode_cache(store, sampler.imgsz, sampler.load_rule, decode_scale=render.decode_scale,
                                      shrink=render.shrink,
                                      budget_mb=render.decode_cache_mb, jpeg_decoder=render.jpeg_decoder,
                                      keep=render.decode_cache_keep)  # type: ignore[arg-type]  # checked by RayOptions
        except Exception as e:  # e.g. a segment of another layout left at its name: reported like a store error
            store.close()
            self.error = (f"engine 'ray': the render actor on node {self.where} cannot open the decoded-image cache of "
                          f"the {spec.kind} store at {spec.path}: {e}")
            return
        self.renderer = BatchRenderer(store, sampler, cache=cache, hsv_in_worker=render.hsv_in_worker,
                                      layout=render.layout, reduced_decode=render.decode_scale == "reduced",
                                      axis_kernel=render.axis_kernel, shrink=render.shrink, strict=render.strict,
                                      jpeg_decoder=render.jpeg_decoder)
        self.max_batch_bytes = render.max_batch_bytes

    def hello(self, slots: SlotFile | None = None) -> dict[str, Any]:
        """Where this actor runs, what it runs, the store error it met (None when its store is open), and
        whether it can write into the consumer's ``slots`` (only on the consumer's node; ``slots_error``
        says why a file there could not be mapped)."""
        slots_error = None
        if slots is not None and self.renderer is not None and _node_id() == slots.node_id:
            try:
                self.slots = map_slot_file(slots)
            except OSError as e:
                slots_error = f"cannot map the batch slots {slots.path}: {e}"
        return {"node": self.where, "node_id": _node_id(), "pid": os.getpid(), "error": self.error,
                "versions": versions(), "slots": self.slots is not None, "slots_error": slots_error}

    def read_ahead(self, indices: np.ndarray) -> bool:
        """Download, in a thread of this process, what the loader's order ``indices`` (store indices) needs next
        into this node's cache (a store streamed from object storage: :meth:`Store.read_ahead
        <fastload.store.base.Store.read_ahead>`), in place of any earlier order's; True when it started."""
        self.stop_read_ahead()
        if self.renderer is not None:
            self._ahead = self.renderer.store.read_ahead(np.asarray(indices, np.int64))
        return self._ahead is not None

    def reached(self, position: int) -> None:
        """The loader has been handed the first ``position`` samples of the order given to :meth:`read_ahead`."""
        if self._ahead is not None:
            self._ahead.reached(position)

    def stop_read_ahead(self) -> None:
        ahead, self._ahead = self._ahead, None
        if ahead is not None:
            ahead.stop()

    def render(self, epoch: int, indices: np.ndarray, mosaic_closed: bool, slot: int | None = None) -> tuple[Any, ...]:
        """Render one batch (``indices``: loader indices, or sample ids of an image table), into the consumer's
        slot ``slot`` when given (the actor must have mapped the slots: :meth:`hello`).

        Returns ``(imgs, hw, targets float32 [N, 6], shapes float64 [B, 6], HSV gains float32 [B, 3] or None,
        this process's pid, counts, images int64 [B], replaced, damaged)``: ``imgs`` is the batch (uint8
        ``[B, H, W, 3]`` or ``[B, 3, H, W]``), or None when it was written into the slot; ``hw`` its ``(H, W)``;
        ``counts`` this actor's totals so far (its tasks run in the order they were sent): ``[decodes, cache
        hits, cache misses]``; ``images``, ``replaced``, ``damaged``: the renderer's damage report
        (:class:`~fastload.engines.cpu_render.SlotResult`). With ``strict`` a damaged record raises its
        :class:`~fastload.store.base.DamagedRecordError`, which the engine re-raises as it is.
        """
        if self.renderer is None:
            raise StoreError(self.error)
        renderer = self.renderer
        renderer.sync(mosaic_closed)
        if slot is not None and self.slots is None:
            raise RuntimeError(f"render actor on node {self.where}: asked to write slot {slot} of slots it has not mapped")

        def out_array(b: int, h: int, w: int) -> np.ndarray:
            if slot is not None:
                return batch_view(self.slots[slot], b, h, w, renderer.layout)
            if self.buffer.size < self.max_batch_bytes:  # one reused buffer, made when first needed: Ray copies
                self.buffer = np.empty(self.max_batch_bytes, np.uint8)  # the returned pixels before the next task
            return batch_view(self.buffer, b, h, w, renderer.layout)

        out = renderer.render(int(epoch), np.asarray(indices, np.int64), out_array)
        h, w = out.hw
        imgs = None if slot is not None else out_array(len(indices), h, w)
        shapes = np.stack([shapes_to_array(s) for s in out.shapes])
        cache = renderer.cache
        counts = [renderer.decodes, cache.hits if cache is not None else 0, cache.misses if cache is not None else 0]
        return imgs, (h, w), out.targets, shapes, out.gains, os.getpid(), counts, out.images, out.replaced, out.damaged

    def close(self) -> None:
        """Drop this actor's hold on the node's decoded cache (the last holder removes it) and close its store;
        the engine calls it before killing the actor (a killed holder's segment waits for a stale-cleanup)."""
        self.stop_read_ahead()
        if self.renderer is not None:
            if self.renderer.cache is not None:
                self.renderer.cache.close()
            self.renderer.store.close()
            self.renderer = None
