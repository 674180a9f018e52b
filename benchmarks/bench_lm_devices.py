"""The language model's train step on each platform of this machine, and the
H-PS plan of a GPU worker beside CPU workers.

For each platform (``cuda`` where JAX sees a GPU, and ``cpu`` on a set of
cores), one worker process runs the profiling pass exactly as a worker does
(``python -m hpsjax.profiling.in_place --task lm``, no server): the model's
train step compiled and timed at each batch size. Printed, per platform and
batch: milliseconds a step, tokens a second, and the model's FLOP rate by the
usual estimate for a decoder's forward and backward passes, ``6 N`` FLOPs a
token for ``N`` parameters (attention's own products left out). Then the
ratio of the GPU's throughput to the CPU's, the baseline measured in the same
run, and what :func:`hpsjax.profiling.plan` gives an H-PS round of one GPU
worker and two CPU workers like the profiled one (the README's recipe of a
GPU host and two CPU hosts; compute only: no server, so no link is counted).

Run::

    python benchmarks/bench_lm_devices.py                 # transformer_30m
    python benchmarks/bench_lm_devices.py --model transformer_1m \\
        --platforms cpu --cpu_batches 2,8 --cpu_cores 1   # a quick look
    python benchmarks/bench_lm_devices.py --json out.json

The CPU worker's XLA threads are as many as its cores (it is pinned to
``--cpu_cores`` of them). Exit status 1 when a platform asked for cannot be
profiled.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import pathlib
import subprocess
import sys
import tempfile
import time

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from hpsjax.profiling import WorkerProfile, plan  # noqa: E402


def _profile(args, platform: str, batches: str, out: pathlib.Path) -> float:
    """Runs the profiling pass in its own process; returns its wall seconds."""
    env = dict(os.environ, JAX_PLATFORMS=platform)
    cmd = [
        sys.executable, "-m", "hpsjax.profiling.in_place", "--task", "lm",
        "--model", args.model, "--dataset_arg", f"seq_len={args.seq_len}",
        "--batch_size", batches.split(",")[0], "--profile_batch_sizes", batches,
        "--profile_repeats", str(args.repeats), "--profile_out", str(out),
    ]  # fmt: skip
    if platform == "cpu":
        cores = sorted(os.sched_getaffinity(0))[: args.cpu_cores]
        env["CUDA_VISIBLE_DEVICES"] = ""
        pin = f"import os,sys; os.sched_setaffinity(0, {set(cores)}); "
        pin += "os.execv(sys.argv[1], sys.argv[1:])"
        cmd = [sys.executable, "-c", pin, *cmd]
    start = time.perf_counter()
    done = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True)
    if done.returncode != 0:
        tail = (done.stderr or done.stdout).strip().splitlines()[-1:]
        raise RuntimeError(f"{platform}: the profiling pass failed: {tail}")
    return time.perf_counter() - start


def _rows(name: str, profile: WorkerProfile, seq_len: int) -> list[dict]:
    device = profile.devices[0]
    rows = []
    for b, t in zip(device.batch_sizes, device.step_times, strict=True):
        tokens = b * seq_len / t
        rows.append(
            {
                "platform": name,
                "device_kind": device.device_kind,
                "batch": b,
                "step_ms": t * 1e3,
                "tokens_per_s": tokens,
                "tflops": 6 * profile.param_count * tokens / 1e12,
            }
        )
    return rows


def hps_plan(gpu: WorkerProfile, cpu: WorkerProfile, global_batch: int):
    """The H-PS plan of worker 0 as ``gpu`` and workers 1 and 2 as ``cpu``;
    returns it and its workers' batches."""
    workers = [
        dataclasses.replace(p, worker_id=i) for i, p in enumerate((gpu, cpu, cpu))
    ]
    work = plan(workers, "hps", global_batch=global_batch)
    return work, [w.batch_size for w in work.workers]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="transformer_30m")
    parser.add_argument("--seq_len", type=int, default=128)
    parser.add_argument("--platforms", default="cuda,cpu")
    parser.add_argument("--gpu_batches", default="8,32,128")
    parser.add_argument("--cpu_batches", default="1,4,16")
    parser.add_argument("--cpu_cores", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--global_batch", type=int, default=128)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    platforms = [p.strip() for p in args.platforms.split(",") if p.strip()]
    if not platforms or set(platforms) - {"cuda", "cpu"}:
        parser.error(f"--platforms: cuda and/or cpu, got {args.platforms!r}")
    profiles, rows, seconds = {}, [], {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in platforms:
            out = pathlib.Path(tmp) / f"{name}.json"
            batches = args.gpu_batches if name == "cuda" else args.cpu_batches
            try:
                seconds[name] = _profile(args, name, batches, out)
            except RuntimeError as e:
                print(f"bench_lm_devices: {e}", file=sys.stderr)
                return 1
            profiles[name] = WorkerProfile.from_json(out.read_text())
            rows += _rows(name, profiles[name], args.seq_len)
    first = next(iter(profiles.values()))
    print(
        f"{args.model}: {first.param_count / 1e6:.1f}M parameters, sequences of "
        f"{args.seq_len} bytes; CPU worker on {args.cpu_cores} cores"
    )
    print(
        f"{'platform':<24} {'batch':>5} {'step ms':>9} {'tokens/s':>10} {'TFLOP/s':>8}"
    )
    for r in rows:
        where = f"{r['platform']} ({r['device_kind']})"
        print(
            f"{where:<24} {r['batch']:>5} {r['step_ms']:>9.1f} "
            f"{r['tokens_per_s']:>10.0f} {r['tflops']:>8.2f}"
        )
    for name, s in seconds.items():
        print(f"{name}: the profiling pass took {s:.1f} s, compiles included")
    result = {"model": args.model, "seq_len": args.seq_len, "rows": rows}
    if "cuda" in profiles and "cpu" in profiles:
        gpu, cpu = profiles["cuda"].devices[0], profiles["cpu"].devices[0]
        b = max(set(gpu.batch_sizes) & set(cpu.batch_sizes) or {args.global_batch})
        ratio = gpu.throughput(b) / cpu.throughput(b)
        best = max(gpu.throughput(x) for x in gpu.batch_sizes) / max(
            cpu.throughput(x) for x in cpu.batch_sizes
        )
        print(
            f"GPU over CPU: {ratio:.1f}x the tokens/s at batch {b}, {best:.1f}x "
            "at each one's best measured batch"
        )
        work, batches = hps_plan(profiles["cuda"], profiles["cpu"], args.global_batch)
        print(
            f"H-PS plan, one GPU and two CPU workers, global batch "
            f"{args.global_batch}: batches {batches}, round "
            f"{work.round_time * 1e3:.0f} ms predicted (compute only), idle "
            f"{work.idle_fraction:.2f}"
        )
        result.update(
            gpu_over_cpu=ratio, gpu_over_cpu_best=best, hps_batches=batches,
            hps_round_s=work.round_time, hps_idle=work.idle_fraction,
        )  # fmt: skip
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
