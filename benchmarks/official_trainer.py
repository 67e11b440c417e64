"""The official YOLOv9 ``train_dual.py`` with its own loader vs with fastload, same flags, side by side.

    nice -n 5 python benchmarks/official_trainer.py                       # coco128, --img 128, 3 epochs
    python benchmarks/official_trainer.py --img 160 --epochs 4 --rounds 2 --cache ram

Both runs use a temporary copy of the official repository (``--yolov9``, default
../shared/upstream/yolov9) with no file edited (numpy >= 2.4: ``np.trapz`` -> ``np.trapezoid`` in its
metrics, see tests/official_helpers.py) and the same flags: ``--cfg yolov9-t --workers 2 --batch 16
--noval --noplots``. The fastload run goes through the no-edit launcher's mechanism. Each run's
``create_dataloader`` result is wrapped, from outside the official code, in a timer of the training
loader's iteration: per epoch the wall time from ``iter(loader)`` to its end (all the training steps of
the epoch, not the validation after it) and the time spent inside ``next()`` waiting for a batch.
Printed per epoch and as means over the epochs after the first (warm-up: model build, first workers).
"""
from __future__ import annotations

import argparse
import atexit
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Iterator

REPO = Path(__file__).resolve().parents[1]
DEFAULT_UPSTREAM = REPO.parent / "shared" / "upstream" / "yolov9"
DEFAULT_COCO = REPO.parent / "shared" / "datasets" / "coco128"
LOADERS = ("stock", "fastload")


# ----------------------------------------------------------------------------- in the official process
def timed_loader(loader: Any, epochs: list[dict[str, float]]) -> Any:
    """The trainer's loader with its iteration timed (one record per epoch appended to ``epochs``);
    everything else is the loader's own."""
    from fastload.compat.batch_log import LoaderWrapper

    class TimedLoader(LoaderWrapper):
        def __iter__(self) -> Iterator[Any]:
            return _timed_iteration(self._loader, epochs)

    return TimedLoader(loader)


def _children_cpu_s() -> float:
    """CPU seconds used so far by this process's live child processes (the loader's workers)."""
    import psutil

    total = 0.0
    for child in psutil.Process().children(recursive=True):
        try:
            t = child.cpu_times()
            total += t.user + t.system
        except psutil.Error:
            pass
    return total


def _timed_iteration(loader: Any, epochs: list[dict[str, float]]) -> Iterator[Any]:
    t0 = time.perf_counter()
    workers_cpu0 = _children_cpu_s()
    wait = 0.0
    batches = 0
    it = iter(loader)
    while True:
        t = time.perf_counter()
        try:
            batch = next(it)
        except StopIteration:
            break
        wait += time.perf_counter() - t
        batches += 1
        yield batch
    epochs.append({"epoch_s": time.perf_counter() - t0, "wait_s": wait, "batches": batches,
                   "workers_cpu_s": _children_cpu_s() - workers_cpu0})


def child(kind: str, out: str, script: str, args: list[str]) -> None:
    """Run ``script`` with the ``kind`` loader, its training loader timed; results to ``out`` (JSON)."""
    from fastload.compat.yolov9 import launcher

    sys.path.insert(0, str(Path(script).resolve().parent))
    import utils.dataloaders as official  # the checkout's, imported as the script will import it

    create: Callable[..., Any]
    if kind == "stock":
        create = official.create_dataloader
    else:
        from fastload.compat.yolov9 import create_dataloader as create
    epochs: list[dict[str, float]] = []
    t_start = time.perf_counter()

    def timed(*a: Any, **kw: Any) -> Any:
        loader, dataset = create(*a, **kw)
        return (timed_loader(loader, epochs), dataset) if kw.get("augment") else (loader, dataset)

    def save() -> None:
        Path(out).write_text(json.dumps({"loader": kind, "epochs": epochs, "process_s": time.perf_counter() - t_start}))

    atexit.register(save)
    launcher.run(script, args, timed)


# ----------------------------------------------------------------------------- the comparison
def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--yolov9", type=Path, default=DEFAULT_UPSTREAM, help="official YOLOv9 checkout (copied)")
    p.add_argument("--coco", type=Path, default=DEFAULT_COCO, help="coco128 folder (images/train2017, labels/train2017)")
    p.add_argument("--images", type=int, default=128, help="how many of its images")
    p.add_argument("--img", type=int, default=128)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--cfg", default="models/detect/yolov9-t.yaml")
    p.add_argument("--cache", default=None, help="the official --cache value for both runs (e.g. ram)")
    p.add_argument("--rounds", type=int, default=1, help="stock/fastload pairs, alternating")
    p.add_argument("--keep", action="store_true", help="keep the work folder (copy, data, runs) afterwards")
    p.add_argument("--threads", type=int, default=1,
                   help="OMP_NUM_THREADS of the trainer (1: two threads on a shared 2-core machine spin-wait)")
    return p.parse_args(argv)


