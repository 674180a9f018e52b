"""The profiling pass: time per step, peak memory and transfer time of a worker.

A worker is measured once, before training, on each of its local JAX devices:

* **time per step** ``t(b)`` of the train step at a few batch sizes ``b``, compile
  time excluded (each size is compiled and warmed up first, then timed as the
  median of several runs ended by ``block_until_ready``), fitted to the linear model
  ``t(b) = a + c * b``: ``a`` is the fixed cost of a step (dispatch, parameter-sized
  work such as the optimizer update), ``c`` the cost per sample;
* **peak memory** per batch size, from ``device.memory_stats()`` where the backend
  keeps statistics (GPU, TPU) and from the compiled step's ``memory_analysis()``
  where it does not (CPU) or where the process's high-water mark was set before
  by a larger program, fitted the same way so that the largest batch that fits
  a device's capacity (its ``bytes_limit``) can be read off;
* **transfer time** of one push and one pull of the real model with its codec,
  measured by real round trips to a parameter server or estimated from a link's
  bandwidth and latency.

The measurements are plain, JSON-serialisable dataclasses (:class:`DeviceProfile`,
:class:`TransferProfile`, :class:`WorkerProfile`) that :func:`hpsjax.profiling.plan`
turns into a work plan. A worker with several local devices computes one gradient
from a different batch on each (:func:`multi_device_grad`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
import json
import math
import statistics
import time
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from hpsjax._checks import is_int, is_number
from hpsjax.transforms import powersgd_nbytes
from hpsjax.transforms._quantize import encoded_nbytes

__all__ = [
    "DeviceProfile",
    "LinearFit",
    "Link",
    "TransferProfile",
    "WorkerProfile",
    "measure_transfer",
    "multi_device_grad",
    "profile",
    "tree_wire_nbytes",
]

MIN_SPREAD_SAMPLES = 5
"""Timed steps at a batch size from which a profile reports the step's spread."""

PROFILE_FORMAT = "hpsjax.WorkerProfile"
PROFILE_FORMAT_VERSION = 1

_MEMORY_SOURCES = ("device", "compiled", "synthetic")
_TRANSFER_METHODS = ("measured", "estimated")


def _check_positive_int(name: str, value: Any) -> int:
    if not is_int(value):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    if value <= 0:
        raise ValueError(f"{name} must be positive, got {value}")
    return int(value)


def _check_finite(name: str, value: Any, *, positive: bool) -> float:
    if not is_number(value):
        raise ValueError(f"{name} must be a number, got {value!r}")
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value}")
    if positive and value <= 0:
        raise ValueError(f"{name} must be positive, got {value}")
    if not positive and value < 0:
        raise ValueError(f"{name} must be non-negative, got {value}")
    return value


def _check_worker_id(value: Any) -> int | str:
    if isinstance(value, bool) or not isinstance(value, int | str):
        raise ValueError(f"worker_id must be an int or a str, got {value!r}")
    return value


@dataclasses.dataclass(frozen=True)
class LinearFit:
    """A fitted line ``y(b) = intercept + slope * b`` with both terms ``>= 0``.

    The fit is least squares constrained to non-negative terms: a step never takes
    negative time and never gets cheaper with more samples, so a noisy measurement
    that would give a negative intercept or slope is fitted on the boundary instead
    (the best line through the origin, or the best constant).

    Attributes:
      intercept: ``a``, the value at batch size 0 (seconds or bytes).
      slope: ``c``, the increase per sample (seconds or bytes per sample).
    """

    intercept: float
    slope: float

    def __post_init__(self):
        _check_finite("intercept", self.intercept, positive=False)
        _check_finite("slope", self.slope, positive=False)

    @classmethod
    def fit(cls, xs: Sequence[float], ys: Sequence[float]) -> LinearFit:
        """Fits ``y = a + c * x`` with ``a, c >= 0`` by least squares.

        With one distinct ``x`` the data cannot separate ``a`` from ``c``; the line
        through the origin is returned (``y`` proportional to ``x``).

        Args:
          xs: batch sizes, positive.
          ys: measured values, non-negative.

        Returns:
          The fitted line.
        """
        x = np.asarray(xs, dtype=np.float64)
        y = np.asarray(ys, dtype=np.float64)
        if x.ndim != 1 or x.shape != y.shape or x.size == 0:
            raise ValueError("fit needs two equally long, non-empty sequences")
        if np.any(x <= 0) or np.any(y < 0) or not np.all(np.isfinite(y)):
            raise ValueError("fit needs positive xs and finite, non-negative ys")
        through_origin = float(np.dot(x, y) / np.dot(x, x))
        if np.unique(x).size == 1:
            return cls(0.0, through_origin)
        candidates = []
        # Centred least squares in closed form: points on a line with integer
        # coordinates (the synthetic profiles) give its terms exactly, where
        # np.polyfit's LAPACK solve rounds differently from one machine to the
        # next (a budget of 50 samples read as 49.99...).
        dx = x - np.mean(x)
        slope = float(np.dot(dx, y - np.mean(y)) / np.dot(dx, dx))
        intercept = float(np.mean(y) - slope * np.mean(x))
        if slope >= 0 and intercept >= 0:
            candidates.append((float(intercept), float(slope)))
        candidates.append((0.0, through_origin))
        candidates.append((float(np.mean(y)), 0.0))

        def sse(ac):
            return float(np.sum((ac[0] + ac[1] * x - y) ** 2))

        intercept, slope = min(candidates, key=sse)
        return cls(intercept, slope)

    def __call__(self, b: float) -> float:
        """The fitted value at batch size ``b``."""
        return self.intercept + self.slope * b


