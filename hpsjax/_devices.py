"""Naming a JAX device on the command line and in arguments."""

from __future__ import annotations

from typing import Any

import jax

__all__ = ["describe_device", "resolve_device"]


def describe_device(device: jax.Device) -> str:
    """``"cpu:0"``, ``"gpu:1"``: a device's platform and id."""
    return f"{device.platform}:{device.id}"


def resolve_device(device: Any, *, what: str = "device") -> jax.Device:
    """The JAX device that ``device`` names.

    Args:
      device: ``None`` for the host's first CPU device; a platform name
        (``"cpu"``, ``"gpu"``, ``"cuda"``, ``"rocm"``, ``"tpu"``) for that
        platform's first device, or ``"PLATFORM:INDEX"`` for another one; or a
        ``jax.Device``, returned as it is.
      what: how errors name the argument (e.g. ``"--device"``).

    Returns:
      A ``jax.Device``.

    Raises:
      ValueError: an unknown platform, one this process has no device of, or
        an index past its devices (one line, naming the platforms present).

    Examples:
      >>> describe_device(resolve_device(None))
      'cpu:0'
      >>> describe_device(resolve_device("cpu:0"))
      'cpu:0'
    """
    if device is None:
        device = "cpu"
    if isinstance(device, jax.Device):
        return device
    if not isinstance(device, str) or not device.strip():
        raise ValueError(
            f"{what} must be a platform name such as 'cpu' or 'gpu' (optionally "
            f"with ':INDEX') or a jax.Device, got {device!r}"
        )
    platform, _, index = device.strip().lower().partition(":")
    if index and not index.isdigit():
        raise ValueError(f"{what}: bad device index in {device!r} (e.g. 'gpu:0')")
    try:
        devices = jax.devices(platform)
    except RuntimeError:
        present = sorted({d.platform for d in jax.devices()} | {"cpu"})
        raise ValueError(
            f"{what}: no {platform!r} device in this process (platforms present: "
            f"{', '.join(present)})"
        ) from None
    number = int(index or 0)
    if number >= len(devices):
        raise ValueError(
            f"{what}: {device!r} asks for {platform} device {number}, but there "
            f"are {len(devices)}"
        )
    return devices[number]
