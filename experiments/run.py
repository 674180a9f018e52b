r"""Train one scheme: ``python -m experiments.run --config=... --workdir=...``.

Example::

  python -m experiments.run --config=experiments/configs/hps.py:sim8 \
      --workdir=/tmp/hpsjax/hps

Any config field can be overridden from the command line, e.g.
``--config.backend=processes`` or ``--config.server.learning_rate=0.2``. The logic
is :func:`experiments.train.train_and_evaluate`; this file only parses flags.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from experiments import _cli, registry, train
from hpsjax._logs import quiet_backend_probe

_PROG = "experiments.run"


def parser() -> _cli.Parser:
    """The command's flags."""
    p = _cli.Parser(_PROG, description=__doc__.split("\n\n", 1)[0])
    _cli.add_config_flag(p)
    p.add_argument(
        "--workdir",
        required=True,
        help="Directory for the outputs (created if missing).",
    )
    return p


def main(argv: Sequence[str] | None = None) -> None:
    args = parser().parse(argv)
    with _cli.usage_errors(_PROG):
        config = _cli.config_of(args)
        registry.check_config(config)
    config.freeze()
    quiet_backend_probe()
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(message)s")
    summary = train.train_and_evaluate(config, args.workdir)
    print(f"{train.describe(summary)}; outputs in {args.workdir}")


if __name__ == "__main__":
    main()
