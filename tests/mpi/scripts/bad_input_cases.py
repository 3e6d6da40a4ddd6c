"""Bad input on 2 ranks (2 stages): every rank raises the same clear error, nothing changes, no hang.

Cases run through `tests/mpi/cases_runner.py`. Each returns ``{name: {"error": "Type: message",
"unchanged": bool, "echo_of": rank or None}}``: the error every rank raised, whether this rank's
weights (and the optimizer's step count) are what they were before the bad call, and the rank
whose failure the error copies (`tfsmp.failure.echo_of`). The test pins the messages and
checks that both ranks agree. Checkpoint files are written under ``TFSMP_BAD_INPUT_DIR``.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras
import numpy as np
import tensorflow as tf
from caseutil import reinit

import tfsmp
from tfsmp import failure
from tfsmp.errors import TfsmpError

BATCH = 16
Outcome = dict[str, Any]


def _init(**config: object) -> None:
    reinit({"partitions": 2, "microbatches": 4}, **config)


def _model(width: int = 16, extra: bool = False, name: str = "net") -> keras.Model:
    keras.utils.set_random_seed(3)
    x = keras.Input((8,), name="x")
    h = keras.layers.Dense(width, activation="tanh", name="d0")(x)
    h = keras.layers.Dense(width, activation="tanh", name="d1")(h)
    if extra:
        h = keras.layers.Dense(width, activation="tanh", name="d_extra")(h)
    h = keras.layers.Dense(width, activation="tanh", name="d2")(h)
    return keras.Model(x, keras.layers.Dense(1, name="out")(h), name=name)


def _dm(**kwargs: Any) -> tfsmp.DistributedModel:
    dm = tfsmp.DistributedModel(_model(**kwargs))
    dm.compile(optimizer=keras.optimizers.Adam(1e-2), loss="mse")
    return dm


def _data(n: int = 64, features: int = 8) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(5)
    x = rng.normal(size=(n, features)).astype(np.float32)
    return x, x[:, :1] * 2.0


def _snapshot(dm: tfsmp.DistributedModel) -> list[np.ndarray]:
    """This rank's own variables and the optimizer's iteration count."""
    values = [np.array(v.numpy()) for v in dm.variables]
    opt = getattr(dm, "optimizer", None)
    if opt is not None and opt.built:
        values.append(np.array(opt.iterations.numpy()))
    return values


def _same(a: list[np.ndarray], b: list[np.ndarray]) -> bool:
    return len(a) == len(b) and all(np.array_equal(x, y) for x, y in zip(a, b))


def _outcome(dm: tfsmp.DistributedModel | None, fn: Callable[[], Any],
             before: list[np.ndarray] | None = None) -> Outcome:
    """Runs ``fn``; reports its error and whether ``dm`` kept its state."""
    if dm is not None and before is None:
        before = _snapshot(dm)
    try:
        fn()
        error = "no error"
    except (TfsmpError, ValueError, TypeError, tf.errors.OpError) as e:
        error = f"{type(e).__name__}: {e}"
        echo = failure.echo_of(e)  # a copy of another rank's failure ([Note: echoes defer])
    else:
        echo = None
    unchanged = True if dm is None else _same(before or [], _snapshot(dm))
    return {"error": error, "unchanged": unchanged, "echo_of": echo}


class _Recorder(keras.callbacks.Callback):  # type: ignore[misc]
    """Keeps the state after each finished step, so a failing step can be held against it."""

    def __init__(self, dm: tfsmp.DistributedModel) -> None:
        super().__init__()
        self.dm = dm
        self.last = _snapshot(dm)

    def on_train_batch_end(self, batch: int, logs: object = None) -> None:
        self.last = _snapshot(self.dm)


def _fit_outcome(dm: tfsmp.DistributedModel, data: Any, **kwargs: Any) -> Outcome:
    """fit() on ``data``; unchanged = the state after the last good step is the final state."""
    rec = _Recorder(dm)
    result = _outcome(None, lambda: dm.fit(data, epochs=1, verbose=0, callbacks=[rec], **kwargs))
    result["unchanged"] = _same(rec.last, _snapshot(dm))
    return result


# -- data ---------------------------------------------------------------------------------------

def case_data(ctx: Any) -> dict[str, Outcome]:
    _init()
    x, y = _data()
    dm = _dm()
    dm.train_on_batch(x[:BATCH], y[:BATCH])  # partitioned and traced
    spec = (tf.TensorSpec((None, 8), tf.float32), tf.TensorSpec((None, 1), tf.float32))

    def changing() -> Iterator[tuple[np.ndarray, np.ndarray]]:
        yield x[:BATCH], y[:BATCH]
        yield x[BATCH:2 * BATCH], y[BATCH:2 * BATCH]
        wide, _ = _data(BATCH, features=9)
        yield wide, y[:BATCH]

    ragged = tf.data.Dataset.from_tensor_slices((x[:58], y[:58])).batch(BATCH)
    two = [x[:BATCH], x[:BATCH]]
    checks: list[tuple[str, Callable[[], Outcome]]] = [
        ("shape_changes_between_batches",
         lambda: _fit_outcome(dm, changing(), steps_per_epoch=3)),
        ("string_inputs", lambda: _outcome(dm, lambda: dm.train_on_batch(
            np.full((BATCH, 8), "a"), y[:BATCH]))),
        ("too_many_inputs", lambda: _outcome(dm, lambda: dm.train_on_batch(two, y[:BATCH]))),
        ("no_targets", lambda: _outcome(dm, lambda: dm.train_on_batch(x[:BATCH]))),
        ("ragged_inputs", lambda: _outcome(dm, lambda: dm.train_on_batch(
            tf.RaggedTensor.from_tensor(x[:BATCH], lengths=[8] * (BATCH - 1) + [7]), y[:BATCH]))),
        ("sparse_inputs", lambda: _outcome(dm, lambda: dm.train_on_batch(
            tf.sparse.from_dense(x[:BATCH]), y[:BATCH]))),
        ("sparse_inputs_to_predict", lambda: _outcome(dm, lambda: dm.predict(
            tf.sparse.from_dense(x[:BATCH]), verbose=0))),
        ("optional_input_none", lambda: _optional_input_none(x, y)),
        ("validation_split",  # arrays only, as in Keras (tests/mpi/test_fit_parity.py)
         lambda: _outcome(dm, lambda: dm.fit(ragged, validation_split=0.2, verbose=0))),
        ("class_weight", lambda: _outcome(dm, lambda: dm.fit(
            x, y, class_weight={0: 1.0}, sample_weight=np.ones(len(x), np.float32), verbose=0))),
        ("unknown_fit_argument",
         lambda: _outcome(dm, lambda: dm.fit(x, y, epochz=2, verbose=0))),
        # Keras's data adapter checks the arrays' lengths before any step (issue 27)
        ("labels_longer_than_inputs", lambda: _outcome(dm, lambda: dm.fit(
            x, np.concatenate([y, y[:4]]), batch_size=BATCH, verbose=0))),
        ("labels_shorter_than_inputs", lambda: _outcome(dm, lambda: dm.fit(
            x, y[:-4], batch_size=BATCH, verbose=0))),
        ("dataset_batch_size_not_int", lambda: _fit_outcome(
            dm, tf.data.Dataset.from_generator(changing, output_signature=spec),
            batch_size="16")),
        ("metric_update_fails", lambda: _failing_metric(x, y)),
    ]
    return _run(checks)


class _FailingMetric(keras.metrics.Metric):  # type: ignore[misc]
    """A compiled metric whose update raises (Keras raises it from its train step)."""

    def __init__(self) -> None:
        super().__init__(name="failing")
        self.total = self.add_variable(shape=(), initializer="zeros", name="total")

    def update_state(self, y_true: Any, y_pred: Any, sample_weight: Any = None) -> None:
        raise ValueError("injected metric failure: this metric cannot update")

    def result(self) -> Any:
        return self.total


def _failing_metric(x: np.ndarray, y: np.ndarray) -> Outcome:
    """Only the last stage updates the compiled metrics; the other rank raises its error too,
    marked as a copy of the last stage's rank's failure."""
    dm = tfsmp.DistributedModel(_model(name="metric_net"))
    dm.compile(optimizer=keras.optimizers.SGD(1e-2), loss="mse", metrics=[_FailingMetric()])
    return _outcome(None, lambda: dm.train_on_batch(x[:BATCH], y[:BATCH]))


class _AddIfGiven(keras.layers.Layer):  # type: ignore[misc]
    def call(self, x: Any, o: Any = None) -> Any:
        return x if o is None else x + o


def _optional_input_none(x: np.ndarray, y: np.ndarray) -> Outcome:
    """A model with a Keras optional input, given None for it (Keras runs it)."""
    x_in = keras.Input((8,), name="x")
    o_in = keras.Input((8,), name="o", optional=True)
    h = keras.layers.Dense(16, name="d0")(_AddIfGiven()(x_in, o_in))
    model = keras.Model({"x": x_in, "o": o_in}, keras.layers.Dense(1, name="d1")(h))
    dm = tfsmp.DistributedModel(model)
    dm.compile(optimizer="sgd", loss="mse")
    return _outcome(None, lambda: dm.fit({"x": x, "o": None}, y, batch_size=BATCH, verbose=0))


def _run(checks: list[tuple[str, Callable[[], Outcome]]]) -> dict[str, Outcome]:
    """Runs the checks in order; the name goes to stderr first, so a hang names its check."""
    out = {}
    for name, check in checks:
        print(f"bad input check: {name}", file=sys.stderr, flush=True)
        start = time.monotonic()
        out[name] = check()
        out[name]["seconds"] = round(time.monotonic() - start, 3)
    return out


def case_lengths_differ(ctx: Any) -> dict[str, Outcome]:
    """Targets or weights of another length: only the last stage's loss would notice."""
    _init()
    x, y = _data()
    dm = _dm()
    dm.train_on_batch(x[:BATCH], y[:BATCH])
    return _run([
        ("targets_batch_differs",
         lambda: _outcome(dm, lambda: dm.train_on_batch(x[:BATCH], y[:12]))),
        ("sample_weight_batch_differs", lambda: _outcome(dm, lambda: dm.train_on_batch(
            x[:BATCH], y[:BATCH], sample_weight=np.ones(12, np.float32)))),
    ])


