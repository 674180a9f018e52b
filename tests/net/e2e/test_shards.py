"""Server shards: the key-range partition, the sharded client, sharded launches.

The partition is checked for its properties on random trees (every leaf or row
in exactly one shard, contiguous key ranges, the least possible biggest shard,
split/merge and JSON round trips); the sharded client against real asyncio
servers on loopback, where the merged parameters must equal what one server with
the same optimizer computes; and the command lines end to end, with server-shard
and worker processes.
"""

from __future__ import annotations

import asyncio
import contextlib
import doctest
import itertools
import json
import math
import os
import pathlib
import pickle
import signal
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _models import digits_mlp

from hpsjax._npz import PARAMS_MARKER, params_marker
from hpsjax.models import save_params_npz
from hpsjax.net import _partition, _shards
from hpsjax.ps import (
    AuthError,
    ConnectionClosed,
    KeyRangePartition,
    PushAck,
    Server,
    ServerError,
    ShardedClient,
    ShardedVersion,
    SpecMismatch,
)
from hpsjax.ps import _cli as server_cli
from hpsjax.transforms import Codec, encode_tree
from hpsjax.worker import Worker, WorkerConfig

SECRET = b"shard secret"
LIMIT = 60.0  # seconds any one async test may take


def _run(make_coro, timeout=LIMIT):
    async def guarded():
        async with asyncio.timeout(timeout):
            return await make_coro()

    return asyncio.run(guarded())


def _random_tree(rng, num_leaves, *, max_rows=40):
    """A nested dict (with a list and a tuple) of float32 leaves of random sizes."""
    leaves = [
        rng.normal(
            size=(int(rng.integers(1, max_rows)), int(rng.integers(1, 5)))
        ).astype(np.float32)
        for _ in range(num_leaves)
    ]
    tree = {"layers": [], "head": {}}
    for i, leaf in enumerate(leaves):
        if i % 3 == 0:
            tree["layers"].append(leaf)
        elif i % 3 == 1:
            tree["head"][f"w{i}"] = leaf
        else:
            tree[f"x{i:02d}"] = (leaf, None)
    return tree


