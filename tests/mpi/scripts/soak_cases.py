"""The soak: 500 training steps of a small pipelined model; memory and tf.function traces sampled.

Cases run through `tests/mpi/cases_runner.py` (4 ranks: partitions=2, 2 replicas). Resident
memory is read from /proc/self/status (VmRSS) every SAMPLE_EVERY steps; the trace counts of every
tf.function the pipeline runs are read after the warm-up and at the end.
"""

from __future__ import annotations

import os
import time
from typing import Any

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras
import numpy as np

import tfsmp

STEPS = 500
WARMUP = 50
SAMPLE_EVERY = 25
BATCH = 16
STEPS_PER_EPOCH = 50


def rss_mb() -> float:
    """This process's resident set size in MB (VmRSS)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS line in /proc/self/status")


def trace_counts(dm: tfsmp.DistributedModel) -> dict[str, int]:
    """Traces so far of every tf.function a training step runs on this rank."""
    engine = dm._engine
    bridge = engine._bridge  # the optimizer step's functions (tfsmp/runtime/optimizer_options.py)
    fns: dict[str, Any] = {"apply": getattr(bridge, "_apply_fn", None),
                           "apply_deferred": getattr(bridge, "_deferred_fn", None),
                           # Keras's metric objects' update on the last stage (issue 26)
                           "metrics": getattr(dm._trainer_steps.metrics, "_update_fn", None)}
    for s, prog in engine.programs.items():
        for name in ("_fwd", "_bwd_recompute", "_fused", "_accumulate", "_fwd_split", "_weight"):
            fns[f"stage{s}{name}"] = getattr(prog, name)
    return {k: int(f.experimental_get_tracing_count()) for k, f in fns.items() if f is not None}


class Sampler(keras.callbacks.Callback):  # type: ignore[misc]
    """Records RSS every SAMPLE_EVERY global steps and the trace counts after the warm-up."""

    def __init__(self, dm: tfsmp.DistributedModel) -> None:
        super().__init__()
        self.dm = dm
        self.step = 0
        self.rss: dict[int, float] = {}
        self.traces_after_warmup: dict[str, int] = {}
        self.started = time.monotonic()
        self.warm_at = 0.0

    def on_train_batch_end(self, batch: int, logs: object = None) -> None:
        self.step += 1
        if self.step % SAMPLE_EVERY == 0:
            self.rss[self.step] = round(rss_mb(), 2)
        if self.step == WARMUP:
            self.traces_after_warmup = trace_counts(self.dm)
            self.warm_at = time.monotonic()


def case_soak(ctx: Any) -> dict[str, Any]:
    tfsmp.init({"partitions": 2, "microbatches": 2, "seed": 7})
    keras.utils.set_random_seed(7)
    inp = keras.Input((16,), name="x")
    h = inp
    for i in range(4):
        h = keras.layers.Dense(32, activation="relu", name=f"d{i}")(h)
    model = keras.Model(inp, keras.layers.Dense(4, name="out")(h))
    dm = tfsmp.DistributedModel(model)
    dm.compile(optimizer=keras.optimizers.Adam(1e-3), loss="mse", metrics=["mae"])
    rng = np.random.default_rng(0)
    x = rng.normal(size=(STEPS_PER_EPOCH * BATCH, 16)).astype(np.float32)
    y = x[:, :4] * 0.5
    sampler = Sampler(dm)
    history = dm.fit(x, y, batch_size=BATCH, epochs=STEPS // STEPS_PER_EPOCH, verbose=0,
                     callbacks=[sampler])
    end = time.monotonic()
    return {"steps": sampler.step, "rss_mb": sampler.rss,
            "traces_after_warmup": sampler.traces_after_warmup,
            "traces_at_end": trace_counts(dm),
            "seconds_after_warmup": round(end - sampler.warm_at, 2),
            "loss_first": history.history["loss"][0], "loss_last": history.history["loss"][-1]}
