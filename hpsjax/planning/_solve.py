"""The plan's arithmetic: batches, local steps and the predicted round from time models.

Each worker is a time model (per device: fixed cost, cost per sample, the
fastest time per sample measured, a memory cap, the step's spread) built from
a profile or from a plan in force; the solver turns the models into a
:class:`~hpsjax.planning.WorkPlan` under a scheme (``_solve``), by water-filling batches
over devices, choosing each scheme's local steps and predicting the round with
the server's queue and the slowest worker's spread (the notes in the docs,
``docs/api/planning.md``, give the formulas). NumPy float64, no I/O.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from hpsjax.planning._profiles import WorkerProfile
from hpsjax.planning._workplan import (
    MIN_COMPRESS_RATIO,
    DevicePlan,
    WorkerPlan,
    WorkPlan,
)

__all__ = ["lr_scale"]

# The schemes whose rounds end at a barrier of every worker's push: the
# server's queue of pushes is part of their round.
_BARRIER_SCHEMES = ("hps", "equal", "ashl")
# Draws of the workers' step times behind a barrier round's expected maximum.
_SPREAD_DRAWS = 4096

_log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class _DeviceModel:
    device_id: int
    intercept: float
    slope: float
    floor: float
    max_batch: int | None
    # The step's coefficient of variation at these batch sizes (interpolated).
    spread_sizes: tuple[float, ...] = (1.0,)
    spreads: tuple[float, ...] = (0.0,)

    def time(self, b: float) -> float:
        return max(self.intercept + self.slope * b, self.floor * b)

    def spread(self, b: float) -> float:
        return float(np.interp(b, self.spread_sizes, self.spreads))


@dataclasses.dataclass(frozen=True)
class _WorkerModel:
    worker_id: int | str
    transfer: float
    devices: tuple[_DeviceModel, ...]
    # The push's part of ``transfer``, ``None`` when only the round trip is known.
    push: float | None = None

    @property
    def push_seconds(self) -> float:
        """The push's seconds: as profiled, else half the round trip."""
        return self.transfer / 2 if self.push is None else self.push

    def refitted(self, intercept_shift: float, slope_factor: float) -> _WorkerModel:
        """This worker with its fixed cost shifted and its per-sample cost scaled."""
        return dataclasses.replace(
            self,
            devices=tuple(
                dataclasses.replace(
                    d,
                    intercept=max(d.intercept + intercept_shift, 0.0),
                    slope=d.slope * slope_factor,
                    floor=d.floor * slope_factor,
                )
                for d in self.devices
            ),
        )


def _model_from_profile(profile: WorkerProfile, memory_fraction: float):
    devices = []
    for d in profile.devices:
        fit = d.time_fit
        intercept, slope = fit.intercept, fit.slope
        if slope <= 0:
            # Steps that did not get longer over the measured batches give no
            # per-sample cost; the line through the largest measurement is the
            # cautious stand-in, since the time must grow with the batch somewhere.
            intercept = 0.0
            slope = d.step_times[-1] / d.batch_sizes[-1]
        if not (slope > 0 and math.isfinite(slope)):
            raise ValueError(
                f"worker {profile.worker_id!r} device {d.device_id}: non-positive speed"
            )
        devices.append(
            _DeviceModel(
                device_id=d.device_id,
                intercept=intercept,
                slope=slope,
                floor=d.best_time_per_sample,
                max_batch=d.max_batch(memory_fraction=memory_fraction),
                spread_sizes=tuple(float(b) for b in d.batch_sizes),
                spreads=d.step_spread or (0.0,) * len(d.batch_sizes),
            )
        )
    push = None if profile.transfer is None else profile.transfer.push_seconds
    if push is not None:
        push = min(push, profile.transfer_seconds)
    return _WorkerModel(
        profile.worker_id, profile.transfer_seconds, tuple(devices), push
    )


def _model_from_worker_plan(w: WorkerPlan) -> _WorkerModel:
    return _WorkerModel(
        w.worker_id,
        w.transfer_seconds,
        tuple(
            _DeviceModel(
                d.device_id,
                d.time_intercept,
                d.time_slope,
                d.best_time_per_sample,
                d.max_batch,
                spreads=(d.step_spread,),
            )
            for d in w.devices
        ),
        w.push_seconds,
    )


