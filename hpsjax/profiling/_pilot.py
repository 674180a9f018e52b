r"""A plan made from the run itself: a pilot of real training rounds.

A :class:`Pilot` takes the place of a :class:`~hpsjax.planning.Replanner` at
the server. It starts from an even split of the global batch over the named
workers; once every worker has ``min_reports`` kept reports there, it gives
each worker a second batch in proportion to its measured speed (the global
batch split so that every worker's step takes about as long: a worker of half
the speed gets half the samples), so the second phase is already a balanced
round and every worker has two batch sizes (equal workers keep their share:
speeds within twice their standard error of one another count as one).
Every pilot round is a real training round, on the real server and links,
under the run's own contention. From the reports it fits each worker's step

.. math::

  t_i(b) = a_i + c_i\, b

robustly: the median step at each batch, its standard error from the pooled
median absolute deviation of the steps around their batch's median (relative,
times 1.4826 for a normal's deviation, times 1.2533 for a median's error), and
a weighted least-squares line through the medians (one batch only: through the
origin, as where the batches are within a factor 1.15). Reports are left
out of the fit when they hold a compile or a first
execution: a worker's first ``warmup`` reports at each batch, its reports at a
batch other than the one planned for it (its new step still compiling beside
the rounds), and a phase's reports until every worker has reported at its new
batch (no compile left running beside the rounds). The pilot stops once the
fit is sure enough: for every worker the relative standard error of the
predicted step at the batch the fits would plan for it,

.. math::

  \frac{\operatorname{se}\big(\hat a_i + \hat c_i B_i\big)}{\hat a_i + \hat c_i B_i}
  \le \text{tolerance},

or once ``max_rounds`` pilot rounds have passed; until then the second phase
goes on (no further batch, no further compile). It then installs the plan of
the chosen scheme (under a barrier scheme, the batches it runs are kept where
the fits predict them a round at most 3% longer: a new batch is a compile
beside the rounds), made by :func:`~hpsjax.planning.plan` from the fits (as
:class:`~hpsjax.planning.WorkerProfile` objects whose step spread is the fit's
robust spread and whose transfer is the worker's link), and from then on
re-plans as the ordinary :class:`~hpsjax.planning.Replanner` does. Given
``batch_sizes`` (the shapes the workers compiled ahead), the second phase's
and the final plan's batches are put on them, so that no new batch compiles
beside the rounds.

Given ``balance_rounds``, the pilot then balances its plan on the steps the
workers take at their planned batches, under the run's own contention then:
once every worker has that many kept reports there, each worker's fitted line
is scaled to pass through its median step, and the plan made again from the
scaled lines replaces the one in force where its predicted round takes less
time a sample by at least 5% and by twice the largest relative standard
error of the medians (on proc4, steps at the planned batch came out 34%
faster to 22% slower than the fits, and two workers of four waited 29-37% of
each round at the barrier); after a check that gains less, or
``max_balances`` of them, the pilot is over.

The link: under a scheme whose rounds end at a barrier (``hps``, ``equal``)
the pilot replays the barrier from its reports' times: a round ends at the
push that completes it, and a worker's next push comes its round trip after
that plus its compute, so its link is the median of ``push time - round end -
compute`` (the wire both ways and the server's handling, without the time it
waited at the barrier for the others). Under other schemes it is what
:meth:`Pilot.observe_link` was told last (the server's moving average of a
push's interval less its compute).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import statistics
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from hpsjax._checks import check_int, check_positive, check_worker_id, is_number
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
    on_grid,
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
# The schemes whose rounds end at a barrier of every worker's push: the pilot
# takes their links from the barrier it replays.
_BARRIER_SCHEMES = ("hps", "equal")
# A normal's standard deviation per median absolute deviation, and a median's
# standard error per the mean's.
_MAD_TO_SIGMA = 1.4826
# How much longer a round the fits may predict at the batches the pilot runs
# than at the final plan's for the pilot to keep them: a new batch is a
# compile beside the rounds, seconds of them slowed on a shared machine.
_KEEP = 0.03
# The least ratio of a worker's largest batch to its smallest for a line with
# a fixed cost: closer batches pin down the step there, not its slope (a slope
# fitted too flat would hand the worker samples it cannot take).
_LINE_SPAN = 1.15
_MEDIAN_EFFICIENCY = math.sqrt(math.pi / 2)
# The least gain in the predicted round's seconds per sample for which a
# balancing check moves any batch.
_BALANCE_GAIN = 0.05


@dataclasses.dataclass(frozen=True)
class WorkerFit:
    """A worker's step time fitted from its pilot reports.

    Attributes:
      worker_id: the worker.
      intercept: ``a``, fixed seconds per step (>= 0).
      slope: ``c``, seconds per sample (> 0).
      spread: the steps' robust relative spread around their batch's median
        (1.4826 times the median absolute relative deviation).
      reports: reports in the fit.
      batch_sizes: the distinct batches reported, ascending.
    """

    worker_id: int | str
    intercept: float
    slope: float
    spread: float
    reports: int
    batch_sizes: tuple[int, ...]
    _covariance: Any = dataclasses.field(repr=False, compare=False, default=None)

    def step_time(self, batch_size: float) -> float:
        """The fitted seconds per step at ``batch_size``."""
        return self.intercept + self.slope * batch_size

    def scaled_to(self, batch_size: float, seconds: float) -> WorkerFit:
        """The fit's line scaled to pass through ``seconds`` at ``batch_size``
        (both terms by the same factor: the worker as fast relative to its
        fit at every batch)."""
        k = seconds / self.step_time(batch_size)
        covariance = None if self._covariance is None else self._covariance * k * k
        return dataclasses.replace(
            self, intercept=self.intercept * k, slope=self.slope * k,
            _covariance=covariance,
        )  # fmt: skip

    def relative_error(self, batch_size: float) -> float:
        """The relative standard error of :meth:`step_time` at ``batch_size``."""
        x = np.array([1.0, float(batch_size)])
        se = math.sqrt(max(float(x @ self._covariance @ x), 0.0))
        return se / self.step_time(batch_size)

    def profile(self, transfer_seconds: float | None) -> WorkerProfile:
        """The fit as a one-device :class:`WorkerProfile` for :func:`plan`
        (its line at two batches or more: one batch, and twice it)."""
        sizes = self.batch_sizes
        if len(sizes) == 1:
            sizes = (sizes[0], 2 * sizes[0])
        times = tuple(self.step_time(b) for b in sizes)
        transfer = None
        if transfer_seconds is not None:
            transfer = TransferProfile.of_round_trip(transfer_seconds, "measured")
        device = DeviceProfile(
            0,
            "pilot",
            "pilot",
            sizes,
            times,
            step_spread=(self.spread,) * len(times),
        )
        return WorkerProfile(self.worker_id, (device,), transfer)


def fit_reports(worker_id: int | str, reports: Sequence[tuple[int, float]]):
    """The robust fit ``t = a + c b`` of ``(batch, seconds)`` reports.

    Per batch, the median step and its standard error (the pooled robust
    relative spread of every report around its batch's median, over the
    square root of the batch's reports); a weighted least-squares line through
    the medians, or where the batches span less than a factor 1.15 the line
    through the origin (they fix the step there, not its slope). A negative
    ``a`` is fitted again through the origin; a non-positive ``c`` (steps that
    did not grow with the batch) gives ``a = 0`` and the weighted mean seconds
    per sample. Returns ``None`` for fewer than two reports.
    """
    if len(reports) < 2:
        return None
    groups: dict[int, list[float]] = {}
    for b, t in reports:
        groups.setdefault(int(b), []).append(float(t))
    sizes = tuple(sorted(groups))
    b = np.array(sizes, dtype=np.float64)
    m = np.array([statistics.median(groups[s]) for s in sizes])
    deviations = [
        abs(t / mi - 1) for s, mi in zip(sizes, m, strict=True) for t in groups[s]
    ]
    spread = _MAD_TO_SIGMA * statistics.median(deviations)
    counts = np.array([len(groups[s]) for s in sizes], dtype=np.float64)
    # A floor keeps identical reports (no noise) a finite weight.
    se = np.maximum(_MEDIAN_EFFICIENCY * spread * m / np.sqrt(counts), 1e-9 * m)
    w = 1.0 / se**2
    a, c, covariance = 0.0, 0.0, None
    if len(sizes) >= 2 and sizes[-1] >= _LINE_SPAN * sizes[0]:
        x = np.stack([np.ones_like(b), b], axis=1)
        covariance = np.linalg.inv(x.T @ (w[:, None] * x))
        a, c = covariance @ x.T @ (w * m)
    if covariance is None or c <= 0 or a < 0:
        # Through the origin: t = c b, var(c) = 1 / sum(w b^2).
        a, c = 0.0, float(np.sum(w * b * m) / np.sum(w * b * b))
        covariance = np.array([[0.0, 0.0], [0.0, 1.0 / float(np.sum(w * b * b))]])
    return WorkerFit(
        worker_id, float(a), float(c), float(spread), len(reports), sizes, covariance
    )


def _proportional(total: int, speeds: Sequence[float], low: int = 1) -> list[int]:
    """``total`` split in proportion to ``speeds``, each at least ``low``, by
    largest remainders (the parts add up to ``total``)."""
    share = np.asarray(speeds, dtype=np.float64)
    share = share / share.sum() * total
    parts = np.maximum(np.floor(share), low).astype(int)
    order = np.argsort(-(share - np.floor(share)))
    k = 0
    while parts.sum() < total:
        parts[order[k % len(parts)]] += 1
        k += 1
    while parts.sum() > total:
        largest = int(np.argmax(parts))
        parts[largest] -= 1
    return [int(p) for p in parts]


class Pilot(Replanner):
    """Plans a run from its own first rounds, then re-plans as it drifts.

    Args:
      worker_ids: the workers of the run (at least one, no repeats).
      global_batch: samples per round-step over all workers, in the pilot's
        phases and the final plan.
      scheme: the final plan's scheme, one of :data:`SCHEMES`.
      tolerance: the largest relative standard error of a worker's predicted
        step at its planned batch at which the pilot stops.
      max_rounds: pilot rounds (kept reports of a worker) after which the plan
        is made from the fits as they are.
      min_reports: kept reports of each worker at each pilot batch before the
        pilot moves on.
      batch_sizes: the only batch sizes the second phase and the final plan
        give a worker (ascending, e.g. :func:`~hpsjax.planning.batch_grid`'s,
        the shapes the workers compiled ahead); each planned batch is put on
        them at or below it (:func:`~hpsjax.planning.on_grid`), the plan's
        round predicted at those batches. ``None``: any size.
      balance_rounds: kept reports of each worker at its planned batch
        between two balancing checks after the fit's plan (see the module
        docstring); 0: none, the pilot is over with the fit's plan.
      max_balances: the most balancing checks.
      plan_options: further arguments of :func:`plan` (``lr_scaling``,
        ``reference_batch``, ``local_steps``, ``min_device_batch``,
        ``min_batch``, ``max_local_steps``, ``server_seconds``).
      threshold, window, cooldown, min_observations, warmup: the
        :class:`~hpsjax.planning.Replanner`'s, for after the pilot;
        ``warmup`` also sets the reports left out at each pilot batch (at
        least 1).

    Raises:
      ValueError: for a bad argument, in one line.

    Examples:
      >>> pilot = Pilot(["a", "b"], global_batch=64, tolerance=0.05)
      >>> [w.batch_size for w in pilot.plan.workers]
      [32, 32]
      >>> revised, start = None, 0.0   # rounds at a barrier, links of 5 ms
      >>> while not pilot.done:
      ...     ends = []
      ...     for w in pilot.plan.workers:
      ...         t = (0.01 if w.worker_id == "a" else 0.03) + 0.001 * w.batch_size
      ...         ends.append(start + t + 0.005)
      ...         new = pilot.observe(w.worker_id, w.batch_size, t, ends[-1])
      ...         revised = new or revised
      ...     start = max(ends)
      >>> [w.batch_size for w in revised.workers], round(pilot.link("a"), 3)
      ([42, 22], 0.005)
    """

    def __init__(
        self,
        worker_ids: Sequence[int | str],
        global_batch: int,
        scheme: str = "hps",
        *,
        tolerance: float = 0.05,
        max_rounds: int = 60,
        min_reports: int = 5,
        batch_sizes: Sequence[int] | None = None,
        balance_rounds: int = 0,
        max_balances: int = 4,
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
        self._options = _checked_options(plan_options)
        self._grid = _checked_sizes(batch_sizes)
        self._balance_rounds = check_int("balance_rounds", balance_rounds, low=0)
        self._max_balances = check_int("max_balances", max_balances, low=1)
        # Reports at the planned batches since the plan in force, and the
        # balancing checks made; None until the fit's plan is installed.
        self._balance: dict | None = None
        self._balances = 0
        check_int("warmup", warmup, low=1)
        self._ids = ids
        self._phase = 0
        self._pilot_reports: dict = {w: [] for w in ids}
        self._links: dict = {}
        self._barrier = _Barrier(ids) if scheme in _BARRIER_SCHEMES else None
        self._link_samples: dict = {w: [] for w in ids}
        self._start_phase()
        self._rounds = 0
        self._done = False
        self.fits: dict[int | str, WorkerFit] = {}
        # Why the last plan came (a pilot phase, its fit), None for a drift.
        self.reason: str | None = None
        # The final plan's settings must hold before anything runs.
        self._final_plan([_nominal_fit(w) for w in ids], revision=0)
        super().__init__(
            self._pilot_plan(self._even(), revision=0),
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

    def link(self, worker_id: int | str) -> float | None:
        """The link's seconds the pilot plans ``worker_id`` with (see the
        module docstring), ``None`` before it knows any."""
        samples = self._link_samples.get(worker_id)
        if samples:
            return float(statistics.median(samples))
        return self._links.get(worker_id)

    def observe_link(self, worker_id: int | str, seconds: float) -> None:
        """Records a worker's round trip to the server beyond its compute.

        The server's moving average of a push's interval less its step time
        (the wire both ways and the server's handling, and under a barrier the
        wait for the others): the final plan's transfer seconds for the worker
        under a scheme without a barrier. Unknown workers are ignored.

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
        planned = self._plan.worker(worker_id)
        batch_size, step_time = check_report(batch_size, step_time, now)
        if self._balance is not None:
            return self._balancing(worker_id, batch_size, step_time, now)
        link = None
        if self._barrier is not None:
            link = self._barrier.push(worker_id, now, planned.local_steps * step_time)
        if not self._kept(worker_id, batch_size, planned.batch_size):
            return None
        if link is not None:
            self._link_samples[worker_id].append(link)
        reports = self._pilot_reports[worker_id]
        reports.append((batch_size, step_time))
        self._rounds = max(self._rounds, len(reports))
        if not self._phase_over():
            return None
        return self._next(now)

    def _kept(self, worker_id: int | str, batch_size: int, planned: int) -> bool:
        """Whether a report goes into the fit (see the module docstring)."""
        warming = self._warming(worker_id, batch_size)
        if batch_size != planned:
            return False  # its planned batch's step still compiles
        self._switched.add(worker_id)
        return not warming and len(self._switched) == len(self._ids)

    def _next(self, now: float) -> WorkPlan | None:
        """At the end of a phase: the second phase's plan, the final plan, or
        ``None`` (the second phase goes on)."""
        if self._phase == 0:
            self._phase = 1
            batches = self._second_batches()
            if batches != [w.batch_size for w in self._plan.workers]:
                self.reason = "pilot phase 1"
                self._start_phase()
                self._install(self._pilot_plan(batches, self._plan.revision + 1), now)
                return self._plan
        self.fits = {
            w: fit for w in self._ids if (fit := fit_reports(w, self._pilot_reports[w]))
        }
        if len(self.fits) < len(self._ids):
            return None
        final = self._gridded(
            self._final_plan([self.fits[w] for w in self._ids], self._plan.revision + 1)
        )
        sure = all(
            self.fits[w.worker_id].relative_error(w.batch_size) <= self._tolerance
            for w in final.workers
        )
        if not (sure or self._rounds >= self._max_rounds):
            return None
        kept = self._keeping(final)
        self._done = self._balance_rounds == 0
        if not self._done:
            self._balance = {w: [] for w in self._ids}
        self.reason = f"the pilot's fit after {self._rounds} rounds"
        if kept is not final:
            self.reason += (
                ", the batches it ran kept (the fit's plan, "
                f"{[w.batch_size for w in final.workers]}, predicts a round "
                f"at most {_KEEP:.0%} shorter)"
            )
            final = kept
        self._install(final, now)
        return final

    def _balancing(
        self, worker_id: int | str, batch_size: int, step_time: float, now: float
    ) -> WorkPlan | None:
        """A report after the fit's plan: kept at the worker's planned batch
        past its warm-up; once every worker has ``balance_rounds`` of them,
        a balancing check (:meth:`_balanced`)."""
        warming = self._warming(worker_id, batch_size)
        if warming or batch_size != self._plan.worker(worker_id).batch_size:
            return None
        self._balance[worker_id].append(step_time)
        if any(len(r) < self._balance_rounds for r in self._balance.values()):
            return None
        return self._balanced(now)

    def _balanced(self, now: float) -> WorkPlan | None:
        """Each worker's fit scaled to its median step at its planned batch;
        the plan made again from them, installed where its predicted round
        takes less time a sample than the batches in force (both on the
        scaled fits) by at least :data:`_BALANCE_GAIN` and twice the largest
        relative standard error of the medians, else the pilot is over."""
        batches = [w.batch_size for w in self._plan.workers]
        self.fits = {
            w: self.fits[w].scaled_to(b, statistics.median(self._balance[w]))
            for w, b in zip(self._ids, batches, strict=True)
        }
        # The medians' own noise: a gain within twice the largest relative
        # standard error of a median is not one (under load, with steps
        # spread 40%, six rounds moved the batches back and forth).
        need = max(_BALANCE_GAIN, 2 * max(map(_median_error, self._balance.values())))
        self._balance = {w: [] for w in self._ids}
        self._balances += 1
        revision = self._plan.revision + 1
        made = self._gridded(
            self._final_plan([self.fits[w] for w in self._ids], revision)
        )
        planned = [w.batch_size for w in made.workers]
        # Seconds per sample: a worker that waited at the barrier takes more
        # samples in the same round, or the round's slowest fewer.
        here = self._pilot_plan(batches, revision).round_time / sum(batches)
        there = self._pilot_plan(planned, revision).round_time / sum(planned)
        gains = planned != batches and there <= (1 - need) * here
        if not gains or self._balances >= self._max_balances:
            self._done, self._balance = True, None
        if not gains:
            return None
        self.reason = (
            f"the pilot's balance {self._balances}: steps at the planned batches "
            f"({1e6 * here:.0f} us a sample at {batches}, {1e6 * there:.0f} here)"
        )
        self._install(made, now)
        return made

    def _keeping(self, final: WorkPlan) -> WorkPlan:
        """``final``, or under a barrier scheme the batches the pilot runs
        where the fits put their round within :data:`_KEEP` of ``final``'s
        (no new batch: no compile beside the rounds). The kept plan predicts
        the fits' round at its batches plus what ``final`` adds to the
        slowest median worker (the spread's expected maximum, the queue)."""
        batches = [w.batch_size for w in self._plan.workers]
        planned = [w.batch_size for w in final.workers]
        if self._barrier is None or batches == planned:
            return final
        here = self._pilot_plan(batches, final.revision)
        there = self._pilot_plan(planned, final.revision)
        if here.round_time > (1 + _KEEP) * there.round_time:
            return final
        return self._at_batches(final, batches)

    def _gridded(self, made: WorkPlan) -> WorkPlan:
        """``made`` with its batches on the pilot's ``batch_sizes`` (see
        :func:`_on_grid`; a worker's seconds from its fit and link), or
        ``made`` itself without them."""
        if self._grid is None:
            return made
        steps = self._options.get("local_steps", 1)
        ids = [w.worker_id for w in made.workers]

        def seconds(i: int, b: int) -> float:
            return steps * self.fits[ids[i]].step_time(b) + (self.link(ids[i]) or 0.0)

        batches = [w.batch_size for w in made.workers]
        return self._at_batches(made, _on_grid(batches, self._grid, seconds))

    def _at_batches(self, made: WorkPlan, batches: Sequence[int]) -> WorkPlan:
        """``made`` at other ``batches``: the workers' plans from the fits
        there, the round ``made``'s plus the fits' change of round between its
        batches and these (what ``made`` adds to the slowest median worker,
        the spread's expected maximum and the queue, kept)."""
        planned = [w.batch_size for w in made.workers]
        if list(batches) == planned:
            return made
        here = self._pilot_plan(batches, made.revision)
        there = self._pilot_plan(planned, made.revision)
        return dataclasses.replace(
            made,
            workers=here.workers,
            global_batch=here.global_batch,
            round_time=made.round_time + here.round_time - there.round_time,
        )

    def _start_phase(self) -> None:
        """A phase counts the reports that come after it begins, and none
        until every worker has reported at its batch of the phase."""
        self._phase_start = {w: len(r) for w, r in self._pilot_reports.items()}
        self._switched: set = set()

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

    def _even(self) -> list[int]:
        n, total = len(self._ids), self._global_batch
        return [total // n + (1 if i < total % n else 0) for i in range(n)]

    def _second_batches(self) -> list[int]:
        """The global batch split in proportion to each worker's samples per
        second at its first batch (the median of its kept reports there);
        workers whose speeds are within twice their standard error of one
        another's share their mean speed (noise moves no batch)."""
        speeds, errors = [], []
        for w, e in zip(self._ids, self._even(), strict=True):
            times = [t for b, t in self._pilot_reports[w] if b == e]
            median = statistics.median(times)
            spread = _MAD_TO_SIGMA * statistics.median(
                abs(t / median - 1) for t in times
            )
            speeds.append(e / median)
            errors.append(_MEDIAN_EFFICIENCY * spread / math.sqrt(len(times)))
        low = max(1, int(self._options.get("min_batch", 1)))
        pooled = _pooled(speeds, errors)
        batches = _proportional(self._global_batch, pooled, low)
        if self._grid is not None:
            batches = _on_grid(batches, self._grid, lambda i, b: b / pooled[i])
        return batches

    def _pilot_plan(self, batches: Sequence[int], revision: int) -> WorkPlan:
        options = self._options
        steps = options.get("local_steps", 1)
        reference = options.get("reference_batch") or self._global_batch / len(batches)
        lr_scale = _lr_scale(
            self._global_batch, reference, options.get("lr_scaling", "none")
        )
        workers = []
        for w, b in zip(self._ids, batches, strict=True):
            fit = self.fits.get(w) or _nominal_fit(w)
            t = fit.step_time(b)
            link = self.link(w) or 0.0
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
            lr_scaling=options.get("lr_scaling", "none"),
            reference_batch=reference,
            local_steps=steps,
            revision=revision,
        )

    def _final_plan(self, fits: Sequence[WorkerFit], revision: int) -> WorkPlan:
        profiles = [f.profile(self.link(f.worker_id)) for f in fits]
        made = plan(
            profiles, self._scheme, global_batch=self._global_batch, **self._options
        )
        return dataclasses.replace(made, revision=revision)


