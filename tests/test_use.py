"""Using a trained model: `predict` on image files, `export` to ONNX / StableHLO / safetensors, and
TensorBoard event files that mirror metrics.jsonl."""

from __future__ import annotations

import importlib.util
import io
import json
import os
import signal
import subprocess
import sys
import types
from pathlib import Path

import jax
import numpy as np
import pytest
from conftest import SMALL_SPEEDRUN, synthetic_dataset, wait_for
from PIL import Image

from fashionjax import (
    artifacts,
    cli,
    data,
    environment,
    evaluate,
    export,
    models,
    predict,
    rundir,
    tensorboard,
)
from fashionjax import run as run_lib
from fashionjax.data import CLASS_NAMES

PICKED = np.random.default_rng(3).choice(10000, size=120, replace=False)  # test images written as files


def call(capsys, *argv) -> tuple[int, dict]:
    """Run the CLI in-process with --json; (exit code, the one JSON document)."""
    code = cli.main([*argv, "--json", "--quiet"])
    return code, json.loads(capsys.readouterr().out)


def train_run(directory, *flags) -> None:
    assert cli.main(["train", "--quiet", "--run-dir", str(directory), *flags]) == 0


@pytest.fixture(scope="module")
def mlp_run(real_dataset, tmp_path_factory):
    directory = tmp_path_factory.mktemp("use") / "mlp"
    train_run(directory, "--steps", "300", "--log-every", "100")
    return directory


@pytest.fixture(scope="module")
def in_memory(mlp_run, real_dataset):
    """The run's own predictions of the whole test set, the way `eval` makes them."""
    trained = run_lib.load_trained(mlp_run)
    return evaluate.run(trained.params, "mlp", real_dataset.test.images_u8, real_dataset.test.labels)["predictions"]


def photo_like(image_u8: np.ndarray, rng: np.random.Generator) -> Image.Image:
    """A test image as a user's picture: dark on white, 2-5x larger, off-centre, in colour."""
    side = int(28 * rng.uniform(2, 5))
    garment = Image.fromarray(255 - image_u8).resize((side, side), Image.Resampling.BICUBIC).convert("RGB")
    canvas = Image.new("RGB", (side * 2 + 40, side + 60), (255, 255, 255))
    canvas.paste(garment, (int(rng.integers(0, side + 40)), int(rng.integers(0, 60))))
    return canvas


# ---------------------------------------------------------------- preprocessing, by hand


def test_a_dark_rectangle_on_white_becomes_a_centred_light_one_scaled_to_28():
    picture = np.full((100, 100), 255, np.uint8)
    picture[30:40, 50:70] = 0  # 10 rows x 20 columns of black on white
    image = predict.to_fashion_mnist(picture)
    assert image.shape == (28, 28) and image.dtype == np.uint8
    rows, cols = np.nonzero(image > 128)
    # longest edge 20 -> 28, so 10 rows -> 14, centred: rows 7..20, every column
    assert (rows.min(), rows.max(), cols.min(), cols.max()) == (7, 20, 0, 27)
    assert image[:6].max() == 0 and image[22:].max() == 0  # the rest is black, as in the dataset


def test_a_dataset_image_passes_unchanged(real_dataset):
    image = real_dataset.test.images_u8[0]
    assert np.array_equal(predict.to_fashion_mnist(image), image)


def test_transparent_background_counts_as_light(tmp_path):
    picture = Image.new("RGBA", (60, 40), (0, 0, 0, 0))
    picture.paste((30, 30, 30, 255), (10, 5, 50, 35))  # an opaque dark box on a transparent ground
    picture.save(tmp_path / "cutout.png")
    image = predict.load(tmp_path / "cutout.png")
    rows, cols = np.nonzero(image > 128)
    assert (cols.min(), cols.max()) == (0, 27) and image[0].max() == 0


