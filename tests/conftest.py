"""Shared fixtures: a private cache dir, synthetic IDX files and datasets, and the real data."""

from __future__ import annotations

import gzip
import hashlib
import os
import struct
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from fashionjax import data, models

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def private_cache(tmp_path_factory, monkeypatch):
    """Every test gets its own user cache, so nothing leaks between tests or into ~/.cache."""
    cache = tmp_path_factory.mktemp("cache")
    monkeypatch.setenv("XDG_CACHE_HOME", str(cache))
    monkeypatch.delenv("FASHIONJAX_DATA_DIR", raising=False)
    monkeypatch.delenv("FASHIONJAX_OFFLINE", raising=False)
    return cache


def idx_images(images_u8: np.ndarray) -> bytes:
    n, rows, cols = images_u8.shape
    return struct.pack(">IIII", data.IMAGES_MAGIC, n, rows, cols) + images_u8.tobytes()


def idx_labels(labels: np.ndarray) -> bytes:
    return struct.pack(">II", data.LABELS_MAGIC, len(labels)) + labels.astype(np.uint8).tobytes()


def learnable_split(num: int, seed: int) -> data.Split:
    """Images whose brightest row band says the label, plus noise: learnable in a few steps."""
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, 10, size=num).astype(np.int32)
    images = rng.integers(0, 60, size=(num, 28, 28)).astype(np.uint8)
    for i, label in enumerate(labels):
        images[i, 2 * label + 4: 2 * label + 7, :] = 230
    return data.Split(images, labels)


def synthetic_dataset(num_train: int = 1024, num_test: int = 300) -> data.Dataset:
    return data.Dataset(learnable_split(num_train, 0), learnable_split(num_test, 1), {"kind": "synthetic"})


def write_synthetic_files(directory: Path, num_train: int = 64, num_test: int = 32) -> data.DatasetSpec:
    """Write four small .gz IDX files and return a spec whose digests match them."""
    directory.mkdir(parents=True, exist_ok=True)
    dataset = synthetic_dataset(num_train, num_test)
    files = {}
    for split, names in data.FASHION_MNIST.files.items():
        part = getattr(dataset, split)
        specs = []
        for spec, raw in zip(names, (idx_images(part.images_u8), idx_labels(part.labels)), strict=True):
            blob = gzip.compress(raw, mtime=0)
            (directory / spec.name).write_bytes(blob)
            specs.append(data.FileSpec(spec.name, spec.kind, hashlib.md5(blob).hexdigest(),
                                       hashlib.md5(raw).hexdigest()))
        files[split] = tuple(specs)
    return data.DatasetSpec(files=files, mirrors=(), system_dir=None, cache_name="synthetic")


@pytest.fixture
def synthetic_files(tmp_path):
    directory = tmp_path / "fashion"
    return directory, write_synthetic_files(directory)


@pytest.fixture
def small_dataset():
    return synthetic_dataset()


@pytest.fixture
def synthetic_cli(monkeypatch):
    """Make the CLI load the small learnable synthetic dataset instead of Fashion-MNIST."""
    dataset = synthetic_dataset(num_train=1024, num_test=500)
    monkeypatch.setattr(data, "load", lambda *a, **k: dataset)
    return dataset


# The speedrun network with every layer it has, at a quarter of its widths: for tests that drive it
# through the trainer (batch norm, whitening, its planar first layer, members, devices), where the
# full widths only add compile and evaluation time. The registry's own entry keeps its own tests.
SMALL_SPEEDRUN = models.ConvNet(filters=(9, 16, 16, 32), pools=(False, True, True), hidden=64)


@pytest.fixture
def small_speedrun(monkeypatch):
    """SMALL_SPEEDRUN registered as `speedrun` in this process."""
    monkeypatch.setitem(models.REGISTRY, "speedrun", SMALL_SPEEDRUN.model("speedrun"))


def small_speedrun_cli() -> list[str]:
    """The command line of `fashionjax` (arguments follow) with SMALL_SPEEDRUN registered as `speedrun`."""
    return [sys.executable, "-c", "import sys; from fashionjax import cli, models; "
            f"models.REGISTRY['speedrun'] = models.{SMALL_SPEEDRUN!r}.model('speedrun'); cli.run()"]


@pytest.fixture(scope="session")
def real_dataset():
    if not data.SYSTEM_DIR.is_dir() and not os.environ.get("FASHIONJAX_DATA_DIR"):
        pytest.skip("no Fashion-MNIST source here: install Debian's dataset-fashion-mnist (CI does)")
    return data.load(offline=True)


def synthetic_run(tmp_path_factory, name: str, *train_args: str, num_test: int = 300) -> Path:
    """A finished training run on the small synthetic dataset, made through the real CLI, for
    module-scoped fixtures that many read-only tests share."""
    from fashionjax import cli

    directory = tmp_path_factory.mktemp(name) / "run"
    dataset = synthetic_dataset(num_train=1024, num_test=num_test)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("XDG_CACHE_HOME", str(tmp_path_factory.mktemp("cache")))
        patch.setattr(data, "load", lambda *a, **k: dataset)
        assert cli.main(["train", "--batch-size", "64", "--quiet", "--run-dir", str(directory), *train_args]) == 0
    return directory


def wait_for(predicate, process: subprocess.Popen, timeout: float = 120, poll: float = 0.002) -> None:
    """Poll predicate() while `process` runs; fail naming its stderr if it ends first, or on timeout."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if process.poll() is not None:
            raise AssertionError(f"process ended first: {(process.communicate()[1] or '')[-2000:]}")
        if time.monotonic() > deadline:
            process.kill()
            raise AssertionError("timed out waiting")
        time.sleep(poll)


def file_size_limited(command: list[str], kilobytes: int) -> list[str]:
    """`command` under ulimit -f, set in a shell that then becomes it (no fork of the threaded test
    process). Python ignores SIGXFSZ, so a write past the limit fails with EFBIG, as on a full disk."""
    return ["bash", "-c", f'ulimit -f {kilobytes} && exec "$@"', "bash", *command]