def _assert_trees_equal(a, b):
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def _key_bytes(partition, tree):
    """Bytes of each key of the partition, in key order."""
    out = []
    for leaf in jax.tree.leaves(tree):
        shape = np.shape(leaf)
        nbytes = np.asarray(leaf).nbytes
        rows = shape[0] if partition.split_leaves and shape and shape[0] > 1 else 1
        out += [nbytes // rows] * rows
    return out


def _best_max_bytes(weights, num_shards):
    """The least possible biggest shard over all contiguous cuts (brute force)."""
    n = len(weights)
    prefix = np.concatenate([[0], np.cumsum(weights)])
    best = math.inf
    for cuts in itertools.combinations(range(1, n), num_shards - 1):
        bounds = (0, *cuts, n)
        best = min(
            best, max(prefix[b] - prefix[a] for a, b in itertools.pairwise(bounds))
        )
    return best


# ---------------------------------------------------------------- partition


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("split_leaves", [False, True])
def test_partition_properties(seed, split_leaves):
    rng = np.random.default_rng(seed)
    tree = _random_tree(rng, int(rng.integers(1, 9)), max_rows=6)
    num_leaves = len(jax.tree.leaves(tree))
    for num_shards in range(1, num_leaves + 1):
        p = KeyRangePartition.from_tree(tree, num_shards, split_leaves=split_leaves)
        assert p.num_shards == num_shards
        weights = _key_bytes(p, tree)
        # Contiguous, non-empty key ranges covering every key once.
        assert p.bounds[0] == 0 and p.bounds[-1] == len(weights)
        assert all(a < b for a, b in itertools.pairwise(p.bounds))
        # Bytes per shard are those of its key range, and the biggest shard is
        # as small as any contiguous cut can make it.
        sizes = p.shard_nbytes()
        assert sizes == tuple(
            sum(weights[a:b]) for a, b in itertools.pairwise(p.bounds)
        )
        assert max(sizes) == _best_max_bytes(weights, num_shards)
        assert max(sizes) <= -(-sum(weights) // num_shards) + max(weights)
        # Every leaf (or row) is in exactly one shard, in key order.
        parts = p.split(tree)
        rows = {path: 0 for path in p.paths}
        order = []
        for s, part in enumerate(parts):
            for path in p.shard_paths(s):
                name = path.split("[")[0]
                order.append(name)
            for leaf, path in zip(jax.tree.leaves(part), p.shard_paths(s), strict=True):
                rows[path.split("[")[0]] += np.shape(leaf)[0]
        assert [k for k, _ in itertools.groupby(order)] == list(p.paths)
        assert rows == {
            path: np.shape(leaf)[0]
            for path, leaf in zip(p.paths, jax.tree.leaves(tree), strict=True)
        }
        if not split_leaves:
            assert not p.cuts_leaves
            assert sum(len(p.shard_paths(s)) for s in range(num_shards)) == num_leaves
        _assert_trees_equal(p.merge(parts), tree)


def test_split_and_merge_round_trip_through_json():
    rng = np.random.default_rng(7)
    tree = _random_tree(rng, 7)
    for split_leaves in (False, True):
        p = KeyRangePartition.from_tree(tree, 3, split_leaves=split_leaves)
        text = p.to_json()
        json.loads(text)  # plain JSON
        q = KeyRangePartition.from_json(text)
        assert q == p and q.to_json() == text
        assert q.bounds == p.bounds and q.paths == p.paths
        parts = q.split(tree)
        for a, b in zip(parts, p.split(tree), strict=True):
            _assert_trees_equal(a, b)
        _assert_trees_equal(q.merge(parts), tree)
        # The spec gives the same partition as the arrays.
        spec = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), tree)
        assert KeyRangePartition.from_tree(spec, 3, split_leaves=split_leaves) == p
        _assert_trees_equal(
            jax.tree.map(np.shape, q.spec()), jax.tree.map(np.shape, tree)
        )
    assert KeyRangePartition.from_tree(tree, 2) != KeyRangePartition.from_tree(tree, 3)


def test_merge_keeps_jax_arrays_and_dtypes():
    tree = {"a": jnp.ones((6, 2), jnp.bfloat16), "b": jnp.zeros(3, jnp.float32)}
    p = KeyRangePartition.from_tree(tree, 2, split_leaves=True)
    merged = p.merge(p.split(tree))
    assert merged["a"].dtype == jnp.bfloat16
    _assert_trees_equal(merged, tree)
    assert KeyRangePartition.from_json(p.to_json()) == p


def test_a_huge_leaf_is_a_shard_of_its_own_or_cut_by_rows():
    tree = {
        "embed": np.zeros((1000, 16), np.float32),
        "a": np.zeros(10, np.float32),
        "z": np.zeros((4, 4), np.float32),
    }
    whole = KeyRangePartition.from_tree(tree, 3)
    assert whole.shard_paths(1) == ("embed",)
    assert whole.shard_nbytes()[1] == 64000
    cut = KeyRangePartition.from_tree(tree, 3, split_leaves=True)
    assert cut.cuts_leaves
    sizes = cut.shard_nbytes()
    assert max(sizes) - min(sizes) <= 64 + 40 + 64  # a row, plus the small leaves
    assert [path.split("[")[0] for path in cut.shard_paths(2)] == ["embed", "z"]
    _assert_trees_equal(cut.merge(cut.split(tree)), tree)
    with pytest.raises(ValueError, match="cuts leaf embed"):
        cut.split_leaf_list([0, 1, 2])
    assert whole.split_leaf_list(["a", "embed", "z"]) == [["a"], ["embed"], ["z"]]


