"""Reference-equality cases for the pipeline runtime, many per mpirun launch.

Usage (under mpirun): python -m mpi4py runtime_cases.py CASE [CASE ...]
A CASE is ``model:partitions:microbatches:pipeline:optimize[:flag,flag]``, e.g.
``mlp:2:4:interleaved:speed`` or ``embed:2:4:simple:memory:adam,horovod``. Flags: ``horovod``
(reduce over Horovod), ``adam`` (Adam instead of SGD with momentum), ``v2`` (two virtual
stages per rank), ``shard`` (``shard_optimizer_state``), ``clip`` (``global_clipnorm``), ``xla``
(the ``xla`` parameter: stage programs compiled with XLA), ``jit`` (the same asked by
``compile(jit_compile=True)``); with either, the reference is plain Keras compiled with
``jit_compile=True``; ``blas`` (the ``blas='openblas'`` parameter: the stage programs' products
run tfsmp's OpenBLAS kernel, checked by its rounding, tfsmp/runtime/kernels). Pipelines: ``simple``, ``interleaved``, and the zero-bubble ``zb-h1`` and
``zb-v`` (2 chunks per rank in a V).
Every rank prints one JSON line per case: {"case", "rank", "ok", "losses", "ref_losses",
"max_weight_err", "held_bytes", "plan_bytes", "error"}.

Each case trains the same seeded model for 3 optimizer steps twice — plain Keras in this process,
and `tfsmp.DistributedModel` across the world — and compares per-step losses and all final weights.
"""

from __future__ import annotations

import json
import os
import sys
import traceback

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras
import numpy as np
import tensorflow as tf

import tfsmp
from tfsmp.keras.porting import rank_variables  # what this rank holds
from tfsmp.runtime import kernels

RTOL, ATOL = 1e-5, 1e-6
STEPS, BATCH = 3, 16


def build(name: str) -> keras.Model:
    keras.utils.set_random_seed(1234)
    L = keras.layers
    if name == "mlp":
        x = keras.Input((16,), name="x")
        h = x
        for i in range(5):
            h = L.Dense(24, activation="tanh", name=f"d{i}")(h)
        return keras.Model(x, L.Dense(4, name="head")(h), name="mlp")
    if name == "rescnn":
        x = keras.Input((8, 8, 3), name="img")
        c1 = L.Conv2D(6, 3, padding="same", activation="relu", name="c1")(x)
        c2 = L.Conv2D(6, 3, padding="same", activation="relu", name="c2")(c1)
        c3 = L.Conv2D(6, 3, padding="same", name="c3")(c2)
        h = L.Add(name="skip")([c1, c3])
        h = L.Conv2D(4, 3, padding="same", activation="relu", name="c4")(h)
        h = L.Flatten(name="flat")(h)
        return keras.Model(x, L.Dense(5, name="logits")(h), name="rescnn")
    if name == "multiio":
        a = keras.Input((8,), name="a")
        b = keras.Input((4,), name="b")
        ha = L.Dense(12, activation="relu", name="da")(a)
        hb = L.Dense(12, activation="relu", name="db")(b)
        h = L.Concatenate(name="cat")([ha, hb])
        h = L.Dense(12, activation="relu", name="mix")(h)
        o1 = L.Dense(3, name="cls")(h)
        o2 = L.Dense(1, name="reg")(L.Dense(6, activation="relu", name="pre_reg")(ha))
        return keras.Model({"a": a, "b": b}, {"cls": o1, "reg": o2}, name="multiio")
    if name == "shared":
        x = keras.Input((8,), name="x")
        shared = L.Dense(8, activation="tanh", name="shared")
        h = shared(x)
        h = L.Dense(8, activation="tanh", name="middle")(h)
        h = shared(h)
        h = L.Dense(8, activation="tanh", name="after")(h)
        return keras.Model(x, L.Dense(2, name="out")(h), name="shared")
    if name == "bn":
        x = keras.Input((12,), name="x")
        h = L.Dense(16, name="b1")(x)
        h = L.BatchNormalization(name="bn1")(h)
        h = L.Activation("relu", name="r1")(h)
        h = L.Dense(16, name="b2")(h)
        h = L.BatchNormalization(name="bn2")(h)
        h = L.Activation("relu", name="r2")(h)
        return keras.Model(x, L.Dense(2, name="out")(h), name="bn")
    if name == "drop":
        x = keras.Input((12,), name="x")
        h = L.Dense(32, activation="relu", name="p1")(x)
        h = L.Dropout(0.3, seed=5, name="drop1")(h)
        h = L.Dense(32, activation="relu", name="p2")(h)
        h = L.Dropout(0.3, seed=6, name="drop2")(h)
        return keras.Model(x, L.Dense(2, name="out")(h), name="drop")
    if name == "embed":
        tok = keras.Input((5,), dtype="int32", name="tokens")
        h = L.Embedding(30, 6, name="embed")(tok)
        h = L.Flatten(name="flat")(h)
        h = L.Dense(16, activation="tanh", name="hidden")(h)
        return keras.Model(tok, L.Dense(3, name="cls")(h), name="embed")
    if name == "transformer":
        tok = keras.Input((6,), dtype="int32", name="tokens")
        h = L.Embedding(40, 16, name="embed")(tok)
        for i in range(2):
            a = L.MultiHeadAttention(2, 8, name=f"mha{i}")(h, h)
            h = L.LayerNormalization(name=f"ln{i}a")(L.Add(name=f"res{i}a")([h, a]))
            f = L.Dense(32, activation="relu", name=f"ff{i}a")(h)
            f = L.Dense(16, name=f"ff{i}b")(f)
            h = L.LayerNormalization(name=f"ln{i}b")(L.Add(name=f"res{i}b")([h, f]))
        h = L.GlobalAveragePooling1D(name="pool")(h)
        return keras.Model(tok, L.Dense(3, name="cls")(h), name="transformer")
    raise ValueError(name)


