"""Keras `fit` parity and rank agreement on 2 ranks: validation_split, class_weight, per-output
losses and metrics in History, Dropout with a partial last batch, and the same-batch check.

Cases run through `tests/mpi/cases_runner.py` (`tests/mpi/test_fit_parity.py`); each returns
JSON that the test asserts on. Every case re-initializes tfsmp with its own config.
"""

from __future__ import annotations

import itertools
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import time

import keras
import numpy as np
import tensorflow as tf
from caseutil import reinit

import tfsmp
from tfsmp.errors import StepError

RTOL, ATOL = 1e-5, 1e-6
L = keras.layers


def _init(**config: object) -> None:
    reinit({"partitions": 2, "microbatches": 2}, **config)


def _close(a: object, b: object) -> bool:
    return bool(np.allclose(np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64),
                            rtol=RTOL, atol=ATOL))


def _history_diff(h: dict[str, list[float]], ref: dict[str, list[float]]) -> dict[str, object]:
    """Keys of both, and for every shared key whether the values agree."""
    return {"keys": sorted(h), "ref_keys": sorted(ref),
            "same": {k: _close(h[k], ref[k]) for k in ref if k in h},
            "values": {k: [h.get(k), ref[k]] for k in ref}}


def _error_of(fn: object) -> str:
    try:
        fn()  # type: ignore[operator]
    except (StepError, ValueError, TypeError) as e:
        return f"{type(e).__name__}: {e}"
    return "no error"


def _classifier(seed: int = 3, dropout: float = 0.0) -> keras.Model:
    keras.utils.set_random_seed(seed)
    x = keras.Input((10,), name="x")
    h = L.Dense(16, activation="relu", name="h1")(x)
    if dropout:
        h = L.Dropout(dropout, seed=11, name="drop1")(h)
    h = L.Dense(16, activation="relu", name="h2")(h)
    if dropout:
        h = L.Dropout(dropout, seed=12, name="drop2")(h)
    h = L.Dense(16, activation="relu", name="h3")(h)
    return keras.Model(x, L.Dense(3, name="out")(h), name="clf")


def _data(n: int = 64, seed: int = 5) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 10)).astype(np.float32)
    return x, (x[:, :3].sum(axis=1) > 0).astype(np.int64) + (x[:, 3] > 1)


def _pair(build: object, compile_kwargs: dict[str, object]
          ) -> tuple[keras.Model, tfsmp.DistributedModel]:
    """A plain model and a DistributedModel of a twin with the same initial weights."""
    ref = build()  # type: ignore[operator]
    init = ref.get_weights()
    ref.compile(optimizer=keras.optimizers.SGD(0.1), **compile_kwargs)
    inner = build()  # type: ignore[operator]
    inner.set_weights(init)
    dm = tfsmp.DistributedModel(inner)
    dm.compile(optimizer=keras.optimizers.SGD(0.1), **compile_kwargs)
    return ref, dm


_SCCE = {"loss": keras.losses.SparseCategoricalCrossentropy(from_logits=True),
         "metrics": ["accuracy"]}


# -- 1. validation_split, class_weight --------------------------------------------------------


def case_validation_split(ctx: object) -> dict[str, object]:
    """The last 25% of the arrays (before shuffling) validate, as in Keras."""
    _init()
    x, y = _data(80)
    ref, dm = _pair(_classifier, _SCCE)
    kw = {"batch_size": 16, "epochs": 2, "validation_split": 0.2, "verbose": 0}
    h_ref = ref.fit(x, y, shuffle=False, **kw)
    h = dm.fit(x, y, shuffle=False, **kw)
    out = _history_diff(h.history, h_ref.history)
    # shuffled: validation still the last 16 rows, the training rows only the first 64
    h2 = dm.fit(x, y, shuffle=True, **kw)
    after = dm.evaluate(x[64:], y[64:], batch_size=16, verbose=0, return_dict=True)
    out["shuffled_val_is_tail"] = _close(h2.history["val_loss"][-1], after["loss"])
    ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(16)
    out["dataset_error"] = _error_of(lambda: dm.fit(ds, validation_split=0.2, verbose=0))
    out["ref_dataset_error"] = _error_of(lambda: ref.fit(ds, validation_split=0.2, verbose=0))
    out["too_few"] = _error_of(lambda: dm.fit(x[:1], y[:1], validation_split=0.5, verbose=0))
    return out


