"""The Ray engine (``engine="ray"``): batches rendered by Ray actors on the machines of a Ray cluster.

For when one machine's CPUs cannot feed its GPUs. The loader samples the order as on every engine; this
engine sends each batch as a task ``(epoch, indices, mosaic closed)`` to one of its render actors
(:class:`~fastload.engines.ray_actor.RenderActor`), which runs the CPU engine's renderer
(:class:`~fastload.engines.cpu_render.BatchRenderer`) on a store it opened itself, so the batches are the
ones ``engine="cpu"`` gives for the same seed. Batches are delivered in order. An actor on this process's
node renders straight into a shared-memory slot that this process maps (``RayOptions(delivery="auto")``,
:mod:`~fastload.engines.ray_slots`): no copy, no object-store round trip for the pixels. From other nodes,
``imgs`` is a zero-copy view of the object-store object (one copy in the actor, into its node's store; Ray
moves it once into this node's store).

Flow control: at most ``actors * prefetch`` batches are in flight (submitted, not yet delivered); each new
task goes to the actor with the fewest unfinished ones, so a slower node gets fewer. Memory held is
therefore bounded by that many batches plus those the consumer keeps.

Faults: when the batch at the head of the queue finds its actor dead (killed, crashed, out of memory,
its node gone), the engine starts a new actor in its place (it reopens the store) and sends it every
unfinished batch of the dead one, with the mosaic state each was first sent with. Rendering is a pure
function and batches are delivered by their place in the queue, so the epoch completes with exactly
the batches it would have had, none lost or twice. An actor slot that needs more than ``max_restarts``
replacements raises :class:`~fastload.engines.base.WorkerError`. An exception an actor raises while rendering
(a shard it cannot fetch, refused credentials) is raised here as the one line the CPU engine gives
(:meth:`~fastload.engines.base.WorkerFailure.exception`: a fastload error as its own type, the actor's traceback
kept on it).

DDP: each rank builds its own engine and therefore its own actor pool on the shared cluster (the
default ``actors`` splits the cluster's CPUs between the ranks). Ray places the actors of all pools on
the cluster's nodes; a pool lives and dies with its rank's process.
"""
from __future__ import annotations

import re
import time
import warnings
from dataclasses import dataclass
from typing import Any, ClassVar, Generator, Literal, Sequence

import numpy as np
import torch

from fastload.augment.functional.tiles import check_axis_kernel
from fastload.augment.params import ParamSampler, shapes_from_array
from fastload.engines.base import (Batch, Engine, EngineOptionError, EngineSettings, HostRenderOptions, Rendered,
                                   WorkerError, WorkerFailure, with_worker_traceback)
from fastload.engines.inflight import InFlightWindow
from fastload.engines.ray_actor import RenderActor, RenderSpec, StoreSpec, versions
from fastload.engines.ray_slots import SlotPool
from fastload.store.base import DamagedRecordError, ReadAhead, Store, StoreError, join_labels
from fastload.store.view import StoreView

__all__ = ["RayEngine", "RayOptions", "require_ray"]

INSTALL_HINT = 'pip install "fastload[ray]"'
_TERMINAL_COLOURS = re.compile(r"\x1b\[[0-9;]*m")


def _actor_traceback(error: Exception) -> str:
    """An actor's traceback as Ray raises it in this process (the text of its error, the header line coloured
    for a terminal), plain."""
    return _TERMINAL_COLOURS.sub("", str(error)).strip()


def require_ray() -> Any:
    """Import ``ray`` or raise ImportError, in one line, naming the extra to install."""
    try:  # an optional dependency (pip install "fastload[ray]")
        import ray
    except ImportError as exc:
        raise ImportError(f"engine='ray' needs Ray, which is not installed ({exc}); install it with: {INSTALL_HINT}") from None
    return ray


