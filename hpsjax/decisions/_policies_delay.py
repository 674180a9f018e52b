r"""The delay papers' methods beside Ringmaster: naive optimal and Ringleader.

:class:`NaiveOptimal` is the "naive optimal" method that Ringmaster ASGD and
the papers after it compare with: with fixed computation times
:math:`\tau_{(1)} \le \dots \le \tau_{(n)}`, using only the :math:`m` fastest
workers and choosing :math:`m` to minimise the time complexity is optimal, but
needs the times (here: measured) and the ratio :math:`\sigma^2/\varepsilon`
(here: a knob). :class:`Ringleader` is Ringleader ASGD's rounds over a table
of every worker's gradients (its arithmetic: the server optimizer
:func:`~hpsjax.transforms.gradient_table`). Each is a
:class:`~hpsjax.decisions.Policy` (see :mod:`hpsjax.decisions._policy`).
"""

from __future__ import annotations

import math

from hpsjax._checks import check_int, check_positive
from hpsjax.decisions._policy import Policy, PolicyView, Verdict

__all__ = ["NaiveOptimal", "Ringleader", "fastest_count"]

# The codes of hpsjax.transforms.TABLE_OPS (decisions do not import transforms).
_ADD, _ADD_STEP, _ADD_STEP_ROLL, _ADD_NEXT = 0, 1, 2, 3


def fastest_count(
    times: list[float], noise_ratio: float, *, asynchronous: bool = False
) -> int:
    r"""The :math:`m` that minimises the time complexity of SGD over the
    :math:`m` fastest workers.

    With the times sorted, :math:`\tau_{(1)} \le \dots \le \tau_{(n)}`, and
    :math:`S = \sigma^2 / \varepsilon`:

    .. math::

       m^* = \arg\min_m\, T_m \left(1 + \frac{S}{m}\right), \qquad
       T_m = \tau_{(m)} \ \text{(minibatch SGD: a round waits for the
       slowest of them)}, \quad
       T_m = \Big(\frac{1}{m} \sum_{i \le m} \frac{1}{\tau_{(i)}}\Big)^{-1}
       \ \text{(asynchronous SGD over them)},

    the smallest :math:`m` on a tie.

    Args:
      times: the workers' times per gradient (s), each > 0.
      noise_ratio: :math:`S`, > 0.
      asynchronous: the asynchronous form's :math:`T_m`.

    Returns:
      :math:`m^*`, in ``[1, len(times)]``.

    Examples:
      >>> fastest_count([1.0, 1.0, 1.2, 10.0], noise_ratio=4.0)
      3
      >>> fastest_count([1.0, 1.0, 1.2, 10.0], noise_ratio=0.5)
      2
    """
    if not times:
        raise ValueError("fastest_count needs at least one time.")
    ordered = sorted(times)
    best, best_cost, inverse_sum = 1, math.inf, 0.0
    for m, tau in enumerate(ordered, start=1):
        inverse_sum += 1.0 / tau
        scale = m / inverse_sum if asynchronous else tau
        cost = scale * (1.0 + noise_ratio / m)
        if cost < best_cost * (1.0 - 1e-12):
            best, best_cost = m, cost
    return best


