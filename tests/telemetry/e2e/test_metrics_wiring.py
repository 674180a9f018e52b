"""Metrics where users look at them: Prometheus on the server, TensorBoard
event files of workers and experiments, the summary of a run's files."""

from __future__ import annotations

import asyncio
import urllib.request

import numpy as np
import pytest
from _servers import SECRET, _run, _update
from prometheus_client.parser import text_string_to_metric_families

from hpsjax.models import save_params_npz
from hpsjax.net._client import Client
from hpsjax.ps import _cli as server_cli


def _scrape(port: int) -> dict[str, float]:
    """``{sample name with labels: value}`` of the server's ``/metrics``."""
    url = f"http://127.0.0.1:{port}/metrics"
    with urllib.request.urlopen(url, timeout=10) as response:
        text = response.read().decode()
    samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()))
            samples[sample.name + (f"{{{labels}}}" if labels else "")] = sample.value
    return samples


async def _start(args, capsys) -> tuple[asyncio.Task, int, int]:
    """Starts ``hpsjax-server`` in this loop; returns (task, port, metrics port)."""
    task = asyncio.create_task(server_cli.serve(args))
    out = ""
    while "listening on" not in out:
        await asyncio.sleep(0.05)
        out += capsys.readouterr().out
        if task.done():
            task.result()
    port = int(out.split("listening on ")[1].split()[0].rsplit(":", 1)[1])
    metrics_port = int(out.split("/metrics")[0].rsplit(":", 1)[1])
    return task, port, metrics_port


def test_server_serves_prometheus_metrics(tmp_path, capsys):
    init = tmp_path / "init.npz"
    save_params_npz(
        init, {"b": np.zeros(3, np.float32), "w": np.zeros((4, 3), np.float32)}
    )
    (tmp_path / "secret").write_bytes(SECRET)
    args = server_cli.parse_args(
        ["--init", str(init), "--secret_file", str(tmp_path / "secret"),
         "--metrics_port", "0", "--checkpoint_dir", str(tmp_path / "ckpt"),
         "--checkpoint_every_updates", "1", "--log_level", "WARNING",
         "--policy", "asp"]
    )  # fmt: skip

    async def main():
        task, port, metrics_port = await _start(args, capsys)
        scrape = lambda: asyncio.to_thread(_scrape, metrics_port)
        before = await scrape()
        assert before["hpsjax_server_version"] == 0
        assert before["hpsjax_server_pushes_total"] == 0
        assert "hpsjax_server_checkpoint_age_seconds" not in before
        async with (
            Client("127.0.0.1", port, worker_id="a", secret=SECRET) as a,
            Client("127.0.0.1", port, worker_id="b", secret=SECRET) as b,
        ):
            _, va = await a.pull()
            _, vb = await b.pull()
            for _ in range(3):  # a pushes three times on fresh parameters
                await a.push(_update(1.0), version=va)
                _, va = await a.pull()
            await b.push(_update(1.0), version=vb)  # three versions behind
            during = await scrape()
        assert during["hpsjax_server_version"] == 4
        assert during["hpsjax_server_live_workers"] == 2
        assert during["hpsjax_server_pushes_total"] == 4
        assert during["hpsjax_server_pulls_total"] == 5
        assert during["hpsjax_server_received_bytes_total"] > 4 * 15 * 4
        assert during["hpsjax_server_sent_bytes_total"] > 5 * 15 * 4
        # Staleness 0 three times, 3 once.
        assert during["hpsjax_server_staleness_bucket{le=0.0}"] == 3
        assert during["hpsjax_server_staleness_bucket{le=2.0}"] == 3
        assert during["hpsjax_server_staleness_bucket{le=4.0}"] == 4
        assert during["hpsjax_server_staleness_sum"] == 3
        assert during["hpsjax_server_apply_seconds_count"] == 4
        assert during["hpsjax_server_barrier_wait_seconds_count"] == 5
        after = await scrape()
        for _ in range(100):  # the checkpoint is written by its own thread
            if "hpsjax_server_checkpoint_age_seconds" in after:
                break
            await asyncio.sleep(0.05)
            after = await scrape()
        assert 0 <= after["hpsjax_server_checkpoint_age_seconds"] < 60
        assert after["hpsjax_server_live_workers"] == 0
        # Both ended their runs: left, not dropped.
        assert after["hpsjax_server_dropped_workers_total"] == 0
        assert after["hpsjax_server_worker_leaves_total{reason=done}"] == 2
        assert after["hpsjax_server_worker_leaves_total{reason=crashed}"] == 0
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        with pytest.raises(OSError):  # stopped with the server
            _scrape(metrics_port)

    _run(main, loop="asyncio")


