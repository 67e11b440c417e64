"""The CPU engine's decoded-image cache is one shared-memory segment per machine.

Two DDP ranks (gloo) x 2 workers on (a subset of) coco128 fill it during the first epoch and decode
nothing after that; the six processes' PSS counts it once; it goes with its last user, and a segment
whose users were killed (SIGKILL) is removed by the next user of any decoded cache or by
``cleanup_stale`` (``fastload unstage --stale``). Each test gets a private shm root.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch.distributed as dist
import yaml
import torch.multiprocessing as tmp

from fastload.engines.shm_cache import PREFIX
from fastload.store import shm

WORLD = 2
N_IMAGES = 48
IMGSZ = 96
BATCH = 8
REPO = Path(__file__).resolve().parents[1]


def _subset_yaml(coco128_yaml: Path, out: Path, n: int) -> Path:
    """A data.yaml whose train split lists the first ``n`` coco128 images."""
    cfg = yaml.safe_load(coco128_yaml.read_text())
    images = sorted((coco128_yaml.parent / cfg["train"]).glob("*.jpg"))[:n]
    (out / "train.txt").write_text("".join(f"{p}\n" for p in images))
    data = {"path": str(out), "train": "train.txt", "val": "train.txt", "nc": cfg["nc"], "names": cfg["names"]}
    (out / "data.yaml").write_text(yaml.safe_dump(data))
    return out / "data.yaml"


def _segment_pss(pids: list[int], segment: str) -> tuple[int, int]:
    """(sum of Pss, sum of Rss) in bytes over ``pids`` of the mappings of files under ``segment``."""
    pss = rss = 0
    for pid in pids:
        cur = None
        with open(f"/proc/{pid}/smaps") as f:
            for line in f:
                head = line.split()
                if head and not head[0].endswith(":"):  # a mapping's header line: its path is the 6th field
                    cur = head[5] if len(head) > 5 else None
                elif cur and cur.startswith(segment):
                    if head[0] == "Pss:":
                        pss += int(head[1]) * 1024
                    elif head[0] == "Rss:":
                        rss += int(head[1]) * 1024
    return pss, rss


def _rank_main(rank: int, yaml_path: str, out_dir: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{out_dir}/rendezvous", rank=rank, world_size=WORLD)
    try:
        from fastload.fastloader import loader

        out = Path(out_dir)
        result: dict = {"decodes": [], "early": []}
        with loader(yaml_path, imgsz=IMGSZ, batch_size=BATCH, workers=2, rank=rank, store="files", seed=1,
                    partners="batch") as fl:
            for epoch in range(3):
                fl.set_epoch(epoch)
                for _ in fl:
                    pass
                stats = fl.stats()  # this rank's totals so far
                result["decodes"].append(stats["decodes"])
                result["early"].append(stats["early_batches_used"])
                dist.barrier()  # every rank finished the epoch before the next one starts
            stats = fl.stats()
            result.update({k: v for k, v in stats.items() if k.startswith("decode_cache")})
            (out / f"pids{rank}.json").write_text(json.dumps([os.getpid()] + stats["worker_pids"]))
            dist.barrier()
            if rank == 0:
                pids = [p for k in range(WORLD) for p in json.loads((out / f"pids{k}.json").read_text())]
                result["pss"], result["rss"] = _segment_pss(pids, stats["decode_cache_segment"])
                result["processes"] = len(pids)
            dist.barrier()
        (out / f"rank{rank}.json").write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(180)
def test_two_ranks_share_one_cache_filled_in_the_first_epoch(coco128_yaml, shm_root, tmp_path):
    yaml_path = _subset_yaml(coco128_yaml, tmp_path, N_IMAGES)
    # the ranks are forked from this process (torch imported already) rather than spawned (each spawned
    # interpreter imported torch again); this module starts no Ray, whose threads can hang a fork (conftest.py)
    tmp.start_processes(_rank_main, args=(str(yaml_path), str(tmp_path)), nprocs=WORLD, join=True,
                        start_method="fork")
    r = [json.loads((tmp_path / f"rank{k}.json").read_text()) for k in range(WORLD)]
    seg = r[0]["decode_cache_segment"]
    assert r[1]["decode_cache_segment"] == seg  # one segment for the machine
    assert r[0]["decode_cache_slots"] == r[0]["decode_cache_images"] == N_IMAGES  # the subset fits
    assert r[0]["decode_cache_filled"] == N_IMAGES
    machine = [sum(x["decodes"][e] for x in r) for e in range(3)]  # cumulative decodes, both ranks
    early = [sum(x["early"][e] for x in r) for e in range(3)]  # batches begun before their epoch (cumulative)
    # With partners="batch" an epoch reads each image in one batch only, so the first epoch decodes
    # each image once on the whole machine; the only other decodes are in the batches a rank's workers
    # begin (next-epoch hint) while the other rank is still in its first epoch: they may decode an
    # image first, or a second time, and count in the second epoch. After that: nothing, anywhere.
    assert N_IMAGES <= machine[1] <= N_IMAGES + BATCH * early[1]
    assert machine[1] - machine[0] <= BATCH * (early[1] - early[0])
    assert machine[2] == machine[1]
    # PSS: the 2 x (main + 2 workers) processes count the filled pixels once (page rounding aside),
    # although the workers' resident pages add up to more than one copy
    filled = r[0]["decode_cache_bytes"]
    assert r[0]["processes"] == WORLD * 3
    assert 0.9 * filled <= r[0]["pss"] <= filled + 64 * 4096, (r[0]["pss"], filled)
    assert r[0]["rss"] > 1.5 * r[0]["pss"]
    assert not any(shm_root.glob(PREFIX + "*"))  # the last user out removed it


USER = textwrap.dedent("""
    import sys, time
    from fastload.data.config import load_data_config
    from fastload.engines.shm_cache import SharedDecodeCache
    from fastload.store.files import FileStore
    store = FileStore.from_config(load_data_config(sys.argv[1]))
    cache = SharedDecodeCache.open(store, 64, "test", 1 << 30)
    cache.get(0, lambda i: store.load(i, 64))
    print(cache.segment, flush=True)
    time.sleep(600)
