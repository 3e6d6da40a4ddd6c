"""Keras's update_step as TF's fused training kernels: bit for bit Keras's variables and slots
over several steps, the cases that fall back to Keras's code, and the steps that use them
([Note: fused updates] in tfsmp/runtime/fused_updates.py)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfsmp as smp
from tfsmp.runtime.fused_updates import fused_update_step, fused_updates

pytestmark = pytest.mark.tf

SHAPES = [(64, 33), (33,), (7,), (1,), (3, 5, 7), (129, 17)]
FUSED_OPS = {"ResourceApplyGradientDescent", "ResourceApplyAdagradV2",
             "ResourceApplyKerasMomentum"}


def _schedule() -> Any:
    return keras.optimizers.schedules.ExponentialDecay(1e-2, decay_steps=2, decay_rate=0.7)


def _excluding(name: str, optimizer: Any) -> Any:
    optimizer.exclude_from_weight_decay(var_names=[name])
    return optimizer


OPTIMIZERS: dict[str, Callable[[], Any]] = {
    "adam": lambda: keras.optimizers.Adam(1e-2),
    "adam_schedule": lambda: keras.optimizers.Adam(_schedule()),
    "adam_betas": lambda: keras.optimizers.Adam(3e-3, beta_1=0.8, beta_2=0.95, epsilon=1e-5),
    "adamw": lambda: keras.optimizers.AdamW(1e-2, weight_decay=0.05),
    "adamw_schedule": lambda: _excluding("v1", keras.optimizers.AdamW(_schedule(),
                                                                      weight_decay=0.1)),
    "adam_clipnorm": lambda: keras.optimizers.Adam(1e-2, clipnorm=0.5),
    "adam_clipvalue": lambda: keras.optimizers.Adam(1e-2, clipvalue=0.01),
    "adam_global_clipnorm": lambda: keras.optimizers.Adam(1e-2, global_clipnorm=0.5),
    "adam_ema": lambda: keras.optimizers.Adam(1e-2, use_ema=True, ema_momentum=0.9,
                                              ema_overwrite_frequency=3),
    "adam_accumulation": lambda: keras.optimizers.Adam(1e-2, gradient_accumulation_steps=2),
    "adam_loss_scale": lambda: keras.optimizers.LossScaleOptimizer(keras.optimizers.Adam(1e-2)),
    "sgd": lambda: keras.optimizers.SGD(0.1),
    "sgd_schedule": lambda: keras.optimizers.SGD(_schedule(), weight_decay=0.01),
    "sgd_momentum": lambda: keras.optimizers.SGD(0.1, momentum=0.9),
    "sgd_nesterov": lambda: keras.optimizers.SGD(0.1, momentum=0.9, nesterov=True),
}


class OwnAdam(keras.optimizers.Adam):  # type: ignore[misc]
    """A subclass with an update_step of its own: Keras's code runs, as the user wrote it."""

    def update_step(self, gradient: Any, variable: Any, learning_rate: Any) -> None:
        super().update_step(gradient * 0.5, variable, learning_rate)


def _gradients(step: int, scale: float, dtype: Any = np.float32) -> list[tf.Tensor]:
    rng = np.random.default_rng(100 + step)
    out = []
    for shape in SHAPES:
        g = rng.standard_normal(shape) * scale
        g.flat[:: 5] = 0.0  # exact zeros: the signs of zeros must match too
        out.append(tf.constant(g.astype(dtype)))
    return out


def _train(make: Callable[[], Any], fused: bool, scale: float = 1.0, dtype: str = "float32",
           steps: int = 6) -> tuple[list[bytes], set[str]]:
    """Variables and optimizer variables (as bytes) after ``steps`` applies, and the op types
    of the compiled apply."""
    rng = np.random.default_rng(0)
    variables = [keras.Variable(rng.standard_normal(s).astype(dtype), name=f"v{i}")
                 for i, s in enumerate(SHAPES)]
    optimizer = make()
    optimizer.build(variables)

    @tf.function
    def apply(grads: list[tf.Tensor]) -> None:
        if fused:
            with fused_updates(optimizer):
                optimizer.apply_gradients(zip(grads, variables))
        else:
            optimizer.apply_gradients(zip(grads, variables))

    for step in range(steps):
        apply(_gradients(step, scale, dtype))
    graph = apply.get_concrete_function(_gradients(0, scale, dtype)).graph.as_graph_def()
    ops = {n.op for n in graph.node} | {n.op for f in graph.library.function for n in f.node_def}
    state = [np.asarray(v.numpy()).tobytes() for v in [*variables, *optimizer.variables]]
    return state, ops


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
@pytest.mark.parametrize("scale", [1.0, 1e-20, 1e18])
def test_fused_update_equals_keras_bit_for_bit(name: str, scale: float) -> None:
    keras_state, keras_ops = _train(OPTIMIZERS[name], fused=False, scale=scale)
    fused_state, fused_ops = _train(OPTIMIZERS[name], fused=True, scale=scale)
    assert fused_state == keras_state
    assert FUSED_OPS & fused_ops and not FUSED_OPS & keras_ops  # the fused kernels did run