def _on_grid(
    batches: Sequence[int], grid: Sequence[int], seconds: Callable[[int, int], float]
) -> list[int]:
    """``batches`` on ``grid``: each at the size at or below it
    (:func:`~hpsjax.planning.on_grid`), then raised to the next size where
    ``seconds(i, size)`` (worker ``i``'s predicted round there) stays within
    the slowest worker's round at the sizes below (samples for nothing)."""
    down = [on_grid(b, grid) for b in batches]
    slowest = max(seconds(i, b) for i, b in enumerate(down))
    out = []
    for i, b in enumerate(down):
        k = grid.index(b) + 1
        if k < len(grid) and seconds(i, grid[k]) <= slowest * (1 + 1e-9):
            b = grid[k]
        out.append(int(b))
    return out


def _median_error(times: Sequence[float]) -> float:
    """The relative standard error of the median of ``times``: their robust
    relative spread (1.4826 times the median absolute relative deviation)
    times 1.2533, over the square root of their count."""
    median = statistics.median(times)
    spread = _MAD_TO_SIGMA * statistics.median(abs(t / median - 1) for t in times)
    return _MEDIAN_EFFICIENCY * spread / math.sqrt(len(times))


def _pooled(speeds: Sequence[float], errors: Sequence[float]) -> list[float]:
    """``speeds`` with each run of them (in order of speed) that differ by at
    most twice their combined relative standard ``errors`` from the run's
    first replaced by the run's mean."""
    order = sorted(range(len(speeds)), key=lambda i: speeds[i])
    pooled = list(speeds)
    group = [order[0]]
    for i in [*order[1:], None]:
        first = group[0]
        if i is not None and speeds[i] / speeds[first] - 1 <= 2 * math.hypot(
            errors[i], errors[first]
        ):
            group.append(i)
            continue
        mean = statistics.fmean(speeds[j] for j in group)
        for j in group:
            pooled[j] = mean
        group = [i]
    return pooled


