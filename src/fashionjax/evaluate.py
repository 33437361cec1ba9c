"""Exact evaluation: every test image counted once (fixed batch shape, padded and masked),
then the confusion matrix, per-class metrics and the most-confused pairs on the host.
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

from fashionjax import config as config_lib
from fashionjax import distributed, models
from fashionjax.train import compute_dtype, scale_images


def scored_logits(model: models.Model, params, images, dtype, tta: bool, tta_shift: int = 0):
    """(the logits a prediction is made from, the image's own logits) for images (B, 28, 28) in [0, 1].

    With tta the first is the mean of the image's logits and its mirror image's; with tta_shift as
    well, half that and half the mean over both of every shift by up to tta_shift pixels each way
    (measured on models trained with shifts: docs/speedrun.md, "Toward 95%").
    """
    plain = model.apply(params, images, dtype)  # (B, 10) float32
    if not tta:
        return plain, plain
    mirrored = images[:, :, ::-1]
    pair = (plain + model.apply(params, mirrored, dtype)) / 2
    if not tta_shift:
        return pair, plain
    views = jnp.concatenate([shifted_views(images, tta_shift), shifted_views(mirrored, tta_shift)])
    shifted = jnp.mean(jax.lax.map(lambda view: model.apply(params, view, dtype), views), axis=0)
    return (pair + shifted) / 2, plain


def shifted_views(images, max_shift: int):
    """Every translation of images (B, H, W) by up to max_shift pixels each way except none, filled with
    zeros (black, as training's shifts pad): (V, B, H, W) with V = (2 max_shift + 1)^2 - 1."""
    height, width = images.shape[1:]
    padded = jnp.pad(images, ((0, 0), (max_shift, max_shift), (max_shift, max_shift)))
    span = range(2 * max_shift + 1)
    return jnp.stack([padded[:, dy:dy + height, dx:dx + width] for dy in span for dx in span
                      if (dy, dx) != (max_shift, max_shift)])


def classifier(model_name: str, params, dtype: str = "float32", tta: bool = False, members: int = 1,
               tta_shift: int = 0):
    """The trained model as one pure function: images (B, 28, 28) float32 in [0, 1] -> logits (B, 10),
    scored as the run was evaluated (with its TTA when it used it); what predict and export use.

    For a multi-model run (params stacked over members) it is the ensemble: the log of the finite
    members' mean probabilities, so that a softmax of it gives exactly that mean.
    """
    member_logits, pool = _members(model_name, params, dtype, tta, members, tta_shift)
    return lambda images: pool(member_logits(images)[0])


def classifier_and_plain(model_name: str, params, dtype: str = "float32", tta: bool = False, members: int = 1,
                         tta_shift: int = 0):
    """classifier() and the same model without TTA from one pass: images -> (scored logits, plain logits),
    each (B, 10); the plain ones are the first view that TTA averages."""
    member_logits, pool = _members(model_name, params, dtype, tta, members, tta_shift)
    return lambda images: tuple(map(pool, member_logits(images)))


def _members(model_name: str, params, dtype: str, tta: bool, members: int, tta_shift: int):
    """(images -> each member's (scored, plain) logits, the pooling of members' logits into one model's):
    for one member the logits are (B, 10) and pooling keeps them; for several, (M, B, 10) each, pooled
    to the log of the finite members' mean probabilities."""
    model = models.get(model_name)

    def one(member_params, images):
        return scored_logits(model, member_params, images, compute_dtype(dtype), tta, tta_shift)

    if members == 1:
        return (lambda images: one(params, images)), (lambda logits: logits)
    # Members one after another (lax.map), not vmapped: jax2onnx cannot lower the vmapped network's
    # padding with a symbolic batch, so `export --format onnx` of a --seeds run failed.
    return ((lambda images: jax.lax.map(lambda member_params: one(member_params, images), params)),
            (lambda logits: jnp.log(jnp.nanmean(jax.nn.softmax(logits), axis=0))))


def run_classifier(config: config_lib.TrainConfig, params, with_plain: bool = False):
    """classifier() as a run's config scores it: its model, dtype, TTA and members (with_plain:
    classifier_and_plain() instead)."""
    build = classifier_and_plain if with_plain else classifier
    return build(config.model, params, config.dtype, config.tta, config_lib.member_count(config), config.tta_shift)


def make_predict(model: models.Model, dtype, mesh, tta: bool = False, tta_shift: int = 0):
    """predict(params, batches_u8 (num_batches, B, 784), labels (num_batches, B)) -> per-example outputs.

    With tta each image is scored from its views (scored_logits); the prediction from the image
    alone is returned beside it, so both accuracies can be reported.
    """
    batch_sharding = distributed.batch_sharded(mesh)

    def predict(params, batches_u8, batch_labels):
        def one(_, batch):
            images_u8, labels = batch
            images_u8 = jax.lax.with_sharding_constraint(images_u8, batch_sharding)
            images = scale_images(images_u8).reshape(-1, models.IMAGE_SIDE, models.IMAGE_SIDE)
            logits, plain = scored_logits(model, params, images, dtype, tta, tta_shift)
            losses = optax.softmax_cross_entropy_with_integer_labels(logits, labels)
            probs = jax.nn.softmax(logits)
            return None, (jnp.argmax(logits, -1).astype(jnp.int32), jnp.max(probs, -1), losses,
                          jnp.argmax(plain, -1).astype(jnp.int32))

        _, outputs = jax.lax.scan(one, None, (batches_u8, batch_labels))
        return jax.tree_util.tree_map(lambda x: x.reshape(-1), outputs)

    return predict


def batch_for(num_examples: int, batch_size: int, shards: int = 1) -> int:
    """The batch that scores num_examples in batches of one shape: batch_size, unless fewer examples
    than that are scored (a small test set, a few pictures), which are not padded up to it; in whole
    shards (one per device)."""
    batch = max(1, min(batch_size, num_examples))
    return -(-batch // shards) * shards


def pad_to_batches(images_u8: np.ndarray, labels: np.ndarray, batch_size: int):
    """Pad with zeros to whole batches; returns (images (nb, B, 784), labels (nb, B), num_real)."""
    num_real = len(labels)
    num_batches = -(-num_real // batch_size)
    padded = num_batches * batch_size
    images = np.zeros((padded, images_u8[0].size), np.uint8)
    images[:num_real] = images_u8.reshape(num_real, -1)
    padded_labels = np.zeros((padded,), np.int32)
    padded_labels[:num_real] = labels
    return images.reshape(num_batches, batch_size, -1), padded_labels.reshape(num_batches, batch_size), num_real


def in_fixed_batches(fn, images: np.ndarray, batch_size: int) -> np.ndarray:
    """fn's output row for each image, batch_size images per call (batch_for: fewer images are one
    call of their own size): the last batch is padded with zeros, so a compiled fn sees one shape.
    fn's result is synced to the host (the caller's answer)."""
    out = []
    batch_size = batch_for(len(images), batch_size)
    for start in range(0, len(images), batch_size):
        chunk = images[start:start + batch_size]
        padded = np.zeros((batch_size, *images.shape[1:]), images.dtype)
        padded[:len(chunk)] = chunk
        out.append(np.asarray(fn(padded))[:len(chunk)])
    return np.concatenate(out)


def run(params, model_name: str, images_u8: np.ndarray, labels: np.ndarray, dtype: str = "float32",
        batch_size: int = 1000, mesh=None, tta: bool = False, tta_shift: int = 0) -> dict:
    """Score every example once; returns the eval.json document plus per-example arrays.

    With tta, "accuracy" is the test-time-augmented figure and "accuracy_no_tta" the plain one.
    """
    mesh = mesh if mesh is not None else distributed.make_mesh("all")
    batch_size = batch_for(len(labels), batch_size, mesh.devices.size)
    batches, batch_labels, num_real = pad_to_batches(images_u8, labels, batch_size)
    replicated = distributed.replicated(mesh)
    predict = jax.jit(make_predict(models.get(model_name), compute_dtype(dtype), mesh, tta, tta_shift),
                      in_shardings=replicated, out_shardings=replicated)
    args = (distributed.replicate_tree(params, mesh), distributed.put_replicated(batches, mesh),
            distributed.put_replicated(batch_labels, mesh))
    tic = time.perf_counter()
    compiled = predict.lower(*args).compile()
    compile_seconds = time.perf_counter() - tic
    tic = time.perf_counter()
    outputs = distributed.fetch(compiled(*args))  # deliberate sync: results
    seconds = time.perf_counter() - tic
    # The mask: padded rows sit past num_real and are dropped here, so each image counts once.
    predictions, confidence, losses, plain = (output[:num_real] for output in outputs)
    report = metrics(labels, predictions, losses)
    report.update(compile_seconds=compile_seconds, eval_seconds=seconds, eval_batch_size=batch_size,
                  padded_examples=int(batches.shape[0] * batch_size - num_real), tta=tta, tta_shift=tta_shift)
    if tta:
        report["accuracy_no_tta"] = float(np.mean(plain == labels))
    return {"report": report, "predictions": predictions, "confidence": confidence}


def confusion_matrix(labels: np.ndarray, predictions: np.ndarray, num_classes: int = 10) -> np.ndarray:
    """counts[true, predicted]."""
    counts = np.zeros((num_classes, num_classes), np.int64)
    np.add.at(counts, (labels, predictions), 1)
    return counts


def metrics(labels: np.ndarray, predictions: np.ndarray, losses: np.ndarray, num_classes: int = 10) -> dict:
    """Accuracy, loss, confusion matrix, per-class precision/recall and the most-confused pairs."""
    confusion = confusion_matrix(labels, predictions, num_classes)
    true_positives = np.diag(confusion)
    predicted = confusion.sum(axis=0)
    actual = confusion.sum(axis=1)
    precision = np.divide(true_positives, predicted, out=np.zeros(num_classes), where=predicted > 0)
    recall = np.divide(true_positives, actual, out=np.zeros(num_classes), where=actual > 0)
    off_diagonal = [(int(confusion[t, p]), t, p) for t in range(num_classes) for p in range(num_classes)
                    if t != p and confusion[t, p] > 0]
    off_diagonal.sort(key=lambda item: (-item[0], item[1], item[2]))
    return {
        "examples": int(len(labels)),
        "correct": int(true_positives.sum()),
        "accuracy": float(true_positives.sum() / max(len(labels), 1)),
        "loss": float(np.mean(losses, dtype=np.float64)) if len(losses) else float("nan"),
        "confusion": confusion.tolist(),
        "precision": precision.tolist(),
        "recall": recall.tolist(),
        "most_confused": [{"true": t, "predicted": p, "count": c} for c, t, p in off_diagonal[:10]],
    }


def run_members(stacked_params, model_name: str, images_u8: np.ndarray, labels: np.ndarray, seeds: list[int],
                dtype: str = "float32", batch_size: int = 1000, tta: bool = False, tta_shift: int = 0) -> dict:
    """Score every member of a multi-model run and their ensemble on every example once.

    The ensemble averages the finite members' softmax probabilities (not their accuracies or
    logits). Returns eval.json's document (the ensemble's metrics, with every member's under
    "members") plus the ensemble's per-example predictions and confidence.
    """
    model = models.get(model_name)
    compute = compute_dtype(dtype)

    def log_probs(stacked, images_u8):  # (M, B, 10) log-probabilities and (M, B) labels without TTA
        images = scale_images(images_u8).reshape(-1, models.IMAGE_SIDE, models.IMAGE_SIDE)

        def one(params):
            logits, plain = scored_logits(model, params, images, compute, tta, tta_shift)
            return jax.nn.log_softmax(logits), jnp.argmax(plain, -1)

        return jax.vmap(one)(stacked)

    def by_member(batched):  # (num_batches, M, B, ...) -> (M, num_batches * B, ...), the padding cut off
        batched = np.moveaxis(batched, 1, 0)
        return batched.reshape(batched.shape[0], -1, *batched.shape[3:])[:, :num_real]

    batch_size = batch_for(len(labels), batch_size)
    batches, _, num_real = pad_to_batches(images_u8, labels, batch_size)
    score = jax.jit(lambda stacked, batches: jax.lax.map(lambda batch: log_probs(stacked, batch), batches))
    tic = time.perf_counter()
    batched_log_probs, batched_plain = jax.device_get(score(stacked_params, batches))  # deliberate sync: results
    seconds = time.perf_counter() - tic
    member_log_probs, member_plain = by_member(batched_log_probs), by_member(batched_plain)  # (M, N, 10), (M, N)
    scored = ensemble(member_log_probs, member_plain, labels, seeds)
    scored["report"].update(eval_seconds=seconds, eval_batch_size=batch_size, tta=tta, tta_shift=tta_shift)
    return scored


def ensemble(member_log_probs: np.ndarray, member_plain: np.ndarray, labels: np.ndarray, seeds: list[int]) -> dict:
    """Each member's figures and their ensemble's, from log-probabilities (M, N, 10) and the labels each
    member predicts without TTA (M, N). The ensemble averages the finite members' probabilities:
    neither their accuracies nor a vote."""
    rows = np.arange(len(labels))
    finite = ~np.isnan(member_log_probs).any(axis=(1, 2))  # -inf is a certain "no", NaN a diverged member
    members = [{"seed": seed, "test_accuracy": float(np.mean(member_log_probs[i].argmax(-1) == labels)),
                "test_accuracy_no_tta": float(np.mean(member_plain[i] == labels)),
                "test_loss": float(-member_log_probs[i, rows, labels].mean(dtype=np.float64)),
                "finite": bool(finite[i])} for i, seed in enumerate(seeds)]
    if not finite.any():
        raise FloatingPointError("every member's parameters are non-finite: nothing to evaluate")
    probs = np.exp(member_log_probs[finite].astype(np.float64)).mean(axis=0)  # (N, 10)
    predictions = probs.argmax(-1)
    report = metrics(labels, predictions, -np.log(np.maximum(probs[rows, labels], 1e-300)))
    report.update(members=members, ensemble_members=int(finite.sum()))
    return {"report": report, "predictions": predictions, "confidence": probs.max(-1)}
