"""The data layer: strict parsing, verification, every bad-input case, source order, the cache."""

from __future__ import annotations

import gzip
import http.server
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
from conftest import idx_images, idx_labels, write_synthetic_files

from fashionjax import data

TRAIN_IMAGES = "train-images-idx3-ubyte.gz"
TRAIN_LABELS = "train-labels-idx1-ubyte.gz"


def decoded_dirs(cache: Path) -> list[Path]:
    root = cache / "fashionjax" / "decoded"
    return list(root.iterdir()) if root.exists() else []


def test_load_explicit_dir_parses_and_verifies(synthetic_files):
    directory, spec = synthetic_files
    dataset = data.load(directory, spec=spec)
    assert dataset.train.images_u8.shape == (64, 28, 28) and dataset.train.images_u8.dtype == np.uint8
    assert dataset.train.labels.dtype == np.int32 and dataset.test.labels.shape == (32,)
    assert dataset.source["kind"] == "explicit"
    assert {f["verified_by"] for f in dataset.source["files"]} == {"gzip md5 (upstream file)"}
    assert all(len(f["sha256"]) == 64 for f in dataset.source["files"])


def test_recompressed_file_is_verified_by_content(synthetic_files):
    directory, spec = synthetic_files
    path = directory / TRAIN_LABELS
    path.write_bytes(gzip.compress(gzip.decompress(path.read_bytes()), compresslevel=1, mtime=12345))
    dataset = data.load(directory, spec=spec)
    record = next(f for f in dataset.source["files"] if f["file"].endswith(TRAIN_LABELS))
    assert record["verified_by"] == "decompressed md5 (recompressed copy)"


def corrupt(directory: Path, name: str, blob: bytes) -> None:
    (directory / name).write_bytes(blob)


def _images_blob(n=64):
    return gzip.compress(idx_images(np.zeros((n, 28, 28), np.uint8)))


BAD_CASES = {
    "truncated": (TRAIN_IMAGES, lambda d: (d / TRAIN_IMAGES).read_bytes()[:200], "truncated gzip data"),
    "empty": (TRAIN_IMAGES, lambda d: b"", "file is empty"),
    "checksum": (TRAIN_IMAGES, lambda d: _images_blob(), "checksum mismatch"),
    "magic": (TRAIN_IMAGES, lambda d: gzip.compress(b"\x00\x00\x09\x99" + b"\x00" * 12), "wrong magic number"),
    "html": (TRAIN_IMAGES, lambda d: b"<!DOCTYPE html><html><body>Not Found</body></html>", "looks like an HTML page"),
    "swapped": (TRAIN_LABELS, lambda d: (d / TRAIN_IMAGES).read_bytes(), "are the images and labels files swapped"),
    "short payload": (TRAIN_IMAGES, lambda d: gzip.compress(idx_images(np.zeros((64, 28, 28), np.uint8))[:-5]),
                      "header promises 50176 bytes"),
    "count mismatch": (TRAIN_LABELS, lambda d: gzip.compress(idx_labels(np.zeros(63, np.int32))), None),
    "label range": (TRAIN_LABELS, lambda d: gzip.compress(idx_labels(np.full(64, 10, np.int32))), "outside 0..9"),
}


@pytest.mark.parametrize("case", sorted(BAD_CASES))
def test_bad_file_is_a_one_line_error_and_nothing_is_cached(case, tmp_path, private_cache):
    directory = tmp_path / "bad"
    spec = write_synthetic_files(directory)
    name, make_blob, message = BAD_CASES[case]
    corrupt(directory, name, make_blob(directory))
    with pytest.raises(data.DataError) as info:
        data.load(directory, spec=spec)
    text = str(info.value)
    assert "\n" not in text and text.startswith(str(directory / name))  # the whole path: which copy is bad
    if message is None:  # a count mismatch is caught by the checksum before the counts are compared
        assert "checksum mismatch" in text
    else:
        assert message in text
    assert decoded_dirs(private_cache) == []


def test_count_mismatch_is_named_when_checksums_agree(tmp_path):
    directory = tmp_path / "mismatch"
    spec = write_synthetic_files(directory)
    labels_blob = gzip.compress(idx_labels(np.zeros(63, np.int32)))
    (directory / TRAIN_LABELS).write_bytes(labels_blob)
    import hashlib

    train_images, train_labels = spec.files["train"]
    forged = data.FileSpec(train_labels.name, "labels", hashlib.md5(labels_blob).hexdigest(), "x")
    spec = data.DatasetSpec(files={"train": (train_images, forged), "test": spec.files["test"]})
    with pytest.raises(data.DataError, match="63 labels for 64 images"):
        data.load(directory, spec=spec)


def test_missing_explicit_dir_is_an_error_not_a_fallback(tmp_path, synthetic_files):
    _, spec = synthetic_files
    with pytest.raises(data.DataError, match="file not found"):
        data.load(tmp_path / "nowhere", spec=spec)