def data(name: str, n: int) -> tuple[object, object]:
    rng = np.random.default_rng(7)
    f32 = np.float32
    if name == "mlp":
        return rng.normal(size=(n, 16)).astype(f32), rng.normal(size=(n, 4)).astype(f32)
    if name == "rescnn":
        return rng.normal(size=(n, 8, 8, 3)).astype(f32), rng.integers(0, 5, size=(n,))
    if name == "multiio":
        x = {"a": rng.normal(size=(n, 8)).astype(f32), "b": rng.normal(size=(n, 4)).astype(f32)}
        return x, {"cls": rng.integers(0, 3, size=(n,)), "reg": rng.normal(size=(n, 1)).astype(f32)}
    if name == "shared":
        return rng.normal(size=(n, 8)).astype(f32), rng.normal(size=(n, 2)).astype(f32)
    if name == "transformer":
        return rng.integers(0, 40, size=(n, 6)).astype("int32"), rng.integers(0, 3, size=(n,))
    if name == "embed":
        return rng.integers(0, 30, size=(n, 5)).astype("int32"), rng.integers(0, 3, size=(n,))
    if name in ("bn", "drop"):
        return rng.normal(size=(n, 12)).astype(f32), rng.normal(size=(n, 2)).astype(f32)
    raise ValueError(name)


def loss_of(name: str) -> object:
    if name in ("mlp", "shared", "bn", "drop"):
        return "mse"
    if name == "embed":
        return keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    if name == "multiio":
        return {"cls": keras.losses.SparseCategoricalCrossentropy(from_logits=True), "reg": "mse"}
    return keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def optimizer_of(adam: bool, clip: bool = False) -> keras.optimizers.Optimizer:
    # Adam divides by sqrt(v): on a gradient that is mathematically zero (an attention key bias)
    # it turns rounding noise into ±lr steps, so Adam cases use models without such weights.
    # ``clip``: a global norm small enough to clip every step
    extra = {"global_clipnorm": 0.05} if clip else {}
    if adam:
        return keras.optimizers.Adam(1e-2, **extra)
    return keras.optimizers.SGD(0.05, momentum=0.9, **extra)


def optimizer_bytes(optimizer: keras.optimizers.Optimizer) -> int:
    """Bytes of the optimizer's non-scalar variables (its slots) on this rank."""
    return sum(int(np.prod(v.shape)) * np.dtype(v.dtype).itemsize
               for v in rank_variables(optimizer) if len(v.shape))


def _first(loss: object) -> float:
    """The total loss (Keras returns [total, per-output...] for multi-output models)."""
    return float(loss[0]) if isinstance(loss, (list, tuple)) else float(loss)  # type: ignore[arg-type]


def rows(v: object, lo: int, hi: int) -> object:
    if isinstance(v, dict):
        return {k: a[lo:hi] for k, a in v.items()}
    return v[lo:hi]  # type: ignore[index]


def dropout_modes(p: int, m: int) -> dict[str, object]:
    """Dropout at m > 1 differs from plain Keras (one mask per microbatch), but it must be
    deterministic, and memory mode's recompute must reuse the forward's masks: speed and memory
    training give identical weights."""
    x, y = data("drop", STEPS * BATCH)
    weights = {}
    for optimize in ("speed", "memory"):
        if tfsmp.is_initialized():
            tfsmp.shutdown()
        tfsmp.init({"partitions": p, "microbatches": m, "optimize": optimize})
        dm = tfsmp.DistributedModel(build("drop"))
        dm.compile(optimizer=optimizer_of(False), loss="mse")
        for i in range(STEPS):
            dm.train_on_batch(rows(x, i * BATCH, (i + 1) * BATCH), rows(y, i * BATCH, (i + 1) * BATCH))
        weights[optimize] = dm.get_weights()
    same = all(np.array_equal(a, b) for a, b in zip(weights["speed"], weights["memory"]))
    return {"ok": same, "held_bytes": 0, "plan_bytes": 0, "max_weight_err": 0.0}


