"""Read throughput of every store kind side by side, beside this machine's memcpy ceiling.

    python benchmarks/store_read.py [--data data.yaml] [--seconds 2] [--imgsz 640] [--json out.json]
    python benchmarks/store_read.py --check-cost [--rounds 5] [--workers 2] [--batch 16] [--epochs 3]
    python benchmarks/store_read.py --cold [--rounds 3]

Default data: coco128 (``$FASTLOAD_COCO128`` or ../shared/datasets/coco128) if present, else a
synthetic set. The dataset is converted to lmdb and disk stores in a temporary folder and a ram store
is built from the disk store in shared memory (removed at exit). For each store, one process, one
thread, warm page cache, random order:

* ``read``: ``store.read_image(i)`` with the sample copied into a reusable buffer (a decoded store
  returns a zero-copy view; copying it is what a collate step does) - samples/s and MB/s;
* ``loaded``: ``store.load(i, imgsz)``, the RGB image at ``imgsz`` an augmentation engine starts from
  (decode + resize for files/lmdb, nothing more for disk/ram), also copied once - samples/s.

Ratios: ``x files`` compares loaded samples/s with the plain files store; ``% memcpy`` compares read
MB/s with one core's ``numpy.copyto`` rate.

``--check-cost``: what the load-time checksum of decoded stores costs (a disk/ram record's crc32 is
checked on its first read in each process), with and without the check side by side, rounds
interleaved, the best round reported (other work on the machine only ever slows a round down): ``first read`` reads every record of a freshly opened disk/ram store once
(each read checked: the worst case, no augmentation), ``loader epoch 1`` is the images/s of the first
epoch of a fresh ``fastload.loader`` (cpu engine, fresh workers: every record checked in every worker
that reads it), ``loader epochs 1-E`` of its first ``--epochs`` epochs (later epochs check only the
records a worker had not read yet); each also per CPU second of the loader's processes (``/cpu s``),
which a machine shared with other work disturbs less than the wall clock. ``loaded lmdb`` is the same for the crc32 an LMDB store
checks on every read: ``store.load`` (decode + resize) of every record, with and without it.

``--cold``: a dataset larger than memory. Each store's files (the image files; ``data.mdb``, ``images.bin``,
``pixels.bin``) are dropped from the page cache (``posix_fadvise``), then every record is read once in random order:
samples/s, MB/s and CPU ms per record (this process: page faults and read calls count), rounds interleaved, the
best reported; ``lmdb, no read-ahead`` is the LMDB store opened as fastload did before it let the kernel read
ahead (``fastload.store.lmdb_store.READAHEAD``).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Iterator

import numpy as np

REPO = Path(__file__).resolve().parents[1]


def default_data(tmp: Path) -> Path:
    coco = Path(os.environ.get("FASTLOAD_COCO128", REPO.parent / "shared" / "datasets" / "coco128")) / "coco128.yaml"
    if coco.is_file():
        return coco
    from fastload.data.synthetic import make_synthetic_dataset

    return make_synthetic_dataset(tmp / "synth", n_train=128, n_val=8, nc=3, seed=0)


@contextlib.contextmanager
def converted(data: Path | None, imgsz: int, split: str) -> Iterator[tuple[Path, Any]]:
    """``(data, its lmdb, encoded and disk stores' convert result)`` in a temporary folder removed afterwards
    (``data`` None: :func:`default_data`)."""
    from fastload.store.convert import convert

    with tempfile.TemporaryDirectory(prefix="store_read_") as tmp_s:
        tmp = Path(tmp_s)
        data = data or default_data(tmp)
        yield data, convert(data, "lmdb,encoded,disk", out=tmp / "stores", imgsz=imgsz, splits=split, progress=False,
                            log=lambda s: None)


def measure(store: Any, seconds: float, imgsz: int, mode: str, seed: int = 0) -> dict[str, float]:
    """Samples/s and MB/s of ``read`` or ``loaded`` access over ``seconds`` in random order."""
    n = len(store)
    order = np.random.default_rng(seed).permutation(n)
    buf = np.empty(imgsz * imgsz * 3 * 4 + (16 << 20), np.uint8)  # big enough for any sample here
    count = nbytes = 0
    t0 = time.perf_counter()
    while True:
        for i in order:
            sample = store.read_image(int(i)) if mode == "read" else store.load(int(i), imgsz)
            raw = np.frombuffer(sample, np.uint8) if isinstance(sample, bytes) else sample.reshape(-1)
            if raw.size > buf.size:
                buf = np.empty(raw.size * 2, np.uint8)
            np.copyto(buf[: raw.size], raw)  # touch every byte, as a collate into a batch would
            nbytes += raw.size
            count += 1
            if count % 16 == 0 and time.perf_counter() - t0 >= seconds:
                dt = time.perf_counter() - t0
                return {"samples_s": count / dt, "mb_s": nbytes / dt / 1e6, "samples": count}


def run(data: Path | None, seconds: float, imgsz: int, split: str) -> dict[str, Any]:
    from fastload.bench.ceilings import memcpy_rate
    from fastload.store import open_store

    with converted(data, imgsz, split) as (data, res):
        stores = {
            "files": open_store(data, split, kind="files"),
            "lmdb": open_store(res.yaml_path, split, kind="lmdb"),
            "encoded": open_store(res.yaml_path, split, kind="encoded"),
            "disk": open_store(res.yaml_path, split, kind="disk", imgsz=imgsz),
            "ram": open_store(res.yaml_path, split, kind="ram", imgsz=imgsz),  # from the disk store, not pinned
        }
        try:
            for s in stores.values():  # warm the page cache: every kind starts from the same state
                for i in range(len(s)):
                    s.read_image(i)
            memcpy = memcpy_rate(seconds=0.5, nbytes=256 << 20)
            rows = {}
            for kind, s in stores.items():
                read = measure(s, seconds, imgsz, "read")
                loaded = measure(s, seconds, imgsz, "loaded")
                rows[kind] = {
                    "decoded": s.decoded,
                    "read_samples_s": read["samples_s"],
                    "read_mb_s": read["mb_s"],
                    "loaded_samples_s": loaded["samples_s"],
                    "store_bytes": sum(s.nbytes(i) for i in range(len(s))),
                }
        finally:
            for s in stores.values():
                s.close()
    base = rows["files"]["loaded_samples_s"]
    for r in rows.values():
        r["loaded_x_files"] = r["loaded_samples_s"] / base
        r["read_pct_memcpy"] = 100 * r["read_mb_s"] / memcpy
    return {
        "data": str(data),
        "split": split,
        "samples": len(stores["files"]),
        "imgsz": imgsz,
        "seconds": seconds,
        "memcpy_gb_s": memcpy / 1e3,
        "cpus": os.cpu_count(),
        "stores": rows,
    }


def _first_reads(path: str) -> float:
    """Records/s of reading (and copying) every record of the packed store at ``path`` once, each a first read
    (a store object opened for it: a fresh bitmap of checked records)."""
    from fastload.store.packed import PackedStore

    with PackedStore(path) as store:
        buf = np.empty(0, np.uint8)
        t0 = time.perf_counter()
        for i in range(len(store)):
            img = store.read_image(i).reshape(-1)
            if img.size > buf.size:
                buf = np.empty(img.size, np.uint8)
            np.copyto(buf[: img.size], img)
        return len(store) / (time.perf_counter() - t0)


def _loaded(store: Any, imgsz: int) -> float:
    """Records/s of ``store.load`` (decode + resize for an encoded store) over every record once."""
    t0 = time.perf_counter()
    for i in range(len(store)):
        store.load(i, imgsz)
    return len(store) / (time.perf_counter() - t0)


def _cpu_seconds(pids: list[int]) -> float:
    """User + system CPU seconds of these processes so far (the loader's workers)."""
    import psutil

    return sum(sum(psutil.Process(pid).cpu_times()[:2]) for pid in pids)


def _epochs(yaml_path: Path, kind: str, imgsz: int, batch: int, workers: int, epochs: int) -> tuple[float, ...]:
    """Images/s of the first epoch and of the first ``epochs`` epochs of a fresh loader (its workers check
    every record on its first read), by the wall clock and per CPU second (the loader's processes)."""
    from fastload.fastloader import loader

    with loader(yaml_path, store=kind, imgsz=imgsz, batch_size=batch, workers=workers, seed=0) as fl:
        t0, c0 = time.perf_counter(), time.process_time()
        images = [sum(len(paths) for _, _, paths, _ in fl)]
        pids = fl.stats()["worker_pids"]  # fresh workers: their whole CPU time is this loader's
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0 + _cpu_seconds(pids)
        images += [sum(len(paths) for _, _, paths, _ in fl) for _ in range(epochs - 1)]
        wall_all, cpu_all = time.perf_counter() - t0, time.process_time() - c0 + _cpu_seconds(pids)
        return images[0] / wall, sum(images) / wall_all, images[0] / cpu, sum(images) / cpu_all


def run_check_cost(data: Path | None, imgsz: int, split: str, rounds: int, batch: int, workers: int,
                   epochs: int) -> dict[str, Any]:
    from fastload.data.checksum import CRC32_IMPLEMENTATION
    from fastload.store import open_store
    from fastload.store.convert import convert
    from fastload.store.lmdb_store import LmdbStore
    from fastload.store.packed import PackedStore

    with tempfile.TemporaryDirectory(prefix="store_check_") as tmp_s:
        tmp = Path(tmp_s)
        data = data or default_data(tmp)
        res = convert(data, "lmdb,disk", out=tmp / "stores", imgsz=imgsz, splits=split, progress=False, log=lambda s: None)
        stores = {kind: open_store(res.yaml_path, split, kind=kind, imgsz=imgsz) for kind in ("disk", "ram")}
        lmdb = open_store(res.yaml_path, split, kind="lmdb")
        loader_rows = ("loader epoch 1", f"loader epochs 1-{epochs}", "loader epoch 1 /cpu s",
                       f"loader epochs 1-{epochs} /cpu s")
        runs: dict[str, dict[str, list[float]]] = {
            f"{what} {kind}": {"check": [], "no check": []} for what in ("first read", *loader_rows) for kind in stores}
        runs["loaded lmdb"] = {"check": [], "no check": []}
        try:
            for s in stores.values():  # warm the page cache
                _first_reads(s.path)
            for r in range(rounds):
                for check in ((True, False) if r % 2 == 0 else (False, True)):  # alternate which goes first
                    # class attributes: forked workers inherit them
                    PackedStore.check_on_read = LmdbStore.check_on_read = check
                    label = "check" if check else "no check"
                    for kind, s in stores.items():
                        runs[f"first read {kind}"][label].append(_first_reads(s.path))
                        rates = _epochs(res.yaml_path, kind, imgsz, batch, workers, epochs)
                        for what, rate in zip(loader_rows, rates):
                            runs[f"{what} {kind}"][label].append(rate)
                    runs["loaded lmdb"][label].append(_loaded(lmdb, imgsz))
        finally:
            PackedStore.check_on_read = LmdbStore.check_on_read = True
            n = len(stores["disk"])
            for s in [*stores.values(), lmdb]:
                s.close()
    rows = {name: {label: float(np.max(v)) for label, v in by.items()} for name, by in runs.items()}
    for row in rows.values():
        row["cost_pct"] = 100 * (1 - row["check"] / row["no check"])
    return {"data": str(data), "split": split, "samples": n, "imgsz": imgsz, "rounds": rounds, "batch": batch,
            "workers": workers, "epochs": epochs, "cpus": os.cpu_count(), "crc32": CRC32_IMPLEMENTATION, "rows": rows}


def _cold_pass(store: Any, seed: int) -> dict[str, float]:
    """Every record of ``store`` read once in random order after its files left the page cache."""
    from fastload.bench.pagecache import drop

    files = list(store.im_files) if store.kind == "files" else [str(p) for p in Path(store.path).iterdir()]
    dropped = drop(files)
    if not dropped.ok:
        raise SystemExit(f"--cold: {store.kind} store's files stayed in the page cache ({dropped.describe()})")
    order = np.random.default_rng(seed).permutation(len(store))
    t0, c0, nbytes = time.perf_counter(), time.process_time(), 0
    for i in order:
        sample = store.read_image(int(i))
        nbytes += len(sample) if isinstance(sample, bytes) else sample.nbytes
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    return {"samples_s": len(store) / wall, "mb_s": nbytes / wall / 1e6, "cpu_ms": cpu / len(store) * 1e3}


def run_cold(data: Path | None, imgsz: int, split: str, rounds: int) -> dict[str, Any]:
    from fastload.store import lmdb_store, open_store

    with converted(data, imgsz, split) as (data, res):
        kinds = {"files": ("files", True), "lmdb": ("lmdb", True), "lmdb, no read-ahead": ("lmdb", False),
                 "encoded": ("encoded", True), "disk": ("disk", True)}
        runs: dict[str, list[dict[str, float]]] = {name: [] for name in kinds}
        for r in range(rounds):
            for name, (kind, readahead) in kinds.items():
                lmdb_store.READAHEAD = readahead  # read when the store opens its environment
                try:
                    data_for = data if kind == "files" else res.yaml_path
                    with open_store(data_for, split, kind=kind, imgsz=imgsz) as store:
                        runs[name].append(_cold_pass(store, seed=r))
                        n = len(store)
                finally:
                    lmdb_store.READAHEAD = True
    rows = {name: max(v, key=lambda x: x["samples_s"]) for name, v in runs.items()}
    return {"data": str(data), "split": split, "samples": n, "imgsz": imgsz, "rounds": rounds, "rows": rows}


def format_cold(r: dict[str, Any]) -> str:
    lines = [f"cold reads: {r['samples']} samples of {r['data']} ({r['split']}), each store's files dropped from the "
             f"page cache, every record once in random order, 1 process, best of {r['rounds']} interleaved rounds",
             "", "| store | samples/s | MB/s | CPU ms/record |", "|---|---:|---:|---:|"]
    for name, row in r["rows"].items():
        lines.append(f"| {name} | {row['samples_s']:.0f} | {row['mb_s']:.0f} | {row['cpu_ms']:.3f} |")
    return "\n".join(lines)


def format_check_cost(r: dict[str, Any]) -> str:
    lines = [
        f"load-time checksum of decoded stores: {r['samples']} samples of {r['data']} ({r['split']}), imgsz {r['imgsz']}, "
        f"best of {r['rounds']} interleaved rounds; loader: cpu engine, {r['workers']} workers, batch {r['batch']}; "
        f"crc32 by {r['crc32']}",
        "",
        "| measure | images/s with check | images/s without | cost |",
        "|---|---:|---:|---:|",
    ]
    for name, row in r["rows"].items():
        lines.append(f"| {name} | {row['check']:.0f} | {row['no check']:.0f} | {row['cost_pct']:+.1f} % |")
    lines += ["", "first read = every record read once from a freshly opened store (each read checked); "
              "loader = a fresh loader's first epoch(s): each worker checks a record on its first read of it"]
    return "\n".join(lines)


def format_table(r: dict[str, Any]) -> str:
    lines = [
        f"store read throughput: {r['samples']} samples of {r['data']} ({r['split']}), imgsz {r['imgsz']}, "
        f"1 process, warm page cache, {r['seconds']:.0f} s each",
        f"memcpy ceiling (numpy copy, 256 MB, one core): {r['memcpy_gb_s']:.2f} GB/s",
        "",
        "| store | read samples/s | read MB/s | % memcpy | loaded samples/s | x files | stored MB |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for kind, s in r["stores"].items():
        lines.append(
            f"| {kind} | {s['read_samples_s']:.0f} | {s['read_mb_s']:.0f} | {s['read_pct_memcpy']:.1f} | "
            f"{s['loaded_samples_s']:.0f} | {s['loaded_x_files']:.1f} | {s['store_bytes'] / 1e6:.1f} |"
        )
    lines.append("")
    lines.append("read = sample bytes copied into a buffer; loaded = RGB image at imgsz (decode + resize for files/lmdb)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data", type=Path, default=None, help="data.yaml (default: coco128 if present, else synthetic)")
    p.add_argument("--split", default="train")
    p.add_argument("--seconds", type=float, default=2.0, help="seconds per store and mode (default 2)")
    p.add_argument("--imgsz", type=int, default=640)
    p.add_argument("--json", type=Path, default=None, help="also write the results to this JSON file")
    p.add_argument("--check-cost", action="store_true",
                   help="only the cost of the decoded stores' load-time checksum, with and without it side by side")
    p.add_argument("--rounds", type=int, default=7, help="--check-cost: interleaved rounds (the best reported)")
    p.add_argument("--batch", type=int, default=16, help="--check-cost: the loader's batch size")
    p.add_argument("--workers", type=int, default=2, help="--check-cost: the loader's worker processes")
    p.add_argument("--epochs", type=int, default=3, help="--check-cost: epochs of each loader run")
    p.add_argument("--cold", action="store_true",
                   help="only cold reads: every record once after the store's files left the page cache")
    args = p.parse_args(argv)
    if args.cold:
        result = run_cold(args.data, args.imgsz, args.split, args.rounds)
        print(format_cold(result))
    elif args.check_cost:
        result = run_check_cost(args.data, args.imgsz, args.split, args.rounds, args.batch, args.workers, args.epochs)
        print(format_check_cost(result))
    else:
        result = run(args.data, args.seconds, args.imgsz, args.split)
        print(format_table(result))
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