def case_not_compiled(ctx: Any) -> dict[str, Outcome]:
    _init()
    x, y = _data()
    dm = tfsmp.DistributedModel(_model())
    return _run([("fit_before_compile", lambda: _outcome(None, lambda: dm.fit(x, y, verbose=0)))])


class _Shapeless(keras.layers.Layer):  # type: ignore[misc]
    """Claims an output length that no input shape determines (as a value-dependent op would)."""

    def call(self, x: Any) -> Any:
        return x

    def compute_output_shape(self, shape: Any) -> Any:
        return (shape[0], None)


def case_unknown_boundary_shape(ctx: Any) -> dict[str, Outcome]:
    """A tensor crossing the stages whose length no input shape determines: both ranks refuse
    the step (lengths that follow from the input shapes are resolved: test_dynamic_shapes.py)."""
    _init(microbatches=1)
    x = keras.Input((None,), name="tokens", dtype="int32")
    h = keras.layers.Embedding(20, 4, name="emb")(_Shapeless(name="shapeless")(x))
    h = keras.layers.Dense(4, name="mix")(h)  # per token: every tensor a cut can cross is unknown
    model = keras.Model(x, keras.layers.Dense(1, name="out")(h))
    dm = tfsmp.DistributedModel(model)
    dm.compile(optimizer="sgd", loss="mse")
    tokens = np.ones((4, 6), np.int32)
    return _run([("boundary_shape_unknown", lambda: _outcome(
        None, lambda: dm.train_on_batch(tokens, np.zeros((4, 6, 1), np.float32))))])


