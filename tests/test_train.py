"""The trainer: one compile, determinism, the data order, evaluation counts and metrics by hand."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fashionjax import augment, config, evaluate, models, plan, train

TINY = config.TrainConfig(steps=12, batch_size=64, log_every=4, warmup_steps=2)


def test_chunk_traces_once_over_many_steps(small_dataset, monkeypatch):
    traces = []
    original = models.REGISTRY["mlp"]
    counted = dataclasses.replace(original, apply=lambda *a: (traces.append(1), original.apply(*a))[1])
    monkeypatch.setitem(models.REGISTRY, "mlp", counted)
    result = train.fit(dataclasses.replace(TINY, steps=40), small_dataset.train.images_u8, small_dataset.train.labels)
    assert result.plan.total_steps == 40
    assert len(traces) == 1  # ten chunks of four steps, one trace


def test_compiled_training_flushes_denormals_to_zero(small_dataset, monkeypatch):
    tiny = jnp.float32(1e-20)  # squared: 1e-40, a float32 denormal, which a CPU computes through slow assists
    square = jax.jit(lambda x: x * x).lower(tiny)
    assert float(square.compile()(tiny)) == pytest.approx(1e-40, rel=1e-3)
    assert float(square.compile(train.compiler_options())(tiny)) == 0.0
    asked = []
    monkeypatch.setattr(train, "compiler_options", lambda: asked.append(1) or {"xla_cpu_ftz": True})
    train.fit(TINY, small_dataset.train.images_u8, small_dataset.train.labels)
    assert asked  # the trainer's chunks are compiled with them
    # An XLA that no longer knows the option refuses it by name: training compiles without it
    monkeypatch.setattr(train, "compiler_options", lambda: {"xla_cpu_no_such_option": True})
    with pytest.raises(jax.errors.JaxRuntimeError, match="No such compile option"):
        square.compile(train.compiler_options())
    assert float(train.compile_training(square)(tiny)) == pytest.approx(1e-40, rel=1e-3)


def test_same_seed_same_digest_and_other_seed_differs(small_dataset):
    run = lambda cfg: train.params_digest(  # noqa: E731
        train.fit(cfg, small_dataset.train.images_u8, small_dataset.train.labels).state.params)
    first, second = run(TINY), run(TINY)
    assert first == second
    assert run(dataclasses.replace(TINY, seed=1)) != first


def test_training_learns_the_synthetic_task(small_dataset):
    cfg = dataclasses.replace(TINY, steps=60, log_every=20)
    records = []
    result = train.fit(cfg, small_dataset.train.images_u8, small_dataset.train.labels,
                       hooks=train.Hooks(on_log=records.append))
    assert [r["step"] for r in records] == [20, 40, 60]
    assert records[-1]["loss"] < records[0]["loss"]
    scored = evaluate.run(result.state.params, "mlp", small_dataset.test.images_u8, small_dataset.test.labels)
    assert scored["report"]["accuracy"] > 0.9


def test_hot_loop_refuses_implicit_transfers(small_dataset, monkeypatch):
    """The loop runs under transfer_guard('disallow'): an implicit host-to-device copy fails."""
    cfg = dataclasses.replace(TINY, steps=8)
    images, labels = small_dataset.train.images_u8, small_dataset.train.labels
    assert train.fit(cfg, images, labels).plan.total_steps == 8  # explicit fetches only: fine
    monkeypatch.setattr(train.distributed, "put_replicated", lambda x, mesh: jax.numpy.asarray(x))
    with pytest.raises(Exception, match="Disallowed host-to-device transfer"):
        train.fit(cfg, images, labels)


def test_batch_at_step_is_a_pure_function_of_seed_and_epoch():
    key = jax.random.key_data(jax.random.split(jax.random.key(3))[1])
    a = np.asarray(train.epoch_permutations(key, 2, 2, 100))
    b = np.asarray(train.epoch_permutations(key, 3, 1, 100))
    np.testing.assert_array_equal(a[1], b[0])  # epoch 3's order does not depend on where we start
    assert sorted(a[0].tolist()) == list(range(100)) and not np.array_equal(a[0], a[1])


def test_evaluation_counts_every_example_once_with_a_padded_last_batch(small_dataset):
    params = models.mlp_init(jax.random.key(0))
    test = small_dataset.test  # 300 examples, batch 128: 3 batches, 84 padded rows
    scored = evaluate.run(params, "mlp", test.images_u8, test.labels, batch_size=128)
    report = scored["report"]
    assert report["examples"] == 300 and report["padded_examples"] == 84
    assert int(np.asarray(report["confusion"]).sum()) == 300
    unpadded = evaluate.run(params, "mlp", test.images_u8, test.labels, batch_size=1000)["report"]
    assert unpadded["eval_batch_size"] == 300 and unpadded["padded_examples"] == 0  # not padded up to 1000
    assert report["correct"] == unpadded["correct"]
    assert report["loss"] == pytest.approx(unpadded["loss"], rel=1e-6)


def test_a_batch_is_never_larger_than_the_examples_need():
    assert evaluate.batch_for(10_000, 1000) == 1000
    assert evaluate.batch_for(300, 1000) == 300  # a small test set is one batch of its own size
    assert evaluate.batch_for(3, 256) == 3  # three pictures to predict
    assert evaluate.batch_for(301, 1000, shards=4) == 304 and evaluate.batch_for(10, 3, shards=4) == 4
    assert evaluate.batch_for(0, 1000) == 1


def test_metrics_by_hand():
    labels = np.array([0, 0, 1, 1, 2, 2])
    predictions = np.array([0, 1, 1, 1, 0, 2])
    losses = np.array([1.0, 2.0, 3.0, 4.0, 5.0, 6.0])
    report = evaluate.metrics(labels, predictions, losses, num_classes=3)
    assert report["confusion"] == [[1, 1, 0], [0, 2, 0], [1, 0, 1]]
    assert report["accuracy"] == pytest.approx(4 / 6) and report["loss"] == pytest.approx(3.5)
    assert report["precision"] == pytest.approx([1 / 2, 2 / 3, 1.0])
    assert report["recall"] == pytest.approx([1 / 2, 1.0, 1 / 2])
    assert report["most_confused"] == [{"true": 0, "predicted": 1, "count": 1},
                                       {"true": 2, "predicted": 0, "count": 1}]


@pytest.mark.parametrize("field,value,message", [
    ("lr", 0.0, "learning rate"), ("lr", float("nan"), "learning rate"), ("batch_size", 0, "batch size"),
    ("steps", 0, "--steps"), ("model", "resnet", "unknown model"), ("optimizer", "lion", "unknown optimizer"),
    ("dtype", "float16", "unknown dtype"),
])
def test_bad_hyperparameters_are_named(field, value, message):
    with pytest.raises(config.ConfigError, match=message):
        config.validate(dataclasses.replace(config.TrainConfig(), **{field: value}))


def test_batch_larger_than_training_set_is_refused():
    with pytest.raises(config.ConfigError, match="larger than the training set"):
        plan.resolve(config.TrainConfig(batch_size=1000), num_examples=999)
    with pytest.raises(config.ConfigError, match="does not divide evenly over 3 devices"):
        plan.resolve(config.TrainConfig(batch_size=64), num_examples=999, device_count=3)


def test_codelab_preset():
    preset = config.codelab()
    assert (preset.steps, preset.schedule, preset.batch_size, preset.lr, preset.weight_decay) == (
        400, "constant", 512, 3e-3, 1e-4)


@pytest.mark.parametrize("schedule,rates", [  # 1,000 updates at a peak of 2e-3, 100 of them warming up
    ("constant", {0: 2e-3, 325: 2e-3, 999: 2e-3}),
    ("cosine", {0: 0.0, 50: 1e-3, 100: 2e-3, 325: 1e-3 * (1 + 0.5 ** 0.5), 550: 1e-3, 1000: 0.0}),
    ("linear", {0: 0.0, 50: 1e-3, 100: 2e-3, 325: 1.5e-3, 550: 1e-3, 999: 2e-3 / 900, 1000: 0.0}),
])
def test_learning_rate_schedules_by_hand(schedule, rates):
    rate = train.lr_schedule(config.TrainConfig(lr=2e-3, schedule=schedule, warmup_steps=100), 1000)
    assert {count: float(rate(count)) for count in rates} == pytest.approx(rates, rel=1e-5, abs=1e-9)


@pytest.mark.parametrize("schedule", config.SCHEDULES)
def test_only_a_constant_schedule_may_be_extended_on_resume(schedule):
    from fashionjax import checkpoint

    laid_out = dataclasses.replace(TINY, schedule=schedule)
    meta = {"step": 12, "plan": plan.resolve(laid_out, num_examples=640).to_dict()}
    longer = plan.resolve(dataclasses.replace(laid_out, steps=20), num_examples=640)
    if schedule == "constant":
        checkpoint.check_length(laid_out, longer, meta)
    else:
        with pytest.raises(checkpoint.ResumeError, match=f"the {schedule} schedule of this run is laid out for 12"):
            checkpoint.check_length(laid_out, longer, meta)


def test_augmentation_is_a_pure_function_of_the_key():
    images = np.random.default_rng(0).integers(0, 255, (8, 784), dtype=np.uint8)
    key = jax.random.key(5)
    first = np.asarray(augment.augment_batch(key, images))
    np.testing.assert_array_equal(first, np.asarray(augment.augment_batch(key, images)))
    assert not np.array_equal(first, np.asarray(augment.augment_batch(jax.random.key(6), images)))
    # Shifts and flips move pixels and pad with zeros; they never invent brightness.
    assert first.dtype == np.uint8 and first.sum() <= images.sum()


def test_augmented_training_is_deterministic(small_dataset):
    cfg = dataclasses.replace(TINY, augment=True)
    digests = {train.params_digest(train.fit(cfg, small_dataset.train.images_u8,
                                             small_dataset.train.labels).state.params) for _ in range(2)}
    plain = train.params_digest(train.fit(TINY, small_dataset.train.images_u8, small_dataset.train.labels).state.params)
    assert len(digests) == 1 and plain not in digests


def test_cnn_recipe_augments():
    assert config.default("cnn").augment and not config.default("mlp").augment
