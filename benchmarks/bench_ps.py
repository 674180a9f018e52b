"""Parameter-server throughput and latency over loopback, as ratios to baselines.

Every figure is compared with a baseline measured in the same run on the same
machine, so the ratios (not the absolute numbers) are what carries over between
machines:

1. **big**: a push then a pull of a 64 MiB float32 pytree shaped like a small CNN
   (many leaves), against sending the same bytes both ways through a plain
   blocking socket to a thread echo server. Ratio = baseline time / PS time
   (target >= 0.9). The PS time includes the server's optimizer step (applied
   leaf by leaf as the push arrives unless ``--server_args
   "--overlap_apply_bytes -1"``). Also the server's peak memory over what it
   held before the first push, in copies of the model. ``--link_rate 1.25e9``
   paces the client's sends (its pushes, the baseline's request) to a 10 Gb/s
   link. ``--only big_bsp``: BSP rounds of two clients each ``push_pull``-ing
   the tree at once (the server averages the round's pushes and applies, the
   last push leaf by leaf as it arrives unless turned off), against two
   echoes of it one after another.
2. **small**: round trips of a 1 KiB pytree (``pull`` and ``push_pull``), p50
   and p99, against a bare asyncio echo of the same bytes (target: p50 <= 2x).
3. **fan-in**: aggregate push throughput of 32 concurrent clients against 1
   (a 1 MiB CNN-shaped tree, ASP).
4. **compressed**: 8-bit pushes (``Codec("uniform", 8)``): effective float32
   bytes per second (the update's fp32 size over the time per push) against
   uncompressed pushes, and the bytes each push puts on the wire.

``--model lm30m`` gives **big** and **compressed** the tree of the 30M-parameter
byte-level transformer language model (``hpsjax.models`` "transformer",
``d_model`` 512, 10 layers: 31.6M float32 parameters, 126 MB, 102 leaves)
instead of the CNN: **big** then also reports the push and the pull apart, the
server's own apply time per push (its Prometheus ``apply_seconds``), and the
server's resident memory per model byte (its resident set with the model
loaded, less that of the same server holding a one-float model, over the
model's bytes).

The servers run in their own processes (``hpsjax-server`` from an ``.npz`` of the
model, and an echo server), on uvloop when it is installed; the clients in this
one. Run::

  python benchmarks/bench_ps.py              # full sizes
  python benchmarks/bench_ps.py --quick      # small sizes, a smoke test
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import pathlib
import socket
import statistics
import subprocess
import sys
import tempfile
import textwrap
import threading
import time

import numpy as np

from hpsjax.models import save_params_npz
from hpsjax.net._client import Client
from hpsjax.wire._frames import HEADER_SIZE

SECRET = b"bench secret"
# Extra hpsjax-server arguments (--server_args), e.g. "--no-malloc_tuning".
SERVER_ARGS: list[str] = []


def cnn_shapes(total_bytes: int) -> dict[str, tuple[int, ...]]:
    """Leaf shapes of a VGG-16-like CIFAR CNN with ``total_bytes`` of float32.

    Thirteen 3x3 conv layers (kernel, bias, batch-norm scale and offset each)
    and two dense layers after global pooling: 56 leaves, the largest 9 MiB at
    full size. Channel widths shrink with the square root of the size below
    64 MiB, and the first dense layer's width absorbs the rest.
    """
    convs = [(3, 64), (64, 64), (64, 128), (128, 128), (128, 256), (256, 256),
             (256, 256), (256, 512), (512, 512), (512, 512), (512, 512),
             (512, 512), (512, 512)]  # fmt: skip
    shrink = min(1.0, math.sqrt(total_bytes / (64 * 2**20)))
    shapes: dict[str, tuple[int, ...]] = {}
    for i, (cin, cout) in enumerate(convs):
        cin = cin if i == 0 else max(1, int(cin * shrink))
        cout = max(1, int(cout * shrink))
        shapes[f"conv{i:02d}/kernel"] = (3, 3, cin, cout)
        shapes[f"conv{i:02d}/bias"] = (cout,)
        shapes[f"conv{i:02d}/bn_scale"] = (cout,)
        shapes[f"conv{i:02d}/bn_offset"] = (cout,)
    used = sum(math.prod(s) for s in shapes.values())
    classes = 10
    # Dense layers: cout x width + width + width x classes + classes floats.
    width = max(1, (total_bytes // 4 - used - classes) // (cout + 1 + classes))
    shapes["dense0/kernel"] = (cout, width)
    shapes["dense0/bias"] = (width,)
    shapes["dense1/kernel"] = (width, classes)
    shapes["dense1/bias"] = (classes,)
    return shapes


def lm_shapes(
    d_model: int = 512, num_layers: int = 10, vocab: int = 256, mlp_ratio: int = 4
) -> dict[str, tuple[int, ...]]:
    """Leaf shapes of a decoder-only transformer language model.

    Tied token embeddings (``vocab x d_model``), per layer a pre-attention and a
    pre-MLP norm scale, the query, key, value and output projections
    (``d_model x d_model``) and a two-layer MLP of width ``mlp_ratio *
    d_model`` with biases, and a final norm: ``12 d^2`` parameters a layer. The
    defaults hold 31.6M parameters (126 MB of float32).
    """
    d, hidden = d_model, mlp_ratio * d_model
    shapes: dict[str, tuple[int, ...]] = {"embed/embedding": (vocab, d)}
    for i in range(num_layers):
        layer = f"layers_{i}"
        shapes[f"{layer}/attn_norm/scale"] = (d,)
        for name in ("query", "key", "value", "out"):
            shapes[f"{layer}/attn/{name}/kernel"] = (d, d)
        shapes[f"{layer}/mlp_norm/scale"] = (d,)
        shapes[f"{layer}/mlp/up/kernel"] = (d, hidden)
        shapes[f"{layer}/mlp/up/bias"] = (hidden,)
        shapes[f"{layer}/mlp/down/kernel"] = (hidden, d)
        shapes[f"{layer}/mlp/down/bias"] = (d,)
    shapes["final_norm/scale"] = (d,)
    return shapes


def _nested(flat: dict[str, np.ndarray]) -> dict:
    tree: dict = {}
    for name, value in flat.items():
        node = tree
        *parents, leaf = name.split("/")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    return tree


def _tree(shapes, value=0.0):
    return _nested({k: np.full(s, value, np.float32) for k, s in shapes.items()})


def _nbytes(shapes) -> int:
    return sum(math.prod(s) for s in shapes.values()) * 4


# ------------------------------------------------------------------ servers


class PsServer:
    """``hpsjax-server`` in a subprocess, serving a model from an .npz file."""

    def __init__(
        self,
        shapes,
        workdir: pathlib.Path,
        loop: str,
        policy="asp",
        extra=(),
        metrics=False,
    ):
        init = workdir / f"init-{len(shapes)}-{_nbytes(shapes)}.npz"
        save_params_npz(init, _tree(shapes))
        secret = workdir / "secret"
        secret.write_bytes(SECRET)
        self.metrics_port = _free_port() if metrics else None
        if metrics:
            extra = (*extra, "--metrics_port", str(self.metrics_port))
        self.proc = subprocess.Popen(
            [
                sys.executable, "-m", "hpsjax.ps._cli", "--init", str(init),
                "--secret_file", str(secret), "--policy", policy,
                "--optimizer", "sgd", "--learning_rate", "1e-6",
                "--loop", loop, "--log_level", "WARNING", *extra, *SERVER_ARGS,
            ],
            stdout=subprocess.PIPE,
            text=True,
        )  # fmt: skip
        line = self.proc.stdout.readline()
        while line.startswith("hpsjax-server metrics on"):
            line = self.proc.stdout.readline()
        if "listening on" not in line:
            self.proc.kill()
            raise RuntimeError(f"server failed to start: {line!r}")
        self.port = int(line.rsplit(":", 1)[1])

    def memory(self) -> tuple[int, int]:
        """The server process's ``(resident, peak resident)`` bytes (Linux)."""
        fields = {}
        with open(f"/proc/{self.proc.pid}/status") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key in ("VmRSS", "VmHWM"):
                    fields[key] = int(value.split()[0]) * 1024
        return fields["VmRSS"], fields["VmHWM"]

    def apply_seconds(self) -> tuple[float, int]:
        """The server's summed apply time and its count of applied updates
        (its Prometheus ``apply_seconds`` histogram; needs ``metrics=True``)."""
        import urllib.request

        url = f"http://127.0.0.1:{self.metrics_port}/metrics"
        text = urllib.request.urlopen(url, timeout=30).read().decode()
        found = {}
        for line in text.splitlines():
            name, _, value = line.partition(" ")
            for key in ("apply_seconds_sum", "apply_seconds_count"):
                if name.endswith(key):
                    found[key] = float(value)
        return found["apply_seconds_sum"], int(found["apply_seconds_count"])

    def close(self):
        self.proc.terminate()
        self.proc.wait(60)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


