"""DistributedModel's Keras API on several ranks: fit/callbacks/evaluate/predict/weights/errors.

Cases run through `tests/mpi/cases_runner.py`; each returns JSON the test asserts on (the same on
every rank where that is the point). Every case re-initializes tfsmp with its own config.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras
import numpy as np
import tensorflow as tf
from caseutil import reinit

import tfsmp
from tfsmp.errors import StepError

RTOL, ATOL = 1e-5, 1e-6


def _init(**config: object) -> None:
    reinit({"partitions": 2, "microbatches": 2}, **config)


def _model(seed: int = 3) -> keras.Model:
    keras.utils.set_random_seed(seed)
    x = keras.Input((10,), name="x")
    h = keras.layers.Dense(16, activation="relu", name="h1")(x)
    h = keras.layers.Dense(16, activation="relu", name="h2")(h)
    h = keras.layers.Dense(16, activation="relu", name="h3")(h)
    return keras.Model(x, keras.layers.Dense(3, name="out")(h), name="clf")


def _data(n: int = 64, seed: int = 5) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 10)).astype(np.float32)
    return x, (x[:, :3].sum(axis=1) > 0).astype(np.int64) + (x[:, 3] > 1)


def _pair(metrics: list[str] | None = None) -> tuple[keras.Model, tfsmp.DistributedModel]:
    ref = _model()
    init = ref.get_weights()
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    ref.compile(optimizer=keras.optimizers.SGD(0.1), loss=loss, metrics=metrics)
    inner = _model()
    inner.set_weights(init)
    dm = tfsmp.DistributedModel(inner)
    dm.compile(optimizer=keras.optimizers.SGD(0.1), loss=loss, metrics=metrics)
    return ref, dm


def _close(a: object, b: object) -> bool:
    return bool(np.allclose(np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64),
                            rtol=RTOL, atol=ATOL))


def case_fit_history_matches_keras(ctx: object) -> dict[str, object]:
    _init()
    x, y = _data()
    xv, yv = _data(32, seed=9)
    ref, dm = _pair(["accuracy"])
    h_ref = ref.fit(x, y, batch_size=16, epochs=2, shuffle=False, validation_data=(xv, yv), verbose=0)
    h = dm.fit(x, y, batch_size=16, epochs=2, shuffle=False, validation_data=(xv, yv), verbose=0)
    same = {k: _close(h.history[k], h_ref.history[k]) for k in h_ref.history}
    return {"keys": sorted(h.history), "ref_keys": sorted(h_ref.history), "same": same,
            "loss": h.history["loss"]}


def case_callbacks_act_on_every_rank(ctx: object) -> dict[str, object]:
    _init(microbatches=4)
    x, y = _data()
    _, dm = _pair()
    batches: list[int] = []
    schedule = keras.callbacks.LearningRateScheduler(lambda epoch, lr: 0.05 / (epoch + 1))
    early = keras.callbacks.EarlyStopping(monitor="loss", min_delta=10.0, patience=1)
    count = keras.callbacks.LambdaCallback(on_train_batch_end=lambda b, logs: batches.append(b))
    import tempfile

    # one log folder for every rank, as on a shared file system: world rank 0 alone writes
    logdir = tfsmp.allgather(tempfile.mkdtemp(prefix="tb-") if tfsmp.rank() == 0 else None)[0]
    import atexit
    import shutil

    if tfsmp.rank() == 0:
        atexit.register(shutil.rmtree, logdir, True)
    board = keras.callbacks.TensorBoard(log_dir=logdir)
    h = dm.fit(x, y, batch_size=16, epochs=10, callbacks=[schedule, early, count, board], verbose=0)
    tfsmp.barrier()
    events = [f for _, _, files in os.walk(logdir) for f in files if "tfevents" in f]
    return {"epochs_run": len(h.history["loss"]), "batches": len(batches),
            "lr": float(np.asarray(dm.optimizer.learning_rate)), "stopped": early.stopped_epoch,
            "tensorboard_event_files": len(events)}


def case_evaluate_and_predict_match_keras(ctx: object) -> dict[str, object]:
    _init(microbatches=4)
    x, y = _data(48)
    ref, dm = _pair(["accuracy"])
    ref_eval = ref.evaluate(x, y, batch_size=16, verbose=0)
    dm_eval = dm.evaluate(x, y, batch_size=16, verbose=0)
    ref_pred = ref.predict(x, batch_size=16, verbose=0)
    pred = dm.predict(x, batch_size=16)
    direct = dm(x[:8]).numpy()
    return {"eval_same": _close(dm_eval, ref_eval), "pred_same": _close(pred, ref_pred),
            "call_same": _close(direct, ref_pred[:8]), "pred_sum": float(np.sum(pred))}


def case_weights_roundtrip(ctx: object) -> dict[str, object]:
    _init()
    x, y = _data()
    ref, dm = _pair()
    dm.train_on_batch(x[:16], y[:16])
    ref.train_on_batch(x[:16], y[:16])
    same = all(_close(a, b) for a, b in zip(dm.get_weights(), ref.get_weights()))
    zeros = [np.zeros_like(w) for w in ref.get_weights()]
    dm.set_weights(zeros)
    all_zero = all(float(np.abs(w).sum()) == 0.0 for w in dm.get_weights())
    lines: list[str] = []
    dm.summary(print_fn=lines.append)
    return {"same": same, "all_zero": all_zero, "summary_has_stage": "stage" in lines[1],
            "held": dm.held_variable_bytes()}


def case_dataset_and_generator_inputs(ctx: object) -> dict[str, object]:
    _init()
    x, y = _data()
    ref, dm = _pair()
    ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(16, drop_remainder=True)
    h = dm.fit(ds, epochs=1, verbose=0)
    h_ref = ref.fit(ds, epochs=1, verbose=0)

    def gen():  # type: ignore[no-untyped-def]
        while True:
            for i in range(0, 64, 16):
                yield x[i:i + 16], y[i:i + 16]

    h2 = dm.fit(gen(), steps_per_epoch=4, epochs=1, verbose=0)
    h2_ref = ref.fit(gen(), steps_per_epoch=4, epochs=1, verbose=0)
    return {"dataset_same": _close(h.history["loss"], h_ref.history["loss"]),
            "generator_same": _close(h2.history["loss"], h2_ref.history["loss"])}


def _error_of(fn: object) -> str:
    try:
        fn()  # type: ignore[operator]
    except (StepError, ValueError) as e:
        return f"{type(e).__name__}: {e}"
    return "no error"


def case_bad_batches_fail_on_every_rank(ctx: object) -> dict[str, str]:
    _init(microbatches=4)
    x, y = _data()
    _, dm = _pair()
    dm.train_on_batch(x[:16], y[:16])
    return {
        "not_divisible": _error_of(lambda: dm.train_on_batch(x[:10], y[:10])),
        "other_shape": _error_of(lambda: dm.train_on_batch(np.zeros((16, 12), np.float32), y[:16])),
        "no_targets": _error_of(lambda: dm.train_on_batch(x[:16])),
        "fit_last_batch": _error_of(lambda: dm.fit(x[:58], y[:58], batch_size=16, verbose=0)),
    }


def case_nonfinite_raise_and_skip(ctx: object) -> dict[str, object]:
    _init(microbatches=2, nonfinite="raise")
    x, y = _data()
    _, dm = _pair()
    bad = x[:16].copy()
    bad[9, 0] = np.nan  # microbatch 1 of 2
    raised = _error_of(lambda: dm.train_on_batch(bad, y[:16]))
    _init(microbatches=2, nonfinite="skip")
    _, dm2 = _pair()
    before = dm2.get_weights()
    dm2.train_on_batch(bad, y[:16])
    unchanged = all(np.array_equal(a, b) for a, b in zip(before, dm2.get_weights()))
    dm2.train_on_batch(x[:16], y[:16])
    changed = not all(np.array_equal(a, b) for a, b in zip(before, dm2.get_weights()))
    return {"raised": raised, "skip_unchanged": unchanged, "then_trains": changed,
            "skipped": dm2._engine.skipped_steps}


def case_mixed_precision(ctx: object) -> dict[str, object]:
    out: dict[str, object] = {}
    for policy in ("mixed_bfloat16", "mixed_float16"):
        keras.mixed_precision.set_global_policy(policy)
        try:
            _init(microbatches=1)
            x, y = _data()
            ref, dm = _pair()
            ref_losses = [float(ref.train_on_batch(x[i:i + 16], y[i:i + 16])) for i in (0, 16, 32)]
            losses = [float(dm.train_on_batch(x[i:i + 16], y[i:i + 16])) for i in (0, 16, 32)]
            boundary = dm._engine.plan.boundaries[0].dtype
            out[policy] = {"close": bool(np.allclose(losses, ref_losses, rtol=2e-2)),
                           "boundary_dtype": boundary, "losses": losses, "ref": ref_losses}
        finally:
            keras.mixed_precision.set_global_policy("float32")
    return out


def case_profile_and_post_partition_hook(ctx: object) -> dict[str, object]:
    _init()
    x, y = _data()
    _, dm = _pair()
    calls: list[int] = []
    hook = tfsmp.register_post_partition_hook(lambda: calls.append(len(dm.trainable_variables)))
    try:
        dm.profile(x[:16])
        dm.train_on_batch(x[:16], y[:16])
        dm.train_on_batch(x[16:32], y[16:32])
    finally:
        from tfsmp.keras import model as model_module

        model_module._POST_PARTITION_HOOKS.remove(hook)
    graph = dm._engine.traced.graph
    measured = {n.name: n.measured_seconds for n in graph if not n.is_input}
    return {"hook_calls": calls, "own_variables": len(dm.trainable_variables),
            "measured_on_rank0": all(v is not None and v > 0 for v in measured.values())
            if tfsmp.rank() == 0 else None}


def case_jit_compile_switches_xla(ctx: object) -> dict[str, object]:
    """`compile(jit_compile=...)` decides whether the stage programs compile with XLA
    ([Note: jit_compile is xla] in tfsmp/keras/model.py); a new compile that changes it
    rebuilds them, and training goes on from the same weights, as plain Keras's does. The
    engine still reads the process's config: a stall_timeout changed between steps (as the
    fault scripts lower it) is the limit of the next step, with or without XLA."""
    _init()
    x, y = _data()
    ref, dm = _pair()
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    config = tfsmp.state().config
    before = config.stall_timeout
    seen: list[object] = []
    for i, jit in enumerate((True, False, True)):
        for m in (ref, dm):
            m.compile(optimizer=keras.optimizers.SGD(0.1), loss=loss, jit_compile=jit)
        ref_loss = ref.train_on_batch(x[:32], y[:32])
        object.__setattr__(config, "stall_timeout", 500.0 + i)
        got = dm.train_on_batch(x[:32], y[:32])
        compiled = {bool(p._fwd._jit_compile) for p in dm._engine.programs.values()}
        seen.append({"jit_compile": dm.jit_compile, "programs": sorted(compiled),
                     "same": _close(got, ref_loss),
                     "limit": dm._engine.executors.last.stall_timeout})
    object.__setattr__(config, "stall_timeout", before)
    same_weights = all(_close(a, b) for a, b in zip(dm.get_weights(), ref.get_weights()))
    return {"seen": seen, "same_weights": same_weights}


def _trainer_layers() -> dict[str, type]:
    """Layers with Keras's Trainer mixed in, as Keras's trainer_test.py builds its models."""
    from keras.src.backend.tensorflow.trainer import TensorFlowTrainer as Trainer

    class Dense(Trainer, keras.layers.Dense):  # type: ignore[misc]
        def __init__(self, units: int) -> None:
            keras.layers.Dense.__init__(self, units=units, use_bias=False)
            Trainer.__init__(self)
            # Keras lists and logs a metric the model holds (trainer_test.py's
            # test_metric_tracking): [Note: held metrics] in tfsmp/keras/model.py
            self.held = keras.metrics.MeanSquaredError(name="held")

    class Struct(Trainer, keras.layers.Layer):  # type: ignore[misc]
        def __init__(self, units: int) -> None:
            keras.layers.Layer.__init__(self)
            Trainer.__init__(self)
            self.one = keras.layers.Dense(units, activation="tanh")
            self.two = keras.layers.Dense(units)
            # held by the model and by one of its layers: Keras lists the model's first, each
            # once ([Note: held metrics] in tfsmp/keras/model.py)
            self.held = keras.metrics.Mean(name="held")
            self.one.inner = keras.metrics.Mean(name="inner")

        def call(self, x: dict[str, tf.Tensor]) -> dict[str, tf.Tensor]:
            return {"y_one": self.one(x["x_one"]), "y_two": self.two(x["x_two"])}

    return {"dense": Dense, "struct": Struct}


def case_layer_with_trainer_mixed_in(ctx: object) -> dict[str, object]:
    """A layer with Keras's Trainer mixed in is a model to Keras, and to tfsmp ([Note: a layer
    with Keras's Trainer] in tfsmp/graph/tracer.py): at partitions 1 over 2 replicas and 2
    microbatches its History, weights, evaluate and predict equal plain Keras's."""
    _init(partitions=1)
    x, y = _data()
    data = {"dense": (x, y.astype(np.float32)[:, None] * np.ones((1, 3), np.float32)),
            "struct": ({"x_one": x, "x_two": x[:, ::-1].copy()},
                       {"y_one": x[:, :3], "y_two": x[:, 3:6]})}
    out: dict[str, object] = {}
    for name, cls in _trainer_layers().items():
        xs, ys = data[name]
        keras.utils.set_random_seed(7)
        ref = cls(3)
        ref(tf.nest.map_structure(lambda a: a[:2], xs))
        keras.utils.set_random_seed(7)
        inner = cls(3)
        inner(tf.nest.map_structure(lambda a: a[:2], xs))
        inner.set_weights(ref.get_weights())
        dm = tfsmp.DistributedModel(inner)
        for m in (ref, dm):
            m.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse",
                      metrics={"y_one": ["mae"], "y_two": ["mae"]} if name == "struct" else
                      ["mae"])
        h_ref = ref.fit(xs, ys, batch_size=16, epochs=2, shuffle=False, verbose=0)
        h = dm.fit(xs, ys, batch_size=16, epochs=2, shuffle=False, verbose=0)
        out[name] = {
            "keys": sorted(h.history) == sorted(h_ref.history),
            "metrics": [m.name for m in dm.metrics] == [m.name for m in ref.metrics],
            "history": all(_close(h.history[k], h_ref.history[k]) for k in h_ref.history),
            "weights": all(_close(a, b) for a, b in zip(dm.get_weights(), ref.get_weights())),
            "evaluate": _close(dm.evaluate(xs, ys, verbose=0), ref.evaluate(xs, ys, verbose=0)),
            "predict": all(_close(a, b) for a, b in zip(
                tf.nest.flatten(dm.predict(xs, verbose=0)),
                tf.nest.flatten(ref.predict(xs, verbose=0))))}
    return out


