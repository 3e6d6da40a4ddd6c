"""One stage's backward three ways, alternating in one process: ``python benchmarks/stage_backward.py``.

4 × Dense(1024) (ReLU), microbatch 256, one thread, gradients accumulated into variables:

- taped: the compiled forward under an eager GradientTape, `tape.gradient` of its function call,
  then a compiled accumulation (the fallback of [Note: stashing] in tfsmp/runtime/stage.py);
- compiled: the forward returns its products, one compiled call replays them, differentiates
  and accumulates ([Note: replayed products] in tfsmp/runtime/deferred.py);
- fused: forward, backward and accumulation in one call (the floor; a pipeline cannot use it for
  a stage that is not last, whose output gradients arrive later).

Prints the fastest and the median of ``--rounds`` rounds per arm: forward + backward, and the
backward alone (from the forward's end). Not part of `run.py`: a diagnostic of the stage program.
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=25)
    args = parser.parse_args(argv)
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import keras
    import numpy as np
    import tensorflow as tf

    from tfsmp.runtime import deferred

    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(1)
    deferred.install()
    width, rows = 1024, 256
    x_in = keras.Input((width,))
    h = x_in
    for _ in range(4):
        h = keras.layers.Dense(width, activation="relu")(h)
    model = keras.Model(x_in, h)
    variables = model.trainable_variables
    accs = [tf.Variable(tf.zeros_like(v)) for v in variables]
    x = tf.random.normal((rows, width))
    dy = tf.random.normal((rows, width))

    def accumulate(grads: list[Any]) -> tf.Tensor:
        return tf.reduce_all(tf.stack([tf.reduce_all(tf.math.is_finite(a.assign_add(g)))
                                       for a, g in zip(accs, grads)]))

    forward = tf.function(lambda x: model(x, training=True))
    accumulate_fn = tf.function(accumulate)

    @tf.function
    def forward_stash(x: tf.Tensor) -> Any:
        with deferred.recording(None) as rec:
            out = model(x, training=True)
        return out, rec.products

    @tf.function
    def backward_replay(x: tf.Tensor, products: list[tf.Tensor], dy: tf.Tensor) -> tf.Tensor:
        with tf.GradientTape() as tape, deferred.recording(None, replay=products):
            out = model(x, training=True)
        return accumulate(tape.gradient(out, [v.value for v in variables], output_gradients=dy))

    @tf.function
    def fused(x: tf.Tensor, dy: tf.Tensor) -> tf.Tensor:
        with tf.GradientTape() as tape:
            out = model(x, training=True)
        return accumulate(tape.gradient(out, [v.value for v in variables], output_gradients=dy))

    def taped() -> float:
        tape = tf.GradientTape()
        with tape:
            out = forward(x)
        out.numpy()
        mid = time.perf_counter()
        grads = tape.gradient(out, [v.value for v in variables], output_gradients=dy)
        accumulate_fn(grads).numpy()
        return mid

    def compiled() -> float:
        _, products = forward_stash(x)
        products[-1].numpy()
        mid = time.perf_counter()
        backward_replay(x, products, dy).numpy()
        return mid

    def floor() -> float:
        mid = time.perf_counter()
        fused(x, dy).numpy()
        return mid

    arms: dict[str, Callable[[], float]] = {"taped": taped, "compiled": compiled, "fused": floor}
    for arm in arms.values():
        for _ in range(3):
            arm()
    total: dict[str, list[float]] = {k: [] for k in arms}
    backward: dict[str, list[float]] = {k: [] for k in arms}
    for _ in range(args.rounds):
        for name, arm in arms.items():
            start = time.perf_counter()
            mid = arm()
            end = time.perf_counter()
            total[name].append(end - start)
            backward[name].append(end - mid)
    for name in arms:
        print(f"{name:9s} forward+backward {1e3 * min(total[name]):6.1f} ms (median "
              f"{1e3 * float(np.median(total[name])):6.1f}); backward {1e3 * min(backward[name]):6.1f} ms"
              f" (median {1e3 * float(np.median(backward[name])):6.1f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
