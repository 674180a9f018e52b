"""``python -m hpsjax.launch``: see :mod:`hpsjax.launch`."""

import sys

from hpsjax.launch._cli import main

sys.exit(main())
