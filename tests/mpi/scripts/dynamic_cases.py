"""Models whose boundary shapes are known only at run time, pipelined on 2 ranks vs plain Keras.

Cases run through `tests/mpi/cases_runner.py` ([Note: dynamic boundaries] in
tfsmp/runtime/dynamic_shapes.py). Each trains or runs the same seeded model twice, plain Keras in
this process and `tfsmp.DistributedModel` across the world, and returns per-weight errors as
max |Δ| / max |w| (the tests hold them to 1e-4) plus what the test asserts on.
"""

from __future__ import annotations

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras
import numpy as np
import tensorflow as tf
from caseutil import reinit

import tfsmp

VOCAB, WIDTH = 40, 16


def _init(**config: object) -> None:
    reinit({"partitions": 2, "microbatches": 2}, **config)


# -- models -------------------------------------------------------------------------------------

def bert(seed: int = 11) -> keras.Model:
    """A keras_hub BERT backbone nested in a Functional classifier on its pooled output."""
    import keras_hub

    keras.utils.set_random_seed(seed)
    backbone = keras_hub.models.BertBackbone(
        vocabulary_size=VOCAB, num_layers=2, num_heads=2, hidden_dim=WIDTH, intermediate_dim=32,
        max_sequence_length=32, dropout=0.0, name="bert")
    inputs = {k: keras.Input((None,), dtype="int32", name=k)
              for k in ("token_ids", "segment_ids", "padding_mask")}
    pooled = backbone(inputs)["pooled_output"]
    return keras.Model(inputs, keras.layers.Dense(3, name="head")(pooled), name="bert_clf")


def transformer(seed: int = 5) -> keras.Model:
    """A small per-token Transformer over sequences of any length (``Input(shape=(None,))``)."""
    import keras_hub

    keras.utils.set_random_seed(seed)
    L = keras.layers
    tokens = keras.Input((None,), dtype="int32", name="tokens")
    h = L.Embedding(VOCAB, WIDTH, name="embed")(tokens)
    h = L.Add(name="with_pos")([h, keras_hub.layers.PositionEmbedding(32, name="pos")(h)])
    for i in range(2):
        a = L.MultiHeadAttention(2, 8, name=f"mha{i}")(h, h)
        h = L.LayerNormalization(name=f"ln{i}a")(L.Add(name=f"res{i}a")([h, a]))
        f = L.Dense(32, activation="relu", name=f"ff{i}a")(h)
        f = L.Dense(WIDTH, name=f"ff{i}b")(f)
        h = L.LayerNormalization(name=f"ln{i}b")(L.Add(name=f"res{i}b")([h, f]))
    return keras.Model(tokens, L.Dense(VOCAB, name="logits")(h), name="seq_transformer")