def case_a_bad_batch_fails_alike_where_a_replica_has_no_rows(ctx: object) -> dict[str, object]:
    """A one-row batch of the wrong shape over 2 replicas: the replica without rows refuses it
    too, so a script that catches the error goes on with the next fit (Keras's
    trainer_test.py::test_for_eval_epoch_iterator); before, only the replica holding the row
    raised, and the next fit's collectives met the other replica's report."""
    _init(partitions=1)
    x, y = _data(16)
    _, dm = _pair()
    dm.fit(x, y, batch_size=4, epochs=1, verbose=0)
    errors = []
    for call in (lambda: dm.fit(x, y, batch_size=4, epochs=1, verbose=0,
                                validation_data=(x.reshape((1, 16, 10)), y[:1])),
                 lambda: dm.predict(x.reshape((1, 16, 10)), verbose=0),
                 lambda: dm.train_on_batch(x.reshape((1, 16, 10)), y[:1])):
        try:
            call()
            errors.append("")
        except StepError as e:
            errors.append("per-sample shape" if "per-sample shape" in str(e) else str(e)[:200])
    history = dm.fit(x, y, batch_size=4, epochs=1, verbose=0, validation_data=(x, y))
    return {"errors": errors, "val_loss": "val_loss" in history.history}


def _summaries(logdir: str) -> dict[str, np.ndarray]:
    """Every tensor summary of the events files under ``logdir``, by ``'tag@step'``."""
    out: dict[str, np.ndarray] = {}
    for root, _, files in os.walk(logdir):
        for f in files:
            if "tfevents" not in f:
                continue
            for event in tf.compat.v1.train.summary_iterator(os.path.join(root, f)):
                for v in event.summary.value:
                    key = f"{os.path.relpath(root, logdir)}/{v.tag}@{event.step}"
                    out[key] = tf.make_ndarray(v.tensor) if v.HasField("tensor") else np.zeros(0)
    return out