_ECHO_SERVER = textwrap.dedent(
    """
    import asyncio, sys

    class Echo(asyncio.Protocol):
        def connection_made(self, transport):
            self.transport = transport

        def data_received(self, data):
            self.transport.write(data)

    async def main():
        loop = asyncio.get_running_loop()
        server = await loop.create_server(Echo, "127.0.0.1", 0)
        print(server.sockets[0].getsockname()[1], flush=True)
        await asyncio.Event().wait()

    if sys.argv[1] == "uvloop":
        import uvloop
        uvloop.run(main())
    else:
        asyncio.run(main())
    """
)


class AsyncioEcho:
    """A bare asyncio echo server (a Protocol writing back what it reads)."""

    def __init__(self, loop: str):
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _ECHO_SERVER, loop],
            stdout=subprocess.PIPE,
            text=True,
        )
        self.port = int(self.proc.stdout.readline())

    def close(self):
        self.proc.terminate()
        self.proc.wait(60)


def _recv_into(sock, view):
    while len(view):
        n = sock.recv_into(view)
        if not n:
            raise ConnectionError("echo peer closed")
        view = view[n:]


class ThreadEcho:
    """A blocking-socket echo server on a thread: reads n bytes, sends them back."""

    def __init__(self, nbytes: int):
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.nbytes = nbytes
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self):
        conn, _ = self.listener.accept()
        buf = memoryview(bytearray(self.nbytes))
        with conn:
            while True:
                try:
                    _recv_into(conn, buf)
                except ConnectionError:
                    return
                conn.sendall(buf)

    def close(self):
        self.listener.close()