@dataclasses.dataclass(frozen=True)
class DeviceProfile:
    """Measurements of one device of one worker.

    Attributes:
      device_id: ``jax.Device.id`` of the device.
      platform: ``"cpu"``, ``"gpu"``, ``"tpu"``, or ``"synthetic"``.
      device_kind: the backend's name for the device model.
      batch_sizes: the profiled batch sizes, increasing.
      step_times: median seconds per train step at each batch size.
      peak_memory: peak bytes at each batch size, or ``None`` where unknown.
      memory_source: where ``peak_memory`` comes from: ``"device"``
        (``memory_stats()``), ``"compiled"`` (``memory_analysis()``), or
        ``"synthetic"``; ``None`` with ``peak_memory``.
      memory_capacity: bytes the device can hold (``bytes_limit``), or ``None``
        for no known limit.
      step_spread: how much the step time varies from step to step at each
        batch size: the standard deviation of the timed steps over their mean
        (their coefficient of variation), or ``None`` when not measured (fewer
        than :data:`MIN_SPREAD_SAMPLES` timed steps at every size; a size
        with too few takes the nearest measured size's). A barrier
        round waits for the slowest of its workers' steps, so a planner counts
        it (:func:`hpsjax.profiling.plan`).
    """

    device_id: int
    platform: str
    device_kind: str
    batch_sizes: tuple[int, ...]
    step_times: tuple[float, ...]
    peak_memory: tuple[int, ...] | None = None
    memory_source: str | None = None
    memory_capacity: int | None = None
    step_spread: tuple[float, ...] | None = None

    def __post_init__(self):
        if isinstance(self.device_id, bool) or not isinstance(self.device_id, int):
            raise ValueError(f"device_id must be an int, got {self.device_id!r}")
        sizes = tuple(
            _check_positive_int("batch size", b) for b in tuple(self.batch_sizes)
        )
        if not sizes:
            raise ValueError("a DeviceProfile needs at least one batch size")
        if list(sizes) != sorted(set(sizes)):
            raise ValueError(f"batch_sizes must be increasing, got {sizes}")
        times = tuple(
            _check_finite("step time", t, positive=True) for t in self.step_times
        )
        if len(times) != len(sizes):
            raise ValueError(
                f"{len(times)} step times for {len(sizes)} batch sizes; "
                "give one per batch size"
            )
        object.__setattr__(self, "batch_sizes", sizes)
        object.__setattr__(self, "step_times", times)
        if self.peak_memory is not None:
            memory = tuple(int(m) for m in self.peak_memory)
            if len(memory) != len(sizes) or any(m < 0 for m in memory):
                raise ValueError(
                    "peak_memory must hold one non-negative byte count per batch size"
                )
            if self.memory_source not in _MEMORY_SOURCES:
                raise ValueError(
                    f"memory_source must be one of {_MEMORY_SOURCES}, "
                    f"got {self.memory_source!r}"
                )
            object.__setattr__(self, "peak_memory", memory)
        elif self.memory_source is not None:
            raise ValueError("memory_source given without peak_memory")
        if self.memory_capacity is not None:
            object.__setattr__(
                self,
                "memory_capacity",
                _check_positive_int("memory_capacity", self.memory_capacity),
            )
        if self.step_spread is not None:
            spread = tuple(
                _check_finite("step spread", x, positive=False)
                for x in self.step_spread
            )
            if len(spread) != len(sizes):
                raise ValueError(
                    f"{len(spread)} step spreads for {len(sizes)} batch sizes; "
                    "give one per batch size"
                )
            object.__setattr__(self, "step_spread", spread)

    @classmethod
    def synthetic(
        cls,
        samples_per_second: float,
        *,
        overhead: float = 0.0,
        device_id: int = 0,
        bytes_per_sample: int | None = None,
        base_bytes: int = 0,
        memory_capacity: int | None = None,
    ) -> DeviceProfile:
        """A profile that follows ``t(b) = overhead + b / samples_per_second``.

        Stands for a device that was not measured: a simulated worker, a test, or
        an injected heterogeneity.

        Args:
          samples_per_second: throughput of the per-sample part of a step.
          overhead: fixed seconds per step.
          device_id: id to report.
          bytes_per_sample: peak memory growth per sample; ``None`` for unknown
            memory.
          base_bytes: peak memory at batch size 0.
          memory_capacity: the device's capacity in bytes, ``None`` for unlimited.

        Returns:
          A profile at batch sizes 1 and 1024 that lies exactly on the line.
        """
        sps = _check_finite("samples_per_second", samples_per_second, positive=True)
        overhead = _check_finite("overhead", overhead, positive=False)
        sizes = (1, 1024)
        memory = None
        if bytes_per_sample is not None:
            memory = tuple(int(base_bytes + bytes_per_sample * b) for b in sizes)
        return cls(
            device_id=device_id,
            platform="synthetic",
            device_kind="synthetic",
            batch_sizes=sizes,
            step_times=tuple(overhead + b / sps for b in sizes),
            peak_memory=memory,
            memory_source=None if memory is None else "synthetic",
            memory_capacity=memory_capacity,
        )

    @property
    def time_fit(self) -> LinearFit:
        """The fit ``t(b) = a + c * b`` of seconds per step."""
        return LinearFit.fit(self.batch_sizes, self.step_times)

    @property
    def memory_fit(self) -> LinearFit | None:
        """The fit of peak bytes against batch size, ``None`` when unmeasured."""
        if self.peak_memory is None:
            return None
        return LinearFit.fit(self.batch_sizes, self.peak_memory)

    @property
    def best_time_per_sample(self) -> float:
        """The fewest seconds per sample measured, ``min_k t_k / b_k``."""
        return min(
            t / b for t, b in zip(self.step_times, self.batch_sizes, strict=True)
        )

    def step_time(self, batch_size: float) -> float:
        r"""Predicted seconds per step at ``batch_size``.

        The fitted line, but never faster per sample than the best measured:

        .. math::

          \hat t(b) = \max\big(a + c\,b,\; b \min_k t_k / b_k\big).

        Within the profiled batch sizes the line is the larger; beyond them the
        second term stops the fixed cost ``a`` from being spread over ever more
        samples, a gain no measurement has shown.
        """
        return max(self.time_fit(batch_size), batch_size * self.best_time_per_sample)

    def throughput(self, batch_size: float) -> float:
        """Predicted samples per second at ``batch_size``: ``b / t(b)``."""
        return batch_size / self.step_time(batch_size)

    def max_batch(self, *, memory_fraction: float = 0.9) -> int | None:
        """Largest batch whose predicted peak memory fits the device.

        Args:
          memory_fraction: share of ``memory_capacity`` a step may use; the rest
            is headroom for fragmentation and other buffers.

        Returns:
          The largest batch size ``b`` with ``peak(b) <= memory_fraction *
          memory_capacity``, 0 when not even the fixed part fits, or ``None``
          when the capacity or the memory profile is unknown (no limit).
        """
        if not 0 < memory_fraction <= 1:
            raise ValueError(
                f"memory_fraction must be in (0, 1], got {memory_fraction}"
            )
        fit = self.memory_fit
        if fit is None or self.memory_capacity is None:
            return None
        budget = memory_fraction * self.memory_capacity - fit.intercept
        if budget < 0:
            return 0
        if fit.slope == 0:
            return None
        return math.floor(budget / fit.slope)

    def with_slowdown(self, factor: float) -> DeviceProfile:
        """This profile with every step ``factor`` times as long.

        The spread is divided by ``factor``: an injected slowdown sleeps in
        proportion to the typical step (:class:`hpsjax.worker.Injector`), which
        lengthens the step but adds nothing to how much it varies.
        """
        factor = _check_finite("slowdown factor", factor, positive=True)
        spread = self.step_spread
        return dataclasses.replace(
            self,
            step_times=tuple(t * factor for t in self.step_times),
            step_spread=None if spread is None else tuple(x / factor for x in spread),
        )