class NaiveOptimal(Policy):
    r"""SGD over the :math:`m` fastest workers only; the others stay idle.

    Minibatch SGD (the default): each round waits for one gradient from each
    of the :math:`m` fastest live workers and applies their average; the
    other workers are never sent parameters (their pulls wait), and a push of
    one of them is ignored. With ``asynchronous``: asynchronous SGD over the
    :math:`m` fastest (each push applied at once), Ringmaster ASGD's "Naive
    Optimal ASGD".

    :math:`m` is ``workers`` if given, else :func:`fastest_count` of the
    workers' measured times per gradient (the server's EWMA of the compute
    time each push reports, else of the time between pushes) and
    ``noise_ratio`` :math:`S = \sigma^2/\varepsilon` (``None``: the number of
    live workers, the default delay threshold of
    :class:`~hpsjax.decisions.Ringmaster`, whose optimal :math:`R` is the same
    :math:`\lceil \sigma^2/\varepsilon \rceil`). A worker not yet measured
    counts as one of the fastest, so every worker computes once at the start
    and :math:`m` is then chosen from measured times; it is chosen again as
    the measurements change.

    What was read: the Ringmaster ASGD paper's introduction (Naive Optimal
    ASGD: only the fastest :math:`m_*` workers, optimal for fixed times) and
    the abstract and introduction of "Do We Need Asynchronous SGD?" (arXiv
    2602.03802: synchronous and :math:`m`-synchronous SGD near-optimal).
    What differs: the papers take :math:`m` from the known times and
    :math:`\sigma^2/\varepsilon`; here the times are measured while training
    and :math:`S` is a knob.

    Args:
      workers: :math:`m`, an int >= 1, or ``None`` to choose it.
      noise_ratio: :math:`S > 0`, or ``None`` for the number of live workers.
      asynchronous: asynchronous SGD over them rather than minibatch SGD.

    Examples:
      >>> from hpsjax.decisions._policies import NaiveOptimal
      >>> NaiveOptimal(workers=4)
      NaiveOptimal(workers=4, noise_ratio=None, asynchronous=False)

    References:
      Maranjyan, Tyurin, Richtárik, `Ringmaster ASGD: The First Asynchronous
      SGD with Optimal Time Complexity <https://arxiv.org/abs/2501.16168>`_,
      ICML 2025; Tyurin, Richtárik, `Optimal Time Complexities of Parallel
      Stochastic Optimization Methods Under a Fixed Computation Model
      <https://arxiv.org/abs/2305.12387>`_, NeurIPS 2023; `Do We Need
      Asynchronous SGD? On the Near-Optimality of Synchronous Methods
      <https://arxiv.org/abs/2602.03802>`_, 2026.
    """

    name = "naive_optimal"

    def __init__(
        self,
        *,
        workers: int | None = None,
        noise_ratio: float | None = None,
        asynchronous: bool = False,
    ):
        check_int("workers", workers, low=1, allow_none=True)
        check_positive("noise_ratio", noise_ratio, allow_none=True)
        if not isinstance(asynchronous, bool):
            raise ValueError(f"asynchronous must be a bool, got {asynchronous!r}.")
        self.workers = None if workers is None else int(workers)
        self.noise_ratio = None if noise_ratio is None else float(noise_ratio)
        self.asynchronous = asynchronous
        self.synchronous = not asynchronous
        self._epoch = -1
        self._chosen: frozenset = frozenset()

    def chosen(self, core: PolicyView) -> frozenset:
        """The live workers used now: the :math:`m` fastest (and any not yet
        measured)."""
        if self._epoch == core.epoch:
            return self._chosen
        times, unmeasured = {}, []
        for w in core.live:
            info = core.worker(w)
            t = info.step_time if info.step_time is not None else info.interval
            if t is None or t <= 0:
                unmeasured.append(w)
            else:
                times[w] = t
        ratio = self.noise_ratio or float(max(1, len(core.live)))
        if self.workers is not None:
            m = self.workers
        elif times:
            m = fastest_count(
                list(times.values()), ratio, asynchronous=self.asynchronous
            )
        else:
            m = 0
        fastest = sorted(times, key=lambda w: (times[w], repr(w)))[:m]
        self._chosen = frozenset(fastest).union(unmeasured)
        self._epoch = core.epoch
        return self._chosen

    def admit(self, core, worker_id):
        if worker_id not in self.chosen(core):
            return False
        return self.asynchronous or worker_id not in core.buffer_contributors

    def wait_reason(self, core, worker_id):
        if worker_id not in self.chosen(core):
            return "naive_optimal: not one of the m fastest workers"
        return "naive_optimal: round not complete"

    def judge(self, core, worker_id, staleness):
        del staleness
        if worker_id in self.chosen(core):
            return Verdict()
        return Verdict(0.0, False, "naive_optimal: not one of the m fastest, ignored")

    def ready(self, core):
        if core.buffered == 0:
            return False
        if self.asynchronous:
            return True
        return self.chosen(core) <= core.buffer_contributors

    def _config(self):
        return {
            "workers": self.workers,
            "noise_ratio": self.noise_ratio,
            "asynchronous": self.asynchronous,
        }