def test_zero_size_and_scalar_leaves():
    tree = {
        "empty": np.zeros((0, 3), np.float32),
        "s": np.float32(2.0),
        "v": np.ones(5),
    }
    for split_leaves in (False, True):
        p = KeyRangePartition.from_tree(tree, 3, split_leaves=split_leaves)
        _assert_trees_equal(p.merge(p.split(tree)), tree)


@pytest.mark.parametrize(
    "num_shards,match",
    [(0, ">= 1"), (-2, ">= 1"), (True, "int"), (1.0, "int"), (4, "at most 3")],
)
def test_bad_shard_counts(num_shards, match):
    tree = {"a": np.zeros(2), "b": np.zeros(3), "c": np.zeros(4)}
    with pytest.raises(ValueError, match=match):
        KeyRangePartition.from_tree(tree, num_shards)


def test_bad_trees_are_refused():
    tree = {"a": np.zeros((4, 2)), "b": np.zeros(3)}
    p = KeyRangePartition.from_tree(tree, 2, split_leaves=True)
    with pytest.raises(ValueError, match="no leaves"):
        KeyRangePartition.from_tree({"a": {}}, 1)
    with pytest.raises(ValueError, match="keys must be str"):
        KeyRangePartition.from_tree({1: np.zeros(2)}, 1)
    with pytest.raises(ValueError, match="not an array"):
        KeyRangePartition.from_tree({"a": object()}, 1)
    with pytest.raises(ValueError, match="structure"):
        p.split({"a": np.zeros((4, 2))})
    with pytest.raises(ValueError, match="structure"):
        p.split({"a": np.zeros((4, 2)), "c": np.zeros(3)})
    with pytest.raises(ValueError, match="shape"):
        p.split({"a": np.zeros((5, 2)), "b": np.zeros(3)})
    parts = p.split(tree)
    with pytest.raises(ValueError, match="3 sub-trees"):
        p.merge([*parts, parts[0]])
    with pytest.raises(ValueError, match="structure"):
        p.merge(parts[::-1])
    with pytest.raises(ValueError, match="shape"):
        p.merge([parts[0], {**parts[1], "b": np.zeros(4)}])
    with pytest.raises(ValueError, match="3 per-leaf values"):
        p.split_leaf_list([1, 2, 3])
    with pytest.raises(ValueError, match="shard must be an int in"):
        p.shard_spec(2)


@pytest.mark.parametrize(
    "edit",
    [
        lambda d: d.update(format="other"),
        lambda d: d.update(version=99),
        lambda d: d.update(bounds=[0, 2]),
        lambda d: d.update(bounds=[0, 3, 3, 5]),
        lambda d: d.update(bounds=[0, 5, 3, 5]),
        lambda d: d.update(structure=["d", {"a": 1, "b": 0}]),
        lambda d: d.update(structure=["x", 0]),
        lambda d: d.pop("leaves"),
        lambda d: d["leaves"].pop(),
    ],
)
def test_malformed_json_is_refused(edit):
    tree = {"a": np.zeros((4, 2)), "b": np.zeros(1)}
    doc = json.loads(KeyRangePartition.from_tree(tree, 2, split_leaves=True).to_json())
    edit(doc)
    with pytest.raises(ValueError):
        KeyRangePartition.from_json(json.dumps(doc))
    with pytest.raises(ValueError, match="not JSON"):
        KeyRangePartition.from_json("{")


