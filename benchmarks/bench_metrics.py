"""Writing metrics records to TensorBoard.

Compares :class:`hpsjax.metrics.MetricsWriter` (one event per record, holding
all of its scalars, written in the caller's thread) with what it did before:
one ``tensorboardX.SummaryWriter.add_scalar`` per field, each an event of its
own handed to the writer's process queue and thread. The records are shaped as
a simulation's push records (a worker, a version and 22 numbers); both outputs
are read back and must hold the same points.

Run: ``python benchmarks/bench_metrics.py [--records N] [--repeats R]``.
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time

from hpsjax.metrics import MetricsWriter, read_tensorboard


def _records(n: int) -> list[dict]:
    rng = random.Random(0)
    return [
        {
            "event": "push",
            "worker": i % 4,
            "version": i,
            "time": i * 0.01,
            **{f"field{j}": rng.random() for j in range(22)},
        }
        for i in range(n)
    ]


def _per_scalar(records: list[dict], logdir: str) -> None:
    """The former path: an event per scalar through SummaryWriter."""
    from tensorboardX import SummaryWriter

    writers: dict[int, SummaryWriter] = {}
    for r in records:
        w = r["worker"]
        writer = writers.get(w) or writers.setdefault(
            w, SummaryWriter(f"{logdir}/worker{w}")
        )
        for field, value in r.items():
            if field not in ("event", "worker"):
                writer.add_scalar(f"push/{field}", float(value), r["version"])
    for writer in writers.values():
        writer.close()


def _metrics_writer(records: list[dict], logdir: str) -> None:
    with MetricsWriter(tensorboard_dir=logdir) as writer:
        for r in records:
            writer(r)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--records", type=int, default=2000)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    records = _records(args.records)
    times: dict[str, list[float]] = {"SummaryWriter": [], "MetricsWriter": []}
    written = {}
    for _ in range(args.repeats):
        for name, write in (
            ("SummaryWriter", _per_scalar),
            ("MetricsWriter", _metrics_writer),
        ):
            with tempfile.TemporaryDirectory() as logdir:
                start = time.perf_counter()
                write(records, logdir)
                times[name].append(time.perf_counter() - start)
                written[name] = read_tensorboard(logdir)
    assert written["SummaryWriter"] == written["MetricsWriter"], "different points"
    base = statistics.median(times["SummaryWriter"])
    print(f"{args.records} records of 24 scalars, median of {args.repeats}:")
    for name, ts in times.items():
        t = statistics.median(ts)
        print(f"  {name:14s} {t * 1e6 / args.records:8.1f} us/record  {base / t:5.1f}x")


if __name__ == "__main__":
    main()
