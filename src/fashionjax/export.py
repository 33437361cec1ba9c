"""A trained model out of fashionjax: ONNX (jax2onnx), StableHLO (jax.export) and safetensors weights.

Each artifact holds the classifier exactly as the run was evaluated: images (batch, 28, 28) float32
in [0, 1] -> logits (batch, 10) float32, with flip TTA inside when the run used it. The ONNX and
StableHLO files are checked after writing: they must label all 10,000 test images as JAX does.
TensorFlow is never imported; the converters come from the optional `export` extra.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Callable
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

import fashionjax
from fashionjax import artifacts, environment, evaluate, train
from fashionjax.config import ConfigError, TrainConfig
from fashionjax.predict import SIDE

FORMATS = ("onnx", "stablehlo", "safetensors")
FILES = {"onnx": "model.onnx", "stablehlo": "model.stablehlo", "safetensors": "model.safetensors"}
NEEDS = {"onnx": ("jax2onnx", "onnx", "onnxruntime"), "safetensors": ("safetensors",), "stablehlo": ()}
PREPROCESSING = ("images (batch, 28, 28) float32 in [0, 1] = uint8 pixels / 255, light garment on black, "
                 "as Fashion-MNIST (`fashionjax predict` makes photos so)")
TIE_TOLERANCE = 1e-4  # logits this close (relative) are a tie: either label is right
VERIFY_BATCH = 1000


class ExportError(RuntimeError):
    """An export that could not be written or did not verify."""


def formats(text: str) -> tuple[str, ...]:
    """--format's value: one format or 'all'."""
    if text == "all":
        return FORMATS
    if text not in FORMATS:
        raise ConfigError(f"--format must be one of {', '.join(FORMATS)} or all, got {text!r}")
    return (text,)


def require(wanted: tuple[str, ...]) -> None:
    """Refuse at once, naming the extra, when a converter for a wanted format is not installed."""
    for fmt in wanted:
        environment.require_extra("export", NEEDS[fmt], f"export --format {fmt}")


def metadata(config: TrainConfig, params, class_names) -> dict[str, str]:
    """What travels inside every artifact (strings only, as ONNX and safetensors store them)."""
    return {"fashionjax_version": fashionjax.__version__, "model": config.model,
            "config": json.dumps(dataclasses.asdict(config), sort_keys=True), "class_names": json.dumps(list(class_names)),
            "params_digest": train.params_digest(params), "tta": json.dumps(config.tta),
            "tta_shift": json.dumps(config.tta_shift),
            "input": "images float32 [batch, 28, 28]", "output": "logits float32 [batch, 10]",
            "preprocessing": PREPROCESSING}


def export(trained, wanted: tuple[str, ...], out_dir: Path, test_images_u8: np.ndarray, class_names,
           note: Callable[[str], None] = lambda message: None) -> dict:
    """Write the wanted artifacts into out_dir and verify them; returns export.json's document."""
    require(wanted)
    config, params = trained.config, trained.params
    classify = evaluate.run_classifier(config, params)
    meta = metadata(config, params, class_names)
    images = test_images_u8.reshape(-1, SIDE, SIDE).astype(np.float32) / np.float32(255.0)
    reference = evaluate.in_fixed_batches(jax.jit(classify), images, VERIFY_BATCH)
    document = {"run_dir": str(trained.run_dir), "member": trained.member, "checkpoint_step": trained.step,
                "model": config.model, "params_digest": meta["params_digest"], "tta": config.tta,
                "tta_shift": config.tta_shift, "artifacts": {}}
    # an earlier export.json would describe files this export replaces: one cut short (a signal, a
    # failed check) leaves none, so the folder never claims what it no longer holds
    (out_dir / "export.json").unlink(missing_ok=True)
    for fmt in wanted:
        path = out_dir / FILES[fmt]
        note(f"writing {path}")
        if fmt == "onnx":
            artifacts.atomic_write_bytes(path, onnx_bytes(classify, config.model, meta))
            check = compare(reference, evaluate.in_fixed_batches(onnx_callable(path), images, VERIFY_BATCH))
        elif fmt == "stablehlo":
            artifacts.atomic_write_bytes(path, stablehlo_bytes(classify))
            check = compare(reference, evaluate.in_fixed_batches(load(path), images, VERIFY_BATCH))
        else:
            save_safetensors(params, meta, path)
            check = {"params_equal": train.params_digest(load_safetensors(path)) == meta["params_digest"]}
        document["artifacts"][fmt] = {"path": str(path), "bytes": path.stat().st_size, **check}
        if not check.get("params_equal", True) or check.get("differing_labels", 0) > check.get("ties", 0):
            raise ExportError(f"{path}: does not reproduce the JAX model ({json.dumps(check)})")
    artifacts.atomic_write_json(out_dir / "export.json", dict(document, metadata=meta))
    return document


