"""Train a variant of the speedrun network through the ordinary `train` command (docs/speedrun.md:
the probe table of 2026-12-03).

The variant, a `models.ConvNet` of another shape, is registered as `speedrun` in this process only;
everything else (flags, run directory, summary.json) is the train command's own. Usage:

    python benchmarks/speedrun_probe.py [--filters 9,64,64,128] [--pools 011] [--hidden 512]
        [--residual] [--scaled-norm] [--gelu] [--dropout 0.3] [--lookahead 5,0.5] [--progressive 32,3750]
        [--gpu-conv-min-batch N] -- train --model speedrun --run-dir runs/probe ...

--filters: each convolution's filter count (the first layer's are pooled with their negations, as
the model's are). --pools holds one digit per convolution after the first (which always pools): 1
max-pools (2x2) after it. The last map is flattened.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import re
import sys
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from fashionjax import cli, layers, models, train


@dataclasses.dataclass(frozen=True)
class ProbeNet(models.ConvNet):
    """The speedrun network of another shape (with `residual`, skips), marking while it traces its
    training form (for --dropout)."""

    residual: bool = False

    def forward(self, params, images, compute_dtype=jnp.float32, train=False):
        _TRAINING[0] = train
        try:
            return super().forward(params, images, compute_dtype, train)
        finally:
            _TRAINING[0] = False

    def block(self, x, w, pool, normed):
        """The model's block; with `residual`, where it keeps the width, plus its (pooled) input."""
        y = super().block(x, w, pool, normed)
        if self.residual and y.shape[-1] == x.shape[-1]:
            y = y + (layers.max_pool2x2(x) if pool else x)
        return y


def add_hidden_dropout(rate: float, flat: int) -> None:
    """Dropout on the hidden layer's input (`flat` wide) in training, for this probe only. Its mask
    comes from a key folded from the batch's own pixels (the probe has no key stream to draw from):
    different for each augmented batch, and the same again on resume."""
    dense = models._dense

    def dropped_dense(x, layer, compute_dtype):
        if layer["w"].shape[0] == flat and x.shape[0] > 0 and _TRAINING[0]:
            salt = jax.lax.bitcast_convert_type(jnp.sum(x.astype(jnp.float32)), jnp.int32)
            keep = jax.random.bernoulli(jax.random.fold_in(jax.random.key(0), salt), 1 - rate, x.shape)
            x = jnp.where(keep, x / (1 - rate), 0).astype(x.dtype)
        return dense(x, layer, compute_dtype)

    models._dense = dropped_dense


class LookaheadState(NamedTuple):
    count: jax.Array
    slow: dict


def lookahead(period: int, alpha: float) -> optax.GradientTransformation:
    """A last chain link: every `period` steps the slow weights move alpha of the way to the fast ones
    and the fast weights restart from them (Zhang et al., 2019)."""
    def init(params):
        return LookaheadState(jnp.zeros((), jnp.int32), jax.tree.map(jnp.copy, params))

    def update(updates, state, params):
        fast = optax.apply_updates(params, updates)
        count = state.count + 1
        sync = count % period == 0
        slow = jax.tree.map(lambda s, f: jnp.where(sync, s + alpha * (f - s), s), state.slow, fast)
        updates = jax.tree.map(lambda u, s, p: jnp.where(sync, s - p, u), updates, slow, params)
        return updates, LookaheadState(count, slow)

    return optax.GradientTransformation(init, update)


def add_lookahead(period: int, alpha: float) -> None:
    """Chain Lookahead after the recipe's optimizer, over the trained leaves (not the running statistics)."""
    build = train._optimizer

    def with_lookahead(*args, **kwargs):
        return optax.chain(build(*args, **kwargs), optax.masked(lookahead(period, alpha), train.trained_mask))

    train._optimizer = with_lookahead


