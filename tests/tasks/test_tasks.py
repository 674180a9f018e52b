"""Tasks (hpsjax.tasks): the built-in ones, a user's factory, the datasets of
each target, and ``hpsjax-worker --task`` / ``hpsjax-launch --task``: a user's
regression model and task trained against a real server, bad input refused in
one line with nothing started."""

import json
import math
import os
import pathlib
import re
import subprocess
import sys
import textwrap
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hpsjax import data, models, tasks
from hpsjax.cli import worker as worker_cli
from hpsjax.launch import _cli as launch_cli
from hpsjax.profiling import in_place
from hpsjax.worker import _build as worker_build

ROOT = pathlib.Path(__file__).resolve().parents[2]

# A user's code: a regression model's factory and tasks, good and bad.
USER_MODULE = textwrap.dedent(
    """
    import jax.numpy as jnp
    from flax import nnx
    from hpsjax import tasks

    class Regressor(nnx.Module):
        def __init__(self, features, outputs, *, rngs):
            self.hidden = nnx.Linear(features, 32, rngs=rngs)
            self.out = nnx.Linear(32, outputs, rngs=rngs)

        def __call__(self, x):
            return self.out(nnx.tanh(self.hidden(x)))

    def make_model(*, rngs, features=8, outputs=1):
        return Regressor(features, outputs, rngs=rngs), (features,)

    def absolute_error(outputs, batch):
        b = outputs.shape[0]
        diff = outputs.reshape(b, -1) - batch[1].astype(jnp.float32).reshape(b, -1)
        return jnp.mean(jnp.abs(diff), axis=-1)

    def make_task():
        return tasks.Task(
            "absolute_error",
            absolute_error,
            lambda outputs, batch: {"loss": jnp.mean(absolute_error(outputs, batch))},
            dict,
            "loss",
            False,
            lambda dataset: 1,
        )

    def not_a_task():
        return {"loss": absolute_error}

    def needs_an_argument(scale):
        return make_task()

    VALUE = 3
    """
)


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    """``user_tasks``, importable by this process and the ones it starts."""
    (tmp_path / "user_tasks.py").write_text(USER_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv(
        "PYTHONPATH", os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])
    )
    sys.modules.pop("user_tasks", None)
    yield "user_tasks"
    sys.modules.pop("user_tasks", None)


# ---------------------------------------------------------------- the tasks


def test_the_built_in_tasks_and_their_targets():
    assert sorted(tasks.TASKS) == ["classification", "lm", "regression"]
    expected = {
        "classification": ("accuracy", True, ("accuracy", "loss")),
        "lm": ("loss", False, ("accuracy", "loss", "perplexity")),
        "regression": ("loss", False, ("loss",)),
    }
    for name, (metric, higher, reported) in expected.items():
        task = tasks.get_task(name)
        assert task.name == name
        assert (task.target_metric, task.higher_is_better) == (metric, higher)
        assert tasks.reported_metrics(task) == reported
    lm = tasks.get_task("lm")
    assert lm.tokens_per_example(data.text(16, num_examples=4)) == 16
    assert tasks.get_task("regression").tokens_per_example(None) == 1


def test_losses_and_metrics_of_each_task():
    # Classification: softmax cross-entropy per example.
    logits = jnp.array([[2.0, 0.0], [0.0, 2.0]])
    labels = jnp.array([0, 0])
    task = tasks.get_task("classification")
    ce = [math.log(1 + math.exp(-2)), math.log(1 + math.exp(2))]
    np.testing.assert_allclose(task.loss(logits, (None, labels)), ce, rtol=1e-6)
    assert float(task.metrics(logits, (None, labels))["accuracy"]) == 0.5
    # A language model: each sequence's mean token loss; uniform logits give
    # ln V and a perplexity of V.
    lm = tasks.get_task("lm")
    tokens = jnp.zeros((3, 5), jnp.int32)
    losses = lm.loss(jnp.zeros((3, 5, 64)), (tokens, tokens))
    np.testing.assert_allclose(losses, [math.log(64)] * 3, rtol=1e-6)
    summary = lm.summarize({"loss": math.log(64), "accuracy": 0.0})
    assert summary["perplexity"] == pytest.approx(64.0)
    # Regression: each example's mean squared error over its outputs.
    reg = tasks.get_task("regression")
    out = jnp.array([[1.0, 3.0], [0.0, 0.0]])
    np.testing.assert_allclose(reg.loss(out, (None, jnp.ones((2, 2)))), [2.0, 1.0])
    np.testing.assert_allclose(reg.loss(out[:, :1], (None, jnp.ones(2))), [0.0, 1.0])
    with pytest.raises(ValueError, match="outputs 2 values per example, the targets 1"):
        reg.loss(out, (None, jnp.ones(2)))


