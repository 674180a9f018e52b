"""Tests of the sans-I/O server core: scripted events, exact expected actions."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import msgpack
import numpy as np
import optax
import pytest

from hpsjax.apply._aggregate import Aggregator
from hpsjax.apply._deferred import DeferredAggregator, LazyUpdate
from hpsjax.decisions._core import (
    Applied,
    Drop,
    ForcePull,
    PushAck,
    Release,
    SendParams,
    ServerCore,
    Wait,
)
from hpsjax.decisions._policies import ASP, BSP, SSP, Policy, SemiAsync, Verdict
from hpsjax.wire._errors import (
    HpsError,
    InvalidUpdate,
    NonFiniteUpdate,
    SpecMismatch,
    UnexpectedMessage,
    WorkerDropped,
)
from hpsjax.wire._messages import PushMeta


def params0():
    return {"w": jnp.zeros(3, jnp.float32), "b": jnp.zeros((), jnp.float32)}


def upd(x):
    return {"w": np.full(3, x, np.float32), "b": np.float32(x)}


def make(policy="asp", *, lr=1.0, params=None, **kwargs):
    return ServerCore(params or params0(), optax.sgd(lr), policy, **kwargs)


def w_of(core):
    return np.asarray(core.params["w"]).tolist()


def only(actions, cls):
    return [a for a in actions if isinstance(a, cls)]


def snapshot(core):
    """Everything observable, to check that a failed call changed nothing."""
    return (
        core.version,
        core.epoch,
        core.buffered,
        core.waiting,
        core.live,
        core.next_deadline(),
        core.state_dict(),
        jax.tree.map(np.asarray, core.params),
        {w: info for w, info in core.workers().items()},
    )


def assert_same(a, b):
    assert a[:7] == b[:7]
    jax.tree.map(np.testing.assert_array_equal, a[7], b[7])
    assert a[8] == b[8]


class RecordExtraArgs(Policy):
    """Accepts everything; lets the tests script an arbitrary staleness."""


def probe_optimizer():
    """An optimizer whose applied delta exposes its extra arguments.

    delta = -(u + staleness + (params - stale_params)), so the new parameters
    tell exactly what staleness and which stale copy the core passed.
    """

    def init_fn(params):
        del params
        return optax.EmptyState()

    def update_fn(updates, state, params=None, *, staleness, stale_params, **extra):
        del extra
        delta = jax.tree.map(
            lambda u, p, s: -(u + staleness + (p - s)), updates, params, stale_params
        )
        return delta, state

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


# Basic flow, sign convention, staleness.


def test_join_sends_params_and_asp_push_applies_exactly():
    core = make(lr=0.5)
    assert core.join("a", 0.0) == [SendParams("a", 0, None)]
    actions = core.push("a", upd(2.0), version=0, now=1.0)
    assert actions == [
        PushAck("a", 1, 0, "applied", 1.0, None, None),
        Applied(version=1, contributors=("a",), staleness=0, num_updates=1),
    ]
    assert w_of(core) == [-1.0, -1.0, -1.0]
    assert float(core.params["b"]) == -1.0
    assert core.worker("a").clock == 1 and core.worker("a").applied == 1


def test_pushed_pseudo_gradient_moves_server_by_the_local_delta():
    core = make(lr=1.0, params={"w": jnp.array([1.0, 2.0, 3.0])})
    core.join("a", 0.0)
    local = np.array([0.5, 2.5, 2.0], np.float32)
    pseudo_gradient = np.asarray(core.params["w"]) - local
    core.push("a", {"w": pseudo_gradient}, version=0, now=1.0)
    np.testing.assert_array_equal(np.asarray(core.params["w"]), local)


def test_staleness_is_server_version_minus_push_version():
    core = make()
    for w in "abc":
        core.join(w, 0.0)
    acks = [core.push(w, upd(1.0), version=0, now=1.0)[0] for w in "abc"]
    assert [a.staleness for a in acks] == [0, 1, 2]
    assert [a.version for a in acks] == [1, 2, 3]
    assert core.pull("a", 1.5) == [SendParams("a", 3, None)]
    assert core.push("a", upd(1.0), version=3, now=2.0)[0].staleness == 0
    assert core.worker("a").pulled_version == 3
    assert core.worker("a").pushed_version == 3


def test_optimizer_gets_staleness_and_stale_params():
    core = ServerCore(
        {"w": jnp.zeros(2)}, probe_optimizer(), "asp", keep_stale_params=True
    )
    core.join("a", 0.0)
    core.join("b", 0.0)
    core.push("a", {"w": np.ones(2, np.float32)}, version=0, now=1.0)
    # w = 0 - (1 + 0 + 0) = -1
    assert np.asarray(core.params["w"]).tolist() == [-1.0, -1.0]
    assert core.stale_versions == (0,)
    core.push("b", {"w": np.ones(2, np.float32)}, version=0, now=2.0)
    # tau = 1, w - w_0 = -1: w = -1 - (1 + 1 - 1) = -2
    assert np.asarray(core.params["w"]).tolist() == [-2.0, -2.0]
    # Both may still push against version 0 (local steps) until they push
    # against a newer one; then its copy is freed.
    assert core.stale_versions == (0,)
    for w in "ab":
        core.pull(w, 3.0)
    assert core.stale_versions == (0, 2)
    core.push("a", {"w": np.zeros(2, np.float32)}, version=2, now=4.0)
    assert core.stale_versions == (0, 2)
    core.push("b", {"w": np.zeros(2, np.float32)}, version=2, now=4.0)
    assert core.stale_versions == (2,)


def test_stale_copies_bounded_and_evicted_push_dropped():
    core = ServerCore(
        {"w": jnp.zeros(2)},
        optax.sgd(1.0),
        "asp",
        keep_stale_params=True,
        max_stale_copies=1,
    )
    one = {"w": np.ones(2, np.float32)}
    core.join("slow", 0.0)  # gets version 0
    core.join("fast", 0.0)
    core.push("fast", one, version=0, now=1.0)
    core.pull("fast", 1.0)  # gets version 1; copy of 0 evicted (bound 1)
    assert core.stale_versions == (1,)
    actions = core.push("slow", one, version=0, now=2.0)
    assert actions[0].status == "dropped" and actions[0].weight == 0.0
    assert "no stale copy of version 0" in actions[0].reason
    assert only(actions, ForcePull) == [ForcePull("slow", actions[0].reason)]
    assert core.version == 1 and core.worker("slow").dropped_updates == 1


def test_stale_copies_kept_only_while_referenced():
    core = make(keep_stale_params=True)
    core.join("a", 0.0)
    core.join("b", 0.0)
    core.push("a", upd(1.0), version=0, now=1.0)
    core.pull("a", 1.0)
    assert core.stale_versions == (0, 1)
    core.leave("b", 2.0)
    assert core.stale_versions == (0, 1)  # "a" may still push against 0
    core.push("a", upd(0.0), version=1, now=3.0)
    assert core.stale_versions == (1,)
    np.testing.assert_array_equal(core.stale_params(1)["w"], core.params["w"])
    with pytest.raises(KeyError):
        core.stale_params(0)


# Aggregation (n-softsync).


def test_softsync_averages_buffered_updates():
    core = make(ASP(aggregate=2), lr=1.0)
    core.join("a", 0.0)
    core.join("b", 0.0)
    first = core.push("a", upd(1.0), version=0, now=1.0)
    assert first == [PushAck("a", 0, 0, "buffered", 1.0, None, None)]
    assert core.buffered == 1 and core.buffer_contributors == frozenset({"a"})
    second = core.push("b", upd(3.0), version=0, now=2.0)
    assert second[0].status == "applied"
    assert second[1] == Applied(1, ("a", "b"), 0, 2)
    assert w_of(core) == [-2.0, -2.0, -2.0]
    assert core.buffered == 0


def test_softsync_weights_by_num_samples_and_damping():
    class Halve(Policy):
        name = "halve_b"

        def judge(self, core, worker_id, staleness):
            return Verdict(weight=0.5 if worker_id == "b" else 1.0)

        def ready(self, core):
            return core.buffered >= 2

    core = make(Halve())
    core.join("a", 0.0)
    core.join("b", 0.0)
    core.push("a", upd(1.0), version=0, now=1.0, num_samples=1)
    actions = core.push("b", upd(4.0), version=0, now=1.0, num_samples=3)
    assert actions[0].weight == 0.5
    # (1 * 1 * 1 + 3 * 0.5 * 4) / (1 + 3) = 7 / 4
    assert w_of(core) == [-1.75, -1.75, -1.75]


def test_softsync_staleness_is_the_largest_of_the_aggregate():
    core = ServerCore(
        {"w": jnp.zeros(2)},
        probe_optimizer(),
        ASP(aggregate=2),
        keep_stale_params=True,
    )
    zero = {"w": np.zeros(2, np.float32)}
    for w in "abc":
        core.join(w, 0.0)
    core.push("a", zero, version=0, now=1.0)
    core.push("b", zero, version=0, now=1.0)  # version 1: w = -0
    core.pull("a", 1.0)
    core.push("a", zero, version=1, now=2.0)  # tau 0
    actions = core.push("c", zero, version=0, now=2.0)  # tau 1
    assert only(actions, Applied) == [Applied(2, ("a", "c"), 1, 2)]
    # Stale copy is that of version 0 (oldest): w - w_0 = 0, delta = -(0 + 1 + 0)
    assert np.asarray(core.params["w"]).tolist() == [-1.0, -1.0]


# Deadlines, drops, rejoin.


def run_bsp_rounds(core, workers, rounds, start, step):
    """Every worker pushes `step` s after getting params, then pulls."""
    now = start
    for _ in range(rounds):
        now += step
        for w in workers:
            core.push(w, upd(1.0), version=core.version, now=now)
            core.pull(w, now)
    return now


def test_dead_worker_dropped_at_adaptive_deadline_then_rejoins_fresh():
    core = make("bsp", lr=0.1, deadline_factor=3.0, min_timeout=0.5)
    for w in "abc":
        core.join(w, 0.0)
    now = run_bsp_rounds(core, "abc", rounds=3, start=0.0, step=2.0)
    assert core.version == 3 and core.waiting == ()
    # Every measured interval is 2 s, so every timeout is 3 * 2 = 6 s after the
    # worker's last progress (here: getting round 3's parameters at t=6).
    assert core.worker("c").interval == pytest.approx(2.0)
    assert core.worker("c").deadline == pytest.approx(now + 6.0)
    assert core.next_deadline() is None  # nobody waits: no deadline applies
    # "c" dies; "a" and "b" push round 4 and wait.
    core.push("a", upd(1.0), version=3, now=now + 2.0)
    wait = core.pull("a", now + 2.0)
    assert wait == [Wait("a", now + 6.0, "bsp: round 4 not complete")]
    core.push("b", upd(1.0), version=3, now=now + 2.1)
    assert only(core.pull("b", now + 2.1), Wait)
    assert core.next_deadline() == pytest.approx(now + 6.0)
    assert core.tick(now + 5.9) == []
    assert core.waiting == ("a", "b")
    actions = core.tick(now + 6.0)
    reason = actions[0].reason
    assert actions == [
        Drop("c", reason),
        Applied(4, ("a", "b"), 0, 2),
        Release("a", 4, pytest.approx(4.0)),
        SendParams("a", 4, None),
        Release("b", 4, pytest.approx(3.9)),
        SendParams("b", 4, None),
    ]
    assert "deadline" in reason
    assert core.live == {"a", "b"} and not core.worker("c").live
    assert core.worker("c").dropped_reason == reason
    with pytest.raises(WorkerDropped, match="join again"):
        core.push("c", upd(1.0), version=3, now=now + 7.0)
    # It rejoins later with fresh parameters, at the live workers' clock.
    assert core.join("c", now + 8.0) == [SendParams("c", 4, None)]
    assert core.worker("c").clock == core.min_clock == 4
    assert core.worker("c").joins == 2


def test_deadline_of_unmeasured_worker_is_initial_timeout():
    core = make("bsp", initial_timeout=30.0)
    core.join("a", 0.0)
    core.join("b", 1.0)
    core.push("a", upd(1.0), version=0, now=2.0)
    assert core.pull("a", 2.0) == [Wait("a", 31.0, "bsp: round 1 not complete")]
    assert core.tick(30.9) == []
    assert only(core.tick(31.0), Drop) == [Drop("b", core.worker("b").dropped_reason)]
    assert core.version == 1 and core.waiting == ()


def test_timeout_clipped_to_min_and_max():
    core = make(
        "bsp", deadline_factor=2.0, min_timeout=5.0, max_timeout=7.0, ewma_alpha=1.0
    )
    core.join("a", 0.0)
    core.join("b", 0.0)
    run_bsp_rounds(core, "ab", rounds=1, start=0.0, step=1.0)
    assert core.worker("a").deadline == pytest.approx(1.0 + 5.0)  # 2 * 1 < 5
    run_bsp_rounds(core, "ab", rounds=1, start=1.0, step=10.0)
    assert core.worker("a").deadline == pytest.approx(11.0 + 7.0)  # capped


def test_leave_lets_barrier_proceed():
    core = make("bsp")
    for w in "ab":
        core.join(w, 0.0)
    core.push("a", upd(1.0), version=0, now=1.0)
    core.pull("a", 1.0)
    actions = core.leave("b", 2.0)
    assert actions == [
        Applied(1, ("a",), 0, 1),
        Release("a", 1, 1.0),
        SendParams("a", 1, None),
    ]
    assert core.leave("b", 3.0) == []  # leaving twice is harmless
    assert core.worker("b").dropped_reason is None


def test_rejoin_while_live_cancels_wait():
    core = make("bsp")
    for w in "ab":
        core.join(w, 0.0)
    core.push("a", upd(1.0), version=0, now=1.0)
    core.pull("a", 1.0)
    assert core.waiting == ("a",)
    # "a" restarts: it joins at the smallest clock (0) and may go on at once.
    assert core.join("a", 2.0) == [SendParams("a", 0, None)]
    assert core.waiting == () and core.worker("a").clock == 0


def test_repeated_pull_while_waiting_waits_again():
    core = make("bsp")
    for w in "ab":
        core.join(w, 0.0)
    core.push("a", upd(1.0), version=0, now=1.0)
    first = core.pull("a", 1.0)
    again = core.pull("a", 1.5)
    assert first == again and core.waiting == ("a",)


def test_start_held_for_expected_workers():
    core = make("asp", expected_workers=3, start_timeout=10.0)
    assert core.join("a", 0.0) == [
        Wait("a", 10.0, "start: 1 of 3 expected workers live")
    ]
    assert not core.started and core.next_deadline() == 10.0
    assert core.join("b", 1.0) == [
        Wait("b", 10.0, "start: 2 of 3 expected workers live")
    ]
    actions = core.join("c", 2.0)
    assert actions == [
        SendParams("c", 0, None),
        Release("a", 0, 2.0),
        SendParams("a", 0, None),
        Release("b", 0, 1.0),
        SendParams("b", 0, None),
    ]
    assert core.started


def test_start_timeout_begins_with_whoever_joined():
    core = make("asp", expected_workers=3, start_timeout=10.0)
    core.join("a", 0.0)
    assert core.tick(9.0) == []
    assert core.tick(10.0) == [Release("a", 0, 10.0), SendParams("a", 0, None)]
    assert core.started and core.next_deadline() is None


# Measurements.


def test_step_statistics_ewma():
    core = make(ewma_alpha=0.5)
    core.join("a", 0.0)
    core.push("a", upd(1.0), version=0, now=2.0, step_time=1.5, local_steps=3)
    info = core.worker("a")
    assert (info.interval, info.step_time, info.time_per_step, info.overhead) == (
        2.0,
        1.5,
        0.5,
        0.5,
    )
    core.pull("a", 3.0)
    core.push("a", upd(1.0), version=1, now=7.0, loss=0.25)  # interval 4
    info = core.worker("a")
    assert info.interval == 3.0  # 0.5 * 4 + 0.5 * 2
    assert info.step_time == 2.75  # no step_time: the interval, 0.5*4 + 0.5*1.5
    assert info.time_per_step == 2.25  # 0.5 * 4 / 1 + 0.5 * 0.5
    assert info.overhead == 0.5  # unchanged without a reported step_time
    assert info.last_loss == 0.25


def test_stragglers_by_measured_interval():
    core = make(straggler_factor=2.0)
    for w in "abc":
        core.join(w, 0.0)
    core.push("a", upd(1.0), version=0, now=1.0)
    core.push("b", upd(1.0), version=0, now=1.2)
    assert core.stragglers == ()
    core.push("c", upd(1.0), version=0, now=5.0)
    assert core.stragglers == ("c",)


# Bad input: clear errors, nothing changed.


@pytest.fixture
def busy_core():
    core = make("bsp")
    for w in "ab":
        core.join(w, 0.0)
    core.push("a", upd(1.0), version=0, now=1.0)
    core.pull("a", 1.0)
    return core


@pytest.mark.parametrize(
    ("call", "error", "match"),
    [
        (
            lambda c: c.push("zz", upd(1.0), version=0, now=2.0),
            UnexpectedMessage,
            "not joined",
        ),
        (lambda c: c.pull("zz", 2.0), UnexpectedMessage, "not joined"),
        (lambda c: c.leave("zz", 2.0), UnexpectedMessage, "not joined"),
        (lambda c: c.pull(["x"], 2.0), UnexpectedMessage, "not joined"),
        (
            lambda c: c.push("b", upd(1.0), version=1, now=2.0),
            InvalidUpdate,
            r"\[0, 0\]",
        ),
        (
            lambda c: c.push("b", upd(1.0), version=-1, now=2.0),
            InvalidUpdate,
            "version",
        ),
        (
            lambda c: c.push("b", upd(1.0), version=True, now=2.0),
            InvalidUpdate,
            "version",
        ),
        (
            lambda c: c.push("b", {"w": np.zeros(3)}, version=0, now=2.0),
            SpecMismatch,
            "structure",
        ),
        (
            lambda c: c.push("b", [np.zeros(3), 0.0], version=0, now=2.0),
            SpecMismatch,
            "structure",
        ),
        (
            lambda c: c.push("b", {"w": np.zeros(4), "b": 0.0}, version=0, now=2.0),
            SpecMismatch,
            r"shape \(4,\)",
        ),
        (
            lambda c: c.push(
                "b", {"w": np.zeros(3, bool), "b": 0.0}, version=0, now=2.0
            ),
            SpecMismatch,
            "dtype bool",
        ),
        (
            lambda c: c.push(
                "b", {"w": np.zeros(3, complex), "b": 0.0}, version=0, now=2.0
            ),
            SpecMismatch,
            "dtype complex",
        ),
        (
            lambda c: c.push(
                "b", {"w": np.array([0, np.nan, 0]), "b": 0.0}, version=0, now=2.0
            ),
            NonFiniteUpdate,
            "NaN",
        ),
        (
            lambda c: c.push("b", upd(np.inf), version=0, now=2.0),
            NonFiniteUpdate,
            "NaN",
        ),
        (
            lambda c: c.push("b", upd(1.0), version=0, now=2.0, step_time=-1.0),
            InvalidUpdate,
            "step_time",
        ),
        (
            lambda c: c.push("b", upd(1.0), version=0, now=2.0, num_samples=0),
            InvalidUpdate,
            "num_samples",
        ),
        (
            lambda c: c.push("b", upd(1.0), version=0, now=2.0, local_steps=1.5),
            InvalidUpdate,
            "local_steps",
        ),
        (
            lambda c: c.push("b", upd(1.0), version=0, now=2.0, loss=float("nan")),
            InvalidUpdate,
            "loss",
        ),
        (lambda c: c.push("b", upd(1.0), version=0, now=0.5), ValueError, "backwards"),
        (lambda c: c.tick(float("nan")), ValueError, "finite"),
        (lambda c: c.join(1.5, 2.0), ValueError, "an int or a str"),
        (lambda c: c.set_stage(1, 2.0), ValueError, "no stages"),
    ],
)
def test_bad_input_raises_and_changes_nothing(busy_core, call, error, match):
    before = snapshot(busy_core)
    with pytest.raises(error, match=match):
        call(busy_core)
    assert_same(snapshot(busy_core), before)


def test_protocol_errors_share_the_hierarchy():
    assert issubclass(UnexpectedMessage, HpsError)
    assert issubclass(SpecMismatch, InvalidUpdate)
    assert issubclass(WorkerDropped, HpsError)


def test_compatible_dtypes_are_cast():
    core = make(params={"w": jnp.zeros(2, jnp.bfloat16)})
    core.join("a", 0.0)
    core.push("a", {"w": np.array([1.0, 2.0], np.float64)}, version=0, now=1.0)
    assert core.params["w"].dtype == jnp.bfloat16
    assert np.asarray(core.params["w"], np.float32).tolist() == [-1.0, -2.0]


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"policy": "nope"}, "valid names"),
        (
            {"policy_kwargs": {"staleness_bound": -1}, "policy": "ssp"},
            "staleness_bound",
        ),
        ({"expected_workers": 0}, "expected_workers"),
        ({"deadline_factor": 0.0}, "deadline_factor"),
        ({"min_timeout": -1.0}, "min_timeout"),
        ({"max_timeout": 0.5}, "max_timeout"),
        ({"ewma_alpha": 0.0}, "ewma_alpha"),
        ({"max_stale_copies": 0}, "max_stale_copies"),
        ({"start_timeout": float("inf")}, "start_timeout"),
    ],
)
def test_bad_constructor_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        make(**kwargs)


def test_bad_params_and_optimizer():
    with pytest.raises(ValueError, match="at least one array"):
        ServerCore({}, optax.sgd(1.0))
    with pytest.raises(ValueError, match="GradientTransformation"):
        ServerCore(params0(), "sgd")
    with pytest.raises(ValueError, match="only numbers"):
        ServerCore({"w": jnp.zeros(2, bool)}, optax.sgd(1.0))


# Checkpoints.


def test_state_dict_round_trip_through_msgpack():
    core = make("ssp", lr=0.5, policy_kwargs={"staleness_bound": 1})
    for w in "ab":
        core.join(w, 0.0)
    core.push("a", upd(1.0), version=0, now=1.0, step_time=0.8, loss=2.0)
    core.push("b", upd(1.0), version=0, now=1.5)
    core.leave("b", 2.0)
    state = msgpack.unpackb(msgpack.packb(core.state_dict()))
    params = jax.tree.map(np.asarray, core.params)

    restored = make("ssp", lr=0.5, policy_kwargs={"staleness_bound": 1})
    restored.load_state_dict(state, params=params, opt_state=core.opt_state)
    assert restored.version == 2
    assert restored.live == frozenset()  # workers join again after a restart
    for w in "ab":
        before, after = core.worker(w), restored.worker(w)
        assert after.clock == before.clock and after.pushes == before.pushes
        assert after.interval == before.interval and after.last_loss == before.last_loss
        assert not after.live
    np.testing.assert_array_equal(restored.params["w"], core.params["w"])
    assert restored.state_dict() == core.state_dict()
    # A restored worker rejoins with its measurements and continues.
    assert restored.join("a", 100.0) == [SendParams("a", 2, None)]
    assert restored.worker("a").clock == 1


@pytest.mark.parametrize(
    "corrupt",
    [
        lambda s: s.pop("version"),
        lambda s: s.update(version=-1),
        lambda s: s.update(policy="bsp"),
        lambda s: s.update(format=99),
        lambda s: s["workers"][0].update(clock="x"),
        lambda s: s["workers"][0].update(interval=float("inf")),
        lambda s: s["workers"][0].pop("pushes"),
        lambda s: s["workers"].append({"worker_id": 1.5}),
        lambda s: s.update(policy_state={"extra": 1}),
    ],
)
def test_bad_state_dict_raises_and_changes_nothing(corrupt):
    core = make("asp")
    core.join("a", 0.0)
    core.push("a", upd(1.0), version=0, now=1.0)
    state = core.state_dict()
    corrupt(state)
    before = snapshot(core)
    with pytest.raises(ValueError):
        core.load_state_dict(state)
    assert_same(snapshot(core), before)


def test_load_rejects_mismatched_params():
    core = make()
    state = core.state_dict()
    with pytest.raises(ValueError, match="params to restore"):
        core.load_state_dict(state, params={"w": np.zeros(4), "b": np.float32(0)})
    with pytest.raises(ValueError, match="opt_state"):
        core.load_state_dict(state, opt_state=(optax.EmptyState(), 1))


def test_load_holds_start_again():
    core = make("asp", expected_workers=2)
    core.join("a", 0.0)
    core.join("b", 0.0)
    restored = make("asp", expected_workers=2)
    restored.load_state_dict(core.state_dict())
    assert not restored.started
    assert only(restored.join("a", 5.0), Wait)


# Hot path.


def test_no_recompilation_across_events():
    core = make(ASP(aggregate=2))
    steps = core.aggregator._steps
    fns = (steps.checked_apply, steps.accumulate, steps.all_finite)
    # Cores of other shapes made earlier in this process share the caches of
    # the functions their steps are made of.
    before = [fn._cache_size() for fn in fns]
    for w in range(4):
        core.join(w, 0.0)
    for step in range(40):
        w = step % 4
        # Host (numpy) and device (jax) updates alike.
        update = upd(0.01) if step % 2 else jax.tree.map(jnp.asarray, upd(0.01))
        core.push(w, update, version=core.pulled_version(w), now=1.0 + step)
        core.pull(w, 1.0 + step)
    assert core.version == 20
    for fn, n in zip(fns, before, strict=True):
        assert fn._cache_size() <= n + 1


def test_deadline_bookkeeping_stays_bounded():
    core = make("asp")
    for w in range(3):
        core.join(w, 0.0)
    for step in range(600):
        w = step % 3
        core.push(w, upd(0.0), version=core.pulled_version(w), now=1.0 + step)
        core.pull(w, 1.0 + step)
    assert core._members.heap_size <= 4 * 3 + 64 + 1


@pytest.mark.parametrize(
    "policy_cls, kwargs",
    [
        (BSP, {}),
        (SSP, {"staleness_bound": 1}),
        (SemiAsync, {"max_staleness": 2}),
    ],
)
def test_admit_key_skips_change_nothing(policy_cls, kwargs):
    """A core that skips re-checks by ``admit_key`` acts as one that always scans."""

    class AlwaysScan(policy_cls):
        def admit_key(self, core):
            return None

    rng = np.random.default_rng(0)
    fast = ServerCore(params0(), optax.sgd(1.0), policy_cls(**kwargs))
    slow = ServerCore(params0(), optax.sgd(1.0), AlwaysScan(**kwargs))
    workers = list(range(5))
    joined, now = set(), 0.0
    for _ in range(400):
        now += float(rng.uniform(0.0, 0.05))
        w = int(rng.choice(workers))
        event = rng.choice(["pull", "push", "push", "leave", "tick"])
        if w not in joined:
            calls = [(core.join, (w, now), {}) for core in (fast, slow)]
            joined.add(w)
        elif event == "pull":
            calls = [(core.pull, (w, now), {}) for core in (fast, slow)]
        elif event == "push" and not fast.is_waiting(w):
            calls = [
                (
                    core.push,
                    (w, upd(0.01)),
                    {"version": core.pulled_version(w), "now": now},
                )
                for core in (fast, slow)
            ]
        elif event == "leave":
            calls = [(core.leave, (w, now), {}) for core in (fast, slow)]
            joined.discard(w)
        else:
            calls = [(core.tick, (now,), {}) for core in (fast, slow)]
        results = []
        for fn, args, kw in calls:
            try:
                results.append(fn(*args, **kw))
            except HpsError as err:
                results.append(type(err))
        assert results[0] == results[1]
    assert fast.version == slow.version and fast.version > 0


@pytest.mark.parametrize(
    "policy,kwargs", [("asp", {}), ("bsp", {}), ("ssp", {"staleness_bound": 2})]
)
@pytest.mark.parametrize("optimizer", [optax.sgd(0.1), optax.adam(1e-2)])
def test_deferred_applies_match_applying_at_once(policy, kwargs, optimizer):
    rng = np.random.default_rng(0)
    params = {"a": jnp.asarray(rng.normal(size=(5, 3)), jnp.float32)}
    cores = [
        ServerCore(params, optimizer, policy, policy_kwargs=kwargs, aggregator=agg)
        for agg in (Aggregator, DeferredAggregator)
    ]
    for core in cores:
        for w in range(3):
            core.join(w, 0.0)
    for i in range(40):
        w = int(rng.integers(3))
        update = {"a": rng.normal(size=(5, 3)).astype(np.float32)}
        samples = int(rng.integers(1, 4))
        answers = []
        for core in cores:
            version = core.pulled_version(w)
            answers.append(
                core.push(w, update, version=version, now=i + 1.0, num_samples=samples)
                + core.pull(w, i + 1.0)
            )
        assert answers[0] == answers[1]
        if i % 9 == 0:
            np.testing.assert_allclose(
                cores[1].params["a"], cores[0].params["a"], rtol=1e-6, atol=1e-7
            )
    deferring = cores[1].aggregator
    assert deferring.deferred_applies > 0 or cores[1].version == cores[0].version
    rows, history = deferring.apply_deferred()
    for version, row in rows.items():
        assert 0 < version <= cores[1].version and 0 <= row < len(history[0])
    np.testing.assert_allclose(
        cores[1].params["a"], cores[0].params["a"], rtol=1e-6, atol=1e-7
    )
    for deferred, at_once in zip(
        jax.tree.leaves(cores[1].opt_state),
        jax.tree.leaves(cores[0].opt_state),
        strict=True,
    ):
        np.testing.assert_allclose(deferred, at_once, rtol=1e-6, atol=1e-7)


class _Group:
    """Lazy updates' group: rows of known values, their sum asked for once."""

    def __init__(self, rows, sizes):
        self.rows, self.sizes, self.asked, self.evaluated = rows, sizes, [], 0

    def weighted_sum(self, rows, weights):
        self.asked.append((rows, weights))
        ratios = [w / self.sizes[j] for j, w in zip(rows, weights, strict=True)]
        if sorted(rows) != list(range(len(self.rows))) or not np.allclose(
            ratios, ratios[0], rtol=1e-6
        ):
            return None
        return (
            sum(n * r for n, r in zip(self.sizes, self.rows, strict=True)) * ratios[0],
        )