def one_run(kind: str, checkout: Path, data: Path, work: Path, args: argparse.Namespace, k: int) -> dict[str, Any]:
    sys.path.insert(0, str(REPO / "tests"))
    from official_helpers import official_env

    out = work / f"{kind}-{k}.json"
    flags = ["--data", str(data), "--cfg", args.cfg, "--weights", "", "--hyp", "data/hyps/hyp.scratch-high.yaml",
             "--img", str(args.img), "--batch", str(args.batch), "--workers", str(args.workers), "--epochs",
             str(args.epochs), "--device", "cpu", "--noval", "--noplots", "--project", str(work / "runs"),
             "--name", f"{kind}-{k}", "--exist-ok", *(["--cache", args.cache] if args.cache else [])]
    env = official_env(work, OMP_NUM_THREADS=str(args.threads))
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", kind, "--out", str(out), "train_dual.py", *flags]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=checkout, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{kind} run failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    result = json.loads(out.read_text())
    result["wall_s"] = time.perf_counter() - t0
    return result


def summary(result: dict[str, Any]) -> tuple[float, float, float]:
    """Mean epoch seconds and data-wait fraction over the epochs after the first (all when only one),
    and the workers' CPU seconds per epoch over all epochs (workers render ahead across epoch ends)."""
    eps = result["epochs"][1:] or result["epochs"]
    epoch_s = statistics.mean(e["epoch_s"] for e in eps)
    wait = sum(e["wait_s"] for e in eps) / sum(e["epoch_s"] for e in eps)
    return epoch_s, wait, statistics.mean(e["workers_cpu_s"] for e in result["epochs"])


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--child"]:  # --child KIND --out FILE SCRIPT [official flags]: one official process
        child(argv[1], argv[3], argv[4], argv[5:])
        return 0
    args = parse_args(argv)
    if not (args.yolov9 / "train_dual.py").is_file():
        raise SystemExit(f"no official YOLOv9 checkout at {args.yolov9} (--yolov9)")
    sys.path.insert(0, str(REPO / "tests"))
    from official_helpers import coco_subset, copy_upstream

    work = Path(tempfile.mkdtemp(prefix="fastload-official-bench-"))
    checkout = copy_upstream(work / "yolov9", src=args.yolov9)
    data = coco_subset(args.coco, work / "data", args.images)
    os.environ.setdefault("FASTLOAD_SHM_DIR", str(work / "shm"))  # --cache ram segments live and die with the run
    (work / "shm").mkdir(exist_ok=True)
    print(f"official train_dual.py, {args.images} coco128 images, --img {args.img} --batch {args.batch} --workers "
          f"{args.workers} --epochs {args.epochs}{' --cache ' + args.cache if args.cache else ''}, {args.cfg}, "
          f"CPU, OMP_NUM_THREADS={args.threads}; work folder {work}")
    try:
        compare(args, checkout, data, work)
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    return 0


def compare(args: argparse.Namespace, checkout: Path, data: Path, work: Path) -> None:
    results: dict[str, list[dict[str, Any]]] = {k: [] for k in LOADERS}
    for k in range(args.rounds):
        for kind in LOADERS:
            r = one_run(kind, checkout, data, work, args, k)
            results[kind].append(r)
            per_epoch = "  ".join(f"{e['epoch_s']:.1f}s (wait {e['wait_s'] / e['epoch_s']:.1%}, workers "
                                  f"{e['workers_cpu_s']:.1f} CPU s)" for e in r["epochs"])
            print(f"  round {k + 1} {kind:8s} epochs: {per_epoch}   process {r['wall_s']:.0f}s", flush=True)
    print(f"\n{'loader':10s} {'epoch s':>9s} {'data wait':>10s} {'workers CPU s':>14s} {'process s':>10s}"
          f"   (epochs after the first; workers CPU: all epochs; mean over rounds)")
    rows = {}
    for kind in LOADERS:
        sums = [summary(r) for r in results[kind]]
        epoch_s = statistics.mean(s[0] for s in sums)
        wait = statistics.mean(s[1] for s in sums)
        cpu = statistics.mean(s[2] for s in sums)
        proc_s = statistics.mean(r["wall_s"] for r in results[kind])
        rows[kind] = (epoch_s, wait, proc_s)
        print(f"{kind:10s} {epoch_s:9.2f} {wait:10.1%} {cpu:14.1f} {proc_s:10.0f}")
    ratio = rows["fastload"][0] / rows["stock"][0]
    print(f"\nfastload / stock epoch time: {ratio:.2f}x   data wait: stock {rows['stock'][1]:.1%}, fastload "
          f"{rows['fastload'][1]:.1%}")


if __name__ == "__main__":
    raise SystemExit(main())