def test_deep_images_read_as_their_8_bit_form(real_dataset, tmp_path):
    """16-bit, 32-bit integer and float gray pictures are scaled from their range, not clipped at 255."""
    image = real_dataset.test.images_u8[3]
    photo = np.kron(image, np.ones((3, 2), np.uint8))  # 84x56: not in the dataset's form, so it is trimmed and scaled
    Image.fromarray(photo).save(tmp_path / "8-bit.png")
    Image.fromarray(photo.astype(np.uint16) * 257).save(tmp_path / "16-bit.png")
    Image.fromarray(photo.astype(np.int32) * 257).save(tmp_path / "32-bit.tiff")
    Image.fromarray(photo.astype(np.float32) / 255).save(tmp_path / "float.tiff")
    modes = {name: Image.open(tmp_path / name).mode for name in ("16-bit.png", "32-bit.tiff", "float.tiff")}
    assert modes["16-bit.png"] in ("I;16", "I") and modes["32-bit.tiff"] == "I" and modes["float.tiff"] == "F"
    assert np.array_equal(predict.load(tmp_path / "8-bit.png"), predict.to_fashion_mnist(photo))
    for name in modes:
        assert np.array_equal(predict.load(tmp_path / name), predict.load(tmp_path / "8-bit.png")), name


# ---------------------------------------------------------------- predict through the CLI


def test_test_images_as_png_classify_as_in_memory(mlp_run, in_memory, real_dataset, tmp_path, capsys):
    folder = tmp_path / "pngs"
    folder.mkdir()
    for index in PICKED:
        Image.fromarray(real_dataset.test.images_u8[index]).save(folder / f"{index:05d}.png")
    code, document = call(capsys, "predict", str(mlp_run), str(folder), "--top-k", "3")
    assert code == 0 and document["failures"] == []
    by_index = {int(p["path"].rsplit("/", 1)[1][:5]): p for p in document["predictions"]}
    assert sorted(by_index) == sorted(int(i) for i in PICKED)
    for index, row in by_index.items():
        assert row["label"] == in_memory[index] and row["class"] == CLASS_NAMES[row["label"]]
        probabilities = [t["probability"] for t in row["top_k"]]
        assert len(row["top_k"]) == 3 and probabilities == sorted(probabilities, reverse=True)
        assert row["top_k"][0]["label"] == row["label"] and 0 < sum(probabilities) <= 1 + 1e-6


def test_photo_like_images_classify_the_same_for_the_large_majority(mlp_run, in_memory, real_dataset, tmp_path,
                                                                       capsys):
    rng = np.random.default_rng(11)
    paths = []
    for index in PICKED:
        path = tmp_path / f"{index:05d}.jpg"
        photo_like(real_dataset.test.images_u8[index], rng).save(path, quality=90)
        paths.append(str(path))
    grid = tmp_path / "seen.png"
    code, document = call(capsys, "predict", str(mlp_run), *paths, "--save-preprocessed", str(grid))
    assert code == 0
    same = [row["label"] == in_memory[int(row["path"].rsplit("/", 1)[1][:5])] for row in document["predictions"]]
    assert len(same) == len(PICKED) and np.mean(same) >= 0.85, np.mean(same)
    assert grid.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and document["preprocessed"] == str(grid)


