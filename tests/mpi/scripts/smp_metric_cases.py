"""SMP-script cases that were silently wrong: metrics updated inside `@smp.step`, the porting names
(`get_gradients`, `reset_states`, `variables()`, `num_microbatches`), and hybrid data parallelism
with ``horovod: False`` from unseeded initial weights. Each case compares with plain Keras run
on the same weights and data, in this process."""

from __future__ import annotations

import types
from typing import Any

import keras
import numpy as np
import tensorflow as tf

import tfsmp as smp
from tfsmp.errors import StepError

L = keras.layers
LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
STEPS = 3


def setup(ctx: Any) -> None:
    smp.init()  # the config arrives as SM_HP_MP_PARAMETERS; no seed: replicas draw their own


class Net(smp.DistributedModel):
    def __init__(self) -> None:
        super().__init__()
        self.d1 = L.Dense(16, activation="tanh")
        self.d2 = L.Dense(8, activation="tanh")
        self.d3 = L.Dense(4)

    def call(self, x, training=None):  # type: ignore[no-untyped-def]
        return self.d3(self.d2(self.d1(x)))


def plain(weights: list[np.ndarray]) -> keras.Model:
    ref = keras.Sequential([keras.Input((6,)), L.Dense(16, activation="tanh"),
                            L.Dense(8, activation="tanh"), L.Dense(4)])
    ref.set_weights(weights)
    return ref


def data(n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 6)).astype(np.float32)
    return x, (np.abs(x[:, 0] * 2).astype(np.int64) % 4)


def microbatch_losses(ref: keras.Model, x: np.ndarray, y: np.ndarray) -> list[float]:
    m = smp.num_microbatches()
    return [float(LOSS(yb, ref(xb))) for xb, yb in zip(np.split(x, m), np.split(y, m))]


def case_num_microbatches(ctx: Any) -> int:
    return smp.num_microbatches()


def case_metrics_inside_step(ctx: Any) -> dict[str, Any]:
    """Metrics updated after `model(...)` inside a step, called eagerly and from a
    tf.function: every rank reads the last stage's values, equal to plain Keras."""
    model = Net()
    mean = keras.metrics.Mean()
    acc = keras.metrics.SparseCategoricalAccuracy()

    @smp.step
    def test_step(x, y):  # type: ignore[no-untyped-def]
        logits = model(x, training=False)
        loss = LOSS(y, logits)
        mean(loss)
        acc(y, logits)
        return loss

    graph_step = tf.function(lambda x, y: test_step(x, y).reduce_mean())
    batches = [data(16, 1), data(16, 2)]
    got = {}
    for call, fn in (("eager", test_step), ("graph", graph_step)):
        mean.reset_states()
        acc.reset_states()
        for x, y in batches:
            fn(tf.constant(x), tf.constant(y))
        got[call] = [float(mean.result()), float(acc.result())]
    ref = plain(model.get_weights())
    losses = [v for x, y in batches for v in microbatch_losses(ref, x, y)]
    ref_acc = keras.metrics.SparseCategoricalAccuracy()
    for x, y in batches:
        ref_acc.update_state(y, ref(x))
    return {"got": got, "ref": [float(np.mean(losses)), float(ref_acc.result())]}


