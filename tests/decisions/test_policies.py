"""Tests of the synchronisation policies, each driven through the server core."""

from __future__ import annotations

import heapq

import jax.numpy as jnp
import msgpack
import numpy as np
import optax
import pytest

from hpsjax.decisions._core import (
    Applied,
    Drop,
    ForcePull,
    PushAck,
    Release,
    SendParams,
    ServerCore,
    StageChanged,
    Wait,
)
from hpsjax.decisions._policies import (
    ADSP,
    ASP,
    BSP,
    POLICIES,
    SSP,
    Hybrid,
    HybridStage,
    Policy,
    SaPS,
    SemiAsync,
    Verdict,
    get_policy,
)


def upd(x):
    return {"w": np.full(2, x, np.float32)}


def make(policy, *, lr=1.0, **kwargs):
    return ServerCore({"w": jnp.zeros(2, jnp.float32)}, optax.sgd(lr), policy, **kwargs)


def w_of(core):
    return np.asarray(core.params["w"]).tolist()


def only(actions, cls):
    return [a for a in actions if isinstance(a, cls)]


# Registry.


def test_registry_names_and_objects():
    assert sorted(POLICIES) == [
        "adsp",
        "asp",
        "bsp",
        "halos",
        "hybrid",
        "naive_optimal",
        "ringleader",
        "ringmaster",
        "saps",
        "semi_async",
        "ssp",
    ]
    assert isinstance(get_policy("BSP"), BSP)
    assert get_policy("ssp", staleness_bound=2).staleness_bound == 2
    assert isinstance(get_policy(SaPS), SaPS)
    policy = SemiAsync(max_staleness=1)
    assert get_policy(policy) is policy


@pytest.mark.parametrize(
    ("args", "kwargs", "match"),
    [
        (
            ("nope",),
            {},
            "valid names are adsp, asp, bsp, halos, hybrid, naive_optimal, "
            "ringleader, ringmaster, saps",
        ),
        (("ssp",), {"staleness_bound": -1}, "staleness_bound must be an int >= 0"),
        (("ssp",), {"staleness_bound": 1.5}, "staleness_bound"),
        (("ssp",), {"bound": 1}, "Bad arguments for policy 'ssp'"),
        (("asp",), {"aggregate": 0}, "aggregate"),
        (("asp",), {"on_stale": "ignore"}, "on_stale"),
        (("saps",), {"threshold": -2}, "threshold"),
        (("saps",), {"on_straggler": "wait"}, "on_straggler"),
        (("semi_async",), {"max_staleness": None}, "max_staleness"),
        (("adsp",), {"check_period": 0}, "check_period"),
        (("adsp",), {"search_factor": 1.0}, "search_factor"),
        (("adsp",), {"max_local_steps": 0}, "max_local_steps"),
        (("adsp",), {"search": "yes"}, "search"),
        (("hybrid",), {"stages": []}, "at least one stage"),
        (("hybrid",), {"stages": "async"}, "sequence"),
        (("hybrid",), {"stages": [object()]}, "mode, local_steps"),
        ((BSP(),), {"x": 1}, "policy object"),
        ((3,), {}, "a name, a Policy subclass"),
    ],
)
def test_get_policy_rejects_bad_input(args, kwargs, match):
    with pytest.raises(ValueError, match=match):
        get_policy(*args, **kwargs)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"mode": "fast"}, "valid modes"),
        ({"local_steps": 0}, "local_steps"),
        ({"mode": "semi_async"}, "needs max_staleness"),
        ({"mode": "sync", "max_staleness": 2}, "staleness 0"),
        ({"until_version": 0}, "until_version"),
    ],
)
def test_hybrid_stage_checks(kwargs, match):
    with pytest.raises(ValueError, match=match):
        HybridStage(**kwargs)


def test_hybrid_until_versions_must_increase():
    with pytest.raises(ValueError, match="increase"):
        Hybrid([HybridStage(until_version=5), HybridStage(until_version=5)])


# BSP.


