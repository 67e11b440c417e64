"""One of the two gloo ranks of test_engine_ray.py's DDP test, each on the test's Ray instance:
``python gloo_rank.py RANK DATA_YAML OUT_DIR RAY_ADDRESS IMGSZ BATCH`` loads one epoch with engine="ray" and writes
``OUT_DIR/rank{RANK}.json``: the epoch's paths and checksums (:func:`epoch_checksums`) and the rank's actor count.
The test forks both from the pre-loaded interpreter (tests/preloaded.py), which has imported torch already."""
from __future__ import annotations

import json
import sys
import zlib
from pathlib import Path


def epoch_checksums(fl) -> dict:
    """One epoch of a loader as its paths and a checksum of every batch's pixels and targets."""
    batches = [(imgs.numpy().tobytes(), targets.numpy().tobytes(), list(paths)) for imgs, targets, paths, _ in fl]
    return {"paths": [p for b in batches for p in b[2]], "crc": [[zlib.crc32(b[0]), zlib.crc32(b[1])] for b in batches]}


def main(rank: int, yaml_path: str, out_dir: str, address: str, imgsz: int, batch: int) -> None:
    import ray
    import torch.distributed as dist

    import fastload

    dist.init_process_group("gloo", init_method=f"file://{out_dir}/rendezvous", rank=rank, world_size=2)
    try:
        ray.init(address=address, log_to_driver=False)  # the test's instance, shared by both ranks
        with fastload.loader(yaml_path, imgsz=imgsz, batch_size=batch, store="disk", engine="ray", seed=4,
                             rank=rank) as fl:
            assert fl.world_size == 2  # from torch.distributed
            result = {"ray": epoch_checksums(fl), "actors": fl.stats()["actors"]}
        dist.barrier()
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[5]), int(sys.argv[6]))
