"""Fashion-MNIST on the host: sources, verification, strict IDX parsing and a decoded cache.

This module never imports JAX: it hands verified uint8/int32 NumPy arrays to whoever asks.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import os
import struct
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from fashionjax import artifacts

CLASS_NAMES = (
    "T-shirt/top",
    "Trouser",
    "Pullover",
    "Dress",
    "Coat",
    "Sandal",
    "Shirt",
    "Sneaker",
    "Bag",
    "Ankle boot",
)
NUM_CLASSES = len(CLASS_NAMES)
IMAGES_MAGIC = 2051  # IDX: unsigned bytes, 3 dimensions
LABELS_MAGIC = 2049  # IDX: unsigned bytes, 1 dimension
IMAGE_SHAPE = (28, 28)
SYSTEM_DIR = Path("/usr/share/datasets/fashion-mnist")  # Debian's dataset-fashion-mnist


class DataError(Exception):
    """Data that cannot be used; the message names the file and the fault in one line."""


@dataclass(frozen=True)
class FileSpec:
    """One published file: its name, what it holds, and its published digests."""

    name: str
    kind: str  # "images" or "labels"
    gz_md5: str  # MD5 of the upstream .gz bytes
    raw_md5: str  # MD5 of the decompressed bytes (survives recompression, as Debian's does)


@dataclass(frozen=True)
class DatasetSpec:
    """Where a dataset comes from and how to recognise it."""

    files: dict[str, tuple[FileSpec, FileSpec]]  # split -> (images, labels)
    mirrors: tuple[str, ...] = ()
    system_dir: Path | None = None
    cache_name: str = "fashion-mnist"

    def all_files(self) -> list[FileSpec]:
        return [f for pair in self.files.values() for f in pair]


FASHION_MNIST = DatasetSpec(
    files={
        "train": (
            FileSpec("train-images-idx3-ubyte.gz", "images",
                     "8d4fb7e6c68d591d4c3dfef9ec88bf0d", "f4a8712d7a061bf5bd6d2ca38dc4d50a"),
            FileSpec("train-labels-idx1-ubyte.gz", "labels",
                     "25c81989df183df01b3e8a0aad5dffbe", "9018921c3c673c538a1fc5bad174d6f9"),
        ),
        "test": (
            FileSpec("t10k-images-idx3-ubyte.gz", "images",
                     "bef4ecab320f06d8554ea6380940ec79", "8181f5470baa50b63fa0f6fddb340f0a"),
            FileSpec("t10k-labels-idx1-ubyte.gz", "labels",
                     "bb300cfdad3c16e7a12a480ee83cd310", "15d484375f8d13e6eb1aabb0c3f46965"),
        ),
    },
    mirrors=(
        "https://github.com/zalandoresearch/fashion-mnist/raw/master/data/fashion/",
        "http://fashion-mnist.s3-website.eu-central-1.amazonaws.com/",
    ),
    system_dir=SYSTEM_DIR,
)


@dataclass(frozen=True)
class Split:
    images_u8: np.ndarray  # (N, 28, 28) uint8
    labels: np.ndarray  # (N,) int32


@dataclass(frozen=True)
class Dataset:
    """Verified arrays plus a record of where they came from."""

    train: Split
    test: Split
    source: dict = field(default_factory=dict)
    class_names: tuple[str, ...] = CLASS_NAMES


# ---------------------------------------------------------------- parsing


def parse_idx(raw: bytes, spec: FileSpec, name: str) -> np.ndarray:
    """Parse decompressed IDX bytes strictly; raise DataError naming the file (`name`) and the fault."""
    if len(raw) < 8:
        raise DataError(f"{name}: too short for an IDX header ({len(raw)} bytes)")
    (magic,) = struct.unpack(">I", raw[:4])
    expected_magic = IMAGES_MAGIC if spec.kind == "images" else LABELS_MAGIC
    if magic != expected_magic:
        if magic in (IMAGES_MAGIC, LABELS_MAGIC):
            found = "images" if magic == IMAGES_MAGIC else "labels"
            raise DataError(f"{name}: holds {found}, not {spec.kind} (are the images and labels files swapped?)")
        raise DataError(f"{name}: wrong magic number {magic:#010x}, expected {expected_magic:#010x}")
    ndim = 3 if spec.kind == "images" else 1
    header_size = 4 + 4 * ndim
    if len(raw) < header_size:
        raise DataError(f"{name}: truncated IDX header")
    dims = struct.unpack(f">{ndim}I", raw[4:header_size])
    expected_bytes = int(np.prod(dims, dtype=np.int64))
    payload = len(raw) - header_size
    if payload != expected_bytes:
        raise DataError(f"{name}: header promises {expected_bytes} bytes of data for shape {dims}, file has {payload}")
    array = np.frombuffer(raw, dtype=np.uint8, offset=header_size).reshape(dims)
    if spec.kind == "labels":
        if array.size and int(array.max()) >= NUM_CLASSES:
            raise DataError(f"{name}: label {int(array.max())} is outside 0..{NUM_CLASSES - 1}")
        return array.astype(np.int32)
    return array


def read_gz(path: Path, spec: FileSpec) -> tuple[bytes, dict]:
    """Read, decompress and identify one file; returns the raw bytes and its verification record.
    Faults name the whole path: the same name sits in the cache, Debian's directory and --data-dir."""
    try:
        blob = path.read_bytes()
    except OSError as err:
        raise DataError(f"{path}: cannot read ({err.strerror})") from err
    if not blob:
        raise DataError(f"{path}: file is empty")
    if blob[:2] != b"\x1f\x8b":
        head = blob[:64].lstrip().lower()
        hint = " (looks like an HTML page, not gzip data)" if head.startswith((b"<!doctype", b"<html")) else ""
        raise DataError(f"{path}: not a gzip file{hint}")
    try:
        raw = gzip.decompress(blob)
    except EOFError as err:
        raise DataError(f"{path}: truncated gzip data ({len(blob)} bytes)") from err
    except (OSError, zlib.error) as err:
        raise DataError(f"{path}: corrupt gzip data ({err})") from err
    record = {
        "file": str(path),
        "gz_md5": hashlib.md5(blob).hexdigest(),
        "raw_md5": hashlib.md5(raw).hexdigest(),
        "sha256": hashlib.sha256(blob).hexdigest(),
    }
    return raw, record


