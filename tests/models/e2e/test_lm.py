"""The transformer language model (hpsjax.models.Transformer) on the offline
text, in process and from ``hpsjax-worker --task lm`` against a real server.

Every model here is tiny (one layer, width 32) so that it compiles and trains
in seconds on CPU; the presets' sizes are checked by shape only."""

import json
import math
import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from hpsjax import data, models, tasks
from tests.tasks.test_tasks import train_against_a_server

TINY = {"d_model": 32, "num_layers": 1, "num_heads": 2}


def _count(params) -> int:
    return sum(math.prod(leaf.shape) for leaf in jax.tree.leaves(params))


def _jitted(model):
    """The model's forward pass, compiled (eager flax runs op by op)."""
    graphdef, params = models.split_model(model)
    return jax.jit(lambda x: models.merge_model(graphdef, params)(x))


def test_the_presets_have_about_1m_and_30m_parameters():
    counts = {}
    for name in models.TRANSFORMER_PRESETS:
        abstract = nnx.eval_shape(
            lambda name=name: models.get_model(name, input_shape=(64,), num_classes=256)
        )
        counts[name] = _count(models.split_model(abstract)[1])
    assert counts == {"transformer_1m": 1_020_416, "transformer_30m": 31_624_704}
    # A preset's size can be changed by its arguments.
    abstract = nnx.eval_shape(
        lambda: models.get_model(
            "transformer_1m", input_shape=(64,), num_classes=256, num_layers=1
        )
    )
    assert _count(models.split_model(abstract)[1]) < 300_000


def test_built_from_the_text_it_gives_causal_logits_per_position():
    text = data.get_dataset("text", seq_len=16, num_examples=64)
    resolved = models.resolve_model(
        "transformer",
        input_shape=text.input_shape,
        num_classes=text.num_classes,
        **TINY,
    )
    assert resolved.input_shape == (16,)
    model = resolved.model
    assert isinstance(model, models.Transformer)
    forward = _jitted(model)
    logits = forward(text.x[:3])
    assert logits.shape == (3, 16, 256)
    # Float tokens (as a float32 pipeline may carry them) give the same logits.
    np.testing.assert_allclose(forward(text.x[:3].astype(np.float32)), logits)
    # Tied embeddings: no separate output matrix.
    _, params = models.split_model(model)
    assert sorted(params) == ["blocks", "embed", "norm"]
    # Small initial logits: the first loss is about ln 256.
    loss = tasks.get_task("lm").loss(logits, (None, jnp.asarray(text.y[:3])))
    np.testing.assert_allclose(loss, math.log(256), atol=0.1)
    # Causal: a token changes the logits of its position and later ones only.
    tokens = text.x[:3].copy()
    tokens[0, 5] = (tokens[0, 5] + 1) % 256
    changed = forward(tokens)
    np.testing.assert_allclose(changed[0, :5], logits[0, :5], rtol=1e-5, atol=1e-6)
    assert not np.allclose(changed[0, 5:], logits[0, 5:])
    np.testing.assert_array_equal(changed[1:], logits[1:])


def test_bad_settings_are_one_line():
    bad = [
        (dict(d_model=30, num_heads=4), "num_heads times an even head width"),
        (dict(d_model=12, num_heads=4), "num_heads times an even head width"),
        (dict(num_layers=0), "num_layers must be an int >= 1"),
    ]
    for kwargs, match in bad:
        with pytest.raises(ValueError, match=match):
            models.Transformer(256, rngs=nnx.Rngs(0), **{**TINY, **kwargs})
    with pytest.raises(ValueError, match="takes token sequences"):
        models.get_model("transformer", input_shape=(8, 8, 1), num_classes=10)
    model = models.Transformer(256, seq_len=4, rngs=nnx.Rngs(0), **TINY)
    with pytest.raises(ValueError, match=r"length <= 4"):
        model(jnp.zeros((1, 5), jnp.int32))


def test_it_learns_the_text():
    train, test = data.text(16, num_examples=512).split(0.25, seed=0)
    model = models.get_model(
        "transformer", input_shape=train.input_shape, num_classes=256, **TINY
    )
    graphdef, params = models.split_model(model)
    task = tasks.get_task("lm")
    optimizer = optax.adam(3e-3)
    state = optimizer.init(params)

    @jax.jit
    def step(params, state, batch):
        def loss(p):
            return jnp.mean(tasks.per_example_loss(task, p, graphdef, batch))

        grads = jax.grad(loss)(params)
        updates, state = optimizer.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    evaluate = jax.jit(lambda p, b: tasks.evaluate(task, p, graphdef, b))

    def summary(params):
        means = evaluate(params, (test.x, test.y))
        return task.summarize({k: float(v) for k, v in means.items()})

    before = summary(params)
    stream = train.batches(32, seed=0)
    for _ in range(60):
        params, state = step(params, state, tuple(stream.next()))
    after = summary(params)
    assert after["loss"] < before["loss"] - 1.0, (before, after)
    assert after["perplexity"] == pytest.approx(math.exp(after["loss"]))


@pytest.mark.slow
def test_the_language_model_trains_from_the_worker_cli(tmp_path, session_compile_cache):
    flags = ["--task", "lm", "--dataset_arg", "seq_len=16", "--dataset_arg",
             "num_examples=1000"]  # fmt: skip
    for key, value in TINY.items():
        flags += ["--model_arg", f"{key}={value}"]
    records, out = train_against_a_server(
        tmp_path, flags, "--target_value", "5.0", steps=60
    )
    rounds = [r for r in records if r.get("event") == "round"]
    assert rounds and all(r["tokens_per_s"] > 0 for r in rounds), rounds[:2]
    evals = [r for r in records if r.get("event") == "eval"]
    last = evals[-1]
    assert set(last) >= {"loss", "accuracy", "perplexity", "target_reached"}
    assert last["perplexity"] == pytest.approx(math.exp(last["loss"]))
    assert last["loss"] < 5.0 and last["target_reached"] is True
    assert "hpsjax-worker eval: version" in out and "perplexity" in out
    assert os.path.exists(tmp_path / "w0.jsonl")
    json.dumps(records)  # every record is plain JSON
