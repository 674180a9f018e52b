"""The ``hpsjax-worker`` command line: joining a server, one-line errors."""

import asyncio
import shutil
import socket
import ssl
import subprocess
import sys

import jax
import jax.numpy as jnp
import optax
import pytest

from hpsjax import models, ps
from hpsjax.cli import worker as worker_cli
from hpsjax.profiling import in_place
from hpsjax.ps import _cli as server_cli
from hpsjax.worker import _build as worker_build
from tests.wire.e2e.test_powersgd_wire import _promised, _RecordingClient

SMALL = ["--dataset_arg", "num_examples=64"]
MAIN = "import sys; from hpsjax.cli.worker import main; sys.exit(main())"


def _args(*argv: str, port: int = 1):
    """The worker's flags as worker 0 (``--worker_id`` unless ``argv`` has one)."""
    given = [] if "--worker_id" in argv else ["--worker_id", "0"]
    return worker_cli.parse_args([*SMALL, "--port", str(port), *given, *argv])


def _server_params(tmp_path, *argv: str):
    """The parameters ``hpsjax-server --init`` serves for these model flags."""
    path = tmp_path / "init.npz"
    worker_cli.write_init(worker_cli.parse_args([*SMALL, *argv]), path)
    return server_cli.load_npz_tree(path)


async def _join(server_params, args, **server_kw):
    """Joins a worker of ``args`` to a server of ``server_params``."""
    _, _, params, _ = worker_build.build(args)
    server_kw.setdefault("secret", None)
    async with ps.Server(server_params, optax.sgd(0.1), "asp", **server_kw) as s:
        client = worker_build.make_client(args, (args.host, s.port))
        try:
            await worker_cli.connect(client, params, connect_timeout=2, where="here")
        finally:
            await client.close()


def test_the_same_model_joins(tmp_path):
    server = _server_params(tmp_path, "--model_arg", "hidden=[32]")
    asyncio.run(_join(server, _args("--model_arg", "hidden=[32]")))


def test_a_training_worker_builds_its_model_for_shapes_only(monkeypatch):
    # Its values come from the server: the initializers run no program.
    args = _args("--model_arg", "hidden=[32]")
    train = worker_build.train_shard(args, None, 0, 1)
    graphdef, params, stats = worker_build.model_structure(args, train)
    assert stats is None
    assert all(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(params))
    # The same structure, shapes and dtypes as the model built for real.
    real_graphdef, real, _ = models.split_trainable(
        worker_build.make_model(args, train)
    )
    assert graphdef == real_graphdef
    assert jax.tree.map(lambda x: (x.shape, x.dtype), params) == jax.tree.map(
        lambda x: (x.shape, x.dtype), real
    )
    # A model with batch statistics is built for real: they start from its values.
    args = _args("--model", "resnet", "--dataset_arg", "image_size=8")
    train = worker_build.train_shard(args, None, 0, 1)
    _, params, stats = worker_build.model_structure(args, train)
    assert stats is not None
    assert all(isinstance(x, jax.Array) for x in jax.tree.leaves((params, stats)))
    # So is one whose factory looks at a value.
    monkeypatch.setattr(
        worker_build, "make_model",
        lambda args, train: float(jnp.ones(())) and models.get_model(
            "mlp", input_shape=train.input_shape, num_classes=10, hidden=(4,)
        ),
    )  # fmt: skip
    _, params, _ = worker_build.model_structure(_args(), train)
    assert all(isinstance(x, jax.Array) for x in jax.tree.leaves(params))


@pytest.mark.parametrize(
    "server_flags,worker_flags,match",
    [
        (
            ["--model_arg", "hidden=[256,256]"],
            ["--model_arg", "hidden=[128,128]"],
            r"at 'layers/0/bias': the worker has float32\[128\], "
            r"the server has float32\[256\]",
        ),
        (
            ["--dataset_arg", "image_size=28"],
            ["--dataset_arg", "image_size=8"],
            r"at 'layers/0/kernel': the worker has float32\[64, 64\], "
            r"the server has float32\[784, 64\]",
        ),
        (
            ["--model", "mlp"],
            ["--model", "cnn"],
            r"at 'conv1/bias': the worker has float32\[16\], the server has nothing",
        ),
    ],
)
def test_another_model_is_refused_naming_the_first_differing_leaf(
    tmp_path, server_flags, worker_flags, match
):
    server = _server_params(tmp_path, *server_flags)
    with pytest.raises(worker_cli.JoinError, match=match) as e:
        asyncio.run(_join(server, _args(*worker_flags)))
    assert "\n" not in str(e.value) and "does not match the server's at" in str(e.value)


