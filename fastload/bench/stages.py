"""One function per pipeline stage, each measuring throughput for at most ``seconds`` of wall time.

Every function returns :class:`Measurement` rows (samples, bytes, seconds) or a row whose ``skipped``
says why it could not run; none raises for a missing optional dependency. The timed loops check the
clock after every item, so a measurement overruns its budget by at most one item (one batch for the
loader); set-up (dropping the cache, pre-decoding images, starting workers) is not timed, but it is
bounded and reported.

MB are 10^6 bytes. ``read`` and ``decode`` count the stored (encoded, or for decoded stores the raw
pixel) bytes consumed; ``augment`` and ``loader`` count the output pixel bytes produced.
"""
from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np
import psutil
import torch

from fastload.augment.boxes import transform_labels
from fastload.augment.hyp import load_hyp
from fastload.augment.params import ParamSampler
from fastload.augment.pipeline import render_sample
from fastload.bench import pagecache
from fastload.bench.decoders import available_decoders
from fastload.engines.factory import engine_class
from fastload.fastloader import loader as make_loader

STAGES: tuple[str, ...] = ("read", "decode", "augment", "loader")
MAX_DROP_FILES = 20000  # evicting more files than a budget can read back only wastes set-up time


@dataclass
class Measurement:
    """One row of the report: ``stage`` (read/decode/augment/loader), ``name`` (e.g. ``files cold``)."""

    stage: str
    name: str
    samples: int = 0
    bytes: int = 0
    seconds: float = 0.0
    skipped: str | None = None
    note: str = ""
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.skipped is None and self.samples > 0 and self.seconds > 0

    @property
    def samples_per_s(self) -> float:
        return self.samples / self.seconds if self.ok else 0.0

    @property
    def mb_per_s(self) -> float:
        return self.bytes / self.seconds / 1e6 if self.ok else 0.0

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["samples_per_s"] = self.samples_per_s
        d["mb_per_s"] = self.mb_per_s
        return d


def _run_for(seconds: float, step: Callable[[int], int], max_steps: int | None = None) -> tuple[int, int, float]:
    """Call ``step(k)`` (returning bytes) until ``seconds`` pass or ``max_steps`` ran; at least once."""
    k = 0
    nbytes = 0
    t0 = time.perf_counter()
    while True:
        nbytes += int(step(k))
        k += 1
        dt = time.perf_counter() - t0
        if dt >= seconds or (max_steps is not None and k >= max_steps):
            return k, nbytes, dt


def _read_order(n: int, seed: int = 0) -> np.ndarray:
    """The shuffled order training reads in (one fixed permutation, so runs are comparable)."""
    return np.random.default_rng(seed).permutation(n)


def store_files(store: Any, order: Sequence[int] | None = None) -> list[str]:
    """The files behind a store, in read order: the images for ``files``, the store folder otherwise."""
    if store.kind == "files":
        idx = list(order) if order is not None else range(len(store))
        return [store.im_files[int(i)] for i in idx]
    root = Path(store.path) if store.path else None
    if root is None or not root.exists():
        return []
    if root.is_file():
        return [str(root)]
    return sorted(str(p) for p in root.rglob("*") if p.is_file())


def _reader(store: Any) -> Callable[[int], int]:
    """Read sample ``i`` into process memory and return its stored size in bytes."""
    scratch: dict[str, np.ndarray] = {}

    def read(i: int) -> int:
        sample = store.read_image(int(i))
        if isinstance(sample, np.ndarray):
            # Decoded stores hand out views of a mapping; copying the pixels is the read (the engine
            # does the same when it draws them into the batch).
            flat = sample.reshape(-1)
            buf = scratch.get("b")
            if buf is None or buf.size < flat.size:
                buf = scratch["b"] = np.empty(flat.size, np.uint8)
            np.copyto(buf[: flat.size], flat)
            return int(flat.size)
        return len(sample)

    return read


def measure_read(store: Any, seconds: float) -> list[Measurement]:
    """Cold then warm random-order reads of ``store`` (cold skipped with a reason where impossible)."""
    kind = store.kind
    n = len(store)
    if n == 0:
        return [Measurement("read", f"{kind} {t}", skipped="store is empty") for t in ("cold", "warm")]
    order = _read_order(n)
    read = _reader(store)
    rows: list[Measurement] = []
    cold_count = 0
    if kind == "ram":
        rows.append(Measurement("read", f"{kind} cold", skipped="ram store lives in shared memory: always warm"))
    else:
        files = store_files(store, order[:MAX_DROP_FILES])
        t0 = time.perf_counter()
        dropped = pagecache.drop(files)
        setup = time.perf_counter() - t0
        if not dropped.ok:
            rows.append(Measurement("read", f"{kind} cold", skipped=dropped.reason))
        else:
            limit = min(n, MAX_DROP_FILES) if kind == "files" else n  # a second visit would be warm
            k, nbytes, dt = _run_for(seconds, lambda j: read(order[j]), max_steps=limit)
            cold_count = k
            rows.append(
                Measurement("read", f"{kind} cold", k, nbytes, dt, note=dropped.describe(),
                            extra={"drop_s": setup, "resident_after": dropped.resident_after})
            )
    if cold_count == 0:  # warm the pages the warm pass will cycle over (untimed, bounded)
        cold_count, _, _ = _run_for(seconds, lambda j: read(order[j]), max_steps=n)
    subset = order[:cold_count]
    k, nbytes, dt = _run_for(seconds, lambda j: read(subset[j % len(subset)]))
    rows.append(Measurement("read", f"{kind} warm", k, nbytes, dt, note=f"cycling over {len(subset)} cached samples"))
    return rows


