"""The profiling pass: a worker's step time, peak memory and transfer time, measured.

:func:`profile` times the train step at a few batch sizes on each local JAX
device (compile excluded, each timing ended by ``block_until_ready``), reads
the peak memory from the device or the compiled step, and fits both to lines
in the batch; :func:`measure_transfer` times real round trips to a parameter
server. The results are the :mod:`hpsjax.planning` profiles a plan is made
from (the docs' planning notes say what each term means).
"""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
import math
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from hpsjax._checks import check_int, check_positive, is_int
from hpsjax.planning import (
    DeviceProfile,
    Link,
    TransferProfile,
    WorkerProfile,
)
from hpsjax.transforms import encoded_nbytes, powersgd_nbytes

__all__ = [
    "measure_transfer",
    "profile",
    "tree_wire_nbytes",
]

MIN_SPREAD_SAMPLES = 5
"""Timed steps at a batch size from which a profile reports the step's spread."""


def tree_wire_nbytes(
    tree: Any, codec: Any = None, *, powersgd_rank: int | None = None
) -> int:
    """Payload bytes of ``tree`` on the wire, after ``codec`` where one is given.

    Without a codec every leaf travels as its raw buffer. With a wire codec
    object (``hpsjax.wire._codecs``), each leaf's size is the codec's own count
    (its ``leaf_nbytes``, which the receiver checks); with a quantization
    ``Codec``, ``encoded_nbytes(shape, codec)`` of ``hpsjax.transforms``, the
    same count; with ``powersgd_rank``, its PowerSGD factors'
    ``powersgd_nbytes``.

    Args:
      tree: a pytree of arrays (or ``jax.ShapeDtypeStruct``).
      codec: a wire codec object, a ``hpsjax.transforms.Codec`` or ``None``.
      powersgd_rank: the rank of PowerSGD pushes (not with ``codec``), or
        ``None``.

    Returns:
      The byte count, headers excluded.
    """
    leaves = jax.tree.leaves(tree)
    if powersgd_rank is not None:
        if codec is not None:
            raise ValueError("give codec or powersgd_rank, not both")

        return int(
            sum(powersgd_nbytes(x.shape, x.dtype, powersgd_rank) for x in leaves)
        )
    if codec is None:
        return int(sum(np.dtype(x.dtype).itemsize * math.prod(x.shape) for x in leaves))
    # A wire codec is taken by what it does: profiling sits below the server
    # package, which imports it.
    leaf_nbytes = getattr(codec, "leaf_nbytes", None)
    if leaf_nbytes is not None:
        return int(
            sum(
                leaf_nbytes(i, np.dtype(x.dtype).name, tuple(x.shape))[1]
                for i, x in enumerate(leaves)
            )
        )
    return int(sum(encoded_nbytes(tuple(x.shape), codec) for x in leaves))


def _pulled_version(pulled: Any) -> int:
    """The parameter version in what a client's ``pull()`` returned."""
    version = getattr(pulled, "version", None)
    if version is None and isinstance(pulled, tuple) and len(pulled) == 2:
        version = pulled[1]
    if not is_int(version):
        raise ValueError(
            "cannot read the parameter version from the client's pull() result "
            f"({type(pulled).__name__}); pass an async round-trip callable instead"
        )
    return int(version)


def _is_client(transfer: Any) -> bool:
    return callable(getattr(transfer, "pull", None)) and callable(
        getattr(transfer, "push", None)
    )


