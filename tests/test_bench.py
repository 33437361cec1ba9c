"""The benchmark harness: formulas by hand, the bench.json schema, a tiny run. No timing thresholds."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest

from fashionjax import bench, cli, distributed, lanes
from fashionjax import config as config_lib


def test_spread_and_mfu_by_hand():
    assert bench.spread([3.0, 1.0, 2.0]) == {"median": 2.0, "min": 1.0, "max": 3.0, "all": [3.0, 1.0, 2.0]}
    assert bench.spread([1.0, 2.0, 3.0, 10.0])["median"] == 2.5
    # 1,007,104 FLOPs/example x 100,000 examples/s = 100.7 GFLOP/s; over a 200 GFLOP/s peak: 50.355%.
    assert bench.mfu(1_007_104, 100_000.0, 200e9) == pytest.approx(0.503552)
    assert bench.mfu(1_007_104, 100_000.0, None) is None


@pytest.mark.parametrize("kind,needle,bf16", [
    ("NVIDIA H200", "H200", 989.4e12), ("NVIDIA H100 80GB HBM3", "H100", 989.4e12),
    ("NVIDIA H100 PCIe", "H100 PCIe", 756e12), ("NVIDIA A100-SXM4-80GB", "A100", 312e12), ("NVIDIA L4", "L4", 121e12),
])
def test_gpu_peaks_are_vendor_specs(kind, needle, bf16):
    peak = bench.peaks("gpu", kind, ("float32", "bfloat16"))
    assert peak["source"].startswith("spec") and needle in peak["source"]
    assert peak["flops_per_sec"]["bfloat16"] == bf16
    assert peak["float32_matmul"] == "tf32"  # XLA's default float32 matmul precision on NVIDIA


def test_unknown_gpu_gets_no_mfu():
    assert bench.peaks("gpu", "Mystery Accelerator", ("float32",))["flops_per_sec"] == {}


def test_the_cpu_peak_probe_sums_bfloat16_products_in_float32():
    # 1 + 2^-7 is exact in bfloat16 (8 significant bits); its square 1 + 2^-6 + 2^-14 is not: summed
    # in float32 the 2^-14 survives, a bfloat16 result would round it away.
    x = jnp.full((1, 1), 1 + 2**-7, jnp.bfloat16)
    product = bench.peak_product(x, x)
    assert product.dtype == jnp.float32 and float(product[0, 0]) == 1 + 2**-6 + 2**-14


@pytest.mark.parametrize("env,why", [
    ({"backend": "cpu", "cpu_amx": True}, "uses them only for products summed in float32"),
    ({"backend": "cpu", "cpu_amx": False}, "through float32 conversions"),
    ({"backend": "gpu"}, "launch overhead"),
])
def test_a_slower_bfloat16_gets_the_reason_of_its_machine(env, why):
    cases = [{"mode": "fused", "dtype": dtype, "batch_size": 128, "examples_per_sec": {"median": rate}}
             for dtype, rate in (("float32", 960.0), ("bfloat16", 817.0), ("float32", 1.0))]
    cases[2]["batch_size"] = 512  # a batch with no bfloat16 case says nothing
    slower = [note for note in bench.notes(cases, env) if note.startswith("bfloat16")]
    assert slower == [slower[0]] and "fused at batch 128 (817 vs 960 examples/sec)" in slower[0] and why in slower[0]


def test_models_at_once_compares_with_one_model_and_is_skipped_alone(monkeypatch):
    def fake_measure(work, mode, steps, repeats):  # N models in one program: 900 model-examples/sec per model
        rate = 900.0 * work.config.seeds if work.config.seeds > 1 else 1000.0
        return {"examples_per_sec": {"median": rate}, "compile_seconds": 1.0, "final_loss": 0.5,
                "final_accuracy": 0.8}

    monkeypatch.setattr(bench, "measure", fake_measure)
    mesh = distributed.make_mesh(1)
    work = lambda dtype, batch: bench.Workload(config_lib.default("mlp"), None, None, mesh)  # noqa: E731
    rows = bench.models_at_once(bench.BenchConfig(members=(4, 1)), work, lambda line: None)
    assert [row["members"] for row in rows] == [1, 4]
    on_cpu = jax.default_backend() == "cpu"  # one device: lanes on a CPU, one vmapped program elsewhere
    assert [row["lanes"] for row in rows] == [1, min(4, lanes.cores()) if on_cpu else 1]
    assert [row["speedup_over_separate"] for row in rows] == [1.0, pytest.approx(3.6)]
    assert bench.models_at_once(bench.BenchConfig(members=(1,)), work, lambda line: None) == []
    # without --members a GPU adds 16, 32 and 64; asked for, the counts are exactly those asked for
    assert bench.default_members("gpu") == (1, 2, 4, 8, 16, 32, 64) and bench.default_members("cpu") == (1, 2, 4, 8)


@pytest.mark.slow
def test_bench_cli_tiny_run_writes_the_schema(tmp_path, synthetic_cli, monkeypatch, capsys):
    monkeypatch.setattr(bench, "measure_cpu_peak", lambda dtype: 1e11)  # the probe is timed elsewhere
    out_dir = tmp_path / "bench"
    code = cli.main(["bench", "--batch-sizes", "64,128", "--dtypes", "float32,bfloat16", "--steps", "4",
                     "--repeats", "2", "--members", "1,2", "--out", str(out_dir), "--json"])
    assert code == 0
    document = json.loads(capsys.readouterr().out)
    assert document == json.loads((out_dir / "bench.json").read_text())
    assert set(document) >= {"model", "environment", "flops_per_example", "tokens_per_example", "tokens_assumption",
                             "peak", "cases", "placement", "notes", "charts", "scaling"}
    modes = {(c["mode"], c["dtype"], c["batch_size"]) for c in document["cases"]}
    assert modes == {(m, d, b) for d in ("float32", "bfloat16") for m, b in
                     (("eager", 64), ("jit-step", 64), ("fused", 64), ("fused", 128))}
    for case in document["cases"]:
        rate = case["examples_per_sec"]
        assert rate["min"] <= rate["median"] <= rate["max"] and len(rate["all"]) == 2
        assert case["tokens_per_sec"] == pytest.approx(49 * rate["median"])
        assert case["mfu"] == pytest.approx(1_007_104 * rate["median"] / 1e11)
        assert 0.0 <= case["final_accuracy"] <= 1.0 and case["final_loss"] > 0
    assert "projection" in document["notes"][0]
    assert [p["object"] for p in document["placement"]][:2] == ["parameters", "optimizer state"]
    assert all((out_dir / name).stat().st_size > 1000 for name in document["charts"])


def test_bench_runs_only_the_modes_and_member_counts_asked_for(tmp_path, synthetic_cli, monkeypatch, capsys):
    measured = iter([1e11, 3e11])  # the peak before the cases, then after: a host's speed drifts
    monkeypatch.setattr(bench, "measure_cpu_peak", lambda dtype: next(measured))
    code = cli.main(["bench", "--modes", "jit-step,fused", "--batch-sizes", "64", "--dtypes", "float32", "--steps", "2",
                     "--repeats", "1", "--members", "1,2", "--out", str(tmp_path / "bench"), "--json"])
    assert code == 0
    document = json.loads(capsys.readouterr().out)
    assert [case["mode"] for case in document["cases"]] == ["jit-step", "fused"]
    assert document["config"]["modes"] == ["jit-step", "fused"] and document["config"]["members"] == [1, 2]
    assert [row["members"] for row in document["models_at_once"]] == [1, 2]
    assert document["peak"]["flops_per_sec"] == {"float32": 3e11}  # the higher: MFU is never flattered
    for row in document["models_at_once"]:  # the models' FLOPs together, against the same peak
        expected = document["flops_per_example"] * row["model_examples_per_sec"]["median"] / 3e11
        assert row["mfu"] == pytest.approx(expected)
    fused = document["cases"][1]
    assert fused["mfu"] == pytest.approx(fused["achieved_flops_per_sec"] / 3e11)
    assert (document["cases"][0]["chunk_steps"], fused["chunk_steps"]) == (1, 2)  # capped at the bench's steps


@pytest.mark.slow
def test_fused_bench_runs_the_chunks_the_recipe_trains_in(tmp_path, synthetic_cli, monkeypatch, capsys):
    # The speedrun recipe trains in 100-step chunks (the codelab's, and the default, are 25 steps).
    monkeypatch.setattr(bench, "measure_cpu_peak", lambda dtype: 1e11)
    code = cli.main(["bench", "--model", "speedrun", "--modes", "fused", "--batch-sizes", "16", "--dtypes", "float32",
                     "--steps", "150", "--repeats", "1", "--members", "1", "--out", str(tmp_path / "b"), "--json"])
    assert code == 0
    [case] = json.loads(capsys.readouterr().out)["cases"]
    assert (case["chunk_steps"], case["steps"]) == (config_lib.default("speedrun").log_every, 100) == (100, 100)


def test_bench_bad_flags_exit_2(tmp_path, capsys):
    assert cli.main(["bench", "--batch-sizes", "64,x", "--out", str(tmp_path / "b")]) == 2
    assert "--batch-sizes" in capsys.readouterr().err
    assert cli.main(["bench", "--modes", "fused,lazy", "--out", str(tmp_path / "m")]) == 2
    assert "--modes: unknown mode 'lazy'" in capsys.readouterr().err and not (tmp_path / "m").exists()
    assert cli.main(["bench", "--dtypes", "float16", "--out", str(tmp_path / "c")]) == 2
    assert not (tmp_path / "c").exists()


def test_gpu_check_script_stops_at_once_without_a_gpu(tmp_path):
    # benchmarks/gpu_check.sh runs where a GPU is lent, for minutes; on a CPU it must stop at its first
    # step with that step's one JSON document on record, not train anything
    script = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_check.sh"
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
    done = subprocess.run(["bash", str(script), str(tmp_path / "out")], env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 1, done.stderr
    name, _, body = (tmp_path / "out" / "results.txt").read_text().partition("\n")
    assert name == "### doctor rc=1"
    assert "no GPU visible" in json.loads(body)["error"]["message"]


@pytest.mark.parametrize("phase", ["grid", "confirm"])
def test_gpu_speedrun_attempt_stops_at_once_without_a_gpu(tmp_path, phase):
    script = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_speedrun.py"
    done = subprocess.run([sys.executable, str(script), str(tmp_path / "out"), "--phase", phase], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 1, done.stderr
    name, _, body = (tmp_path / "out" / "results.txt").read_text().partition("\n")
    assert name.startswith("### doctor rc=1 ")
    assert "no GPU visible" in json.loads(body)["error"]["message"]
    assert not (tmp_path / "out" / "runs").exists()  # nothing trained


def test_gpu_speedrun_picks_the_fastest_recipe_to_reach_the_target():
    spec = importlib.util.spec_from_file_location("gpu_speedrun", Path(__file__).resolve().parents[1] / "benchmarks"
                                                  / "gpu_speedrun.py")
    attempt = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(attempt)

    def doc(accuracy, seconds):
        return {"test_accuracy_mean": accuracy, "reached_fraction": float(accuracy >= 0.94),
                "train_seconds_median": seconds}

    assert attempt.fastest_to_target({"slow": doc(0.945, 2.0), "fast": doc(0.941, 0.7), "short": doc(0.939, 0.5)}) == "fast"
    assert attempt.fastest_to_target({"a": doc(0.935, 1.0), "b": doc(0.938, 2.0)}) == "b"  # none reached: most accurate
    assert attempt.fastest_to_target({}) is None
