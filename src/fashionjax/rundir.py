"""A run directory belongs to one run: an ownership lock, a marker, and a manifest of what it wrote.

- The lock (`fcntl.flock` on `.fashionjax.lock`, holding the owner's PID) is held by `train` for its
  whole life; the kernel drops it when the process dies, even by SIGKILL.
- config.json carries a marker (`"fashionjax": {"kind": "run", ...}`) that says "fashionjax made this".
- The manifest (`.fashionjax-manifest.json`) lists every file and folder the run wrote; --overwrite
  removes exactly those, and refuses a directory that holds anything else.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import errno
import fcntl
import json
import os
import secrets
import shutil
from collections.abc import Iterator
from pathlib import Path

from fashionjax import artifacts
from fashionjax.config import ConfigError, TrainConfig

LOCK = ".fashionjax.lock"
MANIFEST = ".fashionjax-manifest.json"
MARKER = {"kind": "run", "format": 1}
OWN_FILES = (LOCK, MANIFEST)


class RunDirError(RuntimeError):
    """The run directory cannot be used as asked (exit 1)."""


class RunDirBusy(RunDirError):
    """Another process holds the run directory's lock."""


def _listing(names) -> str:
    names = sorted(names)
    shown = ", ".join(names[:5])
    return shown + (f" and {len(names) - 5} more" if len(names) > 5 else "")


# What a lock file's second line says holds the directory, as a refusal names it; a lock without one
# (or of a version before it) was a training's.
HOLDERS = {"training": "another training", "report": "a report being written", "export": "an export",
           "bench": "a bench"}


def holder(lock_path: Path) -> tuple[str, str]:
    """(PID, command) of what the lock file says holds its directory (a key of HOLDERS)."""
    try:
        lines = lock_path.read_text().split()
    except OSError:
        lines = []
    return (lines[0] if lines else "unknown"), (lines[1] if len(lines) > 1 else "training")


def busy(path: Path, flag: str = "--run-dir") -> RunDirBusy:
    """The refusal of a directory another command holds: which command, its PID, and the flag that
    chooses another directory."""
    pid, command = holder(path / LOCK)
    return RunDirBusy(f"{path}: in use by {HOLDERS.get(command, 'another fashionjax command')} (pid {pid}); "
                      f"wait for it to finish or choose another {flag}")


