"""The measuring harness: eager vs jit-step vs fused, float32 vs bfloat16, a batch sweep, MFU,
the tokens/sec projection, device placement and scaling across devices.

Protocol for every case: compile apart (lower().compile()), one warm-up run, then R timed repeats
between block_until_ready fences; the loss and batch accuracy of the timed run go beside the speed.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from fashionjax import augment, distributed, environment, figures, lanes, models, train
from fashionjax import config as config_lib
from fashionjax import plan as plan_lib
from fashionjax.config import DTYPES, ConfigError, TrainConfig

MODES = ("eager", "jit-step", "fused")
CODELAB_LOG_EVERY = 25  # the codelab reads metrics to the host every 25 steps

# Vendor dense peaks in FLOP/s (no sparsity), by device-kind substring, most specific first.
GPU_PEAKS = (
    ("H100 PCIe", {"float32": 51.2e12, "tf32": 378e12, "bfloat16": 756e12}),
    ("H200", {"float32": 67e12, "tf32": 494.7e12, "bfloat16": 989.4e12}),
    ("H100", {"float32": 67e12, "tf32": 494.7e12, "bfloat16": 989.4e12}),
    ("A100", {"float32": 19.5e12, "tf32": 156e12, "bfloat16": 312e12}),
    ("L4", {"float32": 30.3e12, "tf32": 60e12, "bfloat16": 121e12}),
)


@dataclass(frozen=True)
class BenchConfig:
    model: str = "mlp"
    batch_sizes: tuple[int, ...] = (128, 512, 2048, 8192)
    dtypes: tuple[str, ...] = ("float32", "bfloat16")
    steps: int = 100
    repeats: int = 5
    eager_steps: int = 10
    compare_batch: int = 512  # where eager, jit-step and fused are compared
    members: tuple[int, ...] | None = None  # models at once; None: default_members() of the backend
    modes: tuple[str, ...] = MODES  # eager, op by op, of the speedrun net ran past half a minute on an H200


def default_members(backend: str) -> tuple[int, ...]:
    """Models at once when --members is not given: 1, 2, 4, 8, and on a GPU also 16, 32 and 64."""
    return (1, 2, 4, 8, 16, 32, 64) if backend == "gpu" else (1, 2, 4, 8)


def quick() -> BenchConfig:
    return BenchConfig(batch_sizes=(512, 2048), steps=25, repeats=3, eager_steps=3, members=(1, 2))


def validate(config: BenchConfig, num_examples: int, device_count: int = 1) -> BenchConfig:
    """Return the config unchanged, or raise ConfigError naming the flag and the bad value."""
    if config.model not in models.REGISTRY:
        raise ConfigError(f"unknown model {config.model!r} (choose from {', '.join(models.REGISTRY)})")
    if not config.dtypes or not config.batch_sizes:
        raise ConfigError(f"--{'dtypes' if not config.dtypes else 'batch-sizes'}: the list is empty")
    for flag, values, known in (("--modes", config.modes, MODES), ("--dtypes", config.dtypes, DTYPES)):
        for value in values:
            if value not in known:
                raise ConfigError(f"{flag}: unknown {flag[2:-1]} {value!r} (choose from {', '.join(known)})")
    for size in config.batch_sizes:
        plan_lib.resolve(TrainConfig(batch_size=size), num_examples, device_count)
    if config.members is not None and (not config.members or min(config.members) < 1):
        raise ConfigError("--members: expected model counts of at least 1")
    if config.steps < 1 or config.repeats < 1:
        raise ConfigError("--steps and --repeats must be at least 1")
    return config


def spread(rates: list[float]) -> dict:
    """Median, min, max and every value of repeated measurements."""
    return {"median": statistics.median(rates), "min": min(rates), "max": max(rates), "all": rates}


def mfu(flops_per_example: int, examples_per_sec: float, peak_flops: float | None) -> float | None:
    """Model FLOPs utilisation: achieved training FLOP/s over the peak."""
    if not peak_flops:
        return None
    return flops_per_example * examples_per_sec / peak_flops


# ---------------------------------------------------------------- peaks


def peak_product(x, y):
    """The peak probe's matmul, summed in float32 whatever the dtype: for bfloat16 that is the form
    XLA:CPU runs on the CPU's bfloat16 dot-product instructions (on a CPU with AMX, on its tiles). With
    a bfloat16 result it takes a slower path, which would understate the peak and so flatter
    bfloat16's MFU (docs/speedrun.md: "bfloat16 summed in float32, and MFU over longer benches" on an
    AMD EPYC, "bfloat16 and AMX" on an Intel Xeon)."""
    return jnp.matmul(x, y, preferred_element_type=jnp.float32)


def measure_cpu_peak(dtype: str, sizes=(512, 1024, 2048), repeats: int = 3) -> float:
    """Best matmul FLOP/s (of `peak_product`) over a few square sizes: the 'measured' peak of this machine."""
    best = 0.0
    for n in sizes:
        a = jnp.ones((n, n), dtype=dtype)
        matmul = jax.jit(peak_product).lower(a, a).compile()
        jax.block_until_ready(matmul(a, a))  # warm-up
        reps = max(1, int(2e9 // (2 * n**3)))  # about 2 GFLOP per timing
        for _ in range(repeats):
            tic = time.perf_counter()
            for _ in range(reps):
                out = matmul(a, a)
            jax.block_until_ready(out)
            best = max(best, reps * 2 * n**3 / (time.perf_counter() - tic))
    return best


def peaks(backend: str, device_kind: str, dtypes) -> dict:
    """Peak FLOP/s per dtype with its provenance: 'measured' on CPUs, 'spec' on known GPUs."""
    if backend == "cpu":
        return {"source": "measured (best matmul of 512/1024/2048 squares, summed in float32, before and after "
                          "the cases, this run)",
                "flops_per_sec": {d: measure_cpu_peak(d) for d in dtypes}}
    for needle, table in GPU_PEAKS:
        if needle in device_kind:
            # XLA runs float32 matmuls on NVIDIA tensor cores as TF32 at the default precision.
            tf32 = jax.config.jax_default_matmul_precision in (None, "default", "bfloat16", "tensorfloat32")
            return {"source": f"spec ({needle} vendor dense peak)",
                    "float32_matmul": "tf32" if tf32 else "float32",
                    "flops_per_sec": {"float32": table["tf32" if tf32 else "float32"],
                                      "bfloat16": table["bfloat16"]}}
    return {"source": "unknown device: no MFU", "flops_per_sec": {}}


# ---------------------------------------------------------------- modes


@dataclass
class Workload:
    """One model/optimizer/dtype/batch on data already on the device."""

    config: TrainConfig
    images_u8: jax.Array  # (N, 784) uint8, replicated
    labels: jax.Array  # (N,) int32
    mesh: object

    def fresh(self):
        # config.seeds > 1: that many models, stacked
        state = train.initial_state(self.config, 10**6, num_examples=int(self.images_u8.shape[0]))
        return distributed.replicate_tree(state, self.mesh), train.config_train_step(self.config, 10**6)

    def plan(self, log_every: int) -> plan_lib.Plan:
        config = dataclasses.replace(self.config, log_every=log_every, steps=10**6, epochs=None)
        return plan_lib.resolve(config, int(self.images_u8.shape[0]), int(self.mesh.devices.size))


def _timed(run: Callable[[], dict], repeats: int, examples_per_run: int) -> tuple[list[float], dict]:
    """Warm up once, then time `repeats` runs; `run` returns the host metrics of a run it has fenced."""
    run()  # warm-up
    rates, metrics = [], None
    for _ in range(repeats):
        tic = time.perf_counter()
        metrics = run()
        rates.append(examples_per_run / (time.perf_counter() - tic))
    return rates, metrics


class Runner(NamedTuple):
    """A benchmark loop, compiled and ready: run() trains `steps` steps and returns their host metrics."""
    compile_seconds: float
    run: Callable[[], dict]
    steps: int  # per run
    chunk_steps: int  # steps per compiled call: 1 for the per-step loops


def fused_runner(work: Workload, steps: int) -> Runner:
    """The trainer's scanned chunks, as long as the model's recipe makes them (--log-every)."""
    state, step_fn = work.fresh()
    plan = work.plan(min(work.config.log_every, steps))
    chunk_steps, count = plan.log_every, plan.perms_per_chunk
    keys = train.chunk_keys(plan, work.mesh)
    epoch, perms = train.place_orders(keys["data"], 0, count, plan.num_examples, work.mesh)
    augment_fn = augment.make_augment(work.config)
    tic = time.perf_counter()
    compiled = train.compile_chunk(step_fn, chunk_steps, plan, work.mesh,
                                   (state, perms, epoch, work.images_u8, work.labels, keys), augment_fn)
    compile_seconds = time.perf_counter() - tic
    holder = {"state": state, "step": 0}  # the host's copy of the step: no device read needed

    def run():
        metrics = None
        for _ in range(steps // chunk_steps):
            state = holder["state"]
            if holder["step"] + chunk_steps > count * plan.steps_per_epoch:  # rewind within the orders made
                zero = np.zeros(np.shape(state.step), np.int32)
                state = state._replace(step=distributed.put_replicated(zero, work.mesh))
                holder["step"] = 0
            holder["state"], metrics = compiled(state, perms, epoch, work.images_u8, work.labels, keys)
            holder["step"] += chunk_steps
        jax.block_until_ready((holder["state"], metrics))
        return distributed.fetch(metrics)

    return Runner(compile_seconds, run, (steps // chunk_steps) * chunk_steps, chunk_steps)


def per_step_runner(work: Workload, steps: int, jit: bool) -> Runner:
    """The codelab's loop: one step per Python iteration, a host read every 25 steps."""
    state, step_fn = work.fresh()
    plan = work.plan(CODELAB_LOG_EVERY)
    batch, num_batches = plan.batch_size, plan.steps_per_epoch
    images = work.images_u8[: num_batches * batch].reshape(num_batches, batch, -1)  # (nb, B, 784)
    labels = work.labels[: num_batches * batch].reshape(num_batches, batch)
    compile_seconds = 0.0
    if jit:
        tic = time.perf_counter()
        step_fn = train.compile_training(jax.jit(step_fn, donate_argnums=0).lower(state, images[0], labels[0]))
        compile_seconds = time.perf_counter() - tic
    holder = {"state": state, "i": 0}

    def run():
        metrics = None
        for k in range(steps):
            i = holder["i"] % num_batches
            holder["i"] += 1
            if jit:
                holder["state"], metrics = step_fn(holder["state"], images[i], labels[i])
            else:
                with jax.disable_jit():
                    holder["state"], metrics = step_fn(holder["state"], images[i], labels[i])
            if k % CODELAB_LOG_EVERY == 0:
                float(metrics["loss"])  # the codelab's deliberate host read at its log points
        jax.block_until_ready((holder["state"], metrics))
        return {key: np.asarray(value)[None] for key, value in distributed.fetch(metrics).items()}

    return Runner(compile_seconds, run, steps, 1)


