"""Settings every test process shares; pytest loads this before any test module.

The suite runs in several processes at once (pytest-xdist, ``-n`` in
``pyproject.toml``), each with its own JAX runtime. On a GPU, JAX would take
three quarters of the device's memory in the first process that touches it and
leave the others too little to start: each process allocates what it uses.
"""

import os

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
