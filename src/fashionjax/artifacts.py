"""The run directory: atomic writes, JSON Lines that survive a torn tail, digests.

Every file a later command trusts is written to a temp file, fsynced, then renamed over the target,
so a crash leaves either the old file or the new one, never half of one.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import hashlib
import json
import math
import os
import tempfile
from collections.abc import Iterable
from pathlib import Path

import numpy as np

_UMASK = os.umask(0)
os.umask(_UMASK)


class ArtifactError(RuntimeError):
    """A file fashionjax reads is not what it should be; the message names the file."""


class OutputDirError(RuntimeError):
    """An output directory cannot be created or written."""


def atomic_write_bytes(path: str | Path, data: bytes) -> None:
    path = Path(path)
    try:
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    except OSError as err:
        raise _naming(err, path) from err
    try:
        os.fchmod(fd, 0o666 & ~_UMASK)  # mkstemp makes 0600 files; artifacts are for sharing
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as err:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        if isinstance(err, OSError):
            raise _naming(err, path) from err
        raise
    _fsync_dir(path.parent)


def _naming(err: OSError, path: Path) -> OSError:
    """The same fault naming the file the user asked for: a full disk or a size limit fails in write(),
    whose error names no file, and mkstemp's names a temp file the user never sees."""
    return type(err)(err.errno, err.strerror, str(path)) if err.errno else err


def atomic_write_text(path: str | Path, text: str) -> None:
    atomic_write_bytes(path, text.encode("utf-8"))


def _json_default(value):
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, Path):
        return str(value)
    raise TypeError(f"not JSON serialisable: {type(value).__name__}")


def to_json(document) -> str:
    return json.dumps(_finite(document), indent=2, sort_keys=True, default=_json_default) + "\n"


def _finite(value):
    """JSON has no NaN or Infinity: write them as null rather than produce invalid JSON."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_finite(v) for v in value]
    return value


def atomic_write_json(path: str | Path, document) -> None:
    atomic_write_text(path, to_json(document))


def read_json(path: str | Path):
    """Parse a JSON file; a malformed one is an ArtifactError naming the file and the place."""
    try:
        return json.loads(Path(path).read_text(encoding="utf-8"))
    except json.JSONDecodeError as err:
        raise ArtifactError(f"{path}: not valid JSON ({err.msg} at line {err.lineno})") from None
    except UnicodeDecodeError:
        raise ArtifactError(f"{path}: not valid JSON (not UTF-8 text)") from None


def append_jsonl(path: str | Path, records: Iterable[dict]) -> None:
    """Append records and fsync: a crash loses at most the line being written."""
    lines = "".join(json.dumps(_finite(r), sort_keys=True, default=_json_default) + "\n" for r in records)
    try:
        with open(path, "a", encoding="utf-8") as f:
            f.write(lines)
            f.flush()
            os.fsync(f.fileno())
    except OSError as err:  # a torn line is cut off by the resume that follows (truncate_jsonl)
        raise _naming(err, Path(path)) from err


def read_jsonl(path: str | Path) -> list[dict]:
    """Read JSON Lines, skipping a torn last line (a write that never finished)."""
    try:
        lines = [line for line in Path(path).read_text(encoding="utf-8", errors="replace").split("\n")
                 if line.strip()]
    except FileNotFoundError:
        return []
    records = []
    for number, line in enumerate(lines):
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            if number == len(lines) - 1:
                break  # a torn last line: the write that never finished
            raise ArtifactError(f"{path}: line {number + 1} is not valid JSON ({err.msg})") from None
        if not isinstance(record, dict):
            raise ArtifactError(f"{path}: line {number + 1} is not a JSON object")
        records.append(record)
    return records


def truncate_jsonl(path: str | Path, keep) -> None:
    """Rewrite a JSON Lines file keeping only records for which keep(record) is true (atomic)."""
    records = [r for r in read_jsonl(path) if keep(r)]
    text = "".join(json.dumps(r, sort_keys=True) + "\n" for r in records)
    atomic_write_text(path, text)


def digest_arrays(named_arrays: Iterable[tuple[str, np.ndarray]]) -> str:
    """SHA-256 over arrays' bytes in sorted name order (names, dtypes and shapes included)."""
    digest = hashlib.sha256()
    for name, array in sorted(named_arrays, key=lambda item: item[0]):
        array = np.ascontiguousarray(array)
        digest.update(f"{name}:{array.dtype.str}:{array.shape};".encode())
        digest.update(array.tobytes())
    return digest.hexdigest()


def utc_stamp() -> str:
    return dt.datetime.now(dt.UTC).strftime("%Y%m%dT%H%M%SZ")


def ensure_file_target(path: str | Path) -> Path:
    """An output file's path, checked before any work: not a directory, and its directory created and
    writable (so a flag naming a folder fails at once, naming it, not after the work as a rename)."""
    path = Path(path)
    if path.is_dir():
        raise OutputDirError(f"{path}: is a directory; name a file to write")
    ensure_dir(path.parent)
    return path


def ensure_dir(directory: str | Path) -> Path:
    """Create an output directory (keeping what is in it) and check that it takes files."""
    directory = Path(directory)
    if directory.exists() and not directory.is_dir():
        raise OutputDirError(f"{directory}: exists and is not a directory")
    try:
        directory.mkdir(parents=True, exist_ok=True)
        # a nameless file (or a uniquely named one): commands probing one --out at once never meet
        with tempfile.TemporaryFile(dir=directory):
            pass
    except OSError as err:
        raise OutputDirError(f"{directory}: output directory is not writable ({err.strerror})") from err
    return directory


def _fsync_dir(directory: Path) -> None:
    with contextlib.suppress(OSError):
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