class _Lazy(LazyUpdate):
    def __init__(self, group, row):
        self.group, self.row = group, row

    def leaves(self):
        self.group.evaluated += 1
        return (self.group.rows[self.row],)


@pytest.mark.parametrize("push_weights", [None, {2: 0.5}])
def test_lazy_updates_of_one_version_are_asked_for_their_sum(push_weights):
    rng = np.random.default_rng(0)
    rows = [rng.normal(size=(4,)).astype(np.float32) for _ in range(3)]
    sizes = [8, 8, 16]
    cores = [
        ServerCore({"a": jnp.zeros(4)}, optax.sgd(0.1), "bsp", aggregator=agg,
                   push_weights=push_weights)
        for agg in (Aggregator, DeferredAggregator)
    ]  # fmt: skip
    group = _Group(rows, sizes)
    for core in cores:
        for w in range(3):
            core.join(w, 0.0)
    for w in (2, 0, 1):  # pushed out of row order
        cores[0].push(w, {"a": rows[w]}, version=0, now=1.0, num_samples=sizes[w])
        meta = PushMeta(0, None, sizes[w], None, None, None)
        cores[1].push_message(w, _Lazy(group, w), meta, now=1.0)
    np.testing.assert_allclose(cores[1].params["a"], cores[0].params["a"], rtol=1e-6)
    ((asked_rows, weights),) = group.asked
    assert asked_rows == [2, 0, 1]
    np.testing.assert_allclose(
        [weights[asked_rows.index(j)] for j in range(3)],
        np.asarray(sizes) / 32 * [1, 1, 0.5 if push_weights else 1],
        rtol=1e-6,
    )
    # The weighted sum where the weights follow the samples; each row where not.
    assert group.evaluated == (3 if push_weights else 0)


