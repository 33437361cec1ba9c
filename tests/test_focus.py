"""--focus: passes over the highest-loss examples after the first epoch, by hand and through the trainer."""

from __future__ import annotations

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fashionjax import augment, cli, config, distributed, focus, plan, train

KEY = jax.random.key(7)


def test_a_pass_reads_the_highest_losses_in_a_shuffled_order():
    losses = jnp.array([0.1, 3.0, 0.5, 2.0, 2.0, 0.2, 9.0, 0.3])
    order = np.asarray(focus.pass_order(losses, KEY, 3, 4))
    assert sorted(order[:4]) == [1, 3, 4, 6]  # the four highest; of the tied 2.0s both fit
    assert list(order[4:]) == [2, 7, 5, 0]  # the rest, hardest first: never read
    assert sorted(order) == list(range(8))
    other_pass = np.asarray(focus.pass_order(losses, KEY, 4, 4))
    assert sorted(other_pass[:4]) == [1, 3, 4, 6] and list(other_pass[:4]) != list(order[:4])
    ties = np.asarray(focus.pass_order(jnp.array([1.0, 2.0, 2.0, 2.0]), KEY, 0, 2))
    assert sorted(ties[:2]) == [1, 2]  # a tie at the cut goes to the lower index


def test_steps_read_the_epoch_then_passes_ranked_afresh_by_the_latest_losses():
    steps_per_epoch, steps_per_pass, batch = 4, 2, 2  # 8 examples; passes of the hardest 4
    epoch_order = jnp.array([5, 2, 7, 0, 1, 6, 3, 4])
    state = focus.initial(8)
    read = []
    for step in range(steps_per_epoch):
        state, indices = focus.batch_indices(state, step, epoch_order, steps_per_epoch, steps_per_pass, batch, KEY)
        read += list(np.asarray(indices))
        state = focus.record(state, indices, indices.astype(jnp.float32))  # an example's loss: its index
    assert read == [5, 2, 7, 0, 1, 6, 3, 4]  # the first epoch: the epoch's own order
    passes = []
    for step in range(steps_per_epoch, steps_per_epoch + 2 * steps_per_pass):
        state, indices = focus.batch_indices(state, step, epoch_order, steps_per_epoch, steps_per_pass, batch, KEY)
        passes.append(list(np.asarray(indices)))
        if step == steps_per_epoch:  # the first focused pass began: forget example 7 (now the easiest)
            state = focus.record(state, jnp.array([7]), jnp.array([-1.0]))
    assert sorted(passes[0] + passes[1]) == [4, 5, 6, 7]  # ranked at the pass's start: 7 still in
    assert sorted(passes[2] + passes[3]) == [3, 4, 5, 6]  # the next pass ranked 7's new loss
    assert passes[0] + passes[1] != [4, 5, 6, 7]  # shuffled (for this key)


def test_the_plan_sizes_the_passes():
    resolved = plan.resolve(dataclasses.replace(config.TrainConfig(), batch_size=64, focus=0.3), 1024)
    assert (resolved.steps_per_epoch, resolved.focus_steps) == (16, 4)
    assert plan.resolve(dataclasses.replace(config.TrainConfig(), batch_size=64), 1024).focus_steps == 0
    assert plan.resolve(dataclasses.replace(config.TrainConfig(), batch_size=64, focus=0.01), 1024).focus_steps == 1
    for bad in (0.0, 1.5, float("nan")):
        with pytest.raises(config.ConfigError, match=r"--focus must be in \(0, 1\]"):
            config.validate(dataclasses.replace(config.TrainConfig(), focus=bad))


TINY = config.TrainConfig(model="speedrun", steps=40, batch_size=64, log_every=4, warmup_steps=2, augment=True,
                          max_shift=0, whiten=True, label_smoothing=0.1, focus=0.5)


def test_training_records_each_examples_loss_and_focuses_on_the_hard_ones(small_dataset, small_speedrun):
    images, labels = small_dataset.train.images_u8, small_dataset.train.labels
    result = train.fit(TINY, images, labels)  # 16 steps an epoch, then three passes of the hardest half
    assert result.plan.focus_steps == 8
    losses = np.asarray(result.state.focus["losses"])
    assert np.isfinite(losses).all() and (losses > 0).all()  # the first epoch read every image
    again = train.fit(TINY, images, labels)
    assert train.params_digest(again.state.params) == train.params_digest(result.state.params)
    plain = train.fit(dataclasses.replace(TINY, focus=1.0), images, labels)
    assert plain.state.focus is None
    assert train.params_digest(plain.state.params) != train.params_digest(result.state.params)


