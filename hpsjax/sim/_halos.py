r"""HALoS in the simulator: real local servers per region under a global server.

:class:`HalosCore` is the server a simulation runs for the ``"halos"`` policy
(``hpsjax.ps.POLICIES['halos']``, HALoS): one :class:`~hpsjax.ps.ServerCore` per
region, the local parameter server (LPS) its workers push to and pull from
over their own links (ASP, the configured server optimizer: HALoS's Delayed
Nesterov with local momentum), and a global parameter server (GPS) that
merges the LPSs' accumulated updates as they arrive over the slow
inter-region link, on the virtual clock through the core's deadlines (a
:class:`~hpsjax.decisions.Tick` delivers each message when the link says).
The simulator reads the GPS's model as the run's parameters (evaluation, the
result) and its version as the run's.

Read: the paper's Algorithm 1 as summarised in its abstract and section 3
(workers take H local steps and send the model difference to their LPS; the
LPS applies it at once with local momentum; after K local updates it sends
the accumulated update to the GPS, which applies it with global momentum
and returns its model, which the LPS merges) and the authors' code
(``utnslab/halos``: ``src/halos/simulation/exec_halos.py``, the LPS's
``on_new_worker_pgrads``, ``_send_updates_to_gps`` with the update
``merged - current``, ``on_new_global_model`` with
``merge_model``: ``(1 - alpha) * local + alpha * global``; ``ps.py``,
``opt.py``'s ``DelayedNesterovOptimizer`` for both servers;
``examples/run_halos.sh``: K = 32, alpha = 0.25, LPS Delayed Nesterov
lr 0.2 x 16, beta 0.9, N = 16; GPS lr 0.15 x 2, beta 0.5, N = 2).
What differs: every LPS reaches the GPS over the same slow link (the
reference places the GPS in region 0, whose LPS it reaches over the fast
one); the link carries one message at a time per direction and an LPS has
one exchange in flight, as in the reference (it sends again only K updates
after it merged).
"""

from __future__ import annotations

import functools
import heapq
from collections.abc import Hashable, Sequence
from typing import Any

import jax
import optax

from hpsjax.decisions import ASP, SendParams, ServerCore, Tick
from hpsjax.profiling import tree_wire_nbytes
from hpsjax.transforms import delayed_nesterov

__all__ = ["HalosCore"]


@functools.lru_cache(maxsize=8)
def _global_step(optimizer: optax.GradientTransformation):
    """The GPS's jitted step: ``(params, state, update) -> (params, state)``."""

    def step(params, state, update):
        deltas, state = optimizer.update(update, state, params)
        return optax.apply_updates(params, deltas), state

    return jax.jit(step)


@jax.jit
def _merge(local: Any, global_: Any, weight: jax.Array) -> Any:
    """The LPS's merge: ``(1 - weight) * local + weight * global_``."""
    return jax.tree.map(lambda a, b: (1 - weight) * a + weight * b, local, global_)


@jax.jit
def _difference(a: Any, b: Any) -> Any:
    return jax.tree.map(lambda x, y: x - y, a, b)


