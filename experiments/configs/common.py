r"""Settings every scheme shares: data, model, evaluation, workers, budget.

Each scheme's config (``bsp.py``, ``hps.py``, ...) starts from :func:`get_config`
and changes only what makes the scheme. The variant after ``:`` on the command
line picks one of :data:`SETTINGS`:

* ``quick``: smoke-test size: 3 workers (slowdowns 1, 2, 4), 1200 examples,
  seconds of compute on either backend.
* ``demo``: the README quick start: 4 simulated workers with speeds 1:1:2:4,
  transient stragglers, a 4 MB/s link.
* ``sim8`` (default): 8 simulated workers, step times spread 6x (1, 1, 1.5, 2,
  2, 3, 4, 6), 2% transient stragglers (4x slower steps), worker 1 three times
  slower from t = 20 s on, a 4 MB/s link with 2 ms latency.
* ``sim8_slowlink``: ``sim8`` with links 8 times slower (0.5 MB/s, 10 ms
  latency): a float32 pull of the MLP takes 82 ms, more than a fast worker's
  step, so communication matters as much as compute.
* ``proc4``: 4 real worker processes with speeds 1:1:2:4 (slowdowns 8, 8, 4,
  2) against a real server on loopback, a 50 MB/s link cap each; a SmallCNN on
  28x28 digits, so that compute (10 to 30 ms per step of 32 samples on a
  shared core) outweighs the per-message overheads.
* ``devices``: 4 real worker processes on real devices, ``gpu:0, cpu:4,
  cpu:2, cpu:1`` (``workers.devices``; on a machine without a GPU the GPU
  worker runs on 4 CPU cores), the server on 3 cores of its own
  (``server.cores``), an MLP (512, 512) on 28x28 digits, 60 s; no injected
  slowdown or link (see ``experiments/placement.py``).
* ``sim32``: 32 simulated workers, 8 on each of four accelerators whose step
  times follow :data:`SIM32_THROUGHPUTS`; sim8's data, model, stragglers and
  links.
* ``lm_sim8``, ``lm_sim32``, ``lm_proc4``: the workers, links and backends of
  ``sim8``, ``sim32`` and ``proc4`` training a language model (task ``lm``):
  a byte-level decoder-only transformer (``d_model`` 32, 2 layers, 2 heads,
  33k parameters) on windows of 32 bytes of the offline ``text`` corpus (10%
  held out), 16 sequences per local step, timed to a validation loss (nats
  per byte) that BSP reaches within the budget: 2.9 in 45 virtual s, 3.0 in
  60 and 2.5 in 40 wall s. Step sizes are tuned on ``lm_sim8``
  (``tuned_as``).
* ``lm_devices``: the language model of the ``lm_*`` settings on the
  ``devices`` setting's real devices and server cores, to a validation loss
  of 2.5 in 60 s (``lm_proc4``'s target).

A simulated worker :math:`i` with slowdown :math:`k_i(t)` takes
:math:`k_i(t)\,(o + (T - o)\,b / b_0)` virtual seconds per local step of
:math:`b` samples (:math:`T` = ``workers.step_time`` at :math:`b_0` =
``batch_size``, :math:`o` = ``workers.step_overhead``), times a mean-one lognormal
jitter and, with probability ``workers.straggle_probability``, times
``workers.straggle_slowdown``. A real worker sleeps :math:`(k_i(t) - 1)\,\bar c` after
each step, :math:`\bar c` the median compute time of its last steps of that
batch (``hpsjax.worker.Injector``). Every message of :math:`n` bytes
takes ``latency`` + :math:`n` / ``bandwidth`` on a worker's link.

Data: the offline ``synthetic_digits`` (8x8) by default. To train on your own
arrays, save them with ``numpy.savez(path, x=images, y=labels)`` and run with
``--config.data.name=npz --config.data.path=/path/to/file.npz`` (optionally
``--config.data.x_key`` / ``--config.data.y_key``); ``data.num_examples`` and
``data.image_size`` then do not apply.
"""

from __future__ import annotations

from typing import Any

from experiments.configs.schema import (
    Data,
    Eval,
    ExperimentConfig,
    Model,
    Server,
    Workers,
)

__all__ = ["SETTINGS", "SIM32_THROUGHPUTS", "get_config", "pick"]

