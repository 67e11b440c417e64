"""The project trainer against the official YOLOv9 one, head to head: same data, hyp, sizes, epochs and seeds.

For each model and seed it trains once with the official script (a temporary copy of ``../shared/upstream/yolov9``:
``train.py`` for GELAN models, ``train_dual.py`` for YOLOv9 ones) and once with ``python -m yolov9.train``, then
evaluates the final EMA weights of both runs with both evaluators (the official ``val.py`` / ``val_dual.py`` and
``python -m yolov9.val``; an official checkpoint is opened and converted only inside a process running the
official code). Prints per-seed and mean +- sd mAP@.5 and mAP@.5:.95, train losses at matching epochs and wall
times; writes everything to a JSON file.

The official ``--seed`` changes only the weights initialisation (its data order and augmentation are seeded by
constants), so the project runs get the same ``--seed`` and a fixed ``--data-seed``: both spreads are then
spreads over initialisations alone.

    python benchmarks/trainer_parity.py                                  # synthetic set, 5 seeds, both models
    python benchmarks/trainer_parity.py --data coco128 --seeds 0 --imgsz 320
    python benchmarks/trainer_parity.py --epochs 3 --seeds 0 --models gelan-t   # a quick smoke run

Completed runs are kept in ``--out`` and reused when the benchmark is started again with the same settings;
``--rescore`` scores the finished runs there again with both evaluators (after a change to either) and trains
nothing.
"""
from __future__ import annotations

import argparse
import csv
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

sys.path.insert(0, str(REPO / "tests"))  # tests/official_helpers.py and tests/reference/, as the tests import them

import torch  # noqa: E402
import yaml  # noqa: E402

from fastload.data.config import load_data_config  # noqa: E402
from fastload.data.synthetic import make_synthetic_dataset  # noqa: E402
from reference.official import Official, available  # noqa: E402
from yolov9.models import DetectionModel, load_cfg  # noqa: E402

COCO128 = Path(os.environ.get("FASTLOAD_COCO128", REPO.parent / "shared" / "datasets" / "coco128"))
LOSS_COLUMNS = ("train/box_loss", "train/cls_loss", "train/dfl_loss")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="gelan-t,yolov9-t", help="comma-separated bundled config names")
    p.add_argument("--seeds", default="0,1,2,3,4", help="comma-separated --seed values")
    p.add_argument("--data", default="synth", help="'synth' (fastload synth set), 'coco128', or a data.yaml")
    p.add_argument("--n-train", type=int, default=256, help="synthetic train images")
    p.add_argument("--n-val", type=int, default=64, help="synthetic val images")
    p.add_argument("--nc", type=int, default=3, help="synthetic classes")
    p.add_argument("--epochs", type=int, default=30)
    p.add_argument("--close-mosaic", type=int, default=5)
    p.add_argument("--imgsz", type=int, default=160)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--data-seed", type=int, default=0, help="the project runs' --data-seed")
    p.add_argument("--threads", type=int, default=1, help="torch/OMP threads of every process")
    p.add_argument("--jobs", type=int, default=1, help="training runs at a time")
    p.add_argument("--out", default=None, help="work folder (default: a temporary one)")
    p.add_argument("--json", default=None, help="result file (default: OUT/trainer_parity.json)")
    p.add_argument("--rescore", action="store_true",
                   help="train nothing: score the finished model/seed pairs in --out again with both evaluators")
    return p.parse_args(argv)


# ---------------------------------------------------------------------------------------------------- data
def prepare_data(args: argparse.Namespace, work: Path) -> tuple[Path, Path]:
    """The dataset in ``work/data``; returns (yaml for the project, yaml with an absolute path for the official)."""
    data_dir = work / "data"
    if args.data == "synth":
        if not (data_dir / "data.yaml").is_file():
            make_synthetic_dataset(data_dir, n_train=args.n_train, n_val=args.n_val, nc=args.nc, seed=0)
        src = data_dir / "data.yaml"
    else:
        yaml_in = COCO128 / "coco128.yaml" if args.data == "coco128" else Path(args.data)
        if not (data_dir / yaml_in.name).is_file():
            shutil.copytree(yaml_in.parent, data_dir, dirs_exist_ok=True)  # the official loader writes caches
        src = data_dir / yaml_in.name
    cfg = yaml.safe_load(src.read_text())
    cfg["path"] = str((src.parent / cfg.get("path", ".")).resolve())
    official_yaml = work / "data_official.yaml"
    official_yaml.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return src, official_yaml


