"""The profiling pass in place: a worker measures itself as the run will go.

``python -m hpsjax.profiling.in_place [hpsjax-worker flags] --profile_out PATH``
takes a worker's own command line (its model, data shard, injected slowdown
and link, and its server's address) and writes the worker's profile: the train
step timed in this process, slowed as the flags slow it, and the push and pull
of the real model timed against the server it names, an injected link's delay
added; the launcher runs one per worker, all at once, so that every worker is
measured under the contention of the run (the docs' profiling notes say more).
Exit status: 0 when the profile was written, 1 when the server could not be
reached, 2 for bad flags.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from hpsjax._config_flags import config_kwargs, flag_message
from hpsjax._logs import quiet_backend_probe
from hpsjax.profiling._worker_profile import (
    add_link,
    measure_step,
    profile_in_place,
    with_injection,
    write_profile,
    write_worker_profile,
)
from hpsjax.worker import JoinError, WorkerConfig
from hpsjax.worker import parse_worker_args as parse_args

__all__ = [
    "add_link",
    "main",
    "measure_step",
    "profile_in_place",
    "with_injection",
    "write_profile",
    "write_worker_profile",
]


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m hpsjax.profiling.in_place``; returns the exit status."""
    args = parse_args(argv, prog="python -m hpsjax.profiling.in_place")
    quiet_backend_probe()
    if args.profile_out is None:
        print("hpsjax-profile: --profile_out is required", file=sys.stderr)
        return 2
    try:
        WorkerConfig(**config_kwargs(WorkerConfig, args))  # checked before measuring
        line = write_worker_profile(args)
    except JoinError as e:
        print(f"hpsjax-profile: {e}", file=sys.stderr)
        return 1
    except (ValueError, OSError) as e:
        print(f"hpsjax-profile: {flag_message(str(e), WorkerConfig)}", file=sys.stderr)
        return 2
    print(f"hpsjax-profile: {line}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