def run_case(spec: str) -> dict[str, object]:
    parts = spec.split(":")
    if parts[0] == "dropmodes":
        return dropout_modes(int(parts[1]), int(parts[2]))
    name, p, m, pipeline, optimize = parts[0], int(parts[1]), int(parts[2]), parts[3], parts[4]
    flags = set(parts[5].split(",")) if len(parts) > 5 else set()
    horovod, adam, clip = "horovod" in flags, "adam" in flags, "clip" in flags
    virtual = 2 if "v2" in flags else 1
    if tfsmp.is_initialized():
        tfsmp.shutdown()
    tfsmp.init({"partitions": p, "microbatches": m, "pipeline": pipeline, "optimize": optimize,
                "horovod": horovod, "virtual_stages": virtual,
                "shard_optimizer_state": "shard" in flags, "xla": "xla" in flags,
                "blas": "openblas" if "blas" in flags else "tensorflow"})
    x, y = data(name, STEPS * BATCH)
    ref = build(name)
    init = ref.get_weights()
    jit = bool({"xla", "jit"} & flags)
    ref.compile(optimizer=optimizer_of(adam, clip), loss=loss_of(name), jit_compile=jit)
    ref_losses = [_first(ref.train_on_batch(rows(x, i * BATCH, (i + 1) * BATCH),
                                           rows(y, i * BATCH, (i + 1) * BATCH)))
                  for i in range(STEPS)]
    model = build(name)
    model.set_weights(init)
    dm = tfsmp.DistributedModel(model)
    dm.compile(optimizer=optimizer_of(adam, clip), loss=loss_of(name),
               jit_compile="jit" in flags)
    losses = [_first(dm.train_on_batch(rows(x, i * BATCH, (i + 1) * BATCH),
                                      rows(y, i * BATCH, (i + 1) * BATCH)))
              for i in range(STEPS)]
    weights = dm.get_weights()
    errs = [float(np.max(np.abs(a - b) / (ATOL + RTOL * np.abs(b)))) if a.size else 0.0
            for a, b in zip(weights, ref.get_weights())]
    loss_ok = np.allclose(losses, ref_losses, rtol=RTOL, atol=ATOL)
    engine = dm._engine
    compiled = {bool(p._fwd._jit_compile) for p in engine.programs.values()}
    if compiled != {jit}:
        raise AssertionError(f"stage programs with jit_compile {compiled}, expected {jit}")
    blas = {isinstance(p._fwd, kernels.OpenBlasProgram) for p in engine.programs.values()}
    if blas != {"blas" in flags}:
        raise AssertionError(f"stage programs with the OpenBLAS kernel {blas}, expected "
                             f"{'blas' in flags}")
    model_weights = {id(v) for v in dm._all_variables()}  # not seed-generator state
    plan_bytes = sum(
        int(np.prod(v.shape)) * np.dtype(v.dtype).itemsize
        for v in engine.traced.variables_of({n for s in engine.stages for n in engine.plan.layers(s)})
        if id(v) in model_weights)
    return {"ok": bool(loss_ok and max(errs, default=0.0) <= 1.0), "losses": losses,
            "ref_losses": ref_losses, "max_weight_err": max(errs, default=0.0),
            "held_bytes": dm.held_variable_bytes(), "plan_bytes": plan_bytes,
            "stages": engine.stages, "planner": engine.plan.planner,
            # zero-bubble schedules: linear layers whose weight gradients ran in W actions, and
            # the most microbatches this rank held at once (forward until backward, or until W)
            "deferred": sum(len(p._deferred_layers or []) for p in engine.programs.values()),
            "max_held": engine._executor.step_state.result.max_held,
            # this rank's optimizer slots (fewer with sharded optimizer state)
            "opt_bytes": optimizer_bytes(dm.optimizer)}


def main(specs: list[str]) -> None:
    from mpi4py import MPI

    from tests.mpi.cases_runner import leave_together

    rank = int(os.environ.get("OMPI_COMM_WORLD_RANK", "0"))
    for spec in specs:
        try:
            out: dict[str, object] = run_case(spec)
            out["error"] = None
        except Exception:
            out = {"ok": False, "error": traceback.format_exc()}
        out.update(case=spec, rank=rank)
        print("CASE " + json.dumps(out), flush=True)
        # a case that failed on one rank only must not leave the others waiting for ever
        leave_together(MPI.COMM_WORLD, spec, out["error"] is None)
    tf.keras.backend.clear_session()


if __name__ == "__main__":
    main(sys.argv[1:])
