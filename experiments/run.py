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

from experiments import train

_CONFIG = config_flags.DEFINE_config_file(
    "config",
    None,
    "A scheme's config file, experiments/configs/<scheme>.py[:setting].",
    lock_config=True,
)
_WORKDIR = flags.DEFINE_string("workdir", None, "Directory for the outputs.")
flags.mark_flags_as_required(["config", "workdir"])


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
    logging.set_verbosity(logging.INFO)
    summary = train.train_and_evaluate(_CONFIG.value, _WORKDIR.value)
    reached = summary["time_to_target"]
    print(
        f"{summary['scheme']}: time to {summary['target_accuracy']:g} accuracy "
        f"{'not reached' if reached is None else f'{reached:.2f}s'}; final accuracy "
        f"{summary['final_accuracy']:.4f}; outputs in {_WORKDIR.value}"
    )


if __name__ == "__main__":
    app.run(main)