def case_get_gradients_trains_like_keras(ctx: Any) -> dict[str, Any]:
    """SMP's documented `optimizer.get_gradients(loss, model.trainable_variables)` inside a
    step called from a tf.function, with `optimizer.variables()` and `reset_states()`."""
    model = Net()
    opt = keras.optimizers.SGD(0.1, momentum=0.9)
    train_acc = keras.metrics.SparseCategoricalAccuracy()

    @smp.step
    def get_grads(x, y):  # type: ignore[no-untyped-def]
        logits = model(x, training=True)
        loss = LOSS(y, logits)
        return opt.get_gradients(loss, model.trainable_variables), loss, logits

    @tf.function
    def train_step(x, y):  # type: ignore[no-untyped-def]
        grads, loss, logits = get_grads(x, y)
        opt.apply_gradients(zip([g.accumulate() for g in grads], model.trainable_variables))
        train_acc(y, logits.merge())
        return loss.reduce_mean()

    x, y = data(16 * STEPS, 3)
    model.partition(x[:16])
    w0 = model.get_weights()
    losses = []
    for s in range(STEPS):
        train_acc.reset_states()
        losses.append(float(train_step(tf.constant(x[s * 16:(s + 1) * 16]),
                                       tf.constant(y[s * 16:(s + 1) * 16]))))
    ref = plain(w0)
    ref_opt = keras.optimizers.SGD(0.1, momentum=0.9)
    ref_losses = []
    for s in range(STEPS):
        xb, yb = x[s * 16:(s + 1) * 16], y[s * 16:(s + 1) * 16]
        with tf.GradientTape() as tape:
            loss = LOSS(yb, ref(xb))
        ref_opt.apply_gradients(zip(tape.gradient(loss, ref.trainable_variables),
                                    ref.trainable_variables))
        ref_losses.append(float(loss))
    err = max(float(np.max(np.abs(a - b))) for a, b in zip(model.get_weights(), ref.get_weights()))
    try:
        opt.get_gradients(tf.constant(1.0), model.trainable_variables)
        outside = "no error"
    except StepError as e:
        outside = str(e)
    return {"losses": losses, "ref_losses": ref_losses, "max_weight_err": err,
            "opt_variables_callable": len(opt.variables()) == len(opt.variables) > 0,
            "outside_error": outside}


def case_unsyncable_variable_raises(ctx: Any) -> str:
    """A variable the step updates that no rank can find is an error on every rank."""
    model = Net()
    holder = types.SimpleNamespace(counter=keras.Variable(0.0))

    @smp.step
    def counting_step(x):  # type: ignore[no-untyped-def]
        logits = model(x, training=False)
        holder.counter.assign_add(1.0)
        return logits

    try:
        counting_step(tf.constant(data(8, 4)[0]))
    except StepError as e:
        return str(e)
    return "no error"


def case_hybrid_replicas(ctx: Any) -> dict[str, Any]:
    """``horovod: False``, 2 replicas, no seed: replicas start from the same weights, and
    `g.accumulate()` is the gradient of the global batch, as in plain Keras."""
    model = Net()  # unseeded: each process draws its own initial values
    opt = keras.optimizers.SGD(0.1)
    r, d = smp.dp_rank(), smp.dp_size()
    x, y = data(16 * STEPS, 5)
    model.partition(x[:8])
    mine = [v.numpy().tolist() for v in model.trainable_variables]
    start_equal = all(p == mine for p in smp.allgather(mine, smp.DP_GROUP))
    w0 = model.get_weights()

    @smp.step
    def get_grads(x, y):  # type: ignore[no-untyped-def]
        with tf.GradientTape() as tape:
            loss = LOSS(y, model(x, training=True))
        return tape.gradient(loss, model.trainable_variables), loss

    for s in range(STEPS):
        xb, yb = x[s * 16:(s + 1) * 16][r::d], y[s * 16:(s + 1) * 16][r::d]
        grads, _ = get_grads(tf.constant(xb), tf.constant(yb))
        opt.apply_gradients(zip([g.accumulate() for g in grads], model.trainable_variables))
    mine = [v.numpy().tolist() for v in model.trainable_variables]
    end_equal = all(p == mine for p in smp.allgather(mine, smp.DP_GROUP))
    ref = plain(w0)
    ref_opt = keras.optimizers.SGD(0.1)
    for s in range(STEPS):
        xb, yb = x[s * 16:(s + 1) * 16], y[s * 16:(s + 1) * 16]
        with tf.GradientTape() as tape:
            loss = tf.add_n([LOSS(yb[q::d], ref(xb[q::d])) for q in range(d)]) / d
        ref_opt.apply_gradients(zip(tape.gradient(loss, ref.trainable_variables),
                                    ref.trainable_variables))
    err = max(float(np.max(np.abs(a - b))) for a, b in zip(model.get_weights(), ref.get_weights()))
    return {"start_equal": start_equal, "end_equal": end_equal, "max_weight_err": err}