async def measure_transfer(
    transfer: Any,
    params: Any,
    *,
    codec: Any = None,
    repeats: int = 3,
    warmup: int = 1,
) -> TransferProfile:
    """Measures real transfer times between this worker and its server.

    ``transfer`` is either a ``hpsjax.ps.Client``, whose ``pull()`` and
    ``push(update, version=..., codec=...)`` are timed one after the other (a
    client not yet connected is connected first and closed after), or an async
    callable ``transfer(update)`` that performs one whole round trip (push
    ``update``, pull the parameters) and is timed as one. A client is also
    timed on a bare request (``refresh_info``, a few bytes each way): the
    push's time beyond it is the server's own time per push, receiving,
    decoding and applying it (``server_seconds``; it also holds the client's
    encoding, small beside the server's apply). The update pushed is a
    tree of zeros shaped like ``params``: it measures the wire and the server's
    handling of a real-sized message, and moves parameters only as far as the
    server's optimizer moves them on a zero gradient (not at all for SGD). Under a
    barrier policy a push waits for the other workers, so measure before training
    starts, with every worker profiling at once, or with a policy that does not
    wait.

    Cancelling is safe: nothing is left half-done on this side (the client's own
    cancellation rules apply); bound it with ``asyncio.wait_for``.

    Args:
      transfer: a client or an async round-trip callable.
      params: the model parameters (their shapes and dtypes set the message size).
      codec: the push codec, ``None`` for raw buffers.
      repeats: timed round trips; the median is reported.
      warmup: untimed round trips first (connection set-up, buffer allocation).

    Returns:
      The measured profile.
    """
    repeats = check_int("repeats", repeats, low=1)
    if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 0:
        raise ValueError(f"warmup must be a non-negative int, got {warmup!r}")
    is_client = _is_client(transfer)
    if not is_client and not callable(transfer):
        raise ValueError(
            "transfer must be a parameter-server Client or an async callable; "
            f"got {type(transfer).__name__}"
        )
    update = jax.tree.map(np.zeros_like, params)
    push_bytes = tree_wire_nbytes(params, codec)
    pull_bytes = tree_wire_nbytes(params)
    pushes, pulls, trips, bare = [], [], [], []
    opened = is_client and getattr(transfer, "closed", False)
    if opened:
        await transfer.connect()
    try:
        for i in range(warmup + repeats):
            t0 = time.perf_counter()
            if is_client:
                pulled = await transfer.pull()
                t1 = time.perf_counter()
                version = _pulled_version(pulled)
                await transfer.push(update, version=version, codec=codec)
                t2 = time.perf_counter()
                if i >= warmup and callable(getattr(transfer, "refresh_info", None)):
                    await transfer.refresh_info()
                    bare.append(time.perf_counter() - t2)
            else:
                result = transfer(update)
                if not inspect.isawaitable(result):
                    raise ValueError(
                        "a transfer callable must be async (return an awaitable)"
                    )
                await result
                t1 = None
                t2 = time.perf_counter()
            if i >= warmup:
                trips.append(t2 - t0)
                if t1 is not None:
                    pulls.append(t1 - t0)
                    pushes.append(t2 - t1)
    finally:
        if opened:
            await transfer.close()
    return TransferProfile(
        round_trip_seconds=statistics.median(trips),
        push_seconds=statistics.median(pushes) if pushes else None,
        pull_seconds=statistics.median(pulls) if pulls else None,
        push_bytes=push_bytes,
        pull_bytes=pull_bytes,
        method="measured",
        server_seconds=(
            max(statistics.median(pushes) - statistics.median(bare), 0.0)
            if pushes and bare
            else None
        ),
    )


def _compiled_peak_bytes(compiled: Any) -> int | None:
    """Peak bytes of a compiled step from XLA's buffer assignment, if reported."""
    try:
        stats = compiled.memory_analysis()
    except (NotImplementedError, RuntimeError):
        return None
    if stats is None:
        return None
    # On CPU, peak_memory_in_bytes can come out below the temporaries alone; the
    # sum of live buffer classes is an upper bound that never undercounts.
    total = (
        stats.argument_size_in_bytes
        + stats.output_size_in_bytes
        + stats.temp_size_in_bytes
        - stats.alias_size_in_bytes
        + stats.generated_code_size_in_bytes
    )
    return int(max(total, getattr(stats, "peak_memory_in_bytes", 0)))


def _profile_device(
    step, params, make_batch, device, batch_sizes, repeats, warmup, time_budget, pace
):
    device_params = jax.device_put(params, device)
    stats = device.memory_stats()
    use_device_stats = bool(stats) and "peak_bytes_in_use" in stats
    times, spreads, marks, compiled_peaks = [], [], [], []
    rose = True
    compile_seconds = 0.0
    for b in batch_sizes:
        if use_device_stats:
            before = device.memory_stats()["peak_bytes_in_use"]
        batch = jax.device_put(make_batch(b), device)
        start = time.perf_counter()
        compiled = step.lower(device_params, batch).compile()
        compile_seconds += time.perf_counter() - start
        start = time.perf_counter()
        for _ in range(warmup):
            t0 = time.perf_counter()
            jax.block_until_ready(compiled(device_params, batch))
            if pace is not None:
                pace(time.perf_counter() - t0)
            if time.perf_counter() - start > time_budget:
                break
        samples = []
        while not samples or (
            len(samples) < repeats and time.perf_counter() - start < time_budget
        ):
            t0 = time.perf_counter()
            jax.block_until_ready(compiled(device_params, batch))
            samples.append(time.perf_counter() - t0)
            if pace is not None:
                pace(samples[-1])
        times.append(statistics.median(samples))
        spreads.append(
            statistics.pstdev(samples) / statistics.fmean(samples)
            if len(samples) >= MIN_SPREAD_SAMPLES
            else None
        )
        compiled_peaks.append(_compiled_peak_bytes(compiled))
        if use_device_stats:
            # Batch sizes run in increasing order, so the process high-water mark
            # read after each is the peak of this size's step (plus whatever else
            # the process holds, which counts against the same bytes_limit)...
            marks.append(int(device.memory_stats()["peak_bytes_in_use"]))
            rose = rose and marks[-1] > before
    if use_device_stats and rose:
        peak, source = tuple(marks), "device"
    elif any(m is None for m in compiled_peaks):
        peak, source = None, None
    else:
        # ... unless a larger program of this process set the mark before: then
        # it reads the same for every size, and XLA's count of the step's
        # buffers is the measure.
        peak, source = tuple(compiled_peaks), "compiled"
    capacity = None
    if stats and stats.get("bytes_limit"):
        capacity = int(stats["bytes_limit"])
    device_profile = DeviceProfile(
        device_id=device.id,
        platform=device.platform,
        device_kind=device.device_kind,
        batch_sizes=tuple(batch_sizes),
        step_times=tuple(max(t, 1e-9) for t in times),
        peak_memory=peak,
        memory_source=source,
        memory_capacity=capacity,
        step_spread=_filled_spread(batch_sizes, spreads),
    )
    return device_profile, compile_seconds


