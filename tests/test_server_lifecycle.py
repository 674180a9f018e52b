"""The server as its user lives it: where its state is, what it logs, its
metrics, how it leaves and stops."""

import jax
import numpy as np
import optax
import pytest
from test_server import SECRET, _params, _run, _update

from hpsjax._devices import describe_device
from hpsjax.models import save_params_npz
from hpsjax.ps import _cli
from hpsjax.ps._client import Client
from hpsjax.ps._server import Server


def _devices_of(tree):
    return {
        describe_device(d) for leaf in jax.tree.leaves(tree) for d in leaf.devices()
    }


# ------------------------------------------------------------ device


def test_the_server_state_is_on_the_host_cpu_by_default():
    async def main():
        server = Server(_params(), optax.sgd(0.1, momentum=0.9), secret=SECRET)
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