def _round_keeping_sum(
    xs: Sequence[float], total: int, lo: Sequence[int], hi: Sequence[float]
) -> list[int]:
    """Integers near ``xs`` that sum to ``total`` within ``[lo, hi]``.

    Largest remainder: floor everything, then hand the missing units to the
    largest fractional parts (earlier entries first on ties).
    """
    ints = [
        min(max(math.floor(x), low), high)
        for x, low, high in zip(xs, lo, hi, strict=True)
    ]
    short = total - sum(ints)
    order = sorted(range(len(xs)), key=lambda j: (-(xs[j] - ints[j]), j))
    while short > 0:
        for j in order:
            if short > 0 and ints[j] < hi[j]:
                ints[j] += 1
                short -= 1
    while short < 0:
        for j in reversed(order):
            if short < 0 and ints[j] > lo[j]:
                ints[j] -= 1
                short += 1
    return [int(i) for i in ints]


@dataclasses.dataclass(frozen=True)
class _Lane:
    """A device seen by the water-filling: ``offset + steps * t_d(b)`` seconds."""

    device: _DeviceModel
    offset: float
    steps: int
    lo: int
    hi: float

    def time(self, b: float) -> float:
        return self.offset + self.steps * self.device.time(b)

    def batch(self, tau: float) -> float:
        """The batch that finishes at ``tau``, within ``[lo, hi]``."""
        u = (tau - self.offset) / self.steps
        d = self.device
        b = min((u - d.intercept) / d.slope, u / d.floor)
        return min(max(b, self.lo), self.hi)

    def breakpoints(self) -> list[float]:
        """Finish times where ``batch`` changes slope."""
        points = [self.time(self.lo)]
        if math.isfinite(self.hi):
            points.append(self.time(self.hi))
        d = self.device
        if d.floor > d.slope:
            kink = d.intercept / (d.floor - d.slope)
            if self.lo < kink < self.hi:
                points.append(self.time(kink))
        return points


def _water_fill(lanes: Sequence[_Lane], total: int) -> list[int]:
    r"""Integer batches with which all lanes finish together, summing to ``total``.

    Solves ``sum_j b_j(tau) = total`` for the finish time ``tau``, where
    ``b_j(tau)`` inverts lane ``j``'s time and is clipped to its limits. Each
    ``b_j`` is continuous, non-decreasing and piecewise linear in ``tau``, so the
    sum is too, and ``tau`` is found exactly on the segment between two
    consecutive breakpoints; the batches are then rounded keeping the sum. For
    lanes of time ``c_j b`` this gives ``b_j`` proportional to ``1 / c_j``, the
    throughput; a lane at its cap passes the rest to the others.
    """

    def filled(tau):
        return sum(lane.batch(tau) for lane in lanes)

    points = sorted({p for lane in lanes for p in lane.breakpoints()})
    tau = points[0]
    previous, level = points[0], filled(points[0])
    if level < total:
        for point in points[1:]:
            next_level = filled(point)
            if next_level >= total:
                tau = previous + (total - level) * (point - previous) / (
                    next_level - level
                )
                break
            previous, level = point, next_level
        else:
            # Past the last breakpoint every uncapped lane grows linearly.
            rate = filled(previous + 1.0) - level
            tau = previous + (total - level) / rate
    return _round_keeping_sum(
        [lane.batch(tau) for lane in lanes],
        total,
        [lane.lo for lane in lanes],
        [lane.hi for lane in lanes],
    )


def lr_scale(global_batch: int, reference: float, lr_scaling: str) -> float:
    """The step-size scale of every worker of a plan of ``global_batch`` samples
    (see :func:`hpsjax.planning.plan`, "Step-size scale")."""
    if lr_scaling == "linear":
        return global_batch / reference
    if lr_scaling == "sqrt":
        return math.sqrt(global_batch / reference)
    return 1.0


