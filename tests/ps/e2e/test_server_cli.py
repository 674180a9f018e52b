"""The ``hpsjax-server`` command line: arguments, model files, optimizers."""

import asyncio
import platform
import subprocess
import sys

import numpy as np
import optax
import pytest
from _servers import SECRET, _run, _update

from hpsjax._npz import PARAMS_MARKER, params_marker
from hpsjax.net._client import Client
from hpsjax.ps import _cli

# What save_params_npz adds: the server's --init refuses a file without it.
MARKER = {PARAMS_MARKER: params_marker()}


def test_npz_names_make_nested_dicts(tmp_path):
    path = tmp_path / "p.npz"
    np.savez(
        path,
        **{"conv/kernel": np.ones((3, 3)), "conv/bias": np.zeros(3), "b": 1.0},
        **MARKER,
    )
    tree = _cli.load_npz_tree(path)
    assert sorted(tree) == ["b", "conv"]
    assert tree["conv"]["kernel"].shape == (3, 3)
    np.testing.assert_array_equal(tree["b"], 1.0)


@pytest.mark.parametrize(
    "arrays,match",
    [
        ({"a": np.ones(1), "a/b": np.ones(1)}, "clashes"),
        ({"a//b": np.ones(1)}, "bad array name"),
        ({}, "no arrays"),
    ],
)
def test_bad_npz_files(tmp_path, arrays, match):
    path = tmp_path / "bad.npz"
    np.savez(path, **arrays)
    with pytest.raises(ValueError, match=match):
        _cli.load_npz_tree(path)


def test_object_arrays_are_never_unpickled(tmp_path):
    path = tmp_path / "obj.npz"
    np.savez(path, x=np.array([{"a": 1}], dtype=object), **MARKER)
    with pytest.raises(ValueError, match="pickle"):
        _cli.load_npz_tree(path)


def test_optimizers():
    assert isinstance(_cli.make_optimizer("adam", 1e-3), optax.GradientTransformation)
    assert isinstance(_cli.make_optimizer("momentum", 0.1, momentum=0.5), tuple)
    for args, kwargs in [(("rmsprp", 0.1), {}), (("sgd", 0.0), {}),
                         (("momentum", 0.1), {"momentum": 1.0})]:  # fmt: skip
        with pytest.raises(ValueError):
            _cli.make_optimizer(*args, **kwargs)


def test_arguments_parse_json_values():
    args = _cli.parse_args(
        ["--init", "x.npz", "--policy", "ssp", "--policy_arg", "staleness_bound=2",
         "--policy_arg", "name=text", "--core_arg", "expected_workers=3"]
    )  # fmt: skip
    assert dict(args.policy_arg) == {"staleness_bound": 2, "name": "text"}
    assert dict(args.core_arg) == {"expected_workers": 3}
    with pytest.raises(SystemExit):
        _cli.parse_args(["--init", "x.npz", "--policy_arg", "novalue"])


def test_main_reports_bad_input_and_exits_2(tmp_path, capsys):
    path = tmp_path / "p.npz"
    np.savez(path, w=np.zeros(2, np.float32), **MARKER)
    secret = tmp_path / "secret"
    secret.write_bytes(b"\n")
    assert _cli.main(["--init", str(path), "--secret_file", str(secret)]) == 2
    assert "empty" in capsys.readouterr().err
    assert (
        _cli.main(["--init", str(path), "--policy", "nope", "--loop", "asyncio"]) == 2
    )
    assert "unknown --policy 'nope'" in capsys.readouterr().err
    code = _cli.main(["--init", str(path), "--host", "0.0.0.0", "--loop", "asyncio"])
    assert code == 2 and "without a secret" in capsys.readouterr().err


def test_serve_hybrid_from_json_stages(tmp_path, capsys):
    path = tmp_path / "p.npz"
    np.savez(path, b=np.zeros(3, np.float32), w=np.zeros((4, 3), np.float32), **MARKER)
    (tmp_path / "secret").write_bytes(SECRET)
    args = _cli.parse_args(
        ["--init", str(path), "--secret_file", str(tmp_path / "secret"),
         "--policy", "hybrid", "--policy_arg",
         'stages=[{"mode": "async", "local_steps": 4}, {"mode": "sync"}]',
         "--learning_rate", "1.0", "--log_level", "WARNING"]
    )  # fmt: skip

    async def main():
        task = asyncio.create_task(_cli.serve(args))
        out = ""
        async with asyncio.timeout(20):
            while "listening on" not in out:
                await asyncio.sleep(0.05)
                out += capsys.readouterr().out
        port = int(out.split("listening on ")[1].split()[0].rsplit(":", 1)[1])
        async with Client("127.0.0.1", port, worker_id="w", secret=SECRET) as c:
            assert c.info.policy == "hybrid"
            _, v = await c.pull()
            ack = await c.push(_update(1.0), version=v)
            assert ack.applied and ack.local_steps == 4
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    _run(main, loop="asyncio")


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc only")
def test_malloc_tuning_applies_in_a_fresh_process():
    # In a subprocess: the setting is process-wide.
    out = subprocess.run(
        [sys.executable, "-c",
         "from hpsjax.ps._cli import keep_freed_memory; print(keep_freed_memory())"],
        capture_output=True, text=True, timeout=120, check=True,
    )  # fmt: skip
    assert out.stdout.strip() == "True"


def test_bad_flags_are_one_line_naming_flags(tmp_path, capsys):
    path = tmp_path / "p.npz"
    np.savez(path, w=np.zeros(2, np.float32), **MARKER)
    # A text file given as --init is not "pickled data".
    secret = tmp_path / "secret.txt"
    secret.write_text("s3cret\n")
    assert _cli.main(["--init", str(secret), "--loop", "asyncio"]) == 2
    err = capsys.readouterr().err
    assert "is not an .npz file" in err and "pickle" not in err
    assert len(err.strip().splitlines()) == 1
    # Unknown --core_arg keys list the valid ones.
    argv = ["--init", str(path), "--loop", "asyncio", "--core_arg", "expected=3"]
    assert _cli.main(argv) == 2
    err = capsys.readouterr().err
    assert "--core_arg expected: ServerCore has no such argument" in err
    assert "valid names: expected_workers, start_timeout," in err
    # What the server builds its core with itself is not the flag's to give.
    argv = ["--init", str(path), "--loop", "asyncio", "--core_arg", "aggregator=1"]
    assert _cli.main(argv) == 2
    assert "--core_arg aggregator: ServerCore has no such argument" in (
        capsys.readouterr().err
    )
    # The refusal to listen without a secret names the flags, not Python args.
    code = _cli.main(["--init", str(path), "--host", "0.0.0.0", "--loop", "asyncio"])
    err = capsys.readouterr().err
    assert code == 2 and "--secret_file" in err and "--insecure" in err
    assert "secret=" not in err and "insecure=True" not in err
    # A negative threshold other than -1 (never) is refused before serving.
    argv = ["--init", str(path), "--loop", "asyncio", "--overlap_apply_bytes", "-5"]
    assert _cli.main(argv) == 2
    err = capsys.readouterr().err
    assert "overlap_apply_bytes must be an int >= 0" in err
    assert len(err.strip().splitlines()) == 1


def test_a_list_without_brackets_is_refused_with_the_json_form():
    with pytest.raises(SystemExit):
        _cli.parse_args(["--init", "x.npz", "--policy_arg", "stages=1,2"])
