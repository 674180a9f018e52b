"""This test process's JAX on a persistent compilation cache for a while
(imported as ``_jax_cache``).

The session's cache (``tests/conftest.py``) serves the processes tests start
through the environment; :func:`compiling_into` points the test process's own
JAX at it too, every program cached however quick its compile, and puts the
earlier settings back after. The cache changes how long a compile takes,
never a result.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import jax
from jax.experimental.compilation_cache import compilation_cache

_OPTIONS = (
    "jax_compilation_cache_dir",
    "jax_persistent_cache_min_compile_time_secs",
    "jax_persistent_cache_min_entry_size_bytes",
)


@contextlib.contextmanager
def compiling_into(path: str | os.PathLike[str]) -> Iterator[None]:
    """Within the block, this process compiles into and loads from ``path``."""
    saved = {name: getattr(jax.config, name) for name in _OPTIONS}
    # JAX decides whether the cache is on at its first compile and keeps that
    # answer; a reset makes the change take effect.
    compilation_cache.reset_cache()
    for name, value in zip(_OPTIONS, (str(path), 0.0, 0), strict=True):
        jax.config.update(name, value)
    try:
        yield
    finally:
        for name, value in saved.items():
            jax.config.update(name, value)
        compilation_cache.reset_cache()