def test_bsp_round_waits_for_all_and_applies_the_average():
    core = make("bsp")
    for w in "abc":
        assert core.join(w, 0.0) == [SendParams(w, 0, None)]
    assert core.push("a", upd(1.0), version=0, now=1.0) == [
        PushAck("a", 0, 0, "buffered", 1.0, None, None)
    ]
    assert core.pull("a", 1.0) == [Wait("a", 120.0, "bsp: round 1 not complete")]
    core.push("b", upd(2.0), version=0, now=2.0)
    assert only(core.pull("b", 2.0), Wait)
    assert core.waiting == ("a", "b")
    actions = core.push("c", upd(6.0), version=0, now=3.0)
    assert actions == [
        PushAck("c", 1, 0, "applied", 1.0, None, None),
        Applied(1, ("a", "b", "c"), 0, 3),
        Release("a", 1, 2.0),
        SendParams("a", 1, None),
        Release("b", 1, 1.0),
        SendParams("b", 1, None),
    ]
    assert w_of(core) == [-3.0, -3.0]  # -(1 + 2 + 6) / 3
    assert core.pull("c", 3.0) == [SendParams("c", 1, None)]
    # Round 2: the same again, one version per round, staleness 0 throughout.
    acks = []
    for i, w in enumerate("cab"):
        acks.append(core.push(w, upd(3.0), version=1, now=4.0 + i)[0])
        core.pull(w, 4.0 + i)
    assert [a.status for a in acks] == ["buffered", "buffered", "applied"]
    assert [a.staleness for a in acks] == [0, 0, 0]
    assert core.version == 2 and w_of(core) == [-6.0, -6.0]
    assert core.waiting == ()


def test_bsp_joiner_takes_part_in_the_current_round():
    core = make("bsp")
    core.join("a", 0.0)
    core.join("b", 0.0)
    core.push("a", upd(1.0), version=0, now=1.0)
    core.pull("a", 1.0)
    assert core.join("c", 1.5) == [SendParams("c", 0, None)]
    core.push("b", upd(1.0), version=0, now=2.0)
    assert core.version == 0  # the round now also waits for "c"
    actions = core.push("c", upd(4.0), version=0, now=3.0)
    assert only(actions, Applied) == [Applied(1, ("a", "b", "c"), 0, 3)]
    assert w_of(core) == [-2.0, -2.0]


# ASP.


def test_asp_applies_every_push_and_nobody_waits():
    core = make("asp")
    seen = []
    for w in "ab":
        seen += core.join(w, 0.0)
    script = [("a", 1.0), ("a", 2.0), ("b", 2.5), ("a", 3.0), ("b", 5.0)]
    stalenesses = []
    for w, t in script:
        version = core.pulled_version(w)
        actions = core.push(w, upd(1.0), version=version, now=t)
        stalenesses.append(actions[0].staleness)
        assert actions[0].status == "applied"
        seen += actions + core.pull(w, t)
    assert stalenesses == [0, 0, 2, 1, 1]
    assert not only(seen, Wait) and core.version == 5
    assert w_of(core) == [-5.0, -5.0]


def test_asp_with_staleness_bound_damps_without_waiting():
    core = make(ASP(max_staleness=1))
    for w in "abc":
        core.join(w, 0.0)
    core.push("a", upd(1.0), version=0, now=1.0)
    core.push("b", upd(1.0), version=0, now=1.0)
    ack = core.push("c", upd(1.0), version=0, now=1.0)[0]
    assert (ack.staleness, ack.weight) == (2, pytest.approx(2 / 3))
    assert "damped" in ack.reason
    assert w_of(core) == pytest.approx([-(2 + 2 / 3)] * 2)


# SSP.


def test_ssp_exact_bound_proceeds_one_past_waits():
    core = make(SSP(staleness_bound=2))
    core.join("fast", 0.0)
    core.join("slow", 0.0)
    for clock in (1, 2):  # clock - min = 1, 2 <= s: proceeds
        core.push("fast", upd(1.0), version=core.version, now=float(clock))
        assert core.pull("fast", float(clock)) == [SendParams("fast", clock, None)]
    core.push("fast", upd(1.0), version=core.version, now=3.0)
    assert core.pull("fast", 3.0) == [
        Wait("fast", 120.0, "ssp: clock 3 ahead of slowest 0 by more than 2")
    ]
    actions = core.push("slow", upd(1.0), version=0, now=4.0)
    assert actions == [
        PushAck("slow", 4, 3, "applied", 1.0, None, None),
        Applied(4, ("slow",), 3, 1),
        Release("fast", 4, 1.0),
        SendParams("fast", 4, None),
    ]


