"""Typed, frozen configuration: dataclasses, their validation and presets.

Nothing here reads files or flags; the CLI builds these and the library consumes them.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field

MODELS = ("mlp", "cnn", "speedrun", "deep")  # kept in step with models.REGISTRY by a test
WHITENABLE = ("speedrun", "deep")  # models whose first layer --whiten can fit; kept in step with models by a test
CONVOLUTIONAL = ("cnn", "speedrun", "deep")  # models with convolution filters (for --optimizer muon); the same test
OPTIMIZERS = ("adamw", "adam", "sgd", "muon")
SCHEDULES = ("constant", "cosine", "linear")
DTYPES = ("float32", "bfloat16")
MAX_SEED = 2**32 - 1  # JAX's default PRNG takes 32-bit seeds: larger ones alias smaller ones


class ConfigError(ValueError):
    """A configuration that cannot run; the message says which value and why."""


def _flag(help_text: str, default=None, **extra):
    """A config field that is also a `train` flag; the CLI builds its flags from these."""
    return field(default=default, metadata={"help": help_text, **extra})


@dataclass(frozen=True)
class TrainConfig:
    model: str = _flag(f"one of {', '.join(MODELS)}", "mlp", choices=MODELS)
    epochs: int | None = _flag("passes over the training set (with --focus: that many epochs' steps)", 10,
                               group="length")  # used when steps is None
    steps: int | None = _flag("optimizer steps (instead of --epochs)", None, group="length")
    batch_size: int = _flag("global batch size (split over the devices)", 512)
    optimizer: str = _flag(f"one of {', '.join(OPTIMIZERS)}", "adamw", choices=OPTIMIZERS)
    lr: float = _flag("peak learning rate", 3e-3)
    schedule: str = _flag(f"one of {', '.join(SCHEDULES)} (cosine and linear warm up, then decay to zero)", "cosine",
                          choices=SCHEDULES)
    warmup_steps: int = _flag("warm-up steps of the cosine and linear schedules", 100)
    weight_decay: float = _flag("decoupled weight decay", 1e-4)
    momentum: float = _flag("momentum (sgd; muon's convolution filters)", 0.9)
    muon_scale: float = _flag("--optimizer muon: the convolution filters' peak rate as a multiple of --lr (Muon's "
                              "updates are scaled to AdamW's size; every other weight trains with AdamW at --lr)", 3.0)
    nesterov: bool = _flag("Nesterov momentum (sgd only)", False)
    clip_norm: float | None = _flag("clip gradients to this global norm (off when unset)", None)
    dtype: str = _flag(f"compute dtype: {', '.join(DTYPES)}", "float32", choices=DTYPES)
    augment: bool = _flag("random horizontal flips and shifts (see --max-shift) of each training batch", False)
    max_shift: int = _flag("largest shift in pixels of --augment (0: flips only)", 1)
    alternate_flips: bool = _flag("--augment mirrors each image in alternate epochs (from a coin per image) "
                                  "instead of at random", False)
    cutout: int = _flag("--augment also blacks out a square of this side, centred at a random pixel of each "
                        "training image (0: off)", 0)
    whiten: bool = _flag(f"{' and '.join(WHITENABLE)} only: fix the first convolution to whiten the 3x3-pixel "
                         "patches it reads, fitted to the training images (not trained)", False)
    focus: float = _flag("after the first epoch, each pass reads only this fraction of the training images: those "
                         "with the highest latest training loss, ranked afresh at each pass; --epochs still counts "
                         "whole epochs' worth of steps (1: every image in every epoch)", 1.0)
    ema: float = _flag("evaluate a moving average of the weights, updated after each step with this decay "
                       "(0: off)", 0.0)
    label_smoothing: float = _flag("move this much of each target's probability to uniform", 0.0)
    tta: bool = _flag("test-time augmentation: score each test image and its mirror image (the summary "
                      "gives accuracy with and without)", False)
    tta_shift: int = _flag("with --tta, also score each test image and its mirror shifted by up to this many pixels "
                           "each way (zero-filled, as in training); the shifted views together weigh as much as the "
                           "pair unshifted (0: the mirror only)", 0)
    tensorboard: bool = _flag("also write TensorBoard event files into RUN_DIR/tensorboard (needs the tb extra)",
                              False)
    seed: int = _flag(f"root of all randomness, 0..{MAX_SEED}", 0)
    seeds: int = _flag("train the models of seeds seed .. seed+N-1 together, in one compiled program; the "
                       "summary gives each, their mean ± std and their ensemble", 1)
    log_every: int = _flag("steps per compiled chunk and log point (capped at the run's length)", 25)
    checkpoint_every: int | None = _flag("steps between checkpoints (unset: once an epoch)", None)
    keep: int = _flag("checkpoints to keep", 3)
    eval_batch_size: int = 1000
    # --sweep: ((name, (value, ...)), ...); one member per point of the grid and seed (sweep.py)
    sweep: tuple = ()

    def __post_init__(self):  # a config read back from JSON holds lists: make the sweep hashable again
        object.__setattr__(self, "sweep", tuple((name, tuple(values)) for name, values in self.sweep))

    @property
    def decaying(self) -> bool:
        """Whether the learning rate follows a schedule laid out over the run's length (not constant)."""
        return self.schedule != "constant"


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ConfigError(message)