def test_sharded_versions_and_combined_acks():
    v = ShardedVersion([5, 4, 6])
    assert v == 4 and int(v) == 4 and v.shards == (5, 4, 6)
    assert json.dumps({"version": v}) == '{"version": 4}'
    assert pickle.loads(pickle.dumps(v)).shards == (5, 4, 6)
    assert max(3, int(v)) - ShardedVersion([2, 2]) == 2
    with pytest.raises(ValueError):
        ShardedVersion([])
    with pytest.raises(ValueError):
        ShardedVersion([1, -1])

    def ack(version, staleness, status, weight=1.0, steps=None, reason=None, fp=False):
        return PushAck(None, version, staleness, status, weight, steps, reason, fp)

    combined = _shards._combine(
        [ack(5, 1, "applied"), ack(4, 3, "applied", 0.5, 4, "stale", True)]
    )
    assert isinstance(combined, PushAck) and len(combined.shards) == 2
    assert combined.version.shards == (5, 4) and combined.staleness == 3
    assert combined.status == "applied" and combined.applied
    assert combined.weight == 0.5 and combined.local_steps == 4
    assert combined.reason == "shard 1: stale" and combined.force_pull
    assert _shards._combine([ack(1, 0, "applied"), ack(1, 0, "buffered")]).status == (
        "buffered"
    )
    dropped = _shards._combine([ack(1, 0, "buffered"), ack(1, 9, "dropped", 0.0)])
    assert dropped.status == "dropped" and not dropped.applied


@pytest.mark.parametrize("module", [_partition, _shards])
def test_module_doctests(module):
    assert doctest.testmod(module).failed == 0


# ------------------------------------------------------- against servers


def _servers(partition, tree, optimizer, policy="asp", **kwargs):
    return [
        Server(part, optimizer, policy, secret=SECRET, port=0, **kwargs)
        for part in partition.split(tree)
    ]


@contextlib.asynccontextmanager
async def _running(partition, tree, optimizer, policy="asp", **kwargs):
    """One started server per shard of ``tree``; all closed on the way out."""
    servers = _servers(partition, tree, optimizer, policy, **kwargs)
    try:
        for s in servers:
            await s.start()
        yield servers
    finally:
        for s in servers:
            await s.close()


def _sharded(servers, partition, worker_id="w0", **kwargs):
    kwargs.setdefault("timeout", 20.0)
    return ShardedClient(
        [("127.0.0.1", s.port) for s in servers],
        partition,
        worker_id=worker_id,
        secret=SECRET,
        **kwargs,
    )


@pytest.mark.parametrize(
    "num_shards,split_leaves,optimizer",
    [
        (2, False, "sgd"),
        (3, False, "sgd"),
        (3, True, "sgd"),
        (3, False, "adam"),
    ],
)
def test_sharded_servers_train_as_one_server(num_shards, split_leaves, optimizer):
    rng = np.random.default_rng(num_shards)
    params = _random_tree(rng, 7)
    updates = [jax.tree.map(lambda x: rng.normal(size=x.shape).astype(x.dtype), params)
               for _ in range(4)]  # fmt: skip
    partition = KeyRangePartition.from_tree(
        params, num_shards, split_leaves=split_leaves
    )

    def make_optimizer():
        return optax.sgd(0.1) if optimizer == "sgd" else optax.adam(0.01)

    async def main():
        async with (
            Server(params, make_optimizer(), "asp", secret=SECRET) as single,
            _running(partition, params, make_optimizer()) as servers,
        ):
            async with (
                _sharded(servers, partition) as sharded,
                _sharded([single], KeyRangePartition.from_tree(params, 1)) as one,
            ):
                assert len(sharded.info) == num_shards
                pulled, version = await sharded.pull()
                _assert_trees_equal(pulled, params)
                assert version.shards == (0,) * num_shards
                _, v1 = await one.pull()
                for i, update in enumerate(updates):
                    if i % 2:
                        ack, pulled, version = await sharded.push_pull(
                            update, version=version, num_samples=8
                        )
                    else:
                        ack = await sharded.push(update, version=version)
                        pulled, version = await sharded.pull()
                    ack1 = await one.push(update, version=v1)
                    got1, v1 = await one.pull()
                    assert ack.applied and ack1.applied
                    assert ack.version.shards == (i + 1,) * num_shards
                    assert version == v1 == i + 1
                    assert ack.staleness == ack1.staleness == 0
                    if optimizer == "sgd":
                        _assert_trees_equal(pulled, got1)
                    else:
                        for x, y in zip(
                            jax.tree.leaves(pulled),
                            jax.tree.leaves(got1),
                            strict=True,
                        ):
                            np.testing.assert_allclose(x, y, rtol=1e-6, atol=1e-7)
                assert sharded.bytes_sent > 0 and sharded.bytes_received > 0
                assert sharded.local_steps is None and sharded.plan is None
            for s, part in zip(servers, partition.split(pulled), strict=True):
                _assert_trees_equal(s.params, part)

    _run(main)


