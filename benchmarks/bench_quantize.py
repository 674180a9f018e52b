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

Run::

  python benchmarks/bench_quantize.py              # 16M elements
  python benchmarks/bench_quantize.py --size 1000000 --repeats 5
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp

from hpsjax.transforms._quantize import Codec, decode, encode, encoded_nbytes


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
    args = parser.parse_args()

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
    for name, codec in _codecs(args.block_size):
        if args.filter not in name:
            continue
        enc = jax.jit(encode, static_argnums=1)
        dec = jax.jit(decode, static_argnums=(1, 2, 3))
        encoded = enc(x, codec, key)
        jax.block_until_ready(dec(encoded, codec, x.shape, x.dtype))
        fusions = _fusions(enc.lower(x, codec, key).compile().as_text())

        def both(codec=codec, enc=enc, dec=dec):
            return dec(enc(x, codec, key), codec, x.shape, x.dtype)

        t_copy, t_enc, t_dec, t_both = [], [], [], []
        for _ in range(args.repeats):
            t_copy.append(_time(copy, x, one))
            t_enc.append(_time(enc, x, codec, key))
            t_dec.append(_time(dec, encoded, codec, x.shape, x.dtype))
            t_both.append(_time(both))
        base = statistics.median(t_copy)
        cols = []
        for times in (t_enc, t_dec, t_both):
            t = statistics.median(times)
            cols.append(f"{gb / t:9.2f} {base / t:7.2f}")
        ratio = x.nbytes / encoded_nbytes(x.shape, codec)
        print(f"{name:34s} {' '.join(cols)} {ratio:6.1f} {fusions:7d}")


if __name__ == "__main__":
    main()