# -- checkpoints --------------------------------------------------------------------------------

def _root() -> str:
    return os.path.join(os.environ["TFSMP_BAD_INPUT_DIR"], "ckpts")


def _manager(dm: tfsmp.DistributedModel, directory: str) -> Any:
    return tfsmp.CheckpointManager(tf.train.Checkpoint(model=dm, optimizer=dm.optimizer),
                                   directory=directory)


def _variant(src: str, name: str, damage: Callable[[str, dict[str, Any]], None]) -> str:
    """A copy of checkpoint ``src`` under ``<root>/<name>/ckpt-1``, damaged by rank 0."""
    dst = os.path.join(_root(), name, "ckpt-1")
    if tfsmp.rank() == 0:
        shutil.copytree(src, dst)
        with open(os.path.join(dst, "manifest.json")) as f:
            manifest = json.load(f)
        damage(dst, manifest)
    tfsmp.barrier()
    return os.path.dirname(dst)


def _last_stage_file(path: str, manifest: dict[str, Any]) -> str:
    last = max(manifest["stages"].values())
    key = next(k for k, s in sorted(manifest["stages"].items()) if s == last and "kernel" in k)
    return os.path.join(path, manifest["variables"][key]["file"])


def _write_manifest(path: str, manifest: Any) -> None:
    with open(os.path.join(path, "manifest.json"), "w") as f:
        json.dump(manifest, f)