def test_encoded_and_stale_pushes():
    rng = np.random.default_rng(0)
    params = _random_tree(rng, 5)
    partition = KeyRangePartition.from_tree(params, 2)
    codec = Codec("uniform", 8)
    spec = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params)

    async def main():
        async with (
            Server(params, optax.sgd(1.0), "asp", secret=SECRET) as single,
            _running(partition, params, optax.sgd(1.0)) as servers,
            _sharded(servers, partition, "a") as a,
            _sharded(servers, partition, "b") as b,
            _sharded([single], KeyRangePartition.from_tree(params, 1)) as one,
        ):
            _, va = await a.pull()
            _, vb = await b.pull()
            _, v1 = await one.pull()
            update = jax.tree.map(lambda x: np.ones_like(x), params)
            encoded = encode_tree(update, codec, jax.random.key(1))
            ack = await a.push(spec, version=va, codec=codec, encoded=encoded)
            await one.push(spec, version=v1, codec=codec, encoded=encoded)
            assert ack.applied
            # b computed on version 0; the shards are at 1 now.
            ack = await b.push(update, version=vb)
            assert ack.staleness == 1 and ack.version.shards == (2, 2)
            ack = await b.push(update, version=[2, 0])
            assert ack.staleness == 2
            assert [r.staleness for r in ack.shards] == [0, 2]
            with pytest.raises(ValueError, match="versions for 2 shards"):
                await b.push(update, version=(1, 1, 1))
            with pytest.raises(ValueError, match="structure"):
                await b.push({"w": np.zeros(2)}, version=2)
            merged, _ = await a.pull()
            await one.push(update, version=0)
            await one.push(update, version=0)
            expected, _ = await one.pull()
            _assert_trees_equal(merged, expected)

    _run(main)


def test_a_failing_shard_fails_the_call_and_says_what_happened():
    params = {"a": np.zeros((3, 2), np.float32), "b": np.zeros(4, np.float32)}
    partition = KeyRangePartition.from_tree(params, 2)

    async def main():
        async with _running(partition, params, optax.sgd(0.1)) as servers:
            client = _sharded(servers, partition)
            async with client:
                _, version = await client.pull()
                await servers[1].close()
                update = jax.tree.map(np.ones_like, params)
                start = time.monotonic()
                with pytest.raises((ConnectionClosed, ServerError)) as info:
                    for _ in range(50):  # until the close reached the client
                        await client.push(update, version=version)
                        await asyncio.sleep(0.02)
                assert time.monotonic() - start < 10
                error = info.value
                assert "shard 1 of 2" in str(error)
                assert error.shard_index == 1
                if 0 in error.shard_results:
                    assert "shards [0] completed it" in str(error)
                with pytest.raises((ConnectionClosed, ServerError), match="shard 1"):
                    await client.pull()
                assert client.closed

    _run(main)


def test_a_dead_shard_does_not_hang_a_barrier_wait():
    params = {"a": np.zeros((3, 2), np.float32), "b": np.zeros(4, np.float32)}
    partition = KeyRangePartition.from_tree(params, 2)

    async def main():
        async with (
            _running(partition, params, optax.sgd(0.1), "bsp") as servers,
            _sharded(servers, partition, "w0", timeout=None) as w0,
            _sharded(servers, partition, "w1", timeout=None) as w1,
        ):
            _, v0 = await w0.pull()
            await w1.pull()
            update = jax.tree.map(np.ones_like, params)
            # w0's pull waits for w1's push on both shards (BSP)...
            waiting = asyncio.ensure_future(w0.push_pull(update, version=v0))
            await asyncio.sleep(0.2)
            assert not waiting.done()
            # ... until shard 0 goes away: the call fails at once.
            await servers[0].close()
            async with asyncio.timeout(10):
                with pytest.raises(
                    (ConnectionClosed, ServerError), match="shard 0 of 2"
                ):
                    await waiting

    _run(main)


