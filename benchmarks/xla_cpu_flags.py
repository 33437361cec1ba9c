"""Does an XLA:CPU flag make bf16 (or f32) matmuls faster on this CPU? (issue 11: AMX)

Each flag set runs in a fresh process (XLA reads XLA_FLAGS once, at start-up) and reports the best
square-matmul GFLOP/s over a few sizes, for float32 and bfloat16, with the CPU model and whether it
has AMX. Usage: python benchmarks/xla_cpu_flags.py [--json]
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

FLAG_SETS = (
    "",
    "--xla_cpu_use_onednn=true",
    "--xla_cpu_experimental_onednn_fusion_type=dot",
    "--xla_cpu_experimental_xnn_fusion_type=dot",
    "--xla_cpu_experimental_ynn_fusion_type=dot",
    "--xla_cpu_use_xnnpack=true",
)

PROBE = """
import json
from fashionjax import bench, environment
print(json.dumps({"float32": bench.measure_cpu_peak("float32") / 1e9,
                  "bfloat16": bench.measure_cpu_peak("bfloat16") / 1e9}))
"""


def measure(flags: str) -> dict:
    env = dict(os.environ, XLA_FLAGS=flags)
    done = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        return {"flags": flags, "error": (done.stderr.strip().splitlines() or ["failed"])[-1]}
    return {"flags": flags, **json.loads(done.stdout.strip().splitlines()[-1])}


def main() -> None:
    from fashionjax import environment

    rows = [measure(flags) for flags in FLAG_SETS]
    document = {"cpu_model": environment.cpu_model(), "cpu_amx": environment.cpu_has_amx(), "gflops": rows}
    if "--json" in sys.argv:
        print(json.dumps(document, indent=2))
        return
    print(f"{document['cpu_model']} (AMX: {'yes' if document['cpu_amx'] else 'no'}); best square matmul, GFLOP/s")
    for row in rows:
        figures = row.get("error") or f"float32 {row['float32']:7.1f}   bfloat16 {row['bfloat16']:7.1f}"
        print(f"  {row['flags'] or '(no flags)':48s} {figures}")


if __name__ == "__main__":
    main()