class _Barrier:
    """The barrier a barrier scheme's rounds end at, replayed from the times
    of the workers' pushes: a round ends at the push that completes it."""

    def __init__(self, ids: Sequence[int | str]):
        self._ids = frozenset(ids)
        self._pushed: set = set()
        # When the last round ended, and per worker its value at the
        # worker's last push: a round ended since when the two differ.
        self._end: float | None = None
        self._since: dict = {}
        self._latest = 0.0

    def push(self, worker_id: int | str, now: float, compute: float) -> float | None:
        """Counts a push; returns the worker's link seconds in it (``now`` less
        the last round's end and ``compute``), or ``None`` when no round ended
        since its last push (it joined late, or the rounds are out of step)."""
        ended = self._end if self._since.get(worker_id) != self._end else None
        if worker_id in self._pushed:
            # Two pushes in one round: this is not the barrier's round.
            self._pushed.clear()
            self._end = None
            ended = None
        self._pushed.add(worker_id)
        self._since[worker_id] = self._end
        self._latest = now if len(self._pushed) == 1 else max(self._latest, now)
        if self._pushed == self._ids:
            self._end = self._latest
            self._pushed.clear()
        if ended is None:
            return None
        return max(now - ended - compute, 0.0)


def _nominal_fit(worker_id: int | str) -> WorkerFit:
    """A stand-in before any fit: 1 ms per sample, no fixed cost."""
    return WorkerFit(worker_id, 0.0, 1e-3, 0.0, 0, (1, 2), np.zeros((2, 2)))


