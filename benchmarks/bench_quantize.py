"""Throughput of the quantization codec, relative to an elementwise copy.

Every figure is a ratio to a jitted elementwise copy (``x * one``, with ``one`` a
runtime argument so that nothing is elided) of the same float32 array, timed in
the same run, interleaved with the codec so that both see the same machine load:
each repeat times the copy, the encode, the decode and encode-then-decode once,
and the table shows medians (``block_until_ready``, compilation excluded).
Throughputs count the float32 input bytes; ``ratio`` is float32 bytes over
encoded bytes (codes and scales); ``enc fus`` is the number of fused kernels in
the compiled encode (one full-size pass for the codes, one or two reductions for
the scales, the rest scalar work deriving the random seeds from the key).

The last lines are the sparse and low-rank codecs: top-k at 1% (indices and
values, :func:`hpsjax.transforms.topk_encode`) and PowerSGD at rank 4 (the
factors of the array read as a ``--rows`` x ``size / rows`` matrix, one power
iteration from a fresh random ``Q``, :func:`hpsjax.transforms.powersgd_encode`).

Run::

  python benchmarks/bench_quantize.py              # 16M elements
  python benchmarks/bench_quantize.py --size 1000000 --repeats 5
  python benchmarks/bench_quantize.py --filter top-k   # or --filter powersgd
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp

from hpsjax.transforms._powersgd import (
    powersgd_decode,
    powersgd_encode,
    powersgd_nbytes,
)
from hpsjax.transforms._quantize import Codec, decode, encode, encoded_nbytes
from hpsjax.transforms._topk import topk_decode, topk_encode, topk_nbytes


def _codecs(block_size: int) -> list[tuple[str, Codec]]:
    codecs = []
    for bits in (2, 4, 8, 16):
        for stochastic in (True, False):
            for block in (None, block_size):
                rounding = "stoch" if stochastic else "near"
                where = "leaf" if block is None else f"block {block}"
                name = f"uniform {bits:2d}b {rounding} {where}"
                codecs.append(
                    (
                        name,
                        Codec("uniform", bits, block_size=block, stochastic=stochastic),
                    )
                )
    for block in (None, block_size):
        where = "leaf" if block is None else f"block {block}"
        codecs.append(
            (f"qsgd s=127 stoch {where}", Codec("qsgd", levels=127, block_size=block))
        )
        codecs.append((f"sign 1b near {where}", Codec("sign", block_size=block)))
        codecs.append(
            (f"sign 1b stoch {where}", Codec("sign", block_size=block, stochastic=True))
        )
    codecs.append(("none 32b", Codec("none")))
    return codecs


def _entries(x: jax.Array, block_size: int, rows: int):
    """(name, jitted encode(x, key), jitted decode(encoded), encoded bytes)."""
    shape, dtype = x.shape, x.dtype
    entries = []
    for name, codec in _codecs(block_size):
        enc = jax.jit(lambda x, key, codec=codec: encode(x, codec, key))
        dec = jax.jit(lambda e, codec=codec: decode(e, codec, shape, dtype))
        entries.append((name, enc, dec, encoded_nbytes(shape, codec)))
    ratio = 0.01
    entries.append(
        (
            "top-k 1%",
            jax.jit(lambda x, key: topk_encode(x, ratio, key)),
            jax.jit(lambda e: topk_decode(e, shape, dtype)),
            topk_nbytes(shape, dtype, ratio),
        )
    )
    rank, matrix = 4, (rows, x.size // rows)
    entries.append(
        (
            f"powersgd rank {rank} ({matrix[0]}x{matrix[1]})",
            jax.jit(lambda x, key: powersgd_encode(x.reshape(matrix), rank, key=key)),
            jax.jit(lambda e: powersgd_decode(e, matrix, dtype).reshape(shape)),
            powersgd_nbytes(matrix, dtype, rank),
        )
    )
    return entries


def _time(fn, *args) -> float:
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    return time.perf_counter() - start


def _fusions(compiled_text: str) -> int:
    return sum(" fusion(" in line for line in compiled_text.splitlines())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", type=int, default=16 * 2**20, help="elements")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--block-size", type=int, default=4096)
    parser.add_argument(
        "--filter", default="", help="only codecs whose name contains this"
    )
    parser.add_argument(
        "--rows", type=int, default=4096, help="PowerSGD matrix rows (divide size)"
    )
    args = parser.parse_args()
    if args.size % args.rows:
        parser.error(f"--rows {args.rows} must divide --size {args.size}")

    x = jax.random.normal(jax.random.key(0), (args.size,), jnp.float32)
    key = jax.random.key(1)
    one = jnp.float32(1.0)
    copy = jax.jit(lambda x, one: x * one)
    gb = x.nbytes / 1e9

    copy_times = [_time(copy, x, one) for _ in range(args.repeats)]
    print(
        f"size {args.size} float32 ({x.nbytes / 2**20:.0f} MiB), "
        f"{args.repeats} repeats, devices {jax.devices()}"
    )
    print(f"copy (x * one): {gb / statistics.median(copy_times):.2f} GB/s alone\n")
    header = (
        f"{'codec':34s} {'enc GB/s':>9s} {'x copy':>7s} {'dec GB/s':>9s} "
        f"{'x copy':>7s} {'e+d GB/s':>9s} {'x copy':>7s} {'ratio':>6s} "
        f"{'enc fus':>7s}"
    )
    print(header)
    print("-" * len(header))
    for name, enc, dec, nbytes in _entries(x, args.block_size, args.rows):
        if args.filter not in name:
            continue
        encoded = enc(x, key)
        jax.block_until_ready(dec(encoded))
        fusions = _fusions(enc.lower(x, key).compile().as_text())

        def both(enc=enc, dec=dec):
            return dec(enc(x, key))

        t_copy, t_enc, t_dec, t_both = [], [], [], []
        for _ in range(args.repeats):
            t_copy.append(_time(copy, x, one))
            t_enc.append(_time(enc, x, key))
            t_dec.append(_time(dec, encoded))
            t_both.append(_time(both))
        base = statistics.median(t_copy)
        cols = []
        for times in (t_enc, t_dec, t_both):
            t = statistics.median(times)
            cols.append(f"{gb / t:9.2f} {base / t:7.2f}")
        ratio = x.nbytes / nbytes
        print(f"{name:34s} {' '.join(cols)} {ratio:6.1f} {fusions:7d}")


if __name__ == "__main__":
    main()
