r"""Train one scheme: ``python -m experiments.run --config=... --workdir=...``.

Example::

  python -m experiments.run --config=experiments/configs/hps.py:sim8 \
      --workdir=/tmp/hpsjax/hps

Any config field can be overridden from the command line, e.g.
``--config.backend=processes`` or ``--config.server.learning_rate=0.2``. The logic
is :func:`experiments.train.train_and_evaluate`; this file only parses flags.
"""

from absl import app, flags, logging
from ml_collections import config_flags

from experiments import _cli, registry, train
from experiments.configs.common import SETTINGS
from hpsjax._logs import quiet_backend_probe

_PROG = "experiments.run"

_CONFIG = config_flags.DEFINE_config_file(
    "config",
    None,
    "A scheme's config file, experiments/configs/<scheme>.py[:setting]; "
    f"schemes: {', '.join(registry.SCHEMES)}; settings: {', '.join(SETTINGS)} "
    "(default sim8). Override any field with --config.<field>=VALUE, e.g. "
    "--config.server.learning_rate=0.2.",
    lock_config=True,
)
_WORKDIR = flags.DEFINE_string(
    "workdir", None, "Directory for the outputs (created if missing)."
)
flags.mark_flags_as_required(["config", "workdir"])


def main(argv):
    if len(argv) > 1:
        _cli.fail(_PROG, f"unexpected arguments: {' '.join(argv[1:])}")
    quiet_backend_probe()
    logging.set_verbosity(logging.INFO)
    config = _cli.config_value(_PROG, _CONFIG)
    with _cli.usage_errors(_PROG):
        registry.check_config(config)
    summary = train.train_and_evaluate(config, _WORKDIR.value)
    print(f"{train.describe(summary)}; outputs in {_WORKDIR.value}")


if __name__ == "__main__":
    app.run(main, flags_parser=_cli.flags_parser(_PROG))