@dataclass(frozen=True)
class RayOptions(HostRenderOptions):
    """Options of ``engine="ray"`` (``loader(..., engine_options=RayOptions(...))`` or a dict of them).

    Attributes:
        address: the Ray cluster to connect to (``ray.init(address=...)``: ``"auto"``, ``"HOST:6379"``,
            ``"ray://HOST:10001"``). ``None``: ``$RAY_ADDRESS``, else the cluster ``ray start`` started on
            this machine, else a new local Ray instance on this machine's CPUs. A process already
            connected to Ray keeps its connection (another address is refused).
        actors: render actors of this loader (of this rank under DDP). ``None``: the cluster's CPUs
            divided by ``cpus_per_actor`` and by the world size (at least 1).
        cpus_per_actor: CPUs each actor reserves on its node (its OpenCV threads follow it).
        store_path: the store folder the actors open, when it lies elsewhere on their nodes than in this
            process (a per-node staged copy, e.g. ``fastload stage DATA --to /dev/shm/set`` run on every
            node). ``None``: the loader's store path, which every node must then be able to read (a
            shared filesystem, or a copy at the same path on every node). Not for ``store="files"``
            (its images are read by their own paths). A store streamed from object storage (``s3://``) is
            opened by each actor from its URL into its own node's cache (the loader's ``cache_dir``, or that
            node's default; its credentials from that node's environment or ``runtime_env``).
        max_restarts: how many times an actor that dies is replaced (its unfinished batches are rendered
            again by the new one); one more death raises :class:`~fastload.engines.base.WorkerError`.
        timeout: seconds to wait for one batch before raising (0: as long as it takes; Ray reports dead
            actors and nodes itself).
        runtime_env: Ray ``runtime_env`` of the actors (environment variables, ``pip`` packages...);
            None: the cluster's environment.
        decode_cache_mb: encoded stores (files, lmdb): bound of each node's decoded-image cache, one
            shared-memory segment per node that every actor there (of every loader and rank) fills and
            reads, as :class:`~fastload.engines.cpu.CPUOptions` ``decode_cache_mb`` is for one machine's
            workers. ``None``: 1/8 of that node's physical memory; ``0``: off (every read decodes).
        decode_scale, axis_kernel, jpeg_decoder: as in :class:`~fastload.engines.cpu.CPUOptions` (``axis_kernel=None``
            is resolved in this process, so every node draws with the same kernel; ``jpeg_decoder=None`` is each
            actor's process choice, ``$FASTLOAD_JPEG_DECODER`` in its ``runtime_env``).
        delivery: how the pixels of a batch reach this process.
            ``"auto"``: actors on this process's node write them into shared-memory slots that this process
            maps (no copy, no object-store round trip); ``imgs`` is then a view of a slot, which is
            written again only once no tensor of that batch is left (as on ``engine="cpu"``). Actors on
            other nodes, and every actor when the slots do not fit the shared-memory filesystem (a
            warning says so), use the object store.
            ``"object_store"``: every batch through Ray's object store; ``imgs`` is read-only object-store
            memory, valid as long as it is referenced.
        keep: with ``delivery="auto"``, spare slots for the batches the caller holds (>= 1; the file has
            ``actors * prefetch + keep`` slots). Not needed for correctness: while the caller holds so many
            batches that no slot is free, new batches of this node's actors come through the object store
            (one more copy, in the actor; ``stats()["batches_copied"]`` counts them). The common loop
            needs 1, except at the epoch where ``close_mosaic`` switches mosaic off: the batches of that
            epoch rendered ahead with mosaic are dropped, and their slots come back only once their actors
            have finished them, so with ``keep=1`` the first few batches of that epoch are copied.
    """

    engine: ClassVar[str] = "ray"
    address: str | None = None
    actors: int | None = None
    cpus_per_actor: float = 1.0
    store_path: str | None = None
    max_restarts: int = 3
    runtime_env: dict[str, Any] | None = None
    delivery: Literal["auto", "object_store"] = "auto"
    keep: int = 2

    def __post_init__(self) -> None:
        if self.actors is not None and self.actors < 1:
            raise self.bad(f"actors must be None or >= 1, got {self.actors}")
        if not self.cpus_per_actor > 0:
            raise self.bad(f"cpus_per_actor must be > 0, got {self.cpus_per_actor}")
        if self.max_restarts < 0:
            raise self.bad(f"max_restarts must be >= 0, got {self.max_restarts}")
        if self.delivery not in ("auto", "object_store"):
            raise self.bad(f"delivery must be 'auto' or 'object_store', got {self.delivery!r}")
        if self.keep < 1:
            raise self.bad(f"keep must be >= 1, got {self.keep}")
        super().__post_init__()


