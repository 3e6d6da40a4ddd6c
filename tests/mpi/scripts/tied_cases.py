"""Tied weights across stages (run by `tests/mpi/cases_runner.py` on 4 ranks).

Each case trains a model whose variables are read on several stages — a tied embedding
(`keras_hub.layers.ReversibleEmbedding(..., reverse=True)`, GPT-2's head), one Dense called far
apart, one Embedding called on two inputs — and reports: the plan's copies, the largest weight
difference from plain Keras relative to the weight's largest magnitude, and a digest of every
tied variable and its optimizer slots on this rank (the test checks that every copy agrees).
Checkpoint files go to ``$TFSMP_TIED_DIR``.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable
from typing import Any

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras
import keras_hub
import numpy as np
import tensorflow as tf

import tfsmp
from tfsmp.checkpoint.layout import optimizer_state

DIR = os.environ.get("TFSMP_TIED_DIR", "/tmp/tfsmp_tied_cases")
SEQ, VOCAB, DIM = 8, 24, 16
N, BATCH = 64, 16


def _init(**config: object) -> None:
    if tfsmp.is_initialized():
        tfsmp.shutdown()
    tfsmp.init({"microbatches": 2, **config})


# -- models ------------------------------------------------------------------------------------

def tied_lm(seed: int = 1) -> keras.Model:
    """Token ids -> ReversibleEmbedding -> 4 layers -> the same embedding, reversed (logits)."""
    keras.utils.set_random_seed(seed)
    tokens = keras.Input((SEQ,), dtype="int32", name="tokens")
    emb = keras_hub.layers.ReversibleEmbedding(VOCAB, DIM, name="emb")
    h = keras.layers.Dense(DIM, activation="gelu", name="ff1")(emb(tokens))
    h = keras.layers.LayerNormalization(name="ln1")(h)
    h = keras.layers.Dense(DIM, activation="gelu", name="ff2")(h)
    h = keras.layers.Dense(DIM, name="ff3")(h)
    return keras.Model(tokens, emb(h, reverse=True), name="tied_lm")


def lm_data(seed: int = 2) -> tuple[np.ndarray, np.ndarray]:
    ids = np.random.default_rng(seed).integers(0, VOCAB, size=(N, SEQ + 1)).astype("int32")
    return ids[:, :-1], ids[:, 1:]


def shared_dense(seed: int = 1) -> keras.Model:
    """x -> shared -> a -> b -> c -> shared -> head: one Dense called far apart."""
    keras.utils.set_random_seed(seed)
    x = keras.Input((8,), name="x")
    shared = keras.layers.Dense(8, activation="tanh", name="shared")
    h = shared(x)
    for name in ("a", "b", "c"):
        h = keras.layers.Dense(8, activation="relu", name=name)(h)
    return keras.Model(x, keras.layers.Dense(3, name="head")(shared(h)), name="shared_dense")


def dense_data(seed: int = 3) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return rng.normal(size=(N, 8)).astype("float32"), rng.normal(size=(N, 3)).astype("float32")


def twin_embedding(seed: int = 1) -> keras.Model:
    """Two token inputs through one Embedding, the second joined at the end (sparse + sparse)."""
    keras.utils.set_random_seed(seed)
    a = keras.Input((SEQ,), dtype="int32", name="a")
    b = keras.Input((SEQ,), dtype="int32", name="b")
    emb = keras.layers.Embedding(VOCAB, DIM, name="emb")
    h = emb(a)
    for name in ("d1", "d2", "d3"):
        h = keras.layers.Dense(DIM, activation="relu", name=name)(h)
    h = keras.layers.Concatenate(name="join")([h, emb(b)])
    pooled = keras.layers.GlobalAveragePooling1D(name="pool")(h)
    return keras.Model([a, b], keras.layers.Dense(3, name="head")(pooled), name="twin")


def twin_data(seed: int = 4) -> tuple[list[np.ndarray], np.ndarray]:
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, VOCAB, size=(2, N, SEQ)).astype("int32")
    return [ids[0], ids[1]], rng.normal(size=(N, 3)).astype("float32")


MODELS = {"tied_lm": (tied_lm, lm_data, "scce"), "shared_dense": (shared_dense, dense_data, "mse"),
          "twin": (twin_embedding, twin_data, "mse")}


def _loss(kind: str) -> keras.losses.Loss:
    if kind == "scce":
        return keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    return keras.losses.MeanSquaredError()


def _pair(name: str, make: Callable[[], Any]) -> tuple[keras.Model, tfsmp.DistributedModel]:
    """Plain Keras and tfsmp models with equal initial weights and fresh optimizers ``make()``."""
    build, _, kind = MODELS[name]
    ref = build()
    ref.compile(optimizer=make(), loss=_loss(kind))
    inner = build()
    inner.set_weights(ref.get_weights())
    dm = tfsmp.DistributedModel(inner)
    dm.compile(optimizer=make(), loss=_loss(kind))
    return ref, dm


# -- reports -----------------------------------------------------------------------------------

def _digest(v: object) -> str:
    return hashlib.sha1(np.ascontiguousarray(keras.ops.convert_to_numpy(v)).tobytes()).hexdigest()


def tied_digests(dm: tfsmp.DistributedModel) -> dict[str, str]:
    """{checkpoint key (and key/slot): digest} of the tied variables this rank holds."""
    engine = dm._engine
    layout = dm.rank_view
    tied = {id(v) for _, g in engine.ties.groups for v in g.variables}
    out = {layout.keys[i]: _digest(v) for i, v in
           ((id(v), v) for _, g in engine.ties.groups for v in g.variables)}
    opt = getattr(dm.optimizer, "inner_optimizer", dm.optimizer)
    if opt.built:
        slots, _ = optimizer_state(opt, layout)
        ids = {layout.keys[i] for i in tied}
        out.update({f"{key}/{slot}": _digest(v) for (key, slot), v in slots.items() if key in ids})
    return out


def weight_error(got: list[np.ndarray], ref: list[np.ndarray]) -> float:
    """max over weights of max|got - ref| / max(max|ref|, 1e-3) (the test wants <= 1e-4).

    The floor: a weight whose gradient is zero in exact arithmetic keeps values of round-off
    size (GPT-2's attention key biases: softmax ignores a per-query constant, so they sit near
    1e-9 and differ with summation order), where a relative error says nothing. Below 1e-3 in
    magnitude a weight is therefore held to an absolute 1e-7."""
    return max(float(np.max(np.abs(a - b)) / max(float(np.max(np.abs(b))), 1e-3))
               for a, b in zip(got, ref, strict=True))


def _report(dm: tfsmp.DistributedModel, ref: keras.Model) -> dict[str, object]:
    plan = dm._engine.plan
    weights = dm.get_weights()
    return {"err": weight_error(weights, ref.get_weights()),
            "copies": [list(t.stages) for t in plan.ties], "tied": tied_digests(dm),
            "num_weights": len(weights), "ref_num_weights": len(ref.weights),
            "stage_of": dict(plan.stage_of), "finite": all(np.isfinite(w).all() for w in weights)}


def _reference_fit(ref: keras.Model, x: Any, y: Any) -> None:
    """Plain Keras trains ``ref`` on world rank 0 only; every rank then holds its weights.

    Every rank builds the same seeded model on the same data with one intra-op thread, so the
    reference is one deterministic computation: run on all 4 ranks of 2 cores it cost 4 times
    the CPU (GPT-2 + Adam: 34 of the case's 49 s) and proved nothing more."""
    from mpi4py import MPI

    world = MPI.COMM_WORLD
    weights = None
    if world.Get_rank() == 0:
        ref.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
        weights = ref.get_weights()
    ref.set_weights(world.bcast(weights, root=0))


def _fit(name: str, optimizer: Callable[[], Any], **config: object) -> dict[str, object]:
    _init(**config)
    _, data, _ = MODELS[name]
    x, y = data()
    ref, dm = _pair(name, optimizer)
    _reference_fit(ref, x, y)
    dm.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    return _report(dm, ref)


# -- training cases ----------------------------------------------------------------------------

def case_tied_lm_p4_adam(ctx: object) -> dict[str, object]:
    return _fit("tied_lm", lambda: keras.optimizers.Adam(1e-2), partitions=4)


def case_tied_lm_p2_dp2_sgd(ctx: object) -> dict[str, object]:
    return _fit("tied_lm", lambda: keras.optimizers.SGD(0.5, momentum=0.9), partitions=2)


def case_shared_dense_p4_sgd(ctx: object) -> dict[str, object]:
    return _fit("shared_dense", lambda: keras.optimizers.SGD(0.1), partitions=4, microbatches=4)


def case_twin_embedding_p4_adam(ctx: object) -> dict[str, object]:
    """The planner keeps both calls of this Embedding on stage 0 (the second reads a model
    input); a partition file puts the second call on stage 3, so both copies get sparse
    gradients, concatenated before Adam's step."""
    os.makedirs(DIR, exist_ok=True)
    path = os.path.join(DIR, f"twin_plan_{tfsmp_rank()}.json")
    stage_of = {"emb": 0, "d1": 1, "d2": 2, "d3": 3, "emb@1": 3, "join": 3, "pool": 3, "head": 3}
    with open(path, "w") as f:
        json.dump({"num_stages": 4, "stage_of": stage_of}, f)
    return _fit("twin", lambda: keras.optimizers.Adam(1e-2), partitions=4, partition_file=path)


def tfsmp_rank() -> int:
    from mpi4py import MPI

    return MPI.COMM_WORLD.Get_rank()


def case_loss_scaled_p2_dp2(ctx: object) -> dict[str, object]:
    return _fit("shared_dense",
                lambda: keras.optimizers.LossScaleOptimizer(keras.optimizers.Adam(1e-2)),
                partitions=2)


def case_nonfinite_skip_p2_dp2(ctx: object) -> dict[str, object]:
    """A batch with NaN is skipped on every rank: equal to Keras trained without that batch."""
    _init(partitions=2, nonfinite="skip")
    x, y = dense_data()
    bad = x.copy()
    bad[BATCH:2 * BATCH] = np.nan
    ref, dm = _pair("shared_dense", lambda: keras.optimizers.SGD(0.1, momentum=0.9))
    keep = np.r_[0:BATCH, 2 * BATCH:N]
    _reference_fit(ref, x[keep], y[keep])
    dm.fit(bad, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    out = _report(dm, ref)
    out["skipped"] = dm._engine.skipped_steps
    return out


def case_weights_api_one_value_per_weight(ctx: object) -> dict[str, object]:
    """get_weights has one value per weight; set_weights puts it into every copy."""
    _init(partitions=4)
    ref, dm = _pair("tied_lm", lambda: keras.optimizers.SGD(0.1))
    x, y = lm_data()
    dm.train_on_batch(x[:BATCH], y[:BATCH])
    new = [np.full_like(w, 0.01 * (i + 1)) for i, w in enumerate(ref.get_weights())]
    dm.set_weights(new)
    got = dm.get_weights()
    return {"num": len(got), "ref_num": len(ref.get_weights()), "tied": tied_digests(dm),
            "equal": all(np.array_equal(a, b) for a, b in zip(got, new))}


# -- checkpoints and export --------------------------------------------------------------------

def _manager(dm: tfsmp.DistributedModel, name: str) -> tfsmp.CheckpointManager:
    ckpt = tf.train.Checkpoint(model=dm, optimizer=dm.optimizer)
    return tfsmp.CheckpointManager(ckpt, directory=os.path.join(DIR, name))


def case_checkpoint_save_p2(ctx: object) -> dict[str, object]:
    """Trains p=2 d=2, saves a checkpoint and the weights it holds, exports a .keras file."""
    _init(partitions=2)
    ref, dm = _pair("tied_lm", lambda: keras.optimizers.Adam(1e-2))
    x, y = lm_data()
    for i in range(2):
        dm.train_on_batch(x[i * BATCH:(i + 1) * BATCH], y[i * BATCH:(i + 1) * BATCH])
    path = _manager(dm, "tied_ckpt").save()
    weights = dm.get_weights()
    dm.save(os.path.join(DIR, "tied.keras"))
    if tfsmp.rank() == 0:
        np.savez(os.path.join(DIR, "tied_weights.npz"), *weights)
    with open(os.path.join(path, "manifest.json")) as f:
        manifest = json.load(f)
    return {"variables": sorted(manifest["variables"]), "slots": sorted(manifest["slots"]),
            "copies": [list(t.stages) for t in dm._engine.plan.ties],
            "ref_weights": [w.path for w in ref.weights], "tied": tied_digests(dm)}


def case_checkpoint_restore_p4(ctx: object) -> dict[str, object]:
    """A new model (other weights) under p=4 restores the p=2 checkpoint into every copy."""
    _init(partitions=4)
    build, data, kind = MODELS["tied_lm"]
    dm = tfsmp.DistributedModel(build(seed=77))
    dm.compile(optimizer=keras.optimizers.Adam(1e-2), loss=_loss(kind))
    x, _ = data()
    dm.predict(x[:BATCH], batch_size=BATCH)  # partition now: the restore meets built copies
    _manager(dm, "tied_ckpt").restore()
    with np.load(os.path.join(DIR, "tied_weights.npz")) as f:
        saved = [f[f"arr_{i}"] for i in range(len(f.files))]
    layout = dm.rank_view
    index = {id(v): i for i, v in enumerate(dm._all_variables())}
    local = {layout.keys[id(v)]: bool(np.array_equal(v.numpy(), saved[index[id(v)]]))
             for _, g in dm._engine.ties.groups for v in g.variables}
    exported = None
    if tfsmp.rank() == 0:
        loaded = keras.models.load_model(os.path.join(DIR, "tied.keras"), compile=False)
        exported = {"num": len(loaded.weights),
                    "equal": all(np.array_equal(a, b) for a, b in zip(loaded.get_weights(), saved))}
    return {"copies": [list(t.stages) for t in dm._engine.plan.ties], "local_equal": local,
            "tied": tied_digests(dm), "exported": exported,
            "all_equal": all(np.array_equal(a, b) for a, b in zip(dm.get_weights(), saved))}


# -- GPT-2 (keras_hub): a tied head and inputs of shape (None, None) ----------------------------

def gpt2(seed: int = 1) -> keras.Model:
    """A small keras_hub GPT-2 causal LM (random weights, no preprocessor): the head reuses the
    token embedding (`ReversibleEmbedding(..., reverse=True)`)."""
    keras.utils.set_random_seed(seed)
    backbone = keras_hub.models.GPT2Backbone(
        vocabulary_size=VOCAB, num_layers=2, num_heads=2, hidden_dim=DIM, intermediate_dim=32,
        max_sequence_length=SEQ, dropout=0.0)
    return keras_hub.models.GPT2CausalLM(backbone=backbone, preprocessor=None)


def gpt2_data(seed: int = 5) -> tuple[dict[str, np.ndarray], np.ndarray]:
    ids = np.random.default_rng(seed).integers(1, VOCAB, size=(N, SEQ + 1)).astype("int32")
    x = {"token_ids": ids[:, :-1], "padding_mask": np.ones((N, SEQ), dtype="bool")}
    return x, ids[:, 1:]


MODELS["gpt2"] = (gpt2, gpt2_data, "scce")


def case_gpt2_p2_adam(ctx: object) -> dict[str, object]:
    return _fit("gpt2", lambda: keras.optimizers.Adam(1e-2), partitions=2)


def case_gpt2_p4_sgd(ctx: object) -> dict[str, object]:
    return _fit("gpt2", lambda: keras.optimizers.SGD(0.5), partitions=4)