def _try_lock(lock_path: Path, create: bool) -> int | None:
    """An fd holding an exclusive flock on lock_path, or None when another process holds it."""
    flags = os.O_RDWR | (os.O_CREAT if create else 0)
    fd = os.open(lock_path, flags, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as err:
        os.close(fd)
        if err.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            return None
        raise
    return fd


def is_live(run_dir: str | Path) -> tuple[str, str] | None:
    """(PID, command) of what holds run_dir, as holder() reads it, or None when nothing does (takes no
    lock)."""
    lock_path = Path(run_dir) / LOCK
    if not lock_path.is_file():
        return None
    try:
        fd = os.open(lock_path, os.O_RDONLY)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except OSError:
        return holder(lock_path)
    finally:
        os.close(fd)
    return None


def has_checkpoint(run_dir: Path) -> bool:
    """Whether the run has a finalized checkpoint (orbax names those by their step alone)."""
    checkpoints = run_dir / "checkpoints"
    return checkpoints.is_dir() and any(p.name.isdigit() for p in checkpoints.iterdir())


def is_run(run_dir: Path) -> bool:
    """Whether config.json says fashionjax made this directory."""
    try:
        document = json.loads((run_dir / "config.json").read_text())
    except (OSError, ValueError):
        return False
    return isinstance(document, dict) and document.get("fashionjax", {}).get("kind") == MARKER["kind"]


def read_config(run_dir: Path) -> tuple[dict, TrainConfig]:
    """A run's config.json: the document and the TrainConfig it holds. A file that fashionjax did not
    write in this form is an ArtifactError that names it, not a KeyError from deep inside a command."""
    path = Path(run_dir) / "config.json"
    document = artifacts.read_json(path)
    fields = document.get("config") if isinstance(document, dict) else None
    if not isinstance(fields, dict):
        raise artifacts.ArtifactError(f"{path}: not a config.json that fashionjax wrote (no \"config\" object in it)")
    return document, saved_config(fields, path)


def saved_config(fields: dict, source: Path) -> TrainConfig:
    """The TrainConfig of a saved config (config.json's, or a checkpoint's); fields that this version does
    not have (a run of another fashionjax version) are an ArtifactError naming the source."""
    try:
        return TrainConfig(**fields)
    except TypeError as err:
        raise artifacts.ArtifactError(f"{source}: its config does not fit this version of fashionjax ({err}); "
                                      "use the fashionjax that wrote it") from None


def require_run(path: str | Path) -> Path:
    """A RUN_DIR argument: a directory with config.json, or a one-line refusal that names the runs
    inside a folder of them (a speedrun's --out, a runs/ folder)."""
    run_dir = Path(path)
    if (run_dir / "config.json").is_file():
        return run_dir
    inside = [p.name for p in run_dir.iterdir() if is_run(p)] if run_dir.is_dir() else []
    hint = f"; it holds the runs {_listing(inside)}: name one of them" if inside else ""
    raise ConfigError(f"{run_dir}: not a run directory (no config.json){hint}")


def ensure_out_dir(path: str | Path) -> Path:
    """The --out folder of data, bench, export or speedrun: never a training's run directory, where its
    files would be ones --overwrite refuses to remove (and the training may still be writing)."""
    if is_run(Path(path)):
        raise artifacts.OutputDirError(f"{path}: is a training's run directory; choose another --out")
    return artifacts.ensure_dir(path)


@contextlib.contextmanager
def writing_into(path: str | Path, command: str) -> Iterator[Path]:
    """The --out folder of export or bench (ensure_out_dir), locked while the command writes into it:
    a second such command into the same folder at once is refused (RunDirBusy) instead of leaving
    the folder with some files of each, such as one run's model beside another's export.json."""
    out_dir = ensure_out_dir(path)
    owned = RunDir.claim(out_dir, "--out", command)
    try:
        yield out_dir
    finally:
        owned.release()


def read_manifest(run_dir: Path) -> list[str]:
    try:
        names = json.loads((run_dir / MANIFEST).read_text())
    except (OSError, ValueError):
        return []
    return [n for n in names if isinstance(n, str) and n and "/" not in n and n not in (".", "..")] \
        if isinstance(names, list) else []


class RunDir:
    """A run directory owned by this process: created if needed, locked, and its writes recorded."""

    def __init__(self, path: Path, fd: int | None = None, created: bool = False):
        """Use claim() or new_default(); RunDir(path) alone is a view for processes that never write."""
        self.path = path
        self.created = created
        self._fd = fd
        self._written = read_manifest(path) if fd is not None else []
        self._this_command: list[str] = []
        self.lock_created = False

    @classmethod
    def claim(cls, path: str | Path, flag: str = "--run-dir", command: str = "training") -> RunDir:
        """Create the directory when missing and take its lock for `command` (a key of HOLDERS), or
        raise RunDirBusy at once (naming the flag that chose the directory and what holds it)."""
        path = Path(path)
        if path.exists() and not path.is_dir():
            raise RunDirError(f"{path}: exists and is not a directory")
        created = not path.exists()
        try:
            path.mkdir(parents=True, exist_ok=True)
            lock_existed = (path / LOCK).exists()
            fd = _try_lock(path / LOCK, create=True)
        except OSError as err:
            raise RunDirError(f"{path}: output directory is not writable ({err.strerror})") from err
        if fd is None:
            raise busy(path, flag)
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n{command}\n".encode())
        owned = cls(path, fd, created)
        owned.lock_created = not lock_existed
        return owned

    @classmethod
    def new_default(cls, model: str, root: str | Path = "runs") -> RunDir:
        """A fresh, unique directory runs/<UTC time to the microsecond>-<model>-<random suffix>."""
        root = Path(root)
        root.mkdir(parents=True, exist_ok=True)
        while True:
            stamp = dt.datetime.now(dt.UTC).strftime("%Y%m%dT%H%M%S.%fZ")
            path = root / f"{stamp}-{model}-{secrets.token_hex(3)}"
            try:
                path.mkdir()  # atomic: two trainings can never get the same directory
            except FileExistsError:
                continue
            run_dir = cls.claim(path)
            run_dir.created = True
            return run_dir

    def foreign_entries(self) -> list[str]:
        return [p.name for p in self.path.iterdir() if p.name not in OWN_FILES]

    def check_new_run(self, overwrite: bool) -> None:
        """Refuse (ConfigError, before anything is touched) to start a new run where one cannot go.

        --overwrite takes a directory that config.json marks as a run, or whose every entry the
        manifest lists (a run killed before it wrote config.json), and nothing else.
        """
        entries = self.foreign_entries()
        if not entries:
            return
        if not overwrite:
            raise ConfigError(f"{self.path}: run directory is not empty (use --overwrite to replace the run "
                              "there, or --resume to continue it)")
        if not is_run(self.path) and not set(entries) <= set(self._written):
            raise ConfigError(f"{self.path}: not a fashionjax run directory (it holds {_listing(entries)}); "
                              "--overwrite only replaces a fashionjax run")
        others = set(entries) - set(self._written)
        if others:
            raise ConfigError(f"{self.path}: holds files fashionjax did not write ({_listing(others)}); "
                              "--overwrite never deletes them: move them away or choose another --run-dir")

    def clear(self, names: list[str] | None = None) -> None:
        """Remove what the run wrote (default: everything in the manifest; check_new_run has made
        sure that is all there is) and forget it in the manifest."""
        names = list(self._written if names is None else names)
        # config.json (the marker) goes last: a clear cut short still leaves a recognisable run
        for name in sorted(names, key=lambda n: n == "config.json"):
            entry = self.path / name
            if entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry)
            elif entry.exists() or entry.is_symlink():
                entry.unlink()
        self._written = [n for n in self._written if n not in names]
        if self._written:
            artifacts.atomic_write_json(self.path / MANIFEST, self._written)
        else:
            with contextlib.suppress(FileNotFoundError):
                (self.path / MANIFEST).unlink()

    def file(self, name: str) -> Path:
        """The path of a run file, recorded in the manifest before anything is written to it."""
        if self._fd is not None and name not in self._written:
            self._written.append(name)
            artifacts.atomic_write_json(self.path / MANIFEST, self._written)
        if name not in self._this_command:
            self._this_command.append(name)
        return self.path / name

    def discard_unresumable(self) -> None:
        """After a failed or interrupted start: leave no half-written directory behind.

        Removes what this command wrote when no checkpoint exists yet (nothing there could be
        resumed), and the directory itself when this command created it and nothing else is in it.
        """
        if has_checkpoint(self.path):
            return
        self.clear(self._this_command)
        if self.created and not self.foreign_entries():
            with contextlib.suppress(OSError):
                (self.path / LOCK).unlink()
                self.path.rmdir()

    def release(self) -> None:
        """Drop the lock; a lock file this command added to a directory it never wrote into goes too."""
        if self._fd is None:
            return
        if self.lock_created and not self._written:
            with contextlib.suppress(OSError):
                (self.path / LOCK).unlink()
        os.close(self._fd)  # closing the fd drops the flock
        self._fd = None


def marker() -> dict:
    import fashionjax

    return dict(MARKER, version=fashionjax.__version__)
