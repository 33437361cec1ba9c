"""Facts about the machine and software, stored beside every figure fashionjax reports."""

from __future__ import annotations

import os
import platform
import subprocess
from pathlib import Path

import fashionjax


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cpu_has_amx() -> bool:
    """Whether the CPU has Intel AMX tiles for bf16 (the Linux flag amx_bf16)."""
    try:
        return any(line.startswith("flags") and "amx_bf16" in line.split()
                   for line in Path("/proc/cpuinfo").read_text().splitlines())
    except OSError:
        return False


def git_commit() -> str | None:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5,
            cwd=Path(fashionjax.__file__).parent,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None if out.returncode == 0 else None


def _device_memory(device) -> int | None:
    try:
        stats = device.memory_stats()
    except Exception:  # not every backend implements memory_stats
        return None
    return int(stats["bytes_limit"]) if stats and "bytes_limit" in stats else None


def describe(with_git: bool = False) -> dict:
    """Versions, backend and devices (imports JAX)."""
    import jax
    import jaxlib
    import optax

    devices = jax.devices()
    info = {
        "python": platform.python_version(),
        "jax_version": jax.__version__,
        "jaxlib_version": jaxlib.__version__,
        "optax_version": getattr(optax, "__version__", "unknown"),
        "fashionjax_version": fashionjax.__version__,
        "backend": jax.default_backend(),
        "device_kind": devices[0].device_kind,
        "device_count": jax.device_count(),
        "local_device_count": jax.local_device_count(),
        "process_count": jax.process_count(),
        "devices": [
            {"id": d.id, "platform": d.platform, "kind": d.device_kind,
             "process_index": d.process_index, "memory_bytes": _device_memory(d)}
            for d in devices
        ],
        "cpu_model": cpu_model(),
        "cpu_cores": os.cpu_count(),
        "cpu_amx": cpu_has_amx(),
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
        "matmul_precision": str(jax.config.jax_default_matmul_precision or "default"),
    }
    if with_git:
        info["git_commit"] = git_commit()
    return info


def enable_compile_cache() -> None:
    """A persistent XLA cache under the user cache dir: later runs skip most compiling."""
    if os.environ.get("FASHIONJAX_NO_COMPILE_CACHE"):
        return
    import jax

    from fashionjax import data  # no JAX there: no import cycle

    jax.config.update("jax_compilation_cache_dir", str(data.cache_root() / "xla-cache"))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


class MissingExtra(RuntimeError):
    """An optional feature whose packages are not installed; the message names the extra."""


def require_extra(extra: str, modules: tuple[str, ...], feature: str) -> None:
    """Refuse at once, naming the pip extra, when any of `modules` cannot be imported."""
    import importlib.util

    missing = [name for name in modules if importlib.util.find_spec(name) is None]
    if missing:
        raise MissingExtra(f"{feature} needs {', '.join(missing)}: install it with "
                           f"pip install 'fashionjax[{extra}]'")