def test_connect_checks_each_shard_serves_its_key_range():
    params = {"a": np.zeros((3, 2), np.float32), "b": np.zeros(4, np.float32)}
    partition = KeyRangePartition.from_tree(params, 2)

    async def main():
        async with _running(partition, params, optax.sgd(0.1)) as servers:
            swapped = _sharded(servers[::-1], partition)
            with pytest.raises(SpecMismatch, match="shard 0 of 2"):
                await swapped.connect()
            assert all(c.closed for c in swapped.clients)
            wrong = ShardedClient(
                [("127.0.0.1", s.port) for s in servers],
                partition,
                worker_id="w",
                secret=b"wrong",
                timeout=5.0,
            )
            with pytest.raises(AuthError, match=r"shard [01] of 2"):
                await wrong.connect()
            assert all(c.closed for c in wrong.clients)

    _run(main)
    with pytest.raises(ValueError, match="3 server addresses"):
        ShardedClient([("h", 1)] * 3, partition, worker_id="w", secret=None)


def test_worker_runtime_trains_against_shards():
    train, params, loss_fn = digits_mlp(600, hidden=16, out_scale=4.0)

    partition = KeyRangePartition.from_tree(params, 2)
    records = []

    async def main():
        # No deadline drops a worker that a loaded machine holds back: a drop
        # and rejoin would make a version more than the rounds counted here.
        # The start waits for both workers: a worker that joins first and
        # finds itself alone at the barrier would run round 0 by itself.
        async with _running(
            partition, params, optax.sgd(0.2), "bsp",
            core_kwargs=dict(min_timeout=120.0, expected_workers=2),
        ) as servers:  # fmt: skip
            workers = []
            for i, extra in enumerate(
                [dict(staleness_lr="inverse_plus_one"), dict(bits=8)]
            ):
                config = WorkerConfig(
                    worker_id=f"w{i}", batch_size=32, max_steps=12, **extra
                )
                workers.append(
                    Worker(
                        config,
                        loss_fn=loss_fn,
                        batches=train.shard(2, i).batches(32, seed=i).next,
                        metrics=records.append,
                        client=_sharded(servers, partition, f"w{i}"),
                    )
                )
            summaries = await asyncio.gather(*(w.run() for w in workers))
            versions = [s.version for s in servers]
        return summaries, versions

    summaries, versions = _run(main)
    # Both shards ran the same BSP rounds: 12 pushes per worker, 12 versions.
    assert versions == [12, 12]
    for summary in summaries:
        assert summary.pushes == 12 and summary.ended_by == "max_steps"
        assert summary.bytes_sent > 0
    rounds = [r for r in records if r["event"] == "round"]
    assert all(isinstance(r["version"], int) for r in rounds)
    json.dumps(records)
    first = np.mean([r["loss"] for r in rounds if r["step"] < 3])
    last = np.mean([r["loss"] for r in rounds if r["step"] >= 9])
    assert last < first


# ---------------------------------------------------------------- command lines


