"""Benchmark of the worker runtime: idle time, pipeline overlap, profiling cost.

Three measurements, each against a baseline taken in the same run, on worker
*processes* started by :func:`hpsjax.launch.launch` (``hpsjax.models.SmallCNN``
on 28x28 generated digits, 106k parameters, 0.42 MB per push or pull; one XLA
thread per process):

1. **Idle fraction under BSP.** Four workers with injected speeds 1 : 1 : 2 : 4
   (slowdown factors 4, 4, 2, 1) train under BSP with a global batch of 512,
   once with equal batches (128 each) and once with the profiled H-PS plan
   (batches from measured speed). The idle fraction is the share of
   round time a worker spends waiting for the next parameters, averaged over the
   workers (rounds after the warm-up).
2. **Pipeline overlap.** Two workers under ASP with a 10 MB/s link (about 40 ms
   per message), with and without the pipeline (previous push and next pull
   travelling during compute):
   the share of transfer time hidden behind compute,
   ``1 - sum(wait) / sum(transfer)``, and the time a round takes beyond its
   compute, pipelined over sequential.
3. **Profiling cost.** Seconds the profiling pass takes on the slowest worker
   (compiles included, its timed steps stretched by its slowdown) as a share of
   a five-minute run.

Run (takes a few minutes; the figures are noisy on a shared machine)::

    python benchmarks/bench_worker.py            # full
    python benchmarks/bench_worker.py --quick    # fewer rounds
    python benchmarks/bench_worker.py --out results.json
    python benchmarks/bench_worker.py --parts overlap
"""

from __future__ import annotations

import os

# One compute thread per worker process: four workers and a server share the
# machine's cores, and XLA's thread pools would otherwise fight over them.
os.environ.setdefault(
    "XLA_FLAGS", "--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1"
)

import argparse
import io
import json
import pathlib
import statistics
import sys
import tempfile

from hpsjax.launch import launch
from hpsjax.worker import summarize

MODEL = [
    "--model", "cnn",
    "--dataset_arg", "image_size=28",
    "--dataset_arg", "num_examples=4000",
    "--log_level", "WARNING",
]  # fmt: skip
PROFILE_REPEATS = 5
PROFILE = [
    "--profile_batch_sizes", "16,64",
    "--profile_repeats", str(PROFILE_REPEATS),
]  # fmt: skip
SPEEDS = (1, 1, 2, 4)
FIVE_MINUTES = 300.0


def _records(workdir: pathlib.Path, num_workers: int) -> list[list[dict]]:
    out = []
    for i in range(num_workers):
        lines = (workdir / f"metrics_{i}.jsonl").read_text().splitlines()
        out.append([r for r in map(json.loads, lines) if r["event"] == "round"])
    return out


def _launch(workdir: pathlib.Path, num_workers: int, **kwargs):
    log = io.StringIO()
    result = launch(
        num_workers,
        workdir=workdir,
        progress=False,
        log=log,
        timeout=1200,
        **kwargs,
    )
    if result.returncode != 0:
        sys.stderr.write(log.getvalue())
        raise SystemExit(f"launch failed: {result.reason}")
    return result


def bsp_idle(root: pathlib.Path, *, steps: int, warmup: int) -> dict:
    """Idle fraction under BSP with equal batches and with the H-PS plan."""
    slowdowns = {i: ["--slowdown", str(max(SPEEDS) / s)] for i, s in enumerate(SPEEDS)}
    out = {}
    for name, plan in (("equal", None), ("hps", "hps")):
        workdir = root / f"bsp_{name}"
        result = _launch(
            workdir,
            len(SPEEDS),
            policy="bsp",
            steps=steps,
            worker_args=[*MODEL, "--batch_size", "128", *PROFILE],
            per_worker_args=slowdowns,
            plan=plan,
            global_batch=128 * len(SPEEDS),
        )
        per_worker = [
            summarize(rounds[warmup:]) for rounds in _records(workdir, len(SPEEDS))
        ]
        rounds = _records(workdir, len(SPEEDS))
        round_time = statistics.median(
            r["round_s"] for worker in rounds for r in worker[warmup:]
        )
        out[name] = {
            "idle_fraction": statistics.mean(s["idle_fraction"] for s in per_worker),
            "idle_fraction_per_worker": [s["idle_fraction"] for s in per_worker],
            "batches": [w[-1]["batch_size"] for w in rounds],
            "median_round_s": round_time,
            "samples_per_s": 128 * len(SPEEDS) / round_time,
            "profile_seconds": result.profile_seconds,
        }
    out["speedup"] = out["hps"]["samples_per_s"] / out["equal"]["samples_per_s"]
    return out