def _checked_ids(worker_ids: Any) -> list:
    if isinstance(worker_ids, str) or not isinstance(worker_ids, Sequence):
        raise ValueError(f"worker_ids must be a sequence of ids, got {worker_ids!r}")
    ids = list(worker_ids)
    if not ids:
        raise ValueError("worker_ids is empty: a pilot needs at least one worker")
    for w in ids:
        check_worker_id("a worker id", w)
    if len(set(ids)) != len(ids):
        raise ValueError(f"worker ids repeat: {ids}")
    return ids


def _checked_sizes(sizes: Any) -> tuple[int, ...] | None:
    if sizes is None:
        return None
    if isinstance(sizes, str) or not isinstance(sizes, Sequence) or not sizes:
        raise ValueError(
            f"batch_sizes must be a non-empty list of sizes, got {sizes!r}"
        )
    for b in sizes:
        check_int("a batch size of batch_sizes", b, low=1)
    if any(later <= b for b, later in itertools.pairwise(sizes)):
        raise ValueError(f"batch_sizes must ascend without repeats, got {list(sizes)}")
    return tuple(int(b) for b in sizes)


def _checked_options(options: Mapping[str, Any] | None) -> dict:
    options = dict(options or {})
    unknown = sorted(set(options) - set(_PLAN_OPTIONS))
    if unknown:
        raise ValueError(
            f"unknown plan option(s) {unknown}; valid options: {list(_PLAN_OPTIONS)}"
        )
    return options