def case_class_weight(ctx: object) -> dict[str, object]:
    """class_weight weighs each sample by its class, as Keras does (loss and weights equal)."""
    _init()
    x, y = _data(64)
    cw = {0: 1.0, 1: 3.0, 2: 0.25}
    ref, dm = _pair(_classifier, {**_SCCE, "weighted_metrics": ["accuracy"]})
    h_ref = ref.fit(x, y, batch_size=16, epochs=2, shuffle=False, class_weight=cw, verbose=0)
    h = dm.fit(x, y, batch_size=16, epochs=2, shuffle=False, class_weight=cw, verbose=0)
    out = _history_diff(h.history, h_ref.history)
    out["weights_same"] = all(_close(a, b) for a, b in zip(dm.get_weights(), ref.get_weights()))
    sw = np.ones(64, np.float32)
    out["with_sample_weight"] = _error_of(
        lambda: dm.fit(x, y, sample_weight=sw, class_weight=cw, verbose=0))
    out["ref_with_sample_weight"] = _error_of(
        lambda: ref.fit(x, y, sample_weight=sw, class_weight=cw, verbose=0))
    onehot = np.eye(3, dtype=np.float32)[y]  # one-hot targets: the argmax is the class
    _, dm2 = _pair(_classifier, {"loss": keras.losses.CategoricalCrossentropy(from_logits=True)})
    ref2, _ = _pair(_classifier, {"loss": keras.losses.CategoricalCrossentropy(from_logits=True)})
    h3 = dm2.fit(x, onehot, batch_size=16, shuffle=False, class_weight=cw, verbose=0)
    h3_ref = ref2.fit(x, onehot, batch_size=16, shuffle=False, class_weight=cw, verbose=0)
    out["onehot_same"] = _close(h3.history["loss"], h3_ref.history["loss"])
    return out


# -- 2. multi-output: per-output losses and metrics ---------------------------------------------


def _multi_dict() -> keras.Model:
    keras.utils.set_random_seed(4)
    a, b = keras.Input((8,), name="a"), keras.Input((4,), name="b")
    h = L.Dense(12, activation="relu", name="trunk")(L.Concatenate(name="cat")([a, b]))
    h = L.Dense(12, activation="relu", name="trunk2")(h)
    cls = L.Dense(3, name="cls")(L.Dense(8, activation="relu", name="pre_cls")(h))
    reg = L.Dense(1, name="reg")(L.Dense(6, activation="relu", name="pre_reg")(h))
    return keras.Model({"a": a, "b": b}, {"cls": cls, "reg": reg}, name="multi_dict")


def _multi_list() -> keras.Model:
    keras.utils.set_random_seed(6)
    a = keras.Input((8,), name="a")
    h = L.Dense(12, activation="relu", name="trunk")(a)
    h = L.Dense(12, activation="relu", name="trunk2")(h)
    cls = L.Dense(3, name="cls_out")(h)
    reg = L.Dense(1, name="reg_out")(L.Dense(6, activation="relu", name="pre_reg")(h))
    return keras.Model(a, [cls, reg], name="multi_list")


def _multi_data(n: int) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    rng = np.random.default_rng(8)
    x = {"a": rng.normal(size=(n, 8)).astype(np.float32),
         "b": rng.normal(size=(n, 4)).astype(np.float32)}
    return x, {"cls": rng.integers(0, 3, size=(n,)), "reg": rng.normal(size=(n, 1)).astype("f4")}


