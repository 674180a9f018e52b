"""A worker's local JAX devices: naming, resolving, one gradient over several."""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp

__all__ = ["describe_device", "multi_device_grad", "resolve_device"]


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


def _sum_value_and_grad(loss_fn):
    def summed(params, batch):
        losses = loss_fn(params, batch)
        if losses.ndim != 1:
            raise ValueError(
                "loss_fn must return one loss per sample (shape (b,)), got shape "
                f"{losses.shape}"
            )
        return jnp.sum(losses), losses.shape[0]

    return jax.jit(jax.value_and_grad(summed, has_aux=True))


_SUM_GRAD_CACHE: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def multi_device_grad(
    loss_fn: Callable[[Any, Any], jax.Array],
    params: Any,
    per_device_batches: Sequence[Any],
    devices: Sequence[jax.Device] | None = None,
) -> tuple[jax.Array, Any]:
    r"""Gradient of the sample-weighted mean loss over batches on several devices.

    Device ``d`` holds a batch of ``b_d`` samples, sizes free to differ (a plan
    gives a faster device more). Each device computes the gradient of the *sum*
    of its per-sample losses, all devices at once, and the sums are combined on
    the first device:

    .. math::

      g = \frac{1}{B} \sum_d \nabla \sum_{j \in d} \ell_j(\theta)
        = \sum_d \frac{b_d}{B} \, \nabla \bar\ell_d(\theta),
      \qquad B = \sum_d b_d,

    which equals the gradient of the mean loss over the concatenated batch on one
    device; averaging per-device mean gradients instead would give a small batch
    the same weight as a large one.

    Args:
      loss_fn: ``loss_fn(params, batch)`` returning the per-sample losses, shape
        ``(b,)``.
      params: the model parameters.
      per_device_batches: one batch per device, each with a leading batch axis.
      devices: the devices, one per batch; ``jax.local_devices()[:n]`` by default.

    Returns:
      ``(loss, grads)``: the mean loss over all samples and its gradient, both on
      the first device.

    Examples:
      >>> import jax.numpy as jnp
      >>> loss = lambda w, x: (x @ w) ** 2
      >>> x = jnp.arange(6.0).reshape(3, 2)
      >>> _, g = multi_device_grad(loss, jnp.ones(2), [x])
      >>> bool(jnp.allclose(g, jax.grad(lambda w: loss(w, x).mean())(jnp.ones(2))))
      True

    References:
      Xian, Li, Liu, Guo, Du, "H-PS: A Heterogeneous-Aware Parameter Server With
      Distributed Neural Network Training", IEEE Access, 2021,
      https://doi.org/10.1109/ACCESS.2021.3060154
    """
    batches = list(per_device_batches)
    if not batches:
        raise ValueError("per_device_batches is empty")
    if devices is None:
        local = jax.local_devices()
        if len(batches) > len(local):
            raise ValueError(
                f"{len(batches)} batches but only {len(local)} local devices"
            )
        devices = local[: len(batches)]
    devices = list(devices)
    if len(devices) != len(batches):
        raise ValueError(f"{len(batches)} batches for {len(devices)} devices")
    try:
        value_and_grad = _SUM_GRAD_CACHE[loss_fn]
    except KeyError:
        value_and_grad = _SUM_GRAD_CACHE[loss_fn] = _sum_value_and_grad(loss_fn)
    except TypeError:
        value_and_grad = _sum_value_and_grad(loss_fn)
    # Dispatch is asynchronous: every device starts before any result is read.
    results = [
        value_and_grad(jax.device_put(params, d), jax.device_put(batch, d))
        for d, batch in zip(devices, batches, strict=True)
    ]
    total = sum(int(count) for (_, count), _ in results)
    if total == 0:
        raise ValueError("all per-device batches are empty")
    home = devices[0]
    loss_sum = sum(jax.device_put(loss, home) for (loss, _), _ in results)
    grad_sum = jax.tree.map(
        lambda *gs: sum(jax.device_put(g, home) for g in gs),
        *(grads for _, grads in results),
    )
    return loss_sum / total, jax.tree.map(lambda g: g / total, grad_sum)