@dataclasses.dataclass(frozen=True)
class TransferProfile:
    """Time to exchange the model with the parameter server.

    Attributes:
      round_trip_seconds: one push followed by one pull, the time a worker spends
        communicating per round when the transfer does not overlap compute.
      push_seconds: one push of an update, ``None`` when only the round trip was
        measured.
      pull_seconds: one pull of the parameters, ``None`` likewise.
      push_bytes: payload bytes of one push (after the codec).
      pull_bytes: payload bytes of one pull.
      method: ``"measured"`` (real round trips) or ``"estimated"`` (from a
        :class:`Link`).
      server_seconds: the server's own time per push (receiving, decoding and
        applying it), ``None`` when not measured: a push's time beyond a bare
        request's round trip to the same server (:func:`measure_transfer`).
        Pushes that arrive together wait for each other's, which a barrier
        round's plan counts (:func:`hpsjax.profiling.plan`).
    """

    round_trip_seconds: float
    push_seconds: float | None
    pull_seconds: float | None
    push_bytes: int
    pull_bytes: int
    method: str
    server_seconds: float | None = None

    def __post_init__(self):
        _check_finite("round_trip_seconds", self.round_trip_seconds, positive=False)
        for name in ("push_seconds", "pull_seconds", "server_seconds"):
            value = getattr(self, name)
            if value is not None:
                _check_finite(name, value, positive=False)
        for name in ("push_bytes", "pull_bytes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be a non-negative int, got {value!r}")
        if self.method not in _TRANSFER_METHODS:
            raise ValueError(
                f"method must be one of {_TRANSFER_METHODS}, got {self.method!r}"
            )

    @classmethod
    def of_round_trip(cls, seconds: float, method: str) -> TransferProfile:
        """A profile that knows only the round trip's ``seconds`` (no bytes)."""
        return cls(
            round_trip_seconds=seconds,
            push_seconds=None,
            pull_seconds=None,
            push_bytes=0,
            pull_bytes=0,
            method=method,
        )