def test_server_cli_loads_only_its_shard(tmp_path):
    rng = np.random.default_rng(0)
    arrays = {
        "embed": rng.normal(size=(50, 8)).astype(np.float32),
        "dense/kernel": rng.normal(size=(8, 4)).astype(np.float32),
        "dense/bias": np.zeros(4, np.float32),
    }
    path = tmp_path / "init.npz"
    np.savez(path, **arrays, **{PARAMS_MARKER: params_marker()})
    whole = server_cli.load_npz_tree(path)
    for split_leaves in (False, True):
        parts = []
        for shard in range(3):
            part, partition = server_cli.load_npz_shard(
                path, shard, 3, split_leaves=split_leaves
            )
            parts.append(part)
        assert partition == KeyRangePartition.from_tree(
            whole, 3, split_leaves=split_leaves
        )
        _assert_trees_equal(partition.merge(parts), whole)
        assert partition.cuts_leaves == split_leaves
    compressed = tmp_path / "compressed.npz"
    np.savez_compressed(compressed, **arrays, **{PARAMS_MARKER: params_marker()})
    loaded = [
        server_cli.load_npz_shard(compressed, s, 2, split_leaves=True) for s in range(2)
    ]
    _assert_trees_equal(loaded[0][1].merge([part for part, _ in loaded]), whole)
    with pytest.raises(ValueError, match=r"shard must be (an int )?in"):
        server_cli.load_npz_shard(path, 3, 3)
    with pytest.raises(ValueError, match="at most 3"):
        server_cli.load_npz_shard(path, 0, 4)
    np.savez(
        tmp_path / "obj.npz",
        x=np.array([{"a": 1}], dtype=object),
        **{PARAMS_MARKER: params_marker()},
    )
    with pytest.raises(ValueError, match="pickle"):
        server_cli.load_npz_shard(tmp_path / "obj.npz", 0, 1)


@pytest.mark.parametrize(
    "flags,match",
    [
        (["--server_shards", "2"], "needs --server_shard"),
        (["--server_shard", "2", "--server_shards", "2"], r"in \[0, 2\)"),
        (["--server_shards", "0", "--server_shard", "0"], ">= 1"),
        (["--server_shard", "0", "--server_shards", "3"], "at most 2"),
    ],
)
def test_server_cli_refuses_bad_shard_flags(tmp_path, capsys, flags, match):
    path = tmp_path / "p.npz"
    save_params_npz(path, {"a": np.zeros(2, np.float32), "b": np.zeros(3, np.float32)})
    argv = ["--init", str(path), "--no-malloc_tuning", "--loop", "asyncio", *flags]
    assert server_cli.main(argv) == 2
    assert "hpsjax-server:" in capsys.readouterr().err
    with pytest.raises(ValueError, match=match):
        asyncio.run(server_cli.serve(server_cli.parse_args(argv)))


@pytest.mark.parametrize(
    "flags",
    [
        ["--servers", "127.0.0.1:1,127.0.0.1:2", "--port", "1"],
        ["--servers", "127.0.0.1"],
        ["--servers", "127.0.0.1:1", "--split_leaves"],
        ["--servers", "127.0.0.1:1,127.0.0.1:2", "--split_leaves", "--bits", "8"],
    ],
)
def test_worker_cli_refuses_bad_server_flags(flags, capsys):
    from hpsjax.cli import worker as worker_cli

    small = ["--dataset_arg", "num_examples=200", "--model_arg", "hidden=[16]"]
    try:
        code = worker_cli.main([*small, "--log_level", "WARNING", *flags])
    except SystemExit as e:
        code = e.code
    assert code == 2
    assert "hpsjax-worker" in capsys.readouterr().err


def test_worker_cli_builds_a_sharded_client():
    from hpsjax.cli import worker as worker_cli
    from hpsjax.worker import build_worker

    args = worker_cli.parse_args(
        ["--dataset_arg", "num_examples=200", "--model_arg", "hidden=[16]",
         "--servers", "127.0.0.1:5555,[::1]:5556,hostC:5557"]
    )  # fmt: skip
    worker = build_worker(args)
    client = worker._client
    assert isinstance(client, ShardedClient)
    assert client.partition.num_shards == 3
    assert worker.config.host == "127.0.0.1" and worker.config.port == 5555
    assert [(c._host, c._port) for c in client.clients] == [
        ("127.0.0.1", 5555),
        ("::1", 5556),
        ("hostC", 5557),
    ]
    single = build_worker(
        worker_cli.parse_args(
            ["--dataset_arg", "num_examples=200", "--servers", "127.0.0.1:5555"]
        )
    )
    assert not isinstance(single._client, ShardedClient)
    assert single.config.port == 5555