def verify_file(path: Path, spec: FileSpec) -> tuple[np.ndarray, dict]:
    """Decompress, parse and checksum one file; returns its array and how it was verified."""
    raw, record = read_gz(path, spec)
    array = parse_idx(raw, spec, str(path))
    if record["gz_md5"] == spec.gz_md5:
        record["verified_by"] = "gzip md5 (upstream file)"
    elif record["raw_md5"] == spec.raw_md5:
        record["verified_by"] = "decompressed md5 (recompressed copy)"
    else:
        raise DataError(
            f"{path}: checksum mismatch (md5 of content {record['raw_md5']}, expected {spec.raw_md5})"
        )
    return array, record


def load_dir(directory: Path, spec: DatasetSpec) -> Dataset:
    """Load and verify every file of `spec` from one directory."""
    splits, files = {}, []
    for split, (images_spec, labels_spec) in spec.files.items():
        arrays = []
        for file_spec in (images_spec, labels_spec):
            path = directory / file_spec.name
            if not path.exists():
                raise DataError(f"{path}: file not found")
            array, record = verify_file(path, file_spec)
            arrays.append(array)
            files.append(record)
        images_u8, labels = arrays
        if len(images_u8) != len(labels):
            raise DataError(
                f"{directory / labels_spec.name}: {len(labels)} labels for {len(images_u8)} images in "
                f"{images_spec.name}"
            )
        splits[split] = Split(images_u8, labels)
    return Dataset(splits["train"], splits["test"], {"path": str(directory), "files": files})


# ---------------------------------------------------------------- decoded cache


def _fingerprint(spec: DatasetSpec) -> str:
    digests = "".join(f.raw_md5 for f in spec.all_files())
    return hashlib.sha256(digests.encode()).hexdigest()[:16]


def _save_decoded(dataset: Dataset, directory: Path, spec: DatasetSpec) -> None:
    """Write the decoded arrays as .npy with SHA-256 digests in a manifest (written last)."""
    directory.mkdir(parents=True, exist_ok=True)
    digests = {}
    for split in spec.files:
        part = getattr(dataset, split)
        for kind, array in (("images", part.images_u8), ("labels", part.labels)):
            buffer = io.BytesIO()
            np.save(buffer, array, allow_pickle=False)
            blob = buffer.getvalue()
            artifacts.atomic_write_bytes(directory / f"{split}-{kind}.npy", blob)
            digests[f"{split}-{kind}"] = hashlib.sha256(blob).hexdigest()
    manifest = {"fingerprint": _fingerprint(spec), "digests": digests, "source": dataset.source}
    artifacts.atomic_write_json(directory / "manifest.json", manifest)


def _load_decoded(directory: Path, spec: DatasetSpec) -> tuple[Dataset | None, str | None]:
    """(the cached arrays, None) when every digest and shape checks out, else (None, why not).

    The cache is only a shortcut: whatever is wrong with it (a manifest of another shape, a missing
    or altered array), the caller rebuilds it from the verified source.
    """
    manifest_path = directory / "manifest.json"
    if not manifest_path.is_file():
        return None, None
    try:
        manifest = json.loads(manifest_path.read_text())
        if manifest.get("fingerprint") != _fingerprint(spec):
            return None, "made from other files"
        splits = {}
        for split in spec.files:
            arrays = []
            for kind in ("images", "labels"):
                blob = (directory / f"{split}-{kind}.npy").read_bytes()
                if hashlib.sha256(blob).hexdigest() != manifest["digests"][f"{split}-{kind}"]:
                    return None, f"{split}-{kind}.npy does not match its digest"
                arrays.append(np.load(io.BytesIO(blob), allow_pickle=False))
            images, labels = arrays
            if (images.dtype != np.uint8 or images.ndim != 3 or images.shape[1:] != IMAGE_SHAPE
                    or labels.ndim != 1 or len(labels) != len(images)):
                return None, f"{split} arrays have the wrong shape"
            splits[split] = Split(images, labels.astype(np.int32))
        source = dict(manifest["source"], decoded_cache=str(directory))
    except Exception as err:  # any malformed manifest or array: rebuild, never block a command
        return None, f"unreadable ({type(err).__name__})"
    return Dataset(splits["train"], splits["test"], source), None


