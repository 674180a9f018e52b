"""Applies overlapped with receipt: a push applied leaf by leaf as it arrives.

The core decides when a push's apply may be started before the push is whole
(a ``StartApply`` action answering a ``PushBegun`` event), the server's
aggregator starts it
(``OverlapAggregator.start``) and takes its result only where it is still that
push's apply; the server feeds it each leaf as the leaf's bytes arrive.
Either way the parameters are those of the whole-tree apply.
"""

from __future__ import annotations

import asyncio
import logging

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from hpsjax import ps
from hpsjax.apply._overlap import OverlapAggregator
from hpsjax.decisions import PushBegun, StartApply
from hpsjax.decisions._core import ServerCore
from hpsjax.wire._errors import NonFiniteUpdate
from hpsjax.wire._messages import PushMeta


def _params(seed: int = 0):
    rng = np.random.default_rng(seed)
    return {
        "conv": {"kernel": jnp.asarray(rng.standard_normal((3, 3, 4, 8)), "float32")},
        "dense": {
            "bias": jnp.asarray(rng.standard_normal(10), "float32"),
            "kernel": jnp.asarray(rng.standard_normal((8, 10)), "float32"),
        },
    }


def _update(seed: int, scale: float = 0.1):
    return jax.tree.map(
        lambda p: jnp.asarray(
            np.random.default_rng(seed).standard_normal(p.shape) * scale, p.dtype
        ),
        _params(),
    )


def _core(params, optimizer, policy, **kwargs):
    return ServerCore(params, optimizer, policy, aggregator=OverlapAggregator, **kwargs)


def _start(core, worker_id, version, num_samples=None):
    actions = core.handle(PushBegun(worker_id, version, num_samples, 0.0))
    assert all(isinstance(a, StartApply) for a in actions)
    return core.aggregator.start(actions[0].plan if actions else None)


def _push(core, worker_id, update, meta, *, now, prepared=None):
    core.aggregator.prepare(prepared)
    try:
        return core.push_message(worker_id, update, meta, now=now)
    finally:
        core.aggregator.prepare(None)


def _fed(apply, update):
    for i, leaf in enumerate(jax.tree.leaves(update)):
        apply.add(i, leaf)
    return apply


def _assert_trees_close(a, b):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-6, atol=1e-7)


OPTIMIZERS = {
    "sgd": lambda: optax.sgd(0.1),
    "momentum": lambda: optax.sgd(0.1, momentum=0.9, nesterov=True),
    "adam": lambda: optax.adam(1e-2),
}


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_overlapped_applies_give_the_whole_tree_result(name):
    optimizer = OPTIMIZERS[name]()
    whole = _core(_params(), optimizer, "asp")
    overlapped = _core(_params(), optimizer, "asp")
    for core in (whole, overlapped):
        core.join("a", now=0.0)
    for step in range(3):
        meta = PushMeta(version=step)
        update = _update(step)
        whole.push_message("a", update, meta, now=1.0 + step)
        apply = _fed(_start(overlapped, "a", step), update)
        _push(overlapped, "a", update, meta, now=1.0 + step, prepared=apply)
    assert overlapped.aggregator.overlapped_applies == 3
    assert whole.aggregator.overlapped_applies == 0
    assert overlapped.version == whole.version == 3
    _assert_trees_close(overlapped.params, whole.params)
    _assert_trees_close(overlapped.opt_state, whole.opt_state)


def test_an_apply_started_before_another_push_is_ignored():
    core = _core(_params(), optax.sgd(0.1, momentum=0.9), "asp")
    reference = _core(_params(), optax.sgd(0.1, momentum=0.9), "asp")
    for c in (core, reference):
        c.join("a", now=0.0)
        c.join("b", now=0.0)
    apply = _fed(_start(core, "a", 0), _update(1))
    # b's push is applied while a's is still arriving: a's prepared result,
    # made from version 0's parameters, no longer is a's apply.
    for c, prepared in ((core, apply), (reference, None)):
        c.push_message("b", _update(2), PushMeta(version=0), now=1.0)
        _push(c, "a", _update(1), PushMeta(version=0), now=2.0, prepared=prepared)
    assert core.aggregator.overlapped_applies == 0
    assert core.version == 2
    _assert_trees_close(core.params, reference.params)


class _HalvingASP(ps.ASP):
    """ASP that weights every push by 0.5, decided only when it is judged."""

    def judge(self, core, worker_id, staleness):
        return ps.Verdict(weight=0.5)