def test_deferred_applies_refuse_stale_copies():
    with pytest.raises(ValueError, match="keep_stale_params"):
        ServerCore(
            {"a": jnp.zeros(2)},
            optax.sgd(0.1),
            aggregator=DeferredAggregator,
            keep_stale_params=True,
        )


# Finite pushes never make the parameters non-finite.


@pytest.mark.parametrize(
    ("dtype", "value", "num_samples"),
    [
        (jnp.float16, 1.0, 100_000),
        (jnp.float32, 1e20, 2**63),
        (jnp.bfloat16, 1e30, 2**62),
    ],
)
def test_num_samples_never_overflows_the_weighted_update(dtype, value, num_samples):
    params = {"w": jnp.zeros(3, dtype)}
    core = ServerCore(params, optax.sgd(1.0), ASP(aggregate=2))
    core.join("a", 0.0)
    core.join("b", 0.0)
    core.push(
        "a",
        {"w": jnp.full(3, value, dtype)},
        version=0,
        now=1.0,
        num_samples=num_samples,
    )
    acts = core.push(
        "b", {"w": jnp.full(3, value, dtype)}, version=0, now=2.0, num_samples=3
    )
    assert only(acts, Applied)
    w = np.asarray(core.params["w"], np.float32)
    assert np.isfinite(w).all()
    # The average of equal updates is that update, whatever the weights.
    np.testing.assert_allclose(w, -np.float32(jnp.asarray(value, dtype)), rtol=1e-2)


