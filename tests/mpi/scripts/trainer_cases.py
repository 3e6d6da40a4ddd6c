"""Keras's trainer around a pipeline: callbacks, metrics, data, saving, recompiling, against plain Keras.

Each case trains one model twice from one seed, in plain Keras in this process and as a
`tfsmp.DistributedModel` across 2 ranks with the stage cut forced after layer ``d0``, and
returns what the test compares (both ranks alike). Every case is a kind of failure the
trainer of round 3 had (issue 26): hooks never called, logs missing, metrics that only the
last rank held, a shuffle of its own, a lost batch, a save without compile state, frozen
layers still training. ``m`` (microbatches) comes from the case's name suffix.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
import warnings
from collections.abc import Callable
from typing import Any

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras
import numpy as np
import tensorflow as tf
from caseutil import reinit
from conformance_cases import _close, _plan_file

import tfsmp

BATCH = 16


def _mlp(seed: int = 3, out: int = 3, activation: str | None = None) -> keras.Model:
    keras.utils.set_random_seed(seed)
    x = keras.Input((8,), name="x")
    h = keras.layers.Dense(16, activation="tanh", name="d0")(x)
    h = keras.layers.Dense(16, activation="tanh", name="d1")(h)
    return keras.Model(x, keras.layers.Dense(out, activation=activation, name="out")(h))


def _data(n: int = 48, classes: bool = False) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(7)
    x = rng.normal(size=(n, 8)).astype(np.float32)
    if classes:
        return x, (np.abs(x[:, 0] * 3).astype(np.int64) % 3)
    return x, (x[:, :3] * 2).astype(np.float32)


def _compile(**kw: Any) -> dict[str, Any]:
    return {"optimizer": keras.optimizers.SGD(0.05), "loss": "mse", "metrics": ["mae"], **kw}


def _pipelined(build: Any, m: int, x: Any, ctx: Any, cut: str = "d0") -> tfsmp.DistributedModel:
    reinit({"partitions": 2, "stall_timeout": 120}, microbatches=m,
           partition_file=_plan_file(build, cut, x, ctx.rank))
    return tfsmp.DistributedModel(build())


def _m(ctx: Any) -> int:
    return int(ctx.case.rsplit("_m", 1)[1])


def _same_history(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return sorted(a) == sorted(b) and all(_close(a[k], b[k]) for k in a)


def _same_weights(a: list[Any], b: list[Any]) -> bool:
    return len(a) == len(b) and all(_close(u, v) for u, v in zip(a, b))


class Recorder(keras.callbacks.Callback):  # type: ignore[misc]
    """Every hook Keras calls, with the sorted keys of its logs."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[str] = []
        for hook in ("train_begin", "train_end", "epoch_begin", "epoch_end", "test_begin",
                     "test_end", "predict_begin", "predict_end", "train_batch_end",
                     "test_batch_end", "predict_batch_end"):
            setattr(self, f"on_{hook}", self._make(hook))

    def _make(self, hook: str) -> Any:
        def record(*args: Any, logs: Any = None) -> None:
            logs = args[-1] if args and isinstance(args[-1], dict) else logs
            keys = sorted(logs) if isinstance(logs, dict) and "outputs" not in logs else []
            self.calls.append(f"{hook}{keys}")
        return record


def _callbacks_run(model: Any, x: Any, y: Any) -> dict[str, Any]:
    rec = Recorder()
    history = model.fit(x, y, batch_size=BATCH, epochs=2, verbose=0, shuffle=False,
                        validation_data=(x[:16], y[:16]), callbacks=[rec]).history
    fit_calls = list(rec.calls)
    rec.calls.clear()
    evaluation = model.evaluate(x, y, batch_size=BATCH, verbose=0, callbacks=[rec],
                                return_dict=True)
    metrics = {k: float(v) for k, v in model.get_metrics_result().items()}
    each = {m.name: np.asarray(m.result(), dtype=object).tolist() for m in model.metrics
            if not isinstance(m.result(), dict)}
    model.predict(x, batch_size=BATCH, verbose=0, callbacks=[rec])
    return {"fit_calls": fit_calls, "later_calls": rec.calls, "history": history,
            "evaluate": evaluation, "metrics_result": metrics, "each_metric": str(each)}


def case_callbacks_m2(ctx: Any) -> dict[str, Any]:
    """Every hook with Keras's logs (on_train_end gets the last epoch's, val_* included);
    on_test_*/on_predict_* for fit's validation, evaluate(callbacks=) and predict(callbacks=);
    get_metrics_result() and model.metrics after evaluate, on every rank."""
    x, y = _data()
    ref = _mlp()
    ref.compile(**_compile())
    want = _callbacks_run(ref, x, y)
    dm = _pipelined(_mlp, _m(ctx), x, ctx)
    dm.compile(**_compile())
    got = _callbacks_run(dm, x, y)
    return {"calls_same": got["fit_calls"] == want["fit_calls"],
            "later_same": got["later_calls"] == want["later_calls"],
            "history_same": _same_history(got["history"], want["history"]),
            "evaluate_same": _same_history(got["evaluate"], want["evaluate"]),
            "metrics_same": _same_history(got["metrics_result"], want["metrics_result"]),
            "train_end": [c for c in got["fit_calls"] if c.startswith("train_end")],
            "detail": None if got["fit_calls"] == want["fit_calls"] else
            [got["fit_calls"][-3:], want["fit_calls"][-3:]]}


def _fit_compare(ctx: Any, data: Any, fit: dict[str, Any], build: Any = _mlp,
                 compile_kw: dict[str, Any] | None = None, x: Any = None) -> dict[str, Any]:
    """History and weights of one fit(data, **fit), plain Keras against tfsmp."""
    sample = x if x is not None else _data()[0]
    ref = build()
    ref.compile(**_compile(**(compile_kw or {})))
    keras.utils.set_random_seed(11)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        want = ref.fit(*data(), verbose=0, **fit).history
    dm = _pipelined(build, _m(ctx), sample, ctx)
    dm.compile(**_compile(**(compile_kw or {})))
    keras.utils.set_random_seed(11)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got = dm.fit(*data(), verbose=0, **fit).history
    return {"history_same": _same_history(got, want),
            "weights_same": _same_weights(dm.get_weights(), ref.get_weights()),
            "steps": [len(v) for v in got.values()][:1],
            "detail": None if _same_history(got, want) else [got, want]}