def test_classification_through_the_task_equals_the_models_functions():
    train = data.synthetic_digits(40, seed=0)
    model = models.get_model("mlp", input_shape=train.input_shape, num_classes=10)
    graphdef, params = models.split_model(model)
    batch = (train.x[:16], train.y[:16])
    task = tasks.get_task("classification")
    np.testing.assert_array_equal(
        tasks.per_example_loss(task, params, graphdef, batch),
        models.per_example_loss(params, graphdef, batch),
    )
    result = tasks.evaluate(task, params, graphdef, batch)
    assert float(result["loss"]) == float(models.loss_fn(params, graphdef, batch))
    assert float(result["accuracy"]) == float(models.accuracy(params, graphdef, batch))


def test_check_target_and_direction():
    lm = tasks.get_task("lm")
    tasks.check_target(lm, "perplexity")
    assert tasks.higher_is_better(lm, "loss") is False
    assert tasks.higher_is_better(lm, "accuracy") is True
    for name, metric in (("regression", "accuracy"), ("classification", "perplexity")):
        with pytest.raises(ValueError, match=f"reports no metric '{metric}'") as e:
            tasks.check_target(tasks.get_task(name), metric)
        assert "\n" not in str(e.value)


def test_a_users_task_from_a_factory(user_module):
    task = tasks.get_task(f"{user_module}:make_task")
    assert task.name == "absolute_error"
    assert tasks.reported_metrics(task) == ("loss",)
    out = jnp.array([[1.0], [-1.0]])
    np.testing.assert_allclose(task.loss(out, (None, jnp.zeros(2))), [1.0, 1.0])


@pytest.mark.parametrize(
    "spec,match",
    [
        ("ranking", r"unknown task 'ranking'; valid names: classification, lm, "),
        ("no_such_module_xyz:make", r"cannot import module 'no_such_module_xyz'"),
        ("{m}:missing", r"module 'user_tasks' has no attribute 'missing'"),
        ("{m}:VALUE", r"is not callable"),
        ("{m}:not_a_task", r"must return an hpsjax.tasks.Task, got dict"),
        ("{m}:needs_an_argument", r"refused to be called"),
        (":make_task", r"must be 'package.module:make_task'"),
        ("", r"task must be a non-empty string"),
    ],
)
def test_bad_task_specs_are_one_line(user_module, spec, match):
    with pytest.raises(ValueError, match=match) as e:
        tasks.get_task(spec.format(m=user_module))
    assert "\n" not in str(e.value)


# ---------------------------------------------------------------- the data


def test_datasets_of_tokens_and_of_values():
    tokens = data.Dataset(
        np.array([[1, 2], [3, 4]]), np.array([[2, 3], [4, 5]]), target="tokens"
    )
    assert tokens.x.dtype == np.int32 and tokens.num_classes == 6
    assert tokens.split(0.5, seed=0)[0].target == "tokens"
    assert "target='tokens'" in repr(tokens)
    values = data.Dataset(np.ones((3, 2)), np.arange(3.0), target="values")
    assert values.y.dtype == np.float32 and values.num_classes == 1
    wide = data.Dataset(np.ones((3, 2)), np.ones((3, 4)), target="values")
    assert wide.num_classes == 4 and wide.shard(2, 1).target == "values"
    # The labels of earlier versions are unchanged.
    labels = data.Dataset(np.ones((2, 3)), [0.0, 1.0])
    assert labels.target == "labels" and repr(labels).endswith("num_classes=2)")
    bad = [
        (dict(target="words"), "target must be one of"),
        (dict(x=np.ones((2, 3)), y=np.ones((2, 2)), target="tokens"), r"\(n, L\)"),
        (dict(x=np.ones((2, 2)), y=np.full((2, 2), 0.5), target="tokens"), "integers"),
        (dict(x=[[0, 9]], y=[[9, 0]], target="tokens", num_classes=4), "token 9"),
        (dict(x=np.ones((2, 2)), y=np.ones((2, 2, 2)), target="values"), r"\(n, k\)"),
        (dict(y=[np.nan, 1.0], target="values"), "NaN or infinite"),
        (dict(y=[1.0, 2.0], target="values", num_classes=3), "their width 1"),
    ]
    for kwargs, match in bad:
        kwargs = {"x": np.ones((2, 3)), "y": [0, 1], **kwargs}
        with pytest.raises(ValueError, match=match):
            data.Dataset(kwargs.pop("x"), kwargs.pop("y"), **kwargs)