class Ringleader(Policy):
    r"""Ringleader ASGD: rounds of :math:`n` updates over a table of gradients.

    The server keeps a table of every worker's gradients this round (the
    server optimizer :func:`~hpsjax.transforms.gradient_table`: sums
    :math:`G_i`, counts :math:`b_i`) and steps with
    :math:`\frac{1}{n}\sum_i G_i / b_i`. This policy decides, for each push,
    what the table does with it (:attr:`~hpsjax.decisions.Verdict.args`:
    ``slot`` :math:`i`, ``op``), and applies each push alone:

    * phase 1: gradients go into the table, no step, until every one of the
      :math:`n` workers has one there; the push that fills the last empty
      slot steps (the round's first update, its worker "updated");
    * phase 2: the next push of a worker not yet updated this round goes into
      its slot and steps (the worker updated); a push of a worker already
      updated goes into the next round's table; once all :math:`n` are
      updated (:math:`n` steps), the next round's table becomes the table and
      phase 1 starts again.

    Nobody waits and no gradient is discarded; each gradient enters the table
    of its own round or of the next, which bounds its delay by :math:`2n - 2`
    steps in the paper.

    What was read: the paper's abstract and introduction (arXiv 2509.22860)
    and a detailed summary of its method (the table :math:`(G_i, b_i)`, the
    temporary table :math:`(G_i^+, b_i^+)`, the two phases, :math:`n`
    updates per round, the step size
    :math:`\gamma = \min\{1/(8nL), \varepsilon B / (10 L \sigma^2)\}`); not
    the paper's pseudocode itself. What differs: a worker pulls the current
    parameters after each push (in the paper one whose gradient went into a
    table without a step keeps computing at its point, which here only the
    phase-1 pushes do, the parameters not having moved); every push makes a
    server version, those without a step leave the parameters as they were
    (so versions count pushes, not steps); :math:`\gamma` is tuned, its
    constants being unknown to a run; the :math:`n` workers are fixed (a
    worker beyond :math:`n` is ignored, and one that leaves stops the rounds
    at its empty slot).

    Args:
      num_workers: :math:`n`, the workers (int >= 1): the table's slots,
        given to workers in the order of their first push.

    Examples:
      >>> from hpsjax.decisions._policies import Ringleader
      >>> Ringleader(num_workers=4)
      Ringleader(num_workers=4)

    References:
      Maranjyan, Richtárik, `Ringleader ASGD: The First Asynchronous SGD with
      Optimal Time Complexity under Data Heterogeneity
      <https://arxiv.org/abs/2509.22860>`_, 2025.
    """

    name = "ringleader"

    def __init__(self, *, num_workers: int):
        self.num_workers = check_int("num_workers", num_workers, low=1)
        self._slots: dict = {}  # worker -> its table slot
        self._filled: set = set()  # workers with a gradient in the table
        self._next: set = set()  # workers with one in the next round's
        self._updated: set = set()  # workers whose push stepped this round
        self._stepping = False  # phase 2

    def operation(self, worker_id) -> int | None:
        """What the table does with this worker's next push (a code of
        :data:`~hpsjax.transforms.TABLE_OPS`), or ``None``: no slot left."""
        if worker_id not in self._slots and len(self._slots) >= self.num_workers:
            return None
        n = self.num_workers
        if not self._stepping:
            if len(self._filled | {worker_id}) < n:
                return _ADD
        elif worker_id in self._updated:
            return _ADD_NEXT
        return _ADD_STEP_ROLL if len(self._updated | {worker_id}) == n else _ADD_STEP

    def judge(self, core, worker_id, staleness):
        del core, staleness
        op = self.operation(worker_id)
        if op is None:
            return Verdict(0.0, False, "ringleader: no table slot left, ignored")
        slot = self._slots.get(worker_id, len(self._slots))
        return Verdict(args={"slot": slot, "op": op})

    def on_push(self, core, worker_id, now):
        del core, now
        op = self.operation(worker_id)
        if op is None:
            return
        self._slots.setdefault(worker_id, len(self._slots))
        if op == _ADD_NEXT:
            self._next.add(worker_id)
            return
        self._filled.add(worker_id)
        if op == _ADD:
            return
        self._stepping = True
        self._updated.add(worker_id)
        if op == _ADD_STEP_ROLL:
            self._filled, self._next = self._next, set()
            self._updated = set()
            self._stepping = False

    def completes(self, core, worker_id):
        del core, worker_id
        return True

    def state_dict(self):
        return {
            "slots": [[w, i] for w, i in self._slots.items()],
            "filled": sorted(self._slots[w] for w in self._filled),
            "next": sorted(self._slots[w] for w in self._next),
            "updated": sorted(self._slots[w] for w in self._updated),
            "stepping": self._stepping,
        }

    def load_state_dict(self, state):
        try:
            slots = {w: int(i) for w, i in state["slots"]}
            by_slot = {i: w for w, i in slots.items()}
            sets = [
                {by_slot[i] for i in state[k]} for k in ("filled", "next", "updated")
            ]
            stepping = state["stepping"]
        except (KeyError, TypeError, ValueError) as error:
            raise ValueError(f"bad ringleader state: {error!r}") from None
        if not isinstance(stepping, bool) or len(slots) > self.num_workers:
            raise ValueError("bad ringleader state: more slots than workers")
        self._slots = slots
        self._filled, self._next, self._updated = sets
        self._stepping = stepping

    def _config(self):
        return {"num_workers": self.num_workers}
