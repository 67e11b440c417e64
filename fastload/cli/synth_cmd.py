"""``fastload synth OUT``: write a synthetic YOLO dataset (shapes with exact boxes, polygons, rotated boxes or
keypoints: ``--task``) and its data.yaml."""
from __future__ import annotations

import argparse
import time

from fastload.cli.errors import UsageError, whole

# fastload.data.synthetic.TASKS (not imported from there: `fastload --help` stays light)
TASKS = ("detect", "segment", "pose", "obb")


def register(sub: "argparse._SubParsersAction", help_text: str) -> argparse.ArgumentParser:
    """Add the ``synth`` parser to the ``fastload`` sub-commands."""
    p = sub.add_parser("synth", help=help_text, description=help_text)
    p.add_argument("out", help="output folder (images/, labels/ and data.yaml are written into it)")
    p.add_argument("--n-train", type=whole(0), default=64, help="train images (default 64)")
    p.add_argument("--n-val", type=whole(0), default=16, help="val images (default 16)")
    p.add_argument("--nc", type=whole(1), default=3, help="number of classes (default 3: square, circle, triangle)")
    p.add_argument("--seed", type=int, default=0, help="random seed; the same seed writes the same bytes")
    p.add_argument("--min-size", type=whole(16), default=96, help="smallest random long side in pixels (default 96)")
    p.add_argument("--max-size", type=whole(16), default=640, help="largest random long side in pixels (default 640)")
    p.add_argument("--max-objects", type=whole(0), default=6, help="objects per image at most (default 6)")
    p.add_argument("--task", choices=TASKS, default="detect",
                   help="label rows to write: detect (boxes, the default), segment (exact polygons), pose (boxes + "
                        "5 keypoints with visibility; kpt_shape and flip_idx in the yaml) or obb (rotated boxes' "
                        "corners)")
    p.add_argument("--plant-faults", action="store_true",
                   help="also add one file of each fault (truncated JPEG, zero-byte file, PNG named .jpg, class 99, "
                        "x=1.7, 4 columns, text) to train, to see what `fastload info`/`convert` report")
    p.set_defaults(func=run)
    return p


def run(args: argparse.Namespace) -> int:
    """Write the dataset and print where its data.yaml is."""
    # imported when the command runs: `fastload --help` stays light
    from fastload.data.synthetic import make_synthetic_dataset, plant_faults

    t0 = time.perf_counter()
    try:
        yaml_path = make_synthetic_dataset(
            args.out,
            n_train=args.n_train,
            n_val=args.n_val,
            nc=args.nc,
            seed=args.seed,
            min_size=args.min_size,
            max_size=args.max_size,
            max_objects=args.max_objects,
            task=args.task,
        )
        planted = plant_faults(args.out) if args.plant_faults else {}
    except ValueError as exc:  # the options' ranges
        raise UsageError(str(exc)) from exc
    dt = time.perf_counter() - t0
    print(f"wrote {args.n_train} train + {args.n_val} val images in {dt:.2f} s: {yaml_path}")
    for fault, path in planted.items():
        print(f"planted {fault}: {path}")
    return 0