def test_a_non_image_among_images_is_named_and_the_others_are_predicted(mlp_run, real_dataset, tmp_path, capsys):
    for index in PICKED[:3]:
        Image.fromarray(real_dataset.test.images_u8[index]).save(tmp_path / f"{index:05d}.png")
    (tmp_path / "notes.png").write_text("not a picture")
    whole = (tmp_path / f"{PICKED[0]:05d}.png").read_bytes()
    (tmp_path / "torn.png").write_bytes(whole[: len(whole) // 2])
    (tmp_path / "README.txt").write_text("my garments")
    code = cli.main(["predict", str(mlp_run), str(tmp_path), "--json"])
    captured = capsys.readouterr()
    document = json.loads(captured.out)
    assert code == 1
    assert sorted(f["path"].rsplit("/", 1)[1] for f in document["failures"]) == ["README.txt", "notes.png", "torn.png"]
    assert len(document["predictions"]) == 3
    assert sum("notes.png: not a readable image" in line for line in captured.err.splitlines()) == 1


def test_a_blank_picture_is_classified_and_flagged(mlp_run, real_dataset, tmp_path, capsys):
    Image.new("RGBA", (40, 30), (0, 0, 0, 0)).save(tmp_path / "transparent.png")  # white once composited
    Image.new("L", (28, 28), 0).save(tmp_path / "black.png")  # already in the dataset's form
    Image.new("RGB", (90, 60), (200, 30, 30)).save(tmp_path / "red.jpg")
    Image.fromarray(real_dataset.test.images_u8[PICKED[0]]).save(tmp_path / "garment.png")
    assert cli.main(["predict", str(mlp_run), str(tmp_path), "--json"]) == 0
    captured = capsys.readouterr()
    blank = {Path(row["path"]).name: row["blank"] for row in json.loads(captured.out)["predictions"]}
    assert blank == {"black.png": True, "garment.png": False, "red.jpg": True, "transparent.png": True}
    notes = [line for line in captured.err.splitlines() if ": blank (" in line]
    assert len(notes) == 3 and all(line.endswith("its class says nothing about it") for line in notes)


def test_predict_with_no_readable_image_says_only_why(mlp_run, tmp_path, capsys):
    (tmp_path / "notes.png").write_text("not a picture")
    assert cli.main(["predict", str(mlp_run), str(tmp_path / "notes.png")]) == 1
    captured = capsys.readouterr()
    assert captured.out == ""  # no empty table
    assert captured.err.strip().splitlines() == [
        f"fashionjax predict: {tmp_path / 'notes.png'}: not a readable image (not in a picture format Pillow knows)"]


def test_pictures_through_pipes_are_read_when_named_and_left_alone_in_folders(mlp_run, real_dataset, tmp_path):
    # `fashionjax predict RUN <(curl -s URL)` names a pipe, which cannot seek; a pipe inside a folder is
    # passed over, since reading one that nobody writes would block for ever
    picture = io.BytesIO()
    Image.fromarray(real_dataset.test.images_u8[0]).save(picture, "PNG")
    folder = tmp_path / "folder"
    folder.mkdir()
    Image.fromarray(real_dataset.test.images_u8[1]).save(folder / "file.png")
    os.mkfifo(folder / "nobody-writes")
    bash = f"{sys.executable} -m fashionjax predict {mlp_run} <(cat) {folder} --json"
    done = subprocess.run(["bash", "-c", bash], input=picture.getvalue(), capture_output=True, timeout=120)
    document = json.loads(done.stdout)
    assert done.returncode == 0 and document["failures"] == [], done.stderr
    assert [Path(p["path"]).name for p in document["predictions"]][1:] == ["file.png"]
    assert document["predictions"][0]["path"].startswith("/dev/fd/")

    garbage = subprocess.run(["bash", "-c", f"{sys.executable} -m fashionjax predict {mlp_run} /dev/stdin"],
                             input=b"not a picture", capture_output=True, timeout=120)
    assert garbage.returncode == 1 and garbage.stderr.decode().strip().splitlines() == [
        "fashionjax predict: /dev/stdin: not a readable image (not in a picture format Pillow knows)"]


@pytest.mark.parametrize("argv, fragment", [
    (["{run}", "{missing}"], "no such file or folder"),
    (["{run}", "{empty}"], "no files in this folder"),
    (["{run}", "{empty}", "--top-k", "11"], "--top-k must be between 1 and 10"),
    (["{empty}", "{empty}"], "not a run directory"),
])
def test_predict_usage_faults_exit_2(mlp_run, tmp_path, capsys, argv, fragment):
    (tmp_path / "empty").mkdir()
    names = {"run": mlp_run, "missing": tmp_path / "nope.png", "empty": tmp_path / "empty"}
    code, document = call(capsys, "predict", *[arg.format(**names) for arg in argv])
    assert code == 2 and fragment in document["error"]["message"]


# ---------------------------------------------------------------- export


def test_export_all_formats_round_trip_on_the_full_test_set(mlp_run, in_memory, real_dataset, tmp_path, capsys):
    code, document = call(capsys, "export", str(mlp_run), "--format", "all", "--out", str(tmp_path))
    assert code == 0
    onnx_check, hlo_check = document["artifacts"]["onnx"], document["artifacts"]["stablehlo"]
    assert onnx_check["examples"] == hlo_check["examples"] == 10000
    assert onnx_check["differing_labels"] == 0 and onnx_check["max_abs_logit_difference"] < 1e-3
    images = real_dataset.test.images_u8.astype(np.float32) / 255
    # ONNX, through onnxruntime: every test image labelled as JAX labels it; the summary's accuracy
    onnx_labels = export.onnx_callable(tmp_path / "model.onnx")(images).argmax(-1)
    assert np.array_equal(onnx_labels, in_memory)
    summary = artifacts.read_json(mlp_run / "summary.json")
    assert np.mean(onnx_labels == real_dataset.test.labels) == summary["test_accuracy"]
    import onnx

    model = onnx.load(tmp_path / "model.onnx")
    props = {p.key: p.value for p in model.metadata_props}
    assert json.loads(props["class_names"]) == list(CLASS_NAMES) and props["model"] == "mlp"
    assert model.graph.input[0].name == "images" and model.graph.output[0].name == "logits"
    assert not model.graph.input[0].type.tensor_type.shape.dim[0].HasField("dim_value")  # a dynamic batch
    # StableHLO: loads and predicts any batch size
    logits = np.asarray(export.load(tmp_path / "model.stablehlo")(images[:7]))
    assert logits.shape == (7, 10) and np.array_equal(logits.argmax(-1), in_memory[:7])
    # safetensors: the very same parameters, and what they are in the metadata
    trained = run_lib.load_trained(mlp_run)
    loaded = export.load_safetensors(tmp_path / "model.safetensors")
    assert jax.tree_util.tree_structure(loaded) == jax.tree_util.tree_structure(trained.params)
    assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(loaded), jax.tree.leaves(trained.params),
                                                    strict=True))
    from safetensors import safe_open

    with safe_open(tmp_path / "model.safetensors", "np") as handle:
        meta = handle.metadata()
    assert meta["params_digest"] == summary["params_digest"] and meta["model"] == "mlp"
    assert artifacts.read_json(tmp_path / "export.json")["params_digest"] == summary["params_digest"]
    assert not any(name.split(".")[0] == "tensorflow" for name in sys.modules)