def measure(work: Workload, mode: str, steps: int, repeats: int) -> dict:
    """One benchmark case: compile apart, warm up, R timed repeats, with quality beside speed."""
    runner = fused_runner(work, steps) if mode == "fused" else per_step_runner(work, steps, jit=(mode == "jit-step"))
    members = config_lib.member_count(work.config)
    rates, metrics = _timed(runner.run, repeats, runner.steps * work.config.batch_size * members)  # model-examples
    last_losses = np.asarray(metrics["loss"]).reshape(members, -1)[:, -1]
    return {
        "mode": mode, "dtype": work.config.dtype, "batch_size": work.config.batch_size,
        "steps": runner.steps, "chunk_steps": runner.chunk_steps, "repeats": repeats,
        "compile_seconds": runner.compile_seconds,
        "examples_per_sec": spread(rates),
        "final_loss": float(last_losses.mean()),
        "final_accuracy": float(metrics["accuracy"].mean()),
        "devices": int(work.mesh.devices.size),
    }


def placement(work: Workload) -> list[dict]:
    """Where the codelab's last table looks: params, optimizer state and batches."""
    state, _ = work.fresh()

    def where(tree):
        found = set()
        for leaf in jax.tree_util.tree_leaves(tree):
            if isinstance(leaf, jax.Array):
                found.update(str(d) for d in leaf.devices())
        return sorted(found)

    return [{"object": "parameters", "devices": where(state.params)},
            {"object": "optimizer state", "devices": where(state.opt_state)},
            {"object": "training images (uint8)", "devices": where(work.images_u8)},
            {"object": "training labels", "devices": where(work.labels)}]