@pytest.mark.parametrize(
    ("policy", "core_kwargs", "overlapped"),
    [
        # The policy weights the push when it judges it: not known beforehand,
        # so the early apply is not this push's and is ignored.
        (_HalvingASP, {}, 0),
        # push_weights are known beforehand: the early apply is this push's.
        (ps.ASP, {"push_weights": {"a": 0.5}}, 1),
    ],
)
def test_a_weighted_push_is_applied_early_only_where_its_weight_is_known(
    policy, core_kwargs, overlapped
):
    core = _core(_params(), optax.sgd(0.1), policy(), **core_kwargs)
    reference = _core(_params(), optax.sgd(0.1), policy(), **core_kwargs)
    for c in (core, reference):
        c.join("a", now=0.0)
    apply = _fed(_start(core, "a", 0), _update(3))
    _push(core, "a", _update(3), PushMeta(version=0), now=1.0, prepared=apply)
    reference.push_message("a", _update(3), PushMeta(version=0), now=1.0)
    assert core.aggregator.overlapped_applies == overlapped
    _assert_trees_close(core.params, reference.params)


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_a_bsp_rounds_last_push_is_averaged_and_applied_as_it_arrives(name):
    whole = _core(_params(), OPTIMIZERS[name](), "bsp")
    overlapped = _core(_params(), OPTIMIZERS[name](), "bsp")
    for core in (whole, overlapped):
        for w in ("a", "b", "c"):
            core.join(w, now=0.0)
    for step in range(2):
        pushes = [("a", 8), ("b", 24), ("c", 16)]
        for i, (w, samples) in enumerate(pushes):
            meta = PushMeta(version=step, num_samples=samples)
            update = _update(10 * step + i)
            whole.push_message(w, update, meta, now=1.0 + step)
            last = i == len(pushes) - 1
            apply = _start(overlapped, w, step, samples)
            # Only the push that completes the round is applied early.
            assert (apply is not None) == last
            if apply is not None:
                _fed(apply, update)
            _push(overlapped, w, update, meta, now=1.0 + step, prepared=apply)
    assert overlapped.aggregator.overlapped_applies == 2
    assert overlapped.version == whole.version == 2
    _assert_trees_close(overlapped.params, whole.params)
    _assert_trees_close(overlapped.opt_state, whole.opt_state)


def test_a_last_push_with_other_samples_than_announced_is_applied_whole():
    core = _core(_params(), optax.sgd(0.1), "bsp")
    reference = _core(_params(), optax.sgd(0.1), "bsp")
    for c in (core, reference):
        c.join("a", now=0.0)
        c.join("b", now=0.0)
        c.push_message("b", _update(0), PushMeta(version=0, num_samples=8), now=1.0)
    # Started for 8 samples; the push says 32: its weight in the mean differs.
    apply = _fed(_start(core, "a", 0, 8), _update(1))
    meta = PushMeta(version=0, num_samples=32)
    _push(core, "a", _update(1), meta, now=2.0, prepared=apply)
    reference.push_message("a", _update(1), meta, now=2.0)
    assert core.aggregator.overlapped_applies == 0
    _assert_trees_close(core.params, reference.params)


def test_a_non_finite_overlapped_apply_is_refused_and_changes_nothing():
    # sgd(1.0) takes -3e38 - 3e38 to -inf in float32.
    core = _core(jax.tree.map(lambda p: p * 0 - 3e38, _params()), optax.sgd(1.0), "asp")
    core.join("a", now=0.0)
    before = jax.tree.map(np.asarray, core.params)
    huge = jax.tree.map(lambda u: u * 0 + 3e38, _update(0))
    apply = _fed(_start(core, "a", 0), huge)
    with pytest.raises(NonFiniteUpdate, match="non-finite"):
        _push(core, "a", huge, PushMeta(version=0), now=1.0, prepared=apply)
    assert core.version == 0 and core.aggregator.overlapped_applies == 0
    for x, y in zip(jax.tree.leaves(core.params), jax.tree.leaves(before), strict=True):
        np.testing.assert_array_equal(np.asarray(x), y)


def test_no_overlapped_apply_where_the_push_is_not_applied_alone_at_once():
    clipped = optax.chain(optax.clip_by_global_norm(1.0), optax.sgd(0.1))
    core = _core(_params(), clipped, "asp")
    core.join("a", now=0.0)
    assert core.aggregator.leaf_steps is None  # reads every leaf: not separable
    assert _start(core, "a", 0) is None
    bsp = _core(_params(), optax.sgd(0.1), "bsp")
    bsp.join("a", now=0.0)
    bsp.join("b", now=0.0)
    # The first push of a BSP round is buffered, not applied: nothing early.
    assert _start(bsp, "a", 0) is None
    # Unchecked applies are not worked out with the push: nothing early.
    unchecked = _core(_params(), optax.sgd(0.1), "asp", check_result=False)
    unchecked.join("a", now=0.0)
    assert _start(unchecked, "a", 0) is None
    for bad in (-1, 1, "0", None):
        assert _start(core, "a", bad) is None
    plain = _core(_params(), optax.sgd(0.1), "asp")
    assert _start(plain, "nobody", 0) is None