SETTINGS: dict[str, dict[str, Any]] = {
    "quick": {
        "backend": "sim",
        "budget_seconds": 8.0,
        "num_examples": 1200,
        "slowdowns": (1.0, 2.0, 4.0),
        "jitter": 0.1,
        "straggle_probability": 0.0,
        "bandwidth": 4e6,
        "latency": 0.002,
        "speed_changes": (),
        "eval_every": 0.5,
        "target_accuracy": 0.5,
        "hidden": (32,),
    },
    "demo": {
        "backend": "sim",
        "budget_seconds": 30.0,
        "num_examples": 4000,
        "slowdowns": (1.0, 1.0, 2.0, 4.0),
        "jitter": 0.1,
        "straggle_probability": 0.05,
        "bandwidth": 4e6,
        "latency": 0.002,
        "speed_changes": (),
        "eval_every": 0.5,
        "target_accuracy": 0.85,
        "hidden": (64, 64),
    },
    "sim8": {
        "backend": "sim",
        "budget_seconds": 60.0,
        "num_examples": 6000,
        "slowdowns": (1.0, 1.0, 1.5, 2.0, 2.0, 3.0, 4.0, 6.0),
        "jitter": 0.1,
        "straggle_probability": 0.02,
        "bandwidth": 4e6,
        "latency": 0.002,
        "speed_changes": ((1, 20.0, 3.0),),
        "eval_every": 0.5,
        "target_accuracy": 0.9,
        "hidden": (64, 64),
    },
    "proc4": {
        "backend": "processes",
        "budget_seconds": 30.0,
        "num_examples": 6000,
        "image_size": 28,
        "model": "cnn",
        "slowdowns": (8.0, 8.0, 4.0, 2.0),
        "jitter": 0.0,
        "straggle_probability": 0.0,
        "bandwidth": 5e7,
        "latency": 0.001,
        "speed_changes": (),
        "eval_every": 1.0,
        "target_accuracy": 0.9,
        "hidden": (64, 64),
    },
}
"""Heterogeneity settings by name (see the module docstring)."""
SETTINGS["sim8_slowlink"] = dict(SETTINGS["sim8"], bandwidth=5e5, latency=0.01)
# The advisor's checks on processes (RESULTS.md, "The advisor from a pilot's
# telemetry"): proc4's CNN on 3 workers at slowdowns 1, 2.5, 6 behind 20 MB/s
# with proc4's step sizes (pick() reads "tuned_as");
# an MLP (128, 128) on 3 workers at 1, 2, 4 behind 5 MB/s, 2 ms, to 0.85.
SETTINGS["proc3_hidden"] = dict(
    SETTINGS["proc4"], budget_seconds=20.0, slowdowns=(1.0, 2.5, 6.0), bandwidth=2e7,
    tuned_as="proc4",
)  # fmt: skip
SETTINGS["proc3_mlp"] = dict(
    SETTINGS["proc4"], budget_seconds=20.0, model="mlp", hidden=(128, 128),
    slowdowns=(1.0, 2.0, 4.0), bandwidth=5e6, latency=0.002, target_accuracy=0.85,
)  # fmt: skip
# Real devices: each worker process on a GPU or a CPU core set, the server on
# cores of its own (experiments/placement.py); no injected slowdown or link.
SETTINGS["devices"] = {
    "backend": "processes",
    "budget_seconds": 60.0,
    "num_examples": 6000,
    "image_size": 28,
    "model": "mlp",
    "hidden": (512, 512),
    "slowdowns": (1.0, 1.0, 1.0, 1.0),
    "devices": ("gpu:0", "cpu:4", "cpu:2", "cpu:1"),
    "server_cores": 3,
    "jitter": 0.0,
    "straggle_probability": 0.0,
    "bandwidth": None,
    "latency": 0.0,
    "speed_changes": (),
    "eval_every": 2.0,
    "target_accuracy": 0.9,
}

SIM32_THROUGHPUTS: dict[str, float] = {
    "A100 80GB mixed precision": 2470.0,
    "V100 16GB mixed precision": 1200.0,
    "A100 80GB TF32": 938.0,
    "V100 16GB FP32": 367.0,
}
"""Single-GPU ResNet-50 v1.5 training throughputs (img/s) of NVIDIA's
DeepLearningExamples README (PyTorch, pytorch-21.03 NGC container): the
accelerators of setting ``sim32``."""

_FASTEST = max(SIM32_THROUGHPUTS.values())
# sim8's data, model, stragglers and links; 8 workers of each accelerator,
# no slowing-down worker, and an evaluation every virtual second (32 workers
# make 4 times sim8's events per virtual second).
SETTINGS["sim32"] = dict(
    SETTINGS["sim8"],
    budget_seconds=40.0,
    slowdowns=tuple(
        round(_FASTEST / t, 2) for t in SIM32_THROUGHPUTS.values() for _ in range(8)
    ),
    speed_changes=(),
    eval_every=1.0,
)

# The language model of the lm_* settings (task "lm"): a byte-level
# decoder-only transformer on the offline "text" corpus, timed to a
# validation loss (nats per byte) that BSP reaches within each budget.
_LM = {
    "task": "lm",
    "dataset": "text",
    "data_args": {"seq_len": 32},
    "test_fraction": 0.1,
    "batch_size": 16,
    "model": "transformer",
    "model_args": {"d_model": 32, "num_layers": 2, "num_heads": 2},
    "eval_every": 1.0,
    "eval_batch_size": 512,
    "target_accuracy": None,
}
_CLASSIFIER_ONLY = ("num_examples", "image_size", "hidden")