def run(config: BenchConfig, train_images_u8: np.ndarray, train_labels: np.ndarray, mesh=None,
        log: Callable[[str], None] = lambda message: None) -> dict:
    """Every case of a benchmark; returns the bench.json document (without charts)."""
    mesh = mesh if mesh is not None else distributed.make_mesh("all")
    num_examples = len(train_labels)
    validate(config, num_examples, int(mesh.devices.size))
    model = models.get(config.model)
    env = environment.describe(with_git=True)
    config = dataclasses.replace(config, members=config.members or default_members(env["backend"]))
    # The model's own recipe (optimizer, label smoothing), at a constant rate for an endless run.
    base = dataclasses.replace(config_lib.default(config.model), schedule="constant", epochs=None, steps=config.steps)
    placed = {}  # the training data, once per mesh

    def work(dtype: str, batch: int, on_mesh=mesh) -> Workload:
        if id(on_mesh) not in placed:
            placed[id(on_mesh)] = (
                distributed.put_replicated(train_images_u8.reshape(num_examples, -1), on_mesh),
                distributed.put_replicated(train_labels.astype(np.int32), on_mesh))
        return Workload(dataclasses.replace(base, dtype=dtype, batch_size=batch), *placed[id(on_mesh)], on_mesh)

    # A host's speed drifts within minutes, so a CPU's peak is measured before the cases and again
    # after: MFU is over the higher, so a slow spell while measuring it cannot flatter the cases.
    peak = peaks(env["backend"], env["device_kind"], config.dtypes)
    cases = []
    for dtype in config.dtypes:
        for mode in config.modes:
            batches = config.batch_sizes if mode == "fused" else (config.compare_batch,)
            for batch in batches:
                steps = config.eager_steps if mode == "eager" else config.steps
                log(f"{mode} {dtype} batch {batch}: {steps} steps x {config.repeats}")
                cases.append(measure(work(dtype, batch), mode, steps, config.repeats))
    at_once = models_at_once(config, work, log)

    after = peaks(env["backend"], env["device_kind"], config.dtypes)["flops_per_sec"]
    peak["flops_per_sec"] = {dtype: max(flops, after[dtype]) for dtype, flops in peak["flops_per_sec"].items()}
    flops_per_example = model.run_flops_per_example(base.whiten)
    for case in cases:
        rate = case["examples_per_sec"]["median"]
        case["achieved_flops_per_sec"] = flops_per_example * rate
        case["mfu"] = mfu(flops_per_example, rate, peak["flops_per_sec"].get(case["dtype"]))
        case["tokens_per_sec"] = rate * model.tokens_per_example
        case["examples_per_sec_per_device"] = rate / case["devices"]
    for row in at_once:
        row["mfu"] = mfu(flops_per_example, row["model_examples_per_sec"]["median"], peak["flops_per_sec"].get("float32"))

    return {
        "model": config.model, "config": dataclasses.asdict(config), "environment": env,
        "flops_per_example": flops_per_example,
        "tokens_per_example": model.tokens_per_example, "tokens_assumption": models.TOKENS_ASSUMPTION,
        "peak": peak, "cases": cases, "placement": placement(work(config.dtypes[0], config.compare_batch)),
        "scaling": scaling(config, work, log) if mesh.devices.size > 1 else None,
        "models_at_once": at_once,
        "notes": notes(cases, env),
    }


