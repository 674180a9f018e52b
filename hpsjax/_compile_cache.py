"""JAX's persistent compilation cache, shared by every process of a run.

The profiling pass, the workers, the server and the launcher's processes each
call :func:`use_compile_cache` with the same directory (the run's work directory
by default, ``<workdir>/jax_cache``): a step compiled once, by whichever process
got there first, is loaded from disk by the others instead of being compiled
again while a barrier waits. The directory also travels to child processes in
the ``JAX_COMPILATION_CACHE_DIR`` environment variable, which JAX itself reads.
"""

from __future__ import annotations

import os
import pathlib

import jax
from jax.experimental.compilation_cache import compilation_cache

__all__ = ["CACHE_ENV", "cache_dir_for", "cache_env", "use_compile_cache"]

#: The environment variable JAX reads for its persistent cache directory.
CACHE_ENV = "JAX_COMPILATION_CACHE_DIR"

_SUBDIR = "jax_cache"


def cache_dir_for(workdir: str | os.PathLike[str]) -> pathlib.Path:
    """The cache directory of a run whose work directory is ``workdir``."""
    return pathlib.Path(workdir) / _SUBDIR


def cache_env(path: str | os.PathLike[str]) -> dict[str, str]:
    """The environment variables that give a child process the cache at
    ``path``, every program cached (JAX reads them at import)."""
    return {
        CACHE_ENV: str(pathlib.Path(path).expanduser().resolve()),
        "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
        "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0",
    }


def use_compile_cache(
    path: str | os.PathLike[str] | None = None,
) -> pathlib.Path | None:
    """Points this process's JAX at a persistent compilation cache.

    Args:
      path: the cache directory (created if missing). ``None`` takes the one
        in ``JAX_COMPILATION_CACHE_DIR`` when set, and otherwise leaves the
        cache off.

    Returns:
      The directory in use, or ``None`` when the cache stays off. Every
      compiled program is cached, however quick its compile (JAX skips those
      under a second by default, and a worker's step often is one on a CPU),
      and the directory is exported to child processes.
    """
    if path is None:
        path = os.environ.get(CACHE_ENV) or None
        if path is None:
            return None
    directory = pathlib.Path(path).expanduser().resolve()
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise ValueError(
            f"cannot use {str(path)!r} as the compilation cache: {err.strerror}"
        ) from None
    jax.config.update("jax_compilation_cache_dir", str(directory))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    # JAX decides whether the cache is on at its first compile and keeps that
    # answer; a reset makes a directory set after a compile take effect.
    compilation_cache.reset_cache()
    os.environ[CACHE_ENV] = str(directory)
    return directory