def test_a_wrong_secret_is_one_line(tmp_path):
    (tmp_path / "secret").write_text("wrong")
    server = _server_params(tmp_path)
    args = _args("--secret_file", str(tmp_path / "secret"))
    with pytest.raises(worker_cli.JoinError, match="refused the secret"):
        asyncio.run(_join(server, args, secret=b"right"))
    with pytest.raises(worker_cli.JoinError, match="--secret_file"):
        asyncio.run(_join(server, _args(), secret=b"right"))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_server_that_is_not_up_is_retried_then_one_line():
    port = _free_port()
    proc = subprocess.run(
        [sys.executable, "-c", MAIN, *SMALL, "--port", str(port),
         "--connect_timeout", "0.5"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert proc.returncode == 1
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert (
        f"no server answered at 127.0.0.1:{port} within --connect_timeout=0.5s"
        in (lines[0])
    )


def test_server_hostname_reaches_a_single_server(tmp_path):
    """TLS to 127.0.0.1 with a certificate for another name (LAUNCH.md's recipe)."""
    if shutil.which("openssl") is None:
        pytest.skip("openssl is not installed")
    cert, key = tmp_path / "server.pem", tmp_path / "key.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
         "-keyout", str(key), "-out", str(cert), "-subj", "/CN=hostA",
         "-addext", "subjectAltName=DNS:hostA"],
        check=True, capture_output=True,
    )  # fmt: skip
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(cert, key)
    server = _server_params(tmp_path)
    args = _args("--cafile", str(cert), "--server_hostname", "hostA")
    asyncio.run(_join(server, args, ssl=context))
    # Without the name, the certificate is checked for 127.0.0.1 and refused.
    with pytest.raises(worker_cli.JoinError, match=r"not valid for '127\.0\.0\.1'"):
        asyncio.run(_join(server, _args("--cafile", str(cert)), ssl=context))


def test_flag_mistakes_are_one_line(tmp_path, capsys):
    with pytest.raises(SystemExit):
        worker_cli.parse_args(["--model_arg", "hidden=128,128"])
    assert "hidden=[128,128]" in capsys.readouterr().err
    init = str(tmp_path / "init.npz")
    code = worker_cli.main([*SMALL, "--model_arg", "hiden=[8]", "--write_init", init])
    err = capsys.readouterr().err
    assert code == 2
    assert err.strip() == (
        "hpsjax-worker: --model_arg hiden: model 'mlp' has no such argument; "
        "valid names: hidden"
    )
    code = worker_cli.main(["--dataset_arg", "size=8", "--write_init", init])
    assert code == 2 and "--dataset_arg size:" in capsys.readouterr().err


def test_write_init_and_profile_out_say_where_they_wrote(tmp_path, capsys):
    init, profile = tmp_path / "init.npz", tmp_path / "profile.json"
    small = [*SMALL, "--model_arg", "hidden=[8]"]
    assert worker_cli.main([*small, "--write_init", str(init)]) == 0
    assert capsys.readouterr().out.strip() == (
        f"hpsjax-worker: wrote the initial parameters to {init}"
    )
    argv = [*small, "--profile_out", str(profile), "--profile_batch_sizes", "2,4",
            "--profile_repeats", "2"]  # fmt: skip
    assert worker_cli.main(argv) == 0
    assert f"wrote the profile to {profile}" in capsys.readouterr().out
    assert init.exists() and profile.exists()


class _ServerThread:
    """A :class:`hpsjax.ps.Server` on its own event loop in a thread."""

    def __init__(self, params, policy="asp"):
        import threading

        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._params, self._policy = params, policy
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        asyncio.set_event_loop(self._loop)
        self._loop.run_until_complete(self._serve())

    async def _serve(self):
        self._stop = asyncio.Event()
        async with ps.Server(
            self._params, optax.sgd(0.1), self._policy, secret=None
        ) as server:
            self.server = server
            self._ready.set()
            await self._stop.wait()

    def __enter__(self):
        self._thread.start()
        assert self._ready.wait(30)
        return self.server

    def __exit__(self, *exc):
        self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(30)
        self._loop.close()


