r"""A plan made from the run itself: a pilot of real training rounds.

A :class:`Pilot` takes the place of a :class:`~hpsjax.profiling.Replanner` at
the server. It starts from an even split of the global batch over the named
workers, moves every worker through two or more batch sizes (each pilot plan
is a plan revision, so every pilot round is a real training round, on the real
server and links, under the run's own contention), and fits each worker's
step time

.. math::

  t_i(b) = a_i + c_i\, b

by least squares over its reports, leaving out its first ``warmup`` reports at
each batch (compiles, first executions). It stops once the fit is sure enough:
for every worker the relative standard error of the predicted step at the
batch the fits would plan for it,

.. math::

  \frac{\operatorname{se}\big(\hat a_i + \hat c_i B_i\big)}{\hat a_i + \hat c_i B_i}
  \le \text{tolerance},

or once ``max_rounds`` pilot rounds have passed. It then installs the plan of
the chosen scheme, made by :func:`~hpsjax.profiling.plan` from the fits (as
:class:`~hpsjax.profiling.WorkerProfile` objects whose transfer is the link's
round trip the server measured, :meth:`Pilot.observe_link`), and from then on
re-plans as the ordinary :class:`~hpsjax.profiling.Replanner` does.

The batches of a pilot phase: phase 0 gives every worker its even share
``e``; phase 1 gives workers 0, 2, 4, ... ``e (1 + spread)`` and workers 1, 3,
5, ... ``e (1 - spread)``; phase 2 the other way round; then phases 1 and 2
repeat. With an even number of workers the global batch stays the same.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from hpsjax._checks import check_int, check_positive, is_number
from hpsjax.planning import (
    SCHEMES,
    DevicePlan,
    DeviceProfile,
    Replanner,
    TransferProfile,
    WorkerPlan,
    WorkerProfile,
    WorkPlan,
    check_report,
    plan,
)
from hpsjax.planning import lr_scale as _lr_scale

__all__ = ["Pilot", "WorkerFit"]

# The options of plan() a pilot passes on; the others it sets itself.
_PLAN_OPTIONS = (
    "lr_scaling",
    "reference_batch",
    "local_steps",
    "min_device_batch",
    "min_batch",
    "max_local_steps",
    "server_seconds",
)


@dataclasses.dataclass(frozen=True)
class WorkerFit:
    """A worker's step time fitted from its pilot reports.

    Attributes:
      worker_id: the worker.
      intercept: ``a``, fixed seconds per step (>= 0).
      slope: ``c``, seconds per sample (> 0).
      sigma: the residuals' standard deviation (s).
      reports: reports in the fit.
      batch_sizes: the distinct batches reported, ascending.
    """

    worker_id: int | str
    intercept: float
    slope: float
    sigma: float
    reports: int
    batch_sizes: tuple[int, ...]
    _inverse: Any = dataclasses.field(repr=False, compare=False, default=None)

    def step_time(self, batch_size: float) -> float:
        """The fitted seconds per step at ``batch_size``."""
        return self.intercept + self.slope * batch_size

    def relative_error(self, batch_size: float) -> float:
        """The relative standard error of :meth:`step_time` at ``batch_size``."""
        x = np.array([1.0, float(batch_size)])
        se = self.sigma * math.sqrt(max(float(x @ self._inverse @ x), 0.0))
        return se / self.step_time(batch_size)

    def profile(self, transfer_seconds: float | None) -> WorkerProfile:
        """The fit as a one-device :class:`WorkerProfile` for :func:`plan`."""
        times = tuple(self.step_time(b) for b in self.batch_sizes)
        spread = tuple(self.sigma / t for t in times)
        transfer = None
        if transfer_seconds is not None:
            transfer = TransferProfile.of_round_trip(transfer_seconds, "measured")
        device = DeviceProfile(
            0, "pilot", "pilot", self.batch_sizes, times, step_spread=spread
        )
        return WorkerProfile(self.worker_id, (device,), transfer)


def fit_reports(worker_id: int | str, reports: Sequence[tuple[int, float]]):
    """Least squares ``t = a + c b`` over ``(batch, seconds)`` reports.

    Returns ``None`` for fewer than three reports or one batch only. A negative
    ``a`` is fitted again through the origin; a non-positive ``c`` (steps that
    did not grow with the batch) gives ``a = 0`` and the mean seconds per
    sample.
    """
    b = np.array([r[0] for r in reports], dtype=np.float64)
    t = np.array([r[1] for r in reports], dtype=np.float64)
    sizes = tuple(sorted({int(x) for x in b}))
    if len(reports) < 3 or len(sizes) < 2:
        return None
    x = np.stack([np.ones_like(b), b], axis=1)
    inverse = np.linalg.inv(x.T @ x)
    a, c = inverse @ x.T @ t
    if c <= 0:
        a, c = 0.0, float(np.mean(t / b))
    elif a < 0:
        a, c = 0.0, float(b @ t / (b @ b))
    residual = t - (a + c * b)
    sigma = math.sqrt(float(residual @ residual) / (len(reports) - 2))
    return WorkerFit(worker_id, float(a), float(c), sigma, len(reports), sizes, inverse)


class Pilot(Replanner):
    """Plans a run from its own first rounds, then re-plans as it drifts.

    Args:
      worker_ids: the workers of the run (at least one, no repeats).
      global_batch: samples per round-step over all workers of the final plan
        (and of the pilot, with an even number of workers).
      scheme: the final plan's scheme, one of :data:`SCHEMES`.
      tolerance: the largest relative standard error of a worker's predicted
        step at its planned batch at which the pilot stops.
      max_rounds: pilot rounds (reports of a worker) after which the plan is
        made from the fits as they are.
      min_reports: reports of each worker at each pilot batch, after the
        warm-up, before the pilot moves on.
      spread: how far the pilot's batches move from the even share, in
        ``(0, 1)``.
      plan_options: further arguments of :func:`plan` (``lr_scaling``,
        ``reference_batch``, ``local_steps``, ``min_device_batch``,
        ``min_batch``, ``max_local_steps``, ``server_seconds``).
      threshold, window, cooldown, min_observations, warmup: the
        :class:`~hpsjax.profiling.Replanner`'s, for after the pilot;
        ``warmup`` also sets the reports left out at each pilot batch (at
        least 1).

    Raises:
      ValueError: for a bad argument, in one line.

    Examples:
      >>> pilot = Pilot(["a", "b"], global_batch=64, tolerance=0.05)
      >>> [w.batch_size for w in pilot.plan.workers]
      [32, 32]
      >>> revised, now = None, 0.0
      >>> while not pilot.done:
      ...     for w in pilot.plan.workers:
      ...         now += 1.0
      ...         t = (0.01 if w.worker_id == "a" else 0.03) + 0.001 * w.batch_size
      ...         revised = pilot.observe(w.worker_id, w.batch_size, t, now) or revised
      >>> [w.batch_size for w in revised.workers]
      [42, 22]
    """

    def __init__(
        self,
        worker_ids: Sequence[int | str],
        global_batch: int,
        scheme: str = "hps",
        *,
        tolerance: float = 0.05,
        max_rounds: int = 60,
        min_reports: int = 3,
        spread: float = 0.5,
        plan_options: Mapping[str, Any] | None = None,
        threshold: float = 0.2,
        window: int = 10,
        cooldown: float = 30.0,
        min_observations: int = 3,
        warmup: int = 2,
    ):
        ids = _checked_ids(worker_ids)
        self._global_batch = check_int("global_batch", global_batch, low=len(ids))
        if scheme not in SCHEMES:
            raise ValueError(f"unknown scheme {scheme!r}; valid schemes: {SCHEMES}")
        self._scheme = scheme
        self._tolerance = check_positive("tolerance", tolerance)
        self._max_rounds = check_int("max_rounds", max_rounds, low=1)
        self._min_reports = check_int("min_reports", min_reports, low=1)
        if not (is_number(spread) and 0 < spread < 1):
            raise ValueError(f"spread must be in (0, 1), got {spread!r}")
        self._spread = float(spread)
        self._options = _checked_options(plan_options)
        check_int("warmup", warmup, low=1)
        self._ids = ids
        self._phase = 0
        self._pilot_reports: dict = {w: [] for w in ids}
        self._links: dict = {}
        self._start_phase()
        self._rounds = 0
        self._done = False
        self.fits: dict[int | str, WorkerFit] = {}
        # Why the last plan came (a pilot phase, its fit), None for a drift.
        self.reason: str | None = None
        # The final plan's settings must hold before anything runs.
        self._final_plan([_nominal_fit(w) for w in ids], revision=0)
        super().__init__(
            self._pilot_plan(0, revision=0),
            threshold=threshold,
            window=window,
            cooldown=cooldown,
            min_observations=min_observations,
            warmup=warmup,
        )

    @property
    def done(self) -> bool:
        """Whether the pilot is over and its plan installed."""
        return self._done

    @property
    def pilot_rounds(self) -> int:
        """Rounds of the pilot past the warm-ups: the kept reports of the
        worker that has most."""
        return self._rounds

    def observe_link(self, worker_id: int | str, seconds: float) -> None:
        """Records a worker's round trip to the server beyond its compute.

        The server's moving average of a push's interval less its step time
        (the wire both ways and the server's handling): the final plan's
        transfer seconds for the worker. Unknown workers are ignored.

        Raises:
          ValueError: ``seconds`` not a finite number >= 0.
        """
        if not (is_number(seconds) and math.isfinite(seconds) and seconds >= 0):
            raise ValueError(f"seconds must be a finite number >= 0, got {seconds!r}")
        if worker_id in self._pilot_reports:
            self._links[worker_id] = float(seconds)

    def observe(
        self, worker_id: int | str, batch_size: int, step_time: float, now: float
    ) -> WorkPlan | None:
        """Records one local step; returns the next pilot plan, the final plan
        or a revision (see :meth:`Replanner.observe`), else ``None``."""
        if self._done:
            self.reason = None
            return super().observe(worker_id, batch_size, step_time, now)
        self._plan.worker(worker_id)
        batch_size, step_time = check_report(batch_size, step_time, now)
        if self._warming(worker_id, batch_size):
            return None
        reports = self._pilot_reports[worker_id]
        reports.append((batch_size, step_time))
        self._rounds = max(self._rounds, len(reports))
        if not self._phase_over():
            return None
        self.fits = {
            w: fit for w in self._ids if (fit := fit_reports(w, self._pilot_reports[w]))
        }
        if len(self.fits) == len(self._ids):
            final = self._final_plan(
                [self.fits[w] for w in self._ids], self._plan.revision + 1
            )
            sure = all(
                self.fits[w.worker_id].relative_error(w.batch_size) <= self._tolerance
                for w in final.workers
            )
            if sure or self._rounds >= self._max_rounds:
                self._done = True
                self.reason = f"the pilot's fit after {self._rounds} rounds"
                self._install(final, now)
                return final
        self._phase = 1 if self._phase == 2 else self._phase + 1
        self.reason = f"pilot phase {self._phase}"
        self._start_phase()
        self._install(self._pilot_plan(self._phase, self._plan.revision + 1), now)
        return self._plan

    def _start_phase(self) -> None:
        """A phase counts the reports that come after it begins."""
        self._phase_start = {w: len(r) for w, r in self._pilot_reports.items()}

    def _phase_over(self) -> bool:
        """Whether every worker has ``min_reports`` kept reports at its batch
        of this phase (or the pilot's rounds are spent)."""
        if self._rounds >= self._max_rounds:
            return True
        for w in self._plan.workers:
            since = self._pilot_reports[w.worker_id][self._phase_start[w.worker_id] :]
            if sum(b == w.batch_size for b, _ in since) < self._min_reports:
                return False
        return True

    def _pilot_batches(self, phase: int) -> list[int]:
        n, total = len(self._ids), self._global_batch
        even = [total // n + (1 if i < total % n else 0) for i in range(n)]
        if phase == 0:
            return even
        sign = 1 if phase == 1 else -1
        return [
            max(1, round(e * (1 + sign * (1 if i % 2 == 0 else -1) * self._spread)))
            for i, e in enumerate(even)
        ]

    def _pilot_plan(self, phase: int, revision: int) -> WorkPlan:
        batches = self._pilot_batches(phase)
        options = self._options
        steps = options.get("local_steps", 1)
        reference = options.get("reference_batch") or self._global_batch / len(batches)
        lr_scale = _lr_scale(
            self._global_batch, reference, options.get("lr_scaling", "linear")
        )
        workers = []
        for w, b in zip(self._ids, batches, strict=True):
            fit = self.fits.get(w) or _nominal_fit(w)
            t = fit.step_time(b)
            link = self._links.get(w, 0.0)
            device = DevicePlan(0, b, t, fit.intercept, fit.slope, fit.slope, None)
            workers.append(
                WorkerPlan(w, b, steps, lr_scale, t, link, steps * t + link, (device,))
            )
        return WorkPlan(
            scheme=self._scheme,
            global_batch=sum(batches),
            workers=tuple(workers),
            round_time=max(w.round_time for w in workers),
            idle_fraction=0.0,
            lr_scaling=options.get("lr_scaling", "linear"),
            reference_batch=reference,
            local_steps=steps,
            revision=revision,
        )

    def _final_plan(self, fits: Sequence[WorkerFit], revision: int) -> WorkPlan:
        profiles = [f.profile(self._links.get(f.worker_id)) for f in fits]
        made = plan(
            profiles, self._scheme, global_batch=self._global_batch, **self._options
        )
        return dataclasses.replace(made, revision=revision)


def _nominal_fit(worker_id: int | str) -> WorkerFit:
    """A stand-in before any fit: 1 ms per sample, no fixed cost."""
    return WorkerFit(worker_id, 0.0, 1e-3, 0.0, 0, (1, 2), np.eye(2))


def _checked_ids(worker_ids: Any) -> list:
    if isinstance(worker_ids, str) or not isinstance(worker_ids, Sequence):
        raise ValueError(f"worker_ids must be a sequence of ids, got {worker_ids!r}")
    ids = list(worker_ids)
    if not ids:
        raise ValueError("worker_ids is empty: a pilot needs at least one worker")
    for w in ids:
        if isinstance(w, bool) or not isinstance(w, int | str):
            raise ValueError(f"a worker id must be an int or a str, got {w!r}")
    if len(set(ids)) != len(ids):
        raise ValueError(f"worker ids repeat: {ids}")
    return ids


def _checked_options(options: Mapping[str, Any] | None) -> dict:
    options = dict(options or {})
    unknown = sorted(set(options) - set(_PLAN_OPTIONS))
    if unknown:
        raise ValueError(
            f"unknown plan option(s) {unknown}; valid options: {list(_PLAN_OPTIONS)}"
        )
    return options
