"""Train a variant of the speedrun network through the ordinary `train` command (README, "Speedrun":
the probe table of 2026-12-03).

The variant replaces the model's shape constants in this process only; everything else (flags,
run directory, summary.json) is the train command's own. Usage:

    python benchmarks/speedrun_probe.py [--widths 32,64,128,128] [--pools 0101] [--hidden 512]
        [--gelu] -- train --model speedrun --run-dir runs/probe ...

--pools holds one digit per convolution: 1 max-pools (2x2) after it. The last map is flattened.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys

import jax

from fashionjax import cli, models


def reshape_speedrun(widths: tuple[int, ...], pools: tuple[bool, ...], hidden: int) -> None:
    """Point the speedrun model's constants at another shape (convolutions at 14x14 after the stem)."""
    sides, side = [], 14
    for pool in pools:
        sides.append(side)
        side = (side + 1) // 2 if pool else side
    models.SPEEDRUN_WIDTHS, models.SPEEDRUN_POOLS, models.SPEEDRUN_SIDES = widths, pools, tuple(sides)
    models.SPEEDRUN_FAN_INS = tuple(9 * c for c in (4, *widths[:-1]))
    models.SPEEDRUN_FLAT = side * side * widths[-1]
    models.SPEEDRUN_HIDDEN = hidden
    models.REGISTRY["speedrun"] = dataclasses.replace(
        models.REGISTRY["speedrun"], train_flops_per_example=models._train_flops(models._speedrun_macs()))


def main() -> int:
    argv = sys.argv[1:]
    split = argv.index("--") if "--" in argv else len(argv)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--widths", default=",".join(map(str, models.SPEEDRUN_WIDTHS)))
    parser.add_argument("--pools", default="".join("1" if p else "0" for p in models.SPEEDRUN_POOLS))
    parser.add_argument("--hidden", type=int, default=models.SPEEDRUN_HIDDEN)
    parser.add_argument("--gelu", action="store_true", help="GELU instead of ReLU after each batch norm")
    args = parser.parse_args(argv[:split])
    widths = tuple(int(w) for w in args.widths.split(","))
    if len(args.pools) != len(widths) or set(args.pools) - {"0", "1"}:
        parser.error(f"--pools needs one 0 or 1 per width ({len(widths)}), got {args.pools!r}")
    reshape_speedrun(widths, tuple(p == "1" for p in args.pools), args.hidden)
    if args.gelu:
        jax.nn.relu = jax.nn.gelu  # only the speedrun network calls relu; this process only
    print(f"speedrun variant: widths {widths}, pools {args.pools}, hidden {args.hidden}, "
          f"{'GELU' if args.gelu else 'ReLU'}, {models.REGISTRY['speedrun'].train_flops_per_example / 1e6:.1f} "
          "MFLOP of training per example", file=sys.stderr)
    return cli.main(argv[split + 1:])


if __name__ == "__main__":
    sys.exit(main())
