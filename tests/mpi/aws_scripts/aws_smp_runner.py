"""Runs one verbatim AWS SMP TF2 training script of this folder on synthetic MNIST, then replays
its training in plain Keras.

    mpirun -np N python -m mpi4py aws_smp_runner.py SCRIPT --train N --test N [--cwd DIR]

The script runs unchanged through ``runpy`` (as ``__main__``, with its folder first on sys.path,
as ``python SCRIPT`` would have it). What the runner changes, all from outside the script:

- Data loading: ``tf.keras.datasets.mnist.load_data`` returns a small synthetic MNIST (uint8
  28×28 images and uint8 labels, like the real one; class k is a bright 8×5 block at a fixed
  place on faint noise, learnable in a few steps, as the DLC scripts' own loss asserts need);
  the same arrays on every rank. The scripts' loops run over this data, so ``--train`` and
  ``--test`` set how many steps they take.
- SageMaker's environment for ``tf2.py``'s final S3 sync: the test sets ``SM_MODULE_DIR``,
  ``SM_CURRENT_HOST``, puts a fake ``aws`` command on PATH and makes ``/opt/ml/checkpoints``
  exist; the runner puts a ``boto3`` stub in ``sys.modules`` whose ``head_bucket`` succeeds.

It records the model's weights right after partitioning (a post-partition hook), before any
update. After the script, every rank prints ``AWSRANK {rank, dp_rank, mp_rank}`` and world
rank 0 prints ``AWSREF {"replicas": [[{epoch metrics}, ...], ...]}``: the script's training
replayed in one process with plain Keras by code of ours — the same initial weights, the same
tf.data pipelines and seeds (including the DLC scripts' profiling pass over ``train_ds``), the
microbatch losses the step computes, Adam, the mean gradient over data-parallel replicas — and
the metric values each replica's ranks should print. If the script raises, the rank still
prints these lines, then ``AWSFAIL "<traceback>"``, and aborts the job.
"""

from __future__ import annotations

import argparse
import json
import os
import runpy
import sys
import traceback
import types
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
EPOCHS = 5  # hard-coded in every script


