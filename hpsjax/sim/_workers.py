r"""Simulated workers: how long a step takes, how fast a link is, what a worker does.

A simulated worker is described by a :class:`WorkerSpec`: its **compute model**
(:class:`ComputeModel`, seconds per local step as a function of the batch size,
with random jitter and transient stragglers), its **heterogeneity** (the same
:class:`~hpsjax.worker._hetero.Heterogeneity` that real runs inject: a slowdown
schedule, a bandwidth schedule and a latency), and its work per round (batch
size, local steps, step-size scale; a :class:`~hpsjax.planning.WorkPlan`
overrides them).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np

from hpsjax._checks import check_int, check_number
from hpsjax.planning import WorkerProfile
from hpsjax.worker import Heterogeneity

__all__ = ["ComputeModel", "WorkerSpec", "make_workers"]


@dataclasses.dataclass(frozen=True)
class ComputeModel:
    r"""Seconds per local step of one simulated worker.

    The mean time of a step on :math:`b` samples is linear in :math:`b`,

    .. math::

       \bar d(b) = o + (T - o)\,\frac{b}{b_\text{ref}},

    :math:`T` = ``step_time`` at :math:`b_\text{ref}` = ``reference_batch``
    samples and :math:`o` = ``overhead`` the part that does not grow with the
    batch. Each step is then multiplied by a mean-one lognormal jitter of spread
    ``sigma`` and, with probability ``straggle_probability``, by
    ``straggle_slowdown`` (a transient straggler).

    Attributes:
      step_time: :math:`T`, mean seconds per local step at ``reference_batch``
        samples, > 0.
      reference_batch: :math:`b_\text{ref}`; ``None`` takes the batch size of the
        :class:`WorkerSpec` it is given to.
      overhead: :math:`o`, seconds of a step independent of the batch size, in
        ``[0, step_time]``.
      sigma: spread of the lognormal jitter, >= 0 (0: no jitter).
      straggle_probability: chance that a step is a straggler, in ``[0, 1]``.
      straggle_slowdown: how many times longer a straggling step takes, >= 1.

    Raises:
      ValueError: for a value out of range.

    Examples:
      >>> model = ComputeModel(step_time=0.2, reference_batch=32, overhead=0.04)
      >>> round(model.mean_step_time(64), 6)
      0.36
    """

    step_time: float = 0.1
    reference_batch: int | None = None
    overhead: float = 0.0
    sigma: float = 0.0
    straggle_probability: float = 0.0
    straggle_slowdown: float = 1.0

    def __post_init__(self):
        step_time = check_number(
            "step_time", self.step_time, low=0.0, low_inclusive=False
        )
        if self.reference_batch is not None:
            check_int("reference_batch", self.reference_batch, low=1)
        overhead = check_number("overhead", self.overhead, low=0.0)
        if overhead > step_time:
            raise ValueError(
                f"overhead ({overhead}) must not exceed step_time ({step_time})."
            )
        check_number("sigma", self.sigma, low=0.0)
        p = check_number("straggle_probability", self.straggle_probability, low=0.0)
        if p > 1:
            raise ValueError(f"straggle_probability must be <= 1, got {p}.")
        check_number("straggle_slowdown", self.straggle_slowdown, low=1.0)

    @classmethod
    def from_profile(
        cls,
        profile: WorkerProfile,
        *,
        sigma: float = 0.0,
        straggle_probability: float = 0.0,
        straggle_slowdown: float = 1.0,
    ) -> ComputeModel:
        r"""The compute model of a profiled worker, :math:`t(b) = a + c b`.

        A worker with several devices splits a batch over them in proportion to
        their throughput; its step then takes :math:`\max_d a_d + b / \sum_d
        c_d^{-1}` (exact when the devices' fixed costs :math:`a_d` are equal).

        Args:
          profile: the worker's profile (measured, or
            :meth:`~hpsjax.planning.WorkerProfile.synthetic`).
          sigma: lognormal jitter, as for the constructor.
          straggle_probability: as for the constructor.
          straggle_slowdown: as for the constructor.

        Returns:
          A :class:`ComputeModel` with ``reference_batch=1``.

        Examples:
          >>> from hpsjax.planning import WorkerProfile
          >>> model = ComputeModel.from_profile(
          ...     WorkerProfile.synthetic(0, 100.0, overhead=0.01))
          >>> round(model.mean_step_time(50), 6)
          0.51
        """
        if not isinstance(profile, WorkerProfile):
            raise ValueError(
                f"profile must be a WorkerProfile, got {type(profile).__name__}."
            )
        fits = [d.time_fit for d in profile.devices]
        intercept = max(f.intercept for f in fits)
        if any(f.slope == 0 for f in fits):
            slope = 0.0
        else:
            slope = 1.0 / sum(1.0 / f.slope for f in fits)
        if intercept + slope <= 0:
            raise ValueError(
                f"profile of worker {profile.worker_id!r} predicts steps of zero "
                "seconds; it cannot drive a simulated clock."
            )
        return cls(
            step_time=intercept + slope,
            reference_batch=1,
            overhead=intercept,
            sigma=sigma,
            straggle_probability=straggle_probability,
            straggle_slowdown=straggle_slowdown,
        )

    def mean_step_time(self, batch_size: int) -> float:
        """Mean seconds of one local step on ``batch_size`` samples (no jitter).

        Raises:
          ValueError: if ``reference_batch`` is still ``None`` (give the model to a
            :class:`WorkerSpec`, which fills it in).
        """
        if self.reference_batch is None:
            raise ValueError(
                "reference_batch is None: the model takes its WorkerSpec's batch "
                "size; give it to a WorkerSpec first."
            )
        per_sample = (self.step_time - self.overhead) / self.reference_batch
        return self.overhead + per_sample * batch_size

    def draw(self, rng: np.random.Generator, batch_size: int, steps: int) -> np.ndarray:
        """Seconds of ``steps`` consecutive local steps before any slowdown.

        Args:
          rng: the worker's generator (advanced only by the random parts in use,
            so a model without jitter consumes no randomness).
          batch_size: samples per step.
          steps: number of steps.

        Returns:
          A float64 array of shape ``(steps,)``.
        """
        times = np.full(steps, self.mean_step_time(batch_size))
        if self.sigma > 0:
            times *= np.exp(
                self.sigma * rng.standard_normal(steps) - 0.5 * self.sigma**2
            )
        if self.straggle_probability > 0 and self.straggle_slowdown > 1:
            straggle = rng.random(steps) < self.straggle_probability
            times = np.where(straggle, times * self.straggle_slowdown, times)
        return times


@dataclasses.dataclass(frozen=True)
class WorkerSpec:
    """One simulated worker.

    Attributes:
      compute: its :class:`ComputeModel`; a model without ``reference_batch``
        takes ``batch_size``.
      heterogeneity: its slowdown schedule, bandwidth schedule and latency, as
        injected in real runs (times are seconds since the worker joined), or
        ``None`` for full speed and an instantaneous link.
      batch_size: samples per local step, >= 1 (a work plan overrides it).
      local_steps: local steps per push, >= 1 (a work plan, a policy's hint or a
        stage overrides it).
      lr_scale: factor on the step size of its updates, >= 0 (a work plan
        overrides it).
      worker_id: its id at the server (``str`` or ``int``); ``None`` uses its
        position in the list of workers.
      join_time: virtual time (s) at which it joins, >= 0.
      leave_time: virtual time (s) at which it leaves for good, or ``None``.
      startup_time: seconds its first round's compute takes beyond the compute
        model, >= 0 (default 0: it starts hot): what a real worker loses in
        its first round loading its compiled step and running it slowed down.
        Charged as compute time, as processes count it; the slowdown schedule
        does not scale it (it is wall time of the worker it was measured on).

    Raises:
      ValueError: for a value out of range.

    Examples:
      >>> spec = WorkerSpec(ComputeModel(step_time=0.5), batch_size=64)
      >>> spec.compute.reference_batch
      64
    """

    compute: ComputeModel = ComputeModel()
    heterogeneity: Heterogeneity | None = None
    batch_size: int = 32
    local_steps: int = 1
    lr_scale: float = 1.0
    worker_id: int | str | None = None
    join_time: float = 0.0
    leave_time: float | None = None
    startup_time: float = 0.0

    def __post_init__(self):
        if not isinstance(self.compute, ComputeModel):
            raise ValueError(
                f"compute must be a ComputeModel, got {type(self.compute).__name__}."
            )
        if self.heterogeneity is not None and not isinstance(
            self.heterogeneity, Heterogeneity
        ):
            raise ValueError(
                "heterogeneity must be a hpsjax Heterogeneity or None, got "
                f"{type(self.heterogeneity).__name__}."
            )
        check_int("batch_size", self.batch_size, low=1)
        check_int("local_steps", self.local_steps, low=1)
        check_number("lr_scale", self.lr_scale, low=0.0)
        if self.worker_id is not None and (
            isinstance(self.worker_id, bool)
            or not isinstance(self.worker_id, int | str)
        ):
            raise ValueError(
                f"worker_id must be an int, a str or None, got {self.worker_id!r}."
            )
        join = check_number("join_time", self.join_time, low=0.0)
        check_number("startup_time", self.startup_time, low=0.0)
        if self.leave_time is not None:
            leave = check_number("leave_time", self.leave_time, low=0.0)
            if leave <= join:
                raise ValueError(
                    f"leave_time ({leave}) must come after join_time ({join})."
                )
        if self.compute.reference_batch is None:
            object.__setattr__(
                self,
                "compute",
                dataclasses.replace(self.compute, reference_batch=self.batch_size),
            )


def make_workers(
    num_workers: int,
    *,
    step_time: float = 0.1,
    batch_size: int = 32,
    speed_sigma: float = 0.0,
    straggler_fraction: float = 0.0,
    straggler_slowdown: float = 4.0,
    jitter: float = 0.0,
    bandwidth: float | None = None,
    bandwidth_sigma: float = 0.0,
    latency: float = 0.0,
    local_steps: int = 1,
    seed: int = 0,
) -> list[WorkerSpec]:
    r"""Draws a heterogeneous population of simulated workers.

    Worker :math:`i` gets a mean step time :math:`T_i = T e^{\sigma_s z_i}`
    (:math:`z_i \sim \mathcal N(0, 1)`; median :math:`T`), times
    ``straggler_slowdown`` for a randomly chosen ``round(straggler_fraction * n)``
    workers (heavy, permanent stragglers), per-step jitter ``jitter``, and a link
    of bandwidth :math:`B e^{\sigma_B y_i}` bytes/s and latency ``latency``.

    Args:
      num_workers: :math:`n`, >= 1.
      step_time: :math:`T`, the median seconds per local step at ``batch_size``.
      batch_size: samples per local step.
      speed_sigma: :math:`\sigma_s`, spread of the workers' speeds, >= 0.
      straggler_fraction: share of heavy stragglers, in ``[0, 1]``.
      straggler_slowdown: how much slower a heavy straggler is, >= 1.
      jitter: lognormal per-step jitter of every worker (``ComputeModel.sigma``).
      bandwidth: median link bandwidth :math:`B` (bytes/s), or ``None`` for
        instantaneous links (latency only).
      bandwidth_sigma: :math:`\sigma_B`, spread of the bandwidths, >= 0.
      latency: seconds added to every message, >= 0.
      local_steps: local steps per push of every worker.
      seed: seed of the draws.

    Returns:
      ``num_workers`` :class:`WorkerSpec` with ids ``0 .. n-1``.

    Raises:
      ValueError: for an argument out of range.

    Examples:
      >>> workers = make_workers(8, straggler_fraction=0.25, seed=0)
      >>> sorted(round(w.compute.step_time, 3) for w in workers)
      [0.1, 0.1, 0.1, 0.1, 0.1, 0.1, 0.4, 0.4]
    """
    n = check_int("num_workers", num_workers, low=1)
    step_time = check_number("step_time", step_time, low=0.0, low_inclusive=False)
    check_int("batch_size", batch_size, low=1)
    speed_sigma = check_number("speed_sigma", speed_sigma, low=0.0)
    fraction = check_number("straggler_fraction", straggler_fraction, low=0.0)
    if fraction > 1:
        raise ValueError(f"straggler_fraction must be <= 1, got {fraction}.")
    slowdown = check_number("straggler_slowdown", straggler_slowdown, low=1.0)
    check_number("jitter", jitter, low=0.0)
    if bandwidth is not None:
        bandwidth = check_number("bandwidth", bandwidth, low=0.0, low_inclusive=False)
    bandwidth_sigma = check_number("bandwidth_sigma", bandwidth_sigma, low=0.0)
    latency = check_number("latency", latency, low=0.0)
    check_int("local_steps", local_steps, low=1)
    if isinstance(seed, bool) or not isinstance(seed, int | np.integer) or seed < 0:
        raise ValueError(f"seed must be an int >= 0, got {seed!r}.")

    rng = np.random.default_rng(seed)
    speeds = np.exp(speed_sigma * rng.standard_normal(n))
    stragglers = np.zeros(n, bool)
    stragglers[rng.permutation(n)[: round(fraction * n)]] = True
    links = np.exp(bandwidth_sigma * rng.standard_normal(n))
    workers = []
    for i in range(n):
        seconds = step_time * float(speeds[i]) * (slowdown if stragglers[i] else 1.0)
        het = None
        if bandwidth is not None or latency > 0:
            het = Heterogeneity(
                bandwidth=None if bandwidth is None else bandwidth * float(links[i]),
                latency=latency,
            )
        workers.append(
            WorkerSpec(
                compute=ComputeModel(step_time=seconds, sigma=jitter),
                heterogeneity=het,
                batch_size=batch_size,
                local_steps=local_steps,
                worker_id=i,
            )
        )
    return workers


def schedule_value(schedule: Sequence[tuple[float, Any]], t: float) -> Any:
    """The value of a piecewise-constant ``((t0, v0), (t1, v1), ...)`` at ``t``."""
    value = schedule[0][1]
    for start, v in schedule:
        if start > t:
            break
        value = v
    return value


def finish_time(
    schedule: Sequence[tuple[float, float]], start: float, durations: np.ndarray
) -> float:
    """When consecutive steps of the given base ``durations`` end.

    Each step starting at time ``t`` takes ``k(t)`` times its base duration, with
    ``k`` the slowdown schedule (times relative to the same origin as ``start``).
    """
    if len(schedule) == 1:
        return start + schedule[0][1] * float(durations.sum())
    t = start
    for d in durations.tolist():
        t += schedule_value(schedule, t) * d
    return t