def test_ssp_waiter_released_when_slow_worker_dropped():
    core = make(SSP(staleness_bound=0), initial_timeout=10.0)
    core.join("fast", 0.0)
    core.join("dead", 0.0)
    core.push("fast", upd(1.0), version=0, now=1.0)
    assert only(core.pull("fast", 1.0), Wait)
    assert core.next_deadline() == 10.0
    actions = core.tick(10.0)
    assert [type(a) for a in actions] == [Drop, Release, SendParams]
    assert actions[0].worker_id == "dead" and actions[1].worker_id == "fast"


# SaPS.


def saps_script(core):
    """Fast a and b push four times while slow c computes on version 0."""
    actions = []
    for w in "abc":
        actions += core.join(w, 0.0)
    for t, w in [(1.0, "a"), (1.1, "b"), (2.0, "a"), (2.1, "b")]:
        actions += core.push(w, upd(1.0), version=core.pulled_version(w), now=t)
        actions += core.pull(w, t)
    slow = core.push("c", upd(1.0), version=0, now=5.0)
    return actions, slow


def test_saps_damps_straggler_and_forces_pull_fast_never_wait():
    core = make(SaPS(threshold=2))
    fast, slow = saps_script(core)
    assert not only(fast, Wait) and not only(fast, ForcePull)
    assert [a.staleness for a in only(fast, PushAck)] == [0, 1, 1, 1]
    ack = slow[0]
    assert (ack.staleness, ack.status) == (4, "applied")
    assert ack.weight == pytest.approx(0.6)  # (1 + 2) / (1 + 4)
    assert slow[1] == ForcePull("c", "saps straggler: staleness 4 > 2, damped")
    assert w_of(core) == pytest.approx([-4.6, -4.6])
    assert core.pull("c", 5.0) == [SendParams("c", 5, None)]


def test_saps_drop_mode_discards_straggler_update():
    core = make(SaPS(threshold=2, on_straggler="drop"))
    _, slow = saps_script(core)
    assert slow[0] == PushAck(
        "c",
        4,
        4,
        "dropped",
        0.0,
        None,
        "saps straggler: staleness 4 > 2, dropped",
        force_pull=True,
    )
    assert only(slow, ForcePull) and core.version == 4
    assert w_of(core) == [-4.0, -4.0]
    assert core.worker("c").dropped_updates == 1


def test_saps_default_threshold_follows_live_workers():
    core = make("saps")
    policy = core.policy
    for w in "abc":
        core.join(w, 0.0)
    assert policy.current_threshold(core) == 4  # 2 * (3 - 1)
    _, slow = saps_script(make("saps"))
    assert slow[0].weight == 1.0 and len(slow) == 2  # tau 4 <= 4: no straggler


# Semi-async.


def test_semi_async_bounds_version_staleness():
    core = make(SemiAsync(max_staleness=2))
    for w in "abc":
        core.join(w, 0.0)
    core.push("a", upd(1.0), version=0, now=1.0)
    assert core.pull("a", 1.0) == [SendParams("a", 1, None)]  # V - 0 = 1
    core.push("b", upd(1.0), version=0, now=1.1)
    assert core.pull("b", 1.1) == [SendParams("b", 2, None)]  # exactly 2
    core.push("a", upd(1.0), version=1, now=2.0)
    assert core.pull("a", 2.0) == [
        Wait("a", 5.5, "semi_async: a computing worker is 3 versions behind (bound 2)")
    ]
    core.push("b", upd(1.0), version=2, now=2.1)
    assert only(core.pull("b", 2.1), Wait)
    # The slow worker's push is beyond the bound: damped; the others still wait
    # until it pulls fresh parameters.
    ack = core.push("c", upd(1.0), version=0, now=3.0)
    assert ack[0].staleness == 4 and ack[0].weight == pytest.approx(0.6)
    assert ack[1:] == [Applied(5, ("c",), 4, 1)]
    assert core.waiting == ("a", "b")
    assert core.pull("c", 3.5) == [
        SendParams("c", 5, None),
        Release("a", 5, 1.5),
        SendParams("a", 5, None),
        Release("b", 5, pytest.approx(1.4)),
        SendParams("b", 5, None),
    ]


def test_semi_async_drop_mode():
    core = make(SemiAsync(max_staleness=0, on_stale="drop"))
    core.join("a", 0.0)
    core.join("b", 0.0)
    core.push("a", upd(1.0), version=0, now=1.0)
    ack = core.push("b", upd(1.0), version=0, now=1.5)[0]
    assert (ack.status, ack.staleness, core.version) == ("dropped", 1, 1)


# ADSP.