def fake_mnist(n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    y = (np.arange(n) % 10).astype(np.uint8)
    rng.shuffle(y)
    x = rng.integers(0, 40, size=(n, 28, 28), dtype=np.uint8)
    for i, k in enumerate(y):
        r, c = (k // 5) * 14 + 3, (k % 5) * 5 + 1
        x[i, r:r + 8, c:c + 5] = 255
    return x, y


@dataclass(frozen=True)
class Spec:
    """What the replay needs to know about a script (read off its source)."""

    layers: str  # "examples", "conv_last" (tf2_conv.py) or "conv" (hvd2_conv)
    batch: int
    drop_remainder: bool
    train_seed: tuple[int, int]  # shuffle seed = a + b * dp_rank
    test: str  # "shuffled" (seed dp_rank), "plain" or "none"
    profile: bool  # the script iterates train_ds once to profile before training


SPECS = {
    "tf2": Spec("examples", 256, True, (0, 1), "shuffled", False),
    "tf2_hvd": Spec("examples", 256, True, (0, 1), "shuffled", False),
    "tf2_conv": Spec("conv_last", 32, False, (123, 0), "plain", True),
    "smmodelparallel_hvd2_conv": Spec("conv", 32, False, (123, 1), "none", True),
}


def plain_model(kind: str) -> Any:
    import tensorflow as tf
    from tensorflow.keras.layers import Conv2D, Dense, Flatten

    x = tf.keras.Input((28, 28, 1))
    h = Flatten()(Conv2D(32, 3, activation="relu")(x))
    if kind == "examples":
        return tf.keras.Model(x, Dense(10)(Dense(128)(h)))
    h = Dense(10)(Dense(128, activation="relu")(h))
    if kind == "conv_last":
        last = Dense(10)
        h = last(last(h))
    return tf.keras.Model(x, h)


def replay(spec: Spec, data: dict[str, np.ndarray], w0: list[np.ndarray], m: int, d: int
           ) -> list[list[dict[str, float]]]:
    """Per replica, per epoch: the metrics the script prints, from plain Keras."""
    import tensorflow as tf

    tf.random.set_seed(1234)  # as the scripts do; the shuffles' op seeds are explicit
    x_tr, x_te = (data["x_train"] / 255.0)[..., None], (data["x_test"] / 255.0)[..., None]

    def pipeline(x: Any, y: Any, seed: int | None) -> Any:
        ds = tf.data.Dataset.from_tensor_slices((x, y))
        ds = ds.shuffle(10000, seed=seed) if seed is not None else ds
        return ds.batch(spec.batch, drop_remainder=spec.drop_remainder)

    a, b = spec.train_seed
    train = [pipeline(x_tr, data["y_train"], a + b * q) for q in range(d)]
    test = [pipeline(x_te, data["y_test"], q if spec.test == "shuffled" else None)
            for q in range(d)]
    if spec.profile:
        for ds in train:
            next(iter(ds))
    model = plain_model(spec.layers)
    shapes = [tuple(v.shape) for v in model.weights]
    if shapes != [tuple(np.shape(w)) for w in w0]:
        raise AssertionError(f"reference model {shapes} != script model {[np.shape(w) for w in w0]}")
    model.set_weights(w0)
    opt = tf.keras.optimizers.Adam()
    loss_fn = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    out: list[list[dict[str, float]]] = [[] for _ in range(d)]

    @tf.function  # compiled, so that rank 0's replay costs about one replica's training
    def step(xb: Any, yb: Any) -> Any:
        with tf.GradientTape() as tape:
            preds = [model(xi) for xi in tf.split(xb, m)]
            loss = tf.add_n([loss_fn(yi, p) for yi, p in zip(tf.split(yb, m), preds)]) / m
        return loss, tf.concat(preds, 0), tape.gradient(loss, model.trainable_variables)

    for _ in range(EPOCHS):
        tl = [tf.keras.metrics.Mean() for _ in range(d)]
        ta = [tf.keras.metrics.SparseCategoricalAccuracy() for _ in range(d)]
        for batches in zip(*train):
            total = None
            for q, (xb, yb) in enumerate(batches):
                loss, preds, grads = step(xb, yb)
                total = grads if total is None else [t + g for t, g in zip(total, grads)]
                tl[q](loss)
                ta[q](yb, preds)
            opt.apply_gradients(zip([t / d for t in total], model.trainable_variables))
        el = [tf.keras.metrics.Mean() for _ in range(d)]
        ea = [tf.keras.metrics.SparseCategoricalAccuracy() for _ in range(d)]
        for q in range(d):
            for xb, yb in test[q] if spec.test != "none" else []:
                for xi, yi in zip(tf.split(xb, m), tf.split(yb, m)):
                    p = model(xi)
                    el[q](loss_fn(yi, p))
                    ea[q](yi, p)
        for q in range(d):
            out[q].append({"train_loss": float(tl[q].result()), "train_acc": float(ta[q].result()),
                           "test_loss": float(el[q].result()), "test_acc": float(ea[q].result())})
    return out


def _boto3_stub() -> types.ModuleType:
    """``boto3.resource("s3").meta.client.head_bucket(...)`` succeeds; nothing else is used."""
    stub = types.ModuleType("boto3")
    client = types.SimpleNamespace(head_bucket=lambda **kwargs: {})
    stub.resource = lambda name: types.SimpleNamespace(meta=types.SimpleNamespace(client=client))  # type: ignore[attr-defined]
    return stub


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("script")
    parser.add_argument("--train", type=int, required=True)
    parser.add_argument("--test", type=int, required=True)
    parser.add_argument("--cwd")
    args = parser.parse_args()
    script = Path(args.script).resolve()
    if args.cwd:
        os.chdir(args.cwd)
    sys.argv = [str(script)]
    sys.path.insert(0, str(script.parent))

    import tensorflow as tf

    data = {}
    data["x_train"], data["y_train"] = fake_mnist(args.train, 0)
    data["x_test"], data["y_test"] = fake_mnist(args.test, 1)

    def load_data(path: str = "mnist.npz") -> Any:
        return (data["x_train"], data["y_train"]), (data["x_test"], data["y_test"])

    tf.keras.datasets.mnist.load_data = load_data
    sys.modules["boto3"] = _boto3_stub()

    import tfsmp as smp
    from tfsmp.keras.model import DistributedModel

    initial: list[list[np.ndarray]] = []
    smp.register_post_partition_hook(
        lambda: initial.append(DistributedModel._instances()[-1].get_weights()))

    failure = None
    try:
        runpy.run_path(str(script), run_name="__main__")
    except Exception:  # still report (a failure after training leaves metrics to check)
        failure = traceback.format_exc()
    print("AWSRANK " + json.dumps({"rank": smp.rank(), "dp_rank": smp.dp_rank(),
                                   "mp_rank": smp.mp_rank()}), flush=True)
    if smp.rank() == 0 and initial:
        spec = SPECS[script.stem]
        ref = replay(spec, data, initial[0], smp.num_microbatches(), smp.dp_size())
        print("AWSREF " + json.dumps({"replicas": ref}), flush=True)
    if failure is not None:
        print("AWSFAIL " + json.dumps(failure), flush=True)
        from mpi4py import MPI

        MPI.COMM_WORLD.Abort(1)  # peers may wait in a collective for this rank
    smp.barrier()


if __name__ == "__main__":
    main()