def test_num_samples_weights_stay_exact_for_small_counts():
    core = make(ASP(aggregate=2))
    core.join("a", 0.0)
    core.join("b", 0.0)
    core.push("a", upd(1.0), version=0, now=1.0, num_samples=3)
    core.push("b", upd(5.0), version=0, now=2.0, num_samples=1)
    np.testing.assert_allclose(w_of(core), [-2.0] * 3, rtol=1e-6)


@pytest.mark.parametrize("aggregator", [Aggregator, DeferredAggregator])
def test_deferred_weights_are_bounded_too(aggregator):
    params = {"w": jnp.zeros(3, jnp.float16)}
    core = ServerCore(params, optax.sgd(1.0), "asp", aggregator=aggregator)
    core.join("a", 0.0)
    core.push(
        "a", {"w": jnp.ones(3, jnp.float16)}, version=0, now=1.0, num_samples=100_000
    )
    assert np.asarray(core.params["w"]).tolist() == [-1.0] * 3


def test_push_whose_apply_overflows_is_refused_and_changes_nothing():
    params = {"w": jnp.full(3, -1e38, jnp.float32), "b": jnp.zeros((), jnp.float32)}
    core = ServerCore(params, optax.sgd(1.0), "asp")
    core.join("a", 0.0)
    before = snapshot(core)
    update = {"w": np.full(3, 3.3e38, np.float32), "b": np.float32(0)}
    with pytest.raises(NonFiniteUpdate, match=r"parameter \['w'\] non-finite"):
        core.push("a", update, version=0, now=1.0, num_samples=32)
    assert_same(snapshot(core), before)
    assert core.worker("a").pushes == 0
    # The worker goes on with a sound update.
    acts = core.push("a", upd(1.0), version=0, now=2.0)
    assert only(acts, PushAck)[0].status == "applied"
    assert np.isfinite(w_of(core)).all()


