"""Streaming DiLoCo's knobs as its paper and torchft name them: strided
fragments, 4-bit float (E2M1) outer gradients, the merge's alpha and the
overlap tau, each a step computed by hand on a tiny tree."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from hpsjax.transforms import (
    e2m1_round,
    streaming_fragment_nbytes,
    streaming_local,
    streaming_outer,
    streaming_push,
)


def _tree():
    # Leaves in jax.tree.leaves order: a (2), b (3), c (1).
    return {"a": jnp.ones(2), "b": jnp.ones(3), "c": jnp.ones(1)}


def _lists(tree):
    return {k: [float(x) for x in np.asarray(v)] for k, v in tree.items()}


# ---------------------------------------------------------------- strided


def test_strided_fragments_hold_every_pth_leaf():
    tree = _tree()
    push = streaming_push(2, bits=None, layout="strided")
    state = push.init(tree)
    sent, state = push.update(tree, state)  # fragment 0: leaves 0 and 2
    assert _lists(sent) == {"a": [1, 1], "b": [0, 0, 0], "c": [1]}
    sent, state = push.update(tree, state)  # fragment 1: leaf 1
    assert _lists(sent) == {"a": [0, 0], "b": [1, 1, 1], "c": [0]}
    # Contiguous: elements 0-2 | 3-5 of the flat 6.
    contiguous = streaming_push(2, bits=None)
    sent, _ = contiguous.update(tree, contiguous.init(tree))
    assert _lists(sent) == {"a": [1, 1], "b": [1, 0, 0], "c": [0]}
    # float32 bytes: a + c | b.
    assert streaming_fragment_nbytes(tree, 2, None, "strided") == (12, 12)


def test_a_strided_block_is_a_layer_of_the_parameters():
    layers = {
        f"l{i}": {"b": jnp.full(2, i + 1.0), "w": jnp.full((2, 2), i + 1.0)}
        for i in range(3)
    }
    push = streaming_push(2, bits=None, layout="strided")
    sent, _ = push.update(layers, push.init(layers))
    # Fragment 0: layers 0 and 2, whole; layer 1 waits for the next push.
    assert [float(jnp.abs(sent[f"l{i}"]["w"]).sum()) for i in range(3)] == [4, 0, 12]
    assert [float(jnp.abs(sent[f"l{i}"]["b"]).sum()) for i in range(3)] == [2, 0, 6]
    assert streaming_fragment_nbytes(layers, 2, None, "strided") == (48, 24)


def test_strided_outer_steps_the_due_leaves_only():
    outer = streaming_outer(1.0, momentum=0.5, fragments=2, layout="strided")
    step, _ = outer.update(_tree(), outer.init(_tree()))
    # Due leaves a and c: -(0.5 * 1 + 1); b untouched.
    assert _lists(step) == {"a": [-1.5, -1.5], "b": [0, 0, 0], "c": [-1.5]}


def test_strided_needs_a_leaf_a_fragment_and_a_known_layout():
    with pytest.raises(
        ValueError, match=r"^strided fragments \(4\) must not exceed the tree's 3 top"
    ):
        streaming_fragment_nbytes(_tree(), 4, None, "strided")
    with pytest.raises(ValueError, match=r"^layout must be one of") as err:
        streaming_push(2, layout="striped")
    assert "\n" not in str(err.value)


# ---------------------------------------------------------------- E2M1


def test_e2m1_rounds_to_4_bit_floats_on_one_scale():
    # Scale 3 / 6 = 0.5: |x| / s = 6, 2, 0.8, 2.6 -> 6, 2, 1, 3 (nearest).
    x = jnp.array([3.0, 1.0, -0.4, 1.3])
    assert [float(v) for v in e2m1_round(x)] == [3.0, 1.0, -0.5, 1.5]
    assert [float(v) for v in e2m1_round(jnp.zeros(3))] == [0.0, 0.0, 0.0]


def test_an_e2m1_push_sends_4_bit_floats_and_counts_4_bits():
    delta = {"a": jnp.array([3.0, 1.0]), "b": jnp.array([-0.4, 1.3, 0.0])}
    push = streaming_push(1, bits="e2m1")
    sent, state = push.update(delta, push.init(delta))
    # Each leaf on its own scale: a: 0.5 -> 3, 1; b: 1.3 / 6 -> -0.4 / s = 1.85
    # -> 2, 1.3 / s = 6 -> 6.
    s = 1.3 / 6
    np.testing.assert_allclose(sent["a"], [3.0, 1.0], rtol=1e-6)
    np.testing.assert_allclose(sent["b"], [-2 * s, 6 * s, 0.0], rtol=1e-6)
    assert int(state.nbytes) == streaming_fragment_nbytes(delta, 1, bits=4)[0]


# ---------------------------------------------------------------- alpha, tau


def _own_then_pulled(tx):
    """An inner step of sgd(1) on gradient 1 takes a and b to -1; then the
    server's a (0.5) is pulled, b unchanged (0): the merge step."""
    params = {"a": jnp.zeros(1), "b": jnp.zeros(1)}
    ones = jax.tree.map(jnp.ones_like, params)
    state = tx.init(params)
    u, state = tx.update(ones, state, params)
    pulled = {"a": jnp.array([0.5]), "b": jnp.zeros(1)}
    u, state = tx.update(ones, state, pulled)
    return optax.apply_updates(pulled, u), state, ones


