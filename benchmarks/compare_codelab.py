"""fashionjax's fused trainer against the codelab's per-step loop, on this machine, in one process.

    python benchmarks/compare_codelab.py [--steps 200] [--repeats 5]

Both train the same MLP with AdamW at batch 512 in float32 on the real data. The runs alternate
(codelab, fused, codelab, fused, ...) so drift on a shared machine hits both alike; each is warmed
up first, timed between block_until_ready fences, and reported as median, min and max with the
training loss it reached.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from codelab_loop import BATCH_SIZE, CodelabLoop  # noqa: E402

from fashionjax import bench, data, distributed, environment  # noqa: E402
from fashionjax.config import TrainConfig  # noqa: E402


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200, help="timed steps per repeat")
    parser.add_argument("--repeats", type=int, default=5, help="alternating repeats")
    parser.add_argument("--json", action="store_true", help="print the result as JSON")
    args = parser.parse_args(argv)

    dataset = data.load(offline=True)
    mesh = distributed.make_mesh(1)
    images = distributed.put_replicated(dataset.train.images_u8.reshape(60000, -1), mesh)
    labels = distributed.put_replicated(dataset.train.labels, mesh)
    work = bench.Workload(TrainConfig(schedule="constant", batch_size=BATCH_SIZE), images, labels, mesh)
    fused = bench.fused_runner(work, args.steps)
    codelab = CodelabLoop(dataset.train.images_u8, dataset.train.labels)

    fused.run()  # warm-up (the codelab loop warmed up in its constructor, as the codelab does)
    codelab.run(args.steps)
    codelab_rates, fused_rates, fused_loss = [], [], None
    for _ in range(args.repeats):
        codelab_rates.append(codelab.run(args.steps))
        tic = time.perf_counter()
        metrics = fused.run()
        fused_rates.append(fused.steps * BATCH_SIZE / (time.perf_counter() - tic))
        fused_loss = float(metrics["loss"][-1])

    result = {
        "codelab": bench.spread(codelab_rates), "fused": bench.spread(fused_rates),
        "ratio_of_medians": statistics.median(fused_rates) / statistics.median(codelab_rates),
        "codelab_final_loss": codelab.last_loss, "fused_final_loss": fused_loss,
        "steps": args.steps, "repeats": args.repeats, "batch_size": BATCH_SIZE, "dtype": "float32",
        "environment": {k: v for k, v in environment.describe().items() if k != "devices"},
    }
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        env = result["environment"]
        print(f"machine: {env['cpu_model']} ({env['cpu_cores']} cores), {env['backend']}, jax {env['jax_version']}")
        for name in ("codelab", "fused"):
            r = result[name]
            print(f"{name:>8}: {r['median']:>10,.0f} examples/sec median "
                  f"({r['min']:,.0f}-{r['max']:,.0f}), final loss {result[name + '_final_loss']:.4f}")
        print(f"   ratio: {result['ratio_of_medians']:.2f}x (fused / codelab, medians)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