@dataclasses.dataclass(frozen=True)
class Link:
    """A network link for estimating transfer time without a server.

    A message of ``n`` bytes takes ``latency + n / bandwidth`` seconds.

    Attributes:
      bandwidth: bytes per second, positive.
      latency: seconds per message, non-negative.
    """

    bandwidth: float
    latency: float = 0.0

    def __post_init__(self):
        _check_finite("bandwidth", self.bandwidth, positive=True)
        _check_finite("latency", self.latency, positive=False)

    def estimate(self, push_bytes: int, pull_bytes: int) -> TransferProfile:
        """The transfer profile of one push and one pull over this link."""
        push = self.latency + push_bytes / self.bandwidth
        pull = self.latency + pull_bytes / self.bandwidth
        return TransferProfile(
            round_trip_seconds=push + pull,
            push_seconds=push,
            pull_seconds=pull,
            push_bytes=int(push_bytes),
            pull_bytes=int(pull_bytes),
            method="estimated",
        )


@dataclasses.dataclass(frozen=True)
class WorkerProfile:
    """Everything the profiling pass measured on one worker.

    Attributes:
      worker_id: the worker's id, as the parameter server knows it.
      devices: one profile per local device, in ``jax.local_devices()`` order.
      transfer: push/pull times to the server, ``None`` when not profiled (the
        planner then counts no transfer time).
      param_count: number of model parameters.
      param_bytes: bytes of the parameters as held on the device.
      profile_seconds: wall seconds the profiling pass took, compiles included.
      compile_seconds: the part of ``profile_seconds`` spent compiling the step.
    """

    worker_id: int | str
    devices: tuple[DeviceProfile, ...]
    transfer: TransferProfile | None = None
    param_count: int = 0
    param_bytes: int = 0
    profile_seconds: float = 0.0
    compile_seconds: float = 0.0

    def __post_init__(self):
        _check_worker_id(self.worker_id)
        devices = tuple(self.devices)
        if not devices:
            raise ValueError("a WorkerProfile needs at least one DeviceProfile")
        if not all(isinstance(d, DeviceProfile) for d in devices):
            raise ValueError("devices must be DeviceProfile objects")
        ids = [d.device_id for d in devices]
        if len(set(ids)) != len(ids):
            raise ValueError(f"device ids repeat within a worker: {ids}")
        object.__setattr__(self, "devices", devices)
        if self.transfer is not None and not isinstance(self.transfer, TransferProfile):
            raise ValueError("transfer must be a TransferProfile or None")
        for name in ("param_count", "param_bytes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be a non-negative int, got {value!r}")
        _check_finite("profile_seconds", self.profile_seconds, positive=False)
        _check_finite("compile_seconds", self.compile_seconds, positive=False)

    @classmethod
    def synthetic(
        cls,
        worker_id: int | str,
        samples_per_second: float | Sequence[float],
        *,
        overhead: float = 0.0,
        transfer_seconds: float | None = None,
        bytes_per_sample: int | None = None,
        base_bytes: int = 0,
        memory_capacity: int | None = None,
    ) -> WorkerProfile:
        """A worker whose devices follow ``t(b) = overhead + b / speed``.

        Args:
          worker_id: the worker's id.
          samples_per_second: one speed, or one per device for a worker with
            several devices.
          overhead: fixed seconds per step on every device.
          transfer_seconds: round-trip seconds to the server, ``None`` for none.
          bytes_per_sample: see :meth:`DeviceProfile.synthetic`.
          base_bytes: see :meth:`DeviceProfile.synthetic`.
          memory_capacity: see :meth:`DeviceProfile.synthetic`.

        Returns:
          The profile.

        Examples:
          >>> w = WorkerProfile.synthetic("w0", [100.0, 300.0])
          >>> [round(d.throughput(64)) for d in w.devices]
          [100, 300]
        """
        speeds = (
            [samples_per_second]
            if np.ndim(samples_per_second) == 0
            else list(samples_per_second)
        )
        devices = tuple(
            DeviceProfile.synthetic(
                s,
                overhead=overhead,
                device_id=i,
                bytes_per_sample=bytes_per_sample,
                base_bytes=base_bytes,
                memory_capacity=memory_capacity,
            )
            for i, s in enumerate(speeds)
        )
        transfer = None
        if transfer_seconds is not None:
            transfer_seconds = _check_finite(
                "transfer_seconds", transfer_seconds, positive=False
            )
            transfer = TransferProfile.of_round_trip(transfer_seconds, "estimated")
        return cls(worker_id=worker_id, devices=devices, transfer=transfer)

    @property
    def transfer_seconds(self) -> float:
        """Round-trip seconds to the server, 0 when the transfer was not profiled."""
        return 0.0 if self.transfer is None else self.transfer.round_trip_seconds

    def step_time(self, device_batch_sizes: Sequence[int]) -> float:
        """Predicted seconds of one step with these batches, one per device.

        The devices run in parallel, so the step takes as long as the slowest.
        """
        if len(device_batch_sizes) != len(self.devices):
            raise ValueError(
                f"{len(device_batch_sizes)} batch sizes for {len(self.devices)} devices"
            )
        return max(
            d.step_time(b)
            for d, b in zip(self.devices, device_batch_sizes, strict=True)
        )

    def with_slowdown(self, factor: float) -> WorkerProfile:
        """This worker with every device's steps ``factor`` times as long.

        Injects heterogeneity: ``with_slowdown(4.0)`` stands for a worker a quarter
        as fast. The transfer time is left as it is.
        """
        return dataclasses.replace(
            self, devices=tuple(d.with_slowdown(factor) for d in self.devices)
        )

    def to_json(self) -> str:
        """Serialises the profile to a JSON string (see :meth:`from_json`)."""
        body = dataclasses.asdict(self)
        return json.dumps(
            {"format": PROFILE_FORMAT, "version": PROFILE_FORMAT_VERSION, **body},
            sort_keys=True,
        )

    @classmethod
    def from_json(cls, text: str) -> WorkerProfile:
        """Reads a profile written by :meth:`to_json`.

        Raises:
          ValueError: the text is not a profile of a known format version.
        """
        try:
            data = json.loads(text)
        except (TypeError, json.JSONDecodeError) as e:
            raise ValueError(f"not a JSON WorkerProfile: {e}") from None
        if not isinstance(data, dict) or data.get("format") != PROFILE_FORMAT:
            raise ValueError("not a JSON WorkerProfile (format key missing)")
        if data.get("version") != PROFILE_FORMAT_VERSION:
            raise ValueError(
                f"WorkerProfile format version {data.get('version')!r} is not "
                f"supported (this hpsjax reads version {PROFILE_FORMAT_VERSION})"
            )
        try:
            devices = tuple(
                DeviceProfile(
                    **{
                        **d,
                        "batch_sizes": tuple(d["batch_sizes"]),
                        "step_times": tuple(d["step_times"]),
                        "peak_memory": None
                        if d["peak_memory"] is None
                        else tuple(d["peak_memory"]),
                        "step_spread": None
                        if d.get("step_spread") is None
                        else tuple(d["step_spread"]),
                    }
                )
                for d in data["devices"]
            )
            transfer = (
                None
                if data["transfer"] is None
                else TransferProfile(**data["transfer"])
            )
            return cls(
                worker_id=data["worker_id"],
                devices=devices,
                transfer=transfer,
                param_count=data["param_count"],
                param_bytes=data["param_bytes"],
                profile_seconds=data["profile_seconds"],
                compile_seconds=data["compile_seconds"],
            )
        except (KeyError, TypeError) as e:
            raise ValueError(f"malformed WorkerProfile JSON: {e!r}") from None