def test_push_that_overflows_the_optimizer_state_is_refused():
    params = {"w": jnp.zeros(3, jnp.float32)}
    core = ServerCore(params, optax.adam(1e-3), "asp")
    core.join("a", 0.0)
    state = jax.tree.map(np.asarray, core.opt_state)
    with pytest.raises(NonFiniteUpdate, match="the optimizer state"):
        core.push("a", {"w": np.full(3, 3.3e38, np.float32)}, version=0, now=1.0)
    assert core.version == 0
    jax.tree.map(np.testing.assert_array_equal, core.opt_state, state)


def test_buffered_push_whose_aggregate_overflows_is_refused():
    params = {"w": jnp.full(3, 2e38, jnp.float32)}
    core = ServerCore(params, optax.sgd(-1.0), BSP())
    core.join("a", 0.0)
    core.join("b", 0.0)
    core.push("a", {"w": np.full(3, 1e38, np.float32)}, version=0, now=1.0)
    with pytest.raises(NonFiniteUpdate):
        core.push("b", {"w": np.full(3, 3e38, np.float32)}, version=0, now=2.0)
    assert core.version == 0 and core.buffered == 1
    # The buffered update is applied when b pushes a sound one.
    core.push("b", {"w": np.zeros(3, np.float32)}, version=0, now=3.0)
    assert core.version == 1
    np.testing.assert_allclose(w_of(core), [2.5e38] * 3, rtol=1e-6)


