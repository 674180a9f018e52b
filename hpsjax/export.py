"""The trained parameters out of a run: into an ``.npz``, and into your module.

Two ways out of a parameter-server run, both writing
:func:`hpsjax.models.save_params_npz`'s format (with its marker, so the file is
also an ``--init`` for a new run):

* ``hpsjax-server ... --export_params params.npz`` writes the parameters when
  the server stops (SIGINT or SIGTERM);
* ``hpsjax-export CKPT_DIR params.npz`` (or ``python -m hpsjax.export``)
  writes those of the newest checkpoint in a server's ``--checkpoint_dir`` (or
  of ``--step N``), at any time, also while the server runs. For a model
  split over server shards,
  ``CKPT_DIR`` is the directory that holds the ``shard_<i>_of_<n>``
  directories; the shards' newest checkpoints are joined into one model.

:func:`load_params` then puts the parameters into the flax (NNX) module the
workers trained, built as they built it::

    model = resolve_model("my_pkg.my_module:make_model").model
    load_params(model, "params.npz")

Only ``nnx.Param`` variables travel through the parameter server: a model's
BatchNorm statistics stay with each worker, and ``load_params`` leaves the
module's own in place.
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
import re
import sys
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

import jax.numpy as jnp
import numpy as np
from flax import nnx

from hpsjax._config_flags import add_flags, config_kwargs
from hpsjax._flags import ArgumentParser
from hpsjax.models import load_params_npz, save_params_npz
from hpsjax.storage import (
    SERVER_CHECKPOINT_FORMAT,
    CheckpointError,
    CheckpointManager,
)

__all__ = [
    "check_export_path",
    "checkpoint_params",
    "export_params",
    "load_params",
    "main",
]

_SHARD_DIR = re.compile(r"shard_(\d+)_of_(\d+)")


def export_params(path: str | os.PathLike, params: Mapping[str, Any]) -> None:
    """Writes ``params`` to ``path`` in the ``--init`` format, atomically.

    The file is written beside ``path`` and renamed over it once complete, so a
    crash never leaves a half-written file under its name.

    Raises:
      ValueError: ``params`` is not a nested dict of numeric arrays with
        ``str`` keys (:func:`hpsjax.models.save_params_npz`), or ``path``'s
        directory does not exist.
    """
    path = pathlib.Path(path)
    check_export_path(path)
    # Created as any file the user writes (umask), unlike mkstemp's 0600.
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")
    try:
        save_params_npz(tmp, dict(params))
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def check_export_path(path: str | os.PathLike) -> None:
    """Refuses, in one line, a path an export cannot be written to.

    Raises:
      ValueError: the directory does not exist, or ``path`` is a directory.
    """
    path = pathlib.Path(path)
    if path.is_dir():
        raise ValueError(f"{path} is a directory; name the .npz file to write")
    if not path.parent.is_dir():
        raise ValueError(f"cannot write {path}: no directory {path.parent}")


def checkpoint_params(
    directory: str | os.PathLike, *, step: int | None = None
) -> tuple[dict[str, Any], list[int]]:
    """The parameters of a server's checkpoint directory.

    Args:
      directory: a ``hpsjax-server --checkpoint_dir``; for server shards, the
        directory holding their ``shard_<i>_of_<n>`` directories.
      step: the checkpoint to read; ``None`` reads the newest (of each shard).

    Returns:
      ``(params, steps)``: the nested dict of numpy arrays, and the step read
      (one per shard).

    Raises:
      ValueError: no such directory, no checkpoint (or no ``step``), a
        checkpoint of something other than an hpsjax server, missing shards,
        or a damaged checkpoint; each in one line.
    """
    directory = pathlib.Path(directory)
    if not directory.is_dir():
        raise ValueError(f"no checkpoint directory at {directory}")
    shards = _shard_dirs(directory)
    if not shards:
        params, read = _server_params(directory, step)
        return params, [read]
    if step is not None:
        raise ValueError(
            f"{directory} holds server shards, whose steps differ; --step takes "
            "one shard's directory"
        )
    parts, steps = zip(*(_server_params(d, None) for d in shards), strict=True)
    merged = parts[0]
    for part in parts[1:]:
        merged = _join(merged, part)
    return merged, list(steps)


def _shard_dirs(directory: pathlib.Path) -> list[pathlib.Path]:
    """The ``shard_<i>_of_<n>`` directories in shard order; all ``n`` of them."""
    found = {}
    for entry in directory.iterdir():
        match = _SHARD_DIR.fullmatch(entry.name)
        if match and entry.is_dir():
            found[(int(match[2]), int(match[1]))] = entry
    if not found:
        return []
    counts = {n for n, _ in found}
    if len(counts) > 1:
        raise ValueError(
            f"{directory} holds shards of {sorted(counts)} servers; export one "
            "run's shards at a time"
        )
    (n,) = counts
    missing = [i for i in range(n) if (n, i) not in found]
    if missing:
        raise ValueError(f"{directory} lacks shard {missing[0]} of {n}")
    return [found[(n, i)] for i in range(n)]


def _join(a: Any, b: Any) -> Any:
    """Joins two shards' sub-trees: keys united, a leaf cut by rows concatenated."""
    if isinstance(a, dict) and isinstance(b, dict):
        out = dict(a)
        for key, value in b.items():
            out[key] = _join(a[key], value) if key in a else value
        return out
    return np.concatenate([np.asarray(a), np.asarray(b)])


