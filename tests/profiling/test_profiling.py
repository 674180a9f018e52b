"""Tests of the profiling pass: real step timings, memory, transfer, devices."""

import asyncio
import itertools
import json
import math
import os
import socketserver
import struct
import subprocess
import sys
import textwrap
import threading

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from hpsjax.profiling import (
    Link,
    TransferProfile,
    WorkerProfile,
    measure_transfer,
    multi_device_grad,
    plan,
    profile,
    tree_wire_nbytes,
)
from hpsjax.profiling import _profile as profile_module
from hpsjax.transforms._quantize import Codec

TIMEOUT = 20.0


def _mlp_init(seed, sizes=(784, 256, 256, 10)):
    rng = np.random.default_rng(seed)
    return [
        {
            "w": jnp.asarray(rng.normal(size=(m, n)) * m**-0.5, jnp.float32),
            "b": jnp.zeros(n),
        }
        for m, n in itertools.pairwise(sizes)
    ]


def _mlp_apply(params, x):
    for layer in params[:-1]:
        x = jax.nn.relu(x @ layer["w"] + layer["b"])
    return x @ params[-1]["w"] + params[-1]["b"]


_OPT = optax.sgd(0.1)


def _train_step(state, batch):
    params, opt_state = state
    x, y = batch

    def loss(p):
        logits = _mlp_apply(p, x)
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

    grads = jax.grad(loss)(params)
    updates, opt_state = _OPT.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state


def _make_batch(b):
    x = np.random.default_rng(b).normal(size=(b, 784)).astype(np.float32)
    return jnp.asarray(x), jnp.arange(b, dtype=jnp.int32) % 10


@pytest.fixture(scope="module")
def mlp_state():
    params = _mlp_init(0)
    return params, _OPT.init(params)


# --- the compute profile ---------------------------------------------------------


def test_real_profile_of_an_mlp_step(mlp_state):
    prof = profile(
        _train_step,
        mlp_state,
        _make_batch,
        batch_sizes=(1024, 8),
        repeats=5,
        worker_id="cpu-worker",
    )
    assert len(prof.devices) == len(jax.local_devices())
    d = prof.devices[0]
    device = jax.local_devices()[0]
    assert d.platform == device.platform and d.batch_sizes == (8, 1024)
    # 128x the samples: robustly slower even on a busy machine
    assert d.step_times[1] > d.step_times[0]
    assert d.time_fit.slope > 0
    assert d.throughput(1024) > 0 and d.step_time(1024) >= d.step_time(8)
    # CPU devices keep no memory statistics: the compiled step's buffers count.
    # A GPU's count its high-water mark, unless an earlier test set it higher.
    stats = device.memory_stats() or {}
    sources = ("device", "compiled") if "peak_bytes_in_use" in stats else ("compiled",)
    assert d.memory_source in sources
    assert d.peak_memory[1] > d.peak_memory[0]
    # at least the 1024 x 784 float32 inputs
    assert d.peak_memory[1] >= 1024 * 784 * 4
    assert d.memory_fit.slope > 0
    # The device's capacity where its backend reports one (CPUs do not).
    assert d.memory_capacity == (stats.get("bytes_limit") or None)
    assert (d.max_batch() is None) == (d.memory_capacity is None)
    n = 784 * 256 + 256 + 256 * 256 + 256 + 256 * 10 + 10
    assert (prof.param_count, prof.param_bytes) == (n, 4 * n)
    assert prof.transfer is None and prof.transfer_seconds == 0.0
    assert 0 < prof.compile_seconds < prof.profile_seconds
    assert WorkerProfile.from_json(prof.to_json()) == prof


