"""The one optimizer registry: any optax optimizer by name, from the server CLI,
the worker CLI and the experiments."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from experiments import build, registry
from hpsjax._npz import PARAMS_MARKER, params_marker
from hpsjax._optimizers import (
    OPTIMIZERS,
    make_optimizer,
    optimizer_names,
    resolve_optimizer,
)
from hpsjax.cli import worker as worker_cli
from hpsjax.ps import _cli as server_cli
from hpsjax.worker import _build as worker_build

TARGET = {"w": jnp.arange(12.0).reshape(4, 3) / 10, "b": jnp.array([0.5, -0.5, 1.0])}


def _loss(params):
    return sum(
        jnp.sum((params[k] - TARGET[k]) ** 2) for k in TARGET
    )  # a quadratic bowl at TARGET


def _train(optimizer, steps=40):
    """The loss before and after ``steps`` steps of ``optimizer`` (one jitted
    loop, so that the test compiles once)."""

    @jax.jit
    def run(params):
        def step(carry, _):
            params, state = carry
            updates, state = optimizer.update(jax.grad(_loss)(params), state, params)
            return (optax.apply_updates(params, updates), state), None

        (params, _), _ = jax.lax.scan(
            step, (params, optimizer.init(params)), None, length=steps
        )
        return _loss(params)

    params = jax.tree.map(jnp.zeros_like, TARGET)
    return float(_loss(params)), float(run(params))


@pytest.mark.parametrize(
    ("name", "lr", "kwargs"),
    [
        ("muon", 0.02, {}),
        ("contrib.muon", 0.02, {"beta": 0.9}),
        ("adamw", 0.05, {"weight_decay": 0.01}),
        ("lion", 0.01, {"b1": 0.9}),
        ("momentum", 0.05, {}),
    ],
)
def test_optax_optimizers_resolve_by_name_and_train(name, lr, kwargs):
    start, end = _train(make_optimizer(name, lr, **kwargs))
    assert end < 0.5 * start, (name, start, end)


def test_muon_is_optax_contrib_muon():
    assert resolve_optimizer("muon") is optax.contrib.muon
    assert resolve_optimizer("optax.adamw") is optax.adamw
    assert {"muon", "adamw", "lion", "lamb", *OPTIMIZERS} <= set(optimizer_names())
    # Not optimizers: transforms without a learning rate, state classes.
    assert not {"chain", "clip", "apply_updates", "ScaleByAdamState"} & set(
        optimizer_names()
    )


def test_momentum_reaches_optax_only_where_it_is_an_argument():
    # rmsprop takes momentum: passed on; adamw does not: left out, no error.
    opt = make_optimizer("rmsprop", 0.1, momentum=0.5)
    state = opt.init(TARGET)
    assert any("trace" in type(s).__name__.lower() for s in jax.tree.leaves(
        state, is_leaf=lambda x: hasattr(x, "_fields")))  # fmt: skip
    make_optimizer("adamw", 0.1, momentum=0.5)


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (
            lambda: make_optimizer("adamm", 0.1),
            "unknown optimizer 'adamm'; valid names: adam, delayed_nesterov, "
            "demo_outer, gradient_table, lookahead_momentum, momentum, nesterov, "
            "ordered_momentum, sgd, "
            "streaming_local, streaming_nesterov or any optimizer of optax or "
            "optax.contrib "
            "(closest: adam, radam, nadam)",
        ),
        (
            lambda: make_optimizer("adamw", 0.1, weightdecay=0.1),
            "optimizer 'adamw' has no argument 'weightdecay' (did you mean "
            "weight_decay?); its arguments: b1, b2, eps",
        ),
        (
            lambda: make_optimizer("sgd", 0.1, momentum=1.5),
            "bad arguments for optimizer 'sgd': momentum must be in [0, 1)",
        ),
        (lambda: make_optimizer("lion", -1.0), "learning rate must be > 0, got -1.0"),
        (lambda: make_optimizer(3, 0.1), "unknown optimizer 3;"),
    ],
)
def test_bad_names_and_arguments_are_one_line(call, message):
    with pytest.raises(ValueError) as err:
        call()
    text = str(err.value)
    assert "\n" not in text and text.startswith(message), text


def test_server_cli_takes_any_optimizer_and_its_arguments():
    args = server_cli.parse_args(
        ["--init", "x.npz", "--optimizer", "adamw", "--optimizer_arg",
         "weight_decay=0.01", "--optimizer_arg", "b1=0.8"]
    )  # fmt: skip
    assert dict(args.optimizer_arg) == {"weight_decay": 0.01, "b1": 0.8}
    opt = server_cli.make_optimizer(
        args.optimizer, args.learning_rate, momentum=args.momentum,
        **dict(args.optimizer_arg),
    )  # fmt: skip
    start, end = _train(opt)
    assert end < start
    # The old flags mean what they meant.
    args = server_cli.parse_args(["--init", "x.npz", "--optimizer", "momentum"])
    assert args.momentum is None and args.optimizer_arg == []


def test_server_cli_bad_optimizer_is_one_line_and_exit_2(tmp_path, capsys):
    path = tmp_path / "p.npz"
    np.savez(path, w=np.zeros(2, np.float32), **{PARAMS_MARKER: params_marker()})
    for argv, message in [
        (["--optimizer", "lionn"], "unknown optimizer 'lionn'"),
        (["--optimizer", "lion", "--optimizer_arg", "beta1=0.9"],
         "optimizer 'lion' has no argument 'beta1'"),
    ]:  # fmt: skip
        code = server_cli.main(["--init", str(path), "--loop", "asyncio", *argv])
        lines = capsys.readouterr().err.strip().splitlines()
        assert code == 2 and len(lines) == 1, lines
        assert lines[0].startswith(f"hpsjax-server: {message}"), lines


SMALL = ["--model", "mlp", "--dataset", "synthetic_digits", "--dataset_arg",
         "num_examples=64", "--dataset_arg", "image_size=4"]  # fmt: skip


@pytest.mark.parametrize(
    ("argv", "kind"),
    [
        (["--local_optimizer", "muon"], optax.GradientTransformation),
        (["--local_optimizer", "adamw", "--local_optimizer_arg", "weight_decay=0.1"],
         optax.GradientTransformation),
        (["--local_optimizer", "momentum"], optax.GradientTransformation),
        ([], type(None)),
    ],
)  # fmt: skip
def test_worker_cli_local_optimizer_by_name(argv, kind):
    args = worker_cli.parse_args([*SMALL, *argv])
    assert isinstance(worker_build.make_local_optimizer(args), kind)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--local_optimizer", "lionn"], "unknown optimizer 'lionn'"),
        (["--local_optimizer_arg", "b1=0.9"],
         "--local_optimizer_arg needs a --local_optimizer"),
        (["--local_optimizer", "adamw", "--local_optimizer_arg", "decay=1"],
         "optimizer 'adamw' has no argument 'decay'"),
    ],
)  # fmt: skip
def test_worker_cli_bad_local_optimizer_is_one_line(argv, message):
    args = worker_cli.parse_args([*SMALL, *argv])
    with pytest.raises(ValueError) as err:
        worker_build.make_local_optimizer(args)
    assert "\n" not in str(err.value) and str(err.value).startswith(message)


def test_experiments_take_any_optimizer_and_its_arguments():
    config = registry.load_config("asp", "quick")
    config.server.optimizer = "lion"
    config.server.optimizer_args = {"b1": 0.8}
    config.worker.local_optimizer = "muon"
    config.worker.local_optimizer_args = {"beta": 0.9}
    config.worker.local_steps = 2
    registry.check_config(config)
    for opt in (build.server_optimizer(config), build.local_optimizer(config)):
        start, end = _train(opt)
        assert end < start
    config.server.optimizer_args = {"beta1": 0.8}
    with pytest.raises(ValueError, match=r"^optimizer 'lion' has no argument 'beta1'"):
        build.server_optimizer(config)
    config.server.optimizer = "lionn"
    with pytest.raises(ValueError, match=r"^unknown optimizer 'lionn'; valid names: "):
        registry.check_config(config)
