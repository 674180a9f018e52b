"""The server as its user lives it: where its state is, what it logs, its
metrics, how it leaves and stops."""

import asyncio
import contextlib
import logging
import re
import signal
import subprocess
import sys

import jax
import numpy as np
import optax
import pytest
from _servers import SECRET, _params, _run, _update

from hpsjax._devices import describe_device
from hpsjax.metrics import ServerMetrics, read_tensorboard
from hpsjax.models import save_params_npz
from hpsjax.net._client import Client
from hpsjax.net._server import Server
from hpsjax.ps import _cli
from hpsjax.wire._errors import NonFiniteUpdate


def _devices_of(tree):
    return {
        describe_device(d) for leaf in jax.tree.leaves(tree) for d in leaf.devices()
    }


# ------------------------------------------------------------ device


@pytest.mark.parametrize("process_default", [None, "cpu"])
def test_the_server_state_is_on_the_host_cpu_by_default(process_default):
    # With a default device set for the process, or where the process's first
    # device is not the host CPU (a GPU host), the server sets its own on every
    # entry; with neither, it need not.
    context = (
        contextlib.nullcontext()
        if process_default is None
        else jax.default_device(jax.devices(process_default)[0])
    )

    async def main():
        with context:
            server = Server(_params(), optax.sgd(0.1, momentum=0.9), secret=SECRET)
        assert server._device_is_default is (
            process_default is None and jax.devices()[0].platform == "cpu"
        )
        async with server:
            assert describe_device(server.device) == "cpu:0"
            async with Client(
                "127.0.0.1", server.port, worker_id="w", secret=SECRET
            ) as c:
                await c.pull()
                await c.push(_update(1.0), version=0)
                await c.pull()
            assert server.version == 1
            assert _devices_of(server.params) == {"cpu:0"}
            assert _devices_of(server.core.opt_state) == {"cpu:0"}

    _run(main)


def test_the_server_takes_a_device_by_name_or_object():
    cpu = jax.devices("cpu")[0]
    for device in ("cpu", "CPU:0", cpu):
        server = Server(_params(), optax.sgd(0.1), secret=SECRET, device=device)
        assert server.device == cpu
        assert _devices_of(server.params) == {"cpu:0"}


@pytest.mark.parametrize(
    "device,match",
    [
        ("nosuchplatform", r"no 'nosuchplatform' device in this process \(platforms "
         r"present: .*cpu"),
        ("cpu:x", "bad device index"),
        ("cpu:99", "asks for cpu device 99"),
        (3, "must be a platform name"),
    ],
)  # fmt: skip
def test_a_bad_device_is_one_line(device, match):
    with pytest.raises(ValueError, match=match) as info:
        Server(_params(), optax.sgd(0.1), secret=SECRET, device=device)
    assert "\n" not in str(info.value)


def test_the_command_refuses_an_unavailable_device_in_one_line(tmp_path, capsys):
    init = tmp_path / "init.npz"
    save_params_npz(init, {"w": np.zeros(3, np.float32)})
    present = {d.platform for d in jax.devices()}
    missing = next(p for p in ("tpu", "gpu", "rocm") if p not in present)
    status = _cli.main(["--init", str(init), "--device", missing, "--loop", "asyncio"])
    err = capsys.readouterr().err
    assert status == 2
    assert err.startswith(f"hpsjax-server: --device: no {missing!r} device")
    assert err.count("\n") == 1


# ------------------------------------------------------------ logs


_CRASHING_WORKER = """
import asyncio, sys
from hpsjax.net._client import Client

async def main():
    client = Client("127.0.0.1", int(sys.argv[1]), worker_id="doomed", secret=None)
    await client.connect()
    await client.pull()
    print("joined", flush=True)
    await asyncio.sleep(60)

asyncio.run(main())
"""


def _start_server(tmp_path, *flags):
    init = tmp_path / "init.npz"
    save_params_npz(init, {"w": np.zeros((4, 4), np.float32)})
    # A file, not a pipe: a full pipe would stall a server that logs much.
    log = tmp_path / "server.log"
    with open(log, "w") as stderr:
        proc = subprocess.Popen(
            [sys.executable, "-m", "hpsjax.ps._cli", "--init", str(init),
             "--loop", "asyncio", *flags],
            stdout=subprocess.PIPE,
            stderr=stderr,
            text=True,
        )  # fmt: skip
    line = proc.stdout.readline()
    assert "listening on" in line, line + log.read_text()
    return proc, int(line.rsplit(":", 1)[1]), log