def test_parsing_is_strict_under_python_O(tmp_path):
    directory = tmp_path / "opt"
    write_synthetic_files(directory)
    corrupt(directory, TRAIN_LABELS, (directory / TRAIN_IMAGES).read_bytes())
    code = (
        "import sys; sys.path.insert(0, 'tests'); from conftest import write_synthetic_files\n"
        "from pathlib import Path; from fashionjax import data\n"
        f"spec = write_synthetic_files(Path({str(tmp_path / 'fresh')!r}))\n"
        f"data.load({str(directory)!r}, spec=spec)\n"
    )
    result = subprocess.run([sys.executable, "-O", "-c", code], capture_output=True, text=True, timeout=60,
                            cwd=Path(__file__).resolve().parents[1])
    assert result.returncode != 0 and "DataError" in result.stderr and "swapped" in result.stderr


def with_dirs(spec: data.DatasetSpec, system_dir=None, mirrors=()) -> data.DatasetSpec:
    return data.DatasetSpec(files=spec.files, mirrors=mirrors, system_dir=system_dir, cache_name=spec.cache_name)


def test_source_order_cache_then_system(tmp_path, private_cache):
    system = tmp_path / "system"
    spec = with_dirs(write_synthetic_files(system), system_dir=system)
    first = data.load(spec=spec, offline=True)
    assert first.source["kind"] == "system"
    second = data.load(spec=spec, offline=True)
    assert "decoded_cache" in second.source  # the decoded-array shortcut
    np.testing.assert_array_equal(first.train.images_u8, second.train.images_u8)
    # A user-cache copy of the raw files wins over the system copy once the decoded cache is gone.
    for path in decoded_dirs(private_cache):
        for f in path.iterdir():
            f.unlink()
    write_synthetic_files(private_cache / "fashionjax" / "synthetic")
    assert data.load(spec=spec, offline=True).source["kind"] == "cache"


def test_bad_cached_copy_is_skipped_not_used(tmp_path, private_cache):
    system = tmp_path / "system"
    spec = with_dirs(write_synthetic_files(system), system_dir=system)
    cache_copy = private_cache / "fashionjax" / "synthetic"
    write_synthetic_files(cache_copy)
    (cache_copy / TRAIN_IMAGES).write_bytes(b"")
    notes = []
    dataset = data.load(spec=spec, offline=True, log=notes.append)
    assert dataset.source["kind"] == "system"
    assert any("skipping cache copy" in n and "file is empty" in n for n in notes)


def test_tampered_decoded_cache_is_ignored(tmp_path, private_cache):
    system = tmp_path / "system"
    spec = with_dirs(write_synthetic_files(system), system_dir=system)
    data.load(spec=spec, offline=True)
    (cached,) = decoded_dirs(private_cache)
    blob = bytearray((cached / "train-images.npy").read_bytes())
    blob[-1] ^= 0xFF
    (cached / "train-images.npy").write_bytes(bytes(blob))
    dataset = data.load(spec=spec, offline=True)
    assert "decoded_cache" not in dataset.source and dataset.source["kind"] == "system"


def test_offline_with_no_source_says_what_to_do(tmp_path):
    spec = with_dirs(write_synthetic_files(tmp_path / "unused"), system_dir=tmp_path / "absent")
    with pytest.raises(data.DataError, match="dataset-fashion-mnist"):
        data.load(spec=spec, offline=True)


class _Server:
    """A loopback HTTP server over one directory, for real downloads in tests."""

    def __init__(self, directory: Path):
        handler = lambda *a, **k: http.server.SimpleHTTPRequestHandler(*a, directory=str(directory), **k)  # noqa: E731
        http.server.SimpleHTTPRequestHandler.log_message = lambda *a: None
        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


def test_download_falls_back_to_the_next_mirror(tmp_path, private_cache):
    good = tmp_path / "good"
    spec = write_synthetic_files(good)
    bad = tmp_path / "bad"
    bad.mkdir()
    for f in good.iterdir():  # the first mirror serves HTML error pages under the right names
        (bad / f.name).write_bytes(b"<html>rate limited</html>")
    servers = [_Server(bad), _Server(good)]
    try:
        spec = with_dirs(spec, system_dir=None, mirrors=tuple(s.url for s in servers))
        dataset = data.load(spec=spec, offline=False)
    finally:
        for s in servers:
            s.close()
    assert dataset.source["kind"] == "download"
    cached = sorted(p.name for p in (private_cache / "fashionjax" / "synthetic").iterdir())
    assert cached == sorted(f.name for f in spec.all_files())  # no temp files left behind


def test_download_failure_leaves_nothing_that_looks_valid(tmp_path, private_cache):
    bad = tmp_path / "bad"
    spec = write_synthetic_files(tmp_path / "good")
    bad.mkdir()
    server = _Server(bad)  # every file is a 404
    try:
        with pytest.raises(data.DataError, match="download failed from every mirror"):
            data.load(spec=with_dirs(spec, mirrors=(server.url,)), offline=False)
    finally:
        server.close()
    target = private_cache / "fashionjax" / "synthetic"
    assert not target.exists() or list(target.iterdir()) == []
    assert decoded_dirs(private_cache) == []


def test_real_data_is_fashion_mnist(real_dataset):
    summary = data.summarize(real_dataset)
    assert summary["splits"]["train"] == {"images": 60000, "shape": [28, 28], "labels": 60000,
                                          "class_counts": [6000] * 10}
    assert summary["splits"]["test"]["class_counts"] == [1000] * 10
    assert summary["class_names"][9] == "Ankle boot"
