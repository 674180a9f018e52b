"""Wall time of the simulator against a plain SGD loop doing the same gradients.

Run:
  python benchmarks/bench_sim.py [--workers 8,64,256] [--policies asp,bsp]
      [--models small,medium] [--rounds R] [--repeats 3]
  python benchmarks/bench_sim.py --sum_kernel [--models ...] [--workers 64]

``--sum_kernel`` times only the engine's kernels on one version's rounds of
``n`` workers: their gradients summed in one call (``Kernels.grad_sum``, what a
barrier's rounds take), the same gradients one call each (``grad_one``), and a
plain loop of ``n`` steps.

For every model, number of workers and policy it simulates training with
heterogeneous workers (lognormal speeds) for ``R`` gradients per worker (32 for
the small model, 6 for the medium one), then runs a plain single-process loop of
jitted SGD steps (gradient and update in one call, batches gathered on the device
from host indices, like the simulator's) on the same model and batch size for as
many gradient evaluations as the simulator made, in the same process. It prints
both wall times, their ratio (the target is under 1.5), and the share of the
simulator's time spent inside the server core (``ServerCore`` calls, the very
code the asyncio server runs, each call waited for, including the deferred
applies it carries out in one call when the simulator asks for them), which
bounds how low the ratio can go. Each configuration runs once before it is timed, so the
simulator's own kernels are compiled; a new ``ServerCore`` is built, and compiles
its jitted steps, in every run, which dominates the short runs (8 workers). The
best of ``repeats`` timed runs is kept, as the machines are shared and noisy.

Models: ``small`` is an MLP (64, 64) on 8x8 synthetic digits, batch 32 (a
gradient of about 1.5 MFLOP: dispatch-bound, evaluated in vmapped batches);
``medium`` an MLP (256, 256) on 28x28 digits, batch 64 (about 78 MFLOP: evaluated
one worker-step per call).
"""

from __future__ import annotations

import argparse
import time

import jax
import numpy as np
import optax

from hpsjax import data as hdata
from hpsjax import models
from hpsjax.sim import SimConfig, _server_side, make_workers, simulate

_MODELS = {
    "small": dict(image_size=8, hidden=(64, 64), batch=32, rounds=32),
    "medium": dict(image_size=28, hidden=(256, 256), batch=64, rounds=6),
}


class _TimedCore(_server_side.ServerCore):
    """A ServerCore that adds up the wall time of its event calls."""

    seconds = 0.0

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        aggregator = self.aggregator
        if hasattr(aggregator, "apply_deferred"):
            deferred = aggregator.apply_deferred
            aggregator.apply_deferred = lambda: self._timed(deferred)

    def _timed(self, method, *args, **kwargs):
        t0 = time.perf_counter()
        try:
            return method(*args, **kwargs)
        finally:
            # The arrays the call made, not the ``params`` property: reading
            # that would carry out deferred applies at every event.
            aggregator = self.aggregator
            jax.block_until_ready((aggregator._params, aggregator._opt_state))
            _TimedCore.seconds += time.perf_counter() - t0

    def join(self, *args, **kwargs):
        return self._timed(super().join, *args, **kwargs)

    def pull(self, *args, **kwargs):
        return self._timed(super().pull, *args, **kwargs)

    def push(self, *args, **kwargs):
        return self._timed(super().push, *args, **kwargs)

    def tick(self, *args, **kwargs):
        return self._timed(super().tick, *args, **kwargs)

    def leave(self, *args, **kwargs):
        return self._timed(super().leave, *args, **kwargs)


def _setup(name: str):
    spec = _MODELS[name]
    train, _ = hdata.synthetic_digits(
        4000, image_size=spec["image_size"], seed=0
    ).split(0.2, seed=0)
    model = models.get_model(
        "mlp", input_shape=train.input_shape, num_classes=10, hidden=spec["hidden"]
    )
    graphdef, params = models.split_model(model)

    def loss_fn(p, batch):
        return models.loss_fn(p, graphdef, batch)

    return train, params, loss_fn, spec["batch"], spec["rounds"]


