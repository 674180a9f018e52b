"""Settings every test process shares; pytest loads this before any test module.

The suite runs in several processes at once (pytest-xdist, ``-n`` in
``pyproject.toml``), each with its own JAX runtime. On a GPU, JAX would take
three quarters of the device's memory in the first process that touches it and
leave the others too little to start: each process allocates what it uses.

One JAX compilation cache serves the whole test session (fixture
``session_compile_cache``): the process that starts the session makes an empty
directory, which every test process finds in ``HPSJAX_TESTS_JAX_CACHE``, and
removes it at the end. A test that takes the fixture runs with
``JAX_COMPILATION_CACHE_DIR`` naming it, which the worker processes and the
experiments' processes backend read: a worker's step compiled by one test's
workers is loaded from disk by the next test's instead of compiled again. Each
session starts with an empty cache, so a test also passes cold: the cache
changes how long a compile takes, never what a test checks. Tests without the
fixture see no cache, as a user's command without one does.

Each Colab tutorial runs once a session too (``tests/_tutorials.py``): the
tests of what it computes and the docs build that renders it share that run,
through a directory named in ``HPSJAX_TESTS_TUTORIALS``.

The slow tests are started first, the longest of them before the others, so
that the test processes end together instead of one running a two-minute test
while the other has nothing left to do.
"""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile

import pytest

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

# The session's programs are small and run briefly: compiling them is most of
# their time, and LLVM's optimization passes most of a compile. Without them
# (XLA_FLAGS, read by every test process and by the processes it starts) the
# suite spends about a fifth less CPU (test_sim.py, test_quantize.py: 73 ->
# 53 CPU-s; the tutorials and the decisions regression: 142 -> 114). XLA's
# numerics do not depend on it (no fast-math either way): the regression
# fixtures and the tutorials' claims hold with it. Users' runs and the
# benchmarks keep XLA's default level; a level given in XLA_FLAGS is kept.
if "--xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = " ".join(
        [os.environ.get("XLA_FLAGS", ""), "--xla_backend_optimization_level=0"]
    ).strip()

_SESSION_CACHE = "HPSJAX_TESTS_JAX_CACHE"
# The tutorials executed this session (tests/_tutorials.py).
_SESSION_TUTORIALS = "HPSJAX_TESTS_TUTORIALS"
for _variable, _prefix in (
    (_SESSION_CACHE, "hpsjax-tests-jax-cache-"),
    (_SESSION_TUTORIALS, "hpsjax-tests-tutorials-"),
):
    if _variable not in os.environ:
        # The session's first process (pytest-xdist's controller, or the only
        # one with -n 0); the test processes it starts inherit the variable.
        os.environ[_variable] = tempfile.mkdtemp(prefix=_prefix)
        atexit.register(shutil.rmtree, os.environ[_variable], ignore_errors=True)


@pytest.fixture
def session_compile_cache(monkeypatch):
    """The session's JAX compilation cache, in ``JAX_COMPILATION_CACHE_DIR``
    for the processes this test starts (every program cached, however quick
    its compile); the directory's path."""
    from hpsjax._compile_cache import cache_env

    path = os.environ[_SESSION_CACHE]
    for name, value in cache_env(path).items():
        monkeypatch.setenv(name, value)
    return path


# The tests that run longest (a minute or more on 2 cores), started before any
# other; then the other slow tests, then the fast ones, each in collection order.
_LONGEST = (
    "tests/docs/test_docs_site.py::test_docs_build",
    "tests/experiments/e2e/test_devices_suite.py::test_the_devices_suite",
    "tests/test_ray_launch.py::test_the_ray_backend",
    "tests/experiments/test_experiments.py::test_processes_",
    "tests/experiments/test_calibrate.py::test_calibrate_end_to_end",
    "tests/experiments/e2e/test_chaos.py::test_a_run_with_killed",
    "tests/experiments/test_research_schemes.py::test_ashl_reference_on_processes",
)


def _start_rank(item: pytest.Item) -> tuple[int, int]:
    for rank, prefix in enumerate(_LONGEST):
        if item.nodeid.startswith(prefix):
            return (0, rank)
    return (1 if item.get_closest_marker("slow") else 2, 0)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    # A stable sort: every test process collects the same order (pytest-xdist
    # requires it), and tests of one rank keep their collection order.
    items.sort(key=_start_rank)