def encoded_samples(store: Any, seconds: float, max_items: int = 256, max_bytes: int = 256 << 20) -> list[bytes]:
    """Up to ``max_items`` encoded samples (read order) held in memory, so decode timing excludes I/O."""
    if store.decoded:
        return []
    order = _read_order(len(store))
    out: list[bytes] = []
    total = 0
    t0 = time.perf_counter()
    for i in order[:max_items]:
        buf = store.read_image(int(i))
        out.append(bytes(buf))
        total += len(buf)
        # bounded set-up even on a cold, slow disk
        if total >= max_bytes or time.perf_counter() - t0 > max(2 * seconds, 5.0):
            break
    return out


def measure_decode(
    samples: list[bytes], seconds: float, imgsz: int, names: Sequence[str] | None = None
) -> list[Measurement]:
    """Single-thread decode throughput of every available decoder over the same in-memory bytes."""
    rows = []
    for dec in available_decoders(imgsz, tuple(names) if names else None):
        if dec.fn is None:
            rows.append(Measurement("decode", dec.name, skipped=dec.unavailable, note=dec.description))
            continue
        if not samples:
            rows.append(Measurement("decode", dec.name, skipped="no encoded samples (decoded store)", note=dec.description))
            continue
        fn = dec.fn
        try:
            fn(samples[0])  # first call loads libraries; keep it out of the timing
        except Exception as e:
            rows.append(Measurement("decode", dec.name, skipped=f"fails on this data: {type(e).__name__}: {e}"))
            continue
        pixels = [0]

        def step(j: int, fn: Callable[[bytes], np.ndarray] = fn) -> int:
            buf = samples[j % len(samples)]
            pixels[0] += fn(buf).nbytes
            return len(buf)

        k, nbytes, dt = _run_for(seconds, step)
        rows.append(
            Measurement("decode", dec.name, k, nbytes, dt, note=dec.description + " (1 core)",
                        extra={"out_mb_per_s": pixels[0] / dt / 1e6, "threads": 1})
        )
    return rows