def _baseline_seconds(loss_fn, params, train, batch, steps: int) -> float:
    """A plain jitted SGD loop: one gradient and update per call."""
    opt = optax.sgd(0.05)
    data = jax.device_put(hdata.Batch(train.x, train.y))

    @jax.jit
    def step(p, s, idx, data):
        b = jax.tree.map(lambda a: a[idx], data)
        loss, g = jax.value_and_grad(loss_fn)(p, b)
        u, s = opt.update(g, s, p)
        return optax.apply_updates(p, u), s, loss

    rng = np.random.default_rng(0)
    p, s = params, opt.init(params)
    p, s, _ = step(p, s, rng.integers(0, len(train), batch, dtype=np.int32), data)
    jax.block_until_ready(p)
    t0 = time.perf_counter()
    for _ in range(steps):
        idx = rng.integers(0, len(train), batch, dtype=np.int32)
        p, s, _ = step(p, s, idx, data)
    jax.block_until_ready(p)
    return time.perf_counter() - t0


def _sum_kernel(name: str, n: int, repeats: int) -> None:
    from hpsjax.sim import _engine

    train, params, loss_fn, batch, _ = _setup(name)
    data = jax.device_put(hdata.Batch(train.x, train.y))
    k = _engine.kernels(loss_fn, params, None)
    leaves = tuple(jax.tree.leaves(params))
    idx = np.random.default_rng(0).integers(0, len(train), (n, batch), np.int32)
    scale = np.ones(n, np.float32)

    def summed():
        jax.block_until_ready(k.grad_sum(leaves, idx, scale * batch, data))

    def one_by_one():
        jax.block_until_ready(
            [k.grad_one(leaves, idx[j], scale[j], data) for j in range(n)]
        )

    def best(fn):
        fn()  # compiles
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return min(times)

    s, o = best(summed), best(one_by_one)
    loop = min(
        _baseline_seconds(loss_fn, params, train, batch, n) for _ in range(repeats)
    )
    print(
        f"{name:>7} {n:>7} {1e3 * s:>9.2f} {1e3 * o:>11.2f} {1e3 * loop:>8.2f} "
        f"{s / loop:>11.2f}",
        flush=True,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workers", default="8,64,256")
    parser.add_argument("--policies", default="asp,bsp")
    parser.add_argument("--models", default="small,medium")
    parser.add_argument(
        "--rounds", type=int, default=None, help="gradients per worker (per model)"
    )
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--sum_kernel",
        action="store_true",
        help="time the summed gradients of one version's rounds only",
    )
    args = parser.parse_args()
    if args.sum_kernel:
        print(
            f"{'model':>7} {'workers':>7} {'summed ms':>9} {'one by one':>11} "
            f"{'loop ms':>8} {'sum / loop':>11}"
        )
        for name in args.models.split(","):
            for n in (int(v) for v in args.workers.split(",")):
                _sum_kernel(name, n, max(args.repeats, 5))
        return
    _server_side.ServerCore = _TimedCore  # the simulator builds its core from here

    print(
        f"{'model':>7} {'workers':>7} {'policy':>6} {'grads':>6} {'sim s':>8} "
        f"{'loop s':>8} {'ratio':>6} {'core %':>7} {'ratio w/o core':>15}"
    )
    for name in args.models.split(","):
        train, params, loss_fn, batch, rounds = _setup(name)
        rounds = args.rounds or rounds
        for n in (int(v) for v in args.workers.split(",")):
            workers = make_workers(
                n, step_time=0.1, batch_size=batch, speed_sigma=0.5, seed=0
            )
            for policy in args.policies.split(","):
                config = SimConfig(
                    policy=policy,
                    learning_rate=0.05,
                    max_gradients=n * rounds,
                    data_sharding="shared",
                )
                simulate(loss_fn, params, train, workers, config)
                best = core = None
                for _ in range(args.repeats):
                    _TimedCore.seconds = 0.0
                    result = simulate(loss_fn, params, train, workers, config)
                    if best is None or result.wall_seconds < best:
                        best, core = result.wall_seconds, _TimedCore.seconds
                grads = result.evaluated_gradients
                loop = min(
                    _baseline_seconds(loss_fn, params, train, batch, grads)
                    for _ in range(args.repeats)
                )
                print(
                    f"{name:>7} {n:>7} {policy:>6} {grads:>6} {best:>8.3f} "
                    f"{loop:>8.3f} {best / loop:>6.2f} {100 * core / best:>6.0f}% "
                    f"{(best - core) / loop:>15.2f}",
                    flush=True,
                )


if __name__ == "__main__":
    main()