def test_the_text_dataset_is_offline_bytes_shifted_by_one():
    text = data.get_dataset("text", seq_len=32)
    assert text.input_shape == (32,) and text.num_classes == 256
    assert len(text) > 14_000
    np.testing.assert_array_equal(text.x[:, 1:], text.y[:, :-1])
    np.testing.assert_array_equal(text.x[1:, 0], text.y[:-1, -1])
    # Mostly English prose.
    prose = bytes(text.x[:200].ravel().tolist()).decode("utf-8", "replace")
    assert prose.count(" ") > len(prose) / 10
    # The split is fixed by the seed.
    a, b = text.split(0.1, seed=0)[1], text.split(0.1, seed=0)[1]
    np.testing.assert_array_equal(a.x, b.x)
    assert len(data.text(64, num_examples=10)) == 10
    with pytest.raises(ValueError, match="windows of 64 bytes"):
        data.text(64, num_examples=10**6)


def test_synthetic_regression_is_seeded_and_learnable():
    a = data.synthetic_regression(200, num_features=4, seed=3)
    b = data.synthetic_regression(200, num_features=4, seed=3)
    np.testing.assert_array_equal(a.x, b.x)
    np.testing.assert_array_equal(a.y, b.y)
    assert a.target == "values" and a.y.shape == (200,)
    assert not np.array_equal(a.y, data.synthetic_regression(200, seed=4).y)
    two = data.synthetic_regression(50, num_outputs=2)
    assert two.y.shape == (50, 2) and two.num_classes == 2
    # Noise aside, y is a function of x: its variance is well above the noise's.
    assert float(np.var(a.y)) > 4 * 0.1**2
    with pytest.raises(ValueError, match="noise must be >= 0"):
        data.synthetic_regression(noise=-1.0)


def test_load_npz_reads_regression_values(tmp_path):
    path = tmp_path / "r.npz"
    np.savez(path, x=np.ones((4, 3)), y=np.linspace(0, 1, 4))
    loaded = data.load_npz(path, target="values")
    assert loaded.target == "values" and loaded.y.dtype == np.float32


def test_a_regression_mlp_learns_through_the_task():
    train = data.synthetic_regression(256, num_features=4, seed=0)
    model = models.get_model(
        "mlp", input_shape=train.input_shape, num_classes=train.num_classes
    )
    graphdef, params = models.split_model(model)
    task = tasks.get_task("regression")
    batch = (train.x, train.y)

    @jax.jit
    def step(params):
        grads = jax.grad(
            lambda p: jnp.mean(tasks.per_example_loss(task, p, graphdef, batch))
        )(params)
        return jax.tree.map(lambda p, g: p - 0.05 * g, params, grads)

    before = float(tasks.evaluate(task, params, graphdef, batch)["loss"])
    for _ in range(100):
        params = step(params)
    after = float(tasks.evaluate(task, params, graphdef, batch)["loss"])
    assert after < 0.5 * before


# ------------------------------------------------------ the command lines


BAD_FLAGS = [
    (["--task", "ranking"], "unknown task 'ranking'"),
    (["--task", "no_such_module_xyz:make_task"], "cannot import module"),
    (["--task", "{m}:missing"], "has no attribute 'missing'"),
    (["--task", "{m}:not_a_task"], "must return an hpsjax.tasks.Task"),
    (
        ["--task", "regression", "--target_metric", "accuracy", "--target_value",
         "0.9", "--eval_every", "1"],
        "task 'regression' reports no metric 'accuracy'; its metrics: loss",
    ),
    (
        ["--task", "lm", "--target_metric", "perplexity", "--eval_every", "1"],
        "--target_metric needs --target_value",
    ),
    (["--task", "lm", "--target_value", "2.0"], "--target_value needs --eval_every"),
    (["--task", "regression", "--dataset", "synthetic_digits"], "does not fit"),
]  # fmt: skip