def validate(config: TrainConfig) -> TrainConfig:
    """Return the config unchanged, or raise ConfigError naming the first bad value."""
    _require(config.model in MODELS, f"unknown model {config.model!r} (choose from {', '.join(MODELS)})")
    _require(config.optimizer in OPTIMIZERS,
             f"unknown optimizer {config.optimizer!r} (choose from {', '.join(OPTIMIZERS)})")
    _require(config.schedule in SCHEDULES,
             f"unknown schedule {config.schedule!r} (choose from {', '.join(SCHEDULES)})")
    _require(config.dtype in DTYPES, f"unknown dtype {config.dtype!r} (choose from {', '.join(DTYPES)})")
    _require(math.isfinite(config.lr) and config.lr > 0, f"learning rate must be a positive finite number, got {config.lr}")
    _require(math.isfinite(config.weight_decay) and config.weight_decay >= 0,
             f"weight decay must be >= 0, got {config.weight_decay}")
    _require(math.isfinite(config.label_smoothing) and 0 <= config.label_smoothing < 1,
             f"--label-smoothing must be in [0, 1), got {config.label_smoothing}")
    _require(0 <= config.cutout <= 28, f"--cutout must be between 0 and 28 pixels, got {config.cutout}")
    _require(not config.cutout or config.augment, "--cutout is part of the training augmentation: add --augment")
    _require(not config.whiten or config.model in WHITENABLE,
             f"--whiten fits the first layer of the {' and '.join(WHITENABLE)} models; it does not apply to "
             f"--model {config.model}")
    _require(math.isfinite(config.focus) and 0 < config.focus <= 1, f"--focus must be in (0, 1], got {config.focus}")
    _require(math.isfinite(config.ema) and 0 <= config.ema < 1, f"--ema must be in [0, 1), got {config.ema}")
    _require(0 <= config.max_shift <= 4, f"--max-shift must be between 0 and 4 pixels, got {config.max_shift}")
    _require(0 <= config.tta_shift <= 4, f"--tta-shift must be between 0 and 4 pixels, got {config.tta_shift}")
    _require(not config.tta_shift or config.tta, "--tta-shift shifts the views of --tta: add --tta")
    _require(config.clip_norm is None or (math.isfinite(config.clip_norm) and config.clip_norm > 0),
             f"clip norm must be a positive number, got {config.clip_norm}")
    _require(0 <= config.seed <= MAX_SEED, f"--seed must be between 0 and {MAX_SEED}, got {config.seed}")
    _require(config.seeds >= 1 and config.seed + config.seeds - 1 <= MAX_SEED,
             f"--seeds must be at least 1 and end at seed {MAX_SEED} or below, got {config.seeds}")
    _require(not config.nesterov or config.optimizer == "sgd",
             f"--nesterov applies to --optimizer sgd only, not {config.optimizer}")
    # a momentum of 1 or more never forgets a gradient: the update grows without bound
    _require(0 <= config.momentum < 1, f"--momentum must be in [0, 1), got {config.momentum}")
    _require(config.optimizer != "muon" or config.model in CONVOLUTIONAL,
             f"--optimizer muon orthogonalizes convolution filters; --model {config.model} has none "
             f"(choose from {', '.join(CONVOLUTIONAL)})")
    _require(math.isfinite(config.muon_scale) and config.muon_scale > 0,
             f"--muon-scale must be a positive finite number, got {config.muon_scale}")
    _require(config.optimizer == "muon" or config.muon_scale == TrainConfig.muon_scale,
             f"--muon-scale applies to --optimizer muon only, not {config.optimizer}")
    _require(config.batch_size >= 1, f"batch size must be at least 1, got {config.batch_size}")
    _require(config.eval_batch_size >= 1, f"eval batch size must be at least 1, got {config.eval_batch_size}")
    _require(config.log_every >= 1, f"--log-every must be at least 1, got {config.log_every}")
    _require(config.keep >= 1, f"--keep must be at least 1, got {config.keep}")
    _require(config.warmup_steps >= 0, f"warmup steps must be >= 0, got {config.warmup_steps}")
    _require(config.checkpoint_every is None or config.checkpoint_every >= 1,
             f"--checkpoint-every must be at least 1, got {config.checkpoint_every}")
    for name, values in config.sweep:
        require_sweepable(name)
        _require(len(values) >= 1 and len(set(values)) == len(values), f"--sweep {name.replace('_', '-')}: give distinct values")
        for value in values:
            validate(dataclasses.replace(config, sweep=(), **{name: value}))
    _require(len({name for name, _ in config.sweep}) == len(config.sweep), "--sweep: each name once")
    if config.steps is not None:
        _require(config.steps >= 1, f"--steps must be at least 1, got {config.steps}")
    else:
        _require(config.epochs is not None and config.epochs >= 1, f"--epochs must be at least 1, got {config.epochs}")
    return config