def _same_arrays(got: str, want: str) -> bool:
    """Two .weights.h5 files hold the same arrays under the same names (to the tolerance)."""
    import h5py

    def arrays(path: str) -> dict[str, np.ndarray]:
        out: dict[str, np.ndarray] = {}
        with h5py.File(path, "r") as f:
            f.visititems(lambda name, obj: out.__setitem__(name, obj[()])
                         if isinstance(obj, h5py.Dataset) else None)
        return out

    a, b = arrays(got), arrays(want)
    return bool(a) and sorted(a) == sorted(b) and all(_close(a[k], b[k]) for k in a)


def _model_json(summaries: dict[str, np.ndarray]) -> object:
    """The class and config of the model summary TensorBoard wrote (its compile config names
    an optimizer made second in this process 'sgd_1')."""
    import json

    found = summaries.get("train/keras@0")
    if found is None:
        return None
    model = json.loads(found.item())
    return [model["class_name"], model["config"]]


def _same_summary(got: np.ndarray, want: np.ndarray) -> bool:
    """A histogram's buckets to the equality tolerance; an image's pixels within one level
    (a summary image is [width, height, PNG...])."""
    if got.dtype != object:
        return got.shape == want.shape and bool(np.allclose(got, want, rtol=1e-4, atol=1e-5))
    if got.shape != want.shape or list(got[:2]) != list(want[:2]):
        return False
    for a, b in zip(got[2:], want[2:]):
        pa, pb = (tf.io.decode_png(v).numpy().astype(np.int32) for v in (a, b))
        if pa.shape != pb.shape or np.abs(pa - pb).max() > 1:
            return False
    return True


