"""Weights at the step's end across data-parallel replicas (run by `tests/mpi/cases_runner.py`).

4 ranks: a stack of Dense(64) layers and a LayerNormalization (which keeps accumulators), batch
8, 3 Adam steps, at p=2 x d=2 and p=1 x d=4, m = 1 and 4, sharded optimizer state or not; and
at p=4, m=1, where late weights come before a direct update ([Note: late before direct]), and
a batch of 64 rows, whose linear inputs outweigh a Dense(64)'s kernel: a direct update. Each
case returns the losses, every weight's error against plain Keras (<= 1: equal at rtol 1e-5),
whether this rank took its linear layers' gradients at the step's end ([Note: late weights
across replicas] in tfsmp/runtime/stage.py) and the bytes of its full-size gradient
accumulators.
"""

from __future__ import annotations

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from typing import Any

import keras
import numpy as np

import tfsmp

STEPS, BATCH, WIDTH = 3, 8, 64
# as tests/tf/test_late_weights.py: Adam divides by sqrt(v), and a near-zero gradient's
# rounding in another summation order moves its weight by a few 1e-6
RTOL, ATOL = 1e-5, 5e-6


def _model() -> Any:
    x = keras.Input((WIDTH,), name="x")
    h = x
    for i in range(4):
        h = keras.layers.Dense(WIDTH, activation="relu" if i < 3 else None, name=f"d{i}",
                               kernel_initializer=keras.initializers.GlorotUniform(seed=i))(h)
    return keras.Model(x, keras.layers.LayerNormalization(name="norm")(h))


def _data(batch: int = BATCH) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    return (rng.standard_normal((STEPS * batch, WIDTH)).astype("float32"),
            rng.standard_normal((STEPS * batch, WIDTH)).astype("float32"))


def _train(config: dict[str, Any] | None, first_rows: int = BATCH, batch: int = BATCH
           ) -> tuple[list[float], list[np.ndarray], Any]:
    x, y = _data(batch)
    model = _model()
    engine = None
    if config is not None:
        if tfsmp.is_initialized():
            tfsmp.shutdown()
        tfsmp.init({"optimize": "memory", **config})
        model = tfsmp.DistributedModel(model)
    model.compile(optimizer=keras.optimizers.Adam(1e-3), loss="mse")
    # the first batch may have fewer rows (``first_rows``), fewer than the replicas even
    bounds = [(0, first_rows)] + [(i * batch, (i + 1) * batch) for i in range(1, STEPS)]
    losses = [float(np.asarray(model.train_on_batch(x[a:b], y[a:b]))) for a, b in bounds]
    if config is not None:
        engine = model._engine
    return losses, model.get_weights(), engine


def _case(config: dict[str, Any], first_rows: int = BATCH, batch: int = BATCH
          ) -> dict[str, Any]:
    ref_losses, ref, _ = _train(None, first_rows, batch)
    losses, weights, engine = _train(config, first_rows, batch)
    errs = [float(np.max(np.abs(a - b) / (ATOL + RTOL * np.abs(b))))
            for a, b in zip(weights, ref)]
    accs = sum(int(np.prod(a.shape)) * 4 for p in engine.programs.values()
               for a in p.grads.accumulators if int(np.prod(a.shape)) > WIDTH)
    return {"losses": losses, "ref_losses": ref_losses, "max_err": max(errs),
            "late": bool(engine.updates.late) and all(p.late for p in engine.programs.values()),
            "direct": bool(engine.updates.direct), "accumulator_bytes": accs,
            "loss_ok": bool(np.allclose(losses, ref_losses, rtol=RTOL, atol=ATOL))}


def case_p2d2_m4(ctx: Any) -> dict[str, Any]:
    return _case({"partitions": 2, "microbatches": 4})


def case_p2d2_m4_speed(ctx: Any) -> dict[str, Any]:
    """Speed mode asks for the drain split ([Note: drain split] in executor.py); a late stage
    already splits every backward, and its W's are the step's end's (this crashed on the
    accumulators' placeholders)."""
    return _case({"partitions": 2, "microbatches": 4, "optimize": "speed"})


def case_p2d2_m4_sharded(ctx: Any) -> dict[str, Any]:
    return _case({"partitions": 2, "microbatches": 4, "shard_optimizer_state": True})


def case_p2d2_m1_sharded(ctx: Any) -> dict[str, Any]:
    return _case({"partitions": 2, "microbatches": 1, "shard_optimizer_state": True})


def case_p1d4_m2_sharded(ctx: Any) -> dict[str, Any]:
    return _case({"partitions": 1, "microbatches": 2, "shard_optimizer_state": True})


def case_p1d4_m2_first_batch_of_one(ctx: Any) -> dict[str, Any]:
    """Three replicas have no rows in the first step, before the stages decided on weights at
    the step's end: every replica keeps accumulators (this hung in the reductions)."""
    return _case({"partitions": 1, "microbatches": 2}, first_rows=1)


def case_p4_m1_late_before_direct(ctx: Any) -> dict[str, Any]:
    return _case({"partitions": 4, "microbatches": 1})


def case_p4_m1_direct_where_late_does_not_pay(ctx: Any) -> dict[str, Any]:
    return _case({"partitions": 4, "microbatches": 1}, first_rows=64, batch=64)


def teardown(ctx: Any) -> None:
    if tfsmp.is_initialized():
        tfsmp.shutdown()
