"""The experiment config's fields that are run settings: each names its
setting of the run configuration (hpsjax.config), whose rule accepts every
scheme's values, and the worker processes get them as that setting."""

import dataclasses
import doctest

import pytest

from experiments import registry
from experiments.configs import schema
from experiments.worker_flags import run_config
from hpsjax.ps import ServerOptions
from hpsjax.worker import WorkerCommand, WorkerConfig


def test_every_run_field_names_a_setting_of_the_run_configuration():
    fields = schema.run_fields()
    assert fields["worker.local_steps"] == "WorkerConfig.local_steps"
    assert fields["server.learning_rate"] == "ServerOptions.learning_rate"
    assert fields["data.name"] == "WorkerCommand.dataset"
    for path, run in fields.items():
        owner, _, name = run.partition(".")
        names = {f.name for f in dataclasses.fields(schema.RUN_CLASSES[owner])}
        assert name in names, path
    with pytest.raises(ValueError, match=r"WorkerConfig\.nope is no setting"):
        schema._run_field(1, "a field", "WorkerConfig.nope")


@pytest.mark.parametrize("scheme", registry.SCHEMES)
def test_each_schemes_run_settings_pass_the_run_configurations_rules(scheme):
    settings = schema.run_settings(registry.load_config(scheme, "quick"))
    WorkerConfig(**settings["WorkerConfig"], worker_id=0)
    WorkerCommand(**settings["WorkerCommand"])
    ServerOptions(init="init.npz", **settings["ServerOptions"])


def test_the_worker_processes_get_the_run_fields_as_their_settings():
    config = registry.load_config("hps", "quick")
    config.worker.local_steps = 3
    config.batch_size = 24
    settings = schema.run_settings(config)
    worker = run_config(config).workers[1]
    for name in ("batch_size", "local_steps", "bits", "error_feedback"):
        assert getattr(worker.config, name) == settings["WorkerConfig"][name], name
    for name in ("task", "dataset", "test_fraction", "model_seed"):
        assert getattr(worker.command, name) == settings["WorkerCommand"][name], name
    assert (worker.config.local_steps, worker.config.batch_size) == (3, 24)


def test_the_schemas_examples_hold():
    assert doctest.testmod(schema, optionflags=doctest.ELLIPSIS).failed == 0


class _Stop(Exception):
    pass


def _sim_config(monkeypatch, scheme: str):
    """The :class:`hpsjax.sim.SimConfig` the sim backend gives the simulator
    for ``scheme``'s quick setting (the simulation itself not run)."""
    import hpsjax.sim
    from experiments import backends, build

    seen = []

    def simulate(*args, **kwargs):
        seen.append(args[4])
        raise _Stop

    monkeypatch.setattr(hpsjax.sim, "simulate", simulate)
    config = registry.load_config(scheme, "quick")
    config.backend = "sim"
    with pytest.raises(_Stop):
        backends.run_sim(config, build.setup(config), workdir=None, progress=False)
    return config, seen[0]


@pytest.mark.parametrize("scheme", ["ps_plus", "hps", "streaming_diloco"])
def test_the_simulated_workers_take_the_real_workers_settings(monkeypatch, scheme):
    import jax
    import numpy as np

    from experiments import build
    from experiments.worker_flags import worker_config
    from hpsjax.config import parse_worker
    from hpsjax.worker import push_compression

    config, sim = _sim_config(monkeypatch, scheme)
    real = parse_worker(run_config(config).worker_argv(0)).config
    # What the processes get, read back from worker 0's command line, minus
    # the plan (a file for the processes, an object in the simulator).
    options = sim.worker
    assert options == worker_config(config, 0, plan=None).core_options(
        compress_from_stage=options.compress_from_stage
    )
    assert options.overlap == real.overlap
    assert options.staleness_lr == real.staleness_lr
    made = push_compression(dataclasses.replace(real, seed=int(config.seed)))
    if made is None:
        assert sim.push_transform is None
        return
    # The same compression, the worker's own seed aside (the simulator keys
    # each worker itself): equal pushes of one update.
    params = build.setup(config).params
    update = jax.tree.map(
        lambda p: np.random.default_rng(0).normal(size=p.shape).astype(p.dtype),
        params,
    )
    ours, _ = made[1].update(update, made[1].init(params))
    theirs, _ = sim.push_transform.update(update, sim.push_transform.init(params))
    for a, b in zip(jax.tree.leaves(ours), jax.tree.leaves(theirs), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
