"""Converts a directory of earlier-format hpsjax checkpoints to the orbax format.

Run::

    python -m hpsjax.ps.convert_checkpoint OLD_DIRECTORY NEW_DIRECTORY

Every ``ckpt_<step>`` of ``OLD_DIRECTORY`` (``manifest.msgpack`` and
``leaves/``) is read, checked (manifest checksum, leaf shapes and dtypes) and
written to ``NEW_DIRECTORY`` as an orbax checkpoint of the same step, tree and
metadata, which ``hpsjax-server --checkpoint_dir NEW_DIRECTORY`` resumes from.
``OLD_DIRECTORY`` is left as it is. A damaged checkpoint is reported and
skipped. For a sharded server, convert each ``shard_<i>_of_<n>`` directory.
"""

from __future__ import annotations

import argparse
import pathlib
import sys

from hpsjax.ps import _checkpoint, _checkpoint_legacy


def convert(old: str | pathlib.Path, new: str | pathlib.Path) -> list[int]:
    """Converts the checkpoints of ``old`` into ``new``; returns the steps written.

    Raises:
      ValueError: ``old`` holds no earlier-format checkpoint, or ``new`` already
        holds checkpoints.
    """
    old, new = pathlib.Path(old), pathlib.Path(new)
    if not old.is_dir():
        raise ValueError(f"{old} is not a directory")
    steps = _checkpoint_legacy.legacy_steps(old)
    if not steps:
        raise ValueError(f"{old} holds no checkpoint of the earlier hpsjax format")
    if old.resolve() == new.resolve():
        raise ValueError("write the converted checkpoints to another directory")
    manager = _checkpoint.CheckpointManager(new, keep=None)
    try:
        if manager.steps():
            raise ValueError(f"{new} already holds checkpoints")
        written = []
        for step in steps:
            root = old / f"ckpt_{step}"
            try:
                legacy = _checkpoint_legacy.read(root)
            except _checkpoint.CheckpointError as e:
                print(f"skipping damaged checkpoint {root}: {e}", file=sys.stderr)
                continue
            body = legacy.body
            arrays = {
                str(i): value
                for i, (spec, value) in enumerate(
                    zip(body["leaves"], legacy.values, strict=True)
                )
                if _checkpoint._stored(spec)
            }
            plan = _checkpoint._plan_described(
                legacy.step, body["tree"], body["leaves"], arrays, body["metadata"]
            )
            manager._save_plan(plan, overwrite=False)
            written.append(legacy.step)
        return written
    finally:
        manager.close()


def main(argv: list[str] | None = None) -> int:
    """Command line entry point; returns the exit status."""
    parser = argparse.ArgumentParser(
        prog="python -m hpsjax.ps.convert_checkpoint",
        description=__doc__.split("\n")[0],
    )
    parser.add_argument("old", help="directory of earlier-format checkpoints")
    parser.add_argument("new", help="directory to write orbax checkpoints to")
    args = parser.parse_args(argv)
    try:
        written = convert(args.old, args.new)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"converted steps {written} from {args.old} to {args.new}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
