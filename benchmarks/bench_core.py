"""Per-event cost of the sans-I/O server core, as ratios to a bare optimizer step.

Run:
  python benchmarks/bench_core.py [--workers 256] [--events 5000]

Prints (1) the cost of one ASP push + pull through ``ServerCore`` as a ratio to a
bare jitted ``optax.sgd`` step on the same tree, measured in the same run, and
(2) microseconds per push + pull for every built-in policy with many workers, the
load the simulator puts on the core, and (3) the cost of ``check_result`` (a
push refused if its apply would be non-finite) for policies that apply once per
round of several pushes, as a ratio to the same core without it, alternated, and
(4) with ``--leaf-apply`` only: the per-leaf step of a separable optimizer
(:attr:`OverlapAggregator.leaf_steps`, what an apply overlapped with receipt runs as
each leaf arrives) against the whole-tree apply on a 64 MiB tree (16 leaves of
1024x1024 float32): all leaves one by one, and one leaf (the apply left once
the last leaf is in), medians of 5 alternated runs.
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

from hpsjax.apply._overlap import OverlapAggregator
from hpsjax.ps import ServerCore

_POLICIES = {
    "asp": {},
    "saps": {},
    "adsp": {},
    "ssp": {"staleness_bound": 3},
    "bsp": {},
    "semi_async": {"max_staleness": 4},
}


def _tree(leaves: int, side: int):
    params = {f"l{i}": jnp.zeros((side, side), jnp.float32) for i in range(leaves)}
    update = {k: np.full((side, side), 1e-3, np.float32) for k in params}
    return params, update


def bare_step_seconds(params, update, n: int) -> float:
    opt = optax.sgd(0.1)

    @jax.jit
    def step(p, s, u):
        d, s = opt.update(u, s, p)
        return optax.apply_updates(p, d), s

    state = opt.init(params)
    p = params
    for _ in range(5):
        p, state = step(p, state, update)
    jax.block_until_ready(p)
    t0 = time.perf_counter()
    for _ in range(n):
        p, state = step(p, state, update)
    jax.block_until_ready(p)
    return (time.perf_counter() - t0) / n


def core_seconds(
    params, update, policy, kwargs, workers: int, n: int, **core_kwargs
) -> float:
    """Seconds per push + pull, workers taking turns in a fixed order."""
    core = ServerCore(
        params, optax.sgd(0.1), policy, policy_kwargs=kwargs, **core_kwargs
    )
    for w in range(workers):
        core.join(w, 0.0)
    now = 1.0
    t0 = time.perf_counter()
    for i in range(n):
        w = i % workers
        now += 1e-3
        core.push(w, update, version=core.pulled_version(w), now=now)
        core.pull(w, now)
    jax.block_until_ready(core.params)
    return (time.perf_counter() - t0) / n


def _leaf_apply_row(name, optimizer, params, update, repeats: int, n: int) -> None:
    aggregator = OverlapAggregator(params, optimizer)
    steps = aggregator.leaf_steps
    whole = aggregator._steps.apply
    state = aggregator.opt_state
    tau = jnp.int32(0)
    leaves, ups = jax.tree.leaves(params), jax.tree.leaves(update)
    states = steps.split(state)

    # Every run applies the same update to the same parameters, so no call
    # waits on the one before it in either path.
    def run_whole():
        for _ in range(n):
            out = whole(params, state, update, tau, None)
        jax.block_until_ready(out)

    def run_leaves():
        for _ in range(n):
            out = [
                steps.step(leaves[i], states[i], ups[i], tau, None)
                for i in range(len(leaves))
            ]
        jax.block_until_ready(out)

    def run_one():
        for _ in range(n):
            out = steps.step(leaves[0], states[0], ups[0], tau, None)
        jax.block_until_ready(out)

    runs = {"whole": run_whole, "leaves": run_leaves, "one": run_one}
    times = {k: [] for k in runs}
    for f in runs.values():
        f()
    for _ in range(repeats):
        for k, f in runs.items():
            t0 = time.perf_counter()
            f()
            times[k].append((time.perf_counter() - t0) / n)
    w, a, o = (statistics.median(times[k]) for k in ("whole", "leaves", "one"))
    print(
        f"{name:>13}: whole {w * 1e3:6.1f} ms | 16 leaves one by one "
        f"{a * 1e3:6.1f} ms ({a / w:4.2f}x) | one leaf {o * 1e3:5.2f} ms "
        f"({o / w:4.3f}x)"
    )


def leaf_apply_table(repeats: int = 5, n: int = 10) -> None:
    """The per-leaf path against the whole-tree apply, alternated."""
    params = {f"l{i}": jnp.zeros((1024, 1024), jnp.float32) for i in range(16)}
    update = {k: jnp.full((1024, 1024), 1e-3, jnp.float32) for k in params}
    print("\nper-leaf vs whole-tree apply, 16 leaves of 1024x1024 float32 (64 MiB):")
    for name, optimizer in [
        ("sgd+momentum", optax.sgd(0.1, momentum=0.9)),
        ("adam", optax.adam(1e-3)),
    ]:
        _leaf_apply_row(name, optimizer, params, update, repeats, n)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=256)
    parser.add_argument("--events", type=int, default=5000)
    parser.add_argument("--leaf-apply", action="store_true")
    args = parser.parse_args()
    if args.leaf_apply:
        leaf_apply_table()
        return

    params, update = _tree(8, 64)
    bare = bare_step_seconds(params, update, 300)
    # Warm the core's compiled apply step before timing it.
    core_seconds(params, update, "asp", {}, 16, 20)
    asp16 = core_seconds(params, update, "asp", {}, 16, 300)
    print(f"tree: 8 leaves of 64x64 float32; jax {jax.__version__}")
    print(
        f"bare jitted sgd step {bare * 1e6:8.0f} us | ASP push+pull via core "
        f"{asp16 * 1e6:8.0f} us | ratio {asp16 / bare:5.2f}x"
    )
    print(f"\n{args.workers} workers, {args.events} push+pull events each:")
    print(f"{'policy':>12} {'us/event':>10} {'x bare step':>12}")
    for name, kwargs in _POLICIES.items():
        core_seconds(params, update, name, kwargs, args.workers, args.workers)
        s = core_seconds(params, update, name, kwargs, args.workers, args.events)
        print(f"{name:>12} {s * 1e6:10.0f} {s / bare:12.2f}")

    print("\ncheck_result on vs off, 8 workers, medians of 5 alternated runs:")
    for tree, name, kwargs, n in [
        ((8, 64), "bsp", {}, 400),
        ((8, 512), "bsp", {}, 48),
        ((8, 512), "asp", {"aggregate": 4}, 48),
    ]:
        params, update = _tree(*tree)
        times = {True: [], False: []}
        for check in (True, False):
            core_seconds(params, update, name, kwargs, 8, 16, check_result=check)
        for _ in range(5):
            for check in (True, False):
                times[check].append(
                    core_seconds(params, update, name, kwargs, 8, n, check_result=check)
                )
        on, off = (statistics.median(times[c]) for c in (True, False))
        print(
            f"{name} {kwargs or ''} {tree[0]}x{tree[1]}x{tree[1]}: "
            f"{on * 1e6:8.0f} vs {off * 1e6:8.0f} us per push+pull: "
            f"{on / off:5.2f}x"
        )


if __name__ == "__main__":
    main()