# ---------------------------------------------------------------------------------------------------- runs
def _project_env(threads: int) -> dict[str, str]:
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads),
               PYTHONUNBUFFERED="1")
    return env


def train_official(off: Official, args: argparse.Namespace, model: str, seed: int, data: Path, runs: Path) -> Path:
    name = f"official-{model}-s{seed}"
    script = "train_dual.py" if model.startswith("yolov9") else "train.py"
    off.run(script, "--weights", "", "--cfg", f"models/detect/{model}.yaml", "--data", str(data),
            "--hyp", "data/hyps/hyp.scratch-high.yaml", "--epochs", str(args.epochs), "--batch-size", str(args.batch),
            "--img", str(args.imgsz), "--device", "cpu", "--workers", str(args.workers),
            "--close-mosaic", str(args.close_mosaic), "--seed", str(seed), "--project", str(runs), "--name", name,
            "--exist-ok", "--noplots", log=runs / f"{name}.log")
    return runs / name


def project_cfg(model: str, data: Path, work: Path) -> str:
    """The bundled config, or a copy with ``cls_width`` where the official code's head is wider: its class
    tower is ``max(ch_P3, min(2 nc, 128))`` wide, the project's default ``max(ch_P3, min(nc, 100))`` (the
    published sizes); they differ for T models with more than 32 classes."""
    nc = load_data_config(data).nc
    head = DetectionModel(model, nc=nc).head
    ch0 = head.cv3[0][0].conv.weight.shape[1]
    official = max(ch0, min(2 * nc, 128))
    if head.cv3[0][0].conv.weight.shape[0] == official:
        return model
    cfg = load_cfg(model)
    cfg["cls_width"] = official
    path = work / f"{model}-cls{official}.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return str(path)


def train_project(off: Official, args: argparse.Namespace, model: str, seed: int, data: Path, runs: Path) -> Path:
    name = f"project-{model}-s{seed}"
    cmd = [sys.executable, "-m", "yolov9.train", "--cfg", project_cfg(model, data, runs.parent), "--data", str(data),
           "--hyp", str(off.root / "data" / "hyps" / "hyp.scratch-high.yaml"), "--epochs", str(args.epochs),
           "--batch", str(args.batch), "--img", str(args.imgsz), "--device", "cpu", "--workers", str(args.workers),
           "--close-mosaic", str(args.close_mosaic), "--seed", str(seed), "--data-seed", str(args.data_seed),
           "--project", str(runs), "--name", name, "--exist-ok"]
    with open(runs / f"{name}.log", "w") as f:
        proc = subprocess.run(cmd, cwd=REPO, env=_project_env(args.threads), stdout=f, stderr=subprocess.STDOUT)
    if proc.returncode:
        raise RuntimeError(f"{' '.join(cmd)} failed; see {runs / f'{name}.log'}")
    return runs / name


def read_results(run_dir: Path) -> list[dict[str, float]]:
    """``results.csv`` rows (both trainers write the same column names, the official one padded with spaces)."""
    with open(run_dir / "results.csv", newline="") as f:
        rows = list(csv.reader(f))
    head = [h.strip() for h in rows[0]]
    out = []
    for row in rows[1:]:
        rec = {}
        for k, v in zip(head, row):
            try:
                rec[k] = float(v)
            except ValueError:
                pass
        out.append(rec)
    return out


