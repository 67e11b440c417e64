"""How start-up, conversion and per-process memory grow with the number of images (issue 36).

Generates (once per size, reused from ``--root``) a dataset of N small JPEGs (96-160 px, 1-5 boxes each, written
by a thread pool with its own generator: tiles of noise cut and boxed, then ``cv2.imencode``), then measures, each
step in its own subprocess (``PYTHONPATH`` = the tree under test, ``--tree``):

* ``info``: ``fastload info`` with no index cache (first scan) and again (cached): wall seconds, max RSS;
* ``convert`` to each ``--stores`` kind: wall, max RSS, store bytes per image; ``verify`` of that store;
* ``loader()`` on each of files and the converted stores (the index cache is the one ``info`` wrote: its cold scan
  is ``info first``): the open, and a second open in a new process; the first batch, images/s and decodes per output image over ``--batches`` batches, and
  the memory of the main process and of each worker after them: RSS, USS, PSS (psutil) and private anonymous
  memory (``/proc/PID/smaps``: anonymous pages mapped by that process only) and file-backed RSS.

``--compat`` adds the compat layers and the loaders they replace, each in its own subprocess on the same images
(``imgsz``, ``batch``, ``workers``, ``--batches``): fastload's Ultralytics layer (``build_loader``, what
``FastloadTrainer`` builds) and YOLOv9 ``create_dataloader``; the official YOLOv9 ``create_dataloader`` (from a
temporary copy of ``--upstream``) and Ultralytics' own ``build_yolo_dataset`` + ``build_dataloader``, each opened
without its ``labels/train.cache`` and again with it. Per loader: open seconds, the seconds its trainer's first
read of ``dataset.labels`` takes (YOLOv9: ``np.concatenate(dataset.labels)``; Ultralytics: the per-class count over
one dict per image), first batch, images/s, and main / worker memory as above. ``--compat-only``: those rows only
(fastload's index cache made first by ``fastload info``, timed), saved to ``--json`` after each loader.

Printed as one table per step with each size side by side and the growth ratio of the largest to the smallest.

    python benchmarks/scale.py --root /tmp/scale --sizes 10000 100000          # add --million for 1M
    python benchmarks/scale.py --root /tmp/scale --sizes 10000 --tree /work/main  # another tree's code
    python benchmarks/scale.py --root /tmp/scale --sizes 10000 100000 --stores '' --compat  # + the compat rows
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable

import numpy as np
import yaml

REPO = Path(__file__).resolve().parents[1]
NAMES = ("a", "b", "c")
_TILES = 32  # noise tiles every image is cut from

# ----------------------------------------------------------------------------- the dataset


def _tiles(seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(_TILES):
        base = rng.integers(40, 200, size=3)
        noise = rng.integers(-25, 26, size=(160, 160, 3))
        out.append(np.clip(base + noise, 0, 255).astype(np.uint8))
    return out


def _write_one(k: int, tiles: list[np.ndarray], images: Path, labels: Path, seed: int) -> None:
    import cv2

    rng = np.random.default_rng([seed, k])
    h, w = (int(v) for v in rng.integers(96, 161, size=2))
    img = tiles[k % _TILES][:h, :w].copy()
    rows = []
    for _ in range(int(rng.integers(1, 6))):
        bw, bh = int(rng.integers(8, w // 2)), int(rng.integers(8, h // 2))
        x0, y0 = int(rng.integers(0, w - bw)), int(rng.integers(0, h - bh))
        c = int(rng.integers(0, len(NAMES)))
        cv2.rectangle(img, (x0, y0), (x0 + bw - 1, y0 + bh - 1), (60 * c + 40, 255 - 60 * c, 128), -1)
        rows.append(f"{c} {(x0 + bw / 2) / w:.6f} {(y0 + bh / 2) / h:.6f} {bw / w:.6f} {bh / h:.6f}\n")
    ok, enc = cv2.imencode(".jpg", img, [cv2.IMWRITE_JPEG_QUALITY, 90])
    assert ok
    (images / f"{k:07d}.jpg").write_bytes(enc.tobytes())
    (labels / f"{k:07d}.txt").write_text("".join(rows))


def make_dataset(root: Path, n: int, seed: int = 0, threads: int = 8) -> Path:
    """``root/n{n}/data.yaml`` with ``n`` train images (made once: a ``done`` marker says it is complete)."""
    ds = root / f"n{n}"
    yaml_path = ds / "data.yaml"
    if (ds / "done").is_file():
        return yaml_path
    images, labels = ds / "images" / "train", ds / "labels" / "train"
    images.mkdir(parents=True, exist_ok=True)
    labels.mkdir(parents=True, exist_ok=True)
    tiles = _tiles(seed)
    t0 = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        for _ in pool.map(lambda k: _write_one(k, tiles, images, labels, seed), range(n), chunksize=256):
            pass
    yaml_path.write_text(f"path: {ds}\ntrain: images/train\nval: images/train\nnc: {len(NAMES)}\n"
                         f"names: {list(NAMES)}\n")
    (ds / "done").write_text(f"{n}\n")
    print(f"generated {n} images in {time.perf_counter() - t0:.1f} s ({ds})", file=sys.stderr)
    return yaml_path


# ----------------------------------------------------------------------------- measured subprocesses

# Run in the tree's interpreter: open a loader, time it, render --batches batches, report memory per process.
LOADER_CHILD = r"""
import json, os, sys, time
t0 = time.perf_counter()
import fastload
a = json.loads(sys.argv[1])
sys.path.insert(0, a["bench"])
t_import = time.perf_counter()
L = fastload.loader(a["yaml"], imgsz=a["imgsz"], batch_size=a["batch"], workers=a["workers"], store=a["store"],
                    seed=0)
