"""The profiles a plan is made from: each device's fitted time and memory, the link.

:class:`WorkerProfile` (one :class:`DeviceProfile` per local device, with a
:class:`LinearFit` of time and of memory against the batch, and a
:class:`TransferProfile` of the round trip to the server) is what the
profiling pass (:func:`hpsjax.profiling.profile`) measures, a :class:`Link`
estimates and a pilot fits; they are plain, JSON-serialisable dataclasses with
no JAX in them, so that planning runs wherever a plan is made.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Sequence

import numpy as np

from hpsjax._checks import (
    check_int,
    check_number,
    check_positive,
    check_worker_id,
)

__all__ = [
    "PROFILE_FORMAT",
    "PROFILE_FORMAT_VERSION",
    "DeviceProfile",
    "LinearFit",
    "Link",
    "TransferProfile",
    "WorkerProfile",
]

PROFILE_FORMAT = "hpsjax.WorkerProfile"
PROFILE_FORMAT_VERSION = 1

_MEMORY_SOURCES = ("device", "compiled", "synthetic")
_TRANSFER_METHODS = ("measured", "estimated")


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
        check_number("intercept", self.intercept, low=0)
        check_number("slope", self.slope, low=0)

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
        it (:func:`hpsjax.planning.plan`).
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
            check_int("batch size", b, low=1) for b in tuple(self.batch_sizes)
        )
        if not sizes:
            raise ValueError("a DeviceProfile needs at least one batch size")
        if list(sizes) != sorted(set(sizes)):
            raise ValueError(f"batch_sizes must be increasing, got {sizes}")
        times = tuple(check_positive("step time", t) for t in self.step_times)
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
                check_int("memory_capacity", self.memory_capacity, low=1),
            )
        if self.step_spread is not None:
            spread = tuple(
                check_number("step spread", x, low=0) for x in self.step_spread
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
        sps = check_positive("samples_per_second", samples_per_second)
        overhead = check_number("overhead", overhead, low=0)
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
        factor = check_positive("slowdown factor", factor)
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
        request's round trip to the same server
        (:func:`hpsjax.profiling.measure_transfer`).
        Pushes that arrive together wait for each other's, which a barrier
        round's plan counts (:func:`hpsjax.planning.plan`).
    """

    round_trip_seconds: float
    push_seconds: float | None
    pull_seconds: float | None
    push_bytes: int
    pull_bytes: int
    method: str
    server_seconds: float | None = None

    def __post_init__(self):
        check_number("round_trip_seconds", self.round_trip_seconds, low=0)
        for name in ("push_seconds", "pull_seconds", "server_seconds"):
            value = getattr(self, name)
            if value is not None:
                check_number(name, value, low=0)
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
        check_positive("bandwidth", self.bandwidth)
        check_number("latency", self.latency, low=0)

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
        check_worker_id("worker_id", self.worker_id)
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
        check_number("profile_seconds", self.profile_seconds, low=0)
        check_number("compile_seconds", self.compile_seconds, low=0)

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
            transfer_seconds = check_number("transfer_seconds", transfer_seconds, low=0)
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