def _a_short_run(tmp_path, *flags):
    """A checkpointing server through joins, a clean leave, a SIGKILLed worker,
    refused non-finite pushes and a SIGTERM: ``(stdout, stderr)``."""
    proc, port, log = _start_server(
        tmp_path,
        "--policy", "asp",
        "--checkpoint_dir", str(tmp_path / "ckpt"), "--checkpoint_every_s", "0.05",
        *flags,
    )  # fmt: skip
    crashing = subprocess.Popen(
        [sys.executable, "-c", _CRASHING_WORKER, str(port)],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert crashing.stdout.readline().strip() == "joined"

        async def main():
            async with Client("127.0.0.1", port, worker_id=0, secret=None) as c:
                _, version = await c.pull()
                for _ in range(30):
                    _, _, version = await c.push_pull(
                        {"w": np.full((4, 4), 1e-3, np.float32)}, version=version
                    )
                    await asyncio.sleep(0.01)
                for _ in range(3):
                    with pytest.raises(NonFiniteUpdate):
                        await c.push(
                            {"w": np.full((4, 4), np.nan, np.float32)},
                            version=version,
                        )
                crashing.send_signal(signal.SIGKILL)
                crashing.wait(30)
                await asyncio.sleep(0.3)  # the server notices the lost connection

        _run(main)
    finally:
        crashing.kill()
        crashing.communicate(timeout=30)
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=60)
    err = log.read_text()
    assert proc.returncode == 0, err
    return out, err


def test_a_checkpointing_servers_log_is_its_own_lines(tmp_path):
    out, err = _a_short_run(tmp_path)
    lines = err.splitlines()
    loggers = [re.match(r"\S+ \S+ (\w+) ([\w.]+): ", line) for line in lines]
    assert all(loggers), err  # every line is a log line: no traceback
    assert all(m[2].startswith("hpsjax.") for m in loggers), err
    text = "\n".join(lines)
    assert "server state on cpu:0" in text
    assert re.search(r"worker 0 joined from .* at version 0", text)
    assert "worker 'doomed' left: crashed, its connection ended without a goodbye" in (
        text
    )
    assert re.search(r"worker 0 left: done \(\d live\)", text)
    # Three refusals, one line (the next one would come 10 s later at most).
    nonfinite = re.findall(
        r"WARNING .*: worker 0 sent a non-finite update at version \d+ \(refused: "
        r"leaf .* holds NaN or infinity\)",
        text,
    )
    assert len(nonfinite) == 1, text
    # Saves every 0.05 s: the first line and the last (at the stop) only.
    assert 1 <= text.count("checkpoint written:") <= 2, text
    assert re.search(
        r"hpsjax-server: SIGTERM: stopping at version \d+ with 0 live workers "
        r"\(telling them goodbye, writing a last checkpoint\)",
        out,
    ), out
    assert re.search(r"hpsjax-server stopped at version \d+", out), out


@pytest.mark.slow
def test_debug_logs_the_libraries_and_every_checkpoint(tmp_path):
    _, err = _a_short_run(tmp_path, "--log_level", "debug")
    assert " absl: " in err
    assert err.count("checkpoint written:") > 2


def test_a_join_line_names_the_plan_sent_and_a_status_line_the_progress(caplog):
    caplog.set_level(logging.INFO, logger="hpsjax.net._server")

    async def main():
        server = Server(_params(), optax.sgd(0.1), secret=SECRET, status_interval=0.05)
        async with server:
            server.send_plan(
                "w",
                {"revision": 2, "batch_size": 48, "local_steps": 4, "lr_scale": 0.5},
            )
            async with Client(
                "127.0.0.1", server.port, worker_id="w", secret=SECRET
            ) as c:
                _, version = await c.pull()
                for _ in range(5):
                    await c.push(_update(0.1), version=version, loss=2.5)
                    _, version = await c.pull()
                await asyncio.sleep(0.2)

    _run(main)
    text = caplog.text
    assert re.search(
        r"worker 'w' joined from .* at version 0 \(1 live\); sent its plan revision "
        r"2: batch 48, local steps 4, step-size scale 0.5",
        text,
    ), text
    assert re.search(
        r"server: version 5, [\d.]+ versions/s, loss 2.5, staleness 0, "
        r"[\d.]+ pushes/s, 1 live worker\b",
        text,
    ), text


