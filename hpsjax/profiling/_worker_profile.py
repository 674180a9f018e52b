"""A worker's profile from its own ``hpsjax-worker`` flags, its link measured or given.

:func:`profile_in_place` is what ``hpsjax-worker --profile_out`` and
``python -m hpsjax.profiling.in_place`` run: the train step timed in this
process (slowed as the flags slow it) and, when the flags name a server
(``--port`` or ``--servers``), the push and pull of the real model timed
against it (:func:`hpsjax.profiling.measure_transfer`, with the server's own
time per push), an injected link's delay added. Without a server,
``--profile_link BYTES_PER_S[,LATENCY_S]`` gives the link the profile counts
(:class:`hpsjax.planning.Link`); with neither, only an injected link
(``--bandwidth``, ``--latency``) or none (``"transfer": null``).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import math
import pathlib
import time
from typing import Any

import jax
import jax.numpy as jnp
import optax

from hpsjax import models, profiling
from hpsjax._compile_cache import use_compile_cache
from hpsjax.planning import Link, TransferProfile
from hpsjax.profiling._profile import measure_transfer, tree_wire_nbytes
from hpsjax.transforms import Codec
from hpsjax.worker import (
    check_task_fits,
    connect,
    data_shard,
    load_dataset,
    make_client,
    make_heterogeneity,
    make_local_optimizer,
    make_model,
    make_sharded_client,
    make_task,
    server_address,
    task_loss,
)

__all__ = [
    "add_link",
    "measure_step",
    "parse_profile_link",
    "profile_in_place",
    "profile_summary",
    "with_injection",
    "write_profile",
    "write_worker_profile",
]


def parse_profile_link(text: str | None) -> Link | None:
    """``--profile_link``'s value: ``BYTES_PER_S[,LATENCY_S]``, or ``None``.

    Raises:
      ValueError: one line naming the flag and the value.
    """
    if text is None:
        return None
    parts = str(text).split(",")
    try:
        if len(parts) > 2:
            raise ValueError
        bandwidth = float(parts[0])
        latency = float(parts[1]) if len(parts) == 2 else 0.0
        if not (math.isfinite(bandwidth) and bandwidth > 0):
            raise ValueError
        if not (math.isfinite(latency) and latency >= 0):
            raise ValueError
    except ValueError:
        raise ValueError(
            f"--profile_link must be BYTES_PER_S[,LATENCY_S] (a bandwidth > 0 "
            f"and a latency >= 0 in seconds, e.g. 1.25e9,0.0001), got {text!r}"
        ) from None
    return Link(bandwidth=bandwidth, latency=latency)


def add_link(measured: Any, injected: Any) -> Any:
    """A measured transfer with an injected link's delay added to each message.

    Args:
      measured: the :class:`~hpsjax.planning.TransferProfile` timed against
        the server.
      injected: the injected link's estimate, or ``None``.

    Returns:
      The transfer a worker with that link will see (``measured``'s method).
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
    added (:func:`add_link`); without one, ``--profile_link`` (when given)
    is the link counted, an injected one added. The run's compilation cache
    (``JAX_COMPILATION_CACHE_DIR``) is used when set.

    Returns:
      A :class:`~hpsjax.planning.WorkerProfile`, slowed as the flags slow the
      worker at the start.

    Raises:
      ValueError: a bad ``--profile_link``, or ``--profile_link`` beside a
        server address (the server's link is timed); checked before anything
        is measured.
      JoinError: the server named could not be joined.
    """
    given = parse_profile_link(getattr(args, "profile_link", None))
    if given is not None and _has_server(args):
        raise ValueError(
            "--profile_link is for a profile without a server: with --port or "
            "--servers the link to the server is timed"
        )
    use_compile_cache()
    if not _has_server(args):
        measured, spec = measure_step(args)
        profile = with_injection(measured, args, spec)
        if given is None:
            return profile
        codec = None
        if args.bits is not None:
            codec = Codec("sign" if args.bits == 1 else "uniform", args.bits)
        estimate = given.estimate(
            tree_wire_nbytes(spec, codec, powersgd_rank=args.powersgd_rank),
            tree_wire_nbytes(spec),
        )
        return dataclasses.replace(
            profile, transfer=add_link(estimate, profile.transfer)
        )
    measured, spec, link = asyncio.run(_measure(args))
    profile = with_injection(measured, args, spec)
    return dataclasses.replace(profile, transfer=add_link(link, profile.transfer))


def profile_summary(args: argparse.Namespace, profile: Any) -> str:
    """One line: the step at the flags' batch, the link counted, and why."""
    step = profile.devices[0].step_time(args.batch_size)
    transfer = profile.transfer
    if transfer is None:
        link = (
            "no link counted (give --port of a server to time it, or "
            "--profile_link BYTES_PER_S[,LATENCY_S])"
        )
    else:
        how = "timed" if transfer.method == "measured" else "estimated"
        link = f"{transfer.round_trip_seconds * 1e3:.1f} ms push+pull ({how}"
        if transfer.server_seconds is not None:
            link += f"; {transfer.server_seconds * 1e3:.1f} ms of it the server's"
        link += ")"
    return (
        f"worker {args.worker_id}: {step * 1e3:.1f} ms a step of "
        f"{args.batch_size}, {link}"
    )


def write_worker_profile(args: argparse.Namespace) -> str:
    """Profiles the flags' worker, writes ``args.profile_out``; returns
    :func:`profile_summary`'s line.

    Raises:
      JoinError: the server named could not be joined (nothing is written).
      ValueError: a bad flag value (nothing is written).
    """
    profile = profile_in_place(args)
    pathlib.Path(args.profile_out).write_text(profile.to_json())
    return f"{profile_summary(args, profile)}; wrote the profile to {args.profile_out}"


def measure_step(args: argparse.Namespace, *, pace=None):
    """Profiles the flags' train step on this machine, nothing injected.

    ``pace`` goes to :func:`hpsjax.profiling.profile` (a slowed-down worker
    profiled beside others sleeps after its steps as it will in the run).

    Returns:
      ``(profile, spec)``: the :class:`~hpsjax.planning.WorkerProfile` (no
      transfer) and the parameters' shapes and dtypes.
    """

    task = make_task(args)
    index, count = data_shard(args)
    train = load_dataset(args).shard(count, index)
    graphdef, params, stats = models.split_trainable(make_model(args, train))
    stream = train.batches(1, seed=index)
    optimizer = make_local_optimizer(args) or optax.sgd(1.0)
    loss_fn = task_loss(task, graphdef, stats)
    check_task_fits(task, loss_fn, params, stats, train.batches(2, seed=0).next())

    def mean_loss(params, batch):
        if stats is None:
            return jnp.mean(loss_fn(params, batch))
        losses, _ = loss_fn(params, stats, batch)
        return jnp.mean(losses)

    def step(params, batch):
        grads = jax.grad(lambda p: mean_loss(p, batch))(params)
        updates, _ = optimizer.update(grads, optimizer.init(params), params)
        return optax.apply_updates(params, updates)

    try:
        sizes = [int(s) for s in args.profile_batch_sizes.split(",") if s.strip()]
    except ValueError:
        raise ValueError(
            f"--profile_batch_sizes must be integers, got {args.profile_batch_sizes!r}"
        ) from None
    # Through the package, so that a test can stand in for the pass.
    measured = profiling.profile(
        step,
        params,
        lambda b: jax.tree.map(jnp.asarray, stream.next(b)),
        batch_sizes=sizes,
        repeats=args.profile_repeats,
        worker_id=0 if args.worker_id is None else args.worker_id,
        pace=pace,
    )
    spec = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params)
    return measured, spec


def with_injection(measured, args: argparse.Namespace, spec):
    """A measured profile as the flags' worker will train: slowed, linked.

    The slowdown in force at the start multiplies the step times
    (``WorkerProfile.with_slowdown``); an injected link cap or latency gives the
    transfer estimate, for pushes encoded with ``--bits`` or as the factors of
    ``--powersgd_rank`` (``powersgd_nbytes`` per leaf).

    Args:
      measured: a :class:`~hpsjax.planning.WorkerProfile` from
        :func:`measure_step`.
      args: the worker's parsed flags.
      spec: the parameters' shapes and dtypes.

    Returns:
      The profile, with ``worker_id`` from the flags (0 without one).
    """

    het = make_heterogeneity(args)
    codec = None
    if args.bits is not None:
        codec = Codec("sign" if args.bits == 1 else "uniform", args.bits)
    push_bytes = tree_wire_nbytes(spec, codec, powersgd_rank=args.powersgd_rank)
    pull_bytes = tree_wire_nbytes(spec)
    bandwidth = het.bandwidth_at(0.0)
    if bandwidth is not None:
        transfer = Link(bandwidth=bandwidth, latency=het.latency).estimate(
            push_bytes, pull_bytes
        )
    elif het.latency > 0:
        transfer = TransferProfile(
            round_trip_seconds=2 * het.latency,
            push_seconds=het.latency,
            pull_seconds=het.latency,
            push_bytes=push_bytes,
            pull_bytes=pull_bytes,
            method="estimated",
        )
    else:
        transfer = None
    return dataclasses.replace(
        measured.with_slowdown(het.slowdown_at(0.0)),
        worker_id=0 if args.worker_id is None else args.worker_id,
        transfer=transfer,
    )


def write_profile(args: argparse.Namespace, path: str | pathlib.Path) -> None:
    """Profiles the flags' worker on this machine and writes its profile (JSON)."""
    measured, spec = measure_step(args)
    pathlib.Path(path).write_text(with_injection(measured, args, spec).to_json())