def case_tensorboard_logs_weights_as_keras(ctx: object) -> dict[str, object]:
    """TensorBoard's weight histograms, weight images and projector checkpoint at partitions 2:
    the events plain Keras writes ([Note: TensorBoard's weights] in tfsmp/keras/log_writers.py)."""
    import shutil
    import tempfile

    _init()
    x, y = _data()
    ref, dm = _pair()
    root = tfsmp.allgather(tempfile.mkdtemp(prefix="tbw-") if tfsmp.rank() == 0 else None)[0]
    try:
        def board(name: str) -> keras.callbacks.TensorBoard:
            return keras.callbacks.TensorBoard(os.path.join(root, name), histogram_freq=1,
                                               write_images=True, embeddings_freq=2)

        ref_board = board("plain")
        if tfsmp.rank() == 0:
            ref.fit(x, y, batch_size=16, epochs=3, shuffle=False, verbose=0,
                    callbacks=[ref_board])
        # the TensorBoard between two callbacks, as a user's list has it
        seen: list[int] = []
        note = keras.callbacks.LambdaCallback(on_epoch_end=lambda e, logs: seen.append(e))
        layers: dict[str, object] = {}

        class Layers(keras.callbacks.Callback):  # type: ignore[misc]
            """What a user's callback finds as ``self.model.layers`` (TensorBoard walks it)."""

            def on_train_end(self, logs: object = None) -> None:
                layers["names"] = [layer.name for layer in self.model.layers]
                layers["get_layer"] = self.model.get_layer("h2").name

        h = dm.fit(x, y, batch_size=16, epochs=3, shuffle=False, verbose=0,
                   callbacks=[note, board("tfsmp"), note, Layers()])
        # evaluate's and predict's callbacks: TensorBoard writes the evaluation's scalars once
        if tfsmp.rank() == 0:
            ref.evaluate(x, y, batch_size=16, verbose=0,
                         callbacks=[keras.callbacks.TensorBoard(os.path.join(root, "plain_eval"))])
        dm.evaluate(x, y, batch_size=16, verbose=0,
                    callbacks=[keras.callbacks.TensorBoard(os.path.join(root, "tfsmp_eval"))])
        dm.predict(x, batch_size=16, verbose=0,
                   callbacks=[keras.callbacks.TensorBoard(os.path.join(root, "tfsmp_predict"))])
        tfsmp.barrier()
        result: dict[str, object] = {}
        if tfsmp.rank() == 0:
            want = _summaries(os.path.join(root, "plain"))
            got = _summaries(os.path.join(root, "tfsmp"))
            weights = sorted(k for k in want if k.endswith(("/histogram@1", "/image@2")))
            ckpt = [os.path.relpath(os.path.join(r, f), root) for r, _, fs in os.walk(root)
                    for f in fs if f.endswith(".weights.h5")]
            result = {
                "weight_tags": len(weights),
                "missing": sorted(set(want) - set(got)),
                "extra": sorted(set(got) - set(want)),
                "different": sorted(k for k in want if k in got and k.split("@")[0].endswith(
                    ("/histogram", "/image")) and not _same_summary(got[k], want[k])),
                # the graph dashboard's conceptual graph: the model's config as JSON
                "model_json_same": _model_json(got) == _model_json(want) is not None,
                "checkpoints": sorted(c.split(os.sep, 1)[1] for c in ckpt
                                      if c.startswith("tfsmp")),
                "ref_checkpoints": sorted(c.split(os.sep, 1)[1] for c in ckpt
                                          if c.startswith("plain")),
                "eval_files": {name: sorted(os.path.relpath(os.path.join(r, f), root)
                                            .split(os.sep)[1] for r, _, fs in
                                            os.walk(os.path.join(root, name)) for f in fs)
                               for name in ("plain_eval", "tfsmp_eval", "tfsmp_predict")},
                "eval_same": sorted(_summaries(os.path.join(root, "tfsmp_eval")))
                == sorted(_summaries(os.path.join(root, "plain_eval"))),
                "checkpoints_same": all(
                    _same_arrays(os.path.join(root, "tfsmp", c.split(os.sep, 1)[1]),
                                 os.path.join(root, c)) for c in ckpt if c.startswith("plain")),
            }
        result = tfsmp.allgather(result)[0]
        result["epochs_seen"] = seen
        result["layers"] = layers
        result["ref_layers"] = [layer.name for layer in ref.layers]
        result["epochs_trained"] = len(h.history["loss"])
        return result
    finally:
        if tfsmp.rank() == 0:
            shutil.rmtree(root, ignore_errors=True)


