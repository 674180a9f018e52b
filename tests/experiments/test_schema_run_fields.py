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