@pytest.mark.slow
def test_metrics_go_to_json_lines_and_tensorboard_with_evals(tmp_path, capsys):
    from hpsjax.metrics import read_jsonl, read_tensorboard

    model = ["--model_arg", "hidden=[16]"]
    metrics = tmp_path / "w0.jsonl"
    with _ServerThread(_server_params(tmp_path, *model)) as server:
        code = worker_cli.main(
            [*SMALL, *model, "--port", str(server.port), "--max_steps", "6",
             "--batch_size", "8", "--metrics", str(metrics), "--eval_every",
             "0.01", "--eval_batch_size", "5", "--loop", "asyncio",
             "--log_level", "WARNING"]
        )  # fmt: skip
        final_version = server.version
    assert code == 0
    out = capsys.readouterr().out
    assert "hpsjax-worker eval: version" in out
    records = read_jsonl(metrics)
    rounds = [r for r in records if r["event"] == "round"]
    evals = [r for r in records if r["event"] == "eval"]
    assert len(rounds) == 6
    # The last parameters pulled: the final push is not followed by a pull.
    assert evals and rounds[-1]["version"] <= evals[-1]["version"] < final_version
    for record in evals:
        assert 0 <= record["accuracy"] <= 1 and record["loss"] > 0
        assert record["examples"] == 13  # 20% of 64, held out, not sharded
        assert record["worker"] == 0
    assert len({r["version"] for r in evals}) == len(evals)
    scalars = read_tensorboard(tmp_path / "tensorboard")["worker0"]
    assert [s for s, _ in scalars["round/loss"]] == list(range(6))
    assert [v for _, v in scalars["round/loss"]] == pytest.approx(
        [r["loss"] for r in rounds]
    )
    assert [v for _, v in scalars["eval/accuracy"]] == pytest.approx(
        [r["accuracy"] for r in evals]
    )


def test_tensorboard_dir_none_writes_json_lines_only(tmp_path):
    args = _args("--metrics", str(tmp_path / "m.jsonl"), "--tensorboard_dir", "none")
    sink = worker_cli._metrics_sink(args)
    sink({"event": "round", "worker": 0, "step": 0, "loss": 1.0})
    sink.close()
    assert (tmp_path / "m.jsonl").read_text().count("\n") == 1
    assert not (tmp_path / "tensorboard").exists()
    with pytest.raises(ValueError, match="--eval_every must be > 0"):
        worker_build.build(_args("--eval_every", "0"))


@pytest.mark.slow
def test_two_workers_train_a_resnet_keeping_batch_stats_to_themselves(tmp_path):
    import jax
    import numpy as np

    from hpsjax import models
    from hpsjax.metrics import read_jsonl

    data = ["--dataset_arg", "num_examples=256"]
    widths = ["--model_arg", "widths=[8,16]"]
    server_params = server_cli.initial_params(
        "resnet", dataset="synthetic_digits", dataset_args={"num_examples": 256},
        model_args={"widths": [8, 16]},
    )  # fmt: skip
    model = models.get_model(
        "resnet", input_shape=(8, 8, 1), num_classes=10, widths=(8, 16)
    )
    _, params, stats = models.split_with_batch_stats(model)
    paths = worker_build.leaf_specs
    assert set(paths(server_params)) == set(paths(worker_build.server_tree(params)))
    assert not set(paths(server_params)) & set(paths(worker_build.server_tree(stats)))

    async def train(port):
        runs = []
        for worker_id in ("0", "1"):
            args = worker_cli.parse_args(
                [*data, *widths, "--model", "resnet", "--port", str(port),
                 "--worker_id", worker_id, "--shard_count", "2", "--max_steps",
                 "25", "--batch_size", "16", "--eval_every", "30",
                 "--metrics", str(tmp_path / f"w{worker_id}.jsonl"),
                 "--tensorboard_dir", "none", "--log_level", "WARNING"]
            )  # fmt: skip
            sink = worker_cli._metrics_sink(args)
            worker, client, params, graphdef = worker_build.build(args, metrics=sink)
            evaluator = worker_cli.Evaluator(args, graphdef, lambda w=worker: w.state)
            runs.append((worker, client, params, args, evaluator, sink))
        await asyncio.gather(*(worker_cli._serve(*run) for run in runs))
        for *_, sink in runs:
            sink.close()
        return [run[0] for run in runs]

    with _ServerThread(server_params) as server:
        workers = asyncio.run(train(server.port))
        served = server.params
    # The server holds the trainable parameters only, and they moved.
    assert set(paths(served)) == set(paths(server_params))
    moved = jax.tree.map(lambda a, b: float(np.abs(np.asarray(a) - b).max()),
                         served, server_params)  # fmt: skip
    assert max(jax.tree.leaves(moved)) > 0
    for worker_id, worker in zip("01", workers, strict=True):
        # Each worker's own statistics were updated as it trained.
        assert jax.tree.structure(worker.state) == jax.tree.structure(stats)
        mine, initial = jax.tree.leaves(worker.state), jax.tree.leaves(stats)
        assert not all(np.allclose(a, b) for a, b in zip(mine, initial, strict=True))
        records = read_jsonl(tmp_path / f"w{worker_id}.jsonl")
        losses = [r["loss"] for r in records if r["event"] == "round"]
        assert len(losses) == 25
        assert np.mean(losses[-5:]) < np.mean(losses[:5])
        evals = [r for r in records if r["event"] == "eval"]
        assert evals and 0 <= evals[-1]["accuracy"] <= 1


