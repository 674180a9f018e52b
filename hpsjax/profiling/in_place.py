"""The profiling pass in place: a worker measures itself as the run will go.

``python -m hpsjax.profiling.in_place [hpsjax-worker flags] --profile_out PATH``
takes a worker's own command line (its model, data shard, injected slowdown
and link, and its server's address) and writes the worker's profile: the train
step timed in this process (:func:`hpsjax.worker._cli.measure_step`), slowed as
the flags slow it, and the push and pull of the real model timed against the
server it names (:func:`hpsjax.profiling.measure_transfer`), an injected link's
delay added. The launcher runs one such process per worker, all at once, against
a throwaway server of the run's model: every worker is measured beside the
others, under the contention of the run, and the plan counts each one's link.

Without a server address the profile has no measured link: only an injected
one (``--bandwidth``, ``--latency``), or none at all (``"transfer": null``, and
the plan then counts no transfer time).

Exit status: 0 when the profile was written, 1 when the server could not be
reached, 2 for bad flags.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import pathlib
import sys
import time
from collections.abc import Sequence
from typing import Any

import jax

from hpsjax import models
from hpsjax._compile_cache import use_compile_cache
from hpsjax._logs import quiet_backend_probe
from hpsjax.profiling import measure_transfer, tree_wire_nbytes
from hpsjax.transforms import Codec
from hpsjax.worker._build import (
    JoinError,
    connect,
    data_shard,
    load_dataset,
    make_client,
    make_heterogeneity,
    make_model,
    make_sharded_client,
    measure_step,
    server_address,
    with_injection,
)
from hpsjax.worker._cli import parse_args

__all__ = ["add_link", "main", "profile_in_place"]


def add_link(measured: Any, injected: Any) -> Any:
    """A measured transfer with an injected link's delay added to each message.

    Args:
      measured: the :class:`~hpsjax.profiling.TransferProfile` timed against
        the server.
      injected: the injected link's estimate, or ``None``.

    Returns:
      The transfer a worker with that link will see (method ``"measured"``).
    """
    if injected is None:
        return measured

    def plus(a: float | None, b: float | None) -> float | None:
        return None if a is None or b is None else a + b

    return dataclasses.replace(
        measured,
        round_trip_seconds=measured.round_trip_seconds + injected.round_trip_seconds,
        push_seconds=plus(measured.push_seconds, injected.push_seconds),
        pull_seconds=plus(measured.pull_seconds, injected.pull_seconds),
    )


def _has_server(args: argparse.Namespace) -> bool:
    return args.servers is not None or args.port is not None


def _spec(args: argparse.Namespace) -> Any:
    """The shapes and dtypes of the flags' model parameters."""
    index, count = data_shard(args)
    _, params, _ = models.split_trainable(
        make_model(args, load_dataset(args).shard(count, index))
    )
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params)


async def _measure(args: argparse.Namespace) -> tuple[Any, Any, Any]:
    """Compiles, joins the server, times the step, then times the link.

    The step is compiled first, for every profiled batch size (a pass of one
    timed step each, whose programs the compilation cache keeps); the first
    pull waits for every worker when the server expects them all
    (``expected_workers``), so no worker's timing overlaps another's compile:
    the workers then time their steps together, loading the compiled
    programs, and their transfers after, each under the others' load.

    Returns:
      ``(measured, spec, transfer)``: the step's profile, the parameters'
      shapes and dtypes, and the link as timed (no injected delay).
    """
    spec = _spec(args)
    warm = argparse.Namespace(**{**vars(args), "profile_repeats": 1})
    await asyncio.to_thread(measure_step, warm)
    # As slowed in the run: a sleep of (k - 1) times each step.
    slowdown = make_heterogeneity(args).slowdown_at(0.0)

    def pace(seconds: float) -> None:
        time.sleep((slowdown - 1.0) * seconds)

    if args.servers is not None:
        client = make_sharded_client(args, args.servers, spec)
    else:
        client = make_client(args, (args.host, args.port))
    await connect(
        client, spec, connect_timeout=args.connect_timeout, where=server_address(args)
    )
    try:
        server_params, _ = await client.pull()
        measured, spec = await asyncio.to_thread(measure_step, args, pace=pace)
        codec = None
        if args.bits is not None:
            codec = Codec("sign" if args.bits == 1 else "uniform", args.bits)
        if args.servers is not None:
            # A sharded version is no int: time whole round trips.
            async def trip(update: Any) -> None:
                _, version = await client.pull()
                await client.push(update, version=version, codec=codec)

            link = await measure_transfer(trip, server_params, codec=codec)
        else:
            link = await measure_transfer(client, server_params, codec=codec)
    finally:
        await client.close()
    if args.powersgd_rank is not None:
        # Timed with raw pushes: the push's time scaled to its factors' bytes.
        push_bytes = tree_wire_nbytes(spec, powersgd_rank=args.powersgd_rank)
        scale = push_bytes / max(link.push_bytes, 1)
        push = None if link.push_seconds is None else link.push_seconds * scale
        trip_seconds = link.round_trip_seconds
        if link.push_seconds is not None:
            trip_seconds += push - link.push_seconds
        link = dataclasses.replace(
            link, push_seconds=push, round_trip_seconds=trip_seconds,
            push_bytes=push_bytes,
        )  # fmt: skip
    return measured, spec, link


def profile_in_place(args: argparse.Namespace) -> Any:
    """The profile of the worker that ``args`` (its parsed flags) describe.

    The step is timed in this process; with a server address in the flags the
    push and pull are timed against that server, an injected link's delay
    added (:func:`add_link`). The run's compilation cache
    (``JAX_COMPILATION_CACHE_DIR``) is used when set.

    Returns:
      A :class:`~hpsjax.profiling.WorkerProfile`, slowed as the flags slow the
      worker at the start.
    """
    use_compile_cache()
    if not _has_server(args):
        measured, spec = measure_step(args)
        return with_injection(measured, args, spec)
    measured, spec, link = asyncio.run(_measure(args))
    profile = with_injection(measured, args, spec)
    return dataclasses.replace(profile, transfer=add_link(link, profile.transfer))


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m hpsjax.profiling.in_place``; returns the exit status."""
    args = parse_args(argv)
    quiet_backend_probe()
    if args.profile_out is None:
        print("hpsjax-profile: --profile_out is required", file=sys.stderr)
        return 2
    try:
        profile = profile_in_place(args)
    except JoinError as e:
        print(f"hpsjax-profile: {e}", file=sys.stderr)
        return 1
    except (ValueError, OSError) as e:
        print(f"hpsjax-profile: {e}", file=sys.stderr)
        return 2
    pathlib.Path(args.profile_out).write_text(profile.to_json())
    step = profile.devices[0].step_time(args.batch_size)
    link = (
        "no link"
        if profile.transfer is None
        else (f"{profile.transfer.round_trip_seconds * 1e3:.1f} ms push+pull")
    )
    print(
        f"hpsjax-profile: worker {args.worker_id}: {step * 1e3:.1f} ms a step of "
        f"{args.batch_size}, {link}; wrote {args.profile_out}",
        flush=True,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