def case_multi_output_dict(ctx: object) -> dict[str, object]:
    """Dict losses, loss weights and per-output metrics: History and evaluate as in Keras."""
    _init()
    x, y = _multi_data(64)
    xv, yv = _multi_data(32)
    kw = {"loss": {"cls": keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                   "reg": "mse"},
          "loss_weights": {"cls": 1.0, "reg": 0.5},
          "metrics": {"cls": ["accuracy"], "reg": ["mae", "root_mean_squared_error"]}}
    ref, dm = _pair(_multi_dict, kw)
    fit = {"batch_size": 16, "epochs": 2, "shuffle": False, "verbose": 0,
           "validation_data": (xv, yv)}
    h_ref = ref.fit(x, y, **fit)
    h = dm.fit(x, y, **fit)
    out = _history_diff(h.history, h_ref.history)
    ev, ev_ref = dm.evaluate(xv, yv, batch_size=16, verbose=0), ref.evaluate(xv, yv, batch_size=16,
                                                                              verbose=0)
    out["evaluate"], out["ref_evaluate"] = ev, ev_ref
    out["evaluate_same"] = len(ev) == len(ev_ref) and _close(ev, ev_ref)
    evd = dm.evaluate(xv, yv, batch_size=16, verbose=0, return_dict=True)
    evd_ref = ref.evaluate(xv, yv, batch_size=16, verbose=0, return_dict=True)
    out["evaluate_dict"] = _history_diff({k: [v] for k, v in evd.items()},
                                         {k: [v] for k, v in evd_ref.items()})
    out["metrics_names"] = [dm.metrics_names, ref.metrics_names]
    return out


def case_multi_output_list(ctx: object) -> dict[str, object]:
    """List losses and metrics on a list-output model (m=4, per-output loss means over
    microbatches): History as in Keras."""
    _init(microbatches=4)
    x, y = _multi_data(64)
    yl = [y["cls"], y["reg"]]
    kw = {"loss": [keras.losses.SparseCategoricalCrossentropy(from_logits=True), "mse"],
          "loss_weights": [0.7, 2.0], "metrics": [["accuracy"], ["mae"]]}
    ref, dm = _pair(_multi_list, kw)
    h_ref = ref.fit(x["a"], yl, batch_size=16, epochs=2, shuffle=False, verbose=0)
    h = dm.fit(x["a"], yl, batch_size=16, epochs=2, shuffle=False, verbose=0)
    out = _history_diff(h.history, h_ref.history)
    out["train_on_batch"] = [dm.train_on_batch(x["a"][:16], [v[:16] for v in yl]),
                             ref.train_on_batch(x["a"][:16], [v[:16] for v in yl])]
    return out


# -- 3. Dropout with a partial last batch at m=1 ---------------------------------------------


def case_dropout_partial_last_batch(ctx: object) -> dict[str, object]:
    """At m=1 Dropout masks equal plain Keras's, also for an epoch's smaller last batch (arrays
    in speed mode; a tf.data pipeline in memory mode, whose recompute must reuse the masks)."""
    x, y = _data(70)  # batches of 16, 16, 16, 16, 6
    out: dict[str, object] = {}
    for optimize in ("speed", "memory"):
        _init(microbatches=1, optimize=optimize)
        ref, dm = _pair(lambda: _classifier(dropout=0.3), _SCCE)
        data = ((x, y) if optimize == "speed" else
                (tf.data.Dataset.from_tensor_slices((x, y)).batch(16), None))
        h_ref = ref.fit(*data, batch_size=16 if optimize == "speed" else None, epochs=2,
                        shuffle=False, verbose=0)
        h = dm.fit(*data, batch_size=16 if optimize == "speed" else None, epochs=2,
                   shuffle=False, verbose=0)
        out[optimize] = _history_diff(h.history, h_ref.history)
        out[optimize]["max_weight_err"] = max(  # type: ignore[index]
            float(np.max(np.abs(a - b))) for a, b in zip(dm.get_weights(), ref.get_weights()))
    return out


# -- 4. ranks that see different data ---------------------------------------------------------


def _timed_error(fn: object) -> tuple[str, float]:
    start = time.perf_counter()
    msg = _error_of(fn)
    return msg, time.perf_counter() - start


def case_unseeded_permutation_fit(ctx: object) -> dict[str, object]:
    """A script shuffles its arrays without a seed: each rank pairs other inputs with labels."""
    _init()
    x, y = _data(64)
    perm = np.random.default_rng(100 + tfsmp.rank()).permutation(64)  # "unseeded": per rank
    _, dm = _pair(_classifier, _SCCE)
    msg, seconds = _timed_error(lambda: dm.fit(x[perm], y[perm], batch_size=16, epochs=2,
                                               verbose=0))
    same = dm.fit(x, y, batch_size=16, epochs=1, verbose=0)  # then the same data trains
    return {"error": msg, "seconds": seconds, "then_trains": bool(np.isfinite(
        same.history["loss"][0]))}