def tree_wire_nbytes(
    tree: Any, codec: Any = None, *, powersgd_rank: int | None = None
) -> int:
    """Payload bytes of ``tree`` on the wire, after ``codec`` where one is given.

    Without a codec every leaf travels as its raw buffer. With a wire codec
    object (``hpsjax.ps._codecs``), each leaf's size is the codec's own count
    (its ``leaf_nbytes``, which the receiver checks); with a quantization
    ``Codec``, ``encoded_nbytes(shape, codec)`` of ``hpsjax.transforms``, the
    same count; with ``powersgd_rank``, its PowerSGD factors'
    ``powersgd_nbytes``.

    Args:
      tree: a pytree of arrays (or ``jax.ShapeDtypeStruct``).
      codec: a wire codec object, a ``hpsjax.transforms.Codec`` or ``None``.
      powersgd_rank: the rank of PowerSGD pushes (not with ``codec``), or
        ``None``.

    Returns:
      The byte count, headers excluded.
    """
    leaves = jax.tree.leaves(tree)
    if powersgd_rank is not None:
        if codec is not None:
            raise ValueError("give codec or powersgd_rank, not both")

        return int(
            sum(powersgd_nbytes(x.shape, x.dtype, powersgd_rank) for x in leaves)
        )
    if codec is None:
        return int(sum(np.dtype(x.dtype).itemsize * math.prod(x.shape) for x in leaves))
    # A wire codec is taken by what it does: profiling sits below the server
    # package, which imports it.
    leaf_nbytes = getattr(codec, "leaf_nbytes", None)
    if leaf_nbytes is not None:
        return int(
            sum(
                leaf_nbytes(i, np.dtype(x.dtype).name, tuple(x.shape))[1]
                for i, x in enumerate(leaves)
            )
        )
    return int(sum(encoded_nbytes(tuple(x.shape), codec) for x in leaves))