SWEEPABLE = ("lr", "weight_decay", "momentum")  # float hyperparameters of the optimizer


def require_sweepable(name: str) -> None:
    _require(name in SWEEPABLE, f"--sweep {name.replace('_', '-')}: only {', '.join(n.replace('_', '-') for n in SWEEPABLE)} "
                                "can be swept (they are data in the optimizer state)")


def member_configs(config: TrainConfig) -> list[TrainConfig]:
    """The single-run config of each member of a run: every point of the sweep's grid (the first name
    varying slowest), and within each point the seeds seed .. seed+seeds-1."""
    import itertools

    names = [name for name, _ in config.sweep]
    points = itertools.product(*(values for _, values in config.sweep))
    return [dataclasses.replace(config, seeds=1, sweep=(), seed=config.seed + i, **dict(zip(names, point, strict=True)))
            for point in points for i in range(config.seeds)]


def member_count(config: TrainConfig) -> int:
    """How many models a run trains; more than one: its state is stacked on a leading member axis."""
    return len(member_configs(config))


def one_length(explicit: dict) -> dict:
    """Flags given on top of a config: --steps replaces its epochs, and --epochs its steps."""
    if "steps" in explicit:
        return dict(explicit, epochs=None)
    if "epochs" in explicit:
        return dict(explicit, steps=None)
    return explicit


def default(model: str = "mlp") -> TrainConfig:
    """The recommended recipe for each model."""
    if model == "cnn":
        return dataclasses.replace(TrainConfig(), model="cnn", epochs=15, batch_size=256, lr=2e-3,
                                   weight_decay=5e-4, augment=True)
    # The 94% recipe: 20,000 steps, which reached 94.25% on an Intel Xeon where 14,000 gave 93.97%.
    # `--steps 14000 --alternate-flips` is the 120-second record attempt: 94.00% on that Xeon (94.05%
    # on a Zen 4 EPYC without the flips).
    # Measurements behind each choice: docs/speedrun.md.
    if model == "speedrun":
        return dataclasses.replace(TrainConfig(), model="speedrun", steps=20_000, epochs=None, focus=0.5,
                                   batch_size=16, lr=2e-3, schedule="linear", weight_decay=5e-4, augment=True,
                                   max_shift=0, whiten=True, label_smoothing=0.1, tta=True, tta_shift=1, log_every=100)
    if model == "deep":  # the best-accuracy recipe: the speedrun recipe for 12 focused epochs, shifted, cosine
        return dataclasses.replace(default("speedrun"), model="deep", epochs=12, steps=None, schedule="cosine",
                                   max_shift=1)
    return dataclasses.replace(TrainConfig(), model=model)


def codelab() -> TrainConfig:
    """The codelab's run: 400 constant-rate AdamW steps at batch 512."""
    return dataclasses.replace(TrainConfig(), steps=400, epochs=None, schedule="constant")


# Fields that define a run's trajectory: resuming with any of them changed is refused. The run's
# length is checked through the plan; cadences (log_every, checkpoint_every, keep) may change.
TRAJECTORY_FIELDS = ("model", "batch_size", "optimizer", "lr", "schedule", "warmup_steps", "weight_decay",
                     "momentum", "muon_scale", "nesterov", "clip_norm", "dtype", "augment", "max_shift",
                     "alternate_flips", "cutout", "whiten", "focus", "ema", "label_smoothing", "seed", "seeds", "sweep")


def differences(saved: dict, wanted: dict, names) -> list[str]:
    """'name saved -> wanted' for each of `names` whose values differ (what a refused resume lists)."""
    def plain(value):  # as JSON holds it: a tuple in a live config is a list in a saved one
        return json.loads(json.dumps(value))

    return [f"{name} {saved.get(name)!r} -> {wanted.get(name)!r}" for name in names
            if plain(saved.get(name)) != plain(wanted.get(name))]