def test_metrics_port_in_use_is_one_line(tmp_path, capsys):
    import socket

    init = tmp_path / "init.npz"
    save_params_npz(init, {"w": np.zeros(2, np.float32)})
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        code = server_cli.main(
            ["--init", str(init), "--metrics_port", str(port), "--loop", "asyncio"]
        )
    err = capsys.readouterr().err
    assert code == 2 and "cannot serve metrics" in err
    assert len(err.strip().splitlines()) == 1


# ---------------------------------------------------------------------------
# Any flax model from the command line: package.module:factory.
# ---------------------------------------------------------------------------

FACTORY = """
from flax import nnx


class Tiny(nnx.Module):
    def __init__(self, hidden, *, rngs):
        self.hidden = nnx.Linear(64, hidden, rngs=rngs)
        self.out = nnx.Linear(hidden, 10, rngs=rngs)

    def __call__(self, x):
        x = x.reshape((x.shape[0], -1))
        return self.out(nnx.relu(self.hidden(x)))


def make_model(*, rngs, hidden=16):
    return Tiny(hidden, rngs=rngs), (8, 8, 1)
"""


@pytest.fixture
def factory_module(tmp_path, monkeypatch):
    """A model factory in a module of its own, importable from PYTHONPATH."""
    import sys

    package = tmp_path / "user_models"
    package.mkdir()
    name = f"factory_{tmp_path.name.replace('-', '_')}"
    (package / f"{name}.py").write_text(FACTORY)
    monkeypatch.syspath_prepend(str(package))
    monkeypatch.setenv("PYTHONPATH", str(package))
    yield f"{name}:make_model"
    sys.modules.pop(name, None)


def test_server_init_from_a_factory_serves_what_workers_write(tmp_path, factory_module):
    from hpsjax.cli import worker as worker_cli
    from hpsjax.models import load_params_npz

    flags = ["--model_arg", "hidden=12", "--model_seed", "3"]
    init = tmp_path / "init.npz"
    worker_cli.write_init(
        worker_cli.parse_args(
            ["--model", factory_module, "--dataset", "sklearn_digits", *flags]
        ),
        init,
    )
    built = server_cli.initial_params(factory_module, model_args={"hidden": 12}, seed=3)
    written = load_params_npz(init)
    assert sorted(built) == sorted(written) == ["hidden", "out"]
    for layer in built:
        for leaf in built[layer]:
            np.testing.assert_array_equal(built[layer][leaf], written[layer][leaf])
    assert built["hidden"]["kernel"].shape == (64, 12)
    args = server_cli.parse_args(["--init_from", factory_module, *flags])
    assert args.init is None and args.init_from == factory_module
    with pytest.raises(SystemExit):  # one or the other
        server_cli.parse_args(["--init", str(init), "--init_from", "mlp"])
    with pytest.raises(ValueError, match="cannot import module"):
        server_cli.initial_params("no_such_module_here:make")


@pytest.mark.slow
def test_a_factory_model_trains_through_a_server_and_two_workers(
    tmp_path, factory_module
):
    import subprocess
    import sys

    from hpsjax.metrics import read_jsonl, read_tensorboard

    work = tmp_path / "run"
    out = subprocess.run(
        [sys.executable, "-m", "hpsjax.launch", "--workers", "2", "--steps", "8",
         "--policy", "bsp", "--model", factory_module, "--workdir", str(work),
         "--no_progress", "--timeout", "240", "--", "--dataset", "sklearn_digits",
         "--batch_size", "16", "--model_arg", "hidden=8", "--eval_every", "0.01",
         "--loop", "asyncio"],
        capture_output=True, text=True, timeout=300, cwd=tmp_path,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    for i in range(2):
        records = read_jsonl(work / f"metrics_{i}.jsonl")
        rounds = [r for r in records if r["event"] == "round"]
        evals = [r for r in records if r["event"] == "eval"]
        assert len(rounds) == 8
        assert evals and evals[-1]["examples"] == 359  # 20% of 1,797, held out
        assert rounds[-1]["version"] > 0
        scalars = read_tensorboard(work / "tensorboard")[f"worker{i}"]
        assert len(scalars["round/loss"]) == 8
    from experiments import summary as run_summary

    table = run_summary.write_summary(work)["table"]
    assert {w: row["rounds"] for w, row in table.items()} == {"0": 8, "1": 8}