def _server_params(directory: pathlib.Path, step: int | None):
    manager = CheckpointManager(directory, keep=None)
    try:
        if step is None:
            restored = manager.restore_latest()
            if restored is None:
                raise ValueError(f"{directory} holds no checkpoint")
        else:
            restored = manager.restore(step)
    except CheckpointError as e:
        raise ValueError(str(e)) from None
    finally:
        manager.close()
    meta = restored.metadata
    tree = restored.tree
    if not (
        isinstance(meta, dict)
        and meta.get("format") == SERVER_CHECKPOINT_FORMAT
        and isinstance(tree, list | tuple)  # (params, opt_state), a list in orbax's
        and len(tree) == 2
        and isinstance(tree[0], dict)
    ):
        raise ValueError(
            f"{directory} holds checkpoints of something other than an hpsjax "
            "server (no server metadata)"
        )
    return tree[0], restored.step


def load_params(model: Any, params: str | os.PathLike | Mapping[str, Any]) -> Any:
    """Puts parameters into a flax (NNX) module, in place.

    Every ``nnx.Param`` of ``model`` takes the array of the same key path
    (list indices as ``"0"``, ``"1"``, ... as :func:`hpsjax.models.split_model`
    names them); other state (BatchNorm statistics) is left as it is.

    Args:
      model: the ``nnx.Module`` the workers trained, built as they built it.
      params: an ``.npz`` file of :func:`hpsjax.models.save_params_npz`'s format
        (``--export_params``, ``hpsjax-export``), or such a dict.

    Returns:
      ``model``.

    Raises:
      ValueError: the parameters do not fit the model: a key path missing on
        either side, or another shape or dtype (the message names the first).
    """
    if not isinstance(model, nnx.Module):
        raise ValueError(f"model must be an nnx.Module, got {type(model).__name__}")
    given = params if isinstance(params, Mapping) else load_params_npz(params)
    state = nnx.state(model, nnx.Param)

    def fit(own: Any, new: Any, path: str) -> Any:
        where = path or "the root"
        if isinstance(own, Mapping):
            if not isinstance(new, Mapping):
                raise ValueError(f"params do not fit the model at {where}: a leaf")
            keys, new_keys = {str(k) for k in own}, set(new)
            if keys != new_keys:
                extra, lacking = sorted(new_keys - keys), sorted(keys - new_keys)
                raise ValueError(
                    f"params do not fit the model at {where}: "
                    + (f"the model has no {extra}" if extra else "")
                    + ("; " if extra and lacking else "")
                    + (f"the params lack {lacking}" if lacking else "")
                )
            return {k: fit(v, new[str(k)], f"{path}/{k}") for k, v in own.items()}
        new = np.asarray(new)
        if new.shape != own.shape or new.dtype != own.dtype:
            raise ValueError(
                f"params do not fit the model at {where}: the model has "
                f"{own.dtype}{list(own.shape)}, the params {new.dtype}"
                f"{list(new.shape)}"
            )
        return jnp.asarray(new)

    nnx.replace_by_pure_dict(state, fit(nnx.to_pure_dict(state), given, ""))
    nnx.update(model, state)
    return model


@dataclasses.dataclass(frozen=True)
class ExportOptions:
    """``hpsjax-export``'s arguments, one field each."""

    checkpoint_dir: str = dataclasses.field(
        default="",
        metadata={"help": "the server's --checkpoint_dir", "flag": "checkpoint_dir"},
    )
    out: str = dataclasses.field(
        default="", metadata={"help": "the .npz file to write", "flag": "out"}
    )
    step: int | None = dataclasses.field(
        default=None,
        metadata={"help": "the checkpoint to export (default: the newest)"},
    )


def _prog() -> str:
    """The command's name as its user typed it: the console script
    ``hpsjax-export``, else ``python -m hpsjax.export``."""
    invoked = pathlib.Path(sys.argv[0] if sys.argv else "").name
    return "hpsjax-export" if invoked == "hpsjax-export" else "python -m hpsjax.export"


def main(argv: Sequence[str] | None = None) -> int:
    """Console entry point ``hpsjax-export CKPT_DIR OUT.npz`` (also ``python
    -m hpsjax.export``); returns the exit status."""
    prog = _prog()
    parser = ArgumentParser(
        prog=prog,
        description="Write the parameters of an hpsjax server's checkpoint "
        "directory to an .npz file (the --init format; load them into your "
        "flax module with hpsjax.export.load_params).",
    )
    add_flags(parser, ExportOptions)
    args = ExportOptions(**config_kwargs(ExportOptions, parser.parse_args(argv)))
    try:
        check_export_path(args.out)
        params, steps = checkpoint_params(args.checkpoint_dir, step=args.step)
        export_params(args.out, params)
    except (ValueError, OSError) as e:
        print(f"{prog}: {e}", file=sys.stderr)
        return 2
    count = sum(int(np.size(leaf)) for leaf in _leaves(params))
    which = f"step {steps[0]}" if len(steps) == 1 else f"shard steps {steps}"
    print(f"wrote {count} parameters of {which} to {args.out}")
    return 0


def _leaves(tree: Any) -> list[Any]:
    if isinstance(tree, Mapping):
        return [leaf for child in tree.values() for leaf in _leaves(child)]
    return [tree]


if __name__ == "__main__":
    sys.exit(main())