def _pulled_version(pulled: Any) -> int:
    """The parameter version in what a client's ``pull()`` returned."""
    version = getattr(pulled, "version", None)
    if version is None and isinstance(pulled, tuple) and len(pulled) == 2:
        version = pulled[1]
    if not is_int(version):
        raise ValueError(
            "cannot read the parameter version from the client's pull() result "
            f"({type(pulled).__name__}); pass an async round-trip callable instead"
        )
    return int(version)


def _is_client(transfer: Any) -> bool:
    return callable(getattr(transfer, "pull", None)) and callable(
        getattr(transfer, "push", None)
    )


async def measure_transfer(
    transfer: Any,
    params: Any,
    *,
    codec: Any = None,
    repeats: int = 3,
    warmup: int = 1,
) -> TransferProfile:
    """Measures real transfer times between this worker and its server.

    ``transfer`` is either a ``hpsjax.ps.Client``, whose ``pull()`` and
    ``push(update, version=..., codec=...)`` are timed one after the other (a
    client not yet connected is connected first and closed after), or an async
    callable ``transfer(update)`` that performs one whole round trip (push
    ``update``, pull the parameters) and is timed as one. A client is also
    timed on a bare request (``refresh_info``, a few bytes each way): the
    push's time beyond it is the server's own time per push, receiving,
    decoding and applying it (``server_seconds``; it also holds the client's
    encoding, small beside the server's apply). The update pushed is a
    tree of zeros shaped like ``params``: it measures the wire and the server's
    handling of a real-sized message, and moves parameters only as far as the
    server's optimizer moves them on a zero gradient (not at all for SGD). Under a
    barrier policy a push waits for the other workers, so measure before training
    starts, with every worker profiling at once, or with a policy that does not
    wait.

    Cancelling is safe: nothing is left half-done on this side (the client's own
    cancellation rules apply); bound it with ``asyncio.wait_for``.

    Args:
      transfer: a client or an async round-trip callable.
      params: the model parameters (their shapes and dtypes set the message size).
      codec: the push codec, ``None`` for raw buffers.
      repeats: timed round trips; the median is reported.
      warmup: untimed round trips first (connection set-up, buffer allocation).

    Returns:
      The measured profile.
    """
    repeats = _check_positive_int("repeats", repeats)
    if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 0:
        raise ValueError(f"warmup must be a non-negative int, got {warmup!r}")
    is_client = _is_client(transfer)
    if not is_client and not callable(transfer):
        raise ValueError(
            "transfer must be a parameter-server Client or an async callable; "
            f"got {type(transfer).__name__}"
        )
    update = jax.tree.map(np.zeros_like, params)
    push_bytes = tree_wire_nbytes(params, codec)
    pull_bytes = tree_wire_nbytes(params)
    pushes, pulls, trips, bare = [], [], [], []
    opened = is_client and getattr(transfer, "closed", False)
    if opened:
        await transfer.connect()
    try:
        for i in range(warmup + repeats):
            t0 = time.perf_counter()
            if is_client:
                pulled = await transfer.pull()
                t1 = time.perf_counter()
                version = _pulled_version(pulled)
                await transfer.push(update, version=version, codec=codec)
                t2 = time.perf_counter()
                if i >= warmup and callable(getattr(transfer, "refresh_info", None)):
                    await transfer.refresh_info()
                    bare.append(time.perf_counter() - t2)
            else:
                result = transfer(update)
                if not inspect.isawaitable(result):
                    raise ValueError(
                        "a transfer callable must be async (return an awaitable)"
                    )
                await result
                t1 = None
                t2 = time.perf_counter()
            if i >= warmup:
                trips.append(t2 - t0)
                if t1 is not None:
                    pulls.append(t1 - t0)
                    pushes.append(t2 - t1)
    finally:
        if opened:
            await transfer.close()
    return TransferProfile(
        round_trip_seconds=statistics.median(trips),
        push_seconds=statistics.median(pushes) if pushes else None,
        pull_seconds=statistics.median(pulls) if pulls else None,
        push_bytes=push_bytes,
        pull_bytes=pull_bytes,
        method="measured",
        server_seconds=(
            max(statistics.median(pushes) - statistics.median(bare), 0.0)
            if pushes and bare
            else None
        ),
    )


def _compiled_peak_bytes(compiled: Any) -> int | None:
    """Peak bytes of a compiled step from XLA's buffer assignment, if reported."""
    try:
        stats = compiled.memory_analysis()
    except (NotImplementedError, RuntimeError):
        return None
    if stats is None:
        return None
    # On CPU, peak_memory_in_bytes can come out below the temporaries alone; the
    # sum of live buffer classes is an upper bound that never undercounts.
    total = (
        stats.argument_size_in_bytes
        + stats.output_size_in_bytes
        + stats.temp_size_in_bytes
        - stats.alias_size_in_bytes
        + stats.generated_code_size_in_bytes
    )
    return int(max(total, getattr(stats, "peak_memory_in_bytes", 0)))


