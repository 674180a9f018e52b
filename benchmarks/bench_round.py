"""A synchronous round's messages: push then a pull behind it, against one push_pull.

The pipelined worker used to send its push and, right behind it, a pull (four
messages a round: PUSH, PUSH_ACK, PULL, PARAMS); with the pull elided
(``WorkerConfig.pull_with_push``, the default) it sends one PUSH_PULL and the
server answers with the parameters once the round's update is applied (two
messages). This times a BSP round of 4 clients on one event loop with a server
in the same process, both ways, alternated, and prints the medians::

    .venv/bin/python benchmarks/bench_round.py [--reps 7] [--rounds 60]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time

import numpy as np
import optax

from hpsjax.ps import Client, Server

WORKERS = 4


def _tree(n: int) -> dict:
    return {"w": np.zeros((n,), np.float32), "b": np.zeros((10,), np.float32)}


async def _round_p50(n: int, mode: str, rounds: int) -> float:
    server = Server(
        _tree(n),
        optax.sgd(0.0),
        "bsp",
        secret=None,
        insecure=True,
        core_kwargs={"expected_workers": WORKERS},
    )
    await server.start()
    clients = [
        Client("127.0.0.1", server.port, worker_id=i, secret=None)
        for i in range(WORKERS)
    ]
    for c in clients:
        await c.connect()
    joined = await asyncio.gather(*[c.pull() for c in clients])
    update = _tree(n)

    async def worker(c, v):
        times = []
        for _ in range(rounds):
            t = time.perf_counter()
            if mode == "push, pull":
                push = asyncio.ensure_future(c.push(update, version=v))
                await asyncio.sleep(0)  # the push frame goes first
                _, v = await c.pull()
                await push
            else:
                _, _, v = await c.push_pull(update, version=v)
            times.append(time.perf_counter() - t)
        return times

    per_worker = await asyncio.gather(
        *[worker(c, v) for c, (_, v) in zip(clients, joined, strict=True)]
    )
    for c in clients:
        await c.close()
    await server.close()
    return statistics.median(per_worker[0][5:])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--rounds", type=int, default=60)
    args = p.parse_args(argv)
    modes = ("push, pull", "push_pull")
    for n in (256, 108_000):
        out: dict[str, list[float]] = {m: [] for m in modes}
        for rep in range(args.reps):
            for mode in modes if rep % 2 == 0 else modes[::-1]:
                out[mode].append(asyncio.run(_round_p50(n, mode, args.rounds)))
        split, fused = (statistics.median(out[m]) for m in modes)
        print(
            f"{n * 4 / 1024:.0f} KiB tree, BSP round p50: push then pull "
            f"{split * 1e3:.2f} ms, push_pull {fused * 1e3:.2f} ms "
            f"(ratio {fused / split:.2f})"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