def drive(core, speeds, *, until, loss=None):
    """Virtual-clock loop: each worker takes `speeds[w]` s per local step,
    pushes after the hinted number of local steps, and pulls at once."""
    hints = {}
    events = []
    for w in speeds:
        hints[w] = core.join(w, 0.0)[0].local_steps or 1
        heapq.heappush(events, (hints[w] * speeds[w], w))
    while events:
        now, w = heapq.heappop(events)
        if now > until:
            break
        steps = hints[w]
        ack = core.push(
            w,
            upd(0.001),
            version=core.pulled_version(w),
            now=now,
            step_time=steps * speeds[w],
            local_steps=steps,
            loss=None if loss is None else loss(now),
        )[0]
        core.pull(w, now)
        hints[w] = ack.local_steps or 1
        heapq.heappush(events, (now + hints[w] * speeds[w], w))
    return hints


def test_adsp_balances_commit_rates_of_a_1_to_4_speed_ratio():
    speeds = {"fast": 0.25, "slow": 1.0}
    core = make(ADSP(check_period=8.0, search=False))
    hints = drive(core, speeds, until=40.0)
    policy = core.policy
    # C_max = floor(8 / 1.0) = 8 commits per period: one commit per second.
    assert policy.target == 8
    assert hints == {"fast": 4, "slow": 1}
    assert policy.last_counts == {"fast": 8, "slow": 8}
    assert not core.waiting

    # Without the hints the fast worker commits four times as often.
    asp = make("asp")
    drive(asp, speeds, until=40.0)
    assert asp.worker("fast").pushes == 4 * asp.worker("slow").pushes


def test_adsp_fixed_target_sets_local_steps():
    core = make(ADSP(check_period=8.0, commits_per_period=2, search=False))
    hints = drive(core, {"fast": 0.25, "slow": 1.0}, until=40.0)
    assert hints == {"fast": 16, "slow": 4}  # T / C = 4 s per commit
    assert core.policy.last_counts == {"fast": 2, "slow": 2}


def test_adsp_searches_commit_rate_from_losses():
    policy = ADSP(check_period=10.0, search_factor=2.0)
    core = make(policy)
    core.join("a", 0.0)
    losses = {1: 5.0, 2: 3.0, 3: 2.0, 4: 1.8, 5: 1.0}  # mean loss per period
    targets = []
    for t in range(1, 60):
        period = (t - 1) // 10 + 1
        core.push(
            "a",
            upd(0.0),
            version=core.version,
            now=float(t),
            step_time=1.0,
            loss=losses.get(period, 1.0),
        )
        if (t - 1) % 10 == 0 and t > 1:
            targets.append(policy.target)
    # p1: C = C_max = 10; p2: first loss mean; p3: gain 0.1, C -> 5 (fewer
    # commits first); p4: gain 0.02 < 0.1, turn: C -> 10; p5: gain 0.08 > 0.02,
    # keep going up, capped at C_max = 10.
    assert targets == [10, 10, 5, 10, 10]
    assert core.push("a", upd(0.0), version=core.version, now=60.0)[0].local_steps == 1


def test_adsp_state_round_trip():
    policy = ADSP(check_period=8.0, search=False)
    core = make(policy)
    drive(core, {"fast": 0.25, "slow": 1.0}, until=20.0)
    state = msgpack.unpackb(msgpack.packb(core.state_dict()))
    restored = make(ADSP(check_period=8.0, search=False))
    restored.load_state_dict(state)
    assert restored.policy.state_dict() == policy.state_dict()
    assert restored.policy.target == 8
    with pytest.raises(ValueError, match="ADSP state"):
        restored.policy.load_state_dict({"target": 3})
    with pytest.raises(ValueError, match="direction"):
        restored.policy.load_state_dict(policy.state_dict() | {"direction": 0})


# Hybrid.


def test_hybrid_switches_from_async_to_sync_by_version():
    policy = Hybrid(
        [
            HybridStage("async", local_steps=4, until_version=2),
            HybridStage("sync", local_steps=1),
        ]
    )
    core = make(policy)
    assert core.join("a", 0.0) == [SendParams("a", 0, 4)]
    core.join("b", 0.0)
    assert core.push("a", upd(1.0), version=0, now=1.0)[0].local_steps == 4
    assert core.pull("a", 1.0) == [SendParams("a", 1, 4)]
    ack = core.push("b", upd(1.0), version=0, now=1.5)[0]
    assert (ack.status, ack.version, ack.local_steps, policy.stage) == (
        "applied",
        2,
        1,
        1,
    )
    # Sync from here: "a" (clock 2) waits for "b" (clock 1).
    core.push("a", upd(1.0), version=1, now=2.0)
    assert only(core.pull("a", 2.0), Wait)[0].reason.startswith("hybrid stage 1: bsp")
    assert core.pull("b", 2.0) == [SendParams("b", 2, 1)]
    actions = core.push("b", upd(3.0), version=2, now=3.0)
    assert only(actions, Applied) == [Applied(3, ("a", "b"), 1, 2)]
    assert only(actions, Release) == [Release("a", 3, 1.0)]
    assert w_of(core) == [-4.0, -4.0]  # -1 - 1 - (1 + 3) / 2