def _truncate(path: str, manifest: dict[str, Any]) -> None:
    file = _last_stage_file(path, manifest)
    with open(file, "r+b") as f:
        f.truncate(os.path.getsize(file) - 8)


def _flip(path: str, manifest: dict[str, Any]) -> None:
    with open(_last_stage_file(path, manifest), "r+b") as f:
        f.seek(-4, os.SEEK_END)
        f.write(b"\x00\x01\x02\x03")


def _remove(path: str, manifest: dict[str, Any]) -> None:
    os.remove(_last_stage_file(path, manifest))


def _not_json(path: str, manifest: dict[str, Any]) -> None:
    with open(os.path.join(path, "manifest.json"), "w") as f:
        f.write('{"format": "tfsmp-checkpoint", "variables": {')


def _foreign(path: str, manifest: dict[str, Any]) -> None:
    _write_manifest(path, {**manifest, "format": "orbax"})


def _newer(path: str, manifest: dict[str, Any]) -> None:
    _write_manifest(path, {**manifest, "format_version": 99})


def _escape(path: str, manifest: dict[str, Any]) -> None:
    key = next(iter(sorted(manifest["variables"])))
    manifest["variables"][key]["file"] = "../../../../etc/passwd"
    _write_manifest(path, manifest)


def case_checkpoints(ctx: Any) -> dict[str, Outcome]:
    _init(partitions=2)
    x, y = _data()
    dm = _dm()
    dm.train_on_batch(x[:BATCH], y[:BATCH])
    good = _manager(dm, os.path.join(_root(), "good")).save()
    saved = os.path.dirname(good)
    other = _dm()  # a fresh model of the same architecture, partitioned, one step trained
    other.train_on_batch(x[BATCH:2 * BATCH], y[BATCH:2 * BATCH])
    wide, deeper = _dm(width=32), _dm(extra=True)
    for model in (wide, deeper):
        model.train_on_batch(x[:BATCH], y[:BATCH])
    damages = {"truncated_array": _truncate, "checksum_mismatch": _flip, "missing_array": _remove,
               "manifest_not_json": _not_json, "foreign_manifest": _foreign,
               "newer_format_version": _newer, "path_outside_checkpoint": _escape}
    roots = {name: _variant(good, name, damage) for name, damage in damages.items()}
    tf_dir = os.path.join(_root(), "tf_native")
    weights = os.path.join(_root(), "wide.weights.h5")
    text = os.path.join(_root(), "notes.weights.h5")
    wide.save_weights(weights)
    if tfsmp.rank() == 0:
        tf.train.Checkpoint(v=tf.Variable(1.0)).save(os.path.join(tf_dir, "ckpt"))
        with open(text, "w") as f:
            f.write("not an HDF5 file")
    tfsmp.barrier()

    def restore(model: tfsmp.DistributedModel, root: str, prefix: str | None = None
                ) -> Callable[[], Outcome]:
        return lambda: _outcome(model, lambda: _manager(model, root).restore(prefix))

    checks = [(name, restore(other, root)) for name, root in roots.items()]
    checks += [
        ("tensorflow_checkpoint", restore(other, tf_dir, os.path.join(tf_dir, "ckpt-1"))),
        ("wrong_shapes", restore(wide, saved)),
        ("missing_variable", restore(deeper, saved)),
        ("weights_file_wrong_shapes",
         lambda: _outcome(other, lambda: other.load_weights(weights))),
        ("weights_file_not_hdf5", lambda: _outcome(other, lambda: other.load_weights(text))),
    ]
    return _run(checks)


# -- a replica that runs out of data (p=1, d=2) -----------------------------------------------

def case_replica_runs_out(ctx: Any) -> dict[str, Outcome]:
    _init(partitions=1, microbatches=2)
    x, y = _data()
    dm = _dm()
    dm.train_on_batch(x[:BATCH], y[:BATCH])
    steps = 2 if tfsmp.dp_rank() == 1 else 4  # replica 1's shard is shorter

    def shard() -> Iterator[tuple[np.ndarray, np.ndarray]]:
        for i in range(steps):
            yield x[i * BATCH:(i + 1) * BATCH], y[i * BATCH:(i + 1) * BATCH]

    return _run([("replica_runs_out_of_data", lambda: _fit_outcome(dm, shard()))])