def case_shuffled_arrays_m2(ctx: Any) -> dict[str, Any]:
    """shuffle=True under keras.utils.set_random_seed: Keras's own row order."""
    x, y = _data()
    return _fit_compare(ctx, lambda: (x, y), {"batch_size": BATCH, "epochs": 2, "shuffle": True})


class Rows(keras.utils.PyDataset):  # type: ignore[misc]
    def __init__(self, x: np.ndarray, y: np.ndarray) -> None:
        super().__init__()
        self.x, self.y = x, y

    def __len__(self) -> int:
        return len(self.x) // BATCH

    def __getitem__(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        return self.x[i * BATCH:(i + 1) * BATCH], self.y[i * BATCH:(i + 1) * BATCH]


def case_pydataset_shuffled_m2(ctx: Any) -> dict[str, Any]:
    """A PyDataset with shuffle=True: Keras shuffles its batch order, alike on every rank."""
    x, y = _data()
    return _fit_compare(ctx, lambda: (Rows(x, y),), {"epochs": 3, "shuffle": True})


def case_dataset_steps_per_epoch_m2(ctx: Any) -> dict[str, Any]:
    """A repeated dataset with steps_per_epoch: every epoch takes its steps, none lost."""
    x, y = _data()

    def data() -> tuple[Any]:
        return (tf.data.Dataset.from_tensor_slices((x, y)).batch(BATCH).repeat(),)

    return _fit_compare(ctx, data, {"epochs": 3, "steps_per_epoch": 2})


def _peak_error(y_true: Any, y_pred: Any) -> Any:
    return keras.ops.max(keras.ops.abs(y_true - y_pred))  # one value per batch, not per row


def case_metric_per_batch_m4(ctx: Any) -> dict[str, Any]:
    """A metric function returning one value per batch (Keras averages it over batches)."""
    x, y = _data()
    return _fit_compare(ctx, lambda: (x, y), {"batch_size": BATCH, "epochs": 2, "shuffle": False},
                        compile_kw={"metrics": [_peak_error]})


def case_freeze_and_recompile_m2(ctx: Any) -> dict[str, Any]:
    """The transfer-learning guide's recipe: train, freeze a layer, compile, train, unfreeze,
    compile, train: each fit trains exactly the trainable variables."""
    x, y = _data()

    def recipe(model: Any) -> list[Any]:
        fit = {"batch_size": BATCH, "epochs": 1, "verbose": 0, "shuffle": False}
        model.compile(**_compile())
        model.fit(x, y, **fit)
        layers = model.source_model().layers if hasattr(model, "source_model") else model.layers
        first = next(layer for layer in layers if layer.name == "d0")
        first.trainable = False
        model.compile(**_compile())
        model.fit(x, y, **fit)
        first.trainable = True
        model.compile(**_compile())
        model.fit(x, y, **fit)
        return list(model.get_weights())

    want = recipe(_mlp())
    got = recipe(_pipelined(_mlp, _m(ctx), x, ctx))
    return {"weights_same": _same_weights(got, want)}


def _recompile_sequence(model: Any, x: Any, y: Any, after_fit: Any = None) -> list[Any]:
    """Trains on through compile calls that change the optimizer (its kind, its slots, its
    clipping), the loss and the metrics, and one that keeps the optimizer object (Keras keeps
    its state then); after each fit: History and weights."""
    fit = {"batch_size": BATCH, "epochs": 1, "verbose": 0, "shuffle": False}
    steps = [
        {"optimizer": keras.optimizers.Adam(0.01), "loss": "mse"},
        {"optimizer": keras.optimizers.SGD(0.02, momentum=0.9), "loss": "mse",
         "metrics": ["mae"]},
        {"optimizer": keras.optimizers.Adam(0.01, global_clipnorm=0.5), "loss": "mae",
         "metrics": ["mse"]},
        {"optimizer": keras.optimizers.RMSprop(0.005), "loss": "mse"},
        {"optimizer": "same", "loss": "mse", "metrics": ["mae"]},
    ]
    out: list[Any] = []
    for kw in steps:
        if kw["optimizer"] == "same":
            kw = {**kw, "optimizer": model.optimizer}
        model.compile(**kw)
        out.append((model.fit(x, y, **fit).history, list(model.get_weights())))
        if after_fit is not None:
            after_fit(model)
    return out


def _recompile_compare(ctx: Any, **config: Any) -> dict[str, Any]:
    x, y = _data()
    want = _recompile_sequence(_mlp(), x, y)
    reinit({"partitions": 2, "stall_timeout": 120}, microbatches=_m(ctx),
           partition_file=_plan_file(_mlp, "d0", x, ctx.rank), **config)
    dm = tfsmp.DistributedModel(_mlp())
    got = _recompile_sequence(dm, x, y)
    return {"history_same": [_same_history(g[0], w[0]) for g, w in zip(got, want)],
            "weights_same": [_same_weights(g[1], w[1]) for g, w in zip(got, want)]}


def case_recompile_sequence_m2(ctx: Any) -> dict[str, Any]:
    """Compiling a trained pipeline again (new optimizer, loss, metrics; the same optimizer
    object) trains on as plain Keras does: before, the stage programs kept writing the
    gradient accumulators of the first compile, and weights went 0.08 off."""
    return _recompile_compare(ctx)


def case_recompile_sequence_zb_m4(ctx: Any) -> dict[str, Any]:
    """The same under the zero-bubble schedule (split stages write their weight gradients
    in a program of their own)."""
    return _recompile_compare(ctx, pipeline="zb-h1")


def case_recompile_replicas_m2(ctx: Any) -> dict[str, Any]:
    """The same at one stage with 2 data-parallel replicas; and the accumulators a compile
    replaced are freed (the reduction kept every set it had reduced, one more per compile)."""
    import gc
    import weakref

    x, y = _data()
    want = _recompile_sequence(_mlp(), x, y)
    reinit({"partitions": 1, "stall_timeout": 120}, microbatches=_m(ctx))
    seen: list[Any] = []

    def remember(model: Any) -> None:
        seen.extend(weakref.ref(a) for p in model._engine.programs.values()
                    for a in p.accumulators)

    dm = tfsmp.DistributedModel(_mlp())
    got = _recompile_sequence(dm, x, y, remember)
    gc.collect()
    current = {id(a) for p in dm._engine.programs.values() for a in p.accumulators}
    alive = {id(r()) for r in seen if r() is not None}
    return {"history_same": [_same_history(g[0], w[0]) for g, w in zip(got, want)],
            "weights_same": [_same_weights(g[1], w[1]) for g, w in zip(got, want)],
            "replaced_freed": bool(current) and alive == current}


class OwnLoss(keras.Model):  # type: ignore[misc]
    """Keras's guide's pattern: compute_loss() calls super(), adds a term of its own that reads
    ``x``, and updates a metric the model holds ([Note: a model's own compute_loss])."""

    KIND = "additive"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.custom = keras.metrics.Mean(name="custom")

    def compute_loss(self, x: Any = None, y: Any = None, y_pred: Any = None,
                     sample_weight: Any = None, training: bool = True) -> Any:
        if self.KIND == "ignores_losses":  # drops self.losses: refused, the model has some
            return keras.ops.mean(keras.ops.square(y - y_pred))
        if self.KIND == "peak":  # neither a sum nor a mean over the samples: refused
            return keras.ops.max(keras.ops.square(y - y_pred)) + keras.ops.sum(self.losses)
        loss = super().compute_loss(x, y, y_pred, sample_weight, training)
        loss = loss + 0.1 * keras.ops.mean(keras.ops.square(y_pred[:, :1] - x[:, :1]))
        self.custom.update_state(loss * 4)
        return loss


def _own_loss_mlp(kind: str = "additive") -> keras.Model:
    keras.utils.set_random_seed(3)
    x = keras.Input((8,), name="x")
    h = keras.layers.Dense(16, activation="tanh", name="d0")(x)
    h = keras.layers.Dense(16, activation="tanh", activity_regularizer="l2", name="d1")(h)
    out = keras.layers.Dense(3, name="out")(h)
    model = OwnLoss(x, out)
    model.KIND = kind
    return model


def _own_loss_run(model: Any, x: Any, y: Any, sw: Any) -> tuple[Any, ...]:
    model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse", metrics=["mae"])
    first = model.evaluate(x, y, batch_size=BATCH, verbose=0, return_dict=True)
    history = model.fit(x, y, sample_weight=sw, batch_size=BATCH, epochs=2, shuffle=False,
                        verbose=0, validation_data=(x[:16], y[:16])).history
    after = model.evaluate(x, y, batch_size=BATCH, verbose=0, return_dict=True)
    return first, history, after, list(model.get_weights())


def _own_loss_compare(ctx: Any, partitions: int) -> dict[str, Any]:
    x, y = _data()
    sw = np.linspace(0.5, 1.5, len(x)).astype(np.float32)
    want = _own_loss_run(_own_loss_mlp(), x, y, sw)
    if partitions == 2:
        dm = _pipelined(_own_loss_mlp, _m(ctx), x, ctx)
    else:
        reinit({"partitions": 1, "stall_timeout": 120}, microbatches=_m(ctx))
        dm = tfsmp.DistributedModel(_own_loss_mlp())
    got = _own_loss_run(dm, x, y, sw)
    return {"evaluate_same": [_same_history(got[0], want[0]), _same_history(got[2], want[2])],
            "history_same": _same_history(got[1], want[1]),
            "weights_same": _same_weights(got[3], want[3]),
            "keys": sorted(got[1]),
            "custom_is_4x_loss": bool(np.allclose(got[2]["custom"], 4 * got[2]["loss"],
                                                  rtol=1e-5)),
            "detail": None if _same_history(got[1], want[1]) else [got[1], want[1]]}


def case_own_compute_loss_m2(ctx: Any) -> dict[str, Any]:
    """A model's own compute_loss() at partitions=2: History (its metric included), evaluate
    and weights equal plain Keras's, with sample weights, validation and an activity
    regularizer on the first stage."""
    return _own_loss_compare(ctx, 2)


def case_own_compute_loss_replicas_m2(ctx: Any) -> dict[str, Any]:
    """The same at one stage with 2 data-parallel replicas (the value over every replica's
    rows)."""
    return _own_loss_compare(ctx, 1)


def _distiller() -> keras.Model:
    """Keras's knowledge distillation: a frozen teacher's logits and the labels train a
    smaller student (its compute_loss runs the teacher on ``x``)."""
    keras.utils.set_random_seed(5)

    def mlp(width: int, name: str) -> keras.Model:
        x = keras.Input((8,))
        h = keras.layers.Dense(width, activation="relu", name=f"{name}_h0")(x)
        h = keras.layers.Dense(width, activation="relu", name=f"{name}_h1")(h)
        return keras.Model(x, keras.layers.Dense(3, name=f"{name}_out")(h), name=name)

    return keras.distillation.Distiller(
        teacher=mlp(32, "teacher"), student=mlp(16, "student"),
        distillation_losses=keras.distillation.LogitsDistillation(temperature=2.0),
        student_loss_weight=0.3)


def case_distiller_m2(ctx: Any) -> dict[str, Any]:
    """`keras.distillation.Distiller` around a student that METIS splits in two: History
    (student, distillation and total losses), evaluate and the student's weights equal plain
    Keras's; `DistributedModel.compile` compiles the Distiller its own way first."""
    x, labels = _data(classes=True)

    def run(model: Any) -> tuple[Any, ...]:
        model.compile(optimizer=keras.optimizers.Adam(0.01),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        history = model.fit(x, labels, batch_size=BATCH, epochs=2, shuffle=False,
                            verbose=0).history
        return history, model.evaluate(x, labels, batch_size=BATCH, verbose=0,
                                       return_dict=True)

    ref = _distiller()
    want = run(ref)
    reinit({"partitions": 2, "stall_timeout": 120}, microbatches=_m(ctx))
    dm = tfsmp.DistributedModel(_distiller())
    got = run(dm)
    return {"history_same": _same_history(got[0], want[0]),
            "evaluate_same": _same_history(got[1], want[1]),
            "weights_same": _same_weights(dm.get_weights(), ref.get_weights()),
            "keys": sorted(got[0]),
            "detail": None if _same_history(got[0], want[0]) else [got[0], want[0]]}


def case_feature_distiller_refused_m2(ctx: Any) -> dict[str, Any]:
    """A Distiller with feature distillation runs the student's first-stage layer again in its
    compute_loss, which the last stage cannot read: refused on every rank before the first
    step ([Note: a loss that reads other stages] in tfsmp/runtime/engine.py), weights
    unchanged; plain Keras trains the same model (the refusal is the pipeline's)."""
    x, labels = _data(classes=True)

    def build() -> keras.Model:
        keras.utils.set_random_seed(5)

        def mlp(name: str) -> keras.Model:
            i = keras.Input((8,))
            h = keras.layers.Dense(16, activation="relu", name=f"{name}_h0")(i)
            h = keras.layers.Dense(16, activation="relu", name=f"{name}_h1")(h)
            return keras.Model(i, keras.layers.Dense(3, name=f"{name}_out")(h), name=name)

        return keras.distillation.Distiller(
            teacher=mlp("teacher"), student=mlp("student"),
            distillation_losses=keras.distillation.FeatureDistillation(
                loss="mse", teacher_layer_name="teacher_h0", student_layer_name="student_h0"),
            student_loss_weight=0.5)

    def compile_(model: Any) -> None:
        model.compile(optimizer=keras.optimizers.Adam(0.01),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))

    ref = build()
    compile_(ref)
    plain = ref.fit(x, labels, batch_size=BATCH, epochs=1, shuffle=False, verbose=0).history
    reinit({"partitions": 2, "stall_timeout": 60}, microbatches=_m(ctx))
    dm = tfsmp.DistributedModel(build())
    compile_(dm)
    before = [np.array(w) for w in dm.get_weights()]
    try:
        dm.fit(x, labels, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
        message = "trained"
    except tfsmp.errors.StepError as e:
        message = str(e).split("] ", 1)[-1]
    return {"plain_trained": bool(np.isfinite(plain["loss"][0])), "message": message,
            "unchanged": _same_weights(dm.get_weights(), before)}


def case_uneven_replica_rows_m2(ctx: Any) -> dict[str, Any]:
    """A first batch of 5 rows on 2 replicas of 2 microbatches: the replicas' first
    microbatches have 2 and 1 rows, and each decided from its own whether its Dense layers take
    their gradients at the step's end, so they kept different accumulators and their gradient
    reductions waited on each other (a hang until stall_timeout). The decision now rests on the
    step's rows, the same everywhere."""
    rng = np.random.default_rng(0)
    x = rng.random((21, 5)).astype(np.float32)
    y = rng.integers(0, 10, (21,)).astype(np.int32)

    def build() -> keras.Model:
        keras.utils.set_random_seed(1)
        i = keras.Input((5,))
        h = keras.layers.Dense(16, activation="relu", name="d0")(i)
        return keras.Model(i, keras.layers.Dense(10, name="out")(h))

    def run(model: Any) -> Any:
        model.compile(optimizer="adam",
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        return model.fit(x, y, batch_size=5, epochs=1, shuffle=False, verbose=0).history

    ref = build()
    want = run(ref)
    reinit({"partitions": 1, "stall_timeout": 60}, microbatches=_m(ctx))
    dm = tfsmp.DistributedModel(build())
    got = run(dm)
    return {"history_same": _same_history(got, want),
            "weights_same": _same_weights(dm.get_weights(), ref.get_weights())}


class TwoLossesOfOne(keras.Model):  # type: ignore[misc]
    """Keras's model_test: one output, which compute_loss gives to two compiled losses."""

    def compute_loss(self, x: Any = None, y: Any = None, y_pred: Any = None,
                     sample_weight: Any = None, **kwargs: Any) -> Any:
        return super().compute_loss(x=x, y=y, y_pred=[y_pred, y_pred],
                                    sample_weight=sample_weight, **kwargs)


def case_own_compute_loss_two_losses_m1(ctx: Any) -> dict[str, Any]:
    """At one microbatch (nothing measured before the first step) the compiled loss is first
    called inside compute_loss, where it makes a Mean per loss: every rank makes them alike
    before the step (the last stage's rank alone made them, and the metrics' state it sent
    did not fit the other ranks')."""
    rng = np.random.default_rng(0)
    x = rng.random((16, 8)).astype(np.float32)
    y = (rng.random((16, 1)).astype(np.float32), rng.integers(0, 2, (16, 1)).astype(np.float32))

    def build() -> keras.Model:
        keras.utils.set_random_seed(2)
        i = keras.Input((8,), name="x")
        h = keras.layers.Dense(4, name="d0")(i)
        return TwoLossesOfOne(i, keras.layers.Dense(1, activation="sigmoid", name="out")(h))

    def run(model: Any) -> Any:
        model.compile(optimizer="sgd", loss=["mean_squared_error", "binary_crossentropy"])
        return model.fit(x, y, batch_size=4, epochs=2, shuffle=False, verbose=0).history

    want = run(ref := build())
    dm = _pipelined(build, _m(ctx), x, ctx)
    got = run(dm)
    return {"history_same": _same_history(got, want), "keys": sorted(got),
            "weights_same": _same_weights(dm.get_weights(), ref.get_weights())}


def case_own_compute_loss_refusals_m2(ctx: Any) -> dict[str, Any]:
    """An override that drops self.losses while the model has some, or whose value is neither
    a sum nor a mean over the samples, is refused before any update, on every rank."""
    x, y = _data()
    out: dict[str, Any] = {}
    for kind in ("ignores_losses", "peak"):
        dm = _pipelined(lambda kind=kind: _own_loss_mlp(kind), _m(ctx), x, ctx)
        dm.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
        dm.partition(x[:BATCH])
        before = [np.array(w) for w in dm.get_weights()]
        try:
            dm.fit(x, y, batch_size=BATCH, epochs=1, verbose=0)
            out[kind] = "trained"
        except tfsmp.errors.StepError as e:
            out[kind] = str(e).split("] ", 1)[-1][:90]
        out[kind + "_unchanged"] = _same_weights(dm.get_weights(), before)
    return out


def case_save_keras_file_m2(ctx: Any) -> dict[str, Any]:
    """model.save('m.keras') keeps compile and optimizer state: plain Keras loads it and
    evaluates (and its optimizer has the trained steps), as from plain Keras's own file."""
    ref, dm, x = _trained_pair(ctx)
    _, y = _data()
    folder = ctx.world.bcast(tempfile.mkdtemp() if ctx.rank == 0 else None, root=0)
    path = os.path.join(folder, "m.keras")
    dm.save(path)
    out: dict[str, Any] = {}
    if ctx.rank == 0:
        loaded = keras.models.load_model(path)
        want = ref.evaluate(x, y, batch_size=BATCH, verbose=0, return_dict=True)
        out["evaluate_same"] = _same_history(
            loaded.evaluate(x, y, batch_size=BATCH, verbose=0, return_dict=True), want)
        out["iterations"] = int(loaded.optimizer.iterations.numpy())
        out["optimizer_same"] = _same_weights([v.numpy() for v in loaded.optimizer.variables],
                                              [v.numpy() for v in ref.optimizer.variables])
    return ctx.world.bcast(out, root=0)


def case_optimizer_state_everywhere_m2(ctx: Any) -> dict[str, Any]:
    """Callbacks read model.optimizer's iterations and learning rate on every rank, also where
    the stage has nothing to train (stage 1: a softmax only)."""
    x, y = _data(classes=True)

    def build() -> keras.Model:
        keras.utils.set_random_seed(3)
        inp = keras.Input((8,), name="x")
        h = keras.layers.Dense(3, name="d0")(inp)
        return keras.Model(inp, keras.layers.Activation("softmax", name="soft")(h))

    seen: list[Any] = []

    class Reader(keras.callbacks.Callback):  # type: ignore[misc]
        def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
            opt = self.model.optimizer
            seen.append([int(opt.iterations.numpy()), round(float(opt.learning_rate), 6)])

    dm = _pipelined(build, _m(ctx), x, ctx)
    schedule = keras.optimizers.schedules.ExponentialDecay(0.1, decay_steps=1, decay_rate=0.5)
    dm.compile(optimizer=keras.optimizers.SGD(schedule), loss="sparse_categorical_crossentropy")
    dm.fit(x, y, batch_size=BATCH, epochs=1, verbose=0, shuffle=False, callbacks=[Reader()])
    return {"seen": seen}


def _refusal(ctx: Any, make: Any, m: int) -> str:
    x, y = _data()
    dm = _pipelined(_mlp, m, x, ctx)
    try:
        make(dm)
        dm.fit(x, y, batch_size=BATCH, epochs=1, verbose=0)
    except Exception as e:  # the same clear error on every rank, before any step
        return f"{type(e).__name__}: {e}"
    return "no error"


class GlobalNormSGD(keras.optimizers.SGD):  # type: ignore[misc]
    """An optimizer whose apply() reads every gradient at once (a global statistic)."""

    def apply(self, grads: Any, trainable_variables: Any = None) -> Any:
        norm = keras.ops.sqrt(sum(keras.ops.sum(g * g) for g in grads))
        return super().apply([g / (1.0 + norm) for g in grads], trainable_variables)


def case_refusals_m4(ctx: Any) -> dict[str, str]:
    """Refused before training, with a clear error: an optimizer reading all gradients at once
    (apply() overridden), a stateful RNN at m > 1."""
    out = {"apply_override": _refusal(
        ctx, lambda dm: dm.compile(optimizer=GlobalNormSGD(0.05), loss="mse"), 1)}
    x = np.random.default_rng(1).normal(size=(32, 4, 8)).astype(np.float32)
    y = x[:, -1, :3]

    def build() -> keras.Model:
        keras.utils.set_random_seed(3)
        inp = keras.Input((4, 8), batch_size=BATCH, name="x")
        h = keras.layers.Dense(8, name="d0")(inp)
        h = keras.layers.LSTM(8, stateful=True, name="lstm")(h)
        return keras.Model(inp, keras.layers.Dense(3, name="out")(h))

    dm = _pipelined(build, _m(ctx), x, ctx)
    dm.compile(optimizer="sgd", loss="mse")
    try:
        dm.fit(x, y, batch_size=BATCH, epochs=1, verbose=0)
        out["stateful_rnn"] = "no error"
    except Exception as e:
        out["stateful_rnn"] = f"{type(e).__name__}: {e}"
    return out


def case_swap_ema_weights_m2(ctx: Any) -> dict[str, Any]:
    """SwapEMAWeights(swap_on_epoch=True): validation on the moving averages, as in Keras."""
    x, y = _data()

    def run(model: Any) -> dict[str, Any]:
        model.compile(optimizer=keras.optimizers.SGD(0.05, use_ema=True), loss="mse")
        return dict(model.fit(x, y, batch_size=BATCH, epochs=2, validation_data=(x, y),
                              verbose=0, shuffle=False,
                              callbacks=[keras.callbacks.SwapEMAWeights(swap_on_epoch=True)]
                              ).history)

    want = run(_mlp())
    dm = _pipelined(_mlp, _m(ctx), x, ctx)
    got = run(dm)
    return {"history_same": _same_history(got, want), "detail": [got, want]}


def case_terminate_on_nan_m2(ctx: Any) -> dict[str, Any]:
    """TerminateOnNaN stops training at the first non-finite loss, as in Keras (no error)."""
    x, y = _data()
    x[20] = np.nan  # the second batch

    def run(model: Any) -> dict[str, Any]:
        model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
        history = model.fit(x, y, batch_size=BATCH, epochs=3, verbose=0, shuffle=False,
                            callbacks=[keras.callbacks.TerminateOnNaN()]).history
        return {k: [float(v) for v in vs] for k, vs in history.items()}

    want = run(_mlp())
    got = run(_pipelined(_mlp, _m(ctx), x, ctx))
    return {"got": str(got), "want": str(want)}


def case_string_inputs_m2(ctx: Any) -> dict[str, Any]:
    """String inputs through a StringLookup on the first stage."""
    xs = tf.constant([["a"], ["b"], ["c"], ["d"]] * 8)
    ys = (np.arange(32, dtype=np.float32)[:, None] / 32)

    def build() -> keras.Model:
        keras.utils.set_random_seed(3)
        inp = keras.Input((1,), dtype="string", name="x")
        h = keras.layers.StringLookup(vocabulary=["a", "b", "c"], name="lookup")(inp)
        h = keras.layers.Embedding(5, 4, name="emb")(h)
        h = keras.layers.Flatten(name="flat")(h)
        return keras.Model(inp, keras.layers.Dense(1, name="out")(h))

    def run(model: Any) -> Any:
        model.compile(optimizer="sgd", loss="mse")
        return model.fit(xs, ys, batch_size=8, epochs=2, verbose=0, shuffle=False).history

    want = run(build())
    dm = _pipelined(build, _m(ctx), xs, ctx, cut="lookup")
    got = run(dm)
    return {"history_same": _same_history(got, want), "detail": [got, want]}


class Router(keras.layers.Layer):  # type: ignore[misc]
    """A mixture-of-experts router adding a load-balancing loss (Switch Transformer's): the
    product of the batch's routed fractions and mean probabilities, neither a sum nor a mean."""

    def __init__(self, experts: int = 4, **kw: Any) -> None:
        super().__init__(**kw)
        self.gate = keras.layers.Dense(experts, name="gate")
        self.experts = experts

    def call(self, h: Any) -> Any:
        probs = keras.ops.softmax(self.gate(h))
        routed = keras.ops.one_hot(keras.ops.argmax(probs, axis=-1), self.experts)
        balance = self.experts * keras.ops.sum(keras.ops.mean(routed, 0) * keras.ops.mean(probs, 0))
        self.add_loss(0.1 * balance)
        return h * keras.ops.max(probs, axis=-1, keepdims=True)


def case_balancing_loss_m1(ctx: Any) -> dict[str, Any]:
    """A balancing loss neither sum nor mean: at one part per step, plain Keras's numbers; at
    more, one warning naming the layer (case_balancing_loss_m4)."""
    x, y = _data()

    def build() -> keras.Model:
        keras.utils.set_random_seed(3)
        inp = keras.Input((8,), name="x")
        h = keras.layers.Dense(16, activation="tanh", name="d0")(inp)
        h = Router(name="router")(h)
        return keras.Model(inp, keras.layers.Dense(3, name="out")(h))

    ref = build()
    ref.compile(**_compile())
    want = ref.fit(x, y, batch_size=BATCH, epochs=2, verbose=0, shuffle=False).history
    dm = _pipelined(build, _m(ctx), x, ctx)
    dm.compile(**_compile())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = dm.fit(x, y, batch_size=BATCH, epochs=2, verbose=0, shuffle=False).history
    warned = [str(w.message) for w in caught if "neither a sum nor a mean" in str(w.message)]
    return {"history_same": _same_history(got, want),
            "weights_same": _same_weights(dm.get_weights(), ref.get_weights()),
            "warned": ctx.world.allgather(warned)}


case_balancing_loss_m4 = case_balancing_loss_m1


class _StopAtEpochEnd(keras.callbacks.Callback):  # type: ignore[misc]
    """Ends the job between an epoch's last step and its end (a preemption there)."""

    def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
        raise KeyboardInterrupt("stopped before the epoch's end")


def case_tfsmp_backup_positions_m2(ctx: Any) -> dict[str, Any]:
    """tfsmp's BackupAndRestore resumes a backup written after an epoch's last step (before the
    epoch's end), and one written after the last epoch, with the optimizer's state: the weights
    and optimizer variables end as an uninterrupted run's."""
    from tfsmp.checkpoint import BackupAndRestore

    x, y = _data()
    steps = len(x) // BATCH
    fit = {"batch_size": BATCH, "verbose": 0, "shuffle": False}
    whole = _pipelined(_mlp, _m(ctx), x, ctx)
    whole.compile(**_compile(optimizer=keras.optimizers.Adam(0.01)))
    whole.fit(x, y, epochs=2, **fit)
    want = whole.get_weights()  # (each _pipelined call re-initializes the runtime)
    folder = ctx.world.bcast(tempfile.mkdtemp() if ctx.rank == 0 else None, root=0)
    first = _pipelined(_mlp, _m(ctx), x, ctx)
    first.compile(**_compile(optimizer=keras.optimizers.Adam(0.01)))
    backup = BackupAndRestore(folder, save_freq=steps, delete_checkpoint=False)
    with contextlib.suppress(KeyboardInterrupt):
        first.fit(x, y, epochs=2, callbacks=[_StopAtEpochEnd(), backup], **fit)
    second = _pipelined(_mlp, _m(ctx), x, ctx)
    second.compile(**_compile(optimizer=keras.optimizers.Adam(0.01)))
    resumed = BackupAndRestore(folder, save_freq=steps, delete_checkpoint=False)
    second.fit(x, y, epochs=2, callbacks=[resumed], **fit)
    resumed_same = _same_weights(second.get_weights(), want)  # before reinit frees its comm
    third = _pipelined(_mlp, _m(ctx), x, ctx)  # the backup now covers both epochs
    third.compile(**_compile(optimizer=keras.optimizers.Adam(0.01)))
    third.fit(x, y, epochs=2, callbacks=[BackupAndRestore(folder, delete_checkpoint=False)], **fit)
    return {"first_position": backup.restored_position,
            "resumed_from": resumed.restored_position,
            "resumed_same": resumed_same,
            "covered_same": _same_weights(third.get_weights(), want),
            "covered_iterations": int(third.optimizer.iterations.numpy()),
            "steps": steps}


def case_unplannable_m2(ctx: Any) -> str:
    """A model with fewer layers than stages: every rank raises the planner's error (rank 1
    waited for the plan for ever while rank 0 alone raised)."""
    x, y = _data()
    reinit({"partitions": 2, "stall_timeout": 60}, microbatches=2)
    dm = tfsmp.DistributedModel(keras.Sequential([keras.Input((8,)), keras.layers.Dense(3)]))
    dm.compile(optimizer="sgd", loss="mse")
    try:
        dm.fit(x, y, batch_size=BATCH, verbose=0)
    except Exception as e:
        return f"{type(e).__name__}: {e}"
    return "no error"



# -- Keras's saving functions, pickling, MultiOptimizer, log files (issue 26's last gap) ----------

@contextlib.contextmanager
def _shared_folder(ctx: Any) -> Any:
    """A folder every rank names alike (rank 0 makes it, and removes it when all are done)."""
    import shutil

    folder = ctx.world.bcast(tempfile.mkdtemp(prefix="tfsmp-trainer-") if ctx.rank == 0
                             else None, root=0)
    try:
        yield folder
    finally:
        ctx.world.barrier()
        if ctx.rank == 0:
            shutil.rmtree(folder, ignore_errors=True)


def _trained_pair(ctx: Any) -> tuple[keras.Model, tfsmp.DistributedModel, np.ndarray]:
    """The same fit in plain Keras and as a partitioned DistributedModel (Adam: a state)."""
    x, y = _data()
    ref = _mlp()
    ref.compile(**_compile(optimizer=keras.optimizers.Adam(0.01)))
    ref.fit(x, y, batch_size=BATCH, epochs=1, verbose=0, shuffle=False)
    dm = _pipelined(_mlp, _m(ctx), x, ctx)
    dm.compile(**_compile(optimizer=keras.optimizers.Adam(0.01)))
    dm.fit(x, y, batch_size=BATCH, epochs=1, verbose=0, shuffle=False)
    return ref, dm, x


def _error(fn: Any) -> str:
    try:
        fn()
    except Exception as e:
        return f"{type(e).__name__}: {e}"
    return "no error"


def case_keras_saving_functions_m2(ctx: Any) -> dict[str, Any]:
    """Keras's saving functions handed the DistributedModel, on every rank: the files are plain
    Keras's (compile and optimizer state kept), world rank 0 writes them, a file object gets
    the whole archive on each rank, and Keras's own argument errors come out."""
    import io

    from keras.src.saving import saving_lib

    ref, dm, x = _trained_pair(ctx)
    want = ref.predict(x, verbose=0)
    out: dict[str, Any] = {}
    with _shared_folder(ctx) as folder:
        keras.saving.save_model(dm, os.path.join(folder, "m.keras"))
        saving_lib.save_weights_only(dm, os.path.join(folder, "w.weights.h5"))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # Keras: HDF5 is legacy; the loss is not stored
            keras.saving.save_model(dm, os.path.join(folder, "m.h5"))
        from tfsmp.checkpoint import export as tfsmp_export

        # as if the first batch had been float64 (SMP scripts feed x / 255.0): SMP's save_model
        # serves that dtype, Keras's export the model's own (float32), as plain Keras does
        tfsmp_export.remember_inputs(dm, x.astype(np.float64))
        dm.export(os.path.join(folder, "served"))  # Keras's export: a TF SavedModel
        dm.save_model(os.path.join(folder, "smp_served"))
        out["serving_dtypes"] = [
            [spec.dtype.name for spec in tf.nest.flatten(tf.saved_model.load(
                os.path.join(folder, name)).signatures["serving_default"]
                .structured_input_signature)]
            for name in ("served", "smp_served")]
        tf.saved_model.save(dm, os.path.join(folder, "tf_saved"))  # TensorFlow's, every rank
        out["tf_saved_signatures"] = _error(
            lambda: tf.saved_model.save(dm, os.path.join(folder, "no"), signatures=dm.call))
        # every rank reads what world rank 0 wrote: the call returned once it was written
        restored = tf.saved_model.load(os.path.join(folder, "tf_saved"))
        out["tf_saved_model"] = bool(_close(restored.signatures["serving_default"](
            tf.constant(x, tf.float32))["output_0"].numpy(), want))
        if ctx.rank == 0:
            legacy = keras.models.load_model(os.path.join(folder, "m.h5"), compile=False)
            served = tf.saved_model.load(os.path.join(folder, "served"))
            out["h5_and_export"] = [bool(_close(legacy.predict(x, verbose=0), want)),
                                    bool(_close(served.serve(tf.constant(x)).numpy(), want))]
            loaded = keras.models.load_model(os.path.join(folder, "m.keras"))
            out["keras_file"] = [loaded.compiled, _close(loaded.predict(x, verbose=0), want),
                                 _same_weights([v.numpy() for v in loaded.optimizer.variables],
                                               [v.numpy() for v in ref.optimizer.variables])]
            plain = _mlp(seed=9)
            plain.load_weights(os.path.join(folder, "w.weights.h5"))
            out["weights_file"] = bool(_close(plain.predict(x, verbose=0), want))
            ref.save_weights(os.path.join(folder, "ref.weights.h5"))
        ctx.world.barrier()
        other = _pipelined(lambda: _mlp(seed=9), _m(ctx), x, ctx)
        other.compile(**_compile())
        other.predict(x, verbose=0)  # partitioned, other weights
        saving_lib.load_weights_only(other, os.path.join(folder, "ref.weights.h5"))
        out["loaded_into_dm"] = bool(_close(other.predict(x, verbose=0), want))
        buffer = io.BytesIO()
        saving_lib.save_model(other, buffer)  # every rank: its own buffer, the whole archive
        buffer.seek(0)
        out["file_object"] = bool(_close(
            saving_lib.load_model(buffer).predict(x, verbose=0), want))
    out["save_format"] = _error(lambda: other.save("m", save_format="keras"))
    out["unknown_argument"] = _error(lambda: other.save("m.keras", invalid_arg=1))
    return ctx.world.bcast(out, root=0) | {k: out[k] for k in (
        "loaded_into_dm", "file_object", "save_format", "unknown_argument", "tf_saved_model",
        "tf_saved_signatures", "serving_dtypes")}


def _lora_int8(layer: str) -> Callable[[], keras.Model]:
    """An MLP whose ``layer`` is quantized to int8 with LoRA on top: Keras saves its kernel with
    the LoRA product merged in and quantized again (a lossy file)."""
    def build() -> keras.Model:
        model = _mlp()
        model.get_layer(layer).enable_lora(2)
        model.get_layer(layer).quantize("int8")
        return model
    return build


def case_export_exact_m2(ctx: Any) -> dict[str, Any]:
    """[Note: an exact copy] in tfsmp/checkpoint/export.py: Keras's export and TensorFlow's
    SavedModel of a partitioned model serve what it computes, where its Keras weights file
    does not hold its weights as they are (quantized with LoRA)."""
    x, y = _data()
    out: dict[str, Any] = {}
    for layer in ("d0", "out"):  # held by world rank 0, then by rank 1 ([Note: computed entries])
        dm = _pipelined(_lora_int8(layer), _m(ctx), x, ctx)
        dm.compile(**_compile())
        dm.fit(x, y, batch_size=BATCH, epochs=1, verbose=0, shuffle=False)
        want = dm.predict(x, verbose=0)
        with _shared_folder(ctx) as folder:
            dm.export(os.path.join(folder, "served"))
            tf.saved_model.save(dm, os.path.join(folder, "tf_saved"))
            dm.save_weights(os.path.join(folder, "w.weights.h5"))
            served = tf.saved_model.load(os.path.join(folder, "served"))
            saved = tf.saved_model.load(os.path.join(folder, "tf_saved"))
            got = [served.serve(tf.constant(x)).numpy(),
                   saved.signatures["serving_default"](tf.constant(x))["output_0"].numpy()]
            out[f"{layer}_max_error"] = [float(np.max(np.abs(g - want))) for g in got]
            # the weights file is Keras's lossy one (merged and quantized again), read by Keras
            plain = _lora_int8(layer)()
            plain.load_weights(os.path.join(folder, "w.weights.h5"))
            out[f"{layer}_weights_file_error"] = float(np.max(np.abs(
                plain.predict(x, verbose=0) - want)))
    return out


def case_pickle_m2(ctx: Any) -> dict[str, Any]:
    """pickle and copy.deepcopy of a partitioned DistributedModel (every rank): a
    DistributedModel of the same weights, compiled alike, with the optimizer's state; clone_model
    makes a DistributedModel of the same architecture."""
    import copy
    import pickle

    ref, dm, x = _trained_pair(ctx)
    want = ref.predict(x, verbose=0)
    back = pickle.loads(pickle.dumps(dm))
    deep = copy.deepcopy(dm)
    clone = keras.models.clone_model(dm)
    x_, y_ = _data()
    ref.fit(x_, y_, batch_size=BATCH, epochs=1, verbose=0, shuffle=False)
    back.fit(x_, y_, batch_size=BATCH, epochs=1, verbose=0, shuffle=False)
    return {"types": [type(m).__name__ for m in (back, deep, clone)],
            "predict_same": [bool(_close(deep.predict(x, verbose=0), want))],
            "trains_on_same": _same_weights(back.get_weights(), ref.get_weights()),
            "iterations": int(back.optimizer.iterations.numpy()),
            "clone_wraps": type(clone.wrapped).__name__}


def _multi(function_map: bool = False) -> Any:
    """d0 (stage 0) under Adam with EMA, d1 and out (stage 1) under SGD with momentum, and a
    default optimizer that the map names for no variable (unbuilt, at 0, in plain Keras)."""
    adam = keras.optimizers.Adam(0.01, use_ema=True, ema_momentum=0.9)
    sgd = keras.optimizers.SGD(0.05, momentum=0.9)
    if function_map:
        return keras.optimizers.MultiOptimizer(lambda v: adam if v.path.startswith("d0/") else sgd)
    return keras.optimizers.MultiOptimizer(keras.optimizers.OptimizerMap(
        keras.optimizers.RMSprop(0.1), {"d0/.*": adam, "(d1|out)/.*": sgd}))


def case_multi_optimizer_m2(ctx: Any) -> dict[str, Any]:
    """Keras's MultiOptimizer at partitions=2 ([Note: sub-optimizers elsewhere] in
    tfsmp/runtime/updates.py): History (SwapEMAWeights evaluates with the Adam part's averages),
    weights, every sub-optimizer's step count and built state, and model.optimizer.variables
    equal plain Keras's on every rank; the weights file loads into plain Keras with that state;
    a checkpoint restores it; a map given as a function is refused."""
    x, y = _data()
    fit = {"batch_size": BATCH, "epochs": 2, "verbose": 0, "shuffle": False,
           "validation_data": (x[:16], y[:16])}
    ref = _mlp()
    ref.compile(optimizer=_multi(), loss="mse")
    want = ref.fit(x, y, callbacks=[keras.callbacks.SwapEMAWeights(swap_on_epoch=True)],
                   **fit).history
    dm = _pipelined(_mlp, _m(ctx), x, ctx)
    dm.compile(optimizer=_multi(), loss="mse")
    got = dm.fit(x, y, callbacks=[keras.callbacks.SwapEMAWeights(swap_on_epoch=True)],
                 **fit).history

    def counts(opt: Any) -> list[Any]:
        return [int(opt.iterations.numpy()),
                *[[int(o.iterations.numpy()), bool(o.built)] for o in opt.optimizers]]

    def same_state(a: Any, b: Any) -> bool:
        return len(a.variables) == len(b.variables) and all(
            _close(np.asarray(u), np.asarray(v)) for u, v in zip(a.variables, b.variables))

    out: dict[str, Any] = {
        "history_same": _same_history(got, want), "weights_same": _same_weights(
            dm.get_weights(), ref.get_weights()),
        "counts": counts(dm.optimizer), "want_counts": counts(ref.optimizer),
        "variables_same": same_state(dm.optimizer, ref.optimizer)}
    with _shared_folder(ctx) as folder:
        path = os.path.join(folder, "multi.weights.h5")
        dm.save_weights(path)
        fresh = _mlp()
        fresh.compile(optimizer=_multi(), loss="mse")
        fresh.optimizer.build(fresh.trainable_variables)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            fresh.load_weights(path)
        out["loaded_same"] = same_state(fresh.optimizer, ref.optimizer)
        out["load_warnings"] = [str(w.message)[:120] for w in caught
                                if "Skipping" in str(w.message)]
        saved = [np.asarray(v).copy() for v in dm.optimizer.variables]
        manager = tfsmp.CheckpointManager(tf.train.Checkpoint(model=dm, optimizer=dm.optimizer),
                                          directory=os.path.join(folder, "ckpts"))
        manager.save()
        dm.fit(x, y, batch_size=BATCH, epochs=1, verbose=0, shuffle=False)  # moves the state on
        manager.restore()
        out["restored_same"] = len(saved) == len(dm.optimizer.variables) and all(
            np.array_equal(a, np.asarray(b)) for a, b in zip(saved, dm.optimizer.variables))

    def make(model: Any) -> None:
        model.compile(loss="mse", optimizer=_multi(function_map=True))

    out["function_map"] = _refusal(ctx, make, _m(ctx))
    return out


def case_csv_logger_m2(ctx: Any) -> dict[str, Any]:
    """CSVLogger given the same path on every rank (a shared file system): the file has plain
    Keras's rows, written once (world rank 0 writes the logs)."""
    import csv

    x, y = _data()

    def rows(model: Any, path: str) -> list[list[str]]:
        model.compile(**_compile())
        for epochs, append in ((2, False), (1, True)):  # Keras's test: a second fit appends
            model.fit(x, y, batch_size=BATCH, epochs=epochs, verbose=0, shuffle=False,
                      validation_data=(x, y),
                      callbacks=[keras.callbacks.CSVLogger(path, append=append)])
        ctx.world.barrier()
        with open(path) as f:
            return [r for r in csv.reader(f) if r]

    with _shared_folder(ctx) as folder:
        want = rows(_mlp(), os.path.join(folder, f"plain{ctx.rank}.csv"))
        got = rows(_pipelined(_mlp, _m(ctx), x, ctx), os.path.join(folder, "dm.csv"))
    same = len(got) == len(want) and got[0] == want[0] and all(
        len(a) == len(b) and a[0] == b[0]
        and _close(np.asarray(a[1:], float), np.asarray(b[1:], float))
        for a, b in zip(got[1:], want[1:]))
    return {"rows": len(got), "want_rows": len(want), "same": bool(same)}


def case_one_dimensional_inputs_m2(ctx: Any) -> dict[str, Any]:
    """A (batch,) array for an Input of shape (1,) (Keras's test of saving to a file object
    trains so): Keras's Functional model adds the last dimension, and so does tfsmp."""
    rng = np.random.default_rng(5)
    x = rng.normal(size=48).astype(np.float32)

    def build() -> keras.Model:
        keras.utils.set_random_seed(3)
        return keras.Sequential([keras.Input((1,), name="x"), keras.layers.Dense(4, name="d0"),
                                 keras.layers.Dense(1, name="out")])

    out = _fit_compare(ctx, lambda: (x, 2 * x), {"batch_size": BATCH, "epochs": 2,
                                                  "shuffle": False},
                       build=build, compile_kw={"metrics": []}, x=x[:, None])
    return out