""")
# A user of the machine's cache as the CPU engine is one (the engine opens it the same way), without
# torch: these processes start in a fraction of a second.


def _start_users(*yamls: Path) -> list[tuple[subprocess.Popen, str]]:
    """One user process per yaml (started together), each holding its decoded cache; with their segments."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    procs = [subprocess.Popen([sys.executable, "-c", USER, str(y)], stdout=subprocess.PIPE, text=True, env=env)
             for y in yamls]
    out = []
    for proc in procs:
        line = proc.stdout.readline().strip()  # type: ignore[union-attr]
        assert line, f"a user process exited with {proc.wait()}"
        out.append((proc, line))
    return out


def _kill(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGKILL)  # no clean-up runs: the holders file still names it
    proc.wait()


@pytest.mark.timeout(120)
def test_killed_users_segment_is_removed_by_cleanup_or_the_next_user(synth_yaml, shm_root, tmp_path):
    from fastload.data.synthetic import make_synthetic_dataset
    from fastload.fastloader import loader

    sets = [make_synthetic_dataset(tmp_path / name, n_train=6, n_val=1, nc=2, seed=k, max_size=120)
            for k, name in enumerate(("other", "third"))]
    (a, seg_a), (b, seg_b), (c, seg_c) = _start_users(synth_yaml, synth_yaml, sets[0])
    assert sorted(os.listdir(seg_a)) == ["cache.bin", "meta.json", "reserved"]
    assert seg_a == seg_b != seg_c and Path(seg_a).is_dir() and Path(seg_c).is_dir()  # one segment per dataset
    _kill(a)
    _kill(b)
    stale = [s for s in shm.list_segments(prefix=PREFIX) if s.stale]
    assert [str(s.path) for s in stale] == [seg_a] and len(stale[0].dead) == 2
    # `fastload unstage --stale` (shm.cleanup_stale) removes it; the live user's segment stays
    assert [str(s.path) for s in shm.cleanup_stale(prefix=PREFIX)] == [seg_a]
    assert not Path(seg_a).exists() and Path(seg_c).is_dir()
    # the next user of any decoded cache (here of a third dataset) removes a killed user's segment
    _kill(c)
    with loader(sets[1], imgsz=64, batch_size=4, workers=0, store="files") as fl:
        next(iter(fl))
        own = fl.stats()["decode_cache_segment"]
        assert not Path(seg_c).exists() and Path(own).is_dir()
    assert not any(shm_root.iterdir())  # and its own went with it


def test_budget_and_a_small_shm_filesystem(synth_yaml, shm_root, monkeypatch):
    """The budget bounds the images with a place (the first ones of the store); a filesystem with less
    room gets a smaller cache and a warning, one without room for an image none (and a warning)."""
    from fastload.data.config import load_data_config
    from fastload.engines import shm_cache
    from fastload.engines.shm_cache import SharedDecodeCache
    from fastload.store.files import FileStore

    store = FileStore.from_config(load_data_config(synth_yaml))
    one = 64 * 64 * 3  # an upper bound of one loaded image at imgsz 64
    c = SharedDecodeCache.open(store, 64, "test", 3 * one)
    try:
        st = c.stats()
        assert 3 <= st["decode_cache_slots"] < st["decode_cache_images"] == len(store) and "first images" in st["decode_cache_policy"]
        c.get(len(store) - 1, lambda i: store.load(i, 64))  # no place: decoded, not kept
        assert len(c) == 0
    finally:
        c.close()
    monkeypatch.setattr(shm_cache, "free_bytes", lambda _p: int((4096 + 2 * one) / 0.9))
    with pytest.warns(UserWarning, match="holds only part of the dataset"):
        c = SharedDecodeCache.open(store, 64, "test-small", 1 << 30)
    try:
        assert 2 <= c.slots < len(store)
    finally:
        c.close()
    monkeypatch.setattr(shm_cache, "free_bytes", lambda _p: 4096)
    with pytest.warns(UserWarning, match="too little for a decoded-image cache"):
        assert SharedDecodeCache.open(store, 64, "test-none", 1 << 30) is None
    assert not any(shm_root.iterdir())