@pytest.mark.slow
@pytest.mark.parametrize("seeds", [1, 2])
def test_onnx_export_round_trips_for_the_speedrun_model(tmp_path, capsys, monkeypatch, seeds):
    # its convolutions, pooling, batch norm and TTA with shifted views (a scan over them); the cnn's layers
    # are a subset of these. The graph is the same whatever the data, so 100 synthetic test images keep
    # export's own check short. Two seeds are one ensemble, both members inside one graph: what that
    # case checks does not depend on the widths, so it exports the quarter-width net to save time.
    dataset = synthetic_dataset(num_train=1024, num_test=100)
    monkeypatch.setattr(data, "load", lambda *a, **k: dataset)
    monkeypatch.setattr(export, "VERIFY_BATCH", 100)
    if seeds > 1:
        monkeypatch.setitem(models.REGISTRY, "speedrun", SMALL_SPEEDRUN.model("speedrun"))
    train_run(tmp_path / "run", "--model", "speedrun", "--steps", "30", "--log-every", "30", "--tta-shift", "1",
              "--seeds", str(seeds))
    capsys.readouterr()  # the training's own summary table
    code, document = call(capsys, "export", str(tmp_path / "run"), "--format", "onnx", "--out", str(tmp_path / "x"))
    check = document["artifacts"]["onnx"]
    test = dataset.test
    assert code == 0 and check["examples"] == len(test.labels) == 100
    assert check["differing_labels"] == check["ties"] == 0
    # export's check ran every test image through onnxruntime against JAX; here the file is read
    # back from outside and must label some of them, written as files, as predict (JAX, with TTA) does
    picked = [0, 1, 2, 3, 4, 5]
    for index in picked:
        Image.fromarray(test.images_u8[index]).save(tmp_path / f"{index:05d}.png")
    code, document = call(capsys, "predict", str(tmp_path / "run"), *[str(tmp_path / f"{i:05d}.png") for i in picked])
    assert code == 0 and len(document["predictions"]) == len(picked)
    onnx_labels = export.onnx_callable(tmp_path / "x" / "model.onnx")(
        test.images_u8[picked].astype(np.float32) / 255).argmax(-1)
    assert onnx_labels.tolist() == [prediction["label"] for prediction in document["predictions"]]
    import onnx  # and it holds no constant that nothing reads (onnxruntime warns of each on every load)

    graphs, read, initializers, visited = [onnx.load(tmp_path / "x" / "model.onnx").graph], set(), [], 0
    while graphs:
        graph, visited = graphs.pop(), visited + 1
        initializers += [initializer.name for initializer in graph.initializer]
        for node in graph.node:
            read.update(node.input)
            graphs += [attribute.g for attribute in node.attribute if attribute.type == onnx.AttributeProto.GRAPH]
    assert visited > 1 and initializers and set(initializers) <= read  # the TTA scan's loop body was read too


