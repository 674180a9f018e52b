"""Properties every hpsjax optax transform must have, checked on each of them.

Each transform is described by one :class:`Case` in ``CASES``: the factory, its
keyword arguments and the extra arguments its ``update`` takes. Adding a transform
to the suite is adding one line there.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from hpsjax.transforms._frontier import ordered_momentum, sparseloco
from hpsjax.transforms._local_steps import local_steps
from hpsjax.transforms._lookahead import lookahead_momentum
from hpsjax.transforms._outer import delayed_nesterov, diloco_outer
from hpsjax.transforms._powersgd import power_sgd
from hpsjax.transforms._quantize import quantize
from hpsjax.transforms._stages import Stage, hybrid_stages
from hpsjax.transforms._staleness import delay_compensation, scale_by_staleness
from hpsjax.transforms._streaming import (
    streaming_local,
    streaming_outer,
    streaming_push,
)
from hpsjax.transforms._topk import top_k


@dataclasses.dataclass(frozen=True)
class Case:
    """A transform under test.

    Attributes:
      name: test id.
      factory: the transform's factory.
      kwargs: keyword arguments of the factory.
      extra: extra arguments of ``update`` as a function of the params (some need
        a tree like the params).
      static_args: factory arguments ``inject_hyperparams`` must treat as static.
      required: names of extra arguments whose absence raises ``ValueError``.
    """

    name: str
    factory: Callable[..., optax.GradientTransformation]
    kwargs: dict[str, Any] = dataclasses.field(default_factory=dict)
    extra: Callable[[Any], dict[str, Any]] = lambda params: {}
    static_args: tuple[str, ...] = ()
    required: tuple[str, ...] = ()

    def make(self) -> optax.GradientTransformationExtraArgs:
        return optax.with_extra_args_support(self.factory(**self.kwargs))

    def inject(self) -> optax.GradientTransformationExtraArgs:
        return optax.inject_hyperparams(self.factory, static_args=self.static_args)(
            **self.kwargs
        )


def _staleness(tau):
    return lambda params: {"staleness": tau}


def _stale_params(params):
    return {"stale_params": jax.tree.map(lambda p: p - 0.25, params)}


def _stages(*, loss_smoothing=0.0):
    # The first stage ends after one update, so the wrappers below see a switch.
    return hybrid_stages(
        [
            Stage(
                optax.chain(scale_by_staleness("inverse"), optax.scale(0.5)),
                mode="async",
                local_steps=3,
                until_step=1,
                plateau_window=2,
            ),
            Stage(optax.scale_by_adam(), mode="semi_async", max_staleness=2),
        ],
        loss_smoothing=loss_smoothing,
    )


# quantize's integer hyperparameters fix array shapes, so they stay static.
QUANTIZE_STATIC = ("bits", "block_size", "levels")

CASES = [
    *[
        Case(f"quantize_{name}", quantize, kwargs, static_args=QUANTIZE_STATIC)
        for name, kwargs in [
            ("8bit", {"bits": 8}),
            (
                "4bit_blocks_error_feedback",
                {"bits": 4, "block_size": 4, "error_feedback": True},
            ),
            ("sign_error_feedback", {"scheme": "sign", "error_feedback": True}),
            ("qsgd_nearest", {"scheme": "qsgd", "levels": 4, "stochastic": False}),
        ]
    ],
    *[
        Case(
            f"staleness_{name}",
            scale_by_staleness,
            {"policy": policy, **kwargs},
            _staleness(2),
            required=("staleness",),
        )
        for name, policy, kwargs in [
            ("inverse", "inverse", {}),
            ("inverse_plus_one", "inverse_plus_one", {}),
            ("exponential", "exponential", {"gamma": 0.8}),
            ("polynomial", "polynomial", {"power": 0.7}),
            ("drop", "drop", {"max_staleness": 3}),
            ("inverse_cut_off", "inverse", {"max_staleness": 1}),
        ]
    ],
    Case(
        "staleness_callable",
        scale_by_staleness,
        {"policy": lambda tau: jnp.exp(-0.5 * tau)},
        _staleness(3),
        static_args=("policy",),
        required=("staleness",),
    ),
    Case(
        "delay_compensation",
        delay_compensation,
        {"lam": 0.5},
        _stale_params,
        required=("stale_params",),
    ),
    Case(
        "delay_compensation_adaptive",
        delay_compensation,
        {"lam": 0.5, "adaptive": True},
        _stale_params,
        required=("stale_params",),
    ),
    # top_k's ratio and power_sgd's rank fix array shapes, so they stay static.
    Case("top_k_error_feedback", top_k, {"ratio": 0.25}, static_args=("ratio",)),
    Case(
        "top_k_plain",
        top_k,
        {"ratio": 0.5, "error_feedback": False},
        static_args=("ratio",),
    ),
    Case("power_sgd", power_sgd, {"rank": 1}, static_args=("rank",)),
    Case(
        "power_sgd_cold_start",
        power_sgd,
        {"rank": 1, "warm_start": False, "error_feedback": False},
        static_args=("rank",),
    ),
    Case(
        "delayed_nesterov",
        delayed_nesterov,
        {"learning_rate": 0.5, "momentum": 0.9, "delay": 2},
    ),
    Case(
        "delayed_nesterov_fraction",
        delayed_nesterov,
        {"learning_rate": 0.5, "delay": 3, "momentum_fraction": 0.2},
    ),
    Case("diloco_outer", diloco_outer, {"learning_rate": 0.7, "momentum": 0.9}),
    Case(
        "ordered_momentum",
        ordered_momentum,
        {"learning_rate": 0.5, "momentum": 0.9},
        _staleness(3),
        required=("staleness",),
    ),
    Case(
        "lookahead_momentum",
        lookahead_momentum,
        {"learning_rate": 0.5, "momentum": 0.9, "gamma": 0.5},
        _staleness(1),
        required=("staleness",),
    ),
    Case(
        "sparseloco",
        sparseloco,
        {"ratio": 0.25, "bits": 2, "decay": 0.9},
        static_args=("ratio", "bits", "chunk"),
    ),
    Case(
        "streaming_local",
        streaming_local,
        {"inner": optax.adam(0.1), "mixing": 0.5},
        static_args=("inner", "delay"),
    ),
    Case(
        "streaming_local_eager",
        streaming_local,
        {
            "inner": optax.adam(0.1),
            "eager": True,
            "fragments": 2,
            "outer_learning_rate": 0.7,
            "outer_momentum": 0.9,
            "workers": 4,
        },
        static_args=("inner", "eager", "fragments", "workers", "delay"),
    ),
    Case(
        "streaming_push",
        streaming_push,
        {"fragments": 2, "bits": 4, "error_feedback": True},
        static_args=("fragments", "bits", "error_feedback"),
    ),
    Case(
        "streaming_outer",
        streaming_outer,
        {"learning_rate": 0.7, "momentum": 0.9, "fragments": 2},
        static_args=("fragments",),
    ),
    Case("local_steps", local_steps, {"k": 2}),
    Case("local_steps_f32_sum", local_steps, {"k": 3, "accumulator_dtype": "float32"}),
    Case(
        "hybrid_stages",
        _stages,
        {"loss_smoothing": 0.5},
        lambda params: {"staleness": 1, "loss": 0.75},
        required=("staleness", "loss"),
    ),
]

IDS = [case.name for case in CASES]
DTYPES = [jnp.float32, jnp.bfloat16]


def _params(dtype=jnp.float32):
    return {
        "w": jnp.linspace(-1.0, 1.0, 12, dtype=jnp.float32).reshape(3, 4).astype(dtype),
        "b": jnp.array([0.5, -0.25, 0.125, 1.0], dtype),
    }


def _grads(params, step=0):
    return jax.tree.map(
        lambda p: (jnp.cos(3.0 * p.astype(jnp.float32) + step) - 0.3).astype(p.dtype),
        params,
    )


def _avals(tree):
    """Tree of (shape, dtype, weak_type): what lax.cond needs to agree on."""
    return jax.tree.map(
        lambda x: (jnp.shape(x), jnp.result_type(x), getattr(x, "weak_type", False)),
        tree,
    )


def _assert_trees_close(actual, expected, rtol=1e-6, atol=1e-6):
    assert jax.tree.structure(actual) == jax.tree.structure(expected)
    for a, e in zip(jax.tree.leaves(actual), jax.tree.leaves(expected), strict=True):
        assert a.dtype == e.dtype
        np.testing.assert_allclose(
            np.asarray(a, np.float32), np.asarray(e, np.float32), rtol=rtol, atol=atol
        )


def _trajectory(tx, params, extra, steps):
    """Applies ``steps`` updates (unrolled: a scan compiles slower at this size).

    Returns the list of updates and the last state.
    """
    state = tx.init(params)
    outs = []
    for step in range(steps):
        updates, state = tx.update(_grads(params, step), state, params, **extra)
        outs.append(updates)
    return outs, state


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_jit_with_traced_or_static_extra_args(case):
    params = _params()
    extra = case.extra(params)
    tx = case.make()

    # Extra arguments passed as jit arguments are traced; closed over, they are
    # concrete while tracing (the checks on static values run). Both must agree.
    # Both trajectories are traced into one program: one compile, not two.
    @jax.jit
    def traced_and_static(params, traced_extra):
        return (
            _trajectory(tx, params, traced_extra, 2),
            _trajectory(tx, params, extra, 2),
        )

    traced, static = traced_and_static(params, extra)
    (updates_traced, state_traced), (updates_static, state_static) = traced, static
    _assert_trees_close(updates_traced, updates_static, rtol=1e-5, atol=1e-6)
    assert _avals(state_traced) == _avals(state_static) == _avals(tx.init(params))


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_chain_with_sgd_and_adam(case):
    params = _params()
    tx = case.make()
    sgd_chain = optax.chain(case.make(), optax.sgd(0.1))
    adam = optax.adam(0.01)
    adam_chain = optax.chain(case.make(), adam)

    # One compiled program per test keeps the suite fast.
    @jax.jit
    def run(grads, params, extra):
        alone, _ = tx.update(grads, tx.init(params), params, **extra)
        sgd_out, _ = sgd_chain.update(grads, sgd_chain.init(params), params, **extra)
        adam_out, adam_state = adam_chain.update(
            grads, adam_chain.init(params), params, **extra
        )
        expected, _ = adam.update(alone, adam.init(params), params)
        return alone, sgd_out, adam_out, expected, adam_state

    alone, sgd_out, adam_out, expected, adam_state = run(
        _grads(params), params, case.extra(params)
    )
    _assert_trees_close(sgd_out, jax.tree.map(lambda u: -0.1 * u, alone))
    _assert_trees_close(adam_out, expected)
    assert _avals(adam_state) == _avals(adam_chain.init(params))


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_inject_hyperparams_matches_plain(case):
    params = _params()
    plain, injected = case.make(), case.inject()

    @jax.jit
    def run(params, extra):
        return [_trajectory(t, params, extra, 2) for t in (plain, injected)]

    (plain_outs, _), (wrapped_outs, state) = run(params, case.extra(params))
    _assert_trees_close(wrapped_outs, plain_outs, rtol=1e-5, atol=1e-6)
    numeric = {
        k
        for k, v in case.kwargs.items()
        if isinstance(v, int | float) and not isinstance(v, bool)
    }
    assert numeric - set(case.static_args) <= set(state.hyperparams)


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_inside_multisteps(case):
    params = _params()
    multi = optax.MultiSteps(case.make(), every_k_schedule=2)
    tx = case.make()

    @jax.jit
    def run(grads, params, extra):
        state = multi.init(params)
        first, state = multi.update(grads, state, params, **extra)
        second, state = multi.update(grads, state, params, **extra)
        expected, _ = tx.update(grads, tx.init(params), params, **extra)
        return first, second, multi.has_updated(state), expected

    first, second, has_updated, expected = run(
        _grads(params), params, case.extra(params)
    )
    for leaf in jax.tree.leaves(first):
        assert not np.any(np.asarray(leaf, np.float32))
    assert bool(has_updated)
    _assert_trees_close(second, expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_dtype_preserved(case, dtype):
    params = _params(dtype)
    extra = case.extra(params)
    dtypes = jax.tree.map(lambda p: p.dtype, params)
    # Types are checked on the traced program, plain and wrapped (where the
    # hyperparameters take the params' dtype).
    for tx in (case.make(), case.inject()):
        init = tx.init(params)
        outs, state = jax.eval_shape(
            functools.partial(_trajectory, tx, steps=2), params, extra
        )
        for updates in outs:
            assert jax.tree.map(lambda u: u.dtype, updates) == dtypes
        assert _avals(state) == _avals(init)
    if dtype == jnp.bfloat16:
        # float32 values are compared in every other test; here bfloat16 ones
        # must at least stay finite.
        outs, _ = jax.jit(functools.partial(_trajectory, case.make(), steps=1))(
            params, extra
        )
        assert all(bool(jnp.all(jnp.isfinite(u))) for u in jax.tree.leaves(outs))


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_extra_args_forwarded_through_wrappers(case):
    params = _params()
    extra = {**case.extra(params), "unrelated": jnp.ones(2)}
    grads = _grads(params)
    # A transform without extra-args support sits in front: chains must still
    # forward the extra arguments past it.
    plain_scale = optax.GradientTransformation(
        optax.scale(1.0).init, optax.scale(1.0).update
    )
    # MultiSteps.gradient_transformation() drops extra arguments, so the wrapper
    # object's own update is used.
    multi = optax.MultiSteps(case.make(), 1)
    wrappers = [
        optax.chain(plain_scale, case.make()),
        optax.named_chain(("scale", plain_scale), ("tx", case.make())),
        case.inject(),
        optax.GradientTransformationExtraArgs(multi.init, multi.update),
    ]
    # Tracing is enough: a required argument that did not arrive raises while
    # tracing, and the values are compared by the chain, inject and MultiSteps
    # tests above.
    for wrapper in wrappers:
        state = wrapper.init(params)
        updates, new_state = jax.eval_shape(
            functools.partial(wrapper.update, **extra), grads, state, params
        )
        assert _avals(updates) == _avals(grads)
        assert _avals(new_state) == _avals(state)
        for missing in case.required:
            without = {k: v for k, v in extra.items() if k != missing}
            with pytest.raises(ValueError, match=missing):
                jax.eval_shape(
                    functools.partial(wrapper.update, **without), grads, state, params
                )


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_state_structure_stable_under_cond(case):
    params = _params()
    extra = case.extra(params)
    tx = case.make()
    state = tx.init(params)

    @jax.jit
    def maybe_update(pred, state):
        return jax.lax.cond(
            pred,
            lambda s: tx.update(_grads(params), s, params, **extra)[1],
            lambda s: s,
            state,
        )

    updated = maybe_update(True, state)
    kept = maybe_update(False, state)
    assert _avals(updated) == _avals(kept) == _avals(state)
    for a, b in zip(jax.tree.leaves(kept), jax.tree.leaves(state), strict=True):
        if jnp.issubdtype(a.dtype, jax.dtypes.prng_key):
            a, b = jax.random.key_data(a), jax.random.key_data(b)
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