def _filled_spread(
    batch_sizes: Sequence[int], spreads: Sequence[float | None]
) -> tuple[float, ...] | None:
    """Each size's measured spread; a size whose time budget allowed too few
    steps takes the nearest measured size's. ``None`` when none was measured."""
    measured = [
        (b, x) for b, x in zip(batch_sizes, spreads, strict=True) if x is not None
    ]
    if not measured:
        return None
    return tuple(
        x if x is not None else min(measured, key=lambda m: abs(m[0] - b))[1]
        for b, x in zip(batch_sizes, spreads, strict=True)
    )


def profile(
    step_fn: Callable[[Any, Any], Any],
    params: Any,
    make_batch: Callable[[int], Any],
    *,
    batch_sizes: Sequence[int] = (16, 64, 256),
    devices: Sequence[jax.Device] | None = None,
    repeats: int = 5,
    warmup: int = 1,
    time_budget: float = 1.0,
    transfer: Any = None,
    codec: Any = None,
    worker_id: int | str = 0,
    memory_capacity: int | None = None,
    pace: Callable[[float], Any] | None = None,
) -> WorkerProfile:
    r"""Profiles a train step on each local device and the worker's link.

    For every device ``d`` and batch size ``b`` the step is compiled, run
    ``warmup`` times, then timed ``repeats`` times; the median is ``t_d(b)``, and the
    least-squares line

    .. math::

      t_d(b) = a_d + c_d \, b, \qquad a_d, c_d \ge 0

    gives the throughput ``b / t_d(b)`` at any batch. Peak memory per batch size is
    fitted the same way. Devices are measured one after the other so that they do
    not compete for the host.

    Args:
      step_fn: the train step, a pure function ``step_fn(params, batch)`` (model,
        loss and optimizer update); it is jitted here, once per device and batch
        size. Its output is waited for and discarded.
      params: the model parameters (any pytree of arrays).
      make_batch: ``make_batch(b)`` returns a batch of ``b`` samples, the pytree
        ``step_fn`` takes.
      batch_sizes: batch sizes to measure; a wide spread (here 16 to 256) fits the
        line well.
      devices: devices to profile; ``jax.local_devices()`` by default.
      repeats: timed runs per batch size, at most.
      warmup: untimed runs after compiling, at most.
      time_budget: seconds of running (compiling excluded) per batch size and
        device; warm-up and timed runs stop once it is spent, after at least one
        timed run, so that a big model's largest batch does not dominate the
        cost of the pass.
      transfer: how to profile the link to the server: ``None`` (not profiled), a
        :class:`Link` (estimated from bandwidth and latency), a
        :class:`TransferProfile` (already measured, e.g. by awaiting
        :func:`measure_transfer` on the event loop of a connected client), or an
        unconnected ``hpsjax.ps.Client`` or async round-trip callable, measured
        here with ``asyncio.run`` (see :func:`measure_transfer`).
      codec: the push codec; the pushed bytes are ``encoded_nbytes`` of each leaf.
      worker_id: id of this worker.
      memory_capacity: bytes each device may use, overriding the backend's
        ``bytes_limit`` (CPU devices report none).
      pace: called after each warm-up and timed step with the seconds it
        took, outside the timing: e.g. a worker that the run slows down ``k``
        times sleeps ``(k - 1)`` times that, so that workers profiled together
        load the machine as they will in the run.

    Returns:
      A :class:`WorkerProfile` with one :class:`DeviceProfile` per device.

    Raises:
      ValueError: bad arguments (checked before anything runs), or a measured
        transfer requested while an event loop is running in this thread.

    Examples:
      >>> import jax, jax.numpy as jnp
      >>> def step(w, batch):
      ...   return w - 0.1 * jax.grad(lambda w: jnp.mean((batch @ w) ** 2))(w)
      >>> prof = profile(step, jnp.ones(4), lambda b: jnp.ones((b, 4)),
      ...                batch_sizes=(8, 64), repeats=2)
      >>> len(prof.devices) == len(jax.local_devices())
      True

    References:
      Xian, Li, Liu, Guo, Du, "H-PS: A Heterogeneous-Aware Parameter Server With
      Distributed Neural Network Training", IEEE Access, 2021,
      https://doi.org/10.1109/ACCESS.2021.3060154

      Shen, Tang, Zhou, Zhang, Jia, Yu, Zhang, Li, "ASHL: An Adaptive Multi-Stage
      Distributed Deep Learning Training Scheme for Heterogeneous Environments",
      IEEE Transactions on Computers, 2024,
      https://doi.org/10.1109/TC.2023.3315847
    """
    if not callable(step_fn) or not callable(make_batch):
        raise ValueError("step_fn and make_batch must be callable")
    sizes = [check_int("batch size", b, low=1) for b in batch_sizes]
    if not sizes or len(set(sizes)) != len(sizes):
        raise ValueError(f"batch_sizes must be distinct and non-empty, got {sizes}")
    sizes.sort()
    repeats = check_int("repeats", repeats, low=1)
    if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 0:
        raise ValueError(f"warmup must be a non-negative int, got {warmup!r}")
    time_budget = check_positive("time_budget", time_budget)
    if isinstance(worker_id, bool) or not isinstance(worker_id, int | str):
        raise ValueError(f"worker_id must be an int or a str, got {worker_id!r}")
    devices = list(jax.local_devices() if devices is None else devices)
    if not devices:
        raise ValueError("devices is empty")
    if len({d.id for d in devices}) != len(devices):
        raise ValueError("devices repeat")
    if memory_capacity is not None:
        memory_capacity = check_int("memory_capacity", memory_capacity, low=1)
    if pace is not None and not callable(pace):
        raise ValueError(f"pace must be callable or None, got {pace!r}")
    _check_transfer(transfer)

    start = time.perf_counter()
    step = jax.jit(step_fn)
    device_profiles = []
    compile_seconds = 0.0
    for device in devices:
        prof, seconds = _profile_device(
            step,
            params,
            make_batch,
            device,
            sizes,
            repeats,
            warmup,
            time_budget,
            pace,
        )
        if memory_capacity is not None:
            prof = dataclasses.replace(prof, memory_capacity=memory_capacity)
        device_profiles.append(prof)
        compile_seconds += seconds

    if transfer is None or isinstance(transfer, TransferProfile):
        transfer_profile = transfer
    elif isinstance(transfer, Link):
        transfer_profile = transfer.estimate(
            tree_wire_nbytes(params, codec), tree_wire_nbytes(params)
        )
    else:
        transfer_profile = asyncio.run(measure_transfer(transfer, params, codec=codec))

    leaves = jax.tree.leaves(params)
    return WorkerProfile(
        worker_id=worker_id,
        devices=tuple(device_profiles),
        transfer=transfer_profile,
        param_count=int(sum(math.prod(x.shape) for x in leaves)),
        param_bytes=tree_wire_nbytes(params),
        profile_seconds=time.perf_counter() - start,
        compile_seconds=compile_seconds,
    )


def _check_transfer(transfer: Any) -> None:
    """Refuses a ``transfer`` that :func:`profile` cannot measure here."""
    if transfer is None or isinstance(transfer, Link | TransferProfile):
        return
    if not (_is_client(transfer) or callable(transfer)):
        raise ValueError(
            "transfer must be None, a Link, a TransferProfile, a connected "
            f"Client or an async callable; got {type(transfer).__name__}"
        )
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        pass
    else:
        raise ValueError(
            "profile() cannot measure the transfer inside a running event "
            "loop; await measure_transfer(...) and pass its result as transfer="
        )
    if _is_client(transfer) and not getattr(transfer, "closed", True):
        # A connection lives on the event loop that opened it, and profile()
        # would measure on a new one.
        raise ValueError(
            "a connected Client can only be measured on its own event loop: "
            "await measure_transfer(client, ...) there and pass the result as "
            "transfer=, or pass the Client unconnected"
        )