def test_leaves_are_counted_by_reason_and_refusals_too(tmp_path):
    metrics = ServerMetrics(tensorboard_dir=tmp_path)

    async def main():
        server = Server(
            _params(), optax.sgd(0.1), "asp", secret=SECRET, metrics=metrics,
            status_interval=0.05,
        )  # fmt: skip
        async with server:
            done = Client("127.0.0.1", server.port, worker_id="done", secret=SECRET)
            lost = Client("127.0.0.1", server.port, worker_id="lost", secret=SECRET)
            for c in (done, lost):
                await c.connect()
                await c.pull()
            with pytest.raises(NonFiniteUpdate):
                await done.push(_update(np.inf), version=0)
            await done.push(_update(0.1), version=0)
            await done.close()  # says goodbye
            lost._protocol.abort()  # as a killed process's connection ends
            for _ in range(100):
                if not server.core.live:
                    break
                await asyncio.sleep(0.01)
            # A point before the one the close writes, so that the last has a
            # rate of versions (a rate needs an earlier point).
            for _ in range(1000):
                if metrics._points:
                    break
                await asyncio.sleep(0.01)

    _run(main)
    metrics.close()
    assert metrics._leaves == {"done": 1, "crashed": 1, "dropped": 0, "replaced": 0}
    assert metrics.dropped_workers == 1
    scalars = read_tensorboard(tmp_path)[""]
    assert {
        "server/version", "server/live_workers", "server/pushes_per_s",
        "server/versions_per_s", "server/staleness", "server/barrier_wait_s",
        "server/dropped_workers", "server/nonfinite_updates",
    } <= set(scalars)  # fmt: skip
    # The last point, written as the server closed.
    assert scalars["server/version"][-1] == (1, 1.0)
    assert scalars["server/dropped_workers"][-1][1] == 1.0
    assert scalars["server/nonfinite_updates"][-1][1] == 1.0
    assert scalars["server/live_workers"][-1][1] == 0.0


# ------------------------------------------------------------ defaults and errors


def test_the_server_and_the_launcher_default_to_the_same_policy():
    import inspect

    from hpsjax import launch
    from hpsjax.ps import BSP, DEFAULT_POLICY

    assert DEFAULT_POLICY == "bsp"
    assert _cli.parse_args(["--init", "x.npz"]).policy == DEFAULT_POLICY
    assert inspect.signature(launch.launch).parameters["policy"].default == (
        DEFAULT_POLICY
    )
    assert isinstance(Server(_params(), optax.sgd(0.1), secret=SECRET).core.policy, BSP)


@pytest.mark.parametrize(
    "text,message",
    [
        (None, "--work_plan {path}: No such file or directory"),
        ("not json", "--work_plan {path}: not a JSON WorkPlan: Expecting value"),
        (
            '{"format": "hpsjax-work-plan", "version": 1, "workers": '
            '[{"worker_id": 0, "batch_size": 8}]}',
            "--work_plan {path}: malformed WorkPlan JSON: a worker or device entry "
            "has no 'devices'",
        ),
    ],
)
def test_a_bad_plan_file_is_one_readable_line(tmp_path, capsys, text, message):
    from hpsjax.planning import PLAN_FORMAT, PLAN_FORMAT_VERSION

    init, plan = tmp_path / "init.npz", tmp_path / "plan.json"
    save_params_npz(init, {"w": np.zeros(3, np.float32)})
    if text is not None:
        plan.write_text(
            text.replace("hpsjax-work-plan", PLAN_FORMAT).replace(
                '"version": 1', f'"version": {PLAN_FORMAT_VERSION}'
            )
        )
    status = _cli.main(
        ["--init", str(init), "--work_plan", str(plan), "--loop", "asyncio"]
    )
    err = capsys.readouterr().err
    assert status == 2
    assert err.startswith("hpsjax-server: " + message.format(path=plan)), err
    assert err.count("\n") == 1 and "Error(" not in err


@pytest.mark.slow
def test_a_launched_runs_tensorboard_holds_the_server_beside_its_workers(tmp_path):
    from hpsjax.launch import launch

    launch(
        2, policy="asp", steps=20, progress=False, workdir=tmp_path,
        worker_args=["--dataset_arg", "num_examples=64", "--batch_size", "8"],
    )  # fmt: skip
    runs = read_tensorboard(tmp_path / "tensorboard")
    assert {"server", "worker0", "worker1"} <= set(runs), sorted(runs)
    versions = [v for _, v in runs["server"]["server/version"]]
    assert versions[-1] >= 20