@pytest.mark.parametrize("policy", [BSP, lambda: ASP(aggregate=3)])
def test_a_checked_round_applies_once_and_matches_the_unchecked_one(policy):
    cores = {
        check: ServerCore(params0(), optax.adam(0.1), policy(), check_result=check)
        for check in (True, False)
    }
    trials = []
    aggregator = cores[True].aggregator
    checked = aggregator._steps.checked_apply
    aggregator._steps = aggregator._steps._replace(
        checked_apply=lambda *a: trials.append(1) or checked(*a)
    )
    for core in cores.values():
        for w in range(3):
            core.join(w, 0.0)
        for step in range(12):
            w = step % 3
            core.push(w, upd(0.1 * step), version=core.version, now=1.0 + step)
            core.pull(w, 1.0 + step)
    assert cores[True].version == cores[False].version == 4
    # One optimizer step per version, not one per push.
    assert len(trials) == 4
    jax.tree.map(np.testing.assert_array_equal, cores[True].params, cores[False].params)


def test_push_whose_weighted_buffer_overflows_is_refused():
    params = {"w": jnp.zeros(3, jnp.float32)}
    core = ServerCore(params, optax.sgd(1.0), BSP(), push_weights={"a": 4.0})
    core.join("a", 0.0)
    core.join("b", 0.0)
    before = snapshot(core)
    with pytest.raises(NonFiniteUpdate, match="buffered average"):
        core.push("a", {"w": np.full(3, 3e38, np.float32)}, version=0, now=1.0)
    assert_same(snapshot(core), before)


