"""Several members at once on a CPU: lanes split them evenly, run at once, and train each member exactly
as one program would."""

from __future__ import annotations

import dataclasses
import threading
import types

import jax
import numpy as np
import pytest

from fashionjax import config, distributed, lanes, train


def test_groups_are_contiguous_and_even():
    assert lanes.groups(5, 2) == [(0, 3), (3, 2)]
    assert lanes.groups(7, 3) == [(0, 3), (3, 2), (5, 2)]
    assert lanes.groups(4, 4) == [(0, 1), (1, 1), (2, 1), (3, 1)]
    assert lanes.groups(1, 1) == [(0, 1)]


def test_one_lane_per_core_on_a_cpu_with_one_device(monkeypatch):
    if jax.default_backend() != "cpu":
        pytest.skip("lanes are a CPU's: an accelerator vmaps the members into one program")
    monkeypatch.setattr(lanes, "cores", lambda: 3)
    one_device = distributed.make_mesh(1)
    assert [lanes.count(members, one_device) for members in (1, 2, 3, 8)] == [1, 2, 3, 3]
    two_devices = types.SimpleNamespace(devices=np.empty(2))  # a batch sharded over devices: one program
    assert lanes.count(8, two_devices) == 1


# A sweep and seeds (each member its own rate and keys), flips and --focus (each member its own
# ranking of the training images): everything a member carries along the member axis.
MEMBERS = config.TrainConfig(steps=12, batch_size=32, log_every=4, warmup_steps=2, seeds=2, augment=True, focus=0.5,
                             sweep=(("lr", (1e-3, 3e-3)),))


def test_members_train_the_same_in_any_number_of_lanes_and_the_lanes_run_at_once(small_dataset, monkeypatch):
    if jax.default_backend() != "cpu":
        pytest.skip("lanes are a CPU's: an accelerator vmaps the members into one program")
    compile_training = train.compile_training
    barriers = {}

    def compiled_behind_a_barrier(lowered):  # each lane waits for every other to be running too
        compiled = compile_training(lowered)

        def run(*arguments):
            barrier = barriers.get(lanes_now)
            if barrier is not None:
                barrier.wait(timeout=60)  # lanes run one after another: BrokenBarrierError
            return compiled(*arguments)
        return run

    monkeypatch.setattr(train, "compile_training", compiled_behind_a_barrier)
    states = {}
    for lanes_now in (1, 2, 4):
        monkeypatch.setattr(lanes, "cores", lambda count=lanes_now: count)
        barriers[lanes_now] = threading.Barrier(lanes_now) if lanes_now > 1 else None
        states[lanes_now] = train.fit(MEMBERS, small_dataset.train.images_u8, small_dataset.train.labels).state
    assert jax.tree.leaves(states[1].params)[0].shape[0] == 4  # two rates by two seeds
    for count in (2, 4):
        for path, one, laned in zip(jax.tree_util.tree_leaves_with_path(states[1]), jax.tree.leaves(states[1]),
                                    jax.tree.leaves(states[count]), strict=True):
            assert np.array_equal(np.asarray(one), np.asarray(laned)), (count, jax.tree_util.keystr(path[0]))


def test_a_member_alone_in_its_lane_keeps_the_member_axis(small_dataset, monkeypatch):
    monkeypatch.setattr(lanes, "cores", lambda: 2)
    three = dataclasses.replace(MEMBERS, sweep=(), seeds=3)  # lanes of two members and of one
    result = train.fit(three, small_dataset.train.images_u8, small_dataset.train.labels)
    assert {leaf.shape[0] for leaf in jax.tree.leaves(result.state)} == {3}
    assert result.plan.members == 3
