"""Models the worker and server tests share (imported as ``_models``)."""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
import optax

from hpsjax import data


def digits_mlp(num_examples: int, hidden: int = 32, out_scale: float = 6.0):
    """Generated 8x8 digits and a small functional MLP with per-example losses.

    Returns ``(train, params, loss_fn)``; the same seed gives the same model.
    """
    train = data.synthetic_digits(num_examples, seed=0)
    rng = np.random.default_rng(0)
    params = {
        "hidden": {
            "kernel": (rng.normal(size=(64, hidden)) / 8).astype(np.float32),
            "bias": np.zeros(hidden, np.float32),
        },
        "out": {
            "kernel": (rng.normal(size=(hidden, 10)) / out_scale).astype(np.float32),
            "bias": np.zeros(10, np.float32),
        },
    }

    def loss_fn(p, batch):
        x = jnp.reshape(batch.x, (batch.x.shape[0], -1))
        h = jax.nn.relu(x @ p["hidden"]["kernel"] + p["hidden"]["bias"])
        logits = h @ p["out"]["kernel"] + p["out"]["bias"]
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch.y)

    return train, params, loss_fn


#: Worker flags for a small MLP on generated digits (launcher tests).
SMALL_MODEL = [
    "--dataset_arg",
    "num_examples=600",
    "--model_arg",
    "hidden=[16]",
    "--batch_size",
    "16",
    "--log_level",
    "WARNING",
]


def alive(pid: int) -> bool:
    """Whether process ``pid`` still exists."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True