def test_hybrid_set_stage_reexamines_waiters_and_buffer():
    core = make(Hybrid([HybridStage("sync"), HybridStage("async", local_steps=8)]))
    core.join("a", 0.0)
    core.join("b", 0.0)
    core.push("a", upd(2.0), version=0, now=1.0)
    assert only(core.pull("a", 1.0), Wait)
    actions = core.set_stage(1, 2.0)
    assert actions == [
        StageChanged(1, 0),
        Applied(1, ("a",), 0, 1),
        Release("a", 1, 1.0),
        SendParams("a", 1, 8),
    ]
    with pytest.raises(ValueError, match="Stage index"):
        core.set_stage(2, 3.0)
    assert core.policy.stage == 1


def test_hybrid_accepts_transform_stages():
    stages_module = pytest.importorskip("hpsjax.transforms._stages")
    stages = [
        stages_module.Stage(optax.sgd(0.1), mode="async", local_steps=8, until_step=3),
        stages_module.Stage(optax.sgd(0.1), mode="semi_async", max_staleness=2),
    ]
    policy = Hybrid(stages)
    assert policy.stages == (
        HybridStage("async", 8, None, 3),
        HybridStage("semi_async", 1, 2, None),
    )
    state = policy.state_dict()
    policy.set_stage(None, 1)
    assert policy.stage == 1
    policy.load_state_dict(state)
    assert policy.stage == 0
    with pytest.raises(ValueError, match="out of range"):
        policy.load_state_dict({"stage": 5})


# Writing one's own policy.


def test_custom_policy_extension_point():
    class HareTortoise(Policy):
        """The hare may not get more than one push ahead of the tortoise."""

        name = "hare_tortoise"

        def admit(self, core, worker_id):
            if worker_id != "hare" or "tortoise" not in core.live:
                return True
            return core.clock("hare") <= core.clock("tortoise") + 1

        def judge(self, core, worker_id, staleness):
            if staleness > 3:
                return Verdict(weight=0.0, force_pull=True, reason="too stale")
            return Verdict()

        def local_steps(self, core, worker_id):
            return 2 if worker_id == "hare" else 1

    core = make(HareTortoise(), initial_timeout=50.0)
    assert core.join("hare", 0.0) == [SendParams("hare", 0, 2)]
    core.join("tortoise", 0.0)
    core.push("hare", upd(1.0), version=0, now=1.0)
    assert core.pull("hare", 1.0) == [SendParams("hare", 1, 2)]
    core.push("hare", upd(1.0), version=1, now=2.0)
    assert core.pull("hare", 2.0) == [Wait("hare", 50.0, "hare_tortoise: waiting")]
    actions = core.push("tortoise", upd(1.0), version=0, now=3.0)
    assert [type(a) for a in actions] == [PushAck, Applied, Release, SendParams]
    for t in range(4):
        core.push("hare", upd(1.0), version=core.version, now=4.0 + t)
    core.pull("tortoise", 8.0)
    ack = core.push("tortoise", upd(1.0), version=3, now=9.0)
    assert ack[0].status == "dropped" and ack[1] == ForcePull("tortoise", "too stale")
    assert repr(HareTortoise()) == "HareTortoise()"


@pytest.mark.parametrize(
    "verdict", [Verdict(weight=-1.0), Verdict(weight=float("nan")), 0.5]
)
def test_bad_verdict_from_a_custom_policy_changes_nothing(verdict):
    class Broken(Policy):
        name = "broken"

        def judge(self, core, worker_id, staleness):
            return verdict

    core = make(Broken())
    core.join("a", 0.0)
    state = core.state_dict()
    with pytest.raises(ValueError, match="broken"):
        core.push("a", upd(1.0), version=0, now=1.0)
    assert core.state_dict() == state and core.version == 0