@pytest.mark.parametrize(
    ("argv", "pull_with_push"), [((), True), (("--no_pull_with_push",), False)]
)
def test_pull_with_push_is_the_default_and_can_be_turned_off(argv, pull_with_push):
    worker, _, _, _ = worker_build.build(_args(*argv))
    assert worker.config.pull_with_push is pull_with_push
    assert worker.config.overlap is None  # the server's policy's


@pytest.mark.parametrize(
    ("argv", "overlap", "eager_pulls"),
    [
        ((), None, 1),
        (("--overlap", "pipeline"), "pipeline", 1),
        (("--overlap", "none"), "none", 1),
        (("--overlap", "eager", "--eager_pulls", "3"), "eager", 3),
    ],
)
def test_overlap_flag_reaches_the_worker(argv, overlap, eager_pulls):
    worker, _, _, _ = worker_build.build(_args(*argv))
    assert worker.config.overlap == overlap
    assert worker.config.eager_pulls == eager_pulls


def test_eager_pulls_without_eager_overlap_is_one_line(capsys):
    argv = [*SMALL, "--port", "1", "--eager_pulls", "3"]
    assert worker_cli.main(argv) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines == ["hpsjax-worker: --eager_pulls needs --overlap eager"]


def test_an_unknown_overlap_is_one_line_naming_the_modes(capsys):
    with pytest.raises(SystemExit):
        worker_cli.parse_args([*SMALL, "--overlap", "sideways"])
    lines = capsys.readouterr().err.strip().splitlines()
    assert "invalid choice: 'sideways'" in lines[-1]
    assert "'none', 'pipeline', 'eager'" in lines[-1]


@pytest.mark.parametrize(
    "argv,message",
    [
        (
            ["--port", "1", "--bits", "8", "--powersgd_rank", "2"],
            "give bits or powersgd_rank, not both",
        ),
        (
            ["--servers", "127.0.0.1:1,127.0.0.1:2", "--split_leaves",
             "--powersgd_rank", "2"],
            "--powersgd_rank encodes whole arrays, but with --split_leaves the "
            "shards cut some by rows: drop one of the two",
        ),
        (
            ["--servers", "127.0.0.1:1,127.0.0.1:2", "--split_leaves", "--bits", "8"],
            "--bits encodes whole arrays, but with --split_leaves the shards cut "
            "some by rows: drop one of the two",
        ),
        (["--port", "1", "--powersgd_rank", "0"], "--powersgd_rank must be"),
        (
            ["--servers", "127.0.0.1:1,127.0.0.1:2", "--split_leaves",
             "--work_plan", "{plan}", "--compress_from_stage", "1",
             "--worker_id", "0"],
            "--compress_from_stage encodes whole arrays, but with --split_leaves "
            "the shards cut some by rows: drop one of the two",
        ),
    ],
)  # fmt: skip
def test_encoded_push_mistakes_are_one_line(argv, message, capsys, tmp_path):
    if "{plan}" in argv:
        from hpsjax.profiling import WorkerProfile, plan

        path = tmp_path / "plan.json"
        profiles = [WorkerProfile.synthetic(i, 100.0) for i in range(2)]
        path.write_text(plan(profiles, global_batch=32).to_json())
        argv = [str(path) if a == "{plan}" else a for a in argv]
    assert worker_cli.main([*SMALL, *argv]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"hpsjax-worker: {message}")


def test_a_profile_with_powersgd_rank_counts_its_factors():
    import jax

    from hpsjax.profiling import WorkerProfile

    spec = {"b": jax.ShapeDtypeStruct((16,), "float32"),
            "w": jax.ShapeDtypeStruct((64, 16), "float32")}  # fmt: skip
    args = _args("--powersgd_rank", "2", "--bandwidth", "1e6")
    profile = in_place.with_injection(WorkerProfile.synthetic(0, 100.0), args, spec)
    assert profile.transfer.push_bytes == _promised(spec, 2) == (16 + 2 * 80) * 4
    assert profile.transfer.pull_bytes == (16 + 64 * 16) * 4