def test_version_made_without_a_push_to_refuse_keeps_finite_parameters():
    params = {"w": jnp.full(3, 2e38, jnp.float32)}
    core = ServerCore(params, optax.sgd(-1.0), BSP())
    core.join("a", 0.0)
    core.join("b", 0.0)
    # The buffer is finite; its apply is not, and b's leaving completes it.
    core.push("a", {"w": np.full(3, 3e38, np.float32)}, version=0, now=1.0)
    acts = core.leave("b", 2.0)
    assert only(acts, Applied) and core.version == 1
    np.testing.assert_array_equal(w_of(core), [np.float32(2e38)] * 3)


def test_result_check_can_be_turned_off():
    params = {"w": jnp.full(3, -1e38, jnp.float32)}
    core = ServerCore(params, optax.sgd(1.0), "asp", check_result=False)
    core.join("a", 0.0)
    core.push("a", {"w": np.full(3, 3.3e38, np.float32)}, version=0, now=1.0)
    assert np.isinf(w_of(core)).all()


# Joining a running or resumed server.


def test_worker_joining_a_running_server_gets_slack_for_its_first_round():
    core = make("bsp", deadline_factor=2.0, min_timeout=0.5, initial_timeout=60.0)
    core.join("a", 0.0)
    core.join("b", 0.0)
    now = run_bsp_rounds(core, "ab", rounds=50, start=0.0, step=0.1)
    assert core.version == 50 and core.min_clock == 50
    # "b" leaves; a new process of "b" joins at clock 50 and compiles for
    # 20 s while "a" waits for it (its 0.1 s rounds were another process').
    core.leave("b", now)
    assert only(core.join("b", now), SendParams)
    assert core.worker("b").clock == 50
    core.push("a", upd(1.0), version=50, now=now + 0.1)
    assert only(core.pull("a", now + 0.1), Wait)
    assert core.tick(now + 20.0) == []
    acts = core.push("b", upd(1.0), version=50, now=now + 20.0)
    assert only(acts, Applied) and not only(acts, Drop)
    assert core.live == {"a", "b"}
    # From its first measured round on, its deadline follows measured times
    # (2 x its measured interval, not the initial 60 s).
    info = core.worker("b")
    assert info.deadline == pytest.approx(now + 20.0 + 2 * info.interval)