def test_unused_initializers_are_dropped_from_a_graph_and_the_graphs_nested_in_it():
    import onnx
    from onnx import TensorProto, helper

    def constant(name):
        return helper.make_tensor(name, TensorProto.FLOAT, [1], [1.0])

    body = helper.make_graph(  # reads its own "step" and the outer graph's "outer"
        [helper.make_node("Add", ["x_in", "step"], ["sum"]), helper.make_node("Add", ["sum", "outer"], ["x_out"]),
         helper.make_node("Identity", ["cond_in"], ["cond_out"])], "body",
        [helper.make_tensor_value_info(n, t, s) for n, t, s in
         [("i", TensorProto.INT64, []), ("cond_in", TensorProto.BOOL, []), ("x_in", TensorProto.FLOAT, [1])]],
        [helper.make_tensor_value_info(n, t, s) for n, t, s in
         [("cond_out", TensorProto.BOOL, []), ("x_out", TensorProto.FLOAT, [1])]],
        initializer=[constant("step"), constant("body_unused")])
    graph = helper.make_graph(
        [helper.make_node("Add", ["x", "bias"], ["start"]),
         helper.make_node("Loop", ["trips", "", "start"], ["y"], body=body)], "main",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])],
        initializer=[constant("bias"), constant("outer"), constant("unused"),
                     helper.make_tensor("trips", TensorProto.INT64, [], [3])])
    export.drop_unused_initializers(graph)
    assert [i.name for i in graph.initializer] == ["bias", "outer", "trips"]
    assert [i.name for i in graph.node[1].attribute[0].g.initializer] == ["step"]
    onnx.checker.check_model(helper.make_model(graph), full_check=True)


def test_an_output_file_flag_naming_a_folder_is_refused_before_any_work(mlp_run, tmp_path, capsys, monkeypatch):
    folder = tmp_path / "a folder"
    folder.mkdir()
    picture = tmp_path / "picture.png"
    Image.fromarray(np.zeros((28, 28), np.uint8)).save(picture)
    monkeypatch.setattr(run_lib, "load_trained", None)  # refused before the model loads
    for argv in (["predict", str(mlp_run), str(picture), "--save-preprocessed", str(folder)],
                 ["report", str(mlp_run), "--out", str(folder)]):
        code, document = call(capsys, *argv)
        assert code == 1 and document["error"]["message"].endswith(f"{folder}: is a directory; name a file to write")
    assert list(folder.iterdir()) == [] and sorted(p.name for p in tmp_path.iterdir()) == ["a folder", "picture.png"]
    monkeypatch.undo()
    code, document = call(capsys, "report", str(mlp_run), "--out", str(tmp_path / "new" / "page.html"))
    assert code == 0 and (tmp_path / "new" / "page.html").stat().st_size > 1000  # its folder made, as --out's are


def test_two_exports_into_one_folder_at_once_the_second_is_refused(mlp_run, tmp_path):
    # a user exporting two runs into one --out at once would get one run's model beside the other's
    # export.json; the second is refused while the first writes, and the folder is free again after it
    out = tmp_path / "x"
    command = [sys.executable, "-m", "fashionjax", "export", str(mlp_run), "--format", "safetensors", "--out", str(out),
               "--offline", "--json"]
    first = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_for(lambda: (out / rundir.LOCK).is_file() and (out / rundir.LOCK).read_text().strip(), first)
        first.send_signal(signal.SIGSTOP)  # held inside its writes for as long as the second needs
        second = subprocess.run(command, capture_output=True, text=True, timeout=120)
        error = json.loads(second.stdout)["error"]
        assert second.returncode == 1 and error["kind"] == "busy"
        assert error["message"] == (f"fashionjax export: {out}: in use by an export (pid {first.pid}); "
                                    "wait for it to finish or choose another --out")
    finally:
        first.send_signal(signal.SIGCONT)
    out_text, err = first.communicate(timeout=120)
    assert first.returncode == 0, err
    assert artifacts.read_json(out / "export.json")["params_digest"] == json.loads(out_text)["params_digest"]
    assert sorted(p.name for p in out.iterdir()) == ["export.json", "model.safetensors"]  # no lock file left
    again = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert again.returncode == 0, again.stderr