@dataclass
class _Task:
    """A batch sent to an actor and not yet delivered (sent again, in place, when its actor dies)."""

    epoch: int
    indices: np.ndarray
    mosaic_closed: bool  # the mosaic state it was sent with (sent again with the same one)
    actor: int
    ref: Any  # ray.ObjectRef of RenderActor.render's result
    slot: int | None  # the shared-memory slot the actor writes the pixels into (None: the object store)
    copied: bool  # it goes through the object store although its actor could write a slot: none was free


class _ActorTransport:
    """The Ray engine's :class:`~fastload.engines.inflight.Transport`: a task is a :class:`_Task`, sent to the
    actor with the fewest unfinished ones while fewer than ``in_flight_limit`` are in flight."""

    def __init__(self, engine: RayEngine) -> None:
        self.engine = engine

    def submit(self, epoch: int, indices: np.ndarray, mosaic_closed: bool, pending: Sequence[_Task]) -> _Task | None:
        eng = self.engine
        if len(pending) >= eng.in_flight_limit:
            return None
        unfinished = [0] * eng.n_actors
        if pending:
            _, not_ready = eng._ray.wait([t.ref for t in pending], num_returns=len(pending), timeout=0, fetch_local=False)
            waiting = set(not_ready)
            for t in pending:
                unfinished[t.actor] += t.ref in waiting
        k = min(range(eng.n_actors), key=lambda a: (unfinished[a], (a - len(pending)) % eng.n_actors))
        slot = eng._slots.take() if eng._local[k] else None
        ref = eng._actors[k].render.remote(epoch, indices, mosaic_closed, slot)
        eng._peak = max(eng._peak, len(pending) + 1)
        return _Task(epoch, indices, mosaic_closed, k, ref, slot, copied=eng._local[k] and slot is None)

    def receive(self, task: _Task, seq: int, pending: Sequence[_Task]) -> Rendered:
        eng = self.engine
        while True:
            try:
                result = eng._fetch(task, seq)
                break
            except _ActorLost as lost:  # its actor died: a new one renders its unfinished batches again
                eng._replace(task.actor, str(lost))
                eng._resend(pending, task.actor)
        return eng._deliver(task, result)

    def drop(self, tasks: Sequence[_Task]) -> None:
        # Dropped with their references: the actors finish those batches and Ray frees them (their slots once
        # they are finished). Not ray.cancel(): it stalls an actor's later tasks for tens of seconds.
        slots = self.engine._slots
        if slots is not None:
            for t in tasks:
                slots.drop(t.ref, t.slot)


class _ActorLost(Exception):
    """The actor of a task died (or its result was lost with its node): replace it, send its tasks again."""


_connected_here: list[bool] = [False]  # whether connect() made this process's Ray connection


class _NodesReadAhead:
    """The loader's read-ahead (None: none on its node) and the actors reading ahead on the other nodes, told the
    loader's position together; a call to an actor replaced meanwhile (its node gone) is dropped."""

    def __init__(self, here: ReadAhead | None, actors: Sequence[Any]) -> None:
        self.here, self.actors = here, list(actors)

    def reached(self, position: int) -> None:
        if self.here is not None:
            self.here.reached(position)
        self._tell("reached", position)

    def stop(self) -> None:
        if self.here is not None:
            self.here.stop()
        self._tell("stop_read_ahead")

    def _tell(self, method: str, *args: Any) -> None:
        for actor in self.actors:
            try:
                getattr(actor, method).remote(*args)  # not waited for: it queues behind the actor's tasks
            except Exception:  # the actor is gone (replaced by the engine); its node reads on demand again
                pass


def connect(ray: Any, address: str | None) -> None:
    """Connect this process to Ray (once; it stays connected for later loaders); refuse another address
    than the one it is connected to."""
    if ray.is_initialized():
        current = ray.get_runtime_context().gcs_address
        if address not in (None, "auto") and address != current:
            raise EngineOptionError(f"engine 'ray': this process is connected to the Ray cluster at {current}, "
                                    f"not RayOptions(address={address!r}); call ray.shutdown() first to switch")
        return
    ray.init(address=address)
    _connected_here[0] = True


def disconnect() -> None:
    """End the Ray connection a ray engine made (a local instance it started stops with it), for one-off
    tools such as ``fastload bench``; a connection the caller made (``ray.init``) stays."""
    if _connected_here[0]:
        _connected_here[0] = False
        require_ray().shutdown()