# ---------------------------------------------------------------------------------------------------- evaluation
def evaluate_pair(off: Official, args: argparse.Namespace, model: str, official_run: Path, project_run: Path,
                  data: Path, official_data: Path, work: Path) -> dict:
    """Both evaluators on both final EMA weights; returns {weights: {evaluator: metrics}}."""
    ev = work / "eval" / official_run.name.replace("official-", "")
    ev.mkdir(parents=True, exist_ok=True)
    script = "val_dual.py" if model.startswith("yolov9") else "val.py"
    off_ckpt = official_run / "weights" / "last.pt"
    proj_ckpt = project_run / "weights" / "last.pt"
    off_plain, proj_as_official = ev / "official_plain.pt", ev / "project_as_official.pt"
    off.bridge("export", str(off_ckpt), str(off_plain))
    off.bridge("import", str(proj_ckpt), f"models/detect/{model}.yaml", str(proj_as_official))
    val_batch = str(args.batch * 2)  # the batch both trainers validate with (rect batch shapes depend on it)
    out: dict = {"official_weights": {}, "project_weights": {}}
    for key, weights in (("official_weights", off_ckpt), ("project_weights", proj_as_official)):
        res = ev / f"{key}_official_val.pt"
        off.bridge("val", script, str(weights), str(official_data), str(args.imgsz), val_batch, str(args.workers),
                   str(ev / f"{key}_val"), str(res))
        out[key]["official_val"] = torch.load(res, weights_only=True)
    for key, weights in (("official_weights", off_plain), ("project_weights", proj_ckpt)):
        cmd = [sys.executable, "-m", "yolov9.val", "--data", str(data), "--weights", str(weights), "--img",
               str(args.imgsz), "--batch", val_batch, "--device", "cpu", "--workers", str(args.workers)]
        proc = subprocess.run(cmd, cwd=REPO, env=_project_env(args.threads), capture_output=True, text=True)
        if proc.returncode:
            raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stderr[-3000:]}")
        res = json.loads(proc.stdout.strip().splitlines()[-1])
        out[key]["project_val"] = {k: res[k] for k in ("precision", "recall", "mAP50", "mAP50-95")}
    return out


def run_one(off: Official, args: argparse.Namespace, model: str, seed: int, data: Path, official_data: Path,
            work: Path) -> dict:
    """Train both, evaluate both; cached in ``work/records/``."""
    rec_path = work / "records" / f"{model}-s{seed}.json"
    if rec_path.is_file():
        return json.loads(rec_path.read_text())
    runs = work / "runs"
    times, run_dirs = {}, {}
    for trainer, fn, yaml_path in (("official", train_official, official_data), ("project", train_project, data)):
        done = runs / f"{trainer}-{model}-s{seed}" / "wall_s.txt"  # a finished run survives a restart
        if not done.is_file():
            t = time.perf_counter()
            fn(off, args, model, seed, yaml_path, runs)
            done.write_text(f"{time.perf_counter() - t:.1f}\n")
        times[trainer] = float(done.read_text())
        run_dirs[trainer] = done.parent
    official_run, project_run = run_dirs["official"], run_dirs["project"]
    rec = {"model": model, "seed": seed, "wall_s": times,
           "eval": evaluate_pair(off, args, model, official_run, project_run, data, official_data, work),
           "results": {"official": read_results(official_run), "project": read_results(project_run)}}
    rec_path.parent.mkdir(exist_ok=True)
    rec_path.write_text(json.dumps(rec, indent=1))
    print(f"  done {model} seed {seed}: official {times['official']:.0f} s, project {times['project']:.0f} s; "
          f"mAP50-95 (official val) {rec['eval']['official_weights']['official_val']['mAP50-95']:.4f} vs "
          f"{rec['eval']['project_weights']['official_val']['mAP50-95']:.4f}", flush=True)
    return rec


def rescore(off: Official, args: argparse.Namespace, jobs: list[tuple[str, int]], data: Path, official_data: Path,
            work: Path) -> list[dict]:
    """The records of the finished pairs among ``jobs``, their evaluations done again on the same weights."""
    records = []
    for model, seed in jobs:
        rec_path = work / "records" / f"{model}-s{seed}.json"
        if not rec_path.is_file():
            continue
        rec = json.loads(rec_path.read_text())
        runs = work / "runs"
        rec["eval"] = evaluate_pair(off, args, model, runs / f"official-{model}-s{seed}",
                                    runs / f"project-{model}-s{seed}", data, official_data, work)
        rec_path.write_text(json.dumps(rec, indent=1))
        print(f"  rescored {model} seed {seed}", flush=True)
        records.append(rec)
    return records