class HalosCore:
    """HALoS's two-level server, with the server core's interface to its driver.

    Args:
      params: the initial parameters of every LPS and of the GPS.
      optimizer: the LPSs' optax transform (each LPS has its own state).
      policy: the ``"halos"`` policy, HALoS (its settings; each LPS runs
        an :class:`~hpsjax.ps.ASP` with its ASP arguments).
      worker_ids: every worker's id, in order: the regions are contiguous runs
        of them (the policy's ``region_of``).
      replanner: must be ``None`` (a plan revised as speeds drift is not
        built for regions).
      replan_from_pushes: as for :class:`~hpsjax.ps.ServerCore`.
      aggregator: ignored: each LPS applies its pushes at once (the simulator's
        deferred applies assume one server).
      push_weights: as for :class:`~hpsjax.ps.ServerCore`, per worker.
      **core_kwargs: further keyword arguments of every LPS's
        :class:`~hpsjax.ps.ServerCore`.

    Raises:
      ValueError: a re-planner, fewer workers than regions, repeated ids.
    """

    def __init__(
        self,
        params: Any,
        optimizer: optax.GradientTransformation,
        policy: Any,
        *,
        worker_ids: Sequence[Hashable],
        replanner: Any = None,
        replan_from_pushes: bool = True,
        aggregator: Any = None,
        push_weights: dict | None = None,
        **core_kwargs: Any,
    ):
        del aggregator
        if replanner is not None:
            raise ValueError(
                "halos: the local servers take no re-planner; set plan.replan to False."
            )
        ids = list(worker_ids)
        if len(set(ids)) != len(ids):
            raise ValueError(f"halos: worker ids repeat: {ids}")
        self.halos = policy
        self.region = {w: policy.region_of(i, len(ids)) for i, w in enumerate(ids)}
        asp = {
            "aggregate": policy.aggregate,
            "max_staleness": policy.max_staleness,
            "on_stale": policy.on_stale,
        }
        expected = core_kwargs.pop("expected_workers", None)
        self.local = []
        for r in range(policy.regions):
            weights = None
            if push_weights is not None:
                weights = {
                    w: v for w, v in push_weights.items() if self.region.get(w) == r
                }
            self.local.append(
                ServerCore(
                    params,
                    optimizer,
                    ASP(**asp),
                    push_weights=weights or None,
                    replan_from_pushes=replan_from_pushes,
                    # A held start waits for the region's share of them.
                    expected_workers=None
                    if expected is None
                    else sum(1 for w in ids if self.region[w] == r),
                    **core_kwargs,
                )
            )
        global_optimizer = delayed_nesterov(
            policy.global_learning_rate,
            momentum=policy.global_momentum,
            delay=policy.global_delay,
        )
        self._step = _global_step(global_optimizer)
        self._params = params
        self._state = global_optimizer.init(params)
        self._version = 0
        self.message_bytes = tree_wire_nbytes(params)
        # Per region: the model at its last merge, that version, whether an
        # exchange with the GPS is under way, merges so far.
        self.merged = [params] * policy.regions
        self.merged_version = [0] * policy.regions
        self.in_flight = [False] * policy.regions
        self.merges = [0] * policy.regions
        self._messages: list = []  # (arrival, seq, region, kind, payload)
        self._seq = 0
        self.global_bytes = 0  # bytes over the inter-region links, both ways
        # Each exchange: [sent, region, returned] (returned None until then).
        self.exchanges: list[list] = []
        self._open: list[int | None] = [None] * policy.regions

    # ------------------------------------------------------------ reads

    @property
    def params(self) -> Any:
        """The GPS's model."""
        return self._params

    @property
    def version(self) -> int:
        """Updates the GPS has applied."""
        return self._version

    @property
    def aggregator(self) -> Any:
        return self.local[0].aggregator

    @property
    def policy(self) -> Any:
        return self.local[0].policy

    @property
    def stage(self) -> int | None:
        return None

    @property
    def min_clock(self) -> int | None:
        clocks = [c.min_clock for c in self.local if c.min_clock is not None]
        return min(clocks) if clocks else None

    def clock(self, worker_id: Hashable) -> int:
        return self.local[self.region[worker_id]].clock(worker_id)

    def sent_params(self, action: SendParams) -> tuple[Any, Any]:
        """What a :class:`~hpsjax.decisions.SendParams` sends: a key that
        changes whenever those parameters do, and the worker's LPS's model."""
        r = self.region[action.worker_id]
        return (r, self.merges[r], action.version), self.local[r].params

    def next_deadline(self) -> float | None:
        times = [c.next_deadline() for c in self.local]
        if self._messages:
            times.append(self._messages[0][0])
        times = [t for t in times if t is not None]
        return min(times) if times else None

    # ------------------------------------------------------------ events

    def handle(self, event: Any) -> list:
        """Routes a worker's event to its LPS (a tick to all of them), after
        delivering the inter-region messages due by the event's time."""
        now = float(event.now)
        self._deliver(now)
        if isinstance(event, Tick):
            actions: list = []
            for core in self.local:
                actions.extend(core.handle(event))
            return actions
        region = self.region.get(event.worker_id)
        if region is None:
            raise ValueError(f"halos: worker {event.worker_id!r} is in no region.")
        actions = self.local[region].handle(event)
        self._maybe_send(region, now)
        self._deliver(now)
        return actions

    def _maybe_send(self, r: int, now: float) -> None:
        """The LPS sends its accumulated update once it made K since its merge."""
        core = self.local[r]
        if self.in_flight[r] or (
            core.version < self.merged_version[r] + self.halos.accumulation
        ):
            return
        self.in_flight[r] = True
        update = _difference(self.merged[r], core.params)
        self._post(now, r, "global", update)
        self._open[r] = len(self.exchanges)
        self.exchanges.append([now, r, None])

    def _post(self, now: float, r: int, kind: str, payload: Any) -> None:
        self.global_bytes += self.message_bytes
        arrival = now + self.halos.transfer_time(self.message_bytes)
        self._seq += 1
        heapq.heappush(self._messages, (arrival, self._seq, r, kind, payload))

    def _deliver(self, now: float) -> None:
        """Carries out every inter-region message that has arrived by ``now``
        (a zero-time link delivers at once)."""
        while self._messages and self._messages[0][0] <= now:
            at, _, r, kind, payload = heapq.heappop(self._messages)
            if kind == "global":
                self._params, self._state = self._step(
                    self._params, self._state, payload
                )
                self._version += 1
                self._post(at, r, "local", self._params)
            else:
                self._merge(at, r, payload)

    def _merge(self, at: float, r: int, global_params: Any) -> None:
        core = self.local[r]
        weight = jax.numpy.asarray(self.halos.merge_weight, jax.numpy.float32)
        merged = _merge(core.params, global_params, weight)
        core.aggregator.restore(merged, None)
        self.merged[r] = merged
        self.merged_version[r] = core.version
        self.merges[r] += 1
        self.in_flight[r] = False
        self.exchanges[self._open[r]][2] = at
        self._open[r] = None
