r"""Work planning: batch sizes, local steps and step-size scales from profiles.

A :class:`WorkPlan` tells every worker, and every device of a worker, how much to
do per round. It is made by :func:`plan` from the profiles of
:func:`hpsjax.profiling.profile` under one of six schemes:

==================  ======================================================
``hps``             H-PS: batches so that all workers finish a round
                    together
``ashl``            ASHL, our reading of the paper: equal batches, local
                    steps ``H_i`` so that ``H_i t_i + T_i`` is equal across
                    workers
``ashl_reference``  ASHL as its authors' public code plans it: two stages of
                    local steps (multipliers 8 and 2), data shares and push
                    weights ``H_i / sum_j H_j``, a top-k ratio per worker
``adsp``            ADSP: equal batches, steps per commit so that all
                    workers commit equally often in a check period
``dylu``            Dynamic Local Updates (asynchronous local SGD): equal
                    batches, local steps proportional to speed
``equal``           the baseline: equal batches, the same local steps
                    everywhere
==================  ======================================================

Notation: worker ``i`` has devices ``d``; device ``d`` takes
``t_d(b) = max(a_d + c_d b, r_d b)`` seconds per step at batch ``b`` (the
profile's linear fit, never faster per sample than measured, see
:meth:`hpsjax.profiling.DeviceProfile.step_time`); a worker's step takes
``t_i = max_d t_d(b_d)`` as its devices run in parallel; ``T_i`` is its round trip
to the server; ``H_i`` its local steps per round. A worker's round takes

.. math::

  R_i = H_i \, t_i + T_i,

and the plan predicts the round time ``R = max_i R_i + Q`` and the idle fraction
of a barrier round, the share of device time spent waiting for the slowest:

.. math::

  \text{idle} = 1 - \frac{1}{D R} \sum_d \big(H_{i(d)}\, t_d(b_d) + T_{i(d)}\big)

over all ``D`` devices, ``i(d)`` the worker of device ``d``. For ``adsp`` the same
is computed over the commit intervals.

``Q`` is the wait of a barrier round's pushes at the server (``hps``,
``equal`` and ``ashl``; 0 for the others, whose pushes wait for no round). The
server takes ``s`` seconds of its own for each push (receiving, decoding and
applying it: :attr:`hpsjax.profiling.TransferProfile.server_seconds`, or
``plan(server_seconds=...)``) and serves pushes one at a time, first come
first served. Worker ``i``'s push would be done at ``A_i = H_i t_i + P_i``
alone (``P_i`` the push's part of ``T_i``, its own ``s`` in it); in arrival
order, push ``k`` is done at ``D_k = max(D_{k-1} + s, A_{(k)})``, and the
barrier opens at ``D_N`` instead of ``max_i A_i``: ``Q = D_N - max_i A_i``,
up to ``(N - 1) s`` when all arrive together, 0 when they arrive at least
``s`` apart. A round balanced so that all finish together is the one that
queues most; ``hps`` therefore also tries finish times staggered by ``s``
(the fastest worker last) and keeps the batches with the shorter predicted
round. The arithmetic is float64 (NumPy) whatever JAX's default device.

Steps vary: a barrier round (``hps``, ``equal``, ``ashl``) waits for the worker
that is slowest *that round*. Where the profiles measured it
(:attr:`hpsjax.profiling.DeviceProfile.step_spread`, the step time's
coefficient of variation ``v_i`` at the planned batch), ``max_i R_i`` above is
the expectation :math:`E[\max_i (H_i t_i X_i + T_i)]`, ``X_i`` lognormal with
median 1 and variation ``v_i / sqrt(H_i)``, the workers independent (the mean of
4,096 draws from a fixed seed). Four workers at ``v = 0.3`` wait about 38%
longer than their medians say. The batches still balance the medians.

A running plan is revised by :class:`Replanner` when measured speeds drift.

Batch weighting has one owner, the server: it averages the pushes of a round
weighted by their ``num_samples`` (:class:`hpsjax.ps.ServerCore`), so a round of
unequal batches is one step on the mean gradient of all their samples. A plan's
``lr_scale`` is therefore the same for every worker: it never weights a worker by
its batch, and for equal gradients no split of the global batch changes the step.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import logging
import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from hpsjax._checks import check_int, is_int, is_number
from hpsjax._ewma import ewma
from hpsjax.profiling._profile import WorkerProfile

__all__ = [
    "ASHL_STAGE_MULTIPLIERS",
    "LR_SCALINGS",
    "MIN_BATCH_SHARE",
    "MIN_COMPRESS_RATIO",
    "SCHEMES",
    "DevicePlan",
    "Replanner",
    "WorkPlan",
    "WorkerPlan",
    "plan",
]

SCHEMES = ("hps", "ashl", "adsp", "equal", "ashl_reference", "dylu")
# The schemes whose rounds end at a barrier of every worker's push: the
# server's queue of pushes is part of their round.
_BARRIER_SCHEMES = ("hps", "equal", "ashl")
LR_SCALINGS = ("linear", "sqrt", "none")
# The default smallest batch of a worker, as a share of the equal share B / n.
MIN_BATCH_SHARE = 1 / 8
# ``ashl_reference``: the multipliers k of its two stages, AHL then SHL.
ASHL_STAGE_MULTIPLIERS = (8, 2)
# The smallest top-k ratio a plan hands out: one value in a thousand.
MIN_COMPRESS_RATIO = 0.001
# Draws of the workers' step times behind a barrier round's expected maximum.
_SPREAD_DRAWS = 4096

_log = logging.getLogger(__name__)

PLAN_FORMAT = "hpsjax.WorkPlan"
PLAN_FORMAT_VERSION = 1


@dataclasses.dataclass(frozen=True)
class DevicePlan:
    """What one device of a worker does per step.

    Attributes:
      device_id: ``jax.Device.id`` of the device.
      batch_size: samples per step on this device.
      step_time: predicted seconds per step at ``batch_size``.
      time_intercept: ``a`` of the device's model
        ``t(b) = max(a + c b, r b)`` (seconds).
      time_slope: ``c`` of the model (seconds per sample), positive.
      best_time_per_sample: ``r`` of the model, the fewest seconds per sample
        measured, positive.
      max_batch: the largest batch that fits the device's memory, ``None`` for no
        limit. The model is kept so that a plan can be revised on its own.
      step_spread: the step time's coefficient of variation at ``batch_size``
        as profiled (:attr:`~hpsjax.profiling.DeviceProfile.step_spread`), 0
        when not measured.
    """

    device_id: int
    batch_size: int
    step_time: float
    time_intercept: float
    time_slope: float
    best_time_per_sample: float
    max_batch: int | None
    step_spread: float = 0.0

    def __post_init__(self):
        if not isinstance(self.batch_size, int) or self.batch_size < 0:
            raise ValueError(f"batch_size must be an int >= 0, got {self.batch_size}")
        if not (
            self.time_slope > 0
            and self.best_time_per_sample > 0
            and self.time_intercept >= 0
        ):
            raise ValueError(
                "a device's time model needs a slope and a time per sample > 0 "
                "and an intercept >= 0"
            )
        if self.max_batch is not None and self.batch_size > self.max_batch:
            raise ValueError(
                f"device {self.device_id}: batch {self.batch_size} exceeds its "
                f"memory limit of {self.max_batch}"
            )
        if not (math.isfinite(self.step_spread) and self.step_spread >= 0):
            raise ValueError(
                f"step_spread must be finite and >= 0, got {self.step_spread}"
            )


@dataclasses.dataclass(frozen=True)
class WorkerPlan:
    """What one worker does per round.

    Attributes:
      worker_id: the worker's id.
      batch_size: samples per local step over all its devices.
      local_steps: local steps per round (per commit for ``adsp``).
      lr_scale: factor on the base step size (learning rate); the same for every
        worker of a plan (the server weights pushes by their samples).
      step_time: predicted seconds per local step (its slowest device).
      transfer_seconds: round-trip seconds to the server.
      round_time: predicted seconds per round, ``local_steps * step_time +
        transfer_seconds`` (for ``adsp``, the commit interval).
      devices: one plan per device.
      push_seconds: the push's part of ``transfer_seconds`` as profiled, ``None``
        when only the round trip was measured (a planner then counts half of
        it). Kept so that a plan can be revised on its own.
      stage_local_steps: local steps per round in each stage of training, in
        order; empty (the default) for a single stage of ``local_steps``.
        ``ashl_reference``: ``(H_i(8), H_i(2))``, the AHL and the SHL stage
        (``local_steps`` is the first). The worker runs the steps of the stage
        the server announces.
      data_share: the share of the training data this worker holds, ``None``
        (the default) when the plan leaves the data's split alone.
        ``ashl_reference``: ``p_i = H_i(2) / sum_j H_j(2)``; the data is
        re-partitioned by these shares before training.
      push_weight: the factor the server applies to this worker's pushes, 1
        (the default) for none. ``ashl_reference``: ``p_i``, the reference's
        rule of adding ``p_i`` times each worker's parameter delta to the
        global parameters.
      compress_ratio: the share of its update's values this worker sends when
        its pushes are top-k sparsified, in ``[MIN_COMPRESS_RATIO, 1]``; 1 (the
        default) for no sparsification. ``ashl_reference``: the ratio of its
        SHL pushes (AHL pushes go in full precision), see :func:`plan`.

    The fields after ``devices`` are the contract with the runtime: the worker
    applies its stage's local steps and its ``compress_ratio``, the server its
    ``push_weight`` and the data pipeline its ``data_share``; their defaults
    leave a worker as the schemes without them have it.
    """

    worker_id: int | str
    batch_size: int
    local_steps: int
    lr_scale: float
    step_time: float
    transfer_seconds: float
    round_time: float
    devices: tuple[DevicePlan, ...]
    push_seconds: float | None = None
    stage_local_steps: tuple[int, ...] = ()
    data_share: float | None = None
    push_weight: float = 1.0
    compress_ratio: float = 1.0

    def __post_init__(self):
        if isinstance(self.worker_id, bool) or not isinstance(
            self.worker_id, int | str
        ):
            raise ValueError(f"worker_id must be an int or a str: {self.worker_id!r}")
        if not self.devices:
            raise ValueError(f"worker {self.worker_id!r} has no devices")
        if self.batch_size != sum(d.batch_size for d in self.devices):
            raise ValueError(
                f"worker {self.worker_id!r}: batch_size {self.batch_size} is not the "
                "sum of its devices' batches"
            )
        if not isinstance(self.local_steps, int) or self.local_steps < 1:
            raise ValueError(f"local_steps must be an int >= 1: {self.local_steps}")
        if not self.lr_scale >= 0:
            raise ValueError(f"lr_scale must be >= 0, got {self.lr_scale}")
        who = f"worker {self.worker_id!r}"
        if self.push_seconds is not None and not (
            is_number(self.push_seconds)
            and math.isfinite(self.push_seconds)
            and 0 <= self.push_seconds <= self.transfer_seconds
        ):
            raise ValueError(
                f"{who}: push_seconds must be in [0, transfer_seconds], "
                f"got {self.push_seconds!r}"
            )
        if isinstance(self.stage_local_steps, str) or not isinstance(
            self.stage_local_steps, Sequence
        ):
            raise ValueError(
                f"{who}: stage_local_steps must be a sequence of ints >= 1, "
                f"got {self.stage_local_steps!r}"
            )
        stages = tuple(self.stage_local_steps)
        if not all(
            isinstance(h, int) and not isinstance(h, bool) and h >= 1 for h in stages
        ):
            raise ValueError(
                f"{who}: stage_local_steps must be ints >= 1, got {list(stages)}"
            )
        object.__setattr__(self, "stage_local_steps", stages)
        if self.data_share is not None and not (
            is_number(self.data_share) and 0 <= self.data_share <= 1
        ):
            raise ValueError(
                f"{who}: data_share must be in [0, 1] or None, got {self.data_share!r}"
            )
        if not (
            is_number(self.push_weight)
            and math.isfinite(self.push_weight)
            and self.push_weight >= 0
        ):
            raise ValueError(
                f"{who}: push_weight must be a finite number >= 0, "
                f"got {self.push_weight!r}"
            )
        if not (
            is_number(self.compress_ratio)
            and MIN_COMPRESS_RATIO <= self.compress_ratio <= 1
        ):
            raise ValueError(
                f"{who}: compress_ratio must be in [{MIN_COMPRESS_RATIO}, 1], "
                f"got {self.compress_ratio!r}"
            )

    def stage_steps(self, stage: int) -> int:
        """Local steps per round in ``stage`` (0 for the first).

        A worker with a single stage runs ``local_steps`` in every stage.

        Examples:
          >>> w = WorkerProfile.synthetic(0, 1.0, transfer_seconds=0.5)
          >>> p = plan([w, WorkerProfile.synthetic(1, 2.0)], "ashl_reference",
          ...          global_batch=2)
          >>> [p.workers[1].stage_steps(s) for s in (0, 1)]
          [17, 5]
        """
        if not is_int(stage):
            raise ValueError(f"stage must be an int >= 0, got {stage!r}")
        if not self.stage_local_steps:
            if stage < 0:
                raise ValueError(f"stage must be an int >= 0, got {stage!r}")
            return self.local_steps
        if not 0 <= stage < len(self.stage_local_steps):
            raise ValueError(
                f"stage {stage} is not one of this plan's "
                f"{len(self.stage_local_steps)} stages"
            )
        return self.stage_local_steps[stage]


@dataclasses.dataclass(frozen=True)
class WorkPlan:
    """Per-worker and per-device batch sizes, local steps and step-size scales.

    Attributes:
      scheme: one of :data:`SCHEMES`.
      global_batch: samples per round-step over all workers, the sum of the
        workers' batches.
      workers: one plan per worker.
      round_time: predicted seconds of the slowest worker's round.
      idle_fraction: predicted share of device time spent waiting at a barrier
        at the end of the round, in ``[0, 1)``.
      lr_scaling: how ``lr_scale`` follows the global batch, one of
        :data:`LR_SCALINGS`.
      reference_batch: the global batch with ``lr_scale == 1``.
      local_steps: the ``local_steps`` argument of :func:`plan`.
      min_device_batch: the smallest batch given to any device.
      min_batch: the smallest batch given to any worker.
      max_local_steps: the cap on local steps, ``None`` for none.
      commit_interval: ``adsp`` only: target seconds between commits.
      commits_per_period: ``adsp`` only: commits per check period.
      revision: 0 for a fresh plan, one more for each revision by a
        :class:`Replanner`.
      stage_multipliers: ``ashl_reference`` only: the multiplier ``k`` of each
        stage's plan, :data:`ASHL_STAGE_MULTIPLIERS` by default; empty for
        the other schemes.
      base_compress_ratio: ``ashl_reference`` only: the top-k ratio of the
        worker with the longest SHL round, which sets the others' ratios; 1
        for the other schemes.
      server_seconds: the server's own seconds per push the plan counted
        (see :func:`plan`); 0 for none.
      queue_seconds: the wait of the round's last push behind the others at
        the server, part of ``round_time`` (0 for schemes without a barrier).

    The plan's ``round_time`` and ``idle_fraction`` are those of the first
    stage when workers have several.
    """

    scheme: str
    global_batch: int
    workers: tuple[WorkerPlan, ...]
    round_time: float
    idle_fraction: float
    lr_scaling: str
    reference_batch: float
    local_steps: int = 1
    min_device_batch: int = 1
    min_batch: int = 1
    max_local_steps: int | None = None
    commit_interval: float | None = None
    commits_per_period: int | None = None
    revision: int = 0
    stage_multipliers: tuple[int, ...] = ()
    base_compress_ratio: float = 1.0
    server_seconds: float = 0.0
    queue_seconds: float = 0.0

    def __post_init__(self):
        _check_scheme(self.scheme)
        for name in ("server_seconds", "queue_seconds"):
            value = getattr(self, name)
            if not (is_number(value) and math.isfinite(value) and value >= 0):
                raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")
        _check_lr_scaling(self.lr_scaling)
        if not self.workers:
            raise ValueError("a WorkPlan needs at least one worker")
        ids = [w.worker_id for w in self.workers]
        if len(set(ids)) != len(ids):
            raise ValueError(f"worker ids repeat: {ids}")
        if sum(w.batch_size for w in self.workers) != self.global_batch:
            raise ValueError("the workers' batches do not sum to global_batch")
        if not 0 <= self.idle_fraction < 1:
            raise ValueError(f"idle_fraction must be in [0, 1): {self.idle_fraction}")
        scales = {w.lr_scale for w in self.workers}
        if len(scales) > 1:
            raise ValueError(
                f"the workers' lr_scale differ ({sorted(scales)}): the server "
                "already weights each push by its samples, so a per-worker scale "
                "would weight batches twice; plan again with this hpsjax"
            )
        if isinstance(self.stage_multipliers, str) or not isinstance(
            self.stage_multipliers, Sequence
        ):
            raise ValueError(
                "stage_multipliers must be a sequence of ints >= 1, "
                f"got {self.stage_multipliers!r}"
            )
        object.__setattr__(self, "stage_multipliers", tuple(self.stage_multipliers))
        if len({len(w.stage_local_steps) for w in self.workers}) > 1:
            raise ValueError("the workers' stage_local_steps differ in length")
        shares = [w.data_share for w in self.workers]
        if any(x is not None for x in shares) and (
            None in shares or abs(sum(shares) - 1.0) > 1e-6
        ):
            raise ValueError(
                f"the workers' data_share must all be given and sum to 1: {shares}"
            )

    @property
    def check_period(self) -> float | None:
        """``adsp`` only: seconds per check period, ``commit_interval * commits``."""
        if self.commit_interval is None or self.commits_per_period is None:
            return None
        return self.commit_interval * self.commits_per_period

    def worker(self, worker_id: int | str) -> WorkerPlan:
        """The plan of worker ``worker_id``."""
        for w in self.workers:
            if w.worker_id == worker_id:
                return w
        raise ValueError(f"no worker {worker_id!r} in this plan")

    def to_json(self) -> str:
        """Serialises the plan to a JSON string (see :meth:`from_json`)."""
        return json.dumps(
            {
                "format": PLAN_FORMAT,
                "version": PLAN_FORMAT_VERSION,
                **dataclasses.asdict(self),
            },
            sort_keys=True,
        )

    @classmethod
    def from_json(cls, text: str) -> WorkPlan:
        """Reads a plan written by :meth:`to_json`.

        Raises:
          ValueError: the text is not a plan of a known format version, or the
            plan in it is inconsistent.
        """
        try:
            data = json.loads(text)
        except (TypeError, json.JSONDecodeError) as e:
            raise ValueError(f"not a JSON WorkPlan: {e}") from None
        if not isinstance(data, dict) or data.get("format") != PLAN_FORMAT:
            raise ValueError("not a JSON WorkPlan (format key missing)")
        if data.get("version") != PLAN_FORMAT_VERSION:
            raise ValueError(
                f"WorkPlan format version {data.get('version')!r} is not supported "
                f"(this hpsjax reads version {PLAN_FORMAT_VERSION})"
            )
        del data["format"], data["version"]
        try:
            workers = tuple(
                WorkerPlan(
                    **{
                        **w,
                        "devices": tuple(DevicePlan(**d) for d in w["devices"]),
                    }
                )
                for w in data.pop("workers")
            )
            return cls(workers=workers, **data)
        except KeyError as e:
            raise ValueError(
                f"malformed WorkPlan JSON: a worker or device entry has no {e}"
            ) from None
        except TypeError as e:
            raise ValueError(f"malformed WorkPlan JSON: {e}") from None


def _check_scheme(scheme: Any) -> None:
    if scheme not in SCHEMES:
        raise ValueError(f"unknown scheme {scheme!r}; valid schemes: {SCHEMES}")


def _check_lr_scaling(lr_scaling: Any) -> None:
    if lr_scaling not in LR_SCALINGS:
        raise ValueError(
            f"unknown lr_scaling {lr_scaling!r}; valid values: {LR_SCALINGS}"
        )


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


def _weighted_line(xs, ys, weights) -> tuple[float, float] | None:
    """Weighted least squares ``y = a + c x``; ``None`` for fewer than two x."""
    total = sum(weights)
    mx = sum(w * x for w, x in zip(weights, xs, strict=True)) / total
    my = sum(w * y for w, y in zip(weights, ys, strict=True)) / total
    sxx = sum(w * (x - mx) ** 2 for w, x in zip(weights, xs, strict=True))
    if sxx <= 1e-12 * max(mx * mx, 1.0) * total:
        return None
    sxy = sum(w * (x - mx) * (y - my) for w, x, y in zip(weights, xs, ys, strict=True))
    slope = sxy / sxx
    return my - slope * mx, slope


def _refit(model: _WorkerModel, plan: WorkerPlan, reports, alpha: float):
    r"""``model`` refitted to a worker's reports ``(batch, seconds)``, oldest first.

    The worker's time is fitted as ``A + C b`` by least squares over its reports,
    weighted ``(1 - alpha)^age`` so that recent ones count most, and set against
    the same fit of the model's predictions (``A_0 + C_0 b``): every device's
    fixed cost moves by ``A - A_0`` and its per-sample cost is scaled by
    ``C / C_0``. Reports at a single batch fix only one point of the line; it
    then corrects the term that dominates the predicted time there, and keeps
    the other, so a worker measured at batch 1 keeps its per-sample cost and is
    not extrapolated to a large batch.
    """
    batches = [b for b, _ in reports]
    times = [t for _, t in reports]
    weights = [(1.0 - alpha) ** k for k in range(len(reports) - 1, -1, -1)]

    def predicted(b: float) -> float:
        return max(
            d.time(b * p.batch_size / plan.batch_size)
            for d, p in zip(model.devices, plan.devices, strict=True)
        )

    line = _weighted_line(batches, times, weights)
    if line is not None and line[1] > 0:
        fixed, per_sample = line
        if fixed < 0:
            fixed = 0.0
            per_sample = sum(
                w * b * t for w, b, t in zip(weights, batches, times, strict=True)
            ) / sum(w * b * b for w, b in zip(weights, batches, strict=True))
        fixed0, per_sample0 = _weighted_line(
            batches, [predicted(b) for b in batches], weights
        )
        return model.refitted(fixed - fixed0, per_sample / per_sample0)
    total = sum(weights)
    b = sum(w * x for w, x in zip(weights, batches, strict=True)) / total
    t = sum(w * y for w, y in zip(weights, times, strict=True)) / total
    p0 = predicted(b)
    # The bottleneck device's fixed cost, and the rest of the predicted time.
    fixed0 = max(
        (d.time(b * p.batch_size / plan.batch_size), d.intercept)
        for d, p in zip(model.devices, plan.devices, strict=True)
    )[1]
    fixed0 = min(fixed0, p0)
    rest0 = p0 - fixed0
    if fixed0 >= rest0 and t >= rest0:
        return model.refitted(t - p0, 1.0)
    if fixed0 < rest0 and t > fixed0:
        return model.refitted(0.0, (t - fixed0) / rest0)
    # The time contradicts the dominant term alone: scale both.
    return model.refitted(fixed0 * (t / p0 - 1.0), t / p0)


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


def _lr_scale(global_batch: int, reference: float, lr_scaling: str) -> float:
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
) -> WorkPlan:
    limits = _checked_limits(models, global_batch, min_device_batch, min_batch)
    device_batches = _device_batches(
        models, limits, scheme, global_batch, local_steps, min_device_batch, min_batch
    )
    if scheme == "hps" and server_seconds > 0 and len(models) > 1:
        # Finishing together queues every push at the server; finishing one
        # after another, s apart, queues none but asks more of the fast ones.
        staggered = _hps_batches(
            models, limits, global_batch, local_steps, stagger=server_seconds
        )
        steps = [local_steps] * len(models)
        rounds = [
            _round_and_queue(models, b, steps, server_seconds, scheme)[0]
            for b in (device_batches, staggered)
        ]
        if rounds[1] < rounds[0]:
            device_batches = staggered
    step_times = [
        max(d.time(b) for d, b in zip(m.devices, batches, strict=True))
        for m, batches in zip(models, device_batches, strict=True)
    ]
    stage_steps: list[tuple[int, ...]] = [()] * len(models)
    shares: list[float | None] = [None] * len(models)
    weights = [1.0] * len(models)
    ratios = [1.0] * len(models)
    commit_interval = commits = None
    if scheme == "ashl_reference":
        stage_steps, shares, ratios = _ashl_reference(
            models, step_times, stage_multipliers, base_compress_ratio, max_local_steps
        )
        steps = [h[0] for h in stage_steps]
        weights = list(shares)
    else:
        steps, commit_interval, commits = _scheme_local_steps(
            scheme, models, step_times, local_steps, check_period, commits_per_period
        )
    if max_local_steps is not None:
        steps = [min(h, max_local_steps) for h in steps]

    busy, workers = [], []
    lr_scale = _lr_scale(global_batch, reference_batch, lr_scaling)
    extras = zip(stage_steps, shares, weights, ratios, strict=True)
    for m, batches, t, h, (stages, share, weight, ratio) in zip(
        models, device_batches, step_times, steps, extras, strict=True
    ):
        worker, device_busy = _worker_plan(
            scheme, m, batches, t, h, lr_scale,
            stage_local_steps=stages, data_share=share, push_weight=weight,
            compress_ratio=ratio,
        )  # fmt: skip
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


def _checked_report(batch_size: Any, step_time: Any, now: Any) -> tuple[int, float]:
    """A report's batch and step time, checked (``now`` too)."""
    batch_size = check_int("batch_size", batch_size, low=1)
    step_time = _check_positive("step_time", step_time)
    if not is_number(now):
        raise ValueError(f"now must be a number, got {now!r}")
    if not math.isfinite(now):
        raise ValueError(f"now must be finite, got {now}")
    return batch_size, step_time


