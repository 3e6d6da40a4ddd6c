"""The matrix products of a pipeline microbatch, kernel by kernel, alternating in one process:
``python benchmarks/products.py``.

One thread (TensorFlow's pools, or ``TFSMP_BENCH_THREADS``; OpenBLAS's own are off), 256 rows (a microbatch of the peer benchmark's
batch 2048 at m = 8) by a 1024 x 1024 kernel, the three products of a Dense layer's step:
``x @ W`` (forward), ``dY @ W^T`` (input gradient) and ``X^T dY`` (weight gradient), each as
one `tf.function`:

- tensorflow: TensorFlow's own MatMul kernel (Eigen, or oneDNN where TF_ENABLE_ONEDNN_OPTS=1);
- xla: the same function compiled with XLA (``jit_compile=True``);
- openblas: tfsmp's OpenBLAS kernel (`blas: openblas`, [Note: OpenBLAS products] in
  tfsmp/runtime/kernels);
- torch: torch's own product on torch tensors, where torch is installed (`.[bench-torch]`).

Then the same 2048 rows through one weight as 8 calls, as one call of 8 products and as one
product ([Note: rows per call]).

Then the last stage's fused forward-backward of the peer benchmark (4 × Dense(1024) with ReLU,
MSE, the input's gradient, weight gradients into accumulators) with TensorFlow's kernel, with
XLA and with tfsmp's kernel (products into accumulators: [Note: products into accumulators]).

Prints GFLOP/s (products) or ms (the fused call): the median over ``--rounds`` rounds of each
round's fastest of 5 calls. Not part of `run.py`: a diagnostic of the kernels
(docs/performance.md, "OpenBLAS products").
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

ROWS, WIDTH, LAYERS = 256, 1024, 4


def _fastest(fn: Callable[[], Any], calls: int = 5) -> float:
    best = float("inf")
    for _ in range(calls):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def _rounds(arms: dict[str, Callable[[], Any]], rounds: int) -> dict[str, float]:
    """Median over rounds of each arm's fastest call; the arms alternate within a round."""
    import numpy as np

    for fn in arms.values():
        fn()
        fn()
    times: dict[str, list[float]] = {name: [] for name in arms}
    for _ in range(rounds):
        for name, fn in arms.items():
            times[name].append(_fastest(fn))
    return {name: float(np.median(t)) for name, t in times.items()}


def _rows_per_call(kernels: Any, rng: Any, w: Any, rounds: int) -> dict[str, float]:
    """[Note: rows per call] A step's 8 microbatches of 256 rows through one weight, three ways
    with tfsmp's OpenBLAS kernel: 8 calls of one product (what a stage does), one call of 8
    products, one product of 2048 rows. sgemm packs the weight (4 MB) into its panel layout on
    every product, whatever the rows; at 256 rows that is a larger share of the product than at
    2048. The last two differ by that share, which bounds what a weight packed once per step
    and reused by every microbatch could save on ``x @ W`` and ``dY @ W^T`` (sgemm offers no
    such call). Returns each arm's time per 256 rows."""
    import numpy as np
    import tensorflow as tf

    big = tf.constant(rng.standard_normal((8 * ROWS, WIDTH), dtype=np.float32))
    parts = tf.split(big, 8)
    one = kernels.program(lambda a: tf.matmul(a, w), autograph=False)
    eight = kernels.program(lambda ps: [tf.matmul(a, w) for a in ps], autograph=False)
    arms = {"8 calls of 256 rows": lambda: [one(a) for a in parts],
            "1 call of 8 products of 256 rows": lambda: eight(parts),
            "1 product of 2048 rows": lambda: one(big)}
    return {name: seconds / 8 for name, seconds in _rounds(arms, rounds).items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args(argv)
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    from benchmarks import tfhelp

    tfhelp.setup_threads()  # one thread (TFSMP_BENCH_THREADS), before any TensorFlow op
    import keras
    import numpy as np
    import tensorflow as tf

    from tfsmp.runtime import kernels
    from tfsmp.runtime.stage import _accumulate_into

    kernels.load()
    rng = np.random.default_rng(0)
    x_np = rng.standard_normal((ROWS, WIDTH), dtype=np.float32)
    dy_np = rng.standard_normal((ROWS, WIDTH), dtype=np.float32)
    w_np = rng.standard_normal((WIDTH, WIDTH), dtype=np.float32)
    x, dy, w = tf.constant(x_np), tf.constant(dy_np), tf.Variable(w_np)
    products = {"x @ W": (lambda: tf.matmul(x, w)),
                "dY @ W^T": (lambda: tf.matmul(dy, w, transpose_b=True)),
                "X^T dY": (lambda: tf.matmul(x, dy, transpose_a=True))}
    arms: dict[str, Callable[[], Any]] = {}
    for name, f in products.items():
        arms[f"{name} tensorflow"] = tf.function(f, autograph=False)
        arms[f"{name} xla"] = tf.function(f, jit_compile=True, autograph=False)
        arms[f"{name} openblas"] = kernels.program(f, autograph=False)
    try:
        import torch

        torch.set_num_threads(1)
        tx, tdy, tw = (torch.from_numpy(a) for a in (x_np, dy_np, w_np))
        arms["x @ W torch"] = lambda: tx @ tw
        arms["dY @ W^T torch"] = lambda: tdy @ tw.T
        arms["X^T dY torch"] = lambda: tx.T @ tdy
    except ImportError:
        print("torch is not installed (pip install -e .[bench-torch]): no torch arms")
    flops = 2 * ROWS * WIDTH * WIDTH
    for name, seconds in _rounds(arms, args.rounds).items():
        print(f"{name:22s} {flops / seconds / 1e9:6.1f} GFLOP/s")
    for name, seconds in _rows_per_call(kernels, rng, w, args.rounds).items():
        print(f"x @ W openblas, {name:34s} {flops / seconds / 1e9:6.1f} GFLOP/s")

    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.layers.Dense(WIDTH, activation="relu")
                              for _ in range(LAYERS)])
    model.build((None, WIDTH))
    y = tf.constant(rng.standard_normal((ROWS, WIDTH), dtype=np.float32))
    accumulators = [tf.Variable(tf.zeros_like(v)) for v in model.trainable_variables]

    def fused() -> tf.Tensor:
        with tf.GradientTape() as tape:
            tape.watch(x)
            loss = tf.reduce_mean((model(x) - y) ** 2)
        grads = tape.gradient(loss, [x, *model.trainable_variables])
        for acc, g in zip(accumulators, grads[1:]):
            _accumulate_into(acc, g, False)
        return grads[0]

    calls = {"tensorflow": tf.function(fused), "xla": tf.function(fused, jit_compile=True),
             "openblas": kernels.program(fused)}
    for name, seconds in _rounds(calls, args.rounds).items():
        print(f"last stage's fused call, {name:10s} {seconds * 1e3:6.1f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