@pytest.mark.parametrize("flags,match", BAD_FLAGS)
def test_the_worker_refuses_bad_tasks_in_one_line(
    user_module, tmp_path, capsys, flags, match
):
    metrics = tmp_path / "w.jsonl"
    flags = [f.format(m=user_module) for f in flags]
    code = worker_cli.main(
        [*flags, "--port", "1", "--metrics", str(metrics), "--status_interval", "0"]
    )
    err = capsys.readouterr().err
    assert code == 2
    assert err.count("\n") == 1 and match in err, err
    assert not metrics.exists()  # nothing started


@pytest.mark.slow
def test_the_worker_cli_exits_2_for_an_unknown_task():
    done = subprocess.run(
        [sys.executable, "-m", "hpsjax.cli.worker", "--task", "ranking"],
        capture_output=True, text=True, timeout=120,
        env={**os.environ, "JAX_PLATFORMS": "cpu"},
    )  # fmt: skip
    assert done.returncode == 2
    assert done.stderr.startswith("hpsjax-worker: unknown task 'ranking'")
    assert done.stderr.count("\n") == 1, done.stderr


def test_the_task_picks_the_workers_dataset_and_model():
    args = worker_cli.parse_args(["--task", "lm"])
    assert (args.dataset, args.model) == ("text", "transformer")
    args = worker_cli.parse_args(["--task", "regression"])
    assert (args.dataset, args.model) == ("synthetic_regression", "mlp")
    args = worker_cli.parse_args([])
    assert (args.task, args.dataset, args.model) == (
        "classification",
        "synthetic_digits",
        "mlp",
    )
    args = worker_cli.parse_args(["--task", "lm", "--dataset", "npz"])
    assert args.dataset == "npz"


def test_the_launcher_refuses_a_bad_task_before_starting(tmp_path, capsys):
    work = tmp_path / "run"
    code = launch_cli.main(
        ["--workers", "1", "--task", "ranking", "--workdir", str(work), "--no_progress"]
    )
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "unknown task 'ranking'" in err
    assert not work.exists() or not any(work.iterdir())


def test_the_launcher_refuses_a_target_the_task_does_not_report(tmp_path, capsys):
    work = tmp_path / "run"
    code = launch_cli.main(
        ["--workers", "1", "--task", "regression", "--workdir", str(work),
         "--no_progress", "--", "--target_metric", "accuracy",
         "--target_value", "0.9", "--eval_every", "1"]
    )  # fmt: skip
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1, err
    assert "reports no metric 'accuracy'" in err
    assert not work.exists() or not any(work.iterdir())


# ------------------------------------------------- real processes, end to end


def _python(module):
    return [sys.executable, "-m", module]