def _check_positive(name: str, value: Any) -> float:
    if not is_number(value) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be a positive finite number, got {value!r}")
    return float(value)


def plan(
    profiles: Sequence[WorkerProfile],
    scheme: str = "hps",
    *,
    global_batch: int,
    lr_scaling: str = "none",
    reference_batch: float | None = None,
    local_steps: int = 1,
    min_device_batch: int = 1,
    min_batch: int | None = None,
    max_local_steps: int | None = None,
    check_period: float | None = None,
    commits_per_period: int | None = None,
    memory_fraction: float = 0.9,
    stage_multipliers: Sequence[int] | None = None,
    compress_ratio: float | None = None,
    server_seconds: float | None = None,
) -> WorkPlan:
    r"""Plans per-worker batches, local steps and step-size scales from profiles.

    **hps** (H-PS). Every device gets the batch with which all workers finish a
    round at the same time ``tau``:

    .. math::

      b_d = \mathrm{clip}\Big(t_d^{-1}\big((\tau - T_i)/H\big),\;
            b_\mathrm{min},\; b^\mathrm{mem}_d\Big), \qquad \sum_d b_d = B,

    solved exactly for ``tau``, where ``t_d(b) = max(a_d + c_d b, r_d b)`` is the
    device's profiled step time
    (:meth:`hpsjax.profiling.DeviceProfile.step_time`; ``r_d`` the fewest
    seconds per sample measured); with no fixed cost (``a_d = T_i = 0``) this is
    ``b_d`` proportional to throughput ``1 / c_d``. ``b_min`` is the larger of
    ``min_device_batch`` and the device's part of ``min_batch``: where a step is
    mostly fixed cost (``a_d`` large against ``c_d b``), finishing together would
    hand a slow worker a batch of one or two, a worker that then costs a round but
    hardly adds samples; ``min_batch`` holds it up and a warning is logged.
    ``b^mem_d`` is the largest batch
    whose profiled peak memory fits ``memory_fraction`` of the device's capacity;
    where it binds, the rest goes to the other devices. Batches are rounded to
    integers by largest remainder, which keeps ``sum_d b_d = B`` exact. Each worker
    runs ``H = local_steps`` local steps.

    **ashl** (ASHL). Equal batches ``B / n`` per worker (split over its devices
    so that they finish together). The worker with the longest round at
    ``H_min = local_steps`` steps sets the round length, and every worker runs as
    many local steps as fit in it:

    .. math::

      L = \max_i (H_\mathrm{min} t_i + T_i), \qquad
      H_i = \max\big(H_\mathrm{min}, \mathrm{round}((L - T_i) / t_i)\big),

    so ``H_i t_i + T_i`` is about ``L`` for every worker. Plan the coarse AHL stage
    with a large ``local_steps`` and the fine SHL stage with a small one.

    **adsp** (ADSP). Equal batches as for ``ashl``. Time is cut into check
    periods ``Gamma`` in which every worker commits ``C`` times, so commits are
    ``I = Gamma / C`` seconds apart, and worker ``i`` runs

    .. math::

      H_i = \max\big(1, \mathrm{round}(I / t_i)\big)

    local steps per commit; commits go out in the background, so ``T_i`` is not
    part of ``I`` (a link slower than ``I`` stretches the worker's interval to
    ``T_i``). Given ``check_period`` and ``commits_per_period``, ``I`` follows;
    given only ``check_period``, ``C`` is the most commits per period at which the
    slowest worker still runs ``local_steps`` steps per commit; otherwise
    ``I = local_steps * max_i t_i`` and ``C`` is ``commits_per_period`` (1 when not
    given). ADSP searches the global commit rate online; plan again with the
    rate it settles on.

    **ashl_reference** (ASHL as its authors' public code plans it). Equal
    batches as for ``ashl``. For a multiplier ``k`` the plan is

    .. math::

      H_i(k) = \mathrm{round}\Big(\frac{\max_j (k\, c_j + m_j) - m_i}{c_i}\Big),

    ``c_i = t_i`` the worker's compute seconds per local step at its batch and
    ``m_i`` its communication seconds per round, so that ``H_i c_i + m_i`` is
    about the same for every worker. Two plans are made, one per stage of
    ``stage_multipliers`` (``(8, 2)`` by default, as in the reference): the
    AHL stage's with ``m_i = T_i``, its full round trip (AHL pushes in full
    precision), and the SHL stage's with ``m_i = rho P_i + (T_i - P_i)``,
    ``P_i`` the push's part of the round trip (half of it when only the round
    trip was profiled) and ``rho = compress_ratio`` (1 by default, as in the
    reference). Each worker gets ``stage_local_steps = (H_i(8), H_i(2))`` and
    ``local_steps = H_i(8)``. The shares ``p_i = H_i(2) / sum_j H_j(2)`` are
    each worker's ``data_share`` and its ``push_weight``. Its SHL top-k ratio
    is the share of its push that fits the longest SHL round ``M = max_j
    (H_j(2) c_j + m_j)`` after its compute and the rest of its transfer:

    .. math::

      \mathrm{ratio}_i = \mathrm{clip}\Big(
        \frac{M - H_i(2)\, c_i - (T_i - P_i)}{P_i},\;
        \mathrm{MIN\_COMPRESS\_RATIO},\; 1\Big),

    1 where ``P_i = 0``. The worker with the longest round gets ``rho`` and a
    faster one more, up to 1 (no sparsification). The reference also counts
    the seconds spent compressing in ``m_i``; the profile does not measure
    them, so they count as 0 here. ``local_steps`` does not
    apply; ``max_local_steps`` caps both stages before the shares are taken.
    The server decides the switch from AHL to SHL.

    **dylu** (Dynamic Local Updates, asynchronous local SGD). Equal batches
    as for ``ashl``; each worker's local steps are proportional to its speed
    ``1 / t_i``, so that all finish their compute of a round at about the same
    time, the fastest running ``H = local_steps``:

    .. math::

      H_i = \max\Big(1, \mathrm{round}\Big(H\, \frac{\min_j t_j}{t_i}\Big)\Big).

    The transfer does not enter, as in the paper, where workers push in the
    background of an asynchronous server. A :class:`Replanner` sets the steps
    again from the measured speeds.

    **equal**. ``B / n`` per worker and an equal split over its devices,
    ``local_steps`` everywhere: the baseline the others are measured against.

    **Step-size scale.** Batch weighting belongs to the server alone: it averages
    a round's pushes weighted by their samples, which gives the mean gradient of
    all ``B`` samples, ``sum_i (b_i / B) g_i``, however ``B`` is split. So
    ``lr_scale`` is one factor for every worker and depends only on the global
    batch: 1 (``"none"``, the default), ``B / b_ref`` (``"linear"``, the linear
    scaling rule) or ``sqrt(B / b_ref)`` (``"sqrt"``), ``b_ref`` the global batch
    the base step size was tuned for (``B / n`` by default: one worker's equal
    share). ``"linear"`` and ``"sqrt"`` are a deliberate change of the global step
    size; for equal gradients no plan changes the step. Local steps do not change
    the scale: each is an ordinary step on ``b_i`` samples.

    Args:
      profiles: one :class:`WorkerProfile` per worker.
      scheme: one of :data:`SCHEMES`.
      global_batch: ``B``, samples per step over all workers.
      lr_scaling: one of :data:`LR_SCALINGS`.
      reference_batch: the global batch with scale 1; ``B / n`` by default.
      local_steps: ``H`` for ``hps`` and ``equal``, ``H_min`` for ``ashl``, the
        slowest worker's steps per commit for ``adsp``, the fastest worker's
        steps for ``dylu``; not used by ``ashl_reference``.
      min_device_batch: the smallest batch any device gets.
      min_batch: the smallest batch any worker gets; by default
        :data:`MIN_BATCH_SHARE` of the equal share, ``max(1, floor(B / (8 n)))``.
        Pass 1 to let ``hps`` balance finish times alone.
      max_local_steps: a cap on any worker's local steps, ``None`` for none.
      check_period: ``adsp`` only: seconds per check period.
      commits_per_period: ``adsp`` only: commits per check period.
      memory_fraction: share of a device's memory capacity a step may use.
      stage_multipliers: ``ashl_reference`` only: ``(k_AHL, k_SHL)``, two ints
        >= 1; :data:`ASHL_STAGE_MULTIPLIERS` by default.
      compress_ratio: ``ashl_reference`` only: the SHL top-k ratio of the
        worker with the longest round, in ``[MIN_COMPRESS_RATIO, 1]``; 1 by
        default.
      server_seconds: the server's own seconds per push, ``s`` of the barrier
        round's queue (see the module's notes); by default the median of the
        profiles' measured ``transfer.server_seconds``, 0 when none has one.
        Pass 0 to leave the queue out.

    Returns:
      The :class:`WorkPlan`.

    Raises:
      ValueError: no profiles, repeated worker ids, a non-positive speed, a
        global batch smaller than the devices times ``min_device_batch`` (the
        workers times ``min_batch``) or larger than their memory holds, an
        unknown scheme or ``lr_scaling``, or another argument out of range.

    Examples:
      >>> workers = [WorkerProfile.synthetic(i, s) for i, s in enumerate([1, 1, 2, 4])]
      >>> [w.batch_size for w in plan(workers, "hps", global_batch=256).workers]
      [32, 32, 64, 128]
      >>> p = plan(workers, "dylu", global_batch=256, local_steps=8)
      >>> [(w.batch_size, w.local_steps) for w in p.workers]
      [(64, 2), (64, 2), (64, 4), (64, 8)]

    References:
      Xian, Li, Liu, Guo, Du, "H-PS: A Heterogeneous-Aware Parameter Server With
      Distributed Neural Network Training", IEEE Access, 2021,
      https://doi.org/10.1109/ACCESS.2021.3060154

      Shen, Tang, Zhou, Zhang, Jia, Yu, Zhang, Li, "ASHL: An Adaptive Multi-Stage
      Distributed Deep Learning Training Scheme for Heterogeneous Environments",
      IEEE Transactions on Computers, 2024,
      https://doi.org/10.1109/TC.2023.3315847

      Hu, Wang, Wu, "Distributed Machine Learning through Heterogeneous Edge
      Systems" (ADSP), AAAI, 2020, https://arxiv.org/abs/1911.06949

      Goyal, Dollar, Girshick, Noordhuis, Wesolowski, Kyrola, Tulloch, Jia, He,
      "Accurate, Large Minibatch SGD: Training ImageNet in 1 Hour", 2017,
      https://arxiv.org/abs/1706.02677

      Krizhevsky, "One weird trick for parallelizing convolutional neural
      networks" (square-root scaling), 2014, https://arxiv.org/abs/1404.5997

      ASHL's public reference implementation, the repository
      ``xiangunremarkable/ASHL`` on GitHub (its plan, shares and ratios).

      Liu, Chhaparia, Douillard, Kale, Rusu, Shen, Szlam, Ranzato,
      "Asynchronous Local-SGD Training for Language Modeling" (Dynamic Local
      Updates), 2024, https://arxiv.org/abs/2401.09135
    """
    profiles = list(profiles)
    if not profiles:
        raise ValueError("profiles is empty: plan needs at least one worker")
    if not all(isinstance(p, WorkerProfile) for p in profiles):
        raise ValueError("profiles must be WorkerProfile objects")
    ids = [p.worker_id for p in profiles]
    if len(set(ids)) != len(ids):
        raise ValueError(f"worker ids repeat: {ids}")
    _check_scheme(scheme)
    _check_lr_scaling(lr_scaling)
    global_batch = check_int("global_batch", global_batch, low=1)
    local_steps = check_int("local_steps", local_steps, low=1)
    min_device_batch = check_int("min_device_batch", min_device_batch, low=1)
    if min_batch is None:
        min_batch = max(1, math.floor(global_batch * MIN_BATCH_SHARE / len(profiles)))
    min_batch = check_int("min_batch", min_batch, low=1)
    if max_local_steps is not None:
        max_local_steps = check_int("max_local_steps", max_local_steps, low=local_steps)
    if reference_batch is None:
        reference_batch = global_batch / len(profiles)
    reference_batch = _check_positive("reference_batch", reference_batch)
    if check_period is not None:
        check_period = _check_positive("check_period", check_period)
    if commits_per_period is not None:
        commits_per_period = check_int("commits_per_period", commits_per_period, low=1)
    if scheme != "adsp" and (check_period, commits_per_period) != (None, None):
        raise ValueError("check_period and commits_per_period apply to 'adsp' only")
    if scheme != "ashl_reference" and (stage_multipliers, compress_ratio) != (
        None,
        None,
    ):
        raise ValueError(
            "stage_multipliers and compress_ratio apply to 'ashl_reference' only"
        )
    base_compress_ratio = 1.0
    if scheme == "ashl_reference":
        if stage_multipliers is None:
            stage_multipliers = ASHL_STAGE_MULTIPLIERS
        if (
            isinstance(stage_multipliers, str)
            or not isinstance(stage_multipliers, Sequence)
            or len(stage_multipliers) != 2
        ):
            raise ValueError(
                "stage_multipliers must be two ints >= 1 (AHL, SHL), "
                f"got {stage_multipliers!r}"
            )
        stage_multipliers = tuple(
            check_int("stage_multipliers", k, low=1) for k in stage_multipliers
        )
        if compress_ratio is not None:
            if not (
                is_number(compress_ratio) and MIN_COMPRESS_RATIO <= compress_ratio <= 1
            ):
                raise ValueError(
                    f"compress_ratio must be in [{MIN_COMPRESS_RATIO}, 1], "
                    f"got {compress_ratio!r}"
                )
            base_compress_ratio = float(compress_ratio)
    else:
        stage_multipliers = ()
    if not is_number(memory_fraction) or not 0 < memory_fraction <= 1:
        raise ValueError(f"memory_fraction must be in (0, 1], got {memory_fraction}")
    if server_seconds is None:
        measured = [
            p.transfer.server_seconds
            for p in profiles
            if p.transfer is not None and p.transfer.server_seconds is not None
        ]
        server_seconds = float(np.median(measured)) if measured else 0.0
    elif not (
        is_number(server_seconds)
        and math.isfinite(server_seconds)
        and server_seconds >= 0
    ):
        raise ValueError(
            f"server_seconds must be a finite number >= 0, got {server_seconds!r}"
        )
    models = [_model_from_profile(p, memory_fraction) for p in profiles]
    return _solve(
        models,
        scheme,
        global_batch=global_batch,
        lr_scaling=lr_scaling,
        reference_batch=reference_batch,
        local_steps=local_steps,
        min_device_batch=min_device_batch,
        min_batch=min_batch,
        max_local_steps=max_local_steps,
        check_period=check_period,
        commits_per_period=commits_per_period,
        revision=0,
        stage_multipliers=stage_multipliers,
        base_compress_ratio=base_compress_ratio,
        server_seconds=float(server_seconds),
    )