# ------------------------------------------------------------------ benches


# Linux's SO_MAX_PACING_RATE: TCP paces what the socket sends to this many
# bytes per second (a link slower than loopback's memory copy).
_SO_MAX_PACING_RATE = 47


def _pace(sock: socket.socket, rate: float | None) -> None:
    if rate:
        sock.setsockopt(socket.SOL_SOCKET, _SO_MAX_PACING_RATE, int(rate))


def bench_big(shapes, workdir, loop_name, repeats, link_rate=None, detail=False):
    """A push then a pull, and a ``push_pull``, of the tree against blocking
    echoes of the same bytes; with ``detail`` also the push and the pull apart,
    the server's apply time and its resident memory per model byte."""
    nbytes = _nbytes(shapes)
    echo = ThreadEcho(nbytes)
    payload = np.ones(nbytes, np.uint8)
    back = memoryview(bytearray(nbytes))
    empty_rss = _empty_server_rss(workdir, loop_name) if detail else None
    server = PsServer(shapes, workdir, loop_name, metrics=detail)
    update = _tree(shapes, 1e-3)

    async def run():
        t = {"base": [], "push": [], "pull": [], "push_pull": []}
        with socket.create_connection(("127.0.0.1", echo.port)) as sock:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            _pace(sock, link_rate)
            async with Client(
                "127.0.0.1", server.port, worker_id="big", secret=SECRET, timeout=300
            ) as c:
                _pace(c._protocol.transport.get_extra_info("socket"), link_rate)
                _, version = await c.pull()
                # The model and its optimizer state are in; no push yet.
                rss_before, _ = server.memory()
                # Interleaved, so that baseline and server see the same load.
                apply0 = (0.0, 0)
                for i in range(repeats + 1):
                    if i == 1 and detail:
                        # After the warm-up (the first apply compiles).
                        apply0 = server.apply_seconds()
                    t0 = time.perf_counter()
                    sock.sendall(payload)
                    _recv_into(sock, back)
                    t1 = time.perf_counter()
                    ack = await c.push(update, version=version)
                    t2 = time.perf_counter()
                    _, version = await c.pull()
                    t3 = time.perf_counter()
                    _, _, version = await c.push_pull(update, version=version)
                    t4 = time.perf_counter()
                    assert ack.applied
                    for key, dt in zip(
                        t, (t1 - t0, t2 - t1, t3 - t2, t4 - t3), strict=True
                    ):
                        t[key].append(dt)
                _, peak = server.memory()
                apply = None
                if detail:
                    total, count = server.apply_seconds()
                    apply = (total - apply0[0], count - apply0[1])
        return t, rss_before, (peak - rss_before) / nbytes, apply

    try:
        t, rss_loaded, extra_copies, apply = _run(run(), loop_name)
    finally:
        server.close()
        echo.close()
    # The first repeat includes warm-up (compilation, first touch of memory).
    med = {k: statistics.median(v[1:]) for k, v in t.items()}
    base, ps_sep = med["base"], med["push"] + med["pull"]
    result = {
        "tree_bytes": nbytes,
        "leaves": len(shapes),
        "baseline_echo_s": base,
        "push_then_pull_s": ps_sep,
        "push_pull_s": med["push_pull"],
        "ratio_push_then_pull": base / ps_sep,
        "ratio_push_pull": base / med["push_pull"],
        "baseline_GBps": 2 * nbytes / base / 1e9,
        "push_then_pull_GBps": 2 * nbytes / ps_sep / 1e9,
        # Peak server memory over what it held before the first push, in
        # copies of the model (one push in flight at a time here).
        "peak_extra_model_copies": extra_copies,
    }
    if detail:
        apply_sum, applied = apply
        result.update(
            push_s=med["push"],
            pull_s=med["pull"],
            # Half the echo's round trip: the same bytes one way.
            ratio_push=base / 2 / med["push"],
            ratio_pull=base / 2 / med["pull"],
            server_apply_s=apply_sum / max(1, applied),
            server_rss_per_model_byte=(rss_loaded - empty_rss) / nbytes,
        )
    return result


