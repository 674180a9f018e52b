"""The server's PowerSGD decode in PROTOCOL.md's order against a BLAS product.

The server rebuilds a factored leaf as ``p q^T`` with
:func:`hpsjax.wire._codecs._powersgd.powersgd_product`: the rank's terms added in order,
each product and sum rounded to float32, row block by row block, so that any
decoder following PROTOCOL.md section 2.6 gets the same bits. This compares its
time with ``numpy.matmul`` (a BLAS product, whose order is the library's) on
the same factors, in the same process, and counts the elements where the two
differ.

Run: ``python benchmarks/bench_powersgd_decode.py``.
"""

from __future__ import annotations

import timeit

import numpy as np

from hpsjax.wire._codecs._powersgd import powersgd_product

SHAPES = [(512, 784, 2), (1024, 1024, 8), (4096, 4096, 4)]


def _best(fn, repeat: int = 5) -> float:
    fn()
    return min(timeit.repeat(fn, number=1, repeat=repeat))


def main() -> None:
    rng = np.random.default_rng(0)
    print(f"{'n x m, rank':>20} {'ordered ms':>11} {'matmul ms':>10} {'ratio':>6}"
          f" {'elements differing':>19}")  # fmt: skip
    for n, m, r in SHAPES:
        p = rng.standard_normal((n, r), dtype=np.float32)
        q = rng.standard_normal((m, r), dtype=np.float32)
        ordered = _best(lambda p=p, q=q: powersgd_product(p, q))
        blas = _best(lambda p=p, q=q: np.matmul(p, q.T))
        differ = int((powersgd_product(p, q) != np.matmul(p, q.T)).sum())
        print(
            f"{f'{n} x {m}, {r}':>20} {ordered * 1e3:11.2f} {blas * 1e3:10.2f} "
            f"{ordered / blas:6.2f} {differ:>10} of {n * m}"
        )


if __name__ == "__main__":
    main()
