"""SMP's MNIST-style TensorFlow script (reference §2.10) with `import tfsmp as smp`, checked
against the same training in plain Keras in this process.

Usage: python -m mpi4py smp_script.py VARIANT [VARIANT ...]
VARIANT is ``eager`` (call the step directly), ``graph`` (from an outer @tf.function, as SMP's
examples do), ``manual`` (smp.partition scopes, auto_partition off) or ``horovod`` (hybrid
pattern: hvd.allreduce(g.accumulate()) and hvd.broadcast_variables without hvd.init()).
Prints one line per variant: ``SMP {"variant", "rank", "losses", "ref_losses", "max_weight_err"}``.
"""

from __future__ import annotations

import gc
import json
import os
import sys
import traceback

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras
import numpy as np
import tensorflow as tf

import tfsmp as smp

STEPS, BATCH = 4, 32
L = keras.layers


def images(n: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(11)
    return rng.random((n, 28, 28, 1)).astype(np.float32), rng.integers(0, 10, size=n)


class Net(smp.DistributedModel):
    """The model of SMP's example: conv, flatten, two dense layers."""

    def __init__(self, manual: bool = False) -> None:
        super().__init__()
        self.manual = manual
        self.conv = L.Conv2D(8, 3, activation="relu", name="conv")
        self.pool = L.MaxPooling2D(4, name="pool")
        self.flat = L.Flatten(name="flat")
        self.d1 = L.Dense(32, activation="relu", name="d1")
        self.d2 = L.Dense(10, name="d2")

    def call(self, x, training=None):  # type: ignore[no-untyped-def]
        if not self.manual:
            return self.d2(self.d1(self.flat(self.pool(self.conv(x)))))
        with smp.partition(0):
            h = self.pool(self.conv(x))
        with smp.partition(1):
            return self.d2(self.d1(self.flat(h)))


class Ref(keras.Model):
    def __init__(self) -> None:
        super().__init__()
        self.conv = L.Conv2D(8, 3, activation="relu", name="conv")
        self.pool = L.MaxPooling2D(4, name="pool")
        self.flat = L.Flatten(name="flat")
        self.d1 = L.Dense(32, activation="relu", name="d1")
        self.d2 = L.Dense(10, name="d2")

    def call(self, x):  # type: ignore[no-untyped-def]
        return self.d2(self.d1(self.flat(self.pool(self.conv(x)))))


def reference(x: np.ndarray, y: np.ndarray, replicas: int) -> tuple[list[list[float]], list[np.ndarray]]:
    keras.utils.set_random_seed(0)
    ref = Ref()
    ref(x[:1])
    opt = keras.optimizers.SGD(0.1, momentum=0.9)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    losses = []
    for s in range(STEPS):
        xb, yb = x[s * BATCH:(s + 1) * BATCH], y[s * BATCH:(s + 1) * BATCH]
        with tf.GradientTape() as tape:
            per = [loss_fn(yb[r::replicas], ref(xb[r::replicas])) for r in range(replicas)]
            loss = tf.add_n(per) / replicas
        opt.apply_gradients(zip(tape.gradient(loss, ref.trainable_variables), ref.trainable_variables))
        losses.append([float(v) for v in per])
    return losses, [v.numpy() for v in ref.weights]


def run(variant: str) -> dict[str, object]:
    horovod = variant == "horovod"
    config = {"partitions": 2, "microbatches": 4, "pipeline": "interleaved",
              "optimize": "speed", "horovod": horovod}
    if variant == "manual":
        config.update(auto_partition=False, default_partition=0)
    if smp.is_initialized():
        smp.shutdown()
    smp.init(config)
    replicas = smp.dp_size()
    x, y = images(STEPS * BATCH)
    ref_losses, ref_weights = reference(x, y, replicas)

    keras.utils.set_random_seed(0)
    model = Net(manual=variant == "manual")
    opt = keras.optimizers.SGD(0.1, momentum=0.9)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    accuracy = keras.metrics.SparseCategoricalAccuracy()
    if horovod:
        import horovod.tensorflow as hvd  # no hvd.init(): smp.init did it on the dp group

    @smp.step
    def fwd_bwd(images, labels):  # type: ignore[no-untyped-def]
        with tf.GradientTape() as tape:
            logits = model(images, training=True)
            loss = loss_fn(labels, logits)
        return tape.gradient(loss, model.trainable_variables), loss, logits

    def train_step(images, labels, first_batch):  # type: ignore[no-untyped-def]
        grads, loss, logits = fwd_bwd(images, labels)
        grads = [g.accumulate() for g in grads]
        if horovod:
            grads = [hvd.allreduce(g) for g in grads]
        opt.apply_gradients(zip(grads, model.trainable_variables))
        accuracy.update_state(labels, logits.merge())
        return loss.reduce_mean()

    step_fn = train_step if variant == "eager" else tf.function(train_step)
    losses = []
    for s in range(STEPS):
        xb, yb = x[s * BATCH:(s + 1) * BATCH], y[s * BATCH:(s + 1) * BATCH]
        r = smp.dp_rank()
        loss = step_fn(tf.constant(xb[r::replicas]), tf.constant(yb[r::replicas]), s == 0)
        if horovod and s == 0:
            hvd.broadcast_variables(model.variables, root_rank=0)
            hvd.broadcast_variables(opt.variables, root_rank=0)
        losses.append(float(loss))
    weights = model.get_weights()
    err = max(float(np.max(np.abs(a - b) / (1e-6 + 1e-5 * np.abs(b))))
              for a, b in zip(weights, ref_weights))
    per_var = [float(np.max(np.abs(a - b))) for a, b in zip(weights, ref_weights)]
    result = {"per_var": per_var, "variant": variant, "rank": smp.rank(), "losses": losses,
              "ref_losses": [step[smp.dp_rank()] for step in ref_losses], "max_weight_err": err,
              "accuracy": float(accuracy.result()), "stage": smp.mp_rank(),
              "plan": dict(model.plan.stage_of)}
    gc.collect()
    return result


def main(variants: list[str]) -> None:
    for variant in variants:
        try:
            out = run(variant)
        except Exception:
            out = {"variant": variant, "rank": smp.rank() if smp.is_initialized() else -1,
                   "error": traceback.format_exc()}
        print("SMP " + json.dumps(out), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