def _limits(model: _WorkerModel, min_device_batch: int, min_batch: int):
    # The worker's minimum is spread over its devices, so their sum reaches it.
    low = max(min_device_batch, -(-min_batch // len(model.devices)))
    lo, hi = [], []
    for d in model.devices:
        cap = math.inf if d.max_batch is None else d.max_batch
        if cap < low:
            raise ValueError(
                f"worker {model.worker_id!r} device {d.device_id}: not even "
                f"{low} sample(s) fit its memory"
            )
        lo.append(low)
        hi.append(cap)
    return lo, hi


def _hps_batches(
    models, limits, global_batch: int, local_steps: int, stagger: float = 0.0
):
    """Per worker, its devices' batches with which all finish a round together,
    or, with ``stagger`` > 0, one after another ``stagger`` seconds apart, the
    fastest worker last."""
    # Every device of worker i finishes its H local steps and the transfer at
    # the same time: lane time H t_d(b) + T_i (+ its place times the stagger).
    speed = [sum(1.0 / d.slope for d in m.devices) for m in models]
    place = [0] * len(models)
    for k, i in enumerate(sorted(range(len(models)), key=lambda j: -speed[j])):
        place[i] = k
    lanes = [
        _Lane(d, m.transfer + place[i] * stagger, local_steps, low, high)
        for i, (m, (m_lo, m_hi)) in enumerate(zip(models, limits, strict=True))
        for d, low, high in zip(m.devices, m_lo, m_hi, strict=True)
    ]
    flat = iter(_water_fill(lanes, global_batch))
    return [[next(flat) for _ in m.devices] for m in models]


def _warn_min_batch(models, global_batch, local_steps, min_device_batch, min_batch):
    """Logs the workers that only ``min_batch`` keeps from a smaller batch."""
    free = _hps_batches(
        models,
        [_limits(m, min_device_batch, 1) for m in models],
        global_batch,
        local_steps,
    )
    held = [
        m.worker_id for m, b in zip(models, free, strict=True) if sum(b) < min_batch
    ]
    if held:
        _log.warning(
            "plan: finishing together would give batches %s; workers %s get "
            "min_batch=%d instead (their step time is mostly fixed cost, or they "
            "are far slower than the rest)",
            [sum(b) for b in free],
            held,
            min_batch,
        )


def _queue_seconds(arrivals: Sequence[float], server_seconds: float) -> float:
    """The wait of a barrier round's last push behind the others at the server.

    ``arrivals``: when each push would be done alone (its own service in it);
    the server serves them one at a time, ``server_seconds`` each, in arrival
    order: push ``k`` is done at ``D_k = max(D_{k-1} + s, A_(k))``. Returns
    ``D_N - max A``.
    """
    if server_seconds <= 0 or len(arrivals) < 2:
        return 0.0
    a = np.sort(np.asarray(arrivals, dtype=np.float64))
    done = a[0]
    for x in a[1:]:
        done = max(done + np.float64(server_seconds), x)
    return float(done - a[-1])


def _expected_slowest(
    compute: Sequence[float], spreads: Sequence[float], transfers: Sequence[float]
) -> float:
    """``E[max_i (c_i X_i + t_i)]`` over the workers of a barrier round.

    ``X_i`` is lognormal with median 1 and coefficient of variation ``s_i``
    (compute times are skewed: a step can be held up a lot, not sped up much),
    the workers independent; the expectation is the mean of
    :data:`_SPREAD_DRAWS` draws from a fixed seed, so that a plan is a
    function of its profiles. All spreads 0: ``max_i (c_i + t_i)``.
    """
    c = np.asarray(compute, dtype=np.float64)
    t = np.asarray(transfers, dtype=np.float64)
    s = np.asarray(spreads, dtype=np.float64)
    if not np.any(s > 0):
        return float(np.max(c + t))
    sigma = np.sqrt(np.log1p(s**2))
    z = np.random.default_rng(0).standard_normal((_SPREAD_DRAWS, len(c)))
    return float(np.mean(np.max(c * np.exp(sigma * z) + t, axis=1)))


def _round_and_queue(models, device_batches, steps, server_seconds, scheme):
    """The predicted round (the slowest worker's, plus the queue) and the
    queue's seconds, of workers running ``steps`` local steps on their
    devices' ``device_batches``.

    A barrier round waits for the slowest worker *that round*: with steps
    that vary (profiled spreads), the expected maximum, above the slowest
    median (:func:`_expected_slowest`); ``h`` local steps vary ``sqrt(h)``
    times less than one."""
    compute, spreads = [], []
    for m, batches, h in zip(models, device_batches, steps, strict=True):
        times = [d.time(b) for d, b in zip(m.devices, batches, strict=True)]
        slow = int(np.argmax(times))
        compute.append(h * times[slow])
        spreads.append(m.devices[slow].spread(batches[slow]) / math.sqrt(max(h, 1)))
    transfers = [m.transfer for m in models]
    if scheme not in _BARRIER_SCHEMES:
        return max(c + t for c, t in zip(compute, transfers, strict=True)), 0.0
    slowest = _expected_slowest(compute, spreads, transfers)
    queue = _queue_seconds(
        [c + m.push_seconds for c, m in zip(compute, models, strict=True)],
        server_seconds,
    )
    return slowest + queue, queue


def _solve(
    models: Sequence[_WorkerModel],
    scheme: str,
    *,
    global_batch: int,
    lr_scaling: str,
    reference_batch: float,
    local_steps: int,
    min_device_batch: int,
    min_batch: int,
    max_local_steps: int | None,
    check_period: float | None,
    commits_per_period: int | None,
    revision: int,
    stage_multipliers: tuple[int, ...] = (),
    base_compress_ratio: float = 1.0,
    server_seconds: float = 0.0,
    device_batches: Sequence[Sequence[int]] | None = None,
) -> WorkPlan:
    """The plan of ``models`` under ``scheme``: :func:`hpsjax.planning.plan`'s
    arguments, checked, with the workers as time models; ``device_batches``,
    where given, are kept (each worker's per device) and the rest is planned
    around them."""
    limits = _checked_limits(models, global_batch, min_device_batch, min_batch)
    kept = device_batches is not None
    if kept:
        device_batches = [list(b) for b in device_batches]
    else:
        device_batches = _device_batches(
            models, limits, scheme, global_batch, local_steps, min_device_batch,
            min_batch,
        )  # fmt: skip
    if not kept and scheme == "hps" and server_seconds > 0 and len(models) > 1:
        device_batches = _staggered_if_shorter(
            models, limits, device_batches, global_batch, local_steps, server_seconds
        )
    step_times = [
        max(d.time(b) for d, b in zip(m.devices, batches, strict=True))
        for m, batches in zip(models, device_batches, strict=True)
    ]
    steps, extras, commit_interval, commits = _steps_and_extras(
        scheme, models, step_times, local_steps, check_period, commits_per_period,
        stage_multipliers, base_compress_ratio, max_local_steps,
    )  # fmt: skip
    busy, workers = [], []
    scale = lr_scale(global_batch, reference_batch, lr_scaling)
    for m, batches, t, h, extra in zip(
        models, device_batches, step_times, steps, extras, strict=True
    ):
        worker, device_busy = _worker_plan(scheme, m, batches, t, h, scale, **extra)
        busy += device_busy
        workers.append(worker)
    round_time, queue = _round_and_queue(
        models, device_batches, [w.local_steps for w in workers], server_seconds,
        scheme,
    )  # fmt: skip
    if scheme == "adsp":
        round_time = max(w.round_time for w in workers)
    idle = 1.0 - sum(busy) / (len(busy) * round_time) if round_time > 0 else 0.0
    return WorkPlan(
        scheme=scheme,
        global_batch=global_batch,
        workers=tuple(workers),
        round_time=round_time,
        idle_fraction=min(max(idle, 0.0), math.nextafter(1.0, 0.0)),
        lr_scaling=lr_scaling,
        reference_batch=reference_batch,
        local_steps=local_steps,
        min_device_batch=min_device_batch,
        min_batch=min_batch,
        max_local_steps=max_local_steps,
        commit_interval=commit_interval,
        commits_per_period=commits,
        revision=revision,
        stage_multipliers=stage_multipliers,
        base_compress_ratio=base_compress_ratio,
        server_seconds=float(server_seconds),
        queue_seconds=queue,
    )


def _staggered_if_shorter(
    models, limits, device_batches, global_batch, local_steps, server_seconds
):
    """``hps``'s batches: finishing together queues every push at the server;
    finishing one after another, ``server_seconds`` apart, queues none but asks
    more of the fast ones. The split with the shorter predicted round."""
    staggered = _hps_batches(
        models, limits, global_batch, local_steps, stagger=server_seconds
    )
    steps = [local_steps] * len(models)
    rounds = [
        _round_and_queue(models, b, steps, server_seconds, "hps")[0]
        for b in (device_batches, staggered)
    ]
    return staggered if rounds[1] < rounds[0] else device_batches


def _steps_and_extras(
    scheme, models, step_times, local_steps, check_period, commits_per_period,
    stage_multipliers, base_compress_ratio, max_local_steps,
):  # fmt: skip
    """Each worker's local steps and its other plan fields (stages, data
    share, push weight, top-k ratio), with ADSP's commit interval and commits
    per period (else ``None``)."""
    n = len(models)
    extras = [{} for _ in range(n)]
    commit_interval = commits = None
    if scheme == "ashl_reference":
        stage_steps, shares, ratios = _ashl_reference(
            models, step_times, stage_multipliers, base_compress_ratio, max_local_steps
        )
        steps = [h[0] for h in stage_steps]
        extras = [
            {
                "stage_local_steps": stages,
                "data_share": share,
                "push_weight": share,
                "compress_ratio": ratio,
            }
            for stages, share, ratio in zip(stage_steps, shares, ratios, strict=True)
        ]
    else:
        steps, commit_interval, commits = _scheme_local_steps(
            scheme, models, step_times, local_steps, check_period, commits_per_period
        )
    if max_local_steps is not None:
        steps = [min(h, max_local_steps) for h in steps]
    return steps, extras, commit_interval, commits


def _checked_limits(models, global_batch, min_device_batch, min_batch):
    """Each worker's per-device batch limits, once ``global_batch`` is known
    to fit between the minimum batches and the devices' memory."""
    n_devices = sum(len(m.devices) for m in models)
    if global_batch < n_devices * min_device_batch:
        raise ValueError(
            f"global batch {global_batch} is smaller than the {n_devices} devices "
            f"times the minimum batch per device ({min_device_batch})"
        )
    limits = [_limits(m, min_device_batch, min_batch) for m in models]
    if global_batch < sum(sum(lo) for lo, _ in limits):
        raise ValueError(
            f"global batch {global_batch} is smaller than the {len(models)} "
            f"workers times min_batch ({min_batch})"
        )
    capacity = sum(sum(hi) for _, hi in limits)
    if global_batch > capacity:
        raise ValueError(
            f"global batch {global_batch} does not fit the devices' memory "
            f"(at most {capacity} samples)"
        )
    return limits


def _device_batches(
    models, limits, scheme, global_batch, local_steps, min_device_batch, min_batch
) -> list[list[int]]:
    """Each worker's batch per device: balanced by speed and memory (``hps``),
    else an equal share per worker, split equally (``equal``) or by speed
    over its devices."""
    if scheme == "hps":
        device_batches = _hps_batches(models, limits, global_batch, local_steps)
        if min_batch > 1 and any(
            sum(b) == sum(lo) for b, (lo, _) in zip(device_batches, limits, strict=True)
        ):
            _warn_min_batch(
                models, global_batch, local_steps, min_device_batch, min_batch
            )
        return device_batches
    shares = _round_keeping_sum(
        [global_batch / len(models)] * len(models),
        global_batch,
        [0] * len(models),
        [math.inf] * len(models),
    )
    device_batches = []
    for m, (m_lo, m_hi), share in zip(models, limits, shares, strict=True):
        if share < sum(m_lo) or share > sum(m_hi):
            raise ValueError(
                f"worker {m.worker_id!r}: an equal share of {share} samples "
                f"does not fit its {len(m.devices)} device(s) (between "
                f"{sum(m_lo)} and {sum(m_hi)}); scheme 'hps' balances by memory"
            )
        if scheme == "equal":
            split = _round_keeping_sum(
                [share / len(m.devices)] * len(m.devices), share, m_lo, m_hi
            )
        else:
            lanes = [
                _Lane(d, 0.0, 1, low, high)
                for d, low, high in zip(m.devices, m_lo, m_hi, strict=True)
            ]
            split = _water_fill(lanes, share)
        device_batches.append(split)
    return device_batches


def _scheme_local_steps(
    scheme, models, step_times, local_steps, check_period, commits_per_period
) -> tuple[list[int], float | None, int | None]:
    """Each worker's local steps under ``scheme`` (not ``ashl_reference``),
    with ADSP's commit interval and commits per period (else ``None``)."""
    if scheme == "dylu":
        # The fastest worker runs local_steps; the others as many as their
        # speed allows in the same compute time, rounded, at least one.
        fastest = min(step_times)
        steps = [
            max(1, math.floor(local_steps * fastest / t + 0.5)) for t in step_times
        ]
        return steps, None, None
    if scheme == "ashl":
        # The worker with the longest round at H_min local steps sets the round
        # length L; every other worker runs as many steps as fit in L.
        length = max(
            local_steps * t + m.transfer
            for m, t in zip(models, step_times, strict=True)
        )
        steps = [
            max(local_steps, math.floor((length - m.transfer) / t + 0.5))
            for m, t in zip(models, step_times, strict=True)
        ]
        return steps, None, None
    if scheme != "adsp":
        return [local_steps] * len(models), None, None
    slowest = max(step_times)
    if check_period is None and commits_per_period is None:
        commits = 1
        commit_interval = local_steps * slowest
    elif check_period is None:
        commits = commits_per_period
        commit_interval = local_steps * slowest
    elif commits_per_period is None:
        commits = max(1, math.floor(check_period / (local_steps * slowest)))
        commit_interval = check_period / commits
    else:
        commits = commits_per_period
        commit_interval = check_period / commits
    steps = [max(1, math.floor(commit_interval / t + 0.5)) for t in step_times]
    return steps, commit_interval, commits


def _worker_plan(
    scheme: str,
    m: _WorkerModel,
    batches: Sequence[int],
    t: float,
    h: int,
    lr_scale: float,
    **extra: Any,
) -> tuple[WorkerPlan, list[float]]:
    """One worker's plan (``extra``: more of its fields) and each of its
    devices' busy seconds per round."""
    if scheme == "adsp":
        # Commits run in the background while training goes on, so a commit
        # interval is the compute between commits, or the transfer if longer.
        round_time = max(h * t, m.transfer)
        busy = [
            max(h * d.time(b), m.transfer)
            for d, b in zip(m.devices, batches, strict=True)
        ]
    else:
        round_time = h * t + m.transfer
        busy = [
            h * d.time(b) + m.transfer for d, b in zip(m.devices, batches, strict=True)
        ]
    worker = WorkerPlan(
        worker_id=m.worker_id,
        batch_size=sum(batches),
        local_steps=h,
        lr_scale=lr_scale,
        step_time=t,
        transfer_seconds=m.transfer,
        round_time=round_time,
        devices=tuple(
            DevicePlan(
                device_id=d.device_id,
                batch_size=b,
                step_time=d.time(b),
                time_intercept=d.intercept,
                time_slope=d.slope,
                best_time_per_sample=d.floor,
                max_batch=d.max_batch,
                step_spread=d.spread(b),
            )
            for d, b in zip(m.devices, batches, strict=True)
        ),
        push_seconds=m.push,
        **extra,
    )
    return worker, busy


def _nearest(x: float) -> int:
    """``x`` rounded to the nearest integer, halves up."""
    return math.floor(x + 0.5)


def _ashl_reference(models, step_times, multipliers, base_ratio, max_local_steps):
    """Per worker: its stages' local steps, its data share and its top-k ratio.

    See :func:`plan`, scheme ``ashl_reference``.
    """
    k_ahl, k_shl = multipliers
    full = [m.transfer for m in models]
    # SHL pushes at the base ratio; the pull and the rest go in full.
    rest = [m.transfer - m.push_seconds for m in models]
    sparse = [
        base_ratio * m.push_seconds + r for m, r in zip(models, rest, strict=True)
    ]

    def local_steps(k, comm):
        length = max(k * c + t for c, t in zip(step_times, comm, strict=True))
        steps = [
            max(1, _nearest((length - t) / c))
            for c, t in zip(step_times, comm, strict=True)
        ]
        if max_local_steps is not None:
            steps = [min(h, max_local_steps) for h in steps]
        return steps

    ahl = local_steps(k_ahl, full)
    shl = local_steps(k_shl, sparse)
    total = sum(shl)
    shares = [h / total for h in shl]
    # Each worker pushes as much as fits the longest SHL round after its
    # compute and the rest of its transfer.
    longest = max(h * c + t for h, c, t in zip(shl, step_times, sparse, strict=True))
    ratios = []
    for m, h, c, r in zip(models, shl, step_times, rest, strict=True):
        push = m.push_seconds
        ratio = 1.0 if push <= 0 else (longest - h * c - r) / push
        ratios.append(min(max(ratio, MIN_COMPRESS_RATIO), 1.0))
    return list(zip(ahl, shl, strict=True)), shares, ratios