def _empty_server_rss(workdir, loop_name) -> int:
    """The resident bytes of a server holding a one-float model, after a
    pull (its runtime, libraries and buffers: what a model adds to nothing)."""
    server = PsServer({"w": (1,)}, workdir, loop_name)

    async def run():
        async with Client(
            "127.0.0.1", server.port, worker_id="e", secret=SECRET, timeout=60
        ) as c:
            await c.pull()
            return server.memory()[0]

    try:
        return _run(run(), loop_name)
    finally:
        server.close()


def bench_big_bsp(shapes, workdir, loop_name, repeats, link_rate=None, clients=2):
    """BSP rounds of ``clients`` workers each ``push_pull``-ing the big tree at
    once, against as many blocking-socket echoes of it one after another."""
    nbytes = _nbytes(shapes)
    echo = ThreadEcho(nbytes)
    payload = np.ones(nbytes, np.uint8)
    back = memoryview(bytearray(nbytes))
    server = PsServer(
        shapes,
        workdir,
        loop_name,
        policy="bsp",
        extra=("--core_arg", f"expected_workers={clients}"),
    )
    update = _tree(shapes, 1e-3)

    async def run():
        base, rounds = [], []
        with socket.create_connection(("127.0.0.1", echo.port)) as sock:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            _pace(sock, link_rate)
            async with contextlib.AsyncExitStack() as stack:
                cs = [
                    await stack.enter_async_context(
                        Client(
                            "127.0.0.1",
                            server.port,
                            worker_id=i,
                            secret=SECRET,
                            timeout=120,
                        )
                    )
                    for i in range(clients)
                ]
                for c in cs:
                    _pace(c._protocol.transport.get_extra_info("socket"), link_rate)
                pulled = await asyncio.gather(*(c.pull() for c in cs))
                versions = [v for _, v in pulled]
                for _ in range(repeats + 1):
                    t0 = time.perf_counter()
                    for _ in range(clients):
                        sock.sendall(payload)
                        _recv_into(sock, back)
                    t1 = time.perf_counter()
                    out = await asyncio.gather(
                        *(
                            c.push_pull(update, version=v)
                            for c, v in zip(cs, versions, strict=True)
                        )
                    )
                    t2 = time.perf_counter()
                    versions = [v for _, _, v in out]
                    assert len(set(versions)) == 1
                    base.append(t1 - t0)
                    rounds.append(t2 - t1)
        return base, rounds

    try:
        base_t, round_t = _run(run(), loop_name)
    finally:
        server.close()
        echo.close()
    base = statistics.median(base_t[1:])
    round_s = statistics.median(round_t[1:])
    return {
        "tree_bytes": nbytes,
        "clients": clients,
        "baseline_echoes_s": base,
        "round_s": round_s,
        "ratio_round": base / round_s,
    }