def compare(reference: np.ndarray, logits: np.ndarray) -> dict:
    """How far an artifact's logits are from JAX's: max |difference|, labels that differ, and how many
    of those are ties (JAX's own logits for the two labels within TIE_TOLERANCE)."""
    mine, theirs = reference.argmax(-1), logits.argmax(-1)
    differ = np.flatnonzero(mine != theirs)
    gap = np.abs(reference[differ, mine[differ]] - reference[differ, theirs[differ]])
    scale = np.maximum(1.0, np.abs(reference[differ, mine[differ]]))
    return {"examples": int(len(reference)), "max_abs_logit_difference": float(np.max(np.abs(reference - logits))),
            "differing_labels": int(len(differ)), "ties": int(np.sum(gap <= TIE_TOLERANCE * scale))}


# ---------------------------------------------------------------- ONNX


def onnx_bytes(classify, model_name: str, meta: dict[str, str]) -> bytes:
    """The classifier as an ONNX model with a dynamic batch: input `images`, output `logits`."""
    import onnx
    from jax2onnx import to_onnx

    logging.getLogger("onnx_ir").setLevel(logging.ERROR)  # it warns about every untyped constant shape
    proto = to_onnx(classify, inputs=[("batch", SIDE, SIDE)], model_name=f"fashionjax_{model_name}",
                    input_names=["images"], output_names=["logits"])
    onnx.helper.set_model_props(proto, meta)
    drop_unused_initializers(proto.graph)
    onnx.checker.check_model(proto)
    return proto.SerializeToString()


def drop_unused_initializers(graph) -> set[str]:
    """Remove, in place, the initializers no node reads, in graph and every graph nested in it; returns
    the names graph's nodes and nested graphs read. jax2onnx leaves constants in the scan's loop body
    that nothing reads, and onnxruntime prints a warning for each one every time it loads the model."""
    import onnx

    read = {output.name for output in graph.output}
    for node in graph.node:
        read.update(node.input)
        for attribute in node.attribute:
            nested = [attribute.g] if attribute.type == onnx.AttributeProto.GRAPH else list(attribute.graphs)
            for subgraph in nested:
                read |= drop_unused_initializers(subgraph)  # a subgraph may read its outer graphs' names
    kept = [initializer for initializer in graph.initializer if initializer.name in read]
    del graph.initializer[:]
    graph.initializer.extend(kept)
    return read


def onnx_callable(path: str | Path):
    """An onnxruntime session as images -> logits."""
    import onnxruntime

    session = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return lambda images: session.run(["logits"], {"images": np.asarray(images, np.float32)})[0]


# ---------------------------------------------------------------- StableHLO


def stablehlo_bytes(classify) -> bytes:
    """jax.export's serialization of the classifier, with a symbolic batch dimension."""
    (batch,) = jax.export.symbolic_shape("batch")
    spec = jax.ShapeDtypeStruct((batch, SIDE, SIDE), jnp.float32)
    return bytes(jax.export.export(jax.jit(classify))(spec).serialize())


def load(path: str | Path):
    """A callable images (batch, 28, 28) float32 -> logits (batch, 10) from a .stablehlo file."""
    exported = jax.export.deserialize(bytearray(Path(path).read_bytes()))
    return exported.call


# ---------------------------------------------------------------- safetensors


def save_safetensors(params, meta: dict[str, str], path: Path) -> None:
    from safetensors.numpy import save

    flat = {_key(key_path): np.asarray(leaf) for key_path, leaf in
            jax.tree_util.tree_leaves_with_path(jax.device_get(params))}
    artifacts.atomic_write_bytes(path, save(flat, metadata=meta))


def load_safetensors(path: str | Path) -> dict:
    """The parameters as the nested dict the models take ("stats/mean1" -> params["stats"]["mean1"])."""
    from safetensors.numpy import load_file

    params: dict = {}
    for name, array in load_file(str(path)).items():
        *parents, leaf = name.split("/")
        node = params
        for parent in parents:
            node = node.setdefault(parent, {})
        node[leaf] = jnp.asarray(array)
    return params


def _key(key_path) -> str:
    return "/".join(str(getattr(entry, "key", entry)) for entry in key_path)
