"""DDP sharding with two real gloo processes: each rank sees a disjoint, equally sized part that
together covers the dataset, every epoch, and set_epoch reshuffles identically on both ranks."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch.distributed as dist
import torch.multiprocessing as tmp

WORLD = 2


def _rank_main(rank: int, yaml_path: str, out_dir: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{out_dir}/rendezvous", rank=rank, world_size=WORLD)
    try:
        from fastload.fastloader import loader

        result = {"len": None, "epochs": []}
        with loader(yaml_path, imgsz=64, batch_size=4, workers=1, rank=rank, store="files") as fl:
            assert fl.world_size == WORLD  # taken from torch.distributed
            result["len"] = len(fl)
            for epoch in range(2):
                fl.sampler.set_epoch(epoch)  # what YOLOv9 train_dual.py calls
                result["epochs"].append([p for _, _, paths, _ in fl for p in paths])
            result["n"] = fl.dataset.n
            result["files"] = fl.dataset.im_files
        dist.barrier()
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(120)
def test_two_gloo_ranks_get_disjoint_equal_covering_shards(synth_yaml, tmp_path):
    # the ranks are forked from this process, which has imported torch already: two spawned interpreters each
    # imported torch again (seconds of CPU apiece). Fork is safe here: this module starts no Ray (its gRPC threads
    # are what make a fork hang, see conftest.py), and the loader's own CPU workers are forked the same way.
    tmp.start_processes(_rank_main, args=(str(synth_yaml), str(tmp_path)), nprocs=WORLD, join=True,
                        start_method="fork")
    r = [json.loads((tmp_path / f"rank{k}.json").read_text()) for k in range(WORLD)]
    n, files = r[0]["n"], r[0]["files"]
    assert r[0]["len"] == r[1]["len"]
    for epoch in range(2):
        a, b = r[0]["epochs"][epoch], r[1]["epochs"][epoch]
        assert len(a) == len(b) == -(-n // WORLD)
        assert set(a) | set(b) == set(files)  # covering
        overlap = len(a) + len(b) - len(set(a) | set(b))
        assert overlap == len(a) * WORLD - n  # only the DistributedSampler wrap-around padding
    assert r[0]["epochs"][0] != r[0]["epochs"][1]  # set_epoch reshuffles