FALLBACKS: dict[str, Callable[[], Any]] = {
    "amsgrad": lambda: keras.optimizers.Adam(1e-2, amsgrad=True),
    "own_update_step": lambda: OwnAdam(1e-2),
    "other_optimizer": lambda: keras.optimizers.RMSprop(1e-2),
    "tensor_beta": lambda: keras.optimizers.Adam(1e-2, beta_1=tf.constant(0.9)),
}


@pytest.mark.parametrize("name", sorted(FALLBACKS))
def test_optimizers_not_proven_equal_run_keras_own_update(name: str) -> None:
    assert fused_update_step(FALLBACKS[name]()) is None
    keras_state, _ = _train(FALLBACKS[name], fused=False)
    fused_state, fused_ops = _train(FALLBACKS[name], fused=True)
    assert fused_state == keras_state and not FUSED_OPS & fused_ops


def test_an_update_step_replaced_on_the_instance_is_kept() -> None:
    optimizer = keras.optimizers.Adam(1e-2)
    calls: list[int] = []

    def mine(gradient: Any, variable: Any, learning_rate: Any) -> None:
        calls.append(1)

    optimizer.update_step = mine
    assert fused_update_step(optimizer) is None
    with fused_updates(optimizer):
        assert optimizer.update_step is mine
    assert optimizer.update_step is mine


def test_float64_variables_and_xla_run_keras_own_update() -> None:
    keras_state, _ = _train(OPTIMIZERS["adam"], fused=False, dtype="float64")
    fused_state, fused_ops = _train(OPTIMIZERS["adam"], fused=True, dtype="float64")
    assert fused_state == keras_state and not FUSED_OPS & fused_ops
    optimizer = keras.optimizers.Adam()
    with fused_updates(optimizer, xla=True):
        assert "update_step" not in vars(optimizer)
    with fused_updates(optimizer):
        assert "update_step" in vars(optimizer)
    assert "update_step" not in vars(optimizer)  # the class's method again


def test_sparse_gradients_run_keras_own_update() -> None:
    def train(fused: bool) -> tuple[list[bytes], set[str]]:
        table = keras.Variable(np.arange(40, dtype=np.float32).reshape(10, 4) / 7, name="t")
        optimizer = keras.optimizers.Adam(1e-2)
        optimizer.build([table])

        @tf.function
        def apply(values: tf.Tensor) -> None:
            grad = tf.IndexedSlices(values, tf.constant([1, 7, 1]), tf.constant([10, 4]))
            if fused:
                with fused_updates(optimizer):
                    optimizer.apply_gradients([(grad, table)])
            else:
                optimizer.apply_gradients([(grad, table)])

        values = tf.constant(np.linspace(-1, 1, 12, dtype=np.float32).reshape(3, 4))
        for _ in range(3):
            apply(values)
        graph = apply.get_concrete_function(values).graph.as_graph_def()
        ops = {n.op for n in graph.node} | {n.op for f in graph.library.function
                                            for n in f.node_def}
        return [table.numpy().tobytes(), *(v.numpy().tobytes() for v in optimizer.variables)], ops

    keras_state, _ = train(False)
    fused_state, fused_ops = train(True)
    assert fused_state == keras_state and not FUSED_OPS & fused_ops


def test_the_one_call_step_uses_the_fused_update() -> None:
    if smp.is_initialized():
        smp.shutdown()
    smp.init({"partitions": 1, "microbatches": 1})
    try:
        x = np.random.default_rng(0).standard_normal((16, 8)).astype(np.float32)
        inputs = keras.Input((8,))
        dm = smp.DistributedModel(keras.Model(inputs, keras.layers.Dense(3)(inputs)))
        dm.compile(optimizer="adam", loss="mse")
        dm.train_on_batch(x, x[:, :3])
        one = dm._engine._one_call
        fn = one._fn_direct if one.direct else one._fn  # [Note: one-call direct update]
        ops = {n.op for cf in fn._list_all_concrete_functions()
               for f in cf.graph.as_graph_def().library.function for n in f.node_def}
        assert "ResourceApplyAdagradV2" in ops
    finally:
        smp.shutdown()