def test_profile_memory_capacity_caps_the_plan(mlp_state):
    params = mlp_state[0]

    def step(p, x):
        return _mlp_apply(p, x).sum()

    def measure(capacity):
        return profile(
            step,
            params,
            lambda b: jnp.ones((b, 784)),
            batch_sizes=(16, 256),
            repeats=1,
            memory_capacity=capacity,
        )

    # The fixed part of the bytes depends on how the platform counts them
    # (on a GPU, everything else this process holds): the capacity given
    # leaves room for about 100 samples over it.
    fit = measure(None).devices[0].memory_fit
    capacity = math.floor(fit(100.5))
    prof = measure(capacity)
    d = prof.devices[0]
    assert d.memory_capacity == capacity  # the argument, over any bytes_limit
    cap = d.max_batch(memory_fraction=1.0)
    fit = d.memory_fit
    assert cap > 16 and fit(cap) <= capacity * (1 + 1e-12) < fit(cap + 1)
    p = plan([prof], global_batch=cap, memory_fraction=1.0)
    assert p.workers[0].batch_size == cap
    with pytest.raises(ValueError, match="does not fit the devices' memory"):
        plan([prof], global_batch=cap + 1, memory_fraction=1.0)


def test_profile_bad_arguments_run_nothing(mlp_state):
    traced = []

    def step(state, batch):
        traced.append(1)
        return _train_step(state, batch)

    cases = [
        ({"batch_sizes": ()}, "distinct and non-empty"),
        ({"batch_sizes": (8, 8)}, "distinct and non-empty"),
        ({"batch_sizes": (0, 8)}, "batch size must be an int >= 1"),
        ({"batch_sizes": (8.5,)}, "batch size must be an int >= 1"),
        ({"repeats": 0}, "repeats must be an int >= 1"),
        ({"warmup": -1}, "warmup must be a non-negative int"),
        ({"time_budget": 0.0}, "time_budget must be a finite number > 0"),
        ({"devices": []}, "devices is empty"),
        ({"transfer": 1e9}, "transfer must be None, a Link"),
        ({"worker_id": 1.5}, "worker_id must be an int or a str"),
        ({"memory_capacity": 0}, "memory_capacity must be an int >= 1"),
    ]
    for kwargs, message in cases:
        with pytest.raises(ValueError, match=message):
            profile(step, mlp_state, _make_batch, **kwargs)
    with pytest.raises(ValueError, match="must be callable"):
        profile(step, mlp_state, None)
    assert traced == []


def test_compiled_memory_unavailable_is_none():
    class NoAnalysis:
        def memory_analysis(self):
            return None

    class Unsupported:
        def memory_analysis(self):
            raise NotImplementedError

    assert profile_module._compiled_peak_bytes(NoAnalysis()) is None
    assert profile_module._compiled_peak_bytes(Unsupported()) is None


# --- transfer --------------------------------------------------------------------


def test_link_estimate(mlp_state):
    params = mlp_state[0]
    nbytes = tree_wire_nbytes(params)
    prof = profile(
        lambda p, x: _mlp_apply(p, x).sum(),
        params,
        lambda b: jnp.ones((b, 784)),
        batch_sizes=(4,),
        repeats=1,
        transfer=Link(bandwidth=1e8, latency=0.002),
    )
    t = prof.transfer
    assert (t.method, t.push_bytes, t.pull_bytes) == ("estimated", nbytes, nbytes)
    assert t.push_seconds == pytest.approx(0.002 + nbytes / 1e8)
    assert t.round_trip_seconds == pytest.approx(2 * (0.002 + nbytes / 1e8))
    assert prof.transfer_seconds == t.round_trip_seconds
    with pytest.raises(ValueError, match="bandwidth must be a finite number > 0"):
        Link(bandwidth=0.0)
    with pytest.raises(ValueError, match="latency must be >= 0"):
        Link(bandwidth=1.0, latency=-1.0)


def test_wire_bytes_follow_the_codec():
    tree = {"a": np.zeros((4, 8), np.float32), "b": np.zeros(3, np.float32)}
    assert tree_wire_nbytes(tree) == 4 * 35
    # 8 bits: one byte per value and one float32 scale per leaf
    assert tree_wire_nbytes(tree, Codec("uniform", 8)) == (32 + 4) + (3 + 4)
    # 1 bit: values packed 8 to a byte
    assert tree_wire_nbytes(tree, Codec("sign")) == (4 + 4) + (1 + 4)
    # PowerSGD rank 1: the 4 x 8 leaf as 4 + 8 factor values, the vector whole
    assert tree_wire_nbytes(tree, powersgd_rank=1) == 4 * (12 + 3)
    with pytest.raises(ValueError, match="not both"):
        tree_wire_nbytes(tree, Codec("sign"), powersgd_rank=1)
    prof = profile(
        lambda p, x: (x @ p["a"]).sum(),
        {"a": jnp.ones((4, 8))},
        lambda b: jnp.ones((b, 4)),
        batch_sizes=(2,),
        repeats=1,
        transfer=Link(bandwidth=1000.0),
        codec=Codec("uniform", 8),
    )
    assert (prof.transfer.push_bytes, prof.transfer.pull_bytes) == (36, 128)
    assert prof.transfer.push_seconds == pytest.approx(0.036)