def _start_server(tmp_path, init):
    server = subprocess.Popen(
        [*_python("hpsjax.ps._cli"), "--init", str(init), "--host", "127.0.0.1",
         "--port", "0", "--policy", "asp", "--optimizer", "sgd",
         "--learning_rate", "0.05", "--loop", "asyncio"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env={**os.environ, "JAX_PLATFORMS": "cpu"},
    )  # fmt: skip
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        line = server.stdout.readline()
        match = re.search(r"listening on 127\.0\.0\.1:(\d+)", line)
        if match:
            return server, int(match.group(1))
        if not line and server.poll() is not None:
            break
    server.kill()
    pytest.fail(f"the server did not start: {server.stdout.read()}")


def train_against_a_server(tmp_path, flags, *worker_flags, steps=60):
    """Writes the init of ``flags``, serves it, trains one worker of ``flags``
    to ``steps`` with an eval at the end; the worker's JSON records."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    init = tmp_path / "init.npz"
    subprocess.run(
        [*_python("hpsjax.cli.worker"), *flags, "--write_init", str(init)],
        check=True, timeout=180, capture_output=True, env=env,
    )  # fmt: skip
    server, port = _start_server(tmp_path, init)
    metrics = tmp_path / "w0.jsonl"
    try:
        done = subprocess.run(
            [*_python("hpsjax.cli.worker"), *flags, "--host", "127.0.0.1",
             "--port", str(port), "--worker_id", "0", "--batch_size", "32",
             "--max_steps", str(steps), "--eval_every", "60", "--metrics",
             str(metrics), "--tensorboard_dir", "none", "--status_interval", "0",
             "--loop", "asyncio", *worker_flags],
            capture_output=True, text=True, timeout=300, env=env,
        )  # fmt: skip
    finally:
        server.terminate()
        server.wait(60)
        server.stdout.close()
    assert done.returncode == 0, done.stdout + done.stderr
    assert "Traceback" not in done.stderr, done.stderr
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    return records, done.stdout


@pytest.mark.slow
def test_a_users_regression_model_and_task_train_from_the_worker_cli(
    tmp_path, user_module, session_compile_cache
):
    flags = ["--task", f"{user_module}:make_task", "--dataset",
             "synthetic_regression", "--model",
             f"{user_module}:make_model"]  # fmt: skip
    records, out = train_against_a_server(tmp_path, flags, steps=80)
    evals = [r for r in records if r.get("event") == "eval"]
    assert evals and set(evals[-1]) >= {"loss", "examples"}
    assert "accuracy" not in evals[-1]
    rounds = [r for r in records if "step" in r and "loss" in r]
    first, last = rounds[0]["loss"], np.mean([r["loss"] for r in rounds[-10:]])
    assert last < 0.8 * first, (first, last)
    assert "hpsjax-worker eval: version" in out and "loss" in out


@pytest.mark.slow
def test_launch_task_regression_reaches_the_workers(tmp_path, session_compile_cache):
    work = tmp_path / "run"
    code = launch_cli.main(
        ["--workers", "1", "--task", "regression", "--steps", "5", "--workdir",
         str(work), "--no_progress", "--compile_cache", session_compile_cache,
         "--timeout", "240", "--", "--dataset_arg", "num_examples=200",
         "--eval_every", "60"]
    )  # fmt: skip
    assert code == 0
    records = [
        json.loads(line) for line in (work / "metrics_0.jsonl").read_text().splitlines()
    ]
    evals = [r for r in records if r.get("event") == "eval"]
    assert evals and "loss" in evals[-1] and "accuracy" not in evals[-1]


def test_launch_mds_own_task_runs_as_written(tmp_path, monkeypatch):
    text = (ROOT / "LAUNCH.md").read_text()
    section = text.split("### Your own task", 1)[1].split("\n### ", 1)[0]
    (block,) = re.findall(r"```python\n(.*?)```", section, re.S)
    (tmp_path / "my_tasks.py").write_text(block)
    monkeypatch.syspath_prepend(str(tmp_path))
    task = tasks.get_task("my_tasks:make_task")
    assert tasks.reported_metrics(task) == ("loss",)
    losses = task.loss(jnp.array([[0.5], [3.0]]), (None, jnp.zeros(2)))
    np.testing.assert_allclose(losses, [0.125, 2.5])
    # The commands' flags parse, and the task fits the regression MLP.
    args = worker_cli.parse_args(
        ["--task", "my_tasks:make_task", "--dataset", "synthetic_regression",
         "--eval_every", "10", "--target_value", "0.05", "--port", "1"]
    )  # fmt: skip
    assert worker_cli.worker_target(args, task) == ("loss", 0.05, False)
    worker_build.build(args, task=task)
    sys.modules.pop("my_tasks", None)


def test_the_profiling_pass_times_the_tasks_loss(user_module, monkeypatch):
    seen = []
    loss = tasks.per_example_loss

    def spy(task, *args):
        seen.append(task.name)
        return loss(task, *args)

    monkeypatch.setattr(tasks, "per_example_loss", spy)
    args = worker_cli.parse_args(
        ["--task", f"{user_module}:make_task", "--dataset", "synthetic_regression",
         "--model", f"{user_module}:make_model", "--dataset_arg", "num_examples=64",
         "--profile_batch_sizes", "4", "--profile_repeats", "1"]
    )  # fmt: skip
    profile, spec = in_place.measure_step(args)
    assert seen and set(seen) == {"absolute_error"}
    assert tuple(profile.devices[0].batch_sizes) == (4,)
    assert spec["out"]["kernel"].shape == (32, 1)  # the user's regression model