def _bert_data(n: int, length: int, seed: int) -> tuple[dict[str, np.ndarray], np.ndarray]:
    rng = np.random.default_rng(seed)
    lengths = rng.integers(length // 2, length + 1, size=n)
    mask = (np.arange(length)[None, :] < lengths[:, None]).astype("int32")
    x = {"token_ids": rng.integers(1, VOCAB, size=(n, length)).astype("int32") * mask,
         "segment_ids": (np.arange(length)[None, :] >= lengths[:, None] // 2).astype("int32") * mask,
         "padding_mask": mask}
    return x, rng.integers(0, 3, size=(n,))


def _seq_data(n: int, length: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    x = rng.integers(0, VOCAB, size=(n, length)).astype("int32")
    return x, np.roll(x, 1, axis=1)  # predict the previous token


def _pair(build: object, lr: float = 0.05) -> tuple[keras.Model, tfsmp.DistributedModel]:
    ref = build()  # type: ignore[operator]
    inner = build()  # type: ignore[operator]
    inner.set_weights(ref.get_weights())
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    ref.compile(optimizer=keras.optimizers.SGD(lr, momentum=0.9), loss=loss)
    dm = tfsmp.DistributedModel(inner)
    dm.compile(optimizer=keras.optimizers.SGD(lr, momentum=0.9), loss=loss)
    return ref, dm


def _weight_errors(ref: keras.Model, dm: tfsmp.DistributedModel) -> dict[str, list[float]]:
    """Per weight path: [max |Δ|, max |w|] against plain Keras."""
    out = {}
    for v, a, b in zip(ref.weights, dm.get_weights(), ref.get_weights()):
        diff = float(np.max(np.abs(np.asarray(a, np.float64) - b))) if np.size(b) else 0.0
        out[v.path] = [diff, float(np.max(np.abs(b))) if np.size(b) else 0.0]
    return out


def _dynamic_boundaries(dm: tfsmp.DistributedModel) -> list[str]:
    return [b.tensor for b in dm.plan.boundaries if None in b.shape]


def _traces(dm: tfsmp.DistributedModel) -> dict[str, int]:
    """How often each stage program of this rank was traced (tf.function tracing counts)."""
    out = {}
    for s, prog in dm._engine.programs.items():
        for name in ("_fwd", "_bwd_recompute", "_fused", "_eval"):
            count = getattr(prog, name).experimental_get_tracing_count()
            if count:
                out[f"{s}{name}"] = count
    return out


# -- cases --------------------------------------------------------------------------------------

def case_bert_fit_equals_keras(ctx: object) -> dict[str, object]:
    """BERT classifier, p=2, m=2: one epoch of `fit` at length 12, then one at length 8."""
    _init()
    ref, dm = _pair(bert)
    for length, seed in ((12, 1), (8, 2)):
        x, y = _bert_data(32, length, seed)
        h_ref = ref.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
        h = dm.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    return {"errors": _weight_errors(ref, dm), "dynamic": _dynamic_boundaries(dm),
            "loss": h.history["loss"], "ref_loss": h_ref.history["loss"]}


def case_transformer_two_lengths(ctx: object) -> dict[str, object]:
    """Per-token Transformer, p=2, m=4 (memory mode): `fit` on a generator of lengths 8, 12, 8,
    then `train_on_batch` at 16 and 12; the stage programs' trace counts after each phase."""
    _init(microbatches=4, optimize="memory")
    ref, dm = _pair(transformer)
    batches = [_seq_data(8, length, seed) for seed, length in enumerate((8, 12, 8))]

    def gen():  # type: ignore[no-untyped-def]
        yield from batches

    ref.fit(gen(), epochs=1, verbose=0)
    dm.fit(gen(), epochs=1, verbose=0)
    after_two = _traces(dm)
    for seed, length in enumerate((16, 12), start=10):
        x, y = _seq_data(8, length, seed)
        ref.train_on_batch(x, y)
        dm.train_on_batch(x, y)
    return {"errors": _weight_errors(ref, dm), "dynamic": _dynamic_boundaries(dm),
            "traces_after_two_lengths": after_two, "traces_after_more": _traces(dm)}


def case_predict_evaluate_new_length(ctx: object) -> dict[str, object]:
    """Speed mode (stashed tapes), p=2, m=2: train at lengths 8 and 12, then predict, evaluate
    and call at lengths never trained on (10, then 6 with a partial last batch)."""
    _init(microbatches=2, optimize="speed")
    ref, dm = _pair(transformer)
    for seed, length in enumerate((8, 12)):
        x, y = _seq_data(8, length, seed)
        ref.train_on_batch(x, y)
        dm.train_on_batch(x, y)
    out: dict[str, object] = {"errors": _weight_errors(ref, dm)}
    for length, n in ((10, 8), (6, 10)):
        xe, ye = _seq_data(n, length, 20 + length)
        pred, ref_pred = dm.predict(xe, batch_size=4), ref.predict(xe, batch_size=4, verbose=0)
        ev, ref_ev = dm.evaluate(xe, ye, batch_size=4, verbose=0), ref.evaluate(
            xe, ye, batch_size=4, verbose=0)
        call, ref_call = dm(xe[:4]).numpy(), ref(xe[:4]).numpy()
        out[str(length)] = {
            "shape": list(pred.shape),
            "pred_err": float(np.max(np.abs(pred - ref_pred))),
            "eval_err": abs(float(ev) - float(ref_ev)),
            "call_err": float(np.max(np.abs(call - ref_call)))}
    return out


def case_step_two_lengths(ctx: object) -> dict[str, object]:
    """`@smp.step` (eager, then inside tf.function) at lengths 8 and 12: gradients of the mean
    microbatch loss equal plain Keras's, the returned loss too."""
    _init(microbatches=2)
    ref = transformer()
    inner = transformer()
    inner.set_weights(ref.get_weights())
    dm = tfsmp.DistributedModel(inner)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    @tfsmp.step
    def step(x: tf.Tensor, y: tf.Tensor) -> object:
        with tf.GradientTape() as tape:
            loss = loss_fn(y, dm(x, training=True))
        return tape.gradient(loss, dm.trainable_variables), loss

    spec = tf.TensorSpec((8, None), tf.int32)  # the length stays unknown in the traced graph

    @tf.function(input_signature=[spec, spec])
    def in_graph(x: tf.Tensor, y: tf.Tensor) -> object:
        grads, loss = step(x, y)
        return [g.accumulate() for g in grads], loss.reduce_mean()

    out: dict[str, object] = {}
    for mode, length in (("eager", 8), ("eager", 12), ("graph", 12), ("graph", 8)):
        x, y = _seq_data(8, length, length)
        if mode == "eager":
            grads, loss = step(tf.constant(x), tf.constant(y))
            got, loss_value = [g.accumulate() for g in grads], loss.reduce_mean()
        else:
            got, loss_value = in_graph(tf.constant(x), tf.constant(y))
        with tf.GradientTape() as tape:
            ref_loss = loss_fn(y, ref(x, training=True))
        want = dict(zip((v.path for v in ref.trainable_variables),
                        tape.gradient(ref_loss, ref.trainable_variables)))
        errs = [float(np.max(np.abs(tf.convert_to_tensor(g) - tf.convert_to_tensor(want[v.path]))))
                for g, v in zip(got, dm.trainable_variables)]
        out[f"{mode}{length}"] = {"grad_err": max(errs), "loss_err": abs(float(loss_value) - float(ref_loss))}
    return out