def _profile_device(
    step, params, make_batch, device, batch_sizes, repeats, warmup, time_budget, pace
):
    device_params = jax.device_put(params, device)
    stats = device.memory_stats()
    use_device_stats = bool(stats) and "peak_bytes_in_use" in stats
    times, spreads, marks, compiled_peaks = [], [], [], []
    rose = True
    compile_seconds = 0.0
    for b in batch_sizes:
        if use_device_stats:
            before = device.memory_stats()["peak_bytes_in_use"]
        batch = jax.device_put(make_batch(b), device)
        start = time.perf_counter()
        compiled = step.lower(device_params, batch).compile()
        compile_seconds += time.perf_counter() - start
        start = time.perf_counter()
        for _ in range(warmup):
            t0 = time.perf_counter()
            jax.block_until_ready(compiled(device_params, batch))
            if pace is not None:
                pace(time.perf_counter() - t0)
            if time.perf_counter() - start > time_budget:
                break
        samples = []
        while not samples or (
            len(samples) < repeats and time.perf_counter() - start < time_budget
        ):
            t0 = time.perf_counter()
            jax.block_until_ready(compiled(device_params, batch))
            samples.append(time.perf_counter() - t0)
            if pace is not None:
                pace(samples[-1])
        times.append(statistics.median(samples))
        spreads.append(
            statistics.pstdev(samples) / statistics.fmean(samples)
            if len(samples) >= MIN_SPREAD_SAMPLES
            else None
        )
        compiled_peaks.append(_compiled_peak_bytes(compiled))
        if use_device_stats:
            # Batch sizes run in increasing order, so the process high-water mark
            # read after each is the peak of this size's step (plus whatever else
            # the process holds, which counts against the same bytes_limit)...
            marks.append(int(device.memory_stats()["peak_bytes_in_use"]))
            rose = rose and marks[-1] > before
    if use_device_stats and rose:
        peak, source = tuple(marks), "device"
    elif any(m is None for m in compiled_peaks):
        peak, source = None, None
    else:
        # ... unless a larger program of this process set the mark before: then
        # it reads the same for every size, and XLA's count of the step's
        # buffers is the measure.
        peak, source = tuple(compiled_peaks), "compiled"
    capacity = None
    if stats and stats.get("bytes_limit"):
        capacity = int(stats["bytes_limit"])
    device_profile = DeviceProfile(
        device_id=device.id,
        platform=device.platform,
        device_kind=device.device_kind,
        batch_sizes=tuple(batch_sizes),
        step_times=tuple(max(t, 1e-9) for t in times),
        peak_memory=peak,
        memory_source=source,
        memory_capacity=capacity,
        step_spread=_filled_spread(batch_sizes, spreads),
    )
    return device_profile, compile_seconds


def _filled_spread(
    batch_sizes: Sequence[int], spreads: Sequence[float | None]
) -> tuple[float, ...] | None:
    """Each size's measured spread; a size whose time budget allowed too few
    steps takes the nearest measured size's. ``None`` when none was measured."""
    measured = [
        (b, x) for b, x in zip(batch_sizes, spreads, strict=True) if x is not None
    ]
    if not measured:
        return None
    return tuple(
        x if x is not None else min(measured, key=lambda m: abs(m[0] - b))[1]
        for b, x in zip(batch_sizes, spreads, strict=True)
    )