def bench_small(workdir, loop_name, repeats):
    shapes = {"w": (16, 16)}  # 1 KiB of float32
    nbytes = _nbytes(shapes)
    echo = AsyncioEcho(loop_name)
    server = PsServer(shapes, workdir, loop_name)
    update = _tree(shapes, 1e-3)
    data = bytes(nbytes)
    warmup = 100

    async def run():
        reader, writer = await asyncio.open_connection("127.0.0.1", echo.port)
        writer.get_extra_info("socket").setsockopt(
            socket.IPPROTO_TCP, socket.TCP_NODELAY, 1
        )
        echo_t, pull_t, pp_t = [], [], []
        async with Client(
            "127.0.0.1", server.port, worker_id="small", secret=SECRET
        ) as c:
            _, version = await c.pull()
            for _ in range(repeats + warmup):
                t0 = time.perf_counter()
                writer.write(data)
                await reader.readexactly(nbytes)
                t1 = time.perf_counter()
                _, version = await c.pull()
                t2 = time.perf_counter()
                _, _, version = await c.push_pull(update, version=version)
                t3 = time.perf_counter()
                echo_t.append(t1 - t0)
                pull_t.append(t2 - t1)
                pp_t.append(t3 - t2)
        writer.close()
        await writer.wait_closed()
        return echo_t[warmup:], pull_t[warmup:], pp_t[warmup:]

    try:
        echo_t, pull_t, pp_t = _run(run(), loop_name)
    finally:
        server.close()
        echo.close()

    def pct(xs, q):
        return float(np.percentile(np.asarray(xs), q))

    out = {"tree_bytes": nbytes}
    for name, xs in [("echo", echo_t), ("pull", pull_t), ("push_pull", pp_t)]:
        out[f"{name}_p50_us"] = pct(xs, 50) * 1e6
        out[f"{name}_p99_us"] = pct(xs, 99) * 1e6
    out["pull_p50_vs_echo"] = out["pull_p50_us"] / out["echo_p50_us"]
    out["push_pull_p50_vs_echo"] = out["push_pull_p50_us"] / out["echo_p50_us"]
    return out


def bench_fan_in(shapes, workdir, loop_name, seconds, clients):
    server = PsServer(shapes, workdir, loop_name)
    update = _tree(shapes, 1e-3)
    nbytes = _nbytes(shapes)

    async def pushes(n):
        cs = [
            Client("127.0.0.1", server.port, worker_id=f"c{i}", secret=SECRET,
                   timeout=120)
            for i in range(n)
        ]  # fmt: skip
        for c in cs:
            await c.connect()
        versions = [v for _, v in await asyncio.gather(*(c.pull() for c in cs))]
        counts = [0] * n
        stop = time.perf_counter() + seconds

        async def one(i, c):
            version = versions[i]
            while time.perf_counter() < stop:
                ack = await c.push(update, version=version)
                version = ack.version
                counts[i] += 1

        t0 = time.perf_counter()
        await asyncio.gather(*(one(i, c) for i, c in enumerate(cs)))
        elapsed = time.perf_counter() - t0
        for c in cs:
            await c.close()
        return sum(counts) / elapsed

    try:
        _run(pushes(1), loop_name)  # warm-up: compilation
        one = _run(pushes(1), loop_name)
        many = _run(pushes(clients), loop_name)
    finally:
        server.close()
    return {
        "tree_bytes": nbytes,
        "clients": clients,
        "pushes_per_s_1": one,
        "pushes_per_s_n": many,
        "GBps_1": one * nbytes / 1e9,
        "GBps_n": many * nbytes / 1e9,
        "ratio_n_vs_1": many / one,
    }