def test_worker_rejoining_a_resumed_core_is_judged_by_its_own_rounds():
    core = make("bsp", deadline_factor=2.0, min_timeout=0.5, initial_timeout=60.0)
    core.join("a", 0.0)
    core.join("b", 0.0)
    run_bsp_rounds(core, "ab", rounds=5, start=0.0, step=0.1)
    state = core.state_dict()
    assert state["workers"][1]["interval"] == pytest.approx(0.1)
    resumed = make("bsp", deadline_factor=2.0, min_timeout=0.5, initial_timeout=60.0)
    resumed.load_state_dict(state)
    t = 1000.0
    resumed.join("a", t)
    resumed.join("b", t + 0.5)
    # Both compile; "a" is done at once, "b" (slower) takes 10 s: not dropped,
    # though 0.1 s rounds were measured before the restart.
    resumed.push("a", upd(1.0), version=5, now=t + 3.0)
    assert only(resumed.pull("a", t + 3.0), Wait)
    assert resumed.next_deadline() == pytest.approx(t + 60.5)
    assert resumed.tick(t + 10.0) == []
    assert only(resumed.push("b", upd(1.0), version=5, now=t + 10.5), Applied)
    assert resumed.version == 6 and resumed.live == {"a", "b"}


def test_drop_reason_names_durations_not_clock_values():
    core = make("bsp", deadline_factor=2.0, min_timeout=0.5, initial_timeout=10.0)
    core.join(3, 2000.0)
    core.join(4, 2000.0)
    core.push(4, upd(1.0), version=0, now=2001.0)
    core.pull(4, 2001.0)
    drop = only(core.tick(2010.0), Drop)[0]
    assert drop.reason == "worker 3 made no progress for 10.0 s (deadline 10.0 s)"
    assert "2010" not in drop.reason and "t=" not in drop.reason
    # The dropped worker rejoins and carries on at the live workers' clock.
    assert only(core.join(3, 2011.0), SendParams)
    assert core.worker(3).clock == core.min_clock == 1
    acts = core.push(3, upd(1.0), version=1, now=2012.0)
    assert only(acts, PushAck)[0].status == "buffered"
    acts = core.push(4, upd(1.0), version=1, now=2012.5)
    assert only(acts, Applied) and core.version == 2
