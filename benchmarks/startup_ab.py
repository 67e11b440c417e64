"""Start-up of two (or more) trees on one dataset whose index cache is valid: interleaved fresh processes, best of N.

Per tree and round, each in a new process: ``build_index`` (torch imported before the clock), a
``fastload.loader(..., store="files", imgsz=160, batch_size=32, workers=2)`` open and the main process's RSS after
it, and the whole ``fastload info DATA --split train`` command (wall from ``wait4``); with ``--ranks N``, also
``build_index`` in N processes as the ranks of one torchrun launch on a node (``LOCAL_WORLD_SIZE=N``,
``LOCAL_RANK``, a new ``TORCHELASTIC_RUN_ID`` per round), started together once all have imported: the seconds
until the last has its index (their exits not counted). Beside each wall time, its CPU seconds (the process's and
its reaped children's, e.g. the stat workers'; all ranks' summed; ``info``'s whole command): on a shared machine
the CPU seconds say what the wall times cannot.
Every timed step must be a cache hit (when the trees' cache versions differ, the caches must not be each other's:
give one tree's cache its own place, e.g. build it while the labels folder is read-only so it goes to
``$FASTLOAD_CACHE_DIR``).

    python benchmarks/startup_ab.py /tmp/scale/n100000/data.yaml /work/main . --rounds 3 --ranks 4
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

CHILD = r"""
import json, os, resource, sys, time
import psutil
import fastload, fastload.fastloader  # torch imported before the clock starts
from fastload.data.index import build_index
if len(sys.argv) > 3:  # a rank: start when every rank is ready
    print("ready", flush=True)
    while not os.path.exists(sys.argv[3]):
        time.sleep(0.005)
def cpu():  # this process's and its reaped children's (the stat workers') CPU seconds
    return sum(getattr(resource.getrusage(w), k) for w in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)
               for k in ("ru_utime", "ru_stime"))
c0, t0 = cpu(), time.perf_counter()
if sys.argv[2] == "index":
    hit = build_index(sys.argv[1], "train", progress=False).report.cache_hit
else:
    fastload.loader(sys.argv[1], imgsz=160, batch_size=32, workers=2, store="files", seed=0)
    hit = True
print(json.dumps({"hit": hit, "s": time.perf_counter() - t0, "cpu": cpu() - c0,
                  "rss": psutil.Process().memory_info().rss, "end": time.time()}))
"""


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("data", help="the data.yaml (its train split is measured)")
    ap.add_argument("trees", nargs="+", help="fastload checkouts whose code is measured")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--ranks", type=int, default=0, help="also build_index in this many ranks of one launch at once")
    a = ap.parse_args(argv)
    steps = ["index s", "index cpu s", "open s", "open cpu s", "open rss MiB", "info s", "info cpu s"] \
        + ([f"{a.ranks} ranks s", f"{a.ranks} ranks cpu s"] if a.ranks else [])
    rows: dict[str, dict[str, list[float]]] = {t: {k: [] for k in steps} for t in a.trees}
    for r in range(a.rounds):
        for tree in a.trees:
            env = dict(os.environ, PYTHONPATH=os.path.abspath(tree))
            for step in ("index", "open"):
                out = subprocess.run([sys.executable, "-c", CHILD, a.data, step], cwd="/", env=env,
                                     capture_output=True, text=True)
                if out.returncode:
                    sys.exit(f"{tree} {step} failed:\n{out.stderr[-3000:]}")
                res = json.loads(out.stdout.strip().splitlines()[-1])
                if not res["hit"]:
                    sys.exit(f"{tree}: the index cache was not valid (a scan was timed); see the docstring")
                rows[tree][f"{step} s"].append(res["s"])
                rows[tree][f"{step} cpu s"].append(res["cpu"])
                if step == "open":
                    rows[tree]["open rss MiB"].append(res["rss"] / 2**20)
            t0 = time.perf_counter()
            proc = subprocess.Popen([sys.executable, "-m", "fastload", "info", a.data, "--split", "train"], cwd="/",
                                    env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            usage = os.wait4(proc.pid, 0)[2]
            rows[tree]["info s"].append(time.perf_counter() - t0)
            rows[tree]["info cpu s"].append(usage.ru_utime + usage.ru_stime)
            if a.ranks:
                launch = dict(env, LOCAL_WORLD_SIZE=str(a.ranks), TORCHELASTIC_RUN_ID=f"ab-{os.getpid()}-{r}-{tree}")
                go = os.path.join(tempfile.mkdtemp(), "go")
                procs = [subprocess.Popen([sys.executable, "-c", CHILD, a.data, "index", go], cwd="/", text=True,
                                          env=dict(launch, LOCAL_RANK=str(k), RANK=str(k)), stdout=subprocess.PIPE,
                                          stderr=subprocess.PIPE) for k in range(a.ranks)]
                for p in procs:
                    p.stdout.readline()  # "ready" (or nothing: it failed, told below)
                start = time.time()
                open(go, "w").close()
                done = [p.communicate() for p in procs]
                shutil.rmtree(os.path.dirname(go))
                if any(p.returncode for p in procs):
                    sys.exit(f"{tree} ranks failed:\n" + "\n".join(err[-2000:] for _, err in done))
                res = [json.loads(out.strip().splitlines()[-1]) for out, _ in done]
                if not all(r_["hit"] for r_ in res):
                    sys.exit(f"{tree}: a rank found the index cache invalid (a scan was timed)")
                rows[tree][f"{a.ranks} ranks s"].append(max(r_["end"] for r_ in res) - start)  # not their exits
                rows[tree][f"{a.ranks} ranks cpu s"].append(sum(r_["cpu"] for r_ in res))
            print(f"round {r} {tree}: " + ", ".join(f"{k} {v[-1]:.2f}" for k, v in rows[tree].items())
                  + f"; load {os.getloadavg()[0]:.1f}", flush=True)
    print(f"best of {a.rounds}, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")
    for tree, values in rows.items():
        print(tree, {k: round(min(v), 2) for k, v in values.items()})
    return 0


if __name__ == "__main__":
    sys.exit(main())