def store_spec(store: Store, store_path: str | None) -> StoreSpec:
    """What an actor needs to open ``store`` (the loader's view) by itself."""
    base, indices = (store.base, store.base_indices) if isinstance(store, StoreView) else (store, np.arange(len(store)))
    labels = join_labels(list(store.labels))  # the rows: the actors' augmentation reads no points yet
    # a streamed store is opened by each actor from its description, unless store_path names a staged copy
    stream = base.description if store_path is None and base.kind == "stream" else None
    return StoreSpec(kind=store.kind, path=str(store_path) if store_path is not None else store.path, stream=stream,
                     imgsz=store.imgsz if store.decoded else None, n_base=len(base),
                     base_indices=np.asarray(indices, np.int64), label_rows=labels.rows,
                     label_counts=labels.counts.astype(np.int32),
                     shapes=np.asarray(store.shapes, np.int32).reshape(-1, 2), im_files=tuple(store.im_files),
                     names=tuple(store.names))


class RayEngine(Engine):
    """Batches rendered by Ray actors (options: :class:`RayOptions`).

    Settings: ``workers`` must be 0 (the renderers are the actors: ``RayOptions(actors=N)``); ``prefetch``
    batches in flight per actor (>= 1); ``device``: each delivered batch is copied there;
    ``hsv_on="worker"`` applies HSV in the actors; ``layout`` is rendered by the actors (HWC, or CHW by
    one transposing copy per image).

    ``imgs`` is a view of a shared-memory slot for batches from actors on this node (``RayOptions.delivery``;
    the slot is written again only once no tensor of the batch is left), else read-only memory of Ray's
    object store: either way the batch is the caller's as long as it holds it; clone it to write into it.
    ``batches_copied`` (every engine has it) counts the batches of this node's actors that came through
    the object store because every slot was in flight or held by the caller. :meth:`stats` adds
    ``actors``, ``nodes`` (the actors' nodes), ``actor_restarts`` (dead actors replaced), ``in_flight``
    (batches sent, not yet delivered), ``in_flight_limit`` and ``in_flight_peak``, ``slot_batches`` /
    ``object_store_batches`` (how the delivered batches came), ``decode_cache_hits`` /
    ``decode_cache_misses`` (the actors' reads of their nodes' decoded caches) and
    ``early_batches_used`` / ``early_batches_dropped`` as the CPU engine does.

    ``decodes`` (and ``decodes_per_image``) sum what the actors report with each batch: every decode made
    for the batches delivered so far, plus those of batches rendered and then dropped (an abandoned epoch,
    a wrong guess of the next epoch's first batches), as on the CPU engine. Not counted: the decodes of an
    actor that died after its last delivered batch (its undelivered batches are counted once more when
    its replacement renders them).

    Default ``partners="dataset"`` (YOLOv9's own draw), for the CPU engine's reason: the actors of a node
    share its decoded-image cache (``RayOptions.decode_cache_mb``), so once a node's cache holds the
    dataset, mosaic partners cost no decode there. ``loader(partners=None)`` plans ``"batch"`` when the decoded
    dataset does not fit the cache bound of the machine that builds the loader
    (:class:`fastload.fastloader.PartnerPlan`); choose it yourself when a node's cache is smaller, or with many
    nodes (each node's cache fills with the images its own actors read, so every node decodes the dataset once).
    """

    name = "ray"
    Options = RayOptions
    renderers = "actors"
    min_prefetch = 1  # each actor needs a batch in flight
    default_workers = 0
    default_partners = "dataset"
    takes_sample_ids = True  # the actors' renderer draws sample ids as the CPU engine's does
    requires = "ray"

    def __init__(self, store: Store, sampler: ParamSampler, settings: EngineSettings, options: RayOptions | None = None) -> None:
        super().__init__(store, sampler, settings, options)
        opts: RayOptions = self.options
        if opts.store_path is not None and store.kind == "files":
            raise EngineOptionError("engine 'ray': store_path does not apply to store='files' (its images are read "
                                    "by their own paths)")
        self._ray = ray = require_ray()
        connect(ray, opts.address)
        cpus = float(ray.cluster_resources().get("CPU", 0.0))
        n = opts.actors or max(1, int(cpus // opts.cpus_per_actor) // settings.world_size)
        if n * opts.cpus_per_actor > cpus:
            raise EngineOptionError(f"engine 'ray': {n} actors x {opts.cpus_per_actor:g} CPUs need more than the "
                                    f"{cpus:g} CPUs of the Ray cluster; lower actors or cpus_per_actor, or add nodes "
                                    f"(`ray start --address=HEAD:6379` on each)")
        self.n_actors = n
        self.in_flight_limit = n * settings.prefetch
        spec = store_spec(store, opts.store_path)
        render = RenderSpec(
            hsv_in_worker=settings.hsv_on == "worker", layout=settings.layout, decode_scale=opts.decode_scale,
            decode_cache_mb=opts.decode_cache_mb,
            axis_kernel=check_axis_kernel(opts.axis_kernel), shrink=self.shrink,
            max_batch_bytes=self.batch_size * int(np.prod(sampler.max_out_hw)) * 3, threads=max(1, int(opts.cpus_per_actor)),
            strict=settings.strict, jpeg_decoder=opts.jpeg_decoder,
        )
        # Replacing dead actors is done here, not by Ray's max_restarts: Ray would need the constructor's
        # arguments kept in its object store and warns on every start; the engine keeps them itself.
        self._actor_class = ray.remote(RenderActor).options(num_cpus=opts.cpus_per_actor, runtime_env=opts.runtime_env)
        self._actor_args = (ray.put(spec), ray.put(sampler), render)  # shipped once, shared by every actor
        self._actors = [self._actor_class.remote(*self._actor_args) for _ in range(n)]
        self.nodes: list[str] = [""] * n
        self._node_ids: list[str | None] = [None] * n  # per actor slot: its Ray node (None outside Ray)
        self.read_ahead_nodes = 0  # nodes other than this process's whose actor reads the current epoch ahead
        self.pids: list[int] = [0] * n
        self._local = [False] * n  # per actor slot: its actor writes into this process's shared-memory slots
        self._slots = self._slot_pool(render.max_batch_bytes) if opts.delivery == "auto" else None
        self._replaced = [0] * n  # per actor slot: how many times a dead actor was replaced
        self._counts = [[0, 0, 0] for _ in range(n)]  # per slot, its actor's latest totals: decodes, cache hits, misses
        self._retired_counts = [0, 0, 0]  # the last totals of replaced actors
        self._peak = 0
        self._active: Generator[Rendered, None, None] | None = None
        self._window: InFlightWindow[_Task] = InFlightWindow()
        self._via = [0, 0]  # batches delivered through the shared-memory slots, through the object store
        try:
            self._greet(range(n))
        except BaseException:
            self._release()
            raise

    def _slot_pool(self, slot_bytes: int) -> SlotPool | None:
        """This process's shared-memory slots for the actors on its node, or None (no node: a Ray Client
        connection; no room in shared memory: a warning)."""
        node_id = self._driver_node_id()
        if node_id is None:
            return None
        try:
            return SlotPool(self.in_flight_limit + self.options.keep, slot_bytes, node_id, self._ray)
        except OSError as e:
            warnings.warn(f"fastload: engine 'ray': {e}; batches from the actors on this node go through Ray's object "
                          f"store (RayOptions(delivery='object_store') silences this)")
            return None

    # -- start-up and replacement -----------------------------------------------------------------------
    def _greet(self, slots: Any) -> None:
        """Wait for the actors in ``slots`` to start; raise one clear error for a store one could not open."""
        ray = self._ray
        slots = list(slots)
        spec = self._slots.spec if self._slots is not None else None
        refs = [self._actors[k].hello.remote(spec) for k in slots]
        start, warned = time.monotonic(), False
        while True:
            _, pending = ray.wait(refs, num_returns=len(refs), timeout=5.0)
            if not pending:
                break
            waited = time.monotonic() - start
            free = ray.available_resources().get("CPU", 0)
            if self.options.timeout and waited > self.options.timeout:
                raise WorkerError(f"engine 'ray': {len(pending)} of {len(refs)} render actors did not start within "
                                  f"{self.options.timeout:g} s; the cluster has {free:g} free CPUs")
            if not warned and waited > 30:
                warnings.warn(f"fastload: {len(pending)} of {len(refs)} Ray render actors are still waiting for CPUs after "
                              f"{waited:.0f} s (free CPUs on the cluster: {free:g}); are other jobs holding them?")
                warned = True
        here = versions()
        for k, ref in zip(slots, refs):
            try:
                info = ray.get(ref)
            except ray.exceptions.RayError as e:
                text = _actor_traceback(e)  # its last line names the exception
                error = WorkerError(f"engine 'ray': render actor {k} could not start ({type(e).__name__}: "
                                    f"{text.splitlines()[-1] if text else 'no reason given'}); is fastload[ray] "
                                    f"installed on every node, the same version as here?")
                raise with_worker_traceback(error, f"engine 'ray': render actor {k}", "its start", text) from None
            if info["error"]:
                raise StoreError(info["error"])
            self.nodes[k], self.pids[k], self._local[k] = info["node"], int(info["pid"]), bool(info["slots"])
            self._node_ids[k] = info["node_id"]
            if info["slots_error"]:
                warnings.warn(f"fastload: engine 'ray': the render actor on node {info['node']} {info['slots_error']}; "
                              f"its batches go through Ray's object store")
            if info["versions"] != here:
                warnings.warn(f"fastload: the Ray render actor on node {info['node']} runs {info['versions']}, this "
                              f"process {here}; its batches may differ from engine='cpu' here")

    def _replace(self, k: int, why: str) -> None:
        """Start a new actor in slot ``k`` (its predecessor died), or raise when it has died too often."""
        if self._replaced[k] >= self.options.max_restarts:
            raise WorkerError(f"engine 'ray': render actor {k} (node {self.nodes[k]}, pid {self.pids[k]}) died and was "
                              f"already replaced max_restarts={self.options.max_restarts} times ({why})")
        try:
            self._ray.kill(self._actors[k], no_restart=True)
        except Exception:  # already gone
            pass
        self._replaced[k] += 1
        self._retired_counts = [a + b for a, b in zip(self._retired_counts, self._counts[k])]
        self._counts[k] = [0, 0, 0]
        self._actors[k] = self._actor_class.remote(*self._actor_args)
        self._greet([k])

    def _resend(self, tasks: Sequence[_Task], k: int) -> None:
        """Send those of ``tasks`` that actor slot ``k`` had again to its (new) actor, in the same order (into
        the same shared-memory slots when the new actor can write them; the old one is dead)."""
        for t in tasks:
            if t.actor == k:
                if t.slot is not None and not self._local[k]:
                    self._slots.give_back(t.slot)
                    t.slot = None
                if not self._local[k]:  # its new actor cannot write slots: the object store is no fallback
                    t.copied = False
                t.ref = self._actors[k].render.remote(t.epoch, t.indices, t.mosaic_closed, t.slot)

    # -- consumer-side state ----------------------------------------------------------------------------
    def read_ahead(self, indices: np.ndarray) -> ReadAhead | None:
        """This process's read-ahead into its node's cache, and, for a store streamed from object storage, one
        actor's on every other node into that node's cache (the actors there read from it); the actors are sent
        the order and the loader's position (calls that queue behind their tasks, never waited for)."""
        here = super().read_ahead(indices)
        if self.store.shards() is None:  # nothing is downloaded: no store read in shards
            return here
        this_node = self._driver_node_id()
        first_on_node: dict[str | None, int] = {}
        for k, node in enumerate(self._node_ids):
            if node != this_node:
                first_on_node.setdefault(node, k)
        actors = [self._actors[k] for k in first_on_node.values()]
        self.read_ahead_nodes = len(actors)
        if not actors:
            return here
        order = np.asarray(indices, np.int64)
        for actor in actors:
            actor.read_ahead.remote(order)
        return _NodesReadAhead(here, actors)

    def _driver_node_id(self) -> str | None:
        """The Ray node of this process (None for a Ray Client driver, which runs on no node of the cluster)."""
        try:
            return self._ray.get_runtime_context().get_node_id()
        except Exception:
            return None

    def expect_next(self, epoch: int, indices: np.ndarray) -> None:
        self._window.expect_next(epoch, indices)

    def stats(self) -> dict[str, Any]:
        out = super().stats()
        out["worker_pids"] = list(self.pids)
        out.update(actors=self.n_actors, nodes=sorted(set(self.nodes)), actor_restarts=sum(self._replaced),
                   in_flight=self._window.in_flight, in_flight_limit=self.in_flight_limit, in_flight_peak=self._peak,
                   slot_batches=self._via[0], object_store_batches=self._via[1])
        out["decode_cache_hits"], out["decode_cache_misses"] = self._total_counts()[1:]
        out["early_batches_used"], out["early_batches_dropped"] = self._window.early_used, self._window.early_dropped
        return out

    def _total_counts(self) -> list[int]:
        """Decodes, cache hits and misses of every actor so far (replaced ones included)."""
        return [r + sum(c[j] for c in self._counts) for j, r in enumerate(self._retired_counts)]

    # -- batches ----------------------------------------------------------------------------------------
    def _fetch(self, task: _Task, seq: int) -> tuple[Any, ...]:
        """The result of ``task``; :class:`_ActorLost` when its actor died before delivering it."""
        ray = self._ray
        try:
            return ray.get(task.ref, timeout=self.options.timeout or None)
        except ray.exceptions.GetTimeoutError:
            raise WorkerError(f"engine 'ray': render actor {task.actor} (node {self.nodes[task.actor]}) gave no batch for "
                              f"{self.options.timeout:g} s (batch {seq} of epoch {task.epoch})") from None
        except (ray.exceptions.RayActorError, ray.exceptions.ObjectLostError) as e:
            raise _ActorLost(f"{type(e).__name__} on batch {seq} of epoch {task.epoch}") from None
        except ray.exceptions.RayTaskError as e:
            if isinstance(e.cause, DamagedRecordError):  # strict: its one line, not the actor's traceback
                raise DamagedRecordError.from_fields(e.cause.fields()) from None
            # the actor's exception, as the CPU engine's workers report theirs: its one line, its traceback kept
            failure = WorkerFailure.of(e.cause, _actor_traceback(e))
            actor = f"engine 'ray': render actor {task.actor} (node {self.nodes[task.actor]}, pid {self.pids[task.actor]})"
            raise failure.exception(actor, f"batch {seq} of epoch {task.epoch}") from None

    def _deliver(self, task: _Task, result: tuple[Any, ...]) -> Rendered:
        imgs, (h, w), targets, shapes, gains, pid, counts, images, replaced, damaged = result
        self._note_damage(damaged, replaced)
        self.pids[task.actor] = int(pid)
        self._counts[task.actor] = [int(c) for c in counts]
        self.decodes = self._total_counts()[0]
        self._via[task.slot is None] += 1
        self.copied += task.copied
        if task.slot is not None:  # free again once no tensor of this batch is left
            imgs = self._slots.lend(task.slot, len(task.indices), h, w, self.settings.layout)
        with warnings.catch_warnings():  # object-store memory is read-only; the class docstring says to clone to write
            warnings.simplefilter("ignore", UserWarning)
            pixels = torch.from_numpy(imgs)
        imgs_t = pixels.permute(0, 3, 1, 2) if self.settings.layout == "nhwc" else pixels
        if self.device is not None and self.device.type != "cpu":
            imgs_t = imgs_t.to(self.device)
        paths = tuple(self.store.im_files[i] for i in np.asarray(images).tolist())
        batch = Batch(imgs_t, torch.from_numpy(np.array(targets, np.float32)), paths,
                      tuple(shapes_from_array(a) for a in shapes))
        return Rendered(batch, None if gains is None else torch.from_numpy(np.array(gains, np.float32)))

    def _render_batches(self, epoch: int, indices: np.ndarray) -> Generator[Rendered, None, None]:
        if self._active is not None:  # an abandoned iteration still has tasks in flight
            self._active.close()
            self._active = None
        gen = self._window.batches(_ActorTransport(self), epoch, indices, self.batch_size, lambda: self.mosaic_closed)
        self._active = gen
        return gen

    # -- shutdown ---------------------------------------------------------------------------------------
    def _kill_actors(self) -> None:
        # actors that hold their node's decoded cache close first, to drop their hold (the last one removes the
        # segment; a killed holder's waits for a stale-cleanup); one still busy past the wait is killed all the same
        closing = []
        for a in self._actors if not self.store.decoded and self.options.decode_cache_mb != 0 else []:
            try:
                closing.append(a.close.remote())
            except Exception:  # already dead, or Ray was shut down first
                pass
        if closing:
            try:
                self._ray.wait(closing, num_returns=len(closing), timeout=5.0)
            except Exception:
                pass
        for a in self._actors:
            try:
                self._ray.kill(a, no_restart=True)
            except Exception:  # already dead, or Ray was shut down first
                pass
        self._actors = []

    def _release(self) -> None:
        if self._active is not None:
            self._active.close()
            self._active = None
        self._window.forget()
        self._kill_actors()
        if self._slots is not None:  # after the actors: none writes into the slots any more
            self._slots.close()
            self._slots = None

