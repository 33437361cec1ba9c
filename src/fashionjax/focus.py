"""--focus: after the first epoch, train on the examples the model still gets most wrong.

The first epoch reads every training image once. From then on each pass reads only the `focus`
fraction of them with the highest latest training loss, in a random order; every image's loss is
recorded as it is trained, and the ranking is refreshed at the start of each pass, so an image
that was easy but has been forgotten comes back once its stale loss outranks the others'. The run's
length in steps is unchanged (--epochs counts full epochs' worth of steps), so the passes come more
often. Measured in docs/speedrun.md ("Focus on the hardest examples").

The losses and the current pass's order live in the TrainState (and so in every checkpoint), and
the pass's order is a pure function of those losses, the run's data key and the pass: resume stays
bit-identical.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

PASS_SALT = 1 << 30  # folded into the data key before a pass's index: apart from the epochs' orders


def initial(num_examples: int) -> dict:
    """The focus state of a fresh run: no loss seen yet (an image never trained ranks first)."""
    return {"losses": jnp.full((num_examples,), jnp.inf, jnp.float32),
            "order": jnp.arange(num_examples, dtype=jnp.int32)}


def pass_steps(steps_per_epoch: int, fraction: float) -> int:
    """Steps of one focused pass: the fraction of an epoch's steps, at least one."""
    return max(1, int(steps_per_epoch * fraction))


def record(state: dict, indices, losses) -> dict:
    """The focus state with the batch's per-example training losses recorded at their indices."""
    return {**state, "losses": state["losses"].at[indices].set(losses.astype(jnp.float32))}


def pass_order(losses, data_key, pass_index, count: int):
    """The order of one focused pass: the `count` highest-loss examples (ties to the lower index),
    shuffled by the pass's own key; (N,) int32 whose first `count` entries are read."""
    hardest = jnp.argsort(-losses, stable=True)
    key = jax.random.fold_in(jax.random.fold_in(data_key, PASS_SALT), pass_index)
    shuffled = hardest[:count][jax.random.permutation(key, count)]
    return jnp.concatenate([shuffled, hardest[count:]]).astype(jnp.int32)


def batch_indices(state: dict, step, epoch_order, steps_per_epoch: int, steps_per_pass: int, batch_size: int,
                  data_key) -> tuple[dict, jax.Array]:
    """(focus state, the step's example indices). The first epoch reads epoch_order, the epoch's own
    permutation; each later step reads the current pass's order, ranked afresh when a pass begins."""
    since = step - steps_per_epoch  # steps into the focused part of the run (negative in the first epoch)
    pass_index, position = jnp.divmod(jnp.maximum(since, 0), steps_per_pass)
    pass_begins = (since >= 0) & (position == 0)

    def begin_pass(state):
        order = pass_order(state["losses"], data_key, pass_index, steps_per_pass * batch_size)
        return {**state, "order": order}

    state = jax.lax.cond(pass_begins, begin_pass, lambda state: state, state)
    first_epoch = jax.lax.dynamic_slice(epoch_order, (jnp.minimum(step, steps_per_epoch - 1) * batch_size,), (batch_size,))
    focused = jax.lax.dynamic_slice(state["order"], (position * batch_size,), (batch_size,))
    return state, jnp.where(since < 0, first_epoch, focused)