def profile(
    step_fn: Callable[[Any, Any], Any],
    params: Any,
    make_batch: Callable[[int], Any],
    *,
    batch_sizes: Sequence[int] = (16, 64, 256),
    devices: Sequence[jax.Device] | None = None,
    repeats: int = 5,
    warmup: int = 1,
    time_budget: float = 1.0,
    transfer: Any = None,
    codec: Any = None,
    worker_id: int | str = 0,
    memory_capacity: int | None = None,
    pace: Callable[[float], Any] | None = None,
) -> WorkerProfile:
    r"""Profiles a train step on each local device and the worker's link.

    For every device ``d`` and batch size ``b`` the step is compiled, run
    ``warmup`` times, then timed ``repeats`` times; the median is ``t_d(b)``, and the
    least-squares line

    .. math::

      t_d(b) = a_d + c_d \, b, \qquad a_d, c_d \ge 0

    gives the throughput ``b / t_d(b)`` at any batch. Peak memory per batch size is
    fitted the same way. Devices are measured one after the other so that they do
    not compete for the host.

    Args:
      step_fn: the train step, a pure function ``step_fn(params, batch)`` (model,
        loss and optimizer update); it is jitted here, once per device and batch
        size. Its output is waited for and discarded.
      params: the model parameters (any pytree of arrays).
      make_batch: ``make_batch(b)`` returns a batch of ``b`` samples, the pytree
        ``step_fn`` takes.
      batch_sizes: batch sizes to measure; a wide spread (here 16 to 256) fits the
        line well.
      devices: devices to profile; ``jax.local_devices()`` by default.
      repeats: timed runs per batch size, at most.
      warmup: untimed runs after compiling, at most.
      time_budget: seconds of running (compiling excluded) per batch size and
        device; warm-up and timed runs stop once it is spent, after at least one
        timed run, so that a big model's largest batch does not dominate the
        cost of the pass.
      transfer: how to profile the link to the server: ``None`` (not profiled), a
        :class:`Link` (estimated from bandwidth and latency), a
        :class:`TransferProfile` (already measured, e.g. by awaiting
        :func:`measure_transfer` on the event loop of a connected client), or an
        unconnected ``hpsjax.ps.Client`` or async round-trip callable, measured
        here with ``asyncio.run`` (see :func:`measure_transfer`).
      codec: the push codec; the pushed bytes are ``encoded_nbytes`` of each leaf.
      worker_id: id of this worker.
      memory_capacity: bytes each device may use, overriding the backend's
        ``bytes_limit`` (CPU devices report none).
      pace: called after each warm-up and timed step with the seconds it
        took, outside the timing: e.g. a worker that the run slows down ``k``
        times sleeps ``(k - 1)`` times that, so that workers profiled together
        load the machine as they will in the run.

    Returns:
      A :class:`WorkerProfile` with one :class:`DeviceProfile` per device.

    Raises:
      ValueError: bad arguments (checked before anything runs), or a measured
        transfer requested while an event loop is running in this thread.

    Examples:
      >>> import jax, jax.numpy as jnp
      >>> def step(w, batch):
      ...   return w - 0.1 * jax.grad(lambda w: jnp.mean((batch @ w) ** 2))(w)
      >>> prof = profile(step, jnp.ones(4), lambda b: jnp.ones((b, 4)),
      ...                batch_sizes=(8, 64), repeats=2)
      >>> len(prof.devices) == len(jax.local_devices())
      True

    References:
      Xian, Li, Liu, Guo, Du, "H-PS: A Heterogeneous-Aware Parameter Server With
      Distributed Neural Network Training", IEEE Access, 2021,
      https://doi.org/10.1109/ACCESS.2021.3060154

      Shen, Tang, Zhou, Zhang, Jia, Yu, Zhang, Li, "ASHL: An Adaptive Multi-Stage
      Distributed Deep Learning Training Scheme for Heterogeneous Environments",
      IEEE Transactions on Computers, 2024,
      https://doi.org/10.1109/TC.2023.3315847
    """
    if not callable(step_fn) or not callable(make_batch):
        raise ValueError("step_fn and make_batch must be callable")
    sizes = [_check_positive_int("batch size", b) for b in batch_sizes]
    if not sizes or len(set(sizes)) != len(sizes):
        raise ValueError(f"batch_sizes must be distinct and non-empty, got {sizes}")
    sizes.sort()
    repeats = _check_positive_int("repeats", repeats)
    if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 0:
        raise ValueError(f"warmup must be a non-negative int, got {warmup!r}")
    time_budget = _check_finite("time_budget", time_budget, positive=True)
    _check_worker_id(worker_id)
    devices = list(jax.local_devices() if devices is None else devices)
    if not devices:
        raise ValueError("devices is empty")
    if len({d.id for d in devices}) != len(devices):
        raise ValueError("devices repeat")
    if memory_capacity is not None:
        memory_capacity = _check_positive_int("memory_capacity", memory_capacity)
    if pace is not None and not callable(pace):
        raise ValueError(f"pace must be callable or None, got {pace!r}")
    measured = not (transfer is None or isinstance(transfer, Link | TransferProfile))
    if measured:
        if not (_is_client(transfer) or callable(transfer)):
            raise ValueError(
                "transfer must be None, a Link, a TransferProfile, a connected "
                f"Client or an async callable; got {type(transfer).__name__}"
            )
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            pass
        else:
            raise ValueError(
                "profile() cannot measure the transfer inside a running event "
                "loop; await measure_transfer(...) and pass its result as transfer="
            )
        if _is_client(transfer) and not getattr(transfer, "closed", True):
            # A connection lives on the event loop that opened it, and profile()
            # would measure on a new one.
            raise ValueError(
                "a connected Client can only be measured on its own event loop: "
                "await measure_transfer(client, ...) there and pass the result as "
                "transfer=, or pass the Client unconnected"
            )

    start = time.perf_counter()
    step = jax.jit(step_fn)
    device_profiles = []
    compile_seconds = 0.0
    for device in devices:
        prof, seconds = _profile_device(
            step,
            params,
            make_batch,
            device,
            sizes,
            repeats,
            warmup,
            time_budget,
            pace,
        )
        if memory_capacity is not None:
            prof = dataclasses.replace(prof, memory_capacity=memory_capacity)
        device_profiles.append(prof)
        compile_seconds += seconds

    if transfer is None or isinstance(transfer, TransferProfile):
        transfer_profile = transfer
    elif isinstance(transfer, Link):
        transfer_profile = transfer.estimate(
            tree_wire_nbytes(params, codec), tree_wire_nbytes(params)
        )
    else:
        transfer_profile = asyncio.run(measure_transfer(transfer, params, codec=codec))

    leaves = jax.tree.leaves(params)
    return WorkerProfile(
        worker_id=worker_id,
        devices=tuple(device_profiles),
        transfer=transfer_profile,
        param_count=int(sum(math.prod(x.shape) for x in leaves)),
        param_bytes=tree_wire_nbytes(params),
        profile_seconds=time.perf_counter() - start,
        compile_seconds=compile_seconds,
    )


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