def measure_augment(
    store: Any, seconds: float, imgsz: int, hyp: Any = None, max_images: int = 256, max_bytes: int = 1 << 30
) -> Measurement:
    """Augmentation alone: records sampled and drawn from pre-decoded loaded images, one core.

    Also counts how many source images each output sample reads (``reads_per_sample``: 4 per
    mosaic, +4 when mixup fires), the multiplier that turns a decode rate into a loader ceiling.
    """
    n = len(store)
    if n == 0:
        return Measurement("augment", "cpu", skipped="store is empty")
    images: list[np.ndarray] = []
    total = 0
    t0 = time.perf_counter()
    for i in range(min(n, max_images)):  # untimed pre-decode, bounded in count, memory and time
        img = np.ascontiguousarray(store.load(i, imgsz))
        images.append(img)
        total += img.nbytes
        if total >= max_bytes or time.perf_counter() - t0 > max(2 * seconds, 5.0):
            break
    k_imgs = len(images)
    preload_s = time.perf_counter() - t0
    hyp_d = load_hyp(hyp)
    shapes = np.array([im.shape[:2] for im in images], np.int32)
    sampler = ParamSampler(shapes, hyp_d, imgsz, augment=True, seed=0)
    labels = list(store.labels[:k_imgs])
    reads = [0]

    def get_image(i: int) -> np.ndarray:
        reads[0] += 1
        return images[int(i)]

    out = np.empty((imgsz, imgsz, 3), np.uint8)

    def step(j: int) -> int:
        p = sampler.sample(j // k_imgs, j % k_imgs)
        img = render_sample(p, get_image, out=out, hsv=True)
        transform_labels(p, labels)
        return int(img.nbytes)

    k, nbytes, dt = _run_for(seconds, step)
    return Measurement(
        "augment", "cpu", k, nbytes, dt,
        note=f"mosaic {hyp_d.get('mosaic')}, mixup {hyp_d.get('mixup')}; {k_imgs} pre-decoded images (1 core)",
        extra={"reads_per_sample": reads[0] / max(k, 1), "preload_s": preload_s, "threads": 1},
    )


class CpuClock:
    """CPU time of this process tree (the loader and its workers, plus ``pids``) and of the whole machine since creation.

    :meth:`cores_since` turns the differences into average busy cores: ``cpu_loader_cores`` (ours)
    and ``cpu_other_cores`` (everything else on the machine), which tells a starved loader from a
    shared machine.
    """

    def __init__(self, pids: Sequence[int] = ()) -> None:
        self.pids = list(pids)  # the loader's renderers: those that are not our children (Ray actors) count too
        self.tree0 = self._tree()
        self.busy0 = self._busy()

    def _tree(self) -> dict[int, float]:
        me = psutil.Process()
        procs = [me, *me.children(recursive=True)]
        for pid in self.pids:
            try:
                procs.append(psutil.Process(pid))
            except psutil.Error:
                continue
        out = {}
        for p in procs:
            try:
                t = p.cpu_times()
                out[p.pid] = t.user + t.system
            except psutil.Error:
                continue
        return out

    @staticmethod
    def _busy() -> float:
        t = psutil.cpu_times()
        return sum(t) - t.idle - getattr(t, "iowait", 0.0)

    def cores_since(self, seconds: float) -> dict[str, float]:
        if seconds <= 0:
            return {}
        tree1 = self._tree()
        # processes that started after the first reading count from zero; ones that ended are lost
        ours = sum(v - self.tree0.get(pid, 0.0) for pid, v in tree1.items())
        busy = self._busy() - self.busy0
        return {"cpu_loader_cores": ours / seconds, "cpu_other_cores": max(0.0, busy - ours) / seconds}


def measure_loader(
    data: Any,
    engine: str,
    store_kind: str,
    seconds: float,
    *,
    split: str = "train",
    imgsz: int = 640,
    batch: int = 64,
    workers: int | None = None,
    hyp: Any = None,
) -> Measurement:
    """The whole loader (store + sampler + engine + workers) for ``seconds`` after its first batch.

    Epochs are chained with ``set_epoch`` so that a small dataset still fills the budget. The first
    batch (worker start-up, first decodes) is timed separately as ``first_batch_s``.
    """
    name = f"{engine}/{store_kind}"
    kwargs: dict[str, Any] = dict(split=split, imgsz=imgsz, batch_size=batch, engine=engine, store=store_kind,
                                  augment=True, shuffle=True)
    cls = engine_class(engine)
    if workers is not None:  # as many renderers as asked (workers, Ray actors; none for the gpu engine)
        kwargs.update(cls.renderer_keywords(workers))
    if hyp is not None:
        kwargs["hyp"] = hyp
    if cls.renders_on == "device":
        kwargs["device"] = "cuda"  # GPU engines deliver on the device; the loader checks CUDA itself
    t_start = time.perf_counter()
    try:
        ld = make_loader(data, **kwargs)
    except Exception as e:  # engine not installed (DALI), no GPU, store not buildable...
        return Measurement("loader", name, skipped=f"cannot build: {type(e).__name__}: {e}")
    samples = nbytes = 0
    first_batch_s = None
    t0 = None
    cpu0: CpuClock | None = None
    epoch = 0
    try:
        while True:
            ld.set_epoch(epoch)
            got_any = False
            for batch_ in ld:
                imgs = batch_[0]
                got_any = True
                if imgs.is_cuda:  # GPU work is asynchronous: count it when done
                    torch.cuda.synchronize(imgs.device)
                now = time.perf_counter()
                if t0 is None:
                    first_batch_s = now - t_start
                    t0 = now
                    # renderers that are not our children (Ray actors): their CPU time counts as the loader's too
                    cpu0 = CpuClock(ld.stats()["worker_pids"])
                else:
                    samples += int(imgs.shape[0])
                    nbytes += int(imgs.numel() * imgs.element_size())
                if now - t0 >= seconds:
                    break
            if not got_any:
                return Measurement("loader", name, skipped="the loader yielded no batch (dataset smaller than a batch with drop_last?)")
            if time.perf_counter() - t0 >= seconds:
                break
            epoch += 1
        dt = time.perf_counter() - t0 if t0 is not None else 0.0
        cpu = cpu0.cores_since(dt) if cpu0 is not None else {}
        stats = ld.stats()
    except Exception as e:
        return Measurement("loader", name, skipped=f"failed while iterating: {type(e).__name__}: {e}")
    finally:
        ld.close()
    n_workers = stats.get("actors", ld.engine.workers)
    unit = cls.renderers or "workers"
    extra: dict[str, Any] = {"first_batch_s": first_batch_s, "epochs": epoch + 1, "workers": n_workers, **cpu}
    hits, misses = stats.get("decode_cache_hits"), stats.get("decode_cache_misses")
    if hits is not None and misses is not None and hits + misses > 0:
        # share of image reads that had to decode (the rest came from the shared decode cache)
        extra["decode_miss_fraction"] = misses / (hits + misses)
    return Measurement(
        "loader", name, samples, nbytes, dt,
        note=f"batch {batch}, {n_workers} {unit}; after the first batch ({first_batch_s:.1f} s)"
        + (f"; busy cores: loader {cpu['cpu_loader_cores']:.1f}, others {cpu['cpu_other_cores']:.1f}" if cpu else ""),
        extra=extra,
    )
