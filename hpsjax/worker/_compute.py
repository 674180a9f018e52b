"""The arithmetic of a worker's rounds: the compiled step, local steps, the update.

:class:`RoundCompute` runs in the worker's compute and encoding threads and
decides nothing: it compiles the train step ahead of the rounds (a new batch
size beside them), runs a round's local steps on the worker's devices (one
gradient over several, or the local optimizer's steps) with the injected
slowdown, and scales and encodes the update the worker core said to push
(quantized, PowerSGD factors, top-k) with error feedback applied once.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import itertools
import math
import time
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from hpsjax._devices import multi_device_grad
from hpsjax.transforms import (
    Codec,
    Stage,
    current_stage,
    hybrid_stages,
    local_steps,
    pending_update,
    power_sgd,
    push_due,
    quantize,
    sparse_encoded,
    sparse_push_transform,
    top_k,
)
from hpsjax.wire import PowerSGDCodec, QuantizedCodec, TopKCodec
from hpsjax.worker._core import (
    Compute,
    Push,
)
from hpsjax.worker._hetero import Injector

__all__ = ["RoundCompute", "push_compression"]


def _shapes_key(batch: Any) -> tuple:
    return tuple((tuple(x.shape), str(x.dtype)) for x in jax.tree.leaves(batch))


def push_compression(config: Any) -> tuple[Any, optax.GradientTransformation] | None:
    """How a worker of ``config`` (a :class:`~hpsjax.worker.WorkerOptions`)
    compresses its pushes: ``(wire codec, transform)``, or ``None`` for
    float32 pushes (top-k from a stage on is the worker core's).

    The one rule for real workers and the simulator (which takes the run's
    worker settings, :mod:`hpsjax.config`): ``push_transform`` (SparseLoCo's,
    DeMo's or Streaming DiLoCo's, whose nonzero entries go out as top-k
    leaves), else PowerSGD at ``powersgd_rank``, else ``bits``-bit
    quantization (sign for 1 bit); each with ``error_feedback``, seeded by
    ``seed``. The codec describes to the wire the bytes the transform kept.
    """
    if config.push_transform is not None:
        return TopKCodec, sparse_push_transform(config.push_transform)
    if config.powersgd_rank is not None:
        # The wire reads each leaf's rank from the factors.
        return PowerSGDCodec, power_sgd(
            config.powersgd_rank, error_feedback=config.error_feedback, seed=config.seed
        )
    if config.bits is None:
        return None
    scheme = "sign" if config.bits == 1 else "uniform"
    # The transform builds its codec from the same arguments.
    codec = QuantizedCodec(Codec(scheme, config.bits, stochastic=config.stochastic))
    return codec, quantize(
        config.bits,
        scheme=scheme,
        stochastic=config.stochastic,
        error_feedback=config.error_feedback,
        seed=config.seed,
    )


# Compiles a worker's step for a batch size new to it, beside its rounds.
_COMPILER = concurrent.futures.ThreadPoolExecutor(1, "hpsjax-worker-compile")


class _Computed(NamedTuple):
    update: Any  # tree like params, float (device arrays)
    version: int
    loss: float
    local_steps: int
    batch_size: int
    compute_s: float
    slowdown_s: float
    compile_s: float
    stage: int | None
    finite: bool = True  # the loss and every value of the update
    decode_s: float = 0.0  # putting the pulled parameters on the device


@jax.jit
def _all_finite(tree: Any) -> jax.Array:
    """Whether every value of a tree of float arrays is finite, as a bool array."""
    return jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree)]))


class _Prepared(NamedTuple):
    update: Any  # numpy tree, or a ShapeDtypeStruct tree when `encoded` is set
    encoded: Any  # Encoded (TopKEncoded, PowerSGDEncoded) per leaf, or None
    nbytes: int
    codec: Any = None  # the wire codec (hpsjax.wire._codecs) of `encoded`
    encode_s: float = 0.0  # scaling, compressing and copying it to the host


def _scale_by_lr_scale() -> optax.GradientTransformationExtraArgs:
    """Scales updates by the keyword extra argument ``lr_scale`` (default 1)."""

    def init_fn(params):
        del params
        return optax.EmptyState()

    def update_fn(updates, state, params=None, *, lr_scale=None, **extra_args):
        del params, extra_args
        if lr_scale is not None:
            updates = jax.tree.map(
                lambda u: u * jnp.asarray(lr_scale, u.dtype), updates
            )
        return updates, state

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def _split_evenly(total: int, parts: int) -> tuple[int, ...]:
    base, extra = divmod(total, parts)
    return tuple(base + (1 if i < extra else 0) for i in range(parts))


def _tree_nbytes(tree: Any) -> int:
    return int(sum(np.asarray(x).nbytes for x in jax.tree.leaves(tree)))


class RoundCompute:
    """A worker's compute: its step, optimizer state, model state and compressors.

    Args:
      config: the worker's :class:`~hpsjax.worker.WorkerConfig`.
      loss_fn: as :class:`~hpsjax.worker.Worker` takes it.
      batches: as :class:`~hpsjax.worker.Worker` takes it.
      local_optimizer: as :class:`~hpsjax.worker.Worker` takes it.
      stages: as :class:`~hpsjax.worker.Worker` takes it.
      devices: the local devices to compute on, the first one home.
      state: the model's own state, or ``None``.
      injector: the worker's :class:`~hpsjax.worker.Injector` (its slowdown).
    """

    def __init__(
        self,
        config: Any,
        *,
        loss_fn: Callable,
        batches: Callable[[int], Any],
        local_optimizer: Any,
        stages: tuple | None,
        devices: list,
        state: Any,
        injector: Injector,
    ):
        self._config = config
        self._loss_fn = loss_fn
        self._batches = batches
        self._devices = devices
        self._state = state
        self._stages = stages
        self._injector = injector
        self._tx = self._make_transform(local_optimizer, stages)
        self._apply = None
        self._opt_state = None
        # The transform compressing pushes (bits or powersgd_rank), its state,
        # and the wire codec of what it keeps (which finds that in its state).
        self._compressor = None
        self._compressor_state = None
        self._codec = None
        self._topk = None  # (ratio, jitted top_k update, its state)
        # The shapes the compressor was made for, and its update once warmed.
        self._compressor_spec = None
        self._compressor_warm = None
        self._spec_like = None
        self._compiled: dict[tuple, Any] = {}
        # Batch shapes compiling in the background, and the last batch size
        # computed with (what a round uses while its own batch compiles).
        self._compiling: dict[tuple, concurrent.futures.Future] = {}
        self._last_batch: tuple[int, ...] | None = None
        self._peeked: Any = None  # the batch drawn to compile the first round

    @property
    def compiled_any(self) -> bool:
        """Whether a step has been compiled already."""
        return bool(self._compiled)

    @property
    def compresses(self) -> bool:
        """Whether pushes go through a compressor (bits, PowerSGD, a push
        transform)."""
        return self._compressor is not None

    @staticmethod
    def _make_transform(local_optimizer, stages):
        if stages is not None:
            if not stages or not all(isinstance(s, Stage) for s in stages):
                raise ValueError("stages must be a non-empty list of Stage")
            scaled = [
                dataclasses.replace(
                    s, transform=optax.chain(s.transform, _scale_by_lr_scale())
                )
                for s in stages
            ]
            return hybrid_stages(scaled)
        if local_optimizer is None:
            return None
        if not isinstance(local_optimizer, optax.GradientTransformation):
            raise ValueError("local_optimizer must be an optax GradientTransformation")
        return optax.chain(local_optimizer, _scale_by_lr_scale(), local_steps(1))

    def _make_compressor(self):
        self._codec, self._compressor = push_compression(self._config)
        self._compress_update = jax.jit(self._compressor.update)

    @property
    def state(self) -> Any:
        """The model state this worker keeps (``state``), as of its last step."""
        return self._state

    def _step_fn(self):
        loss_fn, tx = self._loss_fn, self._tx
        stateful = self._state is not None

        def mean_loss(params, state, batch):
            if stateful:
                losses, state = loss_fn(params, state, batch)
            else:
                losses = loss_fn(params, batch)
            return jnp.mean(losses), state

        grad = jax.value_and_grad(mean_loss, has_aux=True)

        if tx is None:

            def grad_step(params, state, batch, lr_scale):
                (loss, state), grads = grad(params, state, batch)
                scaled = jax.tree.map(lambda g: g * lr_scale.astype(g.dtype), grads)
                return scaled, loss, state

            return grad_step

        def local_step(params, state, opt_state, batch, lr_scale, local_steps):
            (loss, state), grads = grad(params, state, batch)
            updates, opt_state = tx.update(
                grads,
                opt_state,
                params,
                lr_scale=lr_scale,
                local_steps=local_steps,
                loss=loss,
            )
            return optax.apply_updates(params, updates), state, opt_state, loss

        return local_step

    def _apply_fn(self):
        tx = self._tx

        def apply(params, opt_state, grads, loss, lr_scale, local_steps):
            updates, opt_state = tx.update(
                grads,
                opt_state,
                params,
                lr_scale=lr_scale,
                local_steps=local_steps,
                loss=loss,
            )
            return optax.apply_updates(params, updates), opt_state

        return jax.jit(apply)

    def _compiled_step(self, args: tuple, batch: Any) -> tuple[Any, float]:
        """The AOT-compiled step for this batch's shapes, and seconds compiling.

        Compiling ahead keeps compile time out of ``compute_s``, so a slowdown
        factor never multiplies it.
        """
        key = _shapes_key(batch)
        compiled = self._compiled.get(key)
        if compiled is not None:
            return compiled, 0.0
        t = time.perf_counter()
        compiled = self._compile(args)
        self._compiled[key] = compiled
        return compiled, time.perf_counter() - t

    def _compile(self, args: tuple) -> Any:
        return jax.jit(self._step_fn()).lower(*args).compile()

    def _compiling_beside(self, args: tuple, batch: Any) -> bool:
        """Whether ``batch``'s step is compiling beside the rounds.

        A batch size new to this worker (a revised plan) is compiled on a
        thread of its own; while it compiles (this returns true) the round
        computes with the batch it computed last, so a re-plan never stalls
        it (on a busy machine a compile takes seconds, and under BSP every
        worker would wait). The first batch, or one whose compile failed (to
        raise its error in the round), compiles in the round.
        """
        key = _shapes_key(batch)
        if (
            key in self._compiled
            or self._last_batch is None
            or not self._config.compile_beside
        ):
            return False
        pending = self._compiling.get(key)
        if pending is None:
            self._compiling[key] = _COMPILER.submit(self._compile, args)
            return True
        if not pending.done():
            return True
        del self._compiling[key]
        if pending.exception() is None:
            self._compiled[key] = pending.result()
        return False

    def _step_args(self, local, batch, lr_scale, steps_arg) -> tuple:
        if self._tx is None:
            return (local, self._state, batch, lr_scale)
        return (local, self._state, self._opt_state, batch, lr_scale, steps_arg)

    def _take(self, n: int) -> Any:
        """The next batch of ``n`` examples (the one drawn to compile with
        first, if it has that size)."""
        peeked, self._peeked = self._peeked, None
        if peeked is not None and len(jax.tree.leaves(peeked)[0]) == n:
            return peeked
        return self._batches(n)

    def compile_first(self, spec: Any, device_batches: tuple[int, ...]) -> float:
        """Compiles the step for the first round's batch, before joining.

        Runs in the compute thread on parameters of the server's shapes (zeros)
        and a batch drawn for the first round (kept for it), and executes the
        step once there, so that no round, and no barrier of the server's,
        waits on this compile or the step's first execution. Returns the
        seconds it took (0 when the step was compiled already, or with several
        devices, whose step is compiled at its first call).
        """
        if len(self._devices) > 1:
            return 0.0
        home = self._devices[0]
        zeros = jax.tree.map(lambda s: np.zeros(s.shape, s.dtype), spec)
        self.initialise(zeros)
        batch = self._peeked = self._batches(sum(device_batches))
        args = self._step_args(
            jax.device_put(zeros, home),
            jax.device_put(batch, home),
            jnp.asarray(1.0, jnp.float32),
            jnp.asarray(1, jnp.int32),
        )
        step, seconds = self._compiled_step(args, batch)
        self._first_execution(step, args, tuple(device_batches))
        self._last_batch = tuple(device_batches)
        _all_finite(jax.device_put(zeros, home))  # compiled here too
        return seconds

    def precompile(self, spec: Any, sizes: tuple[int, ...]) -> tuple[int, float]:
        """Compiles the step for each batch size of ``sizes`` not compiled yet,
        before joining (after :meth:`compile_first`), and runs it once: a
        plan's later batch (a pilot's, on :func:`~hpsjax.planning.batch_grid`)
        then compiles nothing beside the rounds and its first round holds no
        first execution. With a persistent compilation cache that holds them,
        each compile is a load. Returns how many it compiled and the
        seconds it took (none with several devices, whose step compiles at
        its first call)."""
        if len(self._devices) > 1:
            return 0, 0.0
        home = self._devices[0]
        zeros = jax.device_put(
            jax.tree.map(lambda s: np.zeros(s.shape, s.dtype), spec), home
        )
        count, seconds = 0, 0.0
        for size in sizes:
            batch = jax.device_put(self._batches(int(size)), home)
            if _shapes_key(batch) in self._compiled:
                continue
            args = self._step_args(
                zeros, batch, jnp.asarray(1.0, jnp.float32), jnp.asarray(1, jnp.int32)
            )
            step, spent = self._compiled_step(args, batch)
            self._first_execution(step, args, (int(size),))
            count, seconds = count + 1, seconds + spent
        return count, seconds

    def _first_execution(self, step: Any, args: tuple, key: tuple) -> None:
        """Runs a compiled ``step`` once before joining, its results dropped,
        and counts it as the shape's first execution with the injector (not
        slowed, not in its median): on proc4's CPU workers a step's first
        execution takes 2-8 times a step, which a round would otherwise hold
        (the first round, and the first at each of a pilot's batches)."""
        t = time.perf_counter()
        jax.block_until_ready(step(*args))
        self._injector.after_compute(time.perf_counter() - t, key=key)

    def _next_batches(self, settings: Compute) -> list[Any]:
        total = sum(settings.device_batches)
        batch = self._take(total)
        if len(settings.device_batches) == 1:
            return [batch]
        bounds = np.cumsum((0, *settings.device_batches))
        return [
            jax.tree.map(lambda x, a=a, b=b: x[a:b], batch)
            for a, b in itertools.pairwise(bounds)
        ]

    def compute_round(self, params: Any, version: int, settings: Compute):
        """Runs one round of local steps; called in the compute thread."""
        home = self._devices[0]
        device_batches = settings.device_batches
        t = time.perf_counter()
        local = jax.block_until_ready(jax.device_put(params, home))
        decode_s = time.perf_counter() - t
        lr_scale = jnp.asarray(settings.lr_scale, jnp.float32)
        steps_arg = jnp.asarray(settings.local_steps, jnp.int32)
        compute = slowdown = compile_s = 0.0
        losses = []
        steps = 0
        multi = len(self._devices) > 1
        keep_last = False
        while True:
            if keep_last:
                batches = [self._batches(device_batches[0])]
            else:
                batches = self._next_batches(settings)
            if multi:
                t = time.perf_counter()
                loss, grads = multi_device_grad(
                    self._loss_fn, local, batches, self._devices
                )
                # Every result waited for, as below.
                if self._tx is None:
                    update = jax.tree.map(lambda g: g * settings.lr_scale, grads)
                    jax.block_until_ready((update, loss))
                else:
                    local, self._opt_state = self._apply(
                        local, self._opt_state, grads, loss, lr_scale, steps_arg
                    )
                    jax.block_until_ready((local, self._opt_state, loss))
            else:
                batch = jax.device_put(batches[0], home)
                state = self._state
                args = self._step_args(local, batch, lr_scale, steps_arg)
                if not keep_last and self._compiling_beside(args, batch):
                    # Its step is compiling: this round keeps the last batch.
                    keep_last, device_batches = True, self._last_batch
                    batch = jax.device_put(self._batches(device_batches[0]), home)
                    args = self._step_args(local, batch, lr_scale, steps_arg)
                step, compile_time = self._compiled_step(args, batch)
                compile_s += compile_time
                t = time.perf_counter()
                # On an accelerator the call returns once the step is queued:
                # the clock stops when every result is there, and the slowdown
                # sleeps (k - 1) times that, so a GPU told 4 is 4 times slower.
                if self._tx is None:
                    update, loss, state = step(*args)
                    jax.block_until_ready((update, loss, state))
                else:
                    local, state, self._opt_state, loss = step(*args)
                    jax.block_until_ready((local, state, self._opt_state, loss))
                self._state = state
            spent = time.perf_counter() - t
            compute += spent
            # The slowdown multiplies the typical step of this shape, so a
            # busy core's hiccup is not made k - 1 times longer.
            slowdown += self._injector.after_compute(spent, key=tuple(device_batches))
            losses.append(float(loss))
            steps += 1
            if self._tx is None or bool(push_due(self._opt_state)):
                break
        if self._tx is not None:
            update = jax.tree.map(jnp.negative, pending_update(self._opt_state))
        if not multi:
            self._last_batch = tuple(device_batches)
        loss = float(np.mean(losses))
        return _Computed(
            update=update,
            version=version,
            loss=loss,
            local_steps=steps,
            batch_size=sum(device_batches),
            compute_s=compute,
            slowdown_s=slowdown,
            compile_s=compile_s,
            stage=None if self._stages is None else int(current_stage(self._opt_state)),
            finite=math.isfinite(loss) and bool(_all_finite(update)),
            decode_s=decode_s,
        )

    def prepare(self, computed: _Computed, push: Push) -> _Prepared:
        """:meth:`_encode`, timed (every result on the host when it returns)."""
        t = time.perf_counter()
        prepared = self._encode(computed, push)
        return prepared._replace(encode_s=time.perf_counter() - t)

    def _encode(self, computed: _Computed, push: Push) -> _Prepared:
        """Scales an update by the push's factor and encodes it for the wire.

        Runs in the encoding thread right before the push, so the quantizer's
        (PowerSGD's, top-k's) residual is updated only for an update that is
        sent. A push whose ``compress_ratio`` is below 1 (``WorkerCore``'s rule)
        is top-k sparsified at it and sends the bytes the transform kept.
        """
        update = computed.update
        if push.lr_factor != 1.0:
            factor = push.lr_factor
            update = jax.tree.map(lambda u: u * jnp.asarray(factor, u.dtype), update)
        if push.compress_ratio < 1.0:
            return self._sparsify(update, push.compress_ratio)
        if self._compressor is None:
            host = jax.device_get(update)
            host = jax.tree.map(np.asarray, host)
            return _Prepared(host, None, _tree_nbytes(host))
        sent, state = self._compress_update(update, self._compressor_state)
        self._compressor_state = state
        if self._config.push_transform is not None:
            encoded = sparse_encoded(sent)
        else:
            encoded = jax.device_get(self._codec.last_encoded(state))
        return _Prepared(self._spec_like, encoded, _tree_nbytes(encoded), self._codec)

    def _sparsify(self, update: Any, ratio: float) -> _Prepared:
        """Top-k sparsifies ``update`` at ``ratio`` with error feedback (a new
        ratio starts a new residual)."""
        if self._topk is None or self._topk[0] != ratio:
            tx = top_k(
                ratio,
                error_feedback=self._config.error_feedback,
                seed=self._config.seed,
            )
            state = jax.device_put(tx.init(update), self._devices[0])
            self._topk = (ratio, jax.jit(tx.update), state)
        _, apply, state = self._topk
        _, state = apply(update, state)
        self._topk = (ratio, apply, state)
        encoded = jax.device_get(TopKCodec.last_encoded(state))
        return _Prepared(self._spec_like, encoded, _tree_nbytes(encoded), TopKCodec)

    def initialise(self, params: Any) -> None:
        home = self._devices[0]
        device_params = jax.device_put(params, home)
        self._spec_like = jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params
        )
        # States are committed to the home device, as every step's outputs
        # are: a jitted function called with an uncommitted state, then with
        # its own committed output, is compiled twice (the second time on the
        # second push, which waited for it).
        if self._tx is not None:
            self._opt_state = jax.device_put(self._tx.init(device_params), home)
            if len(self._devices) > 1:
                self._apply = self._apply_fn()
        config = self._config
        if (
            config.bits is not None
            or config.powersgd_rank is not None
            or config.push_transform is not None
        ):
            if self._compressor is None or self._compressor_spec != self._spec_like:
                # Kept for the same shapes: its update stays compiled (a
                # warm-up before joining on zeros of the server's shapes).
                self._make_compressor()
                self._compressor_spec = self._spec_like
            self._compressor_state = jax.device_put(
                self._compressor.init(device_params), home
            )

    def warm_compressor(self) -> None:
        """Traces and compiles the compressor's update on zeros, its state
        untouched: in the encoding thread while the first round computes, so the
        first compressed push does not (1.3 to 1.8 s on proc4's loaded cores for
        the quantizer); the worker runs it before joining where it can, and
        then again it does nothing."""
        if self._compressor_warm is self._compress_update:
            return
        home = self._devices[0]
        zeros = jax.tree.map(
            lambda s: jax.device_put(np.zeros(s.shape, s.dtype), home),
            self._spec_like,
        )
        jax.block_until_ready(self._compress_update(zeros, self._compressor_state))
        self._compressor_warm = self._compress_update
