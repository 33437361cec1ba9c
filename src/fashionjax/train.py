"""The training core: TrainState, the pure step, the scanned chunk, and fit().

Everything under jit is a pure function of PyTrees. The host loop dispatches one compiled chunk of
`log_every` steps at a time and reads metrics only at chunk ends (the log points).
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from fashionjax import artifacts, distributed, focus, lanes, models
from fashionjax import config as config_lib
from fashionjax import plan as plan_lib
from fashionjax.augment import augment_keys, make_augment
from fashionjax.config import TrainConfig
from fashionjax.plan import Plan, root_keys
from fashionjax.signals import Interrupted


class TrainState(NamedTuple):
    step: jax.Array  # int32 scalar: steps taken so far
    params: Any
    opt_state: Any
    focus: dict | None = None  # --focus: each training image's latest loss and the current pass's order


class Diverged(RuntimeError):
    """The loss or gradient stopped being finite."""

    def __init__(self, step: int):
        super().__init__(f"diverged at step {step}: the loss or gradient norm is not finite")
        self.step = step


def compute_dtype(name: str):
    return {"float32": jnp.float32, "bfloat16": jnp.bfloat16}[name]


def lr_schedule(config: TrainConfig, schedule_steps: int) -> Callable[[int], Any]:
    """The learning rate of each update (counted from 0): what the optimizer uses, for the logs too."""
    if not config.decaying:
        return lambda count: config.lr
    warmup = min(config.warmup_steps, max(schedule_steps - 1, 0))
    if config.schedule == "linear":  # a straight line from the peak to zero at the last update
        return optax.join_schedules([optax.linear_schedule(0.0, config.lr, warmup),
                                     optax.linear_schedule(config.lr, 0.0, max(schedule_steps - warmup, 1))], [warmup])
    return optax.warmup_cosine_decay_schedule(
        0.0, config.lr, warmup_steps=warmup, decay_steps=max(schedule_steps, warmup + 1), end_value=0.0)


def make_optimizer(config: TrainConfig, schedule_steps: int) -> optax.GradientTransformation:
    """The optax chain for a config; the schedule's position lives in the optimizer state.

    A swept config's optimizer takes its hyperparameters (the peak learning rate, the weight decay,
    the momentum) from the optimizer state (optax.inject_hyperparams), so that members with
    different values share one compiled step.
    """
    if config.sweep:
        unit = lr_schedule(dataclasses.replace(config, lr=1.0), schedule_steps)

        def build(lr, weight_decay, momentum):
            return _optimizer(config, lambda count: lr * unit(count), weight_decay, momentum)

        return optax.inject_hyperparams(build)(lr=config.lr, weight_decay=config.weight_decay,
                                               momentum=config.momentum)
    # A constant rate goes to optax as a plain number, not as lr_schedule's constant function: a
    # function would add a step count to the optimizer state, which older checkpoints lack.
    learning_rate = lr_schedule(config, schedule_steps) if config.decaying else config.lr
    return _optimizer(config, learning_rate, config.weight_decay, config.momentum)


def _optimizer(config: TrainConfig, learning_rate, weight_decay, momentum) -> optax.GradientTransformation:
    if config.optimizer == "adamw":
        optimizer = optax.adamw(learning_rate, weight_decay=weight_decay)
    elif config.optimizer == "adam":
        optimizer = optax.adam(learning_rate)
    elif config.optimizer == "muon":
        optimizer = muon(learning_rate, config.muon_scale, weight_decay, momentum)
    else:
        sgd = optax.sgd(learning_rate, momentum=momentum, nesterov=config.nesterov)
        optimizer = optax.chain(optax.add_decayed_weights(weight_decay), sgd)
    if config.clip_norm is not None:
        optimizer = optax.chain(optax.clip_by_global_norm(config.clip_norm), optimizer)
    model = models.get(config.model)
    if model.apply_train is not None:  # running statistics are not trained
        optimizer = optax.masked(optimizer, trained_mask)
    if config.whiten:  # zero the frozen layer's updates: AdamW's weight decay would move it with no gradient
        frozen = frozen_paths(config)
        optimizer = optax.chain(optimizer, optax.masked(optax.set_to_zero(),
                                                        partial(_path_mask, lambda path: path in frozen)))
    if config.ema:
        optimizer = optax.chain(optimizer, params_ema(config.ema))
    return optimizer


# Three Newton-Schulz iterations after AOL's rescaling, not optax's default five after the Frobenius
# norm's: the same accuracy in 4-epoch speedruns, for a quarter less of the time Muon adds to a step
# (docs/speedrun.md, "Muon for the convolutions").
MUON_NS_STEPS, MUON_PRECONDITIONING = 3, "aol"


def muon(learning_rate, scale: float, weight_decay, momentum) -> optax.GradientTransformation:
    """Muon (Jordan et al., 2024; optax.contrib.muon) for each convolution's filters, (3, 3, in, out)
    orthogonalized as a (9 in, out) matrix, at `scale` times the rate; AdamW with Nesterov momentum
    (as optax's muon has it) for every other leaf.

    Muon's updates are rescaled to the root-mean-square of AdamW's (consistent_rms 0.2), so one --lr
    serves both and `scale` is a ratio between like quantities.
    """
    def filters_as_matrices(params):
        return jax.tree.map(lambda leaf: optax.contrib.MuonDimensionNumbers((0, 1, 2), 3) if leaf.ndim == 4 else None,
                            params)

    filter_rate = (lambda count: scale * learning_rate(count)) if callable(learning_rate) else scale * learning_rate
    return optax.contrib.muon(filter_rate, beta=momentum, weight_decay=weight_decay, consistent_rms=0.2,
                              ns_steps=MUON_NS_STEPS, preconditioning=MUON_PRECONDITIONING,
                              adam_learning_rate=learning_rate, adam_weight_decay=weight_decay,
                              muon_weight_dimension_numbers=filters_as_matrices)


def _map_by_path(fn: Callable[[tuple, Any], Any], params: dict) -> dict:
    """Each leaf of params -> fn(its path of dict keys, e.g. ("conv0", "w"), the leaf)."""
    return jax.tree_util.tree_map_with_path(lambda path, leaf: fn(tuple(k.key for k in path), leaf), params)


def _path_mask(selects: Callable[[tuple], bool], params: dict) -> dict:
    """An optax mask: each leaf of params -> selects(its path of dict keys)."""
    return _map_by_path(lambda path, _: selects(path), params)


def trained_mask(params: dict) -> dict:
    """True for every leaf the optimizer updates: all but the running statistics under params["stats"]."""
    return _path_mask(lambda path: path[0] != "stats", params)


class EmaState(NamedTuple):
    ema: Any  # the moving average of the parameters, as they stand after each update


def params_ema(decay: float) -> optax.GradientTransformation:
    """A last link of an optax chain that leaves the updates alone and keeps, in its state, the moving
    average ema' = decay * ema + (1 - decay) * (params + updates), starting from the initial params."""
    def init(params):
        return EmaState(jax.tree.map(jnp.copy, params))  # own buffers: the state is donated to each chunk

    def update(updates, state, params):
        new_params = optax.apply_updates(params, updates)
        return updates, EmaState(jax.tree.map(lambda e, p: decay * e + (1 - decay) * p, state.ema, new_params))

    return optax.GradientTransformation(init, update)


def evaluated_params(config: TrainConfig, state: TrainState):
    """The parameters a run is scored with: its weights' moving average with --ema (the running
    statistics stay the trained model's own, which track the current weights), else its weights."""
    if not config.ema:
        return state.params
    ema = optax.tree.get(state.opt_state, "ema")
    return {**ema, "stats": state.params["stats"]} if "stats" in state.params else ema


def scale_images(images_u8):
    """uint8 pixels to float32 in [0, 1]; runs inside the compiled step."""
    return images_u8.astype(jnp.float32) / 255.0


def cross_entropy(logits, labels, label_smoothing: float = 0.0):
    """Per-example cross-entropy against one-hot targets smoothed toward uniform by label_smoothing."""
    if label_smoothing == 0.0:  # the integer-label form: cheaper, and the digests of earlier runs stay
        return optax.softmax_cross_entropy_with_integer_labels(logits, labels)
    targets = optax.smooth_labels(jax.nn.one_hot(labels, logits.shape[-1]), label_smoothing)
    return optax.softmax_cross_entropy(logits, targets)


def loss_and_accuracy(params, images_u8, labels, model: models.Model, dtype, label_smoothing: float = 0.0):
    """(mean loss, {"accuracy", "stats", "losses"}): stats are a batch-normed model's updated running
    statistics, losses each example's own."""
    images = scale_images(images_u8)
    if model.apply_train is None:
        logits, stats = model.apply(params, images, dtype), None  # (batch, 10) float32
    else:
        logits, stats = model.apply_train(params, images, dtype)
    losses = cross_entropy(logits, labels, label_smoothing)
    accuracy = jnp.mean(jnp.argmax(logits, axis=-1) == labels)
    return losses.mean(), {"accuracy": accuracy, "stats": stats, "losses": losses}


def frozen_paths(config: TrainConfig) -> tuple[tuple[str, ...], ...]:
    """The parameter paths training never changes, besides the running statistics: the whitened layer."""
    return (models.get(config.model).whitened,) if config.whiten else ()


def without_gradient(params: dict, frozen: tuple[tuple[str, ...], ...]) -> dict:
    """params with the leaves at the frozen paths cut off from differentiation: their gradient is zero,
    and XLA drops the backward work that only they needed (for the speedrun model's whitened first
    layer, its whole backward pass: a step took 115 ms instead of 128 at batch 128, Intel Xeon)."""
    return _map_by_path(lambda path, leaf: jax.lax.stop_gradient(leaf) if path in frozen else leaf, params)


def config_train_step(config: TrainConfig, schedule_steps: int) -> Callable:
    """The train step `config` trains with: its model, its optimizer over schedule_steps, its compute
    dtype, label smoothing and frozen layers (what fit, bench and the tests all build)."""
    return make_train_step(models.get(config.model), make_optimizer(config, schedule_steps), compute_dtype(config.dtype),
                           config.label_smoothing, frozen_paths(config))


def make_train_step(model: models.Model, optimizer: optax.GradientTransformation, dtype,
                    label_smoothing: float = 0.0, frozen: tuple[tuple[str, ...], ...] = ()) -> Callable:
    """train_step(state, images_u8, labels, indices=None) -> (state, metrics); pure, metrics stay on the
    device. No gradient is taken for the leaves at the `frozen` paths (their grad_norm share is zero).
    A state with --focus records each example's loss at its index in the training set."""
    def loss_fn(params, images_u8, labels):
        return loss_and_accuracy(without_gradient(params, frozen), images_u8, labels, model, dtype, label_smoothing)

    grad_fn = jax.value_and_grad(loss_fn, has_aux=True)

    def train_step(state: TrainState, images_u8, labels, indices=None):
        (loss, aux), grads = grad_fn(state.params, images_u8, labels)
        updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        if aux["stats"] is not None:
            params = {**params, "stats": aux["stats"]}
        focus_state = state.focus
        if focus_state is not None:
            focus_state = focus.record(focus_state, indices, aux["losses"])
        metrics = {"loss": loss, "accuracy": aux["accuracy"], "grad_norm": optax.tree.norm(grads)}
        return TrainState(state.step + 1, params, opt_state, focus_state), metrics

    return train_step


def init_state(model: models.Model, optimizer, seed: int, whiten=None, focus_examples: int = 0) -> TrainState:
    """The fresh state of a run: parameters from the seed's init stream (then passed through whiten,
    which sets a layer fitted to the data, when given), step 0; with focus_examples, --focus's state
    for a training set of that many images."""
    params = model.init(root_keys(seed)["init"])
    if whiten is not None:
        params = whiten(params)
    focus_state = focus.initial(focus_examples) if focus_examples else None
    return TrainState(jnp.zeros((), jnp.int32), params, optimizer.init(params), focus_state)


def fitted_whitening(config: TrainConfig, train_images_u8) -> Callable[[dict], dict] | None:
    """With --whiten, the first layer fitted to the training images (a function that sets it in the
    parameters); otherwise None."""
    return models.get(config.model).whitening(train_images_u8) if config.whiten else None


def initial_state(config: TrainConfig, schedule_steps: int, train_images_u8=None,
                  whiten: Callable[[dict], dict] | None = None, num_examples: int | None = None) -> TrainState:
    """The fresh state of a run, or of all its members stacked on a leading axis: member i is the
    state of the single run of member_configs(config)[i] (its seed, its swept values).

    With --whiten the training images fit the first layer (or `whiten`, a fit from fitted_whitening,
    sets it); without either the state is a template (the shapes a checkpoint restores into). With
    --focus the state holds one loss per training image: num_examples of them (default: the images given).
    """
    model = models.get(config.model)
    if whiten is None and train_images_u8 is not None:
        whiten = fitted_whitening(config, train_images_u8)
    focus_examples = 0
    if config.focus < 1:
        focus_examples = num_examples if num_examples is not None else len(train_images_u8)
    # Each member's optimizer state starts from its own swept values: one optimizer then serves all.
    states = [init_state(model, make_optimizer(dataclasses.replace(member, sweep=config.sweep), schedule_steps),
                         member.seed, whiten, focus_examples) for member in config_lib.member_configs(config)]
    return stack(states) if len(states) > 1 else states[0]


@jax.jit  # one program for the whole tree, where an eager jnp.stack compiles one per leaf shape
def stack(trees: list):
    """Trees of equal structure -> one tree whose leaves have a leading member axis."""
    return jax.tree.map(lambda *leaves: jnp.stack(leaves), *trees)


def unstack(tree, members: int) -> list:
    """The inverse of stack."""
    return [jax.tree.map(lambda leaf, i=i: leaf[i], tree) for i in range(members)]


def epoch_permutations(data_key_data, first_epoch, count: int, num_examples: int):
    """The example order of epochs first_epoch .. first_epoch+count-1: (count, num_examples) int32.

    The order depends only on (seed, epoch), never on the device count or on where a run resumed.
    The key arrives as raw key data so that it can be placed like any other array on the mesh.
    """
    data_key = jax.random.wrap_key_data(data_key_data)

    def one(epoch):
        return jax.random.permutation(jax.random.fold_in(data_key, epoch), num_examples).astype(jnp.int32)

    return jax.vmap(one)(first_epoch + jnp.arange(count))


@functools.lru_cache(maxsize=8)
def _placed_permutations(mesh, members: bool):
    replicated = distributed.replicated(mesh)
    orders = jax.vmap(epoch_permutations, in_axes=(0, None, None, None)) if members else epoch_permutations
    return jax.jit(orders, static_argnums=(2, 3), out_shardings=replicated)


def place_orders(key_data, first_epoch: int, count: int, num_examples: int, mesh):
    """The orders a chunk starting in first_epoch may read, computed on the mesh: (epoch_index, perms);
    key_data (members, 2) gives each member its own orders, (members, count, num_examples)."""
    epoch_index = distributed.put_replicated(np.int32(first_epoch), mesh)
    return epoch_index, _placed_permutations(mesh, key_data.ndim == 2)(key_data, epoch_index, count, num_examples)


def make_chunk(train_step: Callable, num_steps: int, plan: Plan, mesh, augment: Callable | None = None,
               members_together: bool | None = None):
    """run_chunk(state, perms, first_epoch, images_u8, labels, keys) -> (state, metrics of every step).

    For several members state, perms and keys carry a leading member axis, the images and labels are
    shared, and the metrics are (members, steps). On an accelerator (members_together, by default
    off a CPU) the members' steps are vmapped into one, so that their small matmuls batch into large
    ones; on a CPU they run one after another (and compile_chunk runs such programs in lanes).
    """
    batch_sharding = distributed.batch_sharded(mesh)
    steps_per_epoch, batch_size = plan.steps_per_epoch, plan.batch_size

    def one_step(state: TrainState, step, perms, first_epoch, images_u8, labels, keys):
        """A training step; `step` is state.step, passed apart: members step together, so under their
        vmap it stays one number, and what depends only on it (the epoch's order, --focus's ranking
        at a pass's start: a lax.cond, which a batched predicate would turn into both branches at
        every step) is computed once for all of them."""
        order = perms[step // steps_per_epoch - first_epoch]
        if plan.focus_steps:
            focus_state, indices = focus.batch_indices(state.focus, step, order, steps_per_epoch, plan.focus_steps,
                                                       batch_size, jax.random.wrap_key_data(keys["data"]))
            state = state._replace(focus=focus_state)
        else:
            indices = jax.lax.dynamic_slice(order, ((step % steps_per_epoch) * batch_size,), (batch_size,))
        batch_images = jax.lax.with_sharding_constraint(images_u8[indices], batch_sharding)  # (B, 784)
        batch_labels = jax.lax.with_sharding_constraint(labels[indices], batch_sharding)
        if augment is not None:
            batch_images = augment(step, batch_images, indices, keys, steps_per_epoch)
        return train_step(state, batch_images, batch_labels, indices)

    def run_chunk(state: TrainState, perms, first_epoch, images_u8, labels, keys):
        def body(state, _):
            return one_step(state, state.step, perms, first_epoch, images_u8, labels, keys)

        return jax.lax.scan(body, state, None, length=num_steps)

    if plan.members == 1:
        return run_chunk
    if members_together is None:
        members_together = jax.default_backend() != "cpu"
    if members_together:
        def run_together(state, perms, first_epoch, images_u8, labels, keys):
            def body(state, _):
                return jax.vmap(one_step, in_axes=(0, None, 0, None, None, None, 0))(
                    state, state.step[0], perms, first_epoch, images_u8, labels, keys)

            state, metrics = jax.lax.scan(body, state, None, length=num_steps)
            return state, jax.tree.map(lambda metric: jnp.moveaxis(metric, 0, 1), metrics)  # (members, steps)

        return run_together

    # A CPU's matmuls are compute-bound already: the members run one after another inside the program,
    # each exactly the single run's computation (measured: vmap cost up to 5% per model at 8 members).
    def run_members(state, perms, first_epoch, images_u8, labels, keys):
        return jax.lax.map(lambda member: run_chunk(member[0], member[1], first_epoch, images_u8, labels, member[2]),
                           (state, perms, keys))

    return run_members


def chunk_keys(plan: Plan, mesh) -> dict[str, jax.Array]:
    """The raw key data a compiled chunk reads, replicated over the mesh: augmentation's streams, and
    the data stream (the epochs' orders are made from it, and --focus's passes)."""
    return {purpose: distributed.put_replicated(data, mesh)
            for purpose, data in {**augment_keys(plan), "data": plan.key_data("data")}.items()}


def compiler_options() -> dict:
    """XLA options for compiled training: on a CPU, denormal floats flush to zero. A trajectory that
    drifts into denormals is otherwise slowed by the CPU's microcode assists: the speedrun recipe at
    batch 64 trained at ~800 examples/sec instead of ~1,140, to the same parameters bit for bit (Intel Xeon)."""
    return {"xla_cpu_ftz": True} if jax.default_backend() == "cpu" else {}


def compile_training(lowered):
    """lowered.compile() with compiler_options(); an XLA that no longer knows one of them (it
    refuses unknown names) compiles without it, only slower where denormals appear."""
    try:
        return lowered.compile(compiler_options())
    except jax.errors.JaxRuntimeError as error:
        if "No such compile option" not in str(error):
            raise
        return lowered.compile()


def compile_chunk(train_step: Callable, num_steps: int, plan: Plan, mesh, args, augment: Callable | None = None):
    """Compile a chunk ahead of time for these arguments; the state buffers are donated. Several
    members on a CPU train in lanes, a program per core run at once (lanes.py); each lane reads its
    members out of the whole state, so that state is not donated, and lives until the chunk ends."""
    replicated = distributed.replicated(mesh)
    lane_count = lanes.count(plan.members, mesh)
    if lane_count == 1:
        chunk = make_chunk(train_step, num_steps, plan, mesh, augment)
        return compile_training(jax.jit(chunk, in_shardings=replicated, out_shardings=replicated,
                                        donate_argnums=0).lower(*args))

    @functools.cache  # lanes of one size share their program
    def lane_program(size: int):
        chunk = make_chunk(train_step, num_steps, dataclasses.replace(plan, members=size), mesh, augment)

        def train_lane(start, state, perms, first_epoch, images_u8, labels, keys):
            ours = lanes.members_of((state, perms, keys), start, size)
            output = chunk(ours[0], ours[1], first_epoch, images_u8, labels, ours[2])
            return output if size > 1 else jax.tree.map(lambda leaf: leaf[None], output)

        start = distributed.put_replicated(np.int32(0), mesh)
        return compile_training(jax.jit(train_lane, in_shardings=replicated, out_shardings=replicated).lower(
            start, *args))

    return lanes.Lanes([(lane_program(size), distributed.put_replicated(np.int32(start), mesh))
                        for start, size in lanes.groups(plan.members, lane_count)])


@dataclasses.dataclass
class Hooks:
    """What the caller (the CLI) wants to hear about, and when it wants to stop."""

    on_log: Callable[[dict], None] = lambda record: None
    stop_signal: Callable[[], int | None] = lambda: None  # a pending signal number, or None
    on_note: Callable[[str], None] = lambda message: None


@dataclasses.dataclass
class TrainStats:
    """A run's training figures, summed over every process lifetime that trained it.

    Saved in each checkpoint, so that a resumed run (even one whose training had finished before
    it was killed) reports the figures of all its training, never nulls or zeros.
    """

    compile_seconds: float = 0.0
    train_seconds: float = 0.0  # inside training chunks (and fitting --whiten): compile, initialization and evaluation excluded
    steady_examples: int = 0  # every chunk but the first of each process lifetime (its warm-up)
    steady_seconds: float = 0.0
    wall_seconds: float = 0.0  # fit() from start to end, compile and checkpoints included
    final_train_loss: float | None = None

    def add_chunk(self, examples: int, seconds: float, last_loss: float, warm_up: bool) -> None:
        self.train_seconds += seconds
        self.final_train_loss = last_loss
        if not warm_up:
            self.steady_examples += examples
            self.steady_seconds += seconds

    def steady_examples_per_sec(self) -> float | None:
        return self.steady_examples / self.steady_seconds if self.steady_seconds > 0 else None


@dataclasses.dataclass
class FitResult:
    state: TrainState
    plan: Plan
    stats: TrainStats


def fit(
    config: TrainConfig,
    train_images_u8: np.ndarray,
    train_labels: np.ndarray,
    mesh=None,
    plan: Plan | None = None,
    metrics_path: Path | None = None,
    checkpointer=None,
    hooks: Hooks | None = None,
    start: tuple[TrainState, TrainStats] | None = None,
) -> FitResult:
    """Train from scratch, or from `start` (a restored state and its figures), to plan.total_steps.

    A pending stop signal is honoured at the next chunk end: checkpoint, then Interrupted.
    """
    started = time.perf_counter()
    hooks = hooks or Hooks()
    mesh = mesh if mesh is not None else distributed.make_mesh("all")
    plan = plan or plan_lib.resolve(config, int(train_images_u8.shape[0]), int(mesh.devices.size))
    train_step = config_train_step(config, plan.schedule_steps)
    if start is None:
        tic = time.perf_counter()
        whiten = fitted_whitening(config, train_images_u8)  # fitting to the training images is training
        fitting_seconds = time.perf_counter() - tic  # initializing the parameters is not
        start = (initial_state(config, plan.schedule_steps, whiten=whiten, num_examples=plan.num_examples),
                 TrainStats(train_seconds=fitting_seconds))
    state, stats = start
    stats = dataclasses.replace(stats)  # a copy: the caller's figures stay as they were
    wall_before = stats.wall_seconds
    chunks_run = 0  # in this process lifetime: its first chunk is the warm-up

    state = distributed.replicate_tree(state, mesh)
    images_u8 = distributed.put_replicated(train_images_u8.reshape(plan.num_examples, -1), mesh)  # (N, 784) uint8
    labels = distributed.put_replicated(train_labels.astype(np.int32), mesh)
    keys = chunk_keys(plan, mesh)

    step = int(np.ravel(distributed.fetch(state.step))[0])  # deliberate sync: once, before the loop
    healthy = finite_members(state.params, plan.members)  # a member diverged before a resume stays so
    compiled: dict[int, Any] = {}
    perms, epoch_index, perms_epoch = None, None, None
    augment = make_augment(config)
    learning_rates = [lr_schedule(member, plan.schedule_steps) for member in config_lib.member_configs(config)]
    while step < plan.total_steps:
        end = min((step // plan.log_every + 1) * plan.log_every, plan.total_steps)
        num_steps = end - step
        first_epoch = step // plan.steps_per_epoch
        with jax.transfer_guard("disallow"):  # the hot path: any implicit host<->device copy is a bug
            if perms_epoch != first_epoch:  # once an epoch, not once a chunk
                epoch_index, perms = place_orders(keys["data"], first_epoch, plan.perms_per_chunk, plan.num_examples,
                                                  mesh)
                perms_epoch = first_epoch
            args = (state, perms, epoch_index, images_u8, labels, keys)
            if num_steps not in compiled:
                tic = time.perf_counter()
                compiled[num_steps] = compile_chunk(train_step, num_steps, plan, mesh, args, augment)
                stats.compile_seconds += time.perf_counter() - tic
            if chunks_run == 0:  # a stop during start-up or compile: nothing to save
                signum = distributed.agreed_stop(hooks.stop_signal())
                if signum is not None:
                    raise Interrupted(signum, step, agreed=True)
            tic = time.perf_counter()
            state, chunk_metrics = compiled[num_steps](*args)
            jax.block_until_ready((state, chunk_metrics))  # fence: the clock stops when the work is done
            seconds = time.perf_counter() - tic
            host_metrics = distributed.fetch(chunk_metrics)  # deliberate sync: the log point
        stats.wall_seconds = wall_before + time.perf_counter() - started
        record, now = log_record(host_metrics, healthy, step, end, plan, seconds, stats.wall_seconds)
        if now.any() and not now.all() and (healthy != now).any():
            seeds = plan.member_seeds()
            lost = ", ".join(f"{i} (seed {seeds[i]})" for i in np.flatnonzero(healthy & ~now))
            hooks.on_note(f"member(s) {lost} diverged by step {end}: the others go on, and the summary leaves these out")
        healthy = now
        lrs = [float(learning_rate(end - 1)) for learning_rate in learning_rates]  # the chunk's last update's
        record["lr"] = lrs[0] if len(set(lrs)) == 1 else None  # a sweep over lr: each member's below
        if plan.members > 1:
            record["member_lr"] = lrs
        if metrics_path is not None and jax.process_index() == 0:
            artifacts.append_jsonl(metrics_path, [record])  # kept even when this chunk diverged
        if not healthy.any():
            _check_finite(host_metrics, step)
        step = end
        last_losses = np.asarray(host_metrics["loss"]).reshape(plan.members, -1)[healthy, -1]
        stats.add_chunk(num_steps * plan.batch_size * plan.members, seconds, float(last_losses.mean()),
                        warm_up=chunks_run == 0)
        chunks_run += 1
        hooks.on_log(record)
        signum = distributed.agreed_stop(hooks.stop_signal())
        crossed = step // plan.checkpoint_every > (step - num_steps) // plan.checkpoint_every
        if checkpointer is not None and (signum is not None or step == plan.total_steps or crossed):
            checkpointer.save(step, state, plan, dataclasses.asdict(stats))
        if signum is not None and step < plan.total_steps:
            raise Interrupted(signum, step, agreed=True)

    stats.wall_seconds = wall_before + time.perf_counter() - started
    return FitResult(state=state, plan=plan, stats=stats)


def log_record(host_metrics: dict, healthy: np.ndarray, first_step: int, end: int, plan: Plan, seconds: float,
               elapsed: float) -> tuple[dict, np.ndarray]:
    """One metrics.jsonl record from a chunk's metrics ((steps,) each, or (members, steps)), and which
    members are still finite. Several members: the figures are the finite members' means, each
    member's own under member_<name>, and the seeds that diverged (they keep training, harmlessly)."""
    per_member = {name: np.asarray(host_metrics[name]).reshape(plan.members, -1) for name in ("loss", "accuracy",
                                                                                              "grad_norm")}
    finite = np.isfinite(per_member["loss"]).all(-1) & np.isfinite(per_member["grad_norm"]).all(-1)
    now = healthy & finite
    shown = now if now.any() else np.ones_like(now)  # all diverged: the record shows the NaNs
    record = {
        "step": end,
        "epoch": round(plan.epochs(end), 4),
        **{name: float(values[shown].mean()) for name, values in per_member.items()},
        "examples_per_sec": (end - first_step) * plan.batch_size * plan.members / seconds,
        "elapsed_s": elapsed,
    }
    if plan.members > 1:
        record.update({f"member_{name}": values.mean(-1).tolist() for name, values in per_member.items()})
        record["diverged_members"] = np.flatnonzero(~now).tolist()  # indices, in member_configs order
    return record, now


def finite_members(params, members: int) -> np.ndarray:
    """(members,) bool: whose parameters are all finite (a deliberate sync, once per fit)."""
    return np.asarray(distributed.fetch(_finite_members(params, members)))


@functools.partial(jax.jit, static_argnums=1)  # one program, not one eager compile per leaf's shape
def _finite_members(params, members: int):
    finite = jax.tree.map(lambda leaf: jnp.isfinite(leaf).reshape(members, -1).all(-1) if members > 1 else
                          jnp.isfinite(leaf).all()[None], params)
    return jax.tree.reduce(jnp.logical_and, finite)


def _check_finite(host_metrics: dict, first_step: int) -> None:
    finite = np.isfinite(host_metrics["loss"]) & np.isfinite(host_metrics["grad_norm"])
    if not finite.all():
        raise Diverged(first_step + int(np.argmin(finite)) + 1)


def params_digest(params) -> str:
    """SHA-256 of the parameters' bytes in sorted leaf-path order."""
    host = distributed.fetch(params)
    named = [(jax.tree_util.keystr(path), leaf) for path, leaf in jax.tree_util.tree_leaves_with_path(host)]
    return artifacts.digest_arrays(named)
