"""Checkpoint save/restore time against np.save + fsync of the same arrays.

Run:
  python benchmarks/bench_checkpoint.py

Writes 64 MiB in 32 leaves to a temporary directory with
``hpsjax.ps.CheckpointManager`` (orbax-checkpoint over tensorstore, committed
atomically, a crc32 per array) and with plain
``np.save`` + ``fsync``, in the same run, and prints the ratios.
"""

import os
import pathlib
import shutil
import tempfile
import time

import numpy as np

from hpsjax.ps import CheckpointManager


def _baseline_save(directory: pathlib.Path, arrays: list[np.ndarray]) -> None:
    directory.mkdir()
    for i, a in enumerate(arrays):
        path = directory / f"{i}.npy"
        with open(path, "wb") as f:
            np.save(f, a)
            f.flush()
            os.fsync(f.fileno())


def main():
    """Prints save/restore/snapshot times against np.save + fsync of the same data."""
    tmp_path = pathlib.Path(tempfile.mkdtemp(prefix="hpsjax-bench-ckpt-"))
    rng = np.random.default_rng(0)
    arrays = [rng.normal(size=(1024, 1024)).astype(np.float32) for _ in range(16)]
    arrays += [rng.normal(size=(1024,)).astype(np.float32) for _ in range(16)]
    tree = {"params": arrays}
    nbytes = sum(a.nbytes for a in arrays)
    manager = CheckpointManager(tmp_path / "ckpts", keep=1)

    def best(fn, repeats=3):
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        return min(times)

    counter = iter(range(1000))
    t_base = best(lambda: _baseline_save(tmp_path / f"base{next(counter)}", arrays))
    steps = iter(range(1000))
    t_save = best(lambda: manager.save(next(steps), tree))
    t_restore = best(lambda: manager.restore_latest())
    t_base_load = best(
        lambda: [np.load(tmp_path / "base0" / f"{i}.npy") for i in range(len(arrays))]
    )

    async_times = []
    for _ in range(3):
        start = time.perf_counter()
        manager.save_async(next(steps), tree)
        async_times.append(time.perf_counter() - start)
        manager.wait_until_finished()
    t_async = min(async_times)
    manager.close()

    mib = nbytes / 2**20
    print(
        f"\n{mib:.0f} MiB in {len(arrays)} leaves: save {t_save * 1e3:.0f} ms "
        f"({t_save / t_base:.2f}x np.save+fsync at {t_base * 1e3:.0f} ms), "
        f"restore {t_restore * 1e3:.0f} ms ({t_restore / t_base_load:.2f}x np.load "
        f"at {t_base_load * 1e3:.0f} ms), save_async returns in "
        f"{t_async * 1e3:.0f} ms ({t_async / t_save:.2f}x a blocking save)"
    )
    shutil.rmtree(tmp_path, ignore_errors=True)


if __name__ == "__main__":
    main()
