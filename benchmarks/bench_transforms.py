"""Time per jitted train step of each transform, as a ratio to its optax baseline.

Run:
  python benchmarks/bench_transforms.py

Each step updates 1M float32 parameters (four 512x512 leaves); every figure is the
best of interleaved rounds, divided by its baseline (plain sgd, sgd with momentum
or adam) measured in the same run.
"""

import functools
import time

import jax
import jax.numpy as jnp
import optax

from hpsjax.transforms import (
    Stage,
    delay_compensation,
    hybrid_stages,
    local_steps,
    scale_by_staleness,
)


def _step_seconds(runs, *, rounds=15, steps=10):
    """Best time per step of each jitted train step, measured interleaved."""
    best = dict.fromkeys(runs, float("inf"))
    for _ in range(rounds):
        for name, run in runs.items():
            start = time.perf_counter()
            run(steps)
            best[name] = min(best[name], (time.perf_counter() - start) / steps)
    return best


def _train_step(tx, params, grads, extra):
    @functools.partial(jax.jit, donate_argnums=(0, 1))
    def step(params, state, grads, extra):
        updates, state = tx.update(grads, state, params, **extra)
        return optax.apply_updates(params, updates), state

    carry = [jax.tree.map(jnp.copy, params), tx.init(params)]

    def run(steps):
        params, state = carry
        for _ in range(steps):
            params, state = step(params, state, grads, extra)
        jax.block_until_ready((params, state))
        carry[:] = [params, state]

    run(1)
    return run


def main():
    keys = jax.random.split(jax.random.key(0), 4)
    params = {f"l{i}": jax.random.normal(k, (512, 512)) for i, k in enumerate(keys)}
    grads = jax.tree.map(lambda p: 0.01 * p, params)
    stale = {"stale_params": jax.tree.map(lambda p: p - 1e-3, params)}
    tau = {"staleness": jnp.asarray(3)}
    adam_stages = [
        Stage(optax.adam(1e-3), local_steps=8, until_step=10**6),
        Stage(optax.adam(1e-3)),
    ]
    # name -> (transform, extra args, baseline name)
    cases = {
        "sgd": (optax.sgd(0.1), {}, None),
        "sgd(momentum)": (optax.sgd(0.1, momentum=0.9), {}, None),
        "adam": (optax.adam(1e-3), {}, None),
        "scale_by_staleness+sgd": (
            optax.chain(
                scale_by_staleness("polynomial", max_staleness=5), optax.sgd(0.1)
            ),
            tau,
            "sgd",
        ),
        "delay_compensation+sgd": (
            optax.chain(delay_compensation(), optax.sgd(0.1)),
            stale,
            "sgd",
        ),
        "delay_compensation(adaptive)+sgd": (
            optax.chain(delay_compensation(adaptive=True), optax.sgd(0.1)),
            stale,
            "sgd(momentum)",
        ),
        "sgd+local_steps": (
            optax.chain(optax.sgd(0.1), local_steps(8)),
            {},
            "sgd(momentum)",
        ),
        "hybrid_stages(adam)": (
            hybrid_stages([Stage(optax.adam(1e-3), local_steps=8)]),
            {},
            "adam",
        ),
        # XLA:CPU copies the stage states in and out of the lax.switch.
        "hybrid_stages(adam, adam)": (hybrid_stages(adam_stages), {}, "adam"),
    }
    runs = {
        name: _train_step(tx, params, grads, extra)
        for name, (tx, extra, _) in cases.items()
    }
    best = _step_seconds(runs)
    print(f"\n{'step (1M float32 params)':34s} {'ms':>7s}  ratio")
    for name, (_, _, baseline) in cases.items():
        ratio = best[name] / best[baseline or name]
        print(f"{name:34s} {best[name] * 1e3:7.3f}  {ratio:.2f}x {baseline or name}")


if __name__ == "__main__":
    main()
