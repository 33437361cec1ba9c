"""The GPU's time-to-94% attempt (docs/speedrun.md, "On a GPU"), as one prepared run:

    python benchmarks/gpu_speedrun.py OUT_DIR [--seconds 480] [--phase grid|confirm]

fashionjax commands run one after another in this process, so JAX starts once and later compiles
are warm; each command's JSON document is appended to OUT_DIR/results.txt as it finishes, so a run
cut short keeps what it finished. Both phases start with `doctor --require-gpu` (on a CPU the
attempt stops there). The first phase (grid), in order:
  1. a grid of bfloat16 recipes on seed 10, one run each;
  2. the fastest of them to reach 94% (else the most accurate) on seeds 0-4;
  3. `bench --model speedrun` with XLA's convolution and with im2col at each batch size, for the
     crossover behind layers.GPU_CONV_MIN_BATCH and the net's MFU on the GPU;
  4. the float32 GPU recipe of the last measurement on seeds 0-4, for the change since.
The second (confirm) runs that fastest recipe on seeds 5-9, three neighbours of it on seeds 0-4,
and the record's command unchanged. The data comes from FASHIONJAX_DATA_DIR (or the Debian package); nothing is downloaded.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import sys
import time
from pathlib import Path

from fashionjax import cli, layers

GRID = {  # name: speedrun flags, each with --dtype bfloat16
    "b512-e16": "--batch-size 512 --lr 6e-3 --epochs 16",
    "b1024-e16": "--batch-size 1024 --lr 8e-3 --epochs 16",
    "b512-e12": "--batch-size 512 --lr 6e-3 --epochs 12",
    "b1024-e12": "--batch-size 1024 --lr 8e-3 --epochs 12",
    "b512-e12-muon": "--batch-size 512 --lr 6e-3 --epochs 12 --optimizer muon",
    "b1024-e12-muon": "--batch-size 1024 --lr 8e-3 --epochs 12 --optimizer muon",
}
F32_RECIPE = "--batch-size 512 --lr 6e-3 --epochs 16"  # the last measurement's: 94.04% in 2.35 s (median)
GPU_RECIPE = GRID["b1024-e12-muon"]  # the grid's fastest to 94%: 94.03% over seeds 0-4 in a median 0.739 s
NEIGHBOURS = {
    "b1024-e13-muon": "--batch-size 1024 --lr 8e-3 --epochs 13 --optimizer muon",
    "b1024-e12-muon-lr1e-2": "--batch-size 1024 --lr 1e-2 --epochs 12 --optimizer muon",
    "b2048-e14-muon": "--batch-size 2048 --lr 1.2e-2 --epochs 14 --optimizer muon",
}
NEVER = 1 << 30


class Attempt:
    """The commands of one device call: a time budget and the results file they append to."""

    def __init__(self, out: Path, seconds: float):
        self.out, self.ends = out, time.monotonic() + seconds
        out.mkdir(parents=True, exist_ok=True)

    def command(self, name: str, argv: list[str], cost: float) -> dict | None:
        """Run one command (if about `cost` seconds are left) and record its document."""
        if self.ends - time.monotonic() < cost:
            print(f"## {name} skipped: {self.ends - time.monotonic():.0f} s left", file=sys.stderr, flush=True)
            return None
        print(f"## {name} {time.strftime('%H:%M:%S')}: {' '.join(argv)}", file=sys.stderr, flush=True)
        captured, tic = io.StringIO(), time.monotonic()
        with contextlib.redirect_stdout(captured):
            code = cli.main([*argv, "--json"])
        self.record(f"{name} rc={code} wall={time.monotonic() - tic:.1f}", captured.getvalue())
        if code in (130, 143):
            raise KeyboardInterrupt  # the outer time limit: stop here, with everything so far on record
        try:
            return json.loads(captured.getvalue()) if code == 0 else None
        except ValueError:
            return None

    def record(self, title: str, text: str) -> None:
        with open(self.out / "results.txt", "a") as results:
            results.write(f"### {title}\n{text.rstrip()}\n\n")


def fastest_to_target(docs: dict[str, dict]) -> str | None:
    """The grid entry that reached the target in the least training time, else the most accurate."""
    reached = [name for name, doc in docs.items() if doc["reached_fraction"] == 1.0]
    if reached:
        return min(reached, key=lambda name: docs[name]["train_seconds_median"])
    return max(docs, key=lambda name: docs[name]["test_accuracy_mean"], default=None)


# The GPU recipes were measured reading every image in every epoch, with flip TTA alone: pinned, so that
# the CPU recipe's --focus and --tta-shift (its defaults since 2026-12-05) do not change them.
EVERY_IMAGE = ("--focus", "1", "--tta-shift", "0")


def bfloat16_speedrun(flags: str, out: Path, *more: str) -> list[str]:
    """The speedrun command for a recipe's flags, in bfloat16, its seeds' runs under `out`."""
    return ["speedrun", *more, "--dtype", "bfloat16", *EVERY_IMAGE, *flags.split(), "--out", str(out)]


def grid(attempt: Attempt, work: Path) -> None:
    """The first call: recipes on seed 10, the fastest to 94% on seeds 0-4, the convolutions' crossover."""
    docs = {}
    for name, flags in GRID.items():
        doc = attempt.command(f"grid-{name}", bfloat16_speedrun(flags, work / name, "--seed", "10", "--seeds", "1"), 30)
        if doc is not None:
            docs[name] = doc
    best = fastest_to_target(docs)
    if best is not None:
        attempt.command(f"seeds-0-4-{best}", bfloat16_speedrun(GRID[best], work / f"{best}-5"), 60)
        metrics = work / f"{best}-5" / "seed-0" / "metrics.jsonl"  # each chunk's speed: the warm-up's cost
        if metrics.exists():
            attempt.record(f"{metrics.relative_to(attempt.out)}", metrics.read_text())
    shipped = layers.GPU_CONV_MIN_BATCH
    for name, min_batch in (("xla-conv", 0), ("im2col", NEVER)):
        layers.GPU_CONV_MIN_BATCH = min_batch
        attempt.command(f"bench-{name}", ["bench", "--model", "speedrun", "--modes", "fused", "--members", "1",
                                          "--batch-sizes", "16,128,256,512,1024", "--steps", "50", "--repeats",
                                          "3", "--out", str(work / f"bench-{name}")], 60)
    layers.GPU_CONV_MIN_BATCH = shipped
    attempt.command("seeds-0-4-f32", ["speedrun", *EVERY_IMAGE, *F32_RECIPE.split(), "--out", str(work / "f32-5")], 50)


def confirm(attempt: Attempt, work: Path) -> None:
    """The second call: the first call's fastest recipe on seeds 5-9, its neighbours on seeds 0-4,
    and the record's command unchanged (batch 16: im2col on every backend)."""
    attempt.command("seeds-5-9", bfloat16_speedrun(GPU_RECIPE, work / "recipe-5-9", "--seed", "5"), 40)
    for name, flags in NEIGHBOURS.items():
        attempt.command(f"seeds-0-4-{name}", bfloat16_speedrun(flags, work / name), 40)
    attempt.command("record-unchanged", ["speedrun", "--out", str(work / "record")], 90)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--seconds", type=float, default=480.0, help="the whole attempt's budget")
    parser.add_argument("--phase", choices=("grid", "confirm"), default="grid")
    args = parser.parse_args()
    attempt = Attempt(args.out, args.seconds)
    try:
        if attempt.command("doctor", ["doctor", "--require-gpu"], 0) is None:
            return 1
        (grid if args.phase == "grid" else confirm)(attempt, args.out / "runs")
    except KeyboardInterrupt:
        return 124
    return 0


if __name__ == "__main__":
    sys.exit(main())