def _client(server: ps.Server, worker_id: int) -> ps.Client:
    return ps.Client("127.0.0.1", server.port, worker_id=worker_id, secret=None)


async def _serve_and_push(overlap_apply_bytes, optimizer, updates):
    params = _params()
    async with ps.Server(
        params,
        optimizer,
        "asp",
        secret=None,
        overlap_apply_bytes=overlap_apply_bytes,
    ) as server:
        async with _client(server, 0) as client:
            _, version = await client.pull()
            for update in updates:
                ack = await client.push(update, version=version)
                version = ack.version
            pulled, _ = await client.pull()
        return pulled, server.core.aggregator.overlapped_applies


@pytest.mark.parametrize("name", ["adam", "momentum"])
def test_the_server_applies_pushes_as_they_arrive(name, caplog):
    updates = [_update(s) for s in range(4)]
    with caplog.at_level(logging.INFO, logger="hpsjax.net"):
        overlapped, count = asyncio.run(_serve_and_push(0, OPTIMIZERS[name](), updates))
    assert count == len(updates)
    assert "applies: leaf by leaf" in caplog.text
    whole, none = asyncio.run(_serve_and_push(None, OPTIMIZERS[name](), updates))
    assert none == 0
    _assert_trees_close(overlapped, whole)


def test_the_server_says_a_clipped_optimizer_is_applied_whole(caplog):
    clipped = optax.chain(optax.clip_by_global_norm(1.0), optax.sgd(0.1))
    with caplog.at_level(logging.INFO, logger="hpsjax.net"):
        _, count = asyncio.run(_serve_and_push(0, clipped, [_update(0)]))
    assert count == 0
    assert "applies: whole-tree" in caplog.text
    assert "not leaf-separable" in caplog.text


@pytest.mark.parametrize("bad", [-1, 1.5, True, "1"])
def test_a_bad_overlap_threshold_is_one_line(bad):
    with pytest.raises(ValueError, match="overlap_apply_bytes must be an int"):
        ps.Server(_params(), optax.sgd(0.1), secret=None, overlap_apply_bytes=bad)


def test_concurrent_pushes_give_the_sum_of_their_updates():
    # Under ASP with plain SGD the parameters are the start less lr times the
    # sum of the pushes in any order: pushes received side by side, whose
    # early applies may no longer match, change nothing of that.
    updates = [_update(s, scale=0.01) for s in range(6)]

    async def main():
        async with ps.Server(
            _params(), optax.sgd(0.5), "asp", secret=None, overlap_apply_bytes=0
        ) as server:

            async def worker(i):
                async with _client(server, i) as c:
                    _, version = await c.pull()
                    for u in updates[i::3]:
                        version = (await c.push(u, version=version)).version

            await asyncio.gather(*(worker(i) for i in range(3)))
            return (
                server.params,
                server.version,
                server.core.aggregator.overlapped_applies,
            )

    params, version, overlapped = asyncio.run(main())
    assert version == len(updates)
    assert 0 < overlapped <= len(updates)
    total = jax.tree.map(lambda *u: sum(u), *updates)
    expected = jax.tree.map(lambda p, t: p - 0.5 * t, _params(), total)
    for x, y in zip(jax.tree.leaves(params), jax.tree.leaves(expected), strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), atol=1e-5)


def test_a_bsp_server_applies_each_rounds_last_push_as_it_arrives():
    async def serve(overlap_apply_bytes):
        async with ps.Server(
            _params(),
            optax.sgd(0.1, momentum=0.9),
            "bsp",
            secret=None,
            overlap_apply_bytes=overlap_apply_bytes,
            core_kwargs={"expected_workers": 2},
        ) as server:

            async def worker(i):
                async with _client(server, i) as c:
                    _, version = await c.pull()
                    for step in range(3):
                        update = _update(10 * step + i)
                        await c.push(update, version=version, num_samples=8 + 16 * i)
                        _, version = await c.pull()

            await asyncio.gather(worker(0), worker(1))
            return (
                server.params,
                server.version,
                server.core.aggregator.overlapped_applies,
            )

    overlapped, version, count = asyncio.run(serve(0))
    whole, _, none = asyncio.run(serve(None))
    assert version == 3 and count == 3 and none == 0
    _assert_trees_close(overlapped, whole)