# ---------------------------------------------------------------- end to end


def _start(argv, log):
    return subprocess.Popen(
        [sys.executable, *argv],
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
        env={**os.environ, "JAX_PLATFORMS": "cpu"},
    )


def _wait_for(path: pathlib.Path, text: str, proc, timeout: float) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        content = path.read_text()
        if text in content:
            return content
        if proc.poll() is not None:
            break
        time.sleep(0.1)
    raise AssertionError(f"{text!r} not in {path}:\n{path.read_text()}")


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.mark.slow
def test_sharded_servers_and_workers_as_processes(tmp_path, session_compile_cache):
    model = ["--dataset_arg", "num_examples=600", "--model_arg", "hidden=[32]",
             "--log_level", "WARNING", "--loop", "asyncio"]  # fmt: skip
    (tmp_path / "secret").write_text("sharded secret\n")
    secret = ["--secret_file", str(tmp_path / "secret")]
    init = tmp_path / "init.npz"
    subprocess.run(
        [sys.executable, "-m", "hpsjax.cli.worker", *model, "--write_init", str(init)],
        check=True,
        timeout=120,
        env={**os.environ, "JAX_PLATFORMS": "cpu"},
    )
    procs = []
    try:
        ports = []
        for shard in range(2):
            log = tmp_path / f"server{shard}.log"
            with open(log, "w") as f:
                proc = _start(
                    ["-m", "hpsjax.ps._cli", "--init", str(init), *secret,
                     "--server_shard", str(shard), "--server_shards", "2",
                     "--split_leaves", "--policy", "bsp", "--learning_rate", "0.2",
                     "--checkpoint_dir", str(tmp_path / "ckpt"),
                     "--loop", "asyncio", "--log_level", "WARNING"],
                    f,
                )  # fmt: skip
            procs.append(proc)
            text = _wait_for(log, "listening on", proc, 120)
            assert f"shard {shard} of 2" in text
            ports.append(int(text.split("listening on ")[1].split()[0].rsplit(":")[1]))
        servers = ",".join(f"127.0.0.1:{p}" for p in ports)
        workers = []
        for i in range(2):
            with open(tmp_path / f"worker{i}.log", "w") as f:
                workers.append(
                    _start(
                        ["-m", "hpsjax.cli.worker", *model, *secret,
                         "--servers", servers, "--split_leaves",
                         "--worker_id", str(i), "--shard_index", str(i),
                         "--shard_count", "2", "--batch_size", "32",
                         "--max_steps", "15", "--timeout", "60",
                         "--metrics", str(tmp_path / f"w{i}.jsonl")],
                        f,
                    )
                )  # fmt: skip
        procs += workers
        for i, proc in enumerate(workers):
            code = proc.wait(timeout=240)
            assert code == 0, (tmp_path / f"worker{i}.log").read_text()
        for proc in procs[:2]:
            proc.send_signal(signal.SIGTERM)
        for i, proc in enumerate(procs[:2]):
            assert proc.wait(timeout=60) == 0, (tmp_path / f"server{i}.log").read_text()
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=30)
    assert not any(_group_alive(proc.pid) for proc in procs)
    for i in range(2):
        lines = (tmp_path / f"w{i}.jsonl").read_text().splitlines()
        rounds = [r for r in map(json.loads, lines) if r["event"] == "round"]
        assert [r["step"] for r in rounds] == list(range(15))
        # BSP over both shards: the versions advance round by round.
        assert rounds[-1]["pulled_version"] >= 14
        first = np.mean([r["loss"] for r in rounds[:3]])
        last = np.mean([r["loss"] for r in rounds[-3:]])
        assert last < first
        done = (tmp_path / f"worker{i}.log").read_text()
        assert "hpsjax-worker done" in done
    for shard in range(2):
        assert any((tmp_path / "ckpt" / f"shard_{shard}_of_2").iterdir())