def scaling(config: BenchConfig, work: Callable, log) -> dict:
    """Fused float32 at the comparison batch: one device against all of them."""
    full = work("float32", config.compare_batch)
    single = work("float32", config.compare_batch, distributed.make_mesh(1))
    log("scaling: 1 device vs all")
    one = measure(single, "fused", config.steps, config.repeats)["examples_per_sec"]["median"]
    many = measure(full, "fused", config.steps, config.repeats)["examples_per_sec"]["median"]
    devices = int(full.mesh.devices.size)
    return {"devices": devices, "examples_per_sec_1": one, "examples_per_sec_n": many,
            "per_device_n": many / devices, "efficiency": many / (devices * one)}


def models_at_once(config: BenchConfig, work: Callable, log) -> list[dict]:
    """Fused float32 at the comparison batch with N models in one program (vmapped on an accelerator,
    in lanes on a CPU: lanes.py), against N separate runs one after another (which together go at one
    run's model-examples/sec). Empty when only one model is asked for: the fused case above already
    measured it, and there is nothing to compare."""
    counts = sorted(set(config.members))
    if counts == [1]:
        return []
    rows = []
    for count in counts:
        log(f"models at once: {count}")
        one = work("float32", config.compare_batch)
        case = measure(Workload(dataclasses.replace(one.config, seeds=count), one.images_u8, one.labels, one.mesh),
                       "fused", config.steps, config.repeats)
        rows.append({"members": count, "lanes": lanes.count(count, one.mesh),
                     "model_examples_per_sec": case["examples_per_sec"],
                     "compile_seconds": case["compile_seconds"], "final_loss": case["final_loss"],
                     "final_accuracy": case["final_accuracy"]})
    separate = next((row["model_examples_per_sec"]["median"] for row in rows if row["members"] == 1), None)
    for row in rows:
        row["separate_model_examples_per_sec"] = separate
        row["speedup_over_separate"] = row["model_examples_per_sec"]["median"] / separate if separate else None
    return rows


