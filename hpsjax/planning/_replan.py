"""Re-planning: a running plan revised when the workers' measured speeds drift.

:class:`Replanner` takes each worker's reported step times, keeps a moving
average of measured over planned speed, and when a worker has drifted refits
every reporting worker's time model and solves the plan again with the same
scheme and settings. It does no I/O and reads no clock.
"""

from __future__ import annotations

import collections
import math
from typing import Any

from hpsjax._checks import check_int, check_positive, is_number
from hpsjax._ewma import ewma
from hpsjax.planning._solve import _model_from_worker_plan, _solve, _WorkerModel
from hpsjax.planning._workplan import WorkerPlan, WorkPlan

__all__ = ["Replanner", "check_report"]


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


def check_report(batch_size: Any, step_time: Any, now: Any) -> tuple[int, float]:
    """A re-planner's report, checked: its batch and step time (``now`` too).

    Raises:
      ValueError: a batch that is not an int >= 1, a step time that is not a
        positive finite number, or a ``now`` that is not a finite number.
    """
    batch_size = check_int("batch_size", batch_size, low=1)
    step_time = check_positive("step_time", step_time)
    if not is_number(now):
        raise ValueError(f"now must be a number, got {now!r}")
    if not math.isfinite(now):
        raise ValueError(f"now must be finite, got {now}")
    return batch_size, step_time


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

    Under ``hps`` new batches must also be worth their change: the revised
    plan's round, predicted with the refitted models, must be at least
    ``min_gain`` shorter than the round of the batches in force under the same
    models; otherwise the revision keeps the batches in force and only its
    predicted times are refitted. Where push and pull are most of the round
    and the steps are a few milliseconds, a step's noise can read as a drift
    whose revised batches gain nothing: on one H200 and three CPU core sets
    (BENCHMARKS.md, "On a GPU") a revision moved 108 of 128 samples off the
    GPU for a predicted round 2.6% shorter (40.0 to 39.0 ms; the run's
    reports replayed).

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
      min_gain: under ``hps``, the least share of the round that new batches
        must save, as predicted, to replace those in force (0: always).

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
        min_gain: float = 0.05,
    ):
        if not isinstance(plan, WorkPlan):
            raise ValueError(f"plan must be a WorkPlan, got {type(plan).__name__}")
        self._threshold = check_positive("threshold", threshold)
        check_int("window", window, low=1)
        if not is_number(cooldown) or not cooldown >= 0:
            raise ValueError(f"cooldown must be a number >= 0, got {cooldown!r}")
        self._cooldown = float(cooldown)
        self._min_observations = check_int("min_observations", min_observations, low=1)
        self._warmup = check_int("warmup", warmup, low=0)
        if not is_number(min_gain) or not 0.0 <= min_gain < 1.0:
            raise ValueError(f"min_gain must be a number in [0, 1), got {min_gain!r}")
        self._min_gain = float(min_gain)
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
        batch_size, step_time = check_report(batch_size, step_time, now)
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
        settings = dict(
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
        revised = _solve(models, old.scheme, **settings)
        if old.scheme == "hps" and self._min_gain > 0.0:
            # The batches in force, their times refitted: kept unless the new
            # batches save min_gain of its predicted round.
            kept = _solve(
                models, old.scheme, **settings,
                device_batches=[[d.batch_size for d in w.devices] for w in old.workers],
            )  # fmt: skip
            if revised.round_time > (1.0 - self._min_gain) * kept.round_time:
                revised = kept
        self._install(revised, now)
        return self._plan

    def _install(self, revised: WorkPlan, now: float) -> None:
        """Puts ``revised`` in force at ``now``; the averages restart."""
        self._plan = revised
        self._last_revision = now
        for w in revised.workers:
            self._reports.setdefault(w.worker_id, collections.deque(maxlen=self._keep))
        self._reset()