def case_a_tensorboard_failing_while_it_logs_weights_fails_every_rank(ctx: object) -> dict[str, object]:
    """Rank 0's TensorBoard fails at an epoch's end that logs weights: halfway through the
    weights the other ranks serve, or before it asked for any. Every rank raises (the peers
    with rank 0's error), none waits for a request that never comes, and the ranks go on."""
    import shutil
    import tempfile

    from tfsmp.comm.calls import labels

    seen_labels: list[list[str]] = []

    class BrokenImage(keras.callbacks.TensorBoard):  # type: ignore[misc]
        def _log_weight_as_image(self, weight: object, name: str, epoch: int) -> None:
            if "h3" in name:
                seen_labels.append([text for text, _ in labels()])  # what a stall would name
                raise RuntimeError(f"no image for {name}")

    class BrokenScalars(keras.callbacks.TensorBoard):  # type: ignore[misc]
        def _log_epoch_metrics(self, epoch: int, logs: object) -> None:
            raise RuntimeError("no scalars")

    _init()
    x, y = _data()
    _, dm = _pair()
    root = tfsmp.allgather(tempfile.mkdtemp(prefix="tbf-") if tfsmp.rank() == 0 else None)[0]
    errors = []
    try:
        for cls in (BrokenImage, BrokenScalars):
            board = cls(os.path.join(root, cls.__name__), histogram_freq=1, write_images=True)
            try:
                dm.fit(x, y, batch_size=16, epochs=2, verbose=0, callbacks=[board])
                errors.append("")
            except Exception as e:
                errors.append(f"{type(e).__name__}: {e}")
        # the job goes on: the ranks still meet, and train
        loss = dm.fit(x, y, batch_size=16, epochs=1, verbose=0).history["loss"]
        return {"errors": errors, "trained_after": len(loss), "labels": seen_labels}
    finally:
        if tfsmp.rank() == 0:
            shutil.rmtree(root, ignore_errors=True)