def notes(cases: list[dict], env: dict) -> list[str]:
    """Sentences a reader needs beside the numbers."""
    out = ["tokens/sec is a projection, not a measurement: these models read whole images, not tokens; "
           "the figure multiplies examples/sec by " + models.TOKENS_ASSUMPTION + "."]
    rate = {(c["mode"], c["dtype"], c["batch_size"]): c["examples_per_sec"]["median"] for c in cases}
    for (mode, dtype, batch), value in rate.items():
        f32 = rate.get((mode, "float32", batch))
        if dtype == "bfloat16" and f32 and value < f32:
            reason = _slow_bfloat16_reason(env)
            out.append(f"bfloat16 was slower than float32 for {mode} at batch {batch} "
                       f"({figures.rate(value)} vs {figures.rate(f32)} examples/sec): {reason}.")
    return out


def _slow_bfloat16_reason(env: dict) -> str:
    if env["backend"] != "cpu":
        return "a model this small is bound by launch overhead and memory traffic, not matmul speed"
    if env.get("cpu_amx"):  # measured on an AMX Xeon (docs/speedrun.md, "bfloat16 and AMX")
        return ("this CPU has AMX bfloat16 tiles, and XLA:CPU uses them only for products summed in float32 "
                "(the peak probe's form); the model's products return bfloat16, its elementwise work runs "
                "through float32 conversions, and even with every product summed that way the models here "
                "trained slower in bfloat16 than in float32 at batches 16-512")
    return ("XLA:CPU computes bfloat16 elementwise work through float32 conversions, and a matmul with a "
            "bfloat16 result takes a path slower than float32's (only products summed in float32 reach "
            "the CPU's bfloat16 dot products), so bfloat16 costs extra work there")


def case_label(case: dict) -> str:
    return f"{case['mode']} {case['dtype']} b{case['batch_size']}"


def write(document: dict, out_dir) -> dict:
    """bench.json plus its bar charts (PNG) in out_dir; returns the document with chart names."""
    from pathlib import Path

    from fashionjax import artifacts
    from fashionjax.report import plots

    out_dir = Path(out_dir)
    cases = document["cases"]
    groups = {
        "bench_modes.png": ("Examples/sec by mode (batch "
                            f"{document['config']['compare_batch']})",
                            [c for c in cases if c["batch_size"] == document["config"]["compare_batch"]]),
        "bench_batch.png": ("Fused examples/sec by batch size", [c for c in cases if c["mode"] == "fused"]),
    }
    charts = []
    for name, (title, chosen) in groups.items():
        if chosen:
            plots.bars([case_label(c) for c in chosen], [c["examples_per_sec"]["median"] for c in chosen],
                       title, "examples/sec (median)", out_dir / name)
            charts.append(name)
    document = dict(document, charts=charts)
    artifacts.atomic_write_json(out_dir / "bench.json", document)
    return document