def test_an_export_cut_short_leaves_no_export_json_of_an_earlier_one(mlp_run, real_dataset, tmp_path, monkeypatch):
    trained = run_lib.load_trained(mlp_run)
    export.export(trained, ("safetensors",), tmp_path, real_dataset.test.images_u8[:100], CLASS_NAMES)
    assert (tmp_path / "export.json").is_file()

    def cut(*args):
        raise KeyboardInterrupt  # the user's Ctrl-C between two formats

    monkeypatch.setattr(export, "stablehlo_bytes", cut)
    with pytest.raises(KeyboardInterrupt):
        export.export(trained, ("safetensors", "stablehlo"), tmp_path, real_dataset.test.images_u8[:100], CLASS_NAMES)
    assert not (tmp_path / "export.json").exists() and (tmp_path / "model.safetensors").is_file()


def test_export_names_the_extra_when_a_converter_is_missing(mlp_run, tmp_path, capsys, monkeypatch):
    real_find = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "jax2onnx" else
                        real_find(name, *a))
    code, document = call(capsys, "export", str(mlp_run), "--format", "onnx", "--out", str(tmp_path / "x"))
    assert code == 1 and document["error"]["kind"] == "missing_extra"
    assert "pip install 'fashionjax[export]'" in document["error"]["message"] and not (tmp_path / "x").exists()
    code, document = call(capsys, "export", str(mlp_run), "--format", "pdf", "--out", str(tmp_path / "x"))
    assert code == 2 and "--format must be one of" in document["error"]["message"]


def test_export_compare_counts_ties_apart():
    reference = np.array([[1.0, 3.0], [2.0, 2.0 + 1e-6], [5.0, 1.0]], np.float32)
    theirs = np.array([[1.0, 3.0], [2.0 + 1e-6, 2.0], [1.0, 5.0]], np.float32)
    check = export.compare(reference, theirs)
    assert (check["differing_labels"], check["ties"]) == (2, 1) and check["max_abs_logit_difference"] == 4.0


# ---------------------------------------------------------------- TensorBoard


def read_events(run_dir) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run_dir / tensorboard.DIRECTORY))
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


def assert_events_mirror_the_run(run_dir) -> None:
    scalars = read_events(run_dir)
    records = artifacts.read_jsonl(run_dir / "metrics.jsonl")
    for name in tensorboard.SCALARS:
        assert scalars[f"train/{name}"] == [(r["step"], float(np.float32(r[name]))) for r in records], name
    summary = artifacts.read_json(run_dir / "summary.json")
    for tag, key in tensorboard.FINAL.items():
        assert scalars[tag] == [(summary["steps"], float(np.float32(summary[key])))], tag


def test_tensorboard_scalars_equal_metrics_jsonl_also_after_a_resume(synthetic_cli, tmp_path, monkeypatch):
    from tensorboardX import event_file_writer

    # tensorboardX names an event file by the second it opens: every writer here opens in one second,
    # as the training's and the final one do on a short run, and none may overwrite another
    monkeypatch.setattr(event_file_writer, "time", types.SimpleNamespace(time=lambda: 1_764_720_000.25))
    run_dir = tmp_path / "run"
    train_run(run_dir, "--steps", "30", "--log-every", "10", "--batch-size", "64", "--schedule", "constant", "--tensorboard")
    assert_events_mirror_the_run(run_dir)
    records = artifacts.read_jsonl(run_dir / "metrics.jsonl")
    assert [r["step"] for r in records] == [10, 20, 30] and {r["lr"] for r in records} == {3e-3}
    assert cli.main(["train", "--quiet", "--resume", "--run-dir", str(run_dir), "--steps", "50"]) == 0
    assert_events_mirror_the_run(run_dir)  # no log point twice; the final metrics are the new run's
    assert [s for s, _ in read_events(run_dir)["train/loss"]] == [10, 20, 30, 40, 50]


def test_tensorboard_without_its_extra_is_refused_before_anything_is_written(synthetic_cli, tmp_path, capsys,
                                                                              monkeypatch):
    monkeypatch.setattr(environment, "require_extra", _refuse)
    code, document = call(capsys, "train", "--steps", "5", "--run-dir", str(tmp_path / "run"), "--tensorboard")
    assert code == 1 and "pip install 'fashionjax[tb]'" in document["error"]["message"]
    assert not (tmp_path / "run").exists()


def _refuse(extra, modules, feature):
    raise environment.MissingExtra(f"{feature} needs {modules[0]}: install it with pip install 'fashionjax[{extra}]'")