t_open = time.perf_counter()
out = {"import_s": t_import - t0, "open_s": t_open - t_import}
if a["batches"]:
    it = iter(L)
    next(it)
    t1 = time.perf_counter()
    out["first_batch_s"] = t1 - t_open
    for _ in range(a["batches"]):
        next(it)
    out["img_per_s"] = a["batches"] * a["batch"] / (time.perf_counter() - t1)
    st = L.stats()
    out["decodes_per_image"] = st.get("decodes_per_image")

    from scale import process_memory  # benchmarks/scale.py: its folder, a["bench"], is on sys.path above
    out["main"] = process_memory(os.getpid())
    out["workers"] = [process_memory(p) for p in st.get("worker_pids", [])]
L.close()
print("RESULT " + json.dumps(out))
"""


def run_child(args: list[str], tree: Path) -> tuple[dict[str, Any], float, int]:
    """Run ``python args`` in the tree (its code imported): (its ``RESULT`` json or {}, wall seconds, max RSS).

    The max RSS is wait4's of that child: the largest of it and the descendants it waited for (a pool's workers).
    """
    env = dict(os.environ, PYTHONPATH=str(tree))
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        t0 = time.perf_counter()
        # run in the tree: `python -c` and `-m` put the working directory first on sys.path
        proc = subprocess.Popen([sys.executable, *args], env=env, stdout=out, stderr=err, cwd=tree)
        _, status, usage = os.wait4(proc.pid, 0)
        wall = time.perf_counter() - t0
        proc.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0)
        err.seek(0)
        text, errors = out.read().decode(errors="replace"), err.read().decode(errors="replace")
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(args[:4])} failed ({proc.returncode}):\n{errors[-3000:]}")
    result = next((json.loads(line[7:]) for line in text.splitlines() if line.startswith("RESULT ")), {})
    return result, wall, usage.ru_maxrss * 1024


def clear_index_cache(ds: Path, cache_dir: Path) -> None:
    """Remove every scan cache of the dataset (beside its labels and in the benchmark's user cache dir)."""
    for folder in (ds / "labels", cache_dir):
        for p in folder.glob("*.fastload.cache*") if folder.is_dir() else ():
            if p.is_file():
                p.unlink()


def tree_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def measure(n: int, a: argparse.Namespace) -> dict[str, Any]:
    """Every step on the dataset of ``n`` images; flat {row name: value}."""
    yaml_path = make_dataset(a.root, n, threads=a.threads)
    ds = yaml_path.parent
    cache_dir = a.root / "user-cache"
    os.environ["FASTLOAD_CACHE_DIR"] = str(cache_dir)
    row: dict[str, Any] = {"images": n, "jpeg bytes/image": tree_bytes(ds / "images") / n}
    info = ["-m", "fastload", "info", str(yaml_path), "--split", "train"]
    clear_index_cache(ds, cache_dir)
    _, row["info first s"], row["info first maxrss"] = run_child(info, a.tree)
    _, row["info cached s"], row["info cached maxrss"] = run_child(info, a.tree)
    row["index cache bytes/image"] = sum(p.stat().st_size for p in (ds / "labels").glob("*.fastload.cache*")) / n

    def loader(store: str, yaml: Path, prefix: str) -> None:
        spec = {"yaml": str(yaml), "imgsz": a.imgsz, "batch": a.batch, "workers": a.workers, "store": store,
                "bench": str(Path(__file__).resolve().parent)}
        res, _, row[f"{prefix} maxrss"] = run_child(["-c", LOADER_CHILD, json.dumps(dict(spec, batches=a.batches))], a.tree)
        row[f"{prefix} open s"] = res["open_s"]
        row[f"{prefix} first batch s"] = res["first_batch_s"]
        row[f"{prefix} img/s"] = res["img_per_s"]
        row[f"{prefix} decodes/image"] = res["decodes_per_image"]
        for field in ("rss", "uss", "pss", "private_anon", "file_rss"):
            row[f"{prefix} main {field}"] = res["main"][field]
            if res["workers"]:
                row[f"{prefix} worker {field} (max)"] = max(w[field] for w in res["workers"])
        again, _, _ = run_child(["-c", LOADER_CHILD, json.dumps(dict(spec, batches=0))], a.tree)
        row[f"{prefix} second open s"] = again["open_s"]

    loader("files", yaml_path, "loader files")
    out = ds / "fastload"
    for kind in a.stores:
        conv = ["-m", "fastload", "convert", str(yaml_path), "--to", kind, "--out", str(out), "--split", "train",
                "--imgsz", str(a.imgsz), "--no-progress", "--force"]
        _, row[f"convert {kind} s"], row[f"convert {kind} maxrss"] = run_child(conv, a.tree)
        store = out / yaml.safe_load((out / "data.yaml").read_text())["fastload"]["train"][kind]
        row[f"{kind} bytes/image"] = tree_bytes(store) / n
        _, row[f"verify {kind} s"], row[f"verify {kind} maxrss"] = run_child(
            ["-m", "fastload", "verify", str(store), "--no-progress"], a.tree)
        loader(kind, out / "data.yaml", f"loader {kind}")
        if not a.keep_stores:
            shutil.rmtree(store)
    return row


# ----------------------------------------------------------------------------- compat layers (--compat)

COMPAT_LOADERS = ("fastload ultralytics compat", "fastload yolov9 compat", "official yolov9", "ultralytics own")


def process_memory(pid: int) -> dict[str, int]:
    """RSS, USS, PSS (psutil) of ``pid``, its private anonymous memory and file-backed RSS (``/proc/PID/smaps``)."""
    import psutil

    anon = file_rss = 0
    fields: dict[str, Any] = {}

    def flush() -> None:
        nonlocal anon, file_rss
        if fields:
            anon += min(fields.get("Anonymous", 0), fields.get("Private_Clean", 0) + fields.get("Private_Dirty", 0))
            file_rss += fields.get("Rss", 0) if fields["path"].startswith("/") else 0

    with open(f"/proc/{pid}/smaps") as f:
        for line in f:
            head = line.split(None, 1)[0]
            if not head.endswith(":"):  # a mapping line: address perms offset dev inode [path]
                flush()
                parts = line.split(None, 5)
                fields = {"path": parts[5].strip() if len(parts) > 5 else ""}
            elif head[:-1] in ("Rss", "Anonymous", "Private_Clean", "Private_Dirty"):
                fields[head[:-1]] = int(line.split()[1]) * 1024
    flush()
    m = psutil.Process(pid).memory_full_info()
    return {"rss": m.rss, "uss": m.uss, "pss": m.pss, "private_anon": anon, "file_rss": file_rss}


def _compat_opener(a: dict[str, Any]) -> Callable[[], tuple[Any, Any, Callable[[], list[int]], Callable[[], None]]]:
    """In the child, once the modules of ``a["kind"]`` are imported: the function that opens that loader and
    returns ``(batches, dataset.labels as its trainer reads them, worker pids, close)``."""
    images, kind = a["images"], a["kind"]
    data = {"names": dict(enumerate(NAMES)), "nc": len(NAMES), "channels": 3}
    overrides = {"imgsz": a["imgsz"], "batch": a["batch"], "workers": a["workers"], "seed": 0, "verbose": False}
    if kind == "fastload ultralytics compat":
        from fastload.compat.ultralytics.loader import LoaderRequest, build_loader
        from fastload.compat.ultralytics.options import UltralyticsOptions
        from ultralytics.cfg import get_cfg

        def ultralytics_compat():
            ld = build_loader(get_cfg(overrides=overrides), data, LoaderRequest(images, a["batch"], "train", False, 32),
                              UltralyticsOptions())
            return ld, ld.dataset.labels, lambda: ld.stats()["worker_pids"], ld.close
        return ultralytics_compat
    if kind == "fastload yolov9 compat":
        from fastload.augment.hyp import HYP_SCRATCH_HIGH
        from fastload.compat.yolov9 import create_dataloader

        def yolov9_compat():
            fl, ds = create_dataloader(images, a["imgsz"], a["batch"], 32, hyp=dict(HYP_SCRATCH_HIGH), augment=True,
                                       workers=a["workers"], shuffle=True)
            return fl, ds.labels, lambda: fl.stats()["worker_pids"], fl.close
        return yolov9_compat
    if kind == "official yolov9":
        sys.path.insert(0, a["upstream"])
        from utils.dataloaders import create_dataloader  # the official one, from the copy

        hyp = yaml.safe_load((Path(a["upstream"]) / "data" / "hyps" / "hyp.scratch-high.yaml").read_text())

        def official():
            ld, ds = create_dataloader(images, a["imgsz"], a["batch"], 32, hyp=hyp, augment=True,
                                       workers=a["workers"], shuffle=True)
            return ld, ds.labels, lambda: [w.pid for w in ld.iterator._workers], lambda: None
        return official
    from ultralytics.cfg import get_cfg
    from ultralytics.data import build_dataloader, build_yolo_dataset

    def ultralytics_own():
        ds = build_yolo_dataset(get_cfg(overrides=overrides), images, a["batch"], data, mode="train", stride=32)
        ld = build_dataloader(ds, a["batch"], a["workers"], shuffle=True, rank=-1)
        return ld, ds.labels, lambda: [w.pid for w in ld.iterator._workers], lambda: None
    return ultralytics_own


def compat_child(spec: str) -> None:
    """The measured subprocess of one compat row (``--compat``): prints ``RESULT {json}``."""
    import numpy as np

    a = json.loads(spec)
    t0 = time.perf_counter()
    open_loader = _compat_opener(a)
    t1 = time.perf_counter()
    batches, read, worker_pids, close = open_loader()
    out: dict[str, Any] = {"import_s": t1 - t0, "open_s": time.perf_counter() - t1}
    t = time.perf_counter()
    if a["kind"] in ("fastload yolov9 compat", "official yolov9"):  # YOLOv9's train.py: one array of every label
        np.concatenate(read, 0)
    else:  # Ultralytics' trainer: class counts over one dict per image (and its max_det check, the same walk)
        np.bincount(np.concatenate([lb["cls"].flatten() for lb in read], 0).astype(int), minlength=len(NAMES))
    out["labels_s"] = time.perf_counter() - t
    if a["batches"]:
        it = iter(batches)
        t = time.perf_counter()
        next(it)
        out["first_batch_s"] = time.perf_counter() - t
        t = time.perf_counter()
        for _ in range(a["batches"]):
            next(it)
        out["img_per_s"] = a["batches"] * a["batch"] / (time.perf_counter() - t)
        out["main"] = process_memory(os.getpid())
        out["workers"] = [process_memory(pid) for pid in worker_pids()]
    close()
    print("RESULT " + json.dumps(out))


def index_only(n: int, a: argparse.Namespace) -> dict[str, Any]:
    """``--compat-only``: the dataset of ``n`` images and fastload's index cache (``fastload info``, timed: with no
    cache it is the first scan), so the compat rows open as a second ``loader()`` does."""
    yaml_path = make_dataset(a.root, n, threads=a.threads)
    os.environ["FASTLOAD_CACHE_DIR"] = str(a.root / "user-cache")
    row: dict[str, Any] = {"images": n}
    _, row["info s"], row["info maxrss"] = run_child(["-m", "fastload", "info", str(yaml_path), "--split", "train"], a.tree)
    return row


def measure_compat(n: int, a: argparse.Namespace, row: dict[str, Any], save: Callable[[], None]) -> None:
    """The ``--compat`` rows of the dataset of ``n`` images, added to ``row`` (``save()`` after each loader); the
    official loaders' first open is without their ``labels/train.cache`` (a file both name alike: each is removed
    before its first open)."""
    ds = make_dataset(a.root, n, threads=a.threads).parent
    label_cache = ds / "labels" / "train.cache"
    bench = str(Path(__file__).resolve().parent)
    for kind in COMPAT_LOADERS:
        if kind == "official yolov9" and a.upstream is None:
            continue
        official = kind in ("official yolov9", "ultralytics own")
        spec = {"kind": kind, "images": str(ds / "images" / "train"), "imgsz": a.imgsz, "batch": a.batch,
                "workers": a.workers, "batches": a.batches, "upstream": str(a.upstream)}
        child = ["-c", f"import sys; sys.path.insert(0, {bench!r}); import scale; scale.compat_child(sys.argv[1])"]
        if official:
            label_cache.unlink(missing_ok=True)
        try:
            res, _, row[f"{kind} maxrss"] = run_child(child + [json.dumps(spec)], a.tree)
        except RuntimeError as e:  # say which loader does not run here, and go on with the others
            print(f"{kind} at N = {n:,}: {str(e).splitlines()[0]}", file=sys.stderr)
            continue
        row[f"{kind} {'first ' if official else ''}open s"] = res["open_s"]
        if official:
            again, _, _ = run_child(child + [json.dumps(dict(spec, batches=0))], a.tree)
            row[f"{kind} second open s"] = again["open_s"]
        row[f"{kind} labels read s"] = res["labels_s"]
        row[f"{kind} first batch s"] = res["first_batch_s"]
        row[f"{kind} img/s"] = res["img_per_s"]
        for field in ("rss", "uss", "pss", "private_anon"):
            row[f"{kind} main {field}"] = res["main"][field]
            if res["workers"]:
                row[f"{kind} worker {field} (max)"] = max(w[field] for w in res["workers"])
        save()


def upstream_copy(src: Path) -> Path:
    """A temporary copy of the official YOLOv9 checkout (its loader imported from there, nothing changed)."""
    dst = Path(tempfile.mkdtemp(prefix="scale_yolov9_")) / "yolov9"
    shutil.copytree(src, dst)
    return dst


def _fmt(key: str, v: Any) -> str:
    if v is None:
        return "-"
    if "rss" in key or "uss" in key or "pss" in key or "anon" in key:
        return f"{v / 2**20:.0f} MiB"
    if key.endswith(" s"):
        return f"{v:.2f}"
    if isinstance(v, float):
        return f"{v:.0f}" if v >= 100 else f"{v:.2f}"
    return str(v)


def table(rows: list[dict[str, Any]]) -> str:
    """Markdown: one line per measure, one column per size, and the last size over the first."""
    keys = list(dict.fromkeys(k for r in rows for k in r))
    head = "| measure | " + " | ".join(f"{r['images']:,}" for r in rows) + " | growth |"
    lines = [head, "|" + "---|" * (len(rows) + 2)]
    for k in keys[1:]:
        vals = [r.get(k) for r in rows]
        growth = "-"
        if len(rows) > 1 and isinstance(vals[0], (int, float)) and isinstance(vals[-1], (int, float)) and vals[0]:
            growth = f"{vals[-1] / vals[0]:.2f}x"
        lines.append(f"| {k} | " + " | ".join(_fmt(k, v) for v in vals) + f" | {growth} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--root", type=Path, required=True, help="folder of the generated datasets (reused across runs)")
    ap.add_argument("--sizes", type=int, nargs="+", default=[10_000, 100_000])
    ap.add_argument("--million", action="store_true", help="add N = 1,000,000")
    ap.add_argument("--stores", default="lmdb,disk,encoded", help="store kinds to convert to, comma separated ('' none)")
    ap.add_argument("--tree", type=Path, default=REPO, help="the fastload tree whose code is measured")
    ap.add_argument("--imgsz", type=int, default=160)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--batches", type=int, default=20, help="batches timed after the first")
    ap.add_argument("--threads", type=int, default=8, help="generator threads")
    ap.add_argument("--keep-stores", action="store_true", help="keep the converted stores (default: removed)")
    ap.add_argument("--json", type=Path, help="also write the rows here")
    ap.add_argument("--compat", action="store_true",
                    help="add the compat layers' rows and those of the official YOLOv9 and Ultralytics loaders")
    ap.add_argument("--compat-only", action="store_true",
                    help="--compat without the other steps (fastload's index cache is made first, by `fastload info`)")
    ap.add_argument("--upstream", type=Path, default=REPO.parent / "shared" / "upstream" / "yolov9",
                    help="the official YOLOv9 checkout (--compat; copied to a temporary folder)")
    a = ap.parse_args(argv)
    a.stores = [s for s in a.stores.split(",") if s]
    a.root, a.tree = a.root.resolve(), a.tree.resolve()
    sizes = sorted(set(a.sizes + ([1_000_000] if a.million else [])))
    a.compat = a.compat or a.compat_only
    if a.compat:
        a.upstream = upstream_copy(a.upstream) if (a.upstream / "utils" / "dataloaders.py").is_file() else None
    rows: list[dict[str, Any]] = []

    def save() -> None:
        if a.json:
            a.json.write_text(json.dumps(rows, indent=1))

    for n in sizes:
        rows.append(index_only(n, a) if a.compat_only else measure(n, a))
        if a.compat:
            measure_compat(n, a, rows[-1], save)
        print(f"measured N = {n:,}", file=sys.stderr)
        save()
    print(f"tree {a.tree}; imgsz {a.imgsz}, batch {a.batch}, {a.workers} workers, {a.batches} batches timed")
    print(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