def test_a_worker_with_powersgd_rank_pushes_its_factors(tmp_path, monkeypatch):
    clients = []

    class Recording(_RecordingClient):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            clients.append(self)

    monkeypatch.setattr("hpsjax.worker._build.Client", Recording)
    model = ["--model_arg", "hidden=[16]"]
    server_params = _server_params(tmp_path, *model)
    with _ServerThread(server_params) as server:
        code = worker_cli.main(
            [*SMALL, *model, "--port", str(server.port), "--max_steps", "3",
             "--worker_id", "0",
             "--batch_size", "8", "--powersgd_rank", "2", "--overlap", "none",
             "--tensorboard_dir", "none", "--loop", "asyncio",
             "--log_level", "WARNING"]
        )  # fmt: skip
        version = server.version
    assert code == 0 and version == 3
    (client,) = clients
    promised = _promised(server_params, 2)
    # Both kernels are factors: 2 (64 + 16) < 64 * 16 and 2 (16 + 10) < 16 * 10.
    assert promised == (16 + 10 + 2 * (64 + 16) + 2 * (16 + 10)) * 4
    assert len(client.pushed) == 3
    for codec, payload, frame_bytes, on_wire in client.pushed:
        assert codec == {"scheme": "powersgd", "rank": [0, 2, 0, 2]}
        assert payload == promised
        # The rest of the frame: its header and metadata (four leaves' entries).
        assert on_wire == frame_bytes < promised + 512


def test_a_profile_is_slowed_as_the_worker_will_be():
    # The launcher's profiling pass times the bare step; the worker's injected
    # slowdown at the start multiplies the profile's step times, whatever the
    # machine's load made of the timing.
    import jax
    import numpy as np

    from hpsjax.profiling import WorkerProfile

    spec = {"w": jax.ShapeDtypeStruct((4,), "float32")}
    measured = WorkerProfile.synthetic(0, 100.0)
    plain = in_place.with_injection(measured, _args(), spec)
    slowed = in_place.with_injection(measured, _args("--slowdown", "3"), spec)
    times = [np.asarray(p.devices[0].step_times) for p in (plain, slowed)]
    np.testing.assert_allclose(times[1], 3 * times[0], rtol=1e-12)


def test_metrics_port_serves_the_rounds_to_prometheus(capsys, monkeypatch):
    import urllib.request

    from hpsjax.metrics import RoundMetrics

    served = []

    class Served(RoundMetrics):
        def serve(self, *args, **kwargs):
            served.append(self)
            return super().serve(*args, **kwargs)

    monkeypatch.setattr(worker_cli, "RoundMetrics", Served)
    sink = worker_cli._metrics_sink(_args("--metrics_port", "0"))
    try:
        url = capsys.readouterr().out.split(" on ")[1].strip()
        assert url.startswith("http://127.0.0.1:") and url.endswith("/metrics")
        sink({"event": "round", "worker": 0, "step": 0, "batch_size": 8,
              "compute_s": 0.02, "round_s": 0.05, "barrier_s": 0.01})  # fmt: skip
        with urllib.request.urlopen(url, timeout=10) as reply:
            text = reply.read().decode()
        assert 'part="compute"' in text and "round_part_seconds" in text
    finally:
        sink.close()
        served[0].stop()


def test_a_bad_metrics_port_is_one_line(capsys):
    code = worker_cli.main([*SMALL, "--port", "1", "--metrics_port", "70000"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1
    assert err.startswith("hpsjax-worker: --metrics_port must be an int")


def test_a_worker_claiming_a_live_workers_id_is_refused_in_one_line(tmp_path, capsys):
    model = ["--model_arg", "hidden=[16]"]
    thread = _ServerThread(_server_params(tmp_path, *model))
    with thread as server:

        async def join_as_0():
            first = ps.Client(
                "127.0.0.1", server.port, worker_id=0, secret=None, timeout=30
            )
            await first.connect()
            await first.pull()
            return first

        loop = thread._loop
        first = asyncio.run_coroutine_threadsafe(join_as_0(), loop).result(30)
        try:
            code = worker_cli.main(
                [*SMALL, *model, "--port", str(server.port), "--steps", "2",
                 "--worker_id", "0",
                 "--tensorboard_dir", "none", "--loop", "asyncio",
                 "--status_interval", "0", "--log_level", "WARNING"]
            )  # fmt: skip
        finally:
            asyncio.run_coroutine_threadsafe(first.close(), loop).result(30)
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 1
    assert err == [
        "hpsjax-worker: the server refused this worker: worker id 0 belongs to a "
        "live connected worker: give each worker its own --worker_id, or none "
        "(the server assigns one)"
    ]
