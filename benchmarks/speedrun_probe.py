"""Train a variant of the speedrun network through the ordinary `train` command (docs/speedrun.md:
the probe table of 2026-12-03).

The variant, a `models.ConvNet` of another shape, is registered as `speedrun` in this process only;
everything else (flags, run directory, summary.json) is the train command's own. Usage:

    python benchmarks/speedrun_probe.py [--filters 9,64,64,128] [--pools 011] [--hidden 512]
        [--residual] [--gelu] [--dropout 0.3] [--lookahead 5,0.5] [--gpu-conv-min-batch N] -- train --model speedrun --run-dir runs/probe ...

--filters: each convolution's filter count (the first layer's are pooled with their negations, as
the model's are). --pools holds one digit per convolution after the first (which always pools): 1
max-pools (2x2) after it. The last map is flattened.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

from fashionjax import cli, layers, models, train


@dataclass(frozen=True)
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
    parser.add_argument("--gelu", action="store_true", help="GELU instead of ReLU after each batch norm")
    parser.add_argument("--lookahead", default=None, metavar="K,ALPHA",
                        help="Lookahead: every K steps move slow weights ALPHA of the way to the fast ones")
    parser.add_argument("--dropout", type=float, default=0.0, help="drop this fraction of the hidden units in training")
    parser.add_argument("--gpu-conv-min-batch", type=int, default=layers.GPU_CONV_MIN_BATCH,
                        help="the batch from which a GPU runs XLA's convolution instead of im2col (0: always)")
    args = parser.parse_args(argv[:split])
    filters = tuple(int(f) for f in args.filters.split(","))
    if len(args.pools) != len(filters) - 1 or set(args.pools) - {"0", "1"}:
        parser.error(f"--pools needs one 0 or 1 per convolution after the first ({len(filters) - 1}), "
                     f"got {args.pools!r}")
    net = ProbeNet(filters, tuple(p == "1" for p in args.pools), args.hidden, args.residual)
    models.REGISTRY["speedrun"] = net.model("speedrun")  # this process only
    if args.dropout:
        add_hidden_dropout(args.dropout, net.flat)
    if args.lookahead:
        period, alpha = args.lookahead.split(",")
        add_lookahead(int(period), float(alpha))
    layers.GPU_CONV_MIN_BATCH = args.gpu_conv_min_batch
    if args.gelu:
        jax.nn.relu = jax.nn.gelu  # only the speedrun network calls relu; this process only
    print(f"speedrun variant: filters {filters}, pools 1{args.pools}, hidden {args.hidden}, "
          f"{'GELU' if args.gelu else 'ReLU'}{', residual' if args.residual else ''}, {models.REGISTRY['speedrun'].train_flops_per_example / 1e6:.1f} "
          "MFLOP of training per example", file=sys.stderr)
    return cli.main(argv[split + 1:])


if __name__ == "__main__":
    sys.exit(main())