def test_focus_resumes_bit_identically_mid_pass_and_its_runs_evaluate(tmp_path, synthetic_cli, capsys, small_speedrun):
    flags = ["--model", "speedrun", "--batch-size", "64", "--log-every", "4", "--schedule", "constant", "--quiet",
             "--json", "--focus", "0.5"]
    assert cli.main(["train", *flags, "--steps", "40", "--run-dir", str(tmp_path / "straight")]) == 0
    straight = json.loads(capsys.readouterr().out)
    assert cli.main(["train", *flags, "--steps", "20", "--run-dir", str(tmp_path / "split")]) == 0  # mid-pass
    capsys.readouterr()
    assert cli.main(["train", "--resume", "--steps", "40", "--quiet", "--json", "--run-dir", str(tmp_path / "split")]) == 0
    resumed = json.loads(capsys.readouterr().out)
    assert resumed["params_digest"] == straight["params_digest"]
    assert resumed["test_accuracy"] == straight["test_accuracy"]
    assert cli.main(["eval", str(tmp_path / "split"), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["params_digest"] == straight["params_digest"]
    assert cli.main(["train", "--resume", "--steps", "40", "--focus", "0.25", "--quiet", "--json",
                     "--run-dir", str(tmp_path / "split")]) == 1
    assert "focus 0.5 -> 0.25" in json.loads(capsys.readouterr().out)["error"]["message"]


def test_members_with_focus_are_their_single_runs(small_dataset, small_speedrun):
    images, labels = small_dataset.train.images_u8, small_dataset.train.labels
    together = train.fit(dataclasses.replace(TINY, seeds=2), images, labels)
    for member, state in enumerate(train.unstack(together.state, 2)):
        single = train.fit(dataclasses.replace(TINY, seed=member), images, labels)
        assert train.params_digest(state.params) == train.params_digest(single.state.params)


def members_chunk(config, images, labels, together: bool):
    """The chunk function over the first epoch and the first pass, for config's members stepped
    together (vmapped, as on an accelerator) or one after another (as on a CPU), and its arguments."""
    mesh = distributed.make_mesh("all")
    resolved = plan.resolve(config, len(labels))
    step = train.config_train_step(config, resolved.schedule_steps)
    keys = train.chunk_keys(resolved, mesh)
    epoch, perms = train.place_orders(keys["data"], 0, resolved.perms_per_chunk, resolved.num_examples, mesh)
    chunk = train.make_chunk(step, resolved.steps_per_epoch + resolved.focus_steps, resolved, mesh,
                             augment.make_augment(config), members_together=together)
    state = train.initial_state(config, resolved.schedule_steps, images)
    return chunk, (state, perms, epoch, jnp.asarray(images.reshape(len(labels), -1)), jnp.asarray(labels), keys)


def test_members_stepped_together_rank_once_a_pass_and_train_as_one_after_another(small_dataset, small_speedrun):
    images, labels = small_dataset.train.images_u8, small_dataset.train.labels.astype(np.int32)
    config = dataclasses.replace(TINY, seeds=2)
    together, args = members_chunk(config, images, labels, together=True)
    # The ranking is a branch taken at a pass's start: members share the step, so vmap keeps the
    # lax.cond (a per-member predicate would make it a select, both branches at every step).
    assert "cond[" in str(jax.make_jaxpr(together)(*args))
    state, metrics = jax.jit(together)(*args)
    alone, alone_args = members_chunk(config, images, labels, together=False)
    expected_state, expected_metrics = jax.jit(alone)(*alone_args)
    assert metrics["loss"].shape == expected_metrics["loss"].shape == (2, 24)  # (members, steps)
    np.testing.assert_allclose(metrics["loss"], expected_metrics["loss"], rtol=1e-4)
    # The same pass read: its images in the same order. The rest of the ranking may swap examples
    # whose losses the two programs computed a rounding apart (it did on a Zen 3 EPYC), so there the
    # losses it ranks must agree, not the indices.
    pass_length = plan.resolve(config, len(labels)).focus_steps * config.batch_size
    order, expected_order = np.asarray(state.focus["order"]), np.asarray(expected_state.focus["order"])
    np.testing.assert_array_equal(order[:, :pass_length], expected_order[:, :pass_length])
    losses = np.asarray(expected_state.focus["losses"])
    for member in range(2):
        ranked, expected_ranked = (losses[member, o[member, pass_length:]] for o in (order, expected_order))
        np.testing.assert_allclose(ranked, expected_ranked, rtol=1e-4)
    for leaf, expected in zip(jax.tree.leaves(state.params), jax.tree.leaves(expected_state.params), strict=True):
        np.testing.assert_allclose(leaf, expected, rtol=1e-3, atol=1e-4)  # vmapped products sum in another order
