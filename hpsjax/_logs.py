"""Logging shared by the command-line tools."""

from __future__ import annotations

import logging

__all__ = ["quiet_backend_probe"]

_PROBE_LOGGER = "jax._src.xla_bridge"
_PROBE_MESSAGE = "Unable to initialize backend 'tpu'"


def _not_the_tpu_probe(record: logging.LogRecord) -> bool:
    return not record.getMessage().startswith(_PROBE_MESSAGE)


def quiet_backend_probe() -> None:
    """Drops JAX's "Unable to initialize backend 'tpu'" line, and only it.

    JAX logs it at INFO on every machine without a TPU when it looks for
    backends; the platform JAX picks is unchanged. Idempotent.
    """
    logger = logging.getLogger(_PROBE_LOGGER)
    if _not_the_tpu_probe not in logger.filters:
        logger.addFilter(_not_the_tpu_probe)