def test_alpha_mixes_the_local_and_the_global_fragment():
    params, _, _ = _own_then_pulled(streaming_local(optax.sgd(1.0), mixing=0.25))
    # torchft's global.lerp(local, alpha): 0.25 * -1 + 0.75 * 0.5.
    assert _lists(params) == {"a": [0.125], "b": [-1.0]}


@pytest.mark.parametrize(("alpha", "merged"), [(0.0, 0.5), (0.5, -1.25)])
def test_tau_holds_the_merge_for_tau_inner_steps(alpha, merged):
    tx = streaming_local(optax.sgd(1.0), mixing=alpha, delay=2)
    params, state, ones = _own_then_pulled(tx)
    # The step that sees the pull keeps the worker's own values.
    assert _lists(params) == {"a": [-1.0], "b": [-1.0]}
    u, state = tx.update(ones, state, params)
    params = optax.apply_updates(params, u)
    assert _lists(params) == {"a": [-2.0], "b": [-2.0]}  # 1 of tau = 2
    u, state = tx.update(ones, state, params)
    params = optax.apply_updates(params, u)
    # After the 2nd inner step a merges: alpha * -3 + (1 - alpha) * 0.5.
    assert _lists(params) == {"a": [merged], "b": [-3.0]}
    u, state = tx.update(ones, state, params)
    params = optax.apply_updates(params, u)
    assert _lists(params) == {"a": [merged - 1], "b": [-4.0]}  # merged once


def test_tau_zero_merges_at_once_as_before():
    held, _, _ = _own_then_pulled(streaming_local(optax.sgd(1.0), delay=0))
    assert _lists(held) == {"a": [0.5], "b": [-1.0]}


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"delay": -1}, r"^delay must be an int >= 0"),
        ({"delay": 1, "eager": True}, r"^delay \(tau\) needs eager=False"),
        ({"mixing": 1.5}, r"^mixing must be"),
    ],
)
def test_bad_knobs_are_one_line(kwargs, message):
    with pytest.raises(ValueError, match=message) as err:
        streaming_local(optax.sgd(1.0), **kwargs)
    assert "\n" not in str(err.value)


# ---------------------------------------------------------------- billing


def test_the_merge_step_costs_no_time_in_the_simulator():
    from hpsjax.sim import ComputeModel, SimConfig, WorkerSpec, simulate

    rng = np.random.default_rng(0)
    params = {"w": jnp.zeros((4, 2))}
    data = (rng.normal(size=(64, 4)).astype(np.float32), rng.integers(0, 2, 64))

    def loss_fn(p, batch):
        x, y = batch
        logits = x @ p["w"]
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

    computes = {}
    for merge in (0, 1):
        config = SimConfig(
            policy="bsp", local_optimizer=streaming_local(optax.sgd(0.1)),
            server_optimizer=optax.sgd(1.0), max_updates=3, merge_steps=merge,
        )  # fmt: skip
        workers = [WorkerSpec(ComputeModel(step_time=0.1), batch_size=8,
                              local_steps=5)]  # fmt: skip
        result = simulate(loss_fn, params, data, workers, config)
        spans = [i for i in result.timelines[0] if i.kind == "compute"]
        computes[merge] = [round(i.end - i.start, 6) for i in spans]
    # Five local steps a round: five billed, or four with the merge free.
    assert computes[0][:3] == [0.5, 0.5, 0.5]
    assert computes[1][:3] == [0.4, 0.4, 0.4]
    with pytest.raises(ValueError, match=r"^merge_steps must be an int >= 0"):
        SimConfig(max_updates=1, merge_steps=-1)