def _recv_exactly(sock, n):
    data = bytearray()
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            raise ConnectionError("closed")
        data += chunk
    return bytes(data)


class _EchoHandler(socketserver.BaseRequestHandler):
    """Answers each length-prefixed message with as many bytes back."""

    def handle(self):
        while True:
            try:
                (n,) = struct.unpack("!Q", _recv_exactly(self.request, 8))
                _recv_exactly(self.request, n)
            except ConnectionError:
                return
            self.request.sendall(struct.pack("!Q", 4) + b"\0\0\0\7")


@pytest.fixture
def echo_server():
    server = socketserver.ThreadingTCPServer(("127.0.0.1", 0), _EchoHandler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server.server_address
    server.shutdown()
    server.server_close()
    thread.join(TIMEOUT)


class _LoopbackClient:
    """A client with the parameter-server client's pull/push interface."""

    def __init__(self, address):
        self.address = address
        self.reader = self.writer = None
        self.versions = []

    @property
    def closed(self):
        return self.writer is None

    async def connect(self):
        self.reader, self.writer = await asyncio.wait_for(
            asyncio.open_connection(*self.address), TIMEOUT
        )

    async def close(self):
        self.writer.close()
        await self.writer.wait_closed()
        self.reader = self.writer = None

    async def _send(self, payload):
        self.writer.write(struct.pack("!Q", len(payload)) + payload)
        await self.writer.drain()
        (n,) = struct.unpack("!Q", await self.reader.readexactly(8))
        return await self.reader.readexactly(n)

    async def pull(self):
        reply = await self._send(b"pull")
        return None, int.from_bytes(reply, "big")

    async def push(self, update, *, version, codec=None):
        del codec
        self.versions.append(version)
        await self._send(
            b"".join(np.asarray(x).tobytes() for x in jax.tree.leaves(update))
        )


def test_measure_transfer_with_an_async_round_trip(echo_server):
    params = {"w": np.ones((64, 64), np.float32)}
    sent = []

    async def main():
        reader, writer = await asyncio.open_connection(*echo_server)

        async def round_trip(update):
            payload = np.asarray(update["w"]).tobytes()
            sent.append(len(payload))
            writer.write(struct.pack("!Q", len(payload)) + payload)
            await writer.drain()
            (n,) = struct.unpack("!Q", await reader.readexactly(8))
            await reader.readexactly(n)

        try:
            return await asyncio.wait_for(
                measure_transfer(round_trip, params, repeats=3, warmup=1), TIMEOUT
            )
        finally:
            writer.close()
            await writer.wait_closed()

    t = asyncio.run(main())
    assert sent == [64 * 64 * 4] * 4
    assert t.method == "measured" and t.round_trip_seconds > 0
    assert t.push_seconds is None and t.pull_seconds is None
    assert t.push_bytes == t.pull_bytes == 64 * 64 * 4


def test_profile_measures_an_unconnected_client(echo_server):
    params = {"w": jnp.ones((8, 8))}
    client = _LoopbackClient(echo_server)
    prof = profile(
        lambda p, x: (x @ p["w"]).sum(),
        params,
        lambda b: jnp.ones((b, 8)),
        batch_sizes=(4,),
        repeats=1,
        transfer=client,
    )
    t = prof.transfer
    assert t.method == "measured"
    assert t.push_seconds > 0 and t.pull_seconds > 0
    assert t.round_trip_seconds >= t.push_seconds
    # one warm-up and three timed trips, each pushing at the pulled version 7
    assert client.versions == [7] * 4
    assert client.closed


def test_profile_refuses_what_it_cannot_measure(echo_server):
    params = {"w": jnp.ones((8, 8))}
    args = (lambda p, x: (x @ p["w"]).sum(), params, lambda b: jnp.ones((b, 8)))

    async def inside_a_loop():
        async def round_trip(update):
            del update

        with pytest.raises(ValueError, match="inside a running event loop"):
            profile(*args, transfer=round_trip)
        client = _LoopbackClient(echo_server)
        await client.connect()
        try:
            t = await measure_transfer(client, params, repeats=1, warmup=0)
        finally:
            await client.close()
        return client, t

    client, t = asyncio.run(inside_a_loop())
    assert t.method == "measured" and client.versions == [7]
    client.writer = object()  # stands for a connection opened on another loop
    with pytest.raises(ValueError, match="only be measured on its own event loop"):
        profile(*args, transfer=client)


def test_measure_transfer_against_the_parameter_server():
    ps = pytest.importorskip("hpsjax.ps")
    if not (hasattr(ps, "Server") and hasattr(ps, "Client")):
        pytest.skip("hpsjax.ps does not export Server and Client")
    params = {"w": np.ones((32, 32), np.float32)}

    async def main():
        async with ps.Server(params, optax.sgd(0.1), "asp", secret="s") as server:
            client = ps.Client(
                "127.0.0.1", server.port, worker_id="w0", secret="s", timeout=TIMEOUT
            )
            t = await asyncio.wait_for(measure_transfer(client, params), TIMEOUT)
            return t, np.asarray(server.params["w"])

    t, after = asyncio.run(main())
    assert t.method == "measured" and t.push_seconds > 0 and t.pull_seconds > 0
    np.testing.assert_array_equal(after, params["w"])


# --- several devices -------------------------------------------------------------


def _per_sample_loss(params, batch):
    x, y = batch
    h = jnp.tanh(x @ params["w1"] + params["b1"])
    return jnp.sum((h @ params["w2"] - y) ** 2, axis=-1)


def test_multi_device_grad_weights_by_batch_size_on_one_device():
    rng = np.random.default_rng(3)
    params = {
        "w1": jnp.asarray(rng.normal(size=(6, 16)), jnp.float32),
        "b1": jnp.zeros(16),
        "w2": jnp.asarray(rng.normal(size=(16, 2)), jnp.float32),
    }
    x = jnp.asarray(rng.normal(size=(23, 6)), jnp.float32)
    y = jnp.asarray(rng.normal(size=(23, 2)), jnp.float32)
    batches = [(x[:3], y[:3]), (x[3:], y[3:])]
    device = jax.local_devices()[0]
    mean_grad = jax.jit(jax.value_and_grad(lambda p, b: _per_sample_loss(p, b).mean()))
    # Both sides at full float32 precision: at an accelerator's default (TF32 or
    # bfloat16 passes) two groupings of the same sum differ by far more than 1e-5.
    with jax.default_matmul_precision("highest"):
        loss, grads = multi_device_grad(_per_sample_loss, params, batches, [device] * 2)
        want_loss, want = mean_grad(params, (x, y))
    assert loss == pytest.approx(float(want_loss), rel=1e-5)
    for k in params:
        np.testing.assert_allclose(grads[k], want[k], rtol=1e-5, atol=1e-6)
    # the unweighted mean of per-device means is a different, wrong gradient
    naive = jax.tree.map(
        lambda *g: sum(g) / 2, *(mean_grad(params, b)[1] for b in batches)
    )
    assert not np.allclose(naive["w2"], want["w2"], rtol=1e-3)


def test_multi_device_grad_bad_input():
    params = {"w": jnp.ones(3)}
    x = jnp.ones((4, 3))
    per_sample = lambda p, b: b @ p["w"]
    with pytest.raises(ValueError, match="per_device_batches is empty"):
        multi_device_grad(per_sample, params, [])
    with pytest.raises(ValueError, match="local devices"):
        multi_device_grad(per_sample, params, [x] * (len(jax.local_devices()) + 1))
    with pytest.raises(ValueError, match="2 batches for 1 devices"):
        multi_device_grad(per_sample, params, [x, x], jax.local_devices()[:1])
    with pytest.raises(ValueError, match="one loss per sample"):
        multi_device_grad(lambda p, b: (b @ p["w"]).mean(), params, [x])
    with pytest.raises(ValueError, match="all per-device batches are empty"):
        multi_device_grad(per_sample, params, [x[:0]])


_MULTI_DEVICE_SCRIPT = textwrap.dedent(
    """
    import json
    import jax, jax.numpy as jnp, numpy as np
    from hpsjax.profiling import multi_device_grad, plan, profile

    def per_sample(params, batch):
        x, y = batch
        h = jnp.tanh(x @ params["w1"] + params["b1"])
        return jnp.sum((h @ params["w2"] - y) ** 2, axis=-1)

    devices = jax.local_devices()
    rng = np.random.default_rng(0)
    f32 = lambda *shape: jnp.asarray(rng.normal(size=shape), jnp.float32)
    params = {"w1": f32(6, 16), "b1": jnp.zeros(16), "w2": f32(16, 2)}
    sizes = [5, 17, 42][: len(devices)]
    x, y = f32(sum(sizes), 6), f32(sum(sizes), 2)
    cuts = np.cumsum([0] + sizes)
    batches = [(x[a:b], y[a:b]) for a, b in zip(cuts[:-1], cuts[1:])]
    loss, grads = multi_device_grad(per_sample, params, batches, devices)
    want_loss, want = jax.jit(jax.value_and_grad(
        lambda p: per_sample(p, (x, y)).mean()))(params)
    # error relative to the leaf's largest entry: float32 sums in another order
    errors = {
        k: float(np.max(np.abs(np.asarray(grads[k]) - np.asarray(want[k])))
                 / np.max(np.abs(np.asarray(want[k]))))
        for k in params
    }

    def step(p, batch):
        return jax.tree.map(lambda w, g: w - 0.1 * g, p,
                            jax.grad(lambda p: per_sample(p, batch).mean())(p))

    prof = profile(step, params,
                   lambda b: (jnp.ones((b, 6)), jnp.ones((b, 2))),
                   batch_sizes=(4, 64), repeats=2)
    work_plan = plan([prof], global_batch=90)
    print(json.dumps({
        "devices": [d.id for d in devices],
        "grad_devices": sorted(d.id for d in grads["w1"].devices()),
        "loss": [float(loss), float(want_loss)],
        "errors": errors,
        "profile": prof.to_json(),
        "device_batches": [d.batch_size for d in work_plan.workers[0].devices],
    }))
    """
)


@pytest.mark.parametrize("n_devices", [2, 3])
def test_several_cpu_devices_in_a_subprocess(n_devices):
    env = {
        **os.environ,
        "XLA_FLAGS": f"--xla_force_host_platform_device_count={n_devices}",
        "JAX_PLATFORMS": "cpu",
    }
    done = subprocess.run(
        [sys.executable, "-c", _MULTI_DEVICE_SCRIPT],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["devices"] == list(range(n_devices))
    assert out["grad_devices"] == [0]
    assert out["loss"][0] == pytest.approx(out["loss"][1], rel=1e-5)
    assert max(out["errors"].values()) < 1e-5, out["errors"]
    prof = WorkerProfile.from_json(out["profile"])
    assert [d.device_id for d in prof.devices] == list(range(n_devices))
    assert all(d.batch_sizes == (4, 64) for d in prof.devices)
    assert sum(out["device_batches"]) == 90 and min(out["device_batches"]) >= 1


def test_transfer_profile_checks():
    with pytest.raises(ValueError, match="method must be one of"):
        TransferProfile(1.0, None, None, 0, 0, "guessed")
    with pytest.raises(ValueError, match="round_trip_seconds must be >= 0"):
        TransferProfile(-1.0, None, None, 0, 0, "measured")
    with pytest.raises(ValueError, match="push_bytes must be a non-negative int"):
        TransferProfile(1.0, None, None, -1, 0, "measured")