def add_progressive_widths(net: models.ConvNet, width: int, steps: int) -> None:
    """Progressive widths: the convolutions as wide as the second one and at its side (the 14x14 ones)
    train `width` wide until the first chunk boundary (every --log-every steps) at or after `steps`,
    then at full width. The narrow chunks are their own compiled program over sliced parameters, so
    they cost what the narrow network costs (a lax.cond between the two inside one step cost the wide
    steps about 9%); the channels that join later start with zero weights out of them, so widening
    leaves the function unchanged. Which program runs depends only on the step: resume stays exact."""
    narrowed = list(itertools.takewhile(lambda i: (net.sides[i], net.filters[i]) == (net.sides[1], net.filters[1]),
                                        range(1, len(net.filters))))
    reader = narrowed[-1] + 1  # the convolution that reads the narrowed channels keeps its own width
    if reader == len(net.filters) or not 0 < width < net.filters[1]:
        raise SystemExit(f"--progressive needs a width under {net.filters[1]} and a convolution after the narrowed ones")
    wide = models.REGISTRY["speedrun"]

    def sliced(params):
        out = {**params, "stats": dict(params["stats"])}
        for i in narrowed:
            w = params[f"conv{i}"]["w"][..., :width]
            out[f"conv{i}"] = {"w": w[:, :, :width] if i - 1 in narrowed else w, "bias": params[f"conv{i}"]["bias"][:width]}
            out["stats"][f"conv{i}"] = jax.tree.map(lambda s: s[:width], params["stats"][f"conv{i}"])
        out[f"conv{reader}"] = {**params[f"conv{reader}"], "w": params[f"conv{reader}"]["w"][:, :, :width]}
        return out

    def narrow_apply_train(params, images, compute_dtype=jnp.float32):
        logits, stats = wide.apply_train(sliced(params), images, compute_dtype)
        for i in narrowed:  # the late channels' running statistics wait, unchanged
            stats[f"conv{i}"] = jax.tree.map(lambda full, part: full.at[:width].set(part),
                                             params["stats"][f"conv{i}"], stats[f"conv{i}"])
        return logits, stats

    def init(key):
        params = wide.init(key)
        for i in [*narrowed[1:], reader]:
            params[f"conv{i}"]["w"] = params[f"conv{i}"]["w"].at[:, :, width:].set(0.0)
        return params

    models.REGISTRY["speedrun"] = dataclasses.replace(wide, init=init)
    narrow = dataclasses.replace(wide, apply_train=narrow_apply_train)
    build_step, build_chunk = train.make_train_step, train.compile_chunk

    def progressive_step(model, *args, **kwargs):
        step = build_step(model, *args, **kwargs)
        step.narrow = build_step(narrow, *args, **kwargs)
        return step

    def progressive_chunk(train_step, *args, **kwargs):
        narrow_chunk, wide_chunk = build_chunk(train_step.narrow, *args, **kwargs), build_chunk(train_step, *args, **kwargs)

        def run(state, *rest):  # an explicit fetch of the step number, once a chunk
            first = int(np.ravel(jax.device_get(state.step))[0])
            return (narrow_chunk if first < steps else wide_chunk)(state, *rest)

        return run

    train.make_train_step, train.compile_chunk = progressive_step, progressive_chunk


_TRAINING = [False]  # set while speedrun_forward traces its training form


def main() -> int:
    argv = sys.argv[1:]
    split = argv.index("--") if "--" in argv else len(argv)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--filters", default=",".join(map(str, models.SPEEDRUN.filters)))
    parser.add_argument("--pools", default="".join("1" if p else "0" for p in models.SPEEDRUN.pools))
    parser.add_argument("--hidden", type=int, default=models.SPEEDRUN.hidden)
    parser.add_argument("--residual", action="store_true",
                        help="an identity skip around each convolution after the first that keeps its width")
    parser.add_argument("--scaled-norm", action="store_true", help="each batch norm trains a scale too (as deep's do)")
    parser.add_argument("--gelu", action="store_true", help="GELU instead of ReLU after each batch norm")
    parser.add_argument("--lookahead", default=None, metavar="K,ALPHA",
                        help="Lookahead: every K steps move slow weights ALPHA of the way to the fast ones")
    parser.add_argument("--dropout", type=float, default=0.0, help="drop this fraction of the hidden units in training")
    parser.add_argument("--progressive", default=None, metavar="WIDTH,STEPS",
                        help="the 14x14 convolutions train WIDTH wide for the first STEPS steps, then at full width")
    parser.add_argument("--gpu-conv-min-batch", type=int, default=layers.GPU_CONV_MIN_BATCH,
                        help="the batch from which a GPU runs XLA's convolution instead of im2col (0: always)")
    args = parser.parse_args(argv[:split])
    filters = tuple(int(f) for f in args.filters.split(","))
    if len(args.pools) != len(filters) - 1 or set(args.pools) - {"0", "1"}:
        parser.error(f"--pools needs one 0 or 1 per convolution after the first ({len(filters) - 1}), "
                     f"got {args.pools!r}")
    net = ProbeNet(filters, tuple(p == "1" for p in args.pools), args.hidden, scaled_norm=args.scaled_norm,
                   residual=args.residual)
    models.REGISTRY["speedrun"] = net.model("speedrun")  # this process only
    if args.dropout:
        add_hidden_dropout(args.dropout, net.flat)
    if args.lookahead:
        period, alpha = args.lookahead.split(",")
        add_lookahead(int(period), float(alpha))
    if args.progressive:
        if not re.fullmatch(r"\d+,\d+", args.progressive):
            parser.error(f"--progressive needs WIDTH,STEPS, got {args.progressive!r}")
        width, steps = map(int, args.progressive.split(","))
        add_progressive_widths(net, width, steps)
    layers.GPU_CONV_MIN_BATCH = args.gpu_conv_min_batch
    if args.gelu:
        jax.nn.relu = jax.nn.gelu  # only the speedrun network calls relu; this process only
    print(f"speedrun variant: filters {filters}, pools 1{args.pools}, hidden {args.hidden}, "
          f"{'GELU' if args.gelu else 'ReLU'}{', residual' if args.residual else ''}, {models.REGISTRY['speedrun'].train_flops_per_example / 1e6:.1f} "
          "MFLOP of training per example", file=sys.stderr)
    return cli.main(argv[split + 1:])


if __name__ == "__main__":
    sys.exit(main())