# ---------------------------------------------------------------------------------------------------- report
def _mean_sd(xs: list[float]) -> tuple[float, float]:
    return statistics.fmean(xs), statistics.stdev(xs) if len(xs) > 1 else 0.0


def loss_epochs(epochs: int, close_mosaic: int) -> list[int]:
    marks = {0, epochs // 3, 2 * epochs // 3, epochs - close_mosaic - 1, epochs - close_mosaic, epochs - 1}
    return sorted(e for e in marks if 0 <= e < epochs)


def summarise(records: list[dict], args: argparse.Namespace) -> dict:
    summary: dict = {}
    for model in dict.fromkeys(r["model"] for r in records):
        rs = sorted((r for r in records if r["model"] == model), key=lambda r: r["seed"])
        s: dict = {"seeds": [r["seed"] for r in rs]}
        for trainer, wkey in (("official", "official_weights"), ("project", "project_weights")):
            for evaluator in ("official_val", "project_val"):
                for metric in ("mAP50", "mAP50-95"):
                    xs = [r["eval"][wkey][evaluator][metric] for r in rs]
                    s[f"{trainer}/{evaluator}/{metric}"] = {"per_seed": xs, "mean_sd": _mean_sd(xs)}
            walls = [r["wall_s"][trainer] for r in rs]
            s[f"{trainer}/wall_s"] = {"per_seed": walls, "mean_sd": _mean_sd(walls)}
        worst = 0.0
        for r in rs:
            for wkey in ("official_weights", "project_weights"):
                for metric in ("precision", "recall", "mAP50", "mAP50-95"):
                    worst = max(worst, abs(r["eval"][wkey]["official_val"][metric] - r["eval"][wkey]["project_val"][metric]))
        s["evaluator_max_abs_diff"] = worst
        off_m, off_sd = s["official/official_val/mAP50-95"]["mean_sd"]
        prj_m, _ = s["project/official_val/mAP50-95"]["mean_sd"]
        s["project_within_one_sd_or_above"] = prj_m >= off_m - off_sd
        epochs = loss_epochs(args.epochs, args.close_mosaic)
        losses = {}
        for trainer in ("official", "project"):
            per_epoch = {}
            for e in epochs:
                vals = [[r["results"][trainer][e][c] for c in LOSS_COLUMNS] for r in rs if len(r["results"][trainer]) > e]
                per_epoch[e] = [statistics.fmean(v[i] for v in vals) for i in range(3)] if vals else None
            losses[trainer] = per_epoch
        s["train_losses_mean"] = losses
        summary[model] = s
    return summary


def print_report(records: list[dict], summary: dict, args: argparse.Namespace) -> None:
    print(f"\ntrainer parity: data {args.data}, {args.epochs} epochs, close-mosaic {args.close_mosaic}, img "
          f"{args.imgsz}, batch {args.batch}, workers {args.workers}, threads {args.threads}, hyp.scratch-high, "
          f"CPU; project --data-seed {args.data_seed}")
    print("final EMA weights (last.pt); O = official trainer, P = project trainer; "
          "evaluators: off = official val*.py, prj = python -m yolov9.val")
    for model, s in summary.items():
        print(f"\n{model}")
        print(f"{'seed':>6} | {'O mAP50':>8} {'O mAP':>7} | {'P mAP50':>8} {'P mAP':>7} | "
              f"{'O prj-off':>9} {'P prj-off':>9} | {'O wall s':>8} {'P wall s':>8}")
        for r in sorted((r for r in records if r["model"] == model), key=lambda r: r["seed"]):
            o, p = r["eval"]["official_weights"], r["eval"]["project_weights"]
            print(f"{r['seed']:>6} | {o['official_val']['mAP50']:8.4f} {o['official_val']['mAP50-95']:7.4f} | "
                  f"{p['official_val']['mAP50']:8.4f} {p['official_val']['mAP50-95']:7.4f} | "
                  f"{o['project_val']['mAP50-95'] - o['official_val']['mAP50-95']:+9.5f} "
                  f"{p['project_val']['mAP50-95'] - p['official_val']['mAP50-95']:+9.5f} | "
                  f"{r['wall_s']['official']:8.0f} {r['wall_s']['project']:8.0f}")

        def ms(key: str, fmt: str = ".4f") -> str:
            m, sd = s[key]["mean_sd"]
            return f"{m:{fmt}}+-{sd:{fmt}}"

        print(f"{'mean':>6} | O mAP50 {ms('official/official_val/mAP50')}  mAP {ms('official/official_val/mAP50-95')}"
              f" | P mAP50 {ms('project/official_val/mAP50')}  mAP {ms('project/official_val/mAP50-95')}")
        print(f"{'':>6} | same, scored by yolov9.val: O mAP {ms('official/project_val/mAP50-95')}  "
              f"P mAP {ms('project/project_val/mAP50-95')}")
        print(f"{'':>6} | wall: O {ms('official/wall_s', '.0f')} s, P {ms('project/wall_s', '.0f')} s "
              f"(P/O {s['project/wall_s']['mean_sd'][0] / s['official/wall_s']['mean_sd'][0]:.2f})")
        print(f"{'':>6} | evaluators' largest |difference| (P, R, mAP50, mAP50-95, both weights): "
              f"{s['evaluator_max_abs_diff']:.5f}")
        verdict = "yes" if s["project_within_one_sd_or_above"] else "NO"
        print(f"{'':>6} | project mean mAP@.5:.95 within one sd of the official mean or above: {verdict}")
        print(f"{'':>6} | mean train losses (box / cls / dfl) at epoch:")
        for e, o in s["train_losses_mean"]["official"].items():
            p = s["train_losses_mean"]["project"][e]
            if o and p:
                print(f"{'':>6} |   {e:>3}: O {o[0]:.4f} / {o[1]:.4f} / {o[2]:.4f}   P {p[0]:.4f} / {p[1]:.4f} / "
                      f"{p[2]:.4f}")


def _per_run(settings: dict) -> dict:
    """The settings that change a training run: models and seeds may grow between calls on one --out."""
    return {k: v for k, v in settings.items() if k not in ("models", "seeds")}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not available():
        print("the official YOLOv9 repository (../shared/upstream/yolov9) is not here; nothing to compare with")
        return 2
    work = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="trainer-parity-"))
    work.mkdir(parents=True, exist_ok=True)
    settings = {k: v for k, v in vars(args).items() if k not in ("out", "json", "jobs", "rescore")}
    stamp = work / "settings.json"
    if stamp.is_file() and _per_run(json.loads(stamp.read_text())) != _per_run(settings):
        raise SystemExit(f"{work} holds runs made with other settings ({stamp}); use another --out")
    stamp.write_text(json.dumps(settings, indent=1))
    off = Official(work / "official" / "yolov9", args.threads) if (work / "official" / "yolov9").is_dir() \
        else Official.create(work / "official", args.threads)
    (work / "runs").mkdir(exist_ok=True)
    data, official_data = prepare_data(args, work)
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    jobs = [(m, s) for s in seeds for m in models]
    t0 = time.perf_counter()
    if args.rescore:
        records = rescore(off, args, jobs, data, official_data, work)
        if not records:
            print(f"no finished model/seed pairs in {work}")
            return 1
    else:
        print(f"{len(jobs)} model/seed pairs in {work} ({args.jobs} at a time)", flush=True)
        with ThreadPoolExecutor(args.jobs) as pool:
            records = list(pool.map(lambda ms: run_one(off, args, ms[0], ms[1], data, official_data, work), jobs))
    summary = summarise(records, args)
    print_report(records, summary, args)
    out = Path(args.json) if args.json else work / "trainer_parity.json"
    out.write_text(json.dumps({"settings": settings, "summary": summary, "records": records,
                               "total_wall_s": time.perf_counter() - t0}, indent=1))
    print(f"\nwrote {out} ({time.perf_counter() - t0:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
