"""A worker's first-round compile with a cold and a warm compilation cache.

``hpsjax-worker`` compiles the step of its first round before it joins (the
``"compile"`` metrics record gives the seconds). This runs fresh worker
*processes*, one round each, against one ``hpsjax-server``, and reads that
record: without a cache, with an empty cache directory (cold: the compile is
written to it) and with the same directory again (warm: read back), each
``--repeats`` times. The model is ``hpsjax.models.SmallCNN`` on 28x28 generated
digits (``--model mlp`` for a smaller step).

Run::

    python benchmarks/bench_compile.py
    python benchmarks/bench_compile.py --model mlp --batch_size 64 --repeats 5
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import re
import statistics
import subprocess
import sys
import tempfile
import threading

SECRET = b"bench-compile-secret-0123456789ab\n"


def _command(module: str) -> list[str]:
    return [sys.executable, "-c", f"import sys; from {module} import main; "
            "sys.exit(main())"]  # fmt: skip


def _model(args: argparse.Namespace) -> list[str]:
    flags = ["--model", args.model, "--dataset_arg", "image_size=28"]
    return [*flags, "--dataset_arg", "num_examples=2000"]


def _server(tmp: pathlib.Path, args: argparse.Namespace):
    command = [
        *_command("hpsjax.ps._cli"), "--init", str(tmp / "init.npz"),
        "--secret_file", str(tmp / "secret.txt"), "--host", "127.0.0.1",
        "--port", "0", "--policy", "asp", "--loop", "asyncio",
    ]  # fmt: skip
    proc = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    seen = []
    for line in proc.stdout:
        seen.append(line)
        m = re.search(r"listening on 127\.0\.0\.1:(\d+)", line)
        if m:
            # Keep reading its log, so that a full pipe never stalls it.
            threading.Thread(target=proc.stdout.read, daemon=True).start()
            return proc, int(m.group(1))
    proc.kill()
    raise SystemExit("the server did not start:\n" + "".join(seen[-20:]))


def _first_compile(tmp, port, cache, i, args) -> float:
    metrics = tmp / f"m{i}.jsonl"
    command = [
        *_command("hpsjax.cli.worker"), *_model(args), "--host", "127.0.0.1",
        "--port", str(port), "--secret_file", str(tmp / "secret.txt"),
        "--worker_id", str(i), "--shard_index", "0",
        "--batch_size", str(args.batch_size),
        "--max_steps", "1", "--metrics", str(metrics), "--tensorboard_dir",
        "none", "--compile_cache_dir", cache, "--loop", "asyncio",
    ]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        raise SystemExit(f"worker failed:\n{done.stdout}{done.stderr}")
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    (record,) = [r for r in records if r["event"] == "compile"]
    return float(record["compile_s"])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="cnn", help="hpsjax-worker --model")
    p.add_argument("--batch_size", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    os.environ.pop("JAX_COMPILATION_CACHE_DIR", None)
    with tempfile.TemporaryDirectory() as name:
        tmp = pathlib.Path(name)
        (tmp / "secret.txt").write_bytes(SECRET)
        subprocess.run(
            [*_command("hpsjax.cli.worker"), *_model(args), "--write_init",
             str(tmp / "init.npz")],
            check=True, capture_output=True, timeout=600,
        )  # fmt: skip
        server, port = _server(tmp, args)
        try:
            figures: dict[str, list[float]] = {"none": [], "cold": [], "warm": []}
            for r in range(args.repeats):
                cache = str(tmp / f"cache{r}")
                for i, (name, where) in enumerate(
                    (("none", "none"), ("cold", cache), ("warm", cache))
                ):
                    seconds = _first_compile(tmp, port, where, 3 * r + i, args)
                    figures[name].append(seconds)
        finally:
            server.terminate()
            server.wait(60)
    median = {k: statistics.median(v) for k, v in figures.items()}
    print(f"first-round compile of --model {args.model} --batch_size "
          f"{args.batch_size}, median of {args.repeats} fresh processes:")  # fmt: skip
    for name in ("none", "cold", "warm"):
        runs = ", ".join(f"{s:.2f}" for s in figures[name])
        print(f"  {name:5s} cache: {median[name]:6.2f} s   ({runs})")
    print(f"  warm / cold: {median['warm'] / median['cold']:.2f}x")


if __name__ == "__main__":
    main()