def _lm(base: str, **changes: Any) -> dict[str, Any]:
    """Setting ``base``'s workers, links and budget with :data:`_LM`'s task."""
    setting = {k: v for k, v in SETTINGS[base].items() if k not in _CLASSIFIER_ONLY}
    return {**setting, **_LM, **changes}


SETTINGS["lm_sim8"] = _lm("sim8", budget_seconds=45.0, target_value=2.9)
SETTINGS["lm_sim32"] = _lm(
    "sim32", budget_seconds=60.0, target_value=3.0, tuned_as="lm_sim8"
)
SETTINGS["lm_proc4"] = _lm(
    "proc4", budget_seconds=40.0, target_value=2.5, tuned_as="lm_sim8"
)
SETTINGS["lm_devices"] = _lm(
    "devices", budget_seconds=60.0, target_value=2.5, tuned_as="lm_sim8"
)

DEFAULT_SETTING = "sim8"


def pick(config: ExperimentConfig, values: dict[str, Any]) -> Any:
    """The value of ``values`` for the config's setting, else for the setting
    it is tuned as (its ``tuned_as``), else ``values["default"]``: per-setting
    tuning in scheme files."""
    like = SETTINGS.get(config.setting, {}).get("tuned_as")
    return values.get(config.setting, values.get(like, values.get("default")))


def get_config(arg: str | None = None) -> ExperimentConfig:
    """The shared part of every scheme's config, for setting ``arg``.

    Args:
      arg: a name of :data:`SETTINGS`, or ``None`` for ``"sim8"``.

    Returns:
      An :class:`~experiments.configs.schema.ExperimentConfig` (not frozen);
      the scheme's file fills ``scheme`` and changes the server, worker, plan
      and stage fields.

    Raises:
      ValueError: an unknown setting (the message lists the valid names).
    """
    setting = DEFAULT_SETTING if arg in (None, "") else arg
    if setting not in SETTINGS:
        raise ValueError(
            f"unknown setting {setting!r}; valid names: {', '.join(sorted(SETTINGS))}"
        )
    s = SETTINGS[setting]
    config = ExperimentConfig(
        setting=setting,
        backend=s["backend"],
        # What is learned (hpsjax.tasks): "classification", "lm", "regression",
        # or a factory "package.module:make_task"; it sets the workers' loss,
        # the evaluation's metrics and the direction of the target.
        task=s.get("task", "classification"),
        # Virtual seconds (sim) or wall seconds after every worker joined
        # (processes); the same budget for every scheme of a setting.
        budget_seconds=s["budget_seconds"],
        # Samples per local step of each worker; a work plan re-divides
        # batch_size * num_workers among the workers.
        batch_size=s.get("batch_size", 32),
        data=Data(
            name=s.get("dataset", "synthetic_digits"),
            num_examples=s.get("num_examples", 6000),
            image_size=s.get("image_size", 8),
            test_fraction=s.get("test_fraction", 0.2),
            args=dict(s.get("data_args", {})),
        ),
        model=Model(
            name=s.get("model", "mlp"),
            hidden=s.get("hidden", (64, 64)),
            args=dict(s.get("model_args", {})),
        ),
        # The target a run is timed to (experiments/target.py): the metric
        # (None: the task's own, a classifier's accuracy, a language model's
        # loss) and the value; the direction is the task's. An accuracy target
        # without target_value takes target_accuracy.
        eval=Eval(
            every_seconds=s["eval_every"],
            target_value=s.get("target_value"),
            target_accuracy=s.get("target_accuracy"),
            batch_size=s.get("eval_batch_size", 2048),
        ),
        workers=Workers(
            slowdowns=s["slowdowns"],
            jitter=s["jitter"],
            straggle_probability=s["straggle_probability"],
            bandwidth=s["bandwidth"],
            latency=s["latency"],
            speed_changes=s["speed_changes"],
            devices=tuple(s.get("devices", ())),
        ),
        # Deadlines (server.deadline_factor) drop workers that stopped making
        # progress; far above a round so that a transient straggler is never
        # taken for a dead worker.
        server=Server(cores=int(s.get("server_cores", 0))),
    )
    # proc4: its slow workers' planned batches (8 to 16) measured, not
    # extrapolated, and enough timed steps for each step's spread
    # (hpsjax.profiling.MIN_SPREAD_SAMPLES), which a barrier round's predicted
    # time counts on two shared cores; a larger size costs the 8x-slowed
    # workers seconds of the budget.
    config.plan.profile_batch_sizes = pick(
        config, {"proc4": (8, 32), "default": (16, 48)}
    )
    config.plan.profile_repeats = pick(config, {"proc4": 6, "default": 2})
    return config