def bench_compressed(shapes, workdir, loop_name, repeats):
    from hpsjax.transforms._quantize import Codec

    server = PsServer(shapes, workdir, loop_name)
    update = _tree(shapes, 1e-3)
    nbytes = _nbytes(shapes)
    codec = Codec("uniform", 8)

    async def run():
        async with Client(
            "127.0.0.1", server.port, worker_id="q", secret=SECRET, timeout=120
        ) as c:
            _, version = await c.pull()
            times = {"raw": [], "q8": []}
            wire = {}
            for _ in range(repeats + 1):
                for name, kwargs in [("raw", {}), ("q8", {"codec": codec})]:
                    sent = c.bytes_sent
                    t0 = time.perf_counter()
                    ack = await c.push(update, version=version, **kwargs)
                    times[name].append(time.perf_counter() - t0)
                    wire[name] = c.bytes_sent - sent
                    version = ack.version
            return times, wire

    try:
        times, wire = _run(run(), loop_name)
    finally:
        server.close()
    raw = statistics.median(times["raw"][1:])
    q8 = statistics.median(times["q8"][1:])
    return {
        "tree_bytes": nbytes,
        "raw_push_s": raw,
        "q8_push_s": q8,
        "raw_fp32_GBps": nbytes / raw / 1e9,
        "q8_fp32_GBps": nbytes / q8 / 1e9,
        "ratio_q8_vs_raw": raw / q8,
        "raw_wire_bytes": wire["raw"],
        "q8_wire_bytes": wire["q8"],
        "q8_wire_fraction": wire["q8"] / wire["raw"],
        "frame_overhead_bytes": wire["raw"] - nbytes,
    }


def _run(coro, loop_name):
    if loop_name == "uvloop":
        import uvloop

        return uvloop.run(coro)
    return asyncio.run(coro)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="small sizes")
    parser.add_argument("--loop", choices=("uvloop", "asyncio"), default=None)
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--json", help="also write the results to this file")
    parser.add_argument(
        "--server_args", default="", help="extra hpsjax-server arguments"
    )
    parser.add_argument(
        "--only", default="big,small,fan_in,compressed", help="benches to run"
    )
    parser.add_argument(
        "--model",
        choices=("cnn", "lm30m"),
        default="cnn",
        help="big and compressed: a CNN-shaped tree of 64 MiB (4 MiB with "
        "--quick), or the 30M-parameter language model's tree (126 MB)",
    )
    parser.add_argument(
        "--link_rate",
        type=float,
        help="big: pace what the client sends (its pushes, the baseline's "
        "request) to this many bytes/s, a link slower than loopback (Linux)",
    )
    args = parser.parse_args()
    SERVER_ARGS.extend(args.server_args.split())
    loop_name = args.loop
    if loop_name is None:
        try:
            import uvloop  # noqa: F401

            loop_name = "uvloop"
        except ImportError:
            loop_name = "asyncio"
    big = 4 * 2**20 if args.quick else 64 * 2**20
    big_shapes = cnn_shapes(big) if args.model == "cnn" else lm_shapes()
    detail = args.model == "lm30m"
    repeats = args.repeats or (3 if args.quick else 10)
    only = set(args.only.split(","))
    results = {
        "loop": loop_name,
        "cpus": os.cpu_count(),
        "load_average": os.getloadavg()[0],
        "header": HEADER_SIZE,
    }
    print(
        f"loop {loop_name}, {results['cpus']} cpus, load average "
        f"{results['load_average']:.2f} (ratios are against baselines timed "
        "alongside)"
    )
    with tempfile.TemporaryDirectory() as d:
        workdir = pathlib.Path(d)
        if "big" in only:
            results["big"] = bench_big(
                big_shapes, workdir, loop_name, repeats, args.link_rate, detail
            )
            _show("big", results["big"])
        if "big_bsp" in only:
            results["big_bsp"] = bench_big_bsp(
                big_shapes, workdir, loop_name, repeats, args.link_rate
            )
            _show("big_bsp", results["big_bsp"])
        if "small" in only:
            results["small"] = bench_small(
                workdir, loop_name, 200 if args.quick else 2000
            )
            _show("small", results["small"])
        if "fan_in" in only:
            results["fan_in"] = bench_fan_in(
                cnn_shapes(2**20),
                workdir,
                loop_name,
                1.0 if args.quick else 5.0,
                32,
            )
            _show("fan_in", results["fan_in"])
        if "compressed" in only:
            results["compressed"] = bench_compressed(
                big_shapes, workdir, loop_name, repeats
            )
            _show("compressed", results["compressed"])
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(results, indent=2))


def _show(name, result):
    print(f"[{name}]")
    for k, v in result.items():
        text = f"{v:.4g}" if isinstance(v, float) else str(v)
        print(f"  {k:24s} {text}")
    sys.stdout.flush()


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        main()
