"""Cost of the profiling pass, and the idle time its plans predict.

Prints:

1. the wall seconds of ``hpsjax.profiling.profile`` with its default settings for a
   small MLP and a small CNN train step, as a share of a 5-minute training run
   (target: under 2%) and as a ratio to the baseline every run pays anyway,
   compiling and running its train step once;
2. the predicted idle fraction of a barrier (BSP) round for four workers whose
   speeds are 1:1:2:4 (the profiled MLP slowed 4x, 4x, 2x, 1x), under the H-PS
   plan against equal batches, and the other schemes for reference; once for
   compute alone and once with every worker's transfer over a 1 Gb/s link.

Run::

    .venv/bin/python benchmarks/bench_profiling.py
"""

import dataclasses
import itertools
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

from hpsjax.profiling import Link, plan, profile

RUN_SECONDS = 300.0
GLOBAL_BATCH = 256
SPEEDS = (1, 1, 2, 4)


def _dense(rng, m, n):
    return {
        "w": jnp.asarray(rng.normal(size=(m, n)) * m**-0.5, jnp.float32),
        "b": jnp.zeros(n),
    }


def mlp():
    rng = np.random.default_rng(0)
    params = [_dense(rng, m, n) for m, n in itertools.pairwise((784, 256, 256, 10))]

    def apply(p, x):
        for layer in p[:-1]:
            x = jax.nn.relu(x @ layer["w"] + layer["b"])
        return x @ p[-1]["w"] + p[-1]["b"]

    def batch(b):
        x = np.random.default_rng(b).normal(size=(b, 784)).astype(np.float32)
        return jnp.asarray(x), jnp.arange(b, dtype=jnp.int32) % 10

    return params, apply, batch


def cnn():
    rng = np.random.default_rng(1)
    params = {
        "c1": jnp.asarray(rng.normal(size=(3, 3, 1, 16)) / 3, jnp.float32),
        "c2": jnp.asarray(rng.normal(size=(3, 3, 16, 32)) / 12, jnp.float32),
        "out": _dense(rng, 7 * 7 * 32, 10),
    }

    def conv(x, w):
        return jax.lax.conv_general_dilated(
            x, w, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC")
        )

    def pool(x):
        return jax.lax.reduce_window(
            x, -jnp.inf, jax.lax.max, (1, 2, 2, 1), (1, 2, 2, 1), "VALID"
        )

    def apply(p, x):
        x = pool(jax.nn.relu(conv(x, p["c1"])))
        x = pool(jax.nn.relu(conv(x, p["c2"])))
        x = x.reshape(x.shape[0], -1)
        return x @ p["out"]["w"] + p["out"]["b"]

    def batch(b):
        x = np.random.default_rng(b).normal(size=(b, 28, 28, 1)).astype(np.float32)
        return jnp.asarray(x), jnp.arange(b, dtype=jnp.int32) % 10

    return params, apply, batch


def train_step_of(apply):
    opt = optax.sgd(0.1)

    def step(state, batch):
        params, opt_state = state
        x, y = batch

        def loss(p):
            logits = apply(p, x)
            return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

        updates, opt_state = opt.update(jax.grad(loss)(params), opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    return opt, step


def baseline_seconds(step, state, batch):
    """Compiling and running one train step, which every run pays anyway."""
    start = time.perf_counter()
    jax.block_until_ready(jax.jit(step)(state, batch))
    return time.perf_counter() - start


def main():
    print(f"jax {jax.__version__}, devices: {jax.local_devices()}")
    print("\n1. Profiling cost (defaults: batch sizes 16, 64, 256; 5 repeats)")
    print(
        f"{'model':6} {'profile s':>10} {'compiling':>10} {'of 5 min':>9} "
        f"{'baseline s':>11} {'ratio':>6}"
    )
    profiles = {}
    for name, build in (("mlp", mlp), ("cnn", cnn)):
        params, apply, batch = build()
        opt, step = train_step_of(apply)
        state = (params, opt.init(params))
        # A fresh copy of the function so that neither measurement reuses the
        # other's compiled step.
        base = baseline_seconds(lambda s, b, step=step: step(s, b), state, batch(64))
        start = time.perf_counter()
        prof = profile(step, state, batch, transfer=Link(bandwidth=125e6, latency=1e-4))
        cost = time.perf_counter() - start
        profiles[name] = prof
        print(
            f"{name:6} {cost:10.2f} {prof.compile_seconds:10.2f} "
            f"{cost / RUN_SECONDS:9.2%} {base:11.2f} {cost / base:6.1f}"
        )
        d = prof.devices[0]
        print(
            f"       t(b) = {d.time_fit.intercept * 1e3:.3f} ms + "
            f"{d.time_fit.slope * 1e6:.2f} us * b; peak memory at b=256: "
            f"{d.peak_memory[-1] / 2**20:.1f} MiB ({d.memory_source}); "
            f"transfer {prof.transfer_seconds * 1e3:.2f} ms"
        )

    base = profiles["mlp"]
    for title, transfer in (
        ("compute only", None),
        ("with a 1 Gb/s link", base.transfer),
    ):
        print(
            f"\n2. Predicted BSP round, speeds {':'.join(map(str, SPEEDS))}, "
            f"global batch {GLOBAL_BATCH}, profiled MLP, {title}"
        )
        workers = [
            dataclasses.replace(
                base.with_slowdown(max(SPEEDS) / s), worker_id=i, transfer=transfer
            )
            for i, s in enumerate(SPEEDS)
        ]
        print(
            f"{'scheme':6} {'batches':>20} {'local steps':>14} {'round ms':>9} "
            f"{'idle':>6}"
        )
        plans = {}
        for scheme in ("equal", "hps", "ashl", "adsp"):
            p = plan(workers, scheme, global_batch=GLOBAL_BATCH)
            plans[scheme] = p
            batches = ",".join(str(w.batch_size) for w in p.workers)
            steps = ",".join(str(w.local_steps) for w in p.workers)
            print(
                f"{scheme:6} {batches:>20} {steps:>14} {p.round_time * 1e3:9.2f} "
                f"{p.idle_fraction:6.1%}"
            )
        equal, hps = plans["equal"], plans["hps"]
        print(
            f"idle fraction: H-PS {hps.idle_fraction:.1%} vs equal "
            f"{equal.idle_fraction:.1%}; round time equal / H-PS "
            f"{equal.round_time / hps.round_time:.2f}x"
        )


if __name__ == "__main__":
    main()
