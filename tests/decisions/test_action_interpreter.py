"""One action loop for the asyncio server and the simulator: every action the
core returns goes to its driver's handler, and one without a handler fails
loudly."""

from __future__ import annotations

import doctest

import numpy as np
import optax
import pytest

from hpsjax.decisions import (
    ActionInterpreter,
    Applied,
    Joined,
    PushAck,
    PushBegun,
    SaveCheckpoint,
    SendParams,
    ServerCore,
    StartApply,
    Wait,
    WorkerJoined,
    WorkerPulled,
    WorkerPushed,
    _interpreter,
)
from hpsjax.decisions._actions import ACTIONS
from hpsjax.net import Server
from hpsjax.sim._server_side import _ServerSide
from hpsjax.wire import PushMeta, WorkerDropped


def test_the_module_doctest():
    assert doctest.testmod(_interpreter).failed == 0


def test_each_action_goes_to_its_handler_in_order():
    seen = []
    carry_out = ActionInterpreter(
        {kind: (lambda a, k=kind: seen.append(k.__name__)) for kind in ACTIONS}
    )
    core = ServerCore({"w": np.zeros(2, np.float32)}, optax.sgd(1.0), "asp")
    carry_out(core.handle(WorkerJoined("a", 0.0)))
    carry_out(
        core.handle(
            WorkerPushed("a", {"w": np.ones(2, np.float32)}, PushMeta(version=0), 1.0)
        )
    )
    assert seen == ["SendParams", "PushAck", "Applied"]


def test_an_action_without_a_handler_fails_loudly_after_those_before_it():
    sent = []
    carry_out = ActionInterpreter({SendParams: sent.append})
    with pytest.raises(TypeError, match="no handler for the action Wait"):
        carry_out([SendParams("a", 0), Wait("b", None, "round"), SendParams("c", 0)])
    assert sent == [SendParams("a", 0)]
    assert carry_out.handled == frozenset({SendParams})


def test_a_handler_for_something_that_is_no_action_is_refused():
    with pytest.raises(ValueError, match="not action types: <class 'int'>"):
        ActionInterpreter({Applied: print, int: print})


def test_ignore_takes_an_action_and_does_nothing():
    carry_out = ActionInterpreter({PushAck: ActionInterpreter.ignore})
    carry_out([PushAck("a", 1, 0, "applied", 1.0)])


def test_a_push_begun_is_answered_with_the_apply_to_start_where_it_completes():
    core = ServerCore({"w": np.zeros(2, np.float32)}, optax.sgd(1.0), "bsp")
    core.handle(WorkerJoined("a", 0.0))
    core.handle(WorkerJoined("b", 0.0))
    # The first push of the round completes nothing; the last one does.
    assert core.handle(PushBegun("a", 0, 4, 0.5)) == []
    core.push("a", {"w": np.ones(2, np.float32)}, version=0, now=1.0)
    assert core.handle(PushBegun("b", 0, 4, 1.5)) == [StartApply("b", 1.0, 4, 0)]
    # Nothing is checked or changed: a bad version or a stranger gets nothing.
    assert core.handle(PushBegun("b", 3, 4, 1.5)) == []
    assert core.handle(PushBegun("z", 0, None, 1.5)) == []
    assert core.handle(PushBegun("b", 0, None, 1.5))[0].plan == (1.0, 1, 0)
    assert core.buffered == 1 and core.version == 0


def test_the_asyncio_server_has_a_handler_for_every_action():
    server = Server({"w": np.zeros(2, np.float32)}, optax.sgd(1.0), "asp", secret=None)
    assert server._interpret.handled == frozenset(ACTIONS)


def test_the_simulator_handles_every_action_but_saves_early_applies_and_rejoins():
    side = _ServerSide.__new__(_ServerSide)
    handled = side._interpreter().handled
    assert handled == frozenset(ACTIONS) - {SaveCheckpoint, StartApply, Joined}


def test_a_pull_that_may_rejoin_joins_a_worker_that_is_not_live():
    core = ServerCore({"w": np.zeros(2, np.float32)}, optax.sgd(1.0), "asp")
    assert core.handle(WorkerPulled("a", 0.0, rejoin=True)) == [
        Joined("a", 0),
        SendParams("a", 0, None),
    ]
    # A live worker's pull is a pull, with or without rejoin.
    assert core.handle(WorkerPulled("a", 1.0, rejoin=True)) == [SendParams("a", 0)]
    core.leave("a", 2.0)
    with pytest.raises(WorkerDropped):
        core.handle(WorkerPulled("a", 3.0))
    assert core.handle(WorkerPulled("a", 3.0, rejoin=True))[0] == Joined("a", 0)
    assert core.worker("a").joins == 2
    with pytest.raises(ValueError, match="worker_id"):
        core.handle(WorkerPulled(["not", "hashable"], 4.0, rejoin=True))