def case_a_writer_failing_on_rank_0_fails_every_rank(ctx: object) -> dict[str, object]:
    """The log writers and the progress bar run on world rank 0 only ([Note: a writer failing
    on rank 0]). When one fails there (a CSVLogger that cannot open its file, a progress bar
    whose pipe closed mid-epoch, Keras's own or the user's, between collective checkpoint
    saves; a TensorBoard failing at a batch; a progress bar in evaluate and predict), every
    rank raises at once (the peers with rank 0's error), and the ranks go on."""
    import io
    import shutil
    import sys
    import tempfile

    class ClosedPipe(io.StringIO):
        """Rank 0's stdout: breaks after ``writes`` writes."""

        def __init__(self, writes: int) -> None:
            super().__init__()
            self.left = writes

        def write(self, text: str) -> int:
            self.left -= 1
            if self.left < 0:
                raise BrokenPipeError(32, "Broken pipe")
            return super().write(text)

    class BrokenBatch(keras.callbacks.TensorBoard):  # type: ignore[misc]
        def on_train_batch_end(self, batch: int, logs: object = None) -> None:
            super().on_train_batch_end(batch, logs)
            if batch == 2:
                raise RuntimeError("no batch scalars")

    _init()
    x, y = _data()
    _, dm = _pair()
    root = tfsmp.allgather(tempfile.mkdtemp(prefix="wf-") if tfsmp.rank() == 0 else None)[0]
    rank0 = tfsmp.rank() == 0

    def attempt(run: Callable[[], object], pipe: int | None = None) -> str:
        kept = sys.stdout
        if pipe is not None and rank0:
            sys.stdout = ClosedPipe(pipe)
        try:
            run()
            return ""
        except Exception as e:
            return f"{type(e).__name__}: {e}"
        finally:
            sys.stdout = kept

    def saver() -> keras.callbacks.Callback:
        return keras.callbacks.ModelCheckpoint(os.path.join(root, "m.weights.h5"),
                                               save_weights_only=True, save_freq=1)

    errors = {}
    try:
        errors["csv"] = attempt(lambda: dm.fit(x, y, batch_size=16, epochs=1, verbose=0, callbacks=[
            keras.callbacks.CSVLogger(os.path.join(root, "missing", "log.csv"))]))
        errors["keras_bar"] = attempt(lambda: dm.fit(
            x, y, batch_size=16, epochs=1, verbose=1, callbacks=[saver()]), pipe=0)
        errors["user_bar"] = attempt(lambda: dm.fit(
            x, y, batch_size=16, epochs=1, verbose=1,
            callbacks=[saver(), keras.callbacks.ProgbarLogger()]), pipe=0)
        errors["board"] = attempt(lambda: dm.fit(x, y, batch_size=16, epochs=1, verbose=0, callbacks=[
            BrokenBatch(os.path.join(root, "tb"), update_freq=1)]))
        errors["evaluate"] = attempt(lambda: dm.evaluate(x, y, batch_size=16, verbose=1), pipe=0)
        errors["predict"] = attempt(lambda: dm.predict(x, batch_size=16, verbose=1), pipe=0)
        # Horovod's idiom: the writers on rank 0 only, verbose=0 elsewhere; their peers come
        # from rank 0's list, at rank 0's places among the checkpoint saves
        errors["rank0_only"] = attempt(lambda: dm.fit(
            x, y, batch_size=16, epochs=1, verbose=1 if rank0 else 0,
            callbacks=[saver(), BrokenBatch(os.path.join(root, "tb0"), update_freq=1)]
            if rank0 else [saver()]), pipe=None)
        csv = os.path.join(root, "rank0.csv")
        errors["rank0_only_works"] = attempt(lambda: dm.fit(
            x, y, batch_size=16, epochs=2, verbose=2 if rank0 else 0,
            callbacks=[keras.callbacks.CSVLogger(csv), saver()] if rank0 else [saver()]),
            pipe=None)
        rows = len(Path(csv).read_text().splitlines()) if rank0 else None
        # rank 0 also passes a callback of its own (no collective): the peers are placed among
        # the checkpoint saves, the callbacks every rank passed alike
        csv2 = os.path.join(root, "mixed.csv")
        errors["rank0_own_callback"] = attempt(lambda: dm.fit(
            x, y, batch_size=16, epochs=2, verbose=0,
            callbacks=[keras.callbacks.LambdaCallback(), saver(),
                       keras.callbacks.CSVLogger(csv2)] if rank0 else [saver()]))
        rows2 = len(Path(csv2).read_text().splitlines()) if rank0 else None
        # a checkpoint save on some ranks only cannot be collective: refused before any step
        errors["savers_differ"] = attempt(lambda: dm.fit(
            x, y, batch_size=16, epochs=1, verbose=0, callbacks=[saver()] if rank0 else []))
        # the job goes on: the ranks still meet, and train, with a progress bar
        kept, sys.stdout = sys.stdout, io.StringIO()
        try:
            # a callback's change to the epoch's logs reaches History, which runs after the
            # user's callbacks as in Keras (tfsmp appends it with the progress bar)
            history = dm.fit(x, y, batch_size=16, epochs=2, verbose=1, callbacks=[
                keras.callbacks.LearningRateScheduler(lambda epoch, lr: 0.05)])
            printed = sys.stdout.getvalue()
            history_is_models = history is dm.history
            # a user's own progress bar class takes the place of Keras's (Keras looks for
            # any ProgbarLogger): one bar prints, not two
            sys.stdout = io.StringIO()

            class Bar(keras.callbacks.ProgbarLogger):  # type: ignore[misc]
                pass

            dm.fit(x, y, batch_size=16, epochs=2, verbose=1, callbacks=[Bar()])
            own_bar = sys.stdout.getvalue().count("Epoch 1/2")
        finally:
            sys.stdout = kept
        return {"errors": errors, "trained_after": len(history.history["loss"]),
                "history_is_models": history_is_models, "printed": "loss:" in printed,
                "history_keys": sorted(history.history), "own_bar_epoch_lines": own_bar,
                "csv_rows": rows, "mixed_csv_rows": rows2}
    finally:
        if rank0:
            shutil.rmtree(root, ignore_errors=True)