def overlap(root: pathlib.Path, *, steps: int, warmup: int) -> dict:
    """Transfer hidden behind compute, pipeline on versus off."""
    flags = [*MODEL, "--batch_size", "128", "--bandwidth", "1e7"]
    out = {}
    for name, extra in (("pipelined", []), ("sequential", ["--overlap", "none"])):
        workdir = root / f"overlap_{name}"
        _launch(workdir, 2, policy="asp", steps=steps, worker_args=[*flags, *extra])
        rounds = [r for w in _records(workdir, 2) for r in w[warmup:]]
        stats = summarize(rounds)
        out[name] = {
            "overlap": stats["overlap"],
            "idle_fraction": stats["idle_fraction"],
            "median_round_s": statistics.median(r["round_s"] for r in rounds),
            "median_transfer_s": statistics.median(r["transfer_s"] for r in rounds),
            "median_wait_s": statistics.median(r["wait_s"] for r in rounds),
            "median_compute_s": statistics.median(
                r["compute_s"] + r["slowdown_s"] for r in rounds
            ),
        }
    # Compute time varies with the machine's load between the two runs; what
    # the pipeline changes is the time a round spends beyond its compute.
    out["overhead_ratio"] = max(
        out["pipelined"]["median_round_s"] - out["pipelined"]["median_compute_s"], 0
    ) / max(
        out["sequential"]["median_round_s"] - out["sequential"]["median_compute_s"],
        1e-9,
    )
    return out


def profiling_cost(root: pathlib.Path, wall: float) -> dict:
    """The profiling pass's cost on the slowest worker of a real cluster.

    The launcher measures the step once for all workers (they share this
    machine). On a cluster each worker profiles itself at the same time, and the
    slowest pays its timed steps k times over: that is the cost charged here.
    """
    fastest = SPEEDS.index(max(SPEEDS))
    profile = json.loads((root / "bsp_hps" / f"profile_{fastest}.json").read_text())
    timed = sum(
        (1 + PROFILE_REPEATS) * t for d in profile["devices"] for t in d["step_times"]
    )
    slowest = wall - timed + timed * max(SPEEDS) / min(SPEEDS)
    return {
        "pass_seconds": wall,
        "slowest_worker_seconds": slowest,
        "fraction_of_5min_run": slowest / FIVE_MINUTES,
    }


def _print_idle(idle: dict, profiling: dict) -> None:
    print("BSP, speeds 1:1:2:4, global batch 512")
    for name in ("equal", "hps"):
        f = idle[name]
        print(
            f"  {name:6s} batches {f['batches']}: idle {f['idle_fraction']:.1%} "
            f"(per worker {[f'{x:.0%}' for x in f['idle_fraction_per_worker']]}), "
            f"median round {f['median_round_s'] * 1e3:.0f} ms"
        )
    print(f"  throughput H-PS / equal: {idle['speedup']:.2f}x")
    print(
        f"Profiling pass: {profiling['pass_seconds']:.2f} s measured once; "
        f"{profiling['slowest_worker_seconds']:.2f} s on the slowest worker = "
        f"{profiling['fraction_of_5min_run']:.2%} of a 5-minute run"
    )


def _print_overlap(hidden: dict) -> None:
    print("Pipeline, ASP, 2 workers, 0.42 MB messages on a 10 MB/s link")
    for name in ("pipelined", "sequential"):
        f = hidden[name]
        print(
            f"  {name:10s}: transfer hidden {f['overlap']:.1%}, exposed "
            f"{f['median_wait_s'] * 1e3:.0f} ms per round, median round "
            f"{f['median_round_s'] * 1e3:.0f} ms (compute "
            f"{f['median_compute_s'] * 1e3:.0f} ms, transfer "
            f"{f['median_transfer_s'] * 1e3:.0f} ms)"
        )
    print(
        "  round time beyond compute, pipelined / sequential: "
        f"{hidden['overhead_ratio']:.2f}"
    )


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="fewer rounds")
    p.add_argument(
        "--parts",
        default="idle,overlap",
        help="comma-separated: idle (with the profiling cost), overlap",
    )
    p.add_argument("--out", help="write the figures as JSON here")
    p.add_argument("--workdir", help="keep the runs' files here")
    args = p.parse_args(argv)
    parts = {x.strip() for x in args.parts.split(",") if x.strip()}
    if not parts or parts - {"idle", "overlap"}:
        p.error(f"--parts takes idle and/or overlap, got {args.parts!r}")
    steps, warmup = (10, 3) if args.quick else (30, 5)
    root = pathlib.Path(args.workdir or tempfile.mkdtemp(prefix="bench-worker-"))
    figures: dict = {"steps": steps, "warmup_rounds": warmup}
    print(f"runs kept in {root}")
    if "idle" in parts:
        idle = bsp_idle(root, steps=steps, warmup=warmup)
        profiling = profiling_cost(root, idle["hps"]["profile_seconds"])
        figures.update(bsp_idle=idle, profiling=profiling)
        _print_idle(idle, profiling)
    if "overlap" in parts:
        figures["overlap"] = overlap(root, steps=steps, warmup=warmup)
        _print_overlap(figures["overlap"])
    if args.out:
        pathlib.Path(args.out).write_text(json.dumps(figures, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
