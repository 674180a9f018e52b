"""Checkpoints under pushes: lag, memory and stop time, folded saves against a queue.

Run:
  python benchmarks/bench_checkpoint_keepup.py            # 20 s a variant
  python benchmarks/bench_checkpoint_keepup.py --seconds 5

A server of a 32 MiB model (8 float32 leaves of 4 MiB, SGD) checkpoints every
0.3 s while three clients push as fast as they can, for ``--seconds``; then it
is closed (what SIGTERM does). Each variant runs in a fresh process:

* ``fold``: the server as it is (``CheckpointManager.save_async``: one save
  written, at most one waiting, a save due meanwhile replacing it);
* ``queue``: the baseline, the earlier server: every due save queued on one
  thread, each holding its own snapshot, all written in order.

Printed per variant: saves requested and written, the lag of the newest
committed checkpoint behind the server's version (sampled every second, and at
the end), the process's resident memory growth (server and clients share the
process), and the time ``close`` takes.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import json
import pathlib
import re
import subprocess
import sys
import tempfile
import time

import numpy as np
import optax

SECRET = b"bench-keepup-secret"
LEAVES, LEAF_SHAPE = 8, (1024, 1024)


def _rss_mib() -> float:
    text = pathlib.Path("/proc/self/status").read_text()
    return int(re.search(r"VmRSS:\s+(\d+)", text)[1]) / 1024


def _newest_on_disk(directory: pathlib.Path) -> int:
    steps = [
        int(p.name.removeprefix("ckpt_"))
        for p in directory.glob("ckpt_*")
        if p.name.removeprefix("ckpt_").isdigit()
    ]
    return max(steps, default=0)


def _queue_like_before(server) -> dict:
    """Makes ``server`` queue every due save, as the server did before folding."""
    manager = server._manager
    executor = concurrent.futures.ThreadPoolExecutor(max_workers=1)
    counts = {"requested": 0}

    def save_async(step, tree, metadata=None, *, snapshot=True):
        del snapshot
        counts["requested"] += 1
        return executor.submit(manager.save, step, tree, metadata)

    manager.save_async = save_async
    return counts


async def _run(variant: str, seconds: float, directory: pathlib.Path) -> dict:
    from hpsjax.net._client import Client
    from hpsjax.net._server import Server

    params = {
        f"w{i}": np.zeros(LEAF_SHAPE, np.float32) for i in range(LEAVES)
    }  # 32 MiB
    update = {k: np.full(v.shape, 1e-3, np.float32) for k, v in params.items()}
    server = Server(
        params,
        optax.sgd(0.1),
        "asp",
        secret=SECRET,
        checkpoint_dir=directory,
        checkpoint_every_s=0.3,
        checkpoint_keep=2,
        status_interval=0,
    )
    await server.start()
    counts = _queue_like_before(server) if variant == "queue" else None
    rss0 = _rss_mib()
    stop = asyncio.Event()

    async def push(worker: int) -> None:
        async with Client(
            "127.0.0.1", server.port, worker_id=worker, secret=SECRET, timeout=60
        ) as client:
            _, version = await client.pull()
            while not stop.is_set():
                version = (await client.push(update, version=version)).version

    workers = [asyncio.create_task(push(w)) for w in range(3)]
    lags, rss = [], []
    started = time.monotonic()
    while time.monotonic() - started < seconds:
        await asyncio.sleep(1.0)
        lags.append(server.version - _newest_on_disk(directory))
        rss.append(_rss_mib() - rss0)
    stop.set()
    await asyncio.gather(*workers)
    version = server.version
    manager = server._manager
    requested = counts["requested"] if counts else None
    folded = manager.folded_saves
    t0 = time.monotonic()
    await server.close()
    close_s = time.monotonic() - t0
    return {
        "variant": variant,
        "versions": version,
        "requested": requested,
        "folded": folded,
        "lag_mid": lags[len(lags) // 2],
        "lag_end": lags[-1],
        "lag_max": max(lags),
        "rss_mid_mib": rss[len(rss) // 2],
        "rss_end_mib": rss[-1],
        "close_s": close_s,
        "final_on_disk": _newest_on_disk(directory),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--variant", choices=("fold", "queue"))
    args = parser.parse_args()
    if args.variant:
        with tempfile.TemporaryDirectory(prefix="hpsjax-bench-keepup-") as d:
            result = asyncio.run(_run(args.variant, args.seconds, pathlib.Path(d)))
        print(json.dumps(result))
        return
    results = {}
    for variant in ("queue", "fold"):
        out = subprocess.run(
            [sys.executable, __file__, "--variant", variant,
             "--seconds", str(args.seconds)],
            capture_output=True, text=True, check=True,
        )  # fmt: skip
        results[variant] = json.loads(out.stdout.strip().splitlines()[-1])
    print(
        f"32 MiB model, 3 pushing clients, a checkpoint due every 0.3 s, "
        f"{args.seconds:.0f} s"
    )
    for variant, r in results.items():
        print(
            f"  {variant:5s}: {r['versions']} versions; lag behind the version "
            f"{r['lag_mid']} mid-run, {r['lag_end']} at the end (max "
            f"{r['lag_max']}); memory +{r['rss_mid_mib']:.0f} MiB mid-run, "
            f"+{r['rss_end_mib']:.0f} MiB at the end; close "
            f"{r['close_s']:.2f} s; final checkpoint {r['final_on_disk']}"
            + (f"; {r['folded']} saves folded" if variant == "fold" else "")
        )
    q, f = results["queue"], results["fold"]
    print(
        f"  fold/queue: end lag {f['lag_end']}/{q['lag_end']}, memory growth "
        f"{f['rss_end_mib']:.0f}/{q['rss_end_mib']:.0f} MiB, close "
        f"{f['close_s'] / max(q['close_s'], 1e-9):.2f}x"
    )


if __name__ == "__main__":
    main()