# ---------------------------------------------------------------- sources


def cache_root() -> Path:
    """The user cache directory for fashionjax (XDG_CACHE_HOME honoured)."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "fashionjax"


def _download(spec: DatasetSpec, target: Path, log: Callable[[str], None]) -> None:
    """Fetch every missing or bad file into `target`; pooch writes to a temp file and renames."""
    import pooch  # imported lazily: only the download path needs it

    target.mkdir(parents=True, exist_ok=True)
    for file_spec in spec.all_files():
        errors = []
        for mirror in spec.mirrors:
            try:
                log(f"downloading {file_spec.name} from {mirror}")
                pooch.retrieve(
                    mirror + file_spec.name,
                    known_hash=f"md5:{file_spec.gz_md5}",
                    fname=file_spec.name,
                    path=target,
                    downloader=pooch.HTTPDownloader(timeout=60, progressbar=False),
                )
                break
            except Exception as err:  # any mirror failure: try the next one
                errors.append(f"{mirror}: {type(err).__name__}")
        else:
            raise DataError(f"{file_spec.name}: download failed from every mirror ({'; '.join(errors)})")


def load(
    data_dir: str | Path | None = None,
    offline: bool | None = None,
    spec: DatasetSpec = FASHION_MNIST,
    log: Callable[[str], None] = lambda message: None,
) -> Dataset:
    """Return verified Fashion-MNIST: explicit dir, else user cache, system copy, then download.

    Args:
      data_dir: an explicit directory (or FASHIONJAX_DATA_DIR); if its files are bad, that is an error.
      offline: never touch the network (default: FASHIONJAX_OFFLINE=1).
      log: receives one line per notable event (skipped sources, downloads).
    """
    data_dir = data_dir or os.environ.get("FASHIONJAX_DATA_DIR") or None
    if offline is None:
        offline = os.environ.get("FASHIONJAX_OFFLINE", "") not in ("", "0")
    decoded_dir = cache_root() / "decoded" / f"{spec.cache_name}-{_fingerprint(spec)}"
    if data_dir is not None:
        dataset = load_dir(Path(data_dir), spec)
        dataset.source["kind"] = "explicit"
        return dataset
    cached, fault = _load_decoded(decoded_dir, spec)
    if cached is not None:
        return cached
    if fault:
        log(f"decoded cache {decoded_dir} is {fault}: rebuilding it from the verified source")

    user_dir = cache_root() / spec.cache_name
    candidates = [("cache", user_dir)]
    if spec.system_dir is not None:
        candidates.append(("system", spec.system_dir))
    for kind, directory in candidates:
        if not directory.is_dir():
            continue
        try:
            dataset = load_dir(directory, spec)
        except DataError as err:
            log(f"skipping {kind} copy: {err}")
            continue
        dataset.source["kind"] = kind
        return _remember(dataset, decoded_dir, spec, log)

    if offline:
        raise DataError(
            f"Fashion-MNIST not found offline (looked in {user_dir} and {spec.system_dir}); "
            "install the Debian package dataset-fashion-mnist or pass --data-dir"
        )
    _download(spec, user_dir, log)
    dataset = load_dir(user_dir, spec)
    dataset.source["kind"] = "download"
    return _remember(dataset, decoded_dir, spec, log)


def _remember(dataset: Dataset, decoded_dir: Path, spec: DatasetSpec, log: Callable[[str], None]) -> Dataset:
    try:
        _save_decoded(dataset, decoded_dir, spec)
    except OSError as err:  # a read-only cache only costs speed next time
        log(f"not caching decoded arrays in {decoded_dir}: {err.strerror}")
    return dataset


def summarize(dataset: Dataset) -> dict:
    """The `fashionjax data --json` document."""
    splits = {}
    for name in ("train", "test"):
        split = getattr(dataset, name)
        splits[name] = {
            "images": int(split.images_u8.shape[0]),
            "shape": list(split.images_u8.shape[1:]),
            "labels": int(split.labels.shape[0]),
            "class_counts": np.bincount(split.labels, minlength=NUM_CLASSES).tolist(),
        }
    return {"source": dataset.source, "verified": True, "splits": splits, "class_names": list(dataset.class_names)}