class Replanner:
    r"""Revises a work plan when workers' measured speeds drift from the planned.

    Workers report the time of each local step; the replanner keeps, per worker,
    an exponentially weighted moving average of its *speed ratio*

    .. math::

      \rho_i \leftarrow (1 - \alpha)\,\rho_i + \alpha\,
        \frac{\hat t_i(b)}{t_\mathrm{measured}}, \qquad \alpha = \frac{2}{w + 1},

    where ``\hat t_i(b)`` is the plan's predicted step time at the reported batch
    and ``w`` the window; ``rho_i = 1`` means the worker runs as planned, 0.5 at
    half speed. Once a worker has ``min_observations`` reports and
    ``|rho_i - 1| > threshold``, every other worker that has reported at all has
    ``min_observations`` reports too, and at least ``cooldown`` seconds have
    passed since the last revision, every observed worker's time model is
    fitted again and the plan is made again with the same scheme and settings (a
    worker never heard from keeps its planned speed): a worker that slowed down
    gets less work. The averages then restart against the new plan. Under
    ``dylu`` the new plan gives each worker local steps in proportion to its
    refitted speed; under ``ashl_reference`` both stages' steps, the shares and
    the ratios follow the refitted compute times (transfer times stay as
    profiled).

    The fit keeps both terms of the model, the fixed cost per step and the cost
    per sample: a least-squares line ``A + C b`` through the worker's last
    ``max(w, min_observations)`` reports (weighted ``(1 - alpha)^age``, kept
    across revisions), against the same line through the plan's predictions
    ``A_0 + C_0 b``, moves every device's fixed cost by ``A - A_0`` and scales its
    cost per sample by ``C / C_0``. Reports at one batch only fix one point; then
    the term that dominates the predicted time there is corrected and the other
    kept, so a batch-1 worker whose fixed cost was overestimated is not taken to
    be fast per sample and handed the biggest batch.

    A worker's first ``warmup`` reports, and its first ``warmup`` at each batch
    it has not reported just before (a revised plan's), are left out of both the
    average and the fit: a worker's first rounds on real processes take many
    times its steady step (first executions of the step, the other workers
    still starting, an injected slowdown's median over one or two steps; on
    proc4 the first two rounds took 4-17 times the third), and fitted with them
    a revision predicted rounds 2-5 times too long.

    The replanner does no I/O and reads no clock: callers pass ``now``.

    Args:
      plan: the plan in force.
      threshold: relative speed drift that triggers a revision.
      window: span ``w`` of the moving average, in observations.
      cooldown: least seconds between two revisions.
      min_observations: reports from a worker before its drift counts.
      warmup: reports left out after a worker starts or changes batch.

    Examples:
      >>> workers = [WorkerProfile.synthetic(i, 100.0) for i in range(2)]
      >>> replanner = Replanner(plan(workers, global_batch=64), cooldown=0.0)
      >>> new = None
      >>> for k in range(5):
      ...   new = replanner.observe(1, 32, 0.64, now=float(k)) or new
      >>> [w.batch_size for w in new.workers]
      [43, 21]

    References:
      Xian, Li, Liu, Guo, Du, "H-PS: A Heterogeneous-Aware Parameter Server With
      Distributed Neural Network Training", IEEE Access, 2021,
      https://doi.org/10.1109/ACCESS.2021.3060154
    """

    def __init__(
        self,
        plan: WorkPlan,
        *,
        threshold: float = 0.2,
        window: int = 10,
        cooldown: float = 30.0,
        min_observations: int = 3,
        warmup: int = 2,
    ):
        if not isinstance(plan, WorkPlan):
            raise ValueError(f"plan must be a WorkPlan, got {type(plan).__name__}")
        self._threshold = _check_positive("threshold", threshold)
        check_int("window", window, low=1)
        if not is_number(cooldown) or not cooldown >= 0:
            raise ValueError(f"cooldown must be a number >= 0, got {cooldown!r}")
        self._cooldown = float(cooldown)
        self._min_observations = check_int("min_observations", min_observations, low=1)
        self._warmup = check_int("warmup", warmup, low=0)
        # Per worker: the batch of its last report, and its reports since that
        # batch began.
        self._run: dict = {}
        self._alpha = 2.0 / (window + 1)
        self._plan = plan
        self._last_revision: float | None = None
        # Reports outlive a revision: those at the old batch and the new one
        # together pin down both terms of a worker's time.
        self._keep = max(window, min_observations)
        self._reports = {
            w.worker_id: collections.deque(maxlen=self._keep) for w in plan.workers
        }
        self._reset()

    def _reset(self) -> None:
        self._ratio = {w.worker_id: 1.0 for w in self._plan.workers}
        self._count = {w.worker_id: 0 for w in self._plan.workers}

    @property
    def plan(self) -> WorkPlan:
        """The plan in force."""
        return self._plan

    def speed_ratio(self, worker_id: int | str) -> float:
        """The moving average of a worker's measured over planned speed."""
        self._plan.worker(worker_id)
        return self._ratio[worker_id]

    def _warming(self, worker_id: int | str, batch_size: int) -> bool:
        """Counts a report; whether it is one of the first ``warmup`` of its
        worker at this batch (left out)."""
        batch, seen = self._run.get(worker_id, (None, 0))
        seen = seen + 1 if batch == batch_size else 1
        self._run[worker_id] = (batch_size, seen)
        return seen <= self._warmup

    def observe(
        self, worker_id: int | str, batch_size: int, step_time: float, now: float
    ) -> WorkPlan | None:
        """Records one local step of a worker; returns a revised plan or ``None``.

        Args:
          worker_id: the worker that took the step.
          batch_size: samples in the step over all the worker's devices.
          step_time: measured seconds of the step, compute only.
          now: the caller's clock, in seconds.

        Returns:
          A new plan (``revision`` one higher) when a revision is due, else
          ``None`` (always for a report of the warm-up).

        Raises:
          ValueError: an unknown worker, or a non-positive batch size or step
            time; nothing is recorded then.
        """
        worker = self._plan.worker(worker_id)
        batch_size, step_time = _checked_report(batch_size, step_time, now)
        if self._warming(worker_id, batch_size):
            return None
        # The plan's prediction at the reported batch, split over the devices as
        # planned, so a report from before a revision is still judged fairly.
        model = _model_from_worker_plan(worker)
        predicted = max(
            d.time(batch_size * p.batch_size / worker.batch_size)
            for d, p in zip(model.devices, worker.devices, strict=True)
        )
        sample = predicted / step_time
        old = self._ratio[worker_id] if self._count[worker_id] else None
        self._ratio[worker_id] = ewma(old, sample, self._alpha)
        self._count[worker_id] += 1
        self._reports[worker_id].append((batch_size, step_time))

        # Every worker heard from must have a settled average before the plan
        # changes: revising on one worker's measurements while another's are
        # half in would keep the other's (possibly far off) planned speed.
        settled = all(
            c == 0 or c >= self._min_observations for c in self._count.values()
        )
        drifted = settled and any(
            self._count[w] >= self._min_observations
            and abs(self._ratio[w] - 1.0) > self._threshold
            for w in self._ratio
        )
        cooled = (
            self._last_revision is None or now - self._last_revision >= self._cooldown
        )
        if not (drifted and cooled):
            return None
        models = [
            _refit(
                _model_from_worker_plan(w),
                w,
                self._reports[w.worker_id],
                self._alpha,
            )
            if self._count[w.worker_id] >= self._min_observations
            else _model_from_worker_plan(w)
            for w in self._plan.workers
        ]
        old = self._plan
        revised = _solve(
            models,
            old.scheme,
            global_batch=old.global_batch,
            lr_scaling=old.lr_scaling,
            reference_batch=old.reference_batch,
            local_steps=old.local_steps,
            min_device_batch=old.min_device_batch,
            min_batch=old.min_batch,
            max_local_steps=old.max_local_steps,
            check_period=old.check_period,
            commits_per_period=old.commits_per_period,
            revision=old.revision + 1,
            stage_multipliers=old.stage_multipliers,
            base_compress_ratio=old.base_compress_ratio,
            server_seconds=old.server_seconds,
        )
        self._install(revised, now)
        return self._plan

    def _install(self, revised: WorkPlan, now: float) -> None:
        """Puts ``revised`` in force at ``now``; the averages restart."""
        self._plan = revised
        self._last_revision = now
        for w in revised.workers:
            self._reports.setdefault(w.worker_id, collections.deque(maxlen=self._keep))
        self._reset()