def case_unseeded_dataset_fit(ctx: object) -> dict[str, object]:
    """A tf.data pipeline shuffled without a seed; and one whose batch sizes differ per rank."""
    _init()
    x, y = _data(64)
    _, dm = _pair(_classifier, _SCCE)
    ds = tf.data.Dataset.from_tensor_slices((x, y)).shuffle(64, seed=tfsmp.rank()).batch(16)
    msg, seconds = _timed_error(lambda: dm.fit(ds, epochs=1, verbose=0))
    # the same first batch, then rank 1's second batch is another size (both divisible by m)
    sizes = [16, 16, 16, 16] if tfsmp.rank() == 0 else [16, 8, 24, 16]
    starts = np.cumsum([0, *sizes])

    def gen():  # type: ignore[no-untyped-def]
        for lo, hi in itertools.pairwise(starts):
            yield x[lo:hi], y[lo:hi]

    size_msg = _error_of(lambda: dm.fit(gen(), epochs=1, verbose=0))
    return {"error": msg, "seconds": seconds, "size_error": size_msg}


def _step_setup() -> tuple[object, object, object]:
    model = tfsmp.DistributedModel(_classifier())
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    opt = keras.optimizers.SGD(0.1)

    @tfsmp.step
    def train_step(images, labels):  # type: ignore[no-untyped-def]
        with tf.GradientTape() as tape:
            loss = loss_fn(labels, model(images, training=True))
        return tape.gradient(loss, model.trainable_variables), loss

    def run(xb: np.ndarray, yb: np.ndarray) -> float:
        grads, loss = train_step(xb, yb)
        opt.apply_gradients(zip([g.accumulate() for g in grads], model.trainable_variables))
        return float(loss.reduce_mean())

    return model, train_step, run


def case_step_inputs_differ(ctx: object) -> dict[str, object]:
    """@smp.step: stages of one pipeline fed different batches raise; replicas (p=1, d=2) may
    see different data."""
    _init()
    x, y = _data(64)
    _, _, run = _step_setup()
    run(x[:16], y[:16])
    perm = np.random.default_rng(100 + tfsmp.rank()).permutation(64)
    msg, seconds = _timed_error(lambda: run(x[perm][:16], y[perm][:16]))
    run(x[16:32], y[16:32])  # still usable after the error
    _init(partitions=1)
    _, _, run_dp = _step_setup()
    lo = 16 * tfsmp.rank()  # each replica its own shard, as SMP scripts feed them
    replica_losses = [run_dp(x[lo:lo + 16], y[lo:lo + 16]) for _ in range(2)]
    return {"error": msg, "seconds": seconds, "replicas_ok": bool(np.all(np.isfinite(
        replica_losses)))}


def case_fit_replicas_share_one_batch(ctx: object) -> dict[str, object]:
    """p=1, d=2: fit splits the same global batch over replicas; same data passes, else error."""
    _init(partitions=1)
    x, y = _data(64)
    _, dm = _pair(_classifier, _SCCE)
    h = dm.fit(x, y, batch_size=16, epochs=1, verbose=0)
    perm = np.random.default_rng(100 + tfsmp.rank()).permutation(64)
    msg = _error_of(lambda: dm.fit(x[perm], y[perm], batch_size=16, verbose=0))
    return {"loss": h.history["loss"], "error": msg}


def case_checksum_cost(ctx: object) -> dict[str, object]:
    """What a per-step checksum of a 256×28×28 float32 batch (+ labels) costs on this machine."""
    from tfsmp.keras.data import batch_digest

    xb = np.random.default_rng(0).normal(size=(256, 28, 28)).astype(np.float32)
    yb = np.arange(256)
    batch_digest((xb, yb))
    start = time.perf_counter()
    for _ in range(50):
        batch_digest((xb, yb))
    digest_ms = (time.perf_counter() - start) / 50 * 1e3
    from tfsmp.keras.data import check_step_inputs

    _init()
    check_step_inputs((xb, yb), {})
    start = time.perf_counter()
    for _ in range(50):  # digest + one allgather over the pipeline, as each smp.step call does
        check_step_inputs((xb, yb), {})
    return {"ms_per_batch": digest_ms,
            "ms_per_step_check": (time.perf_counter() - start) / 50 * 1e3}
