"""Plain-Keras files from a partitioned model, and pretrained Keras weights into one.

Example::

    dm.load_weights("pretrained.weights.h5")   # each rank reads only its stages' weights
    dm.fit(x, y, epochs=3)
    dm.save("finetuned.keras")                 # every rank calls; world rank 0 writes
    keras.models.load_model("finetuned.keras") # plain Keras, one process: same predictions
    dm.save_model("/opt/ml/model")             # TF SavedModel, signatures["serving_default"]

Writing, roughly: every rank records the Keras weights layout of the whole model (no reads,
see [Note: Keras weights layout] in `keras_h5`); data rank 0 of each pipeline rank sends its
stages' arrays to world rank 0 one variable at a time, which writes each as it arrives, so it
never holds more than its own stages' and one other variable ([Note: streaming export]). Reading: each rank opens the file and reads only the
datasets of the variables it holds. Loads requested before the model is partitioned are kept
and applied by `apply_pending` right after partitioning, on every rank, before the first step.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import tempfile
import warnings
import weakref
from collections.abc import Callable
from typing import Any

import keras
import numpy as np

from tfsmp.checkpoint import checksum, keras_h5, keras_optimizer
from tfsmp.checkpoint.keras_h5 import Entry, H5Layout
from tfsmp.comm import collective_label
from tfsmp.errors import CheckpointError

__all__ = ["apply_pending", "archive_bytes", "check_overwrite", "export_model", "fresh_instance",
           "load_weights", "save",
           "save_keras", "save_legacy_h5", "save_model", "save_weights"]

_TAG = 0x7C4B  # message tag of the gather to world rank 0 (its own tag, never a pipeline one)
_PENDING: weakref.WeakKeyDictionary[Any, list[tuple[Callable[[Any], object], bool]]] = (
    weakref.WeakKeyDictionary())
# dtypes of the first batch: a list, or {input name: dtype} for a dict batch
_FED: weakref.WeakKeyDictionary[Any, list[str] | dict[str, str]] = weakref.WeakKeyDictionary()
_LAST_READ: list[str] = []  # datasets this process read in its last load (tests check partial reads)


def last_read() -> list[str]:
    """The weights-file datasets this process read in its most recent `load_weights`."""
    return list(_LAST_READ)


# -- pending work ------------------------------------------------------------------------------

def defer(dm: Any, fn: Callable[[Any], object], weights: bool = True) -> None:
    """Runs ``fn(dm)`` in `apply_pending`, right after ``dm`` is partitioned.

    ``weights``: whether ``fn`` assigns model weights (then a weights file written before
    partitioning would miss them, and `save` refuses)."""
    _PENDING.setdefault(dm, []).append((fn, weights))


def has_pending(dm: Any, weights_only: bool = False) -> bool:
    return any(w or not weights_only for _, w in _PENDING.get(dm, ()))


def apply_pending(dm: Any) -> None:
    """Applies the loads and restores requested before partitioning, in call order.

    `DistributedModel` calls this on every rank right after building its engine.
    """
    work = _PENDING.pop(dm, [])
    for fn, _ in work:
        fn(dm)


def remember_inputs(dm: Any, sample_x: Any) -> None:
    """Keeps the dtypes of the first batch: `save_model`'s serving signature takes them, as SMP's
    did (SMP scripts feed ``x / 255.0``, float64, to a float32 model)."""
    import tensorflow as tf

    def dtype(t: Any) -> str:
        kind = getattr(t, "dtype", None) or "float32"
        if isinstance(kind, np.dtype) and kind.kind in "OSU":
            return "string"  # NumPy's arrays of bytes or str: TensorFlow's strings
        return str(keras.backend.standardize_dtype(kind))

    if isinstance(sample_x, dict):  # by input name: flattening would sort the keys
        _FED[dm] = {str(k): dtype(v) for k, v in sample_x.items() if not isinstance(v, dict)}
    else:
        _FED[dm] = [dtype(t) for t in tf.nest.flatten(sample_x)]


# -- who holds what ------------------------------------------------------------------------------

def _skip(dm: Any) -> tuple[Any, ...]:
    """What a weights file of the model leaves out: the (partitioned) optimizer."""
    return (getattr(dm, "optimizer", None),)


def _layout(dm: Any) -> H5Layout:
    return keras_h5.record_layout(dm.source_model(), skip=_skip(dm))


def _owners(dm: Any, layout: H5Layout) -> dict[int, int]:
    """``{entry index: world rank that sends it}``; entries absent are computed on rank 0."""
    view = dm.rank_view
    if view is None:
        return {}
    out: dict[int, int] = {}
    for i, e in enumerate(layout.entries):
        held = ([e.value] if isinstance(e.value, keras.Variable)
                else list(getattr(e.layer, "weights", None) or ()))  # [Note: computed entries]
        for v in held:
            key = view.keys.get(id(v))
            if key is not None and key in view.writer:
                out[i] = view.writer[key]  # [Note: one writer per key] in tfsmp/runtime/view.py
                break
    return out


def _value(entry: Entry) -> np.ndarray:
    value = entry.value.value if isinstance(entry.value, keras.Variable) else entry.value
    return np.asarray(keras.ops.convert_to_numpy(value))


def _wire(array: np.ndarray) -> np.ndarray:
    """The array's bytes as a flat uint8 view MPI can move (any dtype, bfloat16 included)."""
    return np.ascontiguousarray(array).reshape(-1).view(np.uint8)


def _empty(shape: tuple[int, ...], dtype_name: str) -> np.ndarray:
    """An array of the sender's shape and dtype (its header): the receiver may hold nothing of
    the entry (another rank's optimizer slot is ``None`` on world rank 0)."""
    import ml_dtypes

    dtype = (np.dtype(getattr(ml_dtypes, dtype_name)) if dtype_name == "bfloat16"
             else np.dtype(dtype_name))
    return np.empty(shape, dtype=dtype)


def _send_mine(dm: Any, layout: H5Layout, owners: dict[int, int]) -> None:
    """[Note: streaming export] Sends this rank's arrays to world rank 0 one variable at a
    time, each after a small header (its shape and dtype, or the error that kept it from being
    read), so neither side holds more than one variable beyond its own stages: gathering a
    rank's stages in one message held them twice on the sender and on world rank 0, which also
    holds its own, more than a rank near its memory cap has."""
    world = dm.runtime_state().comm.world
    for i in sorted(i for i, r in owners.items() if r == world.rank):
        try:
            value = _value(layout.entries[i])
            array: np.ndarray | None = value
            header: tuple[tuple[int, ...], str] | str = (tuple(value.shape), str(value.dtype))
        except Exception as e:  # rank 0 must hear of it, or it waits forever
            array, header = None, f"{type(e).__name__}: {e}"
        world.send_obj(header, 0, _TAG)
        if array is not None:
            world.isend(_wire(array), 0, _TAG).wait()
        del array


def _receive(world: Any, rank: int) -> np.ndarray | str:
    """World rank 0: one variable from ``rank`` ([Note: streaming export]), or its error."""
    header = world.recv_obj(rank, _TAG)
    if isinstance(header, str):
        return f"rank {rank}: {header}"
    array = _empty(*header)
    world.irecv(_wire(array), rank, _TAG).wait()
    return array


def _write_all(dm: Any, layout: H5Layout, owners: dict[int, int], path: str,
               attrs: dict[str, str] | None = None) -> list[str]:
    """World rank 0: writes every entry, receiving the other ranks' arrays one variable at a
    time ([Note: streaming export]).

    Always receives from every sender (they block until it does); returns the problems."""
    world = dm.runtime_state().comm.world
    errors: list[str] = []

    def put(writer: Any, e: Entry, fetch: Callable[[], Any]) -> None:
        try:
            writer.put(e, fetch())
        except Exception as ex:  # a released variable (another stage's), an unwritable file
            errors.append(f"'{e.dataset}' ({getattr(e.value, 'path', 'a tensor')}): "
                          f"{type(ex).__name__}: {ex}")

    writer: Any = None
    try:
        writer = keras_h5.WeightsWriter(path, layout, attrs=attrs)
    except Exception as ex:
        errors.append(f"{path!r} cannot be written: {ex}")
    for i, e in enumerate(layout.entries):
        if writer is not None and owners.get(i, 0) == 0:
            put(writer, e, functools.partial(_value, e))
    for rank in sorted({r for r in owners.values() if r != 0}):
        for i in sorted(i for i, r in owners.items() if r == rank):
            got = _receive(world, rank)
            if isinstance(got, str):
                errors.append(got)
            elif writer is not None:
                put(writer, layout.entries[i], functools.partial(np.asarray, got))
            del got
    if writer is not None:
        writer.close()
    return errors


def _collective_write(dm: Any, target: str, overwrite: bool,
                      finish: Callable[[str, str], None], optimizer: bool = False,
                      attrs: dict[str, str] | None = None) -> None:
    """Every rank: gathers the weights (and with ``optimizer`` the optimizer's state) to world
    rank 0, which writes a temporary weights file (root attributes ``attrs``) and calls
    ``finish(weights_file, output_path)``; errors are raised on every rank."""
    world = dm.runtime_state().comm.world
    if dm.rank_view is None and has_pending(dm, weights_only=True):
        raise CheckpointError(
            f"A model with a pending load_weights/restore can be saved once it is partitioned. "
            f"Received: save to {target!r} before the first step. Fix: run a step (or "
            f"model.partition(x)) first.")
    layout = _layout(dm)
    owners = _owners(dm, layout)
    if optimizer:
        layout, owners = _with_optimizer(dm, layout, owners)
    tmpdir = _root_prepare(target, overwrite) if world.rank == 0 else None
    ready = world.bcast_obj(tmpdir, root=0)
    if isinstance(ready, CheckpointError):
        raise ready
    outcome: str | None = None
    if world.rank != 0:
        if world.rank in owners.values():
            _send_mine(dm, layout, owners)
    else:
        outcome = _root_finish(dm, layout, owners, target, str(tmpdir), finish, attrs)
    outcome = world.bcast_obj(outcome, root=0)
    if outcome is not None:
        raise CheckpointError(outcome)


def _with_optimizer(dm: Any, layout: H5Layout, owners: dict[int, int]
                    ) -> tuple[H5Layout, dict[int, int]]:
    """``layout`` and ``owners`` plus the optimizer's ``optimizer/vars/<i>`` entries, each valued
    with this rank's variable where it holds one ([Note: Keras optimizer layout] in
    keras_optimizer). A collective call; an optimizer tfsmp cannot lay out is left out (with a
    warning) on every rank alike."""
    optimizer, view = getattr(dm, "optimizer", None), dm.rank_view
    if optimizer is None or view is None:  # the same on every rank
        return layout, owners
    world = dm.runtime_state().comm.world
    problem: str | None = None
    steps: int | None = None
    try:
        groups, datasets = keras_optimizer.keras_groups(dm)
        slots, globals_ = keras_optimizer.local_state(dm)
        steps = int(keras.ops.convert_to_numpy(optimizer.iterations))
    except Exception as e:  # every rank must decide alike
        problem = f"{type(e).__name__}: {e}"
    everyone = world.allgather_obj((steps, problem))
    problems = [p for _, p in everyone if p is not None]
    if problems:
        warnings.warn(f"The weights file holds no optimizer state: {problems[0]}", stacklevel=4)
        return layout, owners
    counts = [int(s) for s, _ in everyone]
    globals_rank = counts.index(max(counts))  # a rank that trains nothing never steps
    entries, owners = list(layout.entries), dict(owners)
    for group, key, (kind, name) in datasets:  # optimizer/vars, then any sub-optimizer's group
        local = slots.get(name) if kind == "slot" else globals_.get(name)
        # a slot's writer holds it: with sharded optimizer state, its owner ([Note: optimizer
        # shards] in tfsmp/partitioning/shards.py)
        writer = view.slot_writer or view.writer
        owners[len(entries)] = writer[name[0]] if kind == "slot" else globals_rank
        entries.append(Entry(group, key, local))
    return H5Layout([*layout.groups, *groups], entries), owners


def _root_prepare(target: str, overwrite: bool) -> str | CheckpointError:
    if os.path.exists(target) and not overwrite:
        return CheckpointError(
            f"The file must not exist when overwrite=False. Received: {target!r} exists. Pass "
            f"overwrite=True or another path.")
    try:
        folder = os.path.dirname(os.path.abspath(target))
        os.makedirs(folder, exist_ok=True)
        return tempfile.mkdtemp(prefix=".tfsmp-save-", dir=folder)
    except OSError as e:
        return CheckpointError(f"The target directory must be writable. Received: {target!r} "
                               f"({e}). Pass a writable path.")


def _root_finish(dm: Any, layout: H5Layout, owners: dict[int, int], target: str, tmpdir: str,
                 finish: Callable[[str, str], None], attrs: dict[str, str] | None = None
                 ) -> str | None:
    try:
        weights = os.path.join(tmpdir, keras_h5.WEIGHTS_NAME)
        errors = _write_all(dm, layout, owners, weights, attrs)
        if errors:
            more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
            return (f"Every weight must be readable by the rank that holds it. Received: "
                    f"{errors[0]}{more}.")
        out = os.path.join(tmpdir, "out")
        finish(weights, out)
        os.replace(out, target)  # readers see the old file or the new one, never half of one
        return None
    except Exception as e:  # reported on every rank
        return f"{type(e).__name__}: {e}"
    finally:
        shutil.rmtree(tmpdir, ignore_errors=True)


@collective_label("DistributedModel.save_weights")
def save_weights(dm: Any, filepath: str, overwrite: bool = True) -> None:
    """Writes a standard Keras ``.weights.h5`` of the whole model (every rank calls).

    As ``keras.Model.save_weights``, the file holds the optimizer's state too (``optimizer/vars``,
    in Keras's order: [Note: Keras optimizer layout] in keras_optimizer), so a plain-Keras model
    loads it with its optimizer state. Written during ``fit``, it also records the training
    position ([Note: Keras's BackupAndRestore] in fit_resume).

    Raises:
        ValueError: ``filepath`` does not end in ``.weights.h5``.
        CheckpointError: the file exists and ``overwrite`` is False, or writing failed.
    """
    path = os.fspath(filepath)
    if not str(path).endswith(".weights.h5"):
        raise ValueError(
            f"The filename must end in `.weights.h5`. Received: filepath={path}. Use "
            f"model.save('m.keras') for the whole model.")

    def finish(weights: str, out: str) -> None:
        shutil.move(weights, out)

    from tfsmp.checkpoint import fit_resume

    position = fit_resume.current_position(dm)
    attrs = {fit_resume.POSITION_ATTR: json.dumps(position)} if position else None
    _collective_write(dm, str(path), overwrite, finish, optimizer=True, attrs=attrs)


@collective_label("DistributedModel.save")
def save(dm: Any, filepath: str, overwrite: bool = True, **kwargs: Any) -> None:
    """`DistributedModel.save`: ``.keras`` (whole model), ``.weights.h5`` (weights) or
    ``.h5``/``.hdf5`` (Keras's legacy HDF5 model file, as ``keras.Model.save`` writes it).

    Every rank calls it; world rank 0 writes a file that plain ``keras.models.load_model``
    opens in one process, as ``keras.Model.save`` writes it: a ``.keras`` file keeps the
    compile arguments and (``include_optimizer``, default True) the optimizer's state, so the
    loaded model evaluates and trains on as the saved one would.

    Raises:
        ValueError: another extension or unsupported arguments.
        CheckpointError: the file exists and ``overwrite`` is False, or writing failed.
    """
    path = str(os.fspath(filepath))
    unknown = set(kwargs) - {"zipped", "include_optimizer"}
    if unknown or kwargs.get("zipped", True) is False:
        raise ValueError(
            f"DistributedModel.save writes a zipped .keras file. Received: unsupported "
            f"arguments {sorted(unknown) or ['zipped=False']}. Drop them.")
    include_optimizer = bool(kwargs.get("include_optimizer", True))
    if path.endswith(".weights.h5"):
        save_weights(dm, path, overwrite)
        return
    if path.endswith((".h5", ".hdf5")):
        save_legacy_h5(dm, path, overwrite, include_optimizer)
        return
    if not path.endswith(".keras"):
        raise ValueError(
            f"DistributedModel.save needs a path ending in `.keras` (whole model), `.h5` "
            f"(legacy HDF5 model) or `.weights.h5` (weights only). Received: filepath={path}. "
            f"For a TensorFlow SavedModel call model.save_model(directory); to resume training "
            f"use tfsmp.CheckpointManager.")
    save_keras(dm, path, overwrite, include_optimizer)


def _archive_finish(dm: Any) -> tuple[Callable[[str, str], None], bool]:
    """What turns a weights file into the model's ``.keras`` archive (``finish`` of
    `_collective_write`), and whether the model is compiled (its file then holds the compile
    arguments, as Keras writes a compiled model's)."""
    source = dm.source_model()
    compile_config = dm.get_compile_config() if getattr(dm, "compiled", False) else None

    def finish(weights: str, out: str) -> None:
        keras_h5.write_keras_archive(out, source, weights, compile_config=compile_config)

    return finish, compile_config is not None


@collective_label("DistributedModel.save")
def save_keras(dm: Any, path: str, overwrite: bool = True, include_optimizer: bool = True
               ) -> None:
    """Writes the whole model as the ``.keras`` file ``keras.Model.save`` would write of the
    unpartitioned model (every rank calls; world rank 0 writes)."""
    finish, compiled = _archive_finish(dm)
    _collective_write(dm, path, overwrite, finish, optimizer=compiled and include_optimizer)


@collective_label("DistributedModel.save")
def archive_bytes(dm: Any, include_optimizer: bool = True) -> bytes:
    """The model's ``.keras`` archive (as `save_keras` writes it) as bytes, on every rank: for
    a file object handed to Keras's ``save_model``, and for pickling. Once the model is
    partitioned this is a collective call (the weights are gathered to world rank 0, which
    broadcasts the archive); before, every rank holds every weight and writes it alone."""
    finish, compiled = _archive_finish(dm)
    world = dm.runtime_state().comm.world if dm.rank_view is not None else None
    tmpdir = tempfile.mkdtemp(prefix=".tfsmp-archive-") if world is None or world.rank == 0 else ""
    target = os.path.join(tmpdir, "model.keras") if tmpdir else "unused.keras"
    try:
        if world is None:
            if has_pending(dm, weights_only=True):
                raise CheckpointError(
                    "A model with a pending load_weights/restore can be saved once it is "
                    "partitioned. Received: a save before the first step. Fix: run a step (or "
                    "model.partition(x)) first.")
            error = _root_finish(dm, _layout(dm), {}, target, _private_dir(tmpdir), finish)
            if error is not None:
                raise CheckpointError(error)
        else:
            _collective_write(dm, target, True, finish,
                              optimizer=compiled and include_optimizer)
        data = _read_bytes(target) if tmpdir else None
        if world is not None:
            data = world.bcast_obj(data, root=0)
        return bytes(data or b"")
    finally:
        if tmpdir:
            shutil.rmtree(tmpdir, ignore_errors=True)


def _private_dir(folder: str) -> str:
    return tempfile.mkdtemp(prefix=".tfsmp-save-", dir=folder)


def _read_bytes(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


@collective_label("DistributedModel.save")
def check_overwrite(dm: Any, path: str) -> None:
    """Raises on every rank when ``path`` exists (``overwrite=False``); world rank 0 looks."""
    world = dm.runtime_state().comm.world
    exists = os.path.exists(path) if world.rank == 0 else None
    if world.bcast_obj(exists, root=0):
        raise CheckpointError(
            f"The file must not exist when overwrite=False. Received: {path!r} exists. Pass "
            f"overwrite=True or another path.")


@collective_label("DistributedModel.save")
def save_legacy_h5(dm: Any, path: str, overwrite: bool = True, include_optimizer: bool = True
                   ) -> None:
    """What ``keras.Model.save("m.h5")`` writes (Keras 3.15: ``legacy_h5_format``), from a
    single-process copy of the model on world rank 0."""

    def finish(weights: str, out: str) -> None:
        copy = _standalone_copy(dm, weights)
        legacy = out + ".h5"  # Keras picks the format by extension
        keras.saving.save_model(copy, legacy, overwrite=True, include_optimizer=False)
        if include_optimizer:
            _write_training_config(dm, copy, legacy)
        os.replace(legacy, out)

    _collective_write(dm, path, overwrite, finish)


def _write_training_config(dm: Any, copy: keras.Model, h5_path: str) -> None:
    """Adds the compile arguments (loss, metrics, optimizer config) Keras stores in an HDF5 file,
    so ``load_model`` compiles the model; the optimizer's variables are not stored. Left out, with
    a warning, when Keras could not read them back (e.g. ``loss="mse"`` in Keras 3.15)."""
    import json

    import h5py
    from keras.src.legacy.saving import saving_options, saving_utils

    compile_config = getattr(dm, "_compile_config", None)
    if compile_config is None or getattr(dm, "optimizer", None) is None:
        return
    try:
        config = dict(compile_config.config)
        config["optimizer"] = keras.optimizers.deserialize(keras.optimizers.serialize(dm.optimizer))
        copy.compile(**config)
        with saving_options.keras_option_scope(use_legacy_config=True):
            training = saving_utils.model_metadata(copy, include_optimizer=True)["training_config"]
        saving_utils.compile_args_from_training_config(training)  # what load_model will do
    except Exception as e:
        warnings.warn(f"The HDF5 file holds no compile arguments: Keras could not read them back "
                      f"({type(e).__name__}: {e}). Compile the loaded model, or save to `.keras`.",
                      stacklevel=5)
        return
    from keras.src.legacy.saving import json_utils

    with h5py.File(h5_path, "a") as f:
        f.attrs["training_config"] = json.dumps(
            training, default=json_utils.get_json_type).encode("utf8")


# -- loading pretrained weights -----------------------------------------------------------------

def _check_weights_path(path: str) -> None:
    if path.endswith(".weights.json"):
        raise ValueError(
            f"Sharded weights are not supported. Received: filepath={path}. Save unsharded "
            f"(model.save_weights('w.weights.h5')).")
    if not path.endswith((".weights.h5", ".keras")):
        raise ValueError(
            f"load_weights reads Keras files ending in `.weights.h5` or `.keras`. Received: "
            f"filepath={path}. To resume a tfsmp checkpoint use CheckpointManager.restore().")
    if not os.path.isfile(path):
        raise CheckpointError(
            f"The weights file must exist. Received: filepath={path!r}. Check the path.")


@collective_label("DistributedModel.load_weights")
def load_weights(dm: Any, filepath: str, skip_mismatch: bool = False) -> None:
    """Loads a Keras ``.weights.h5``/``.keras`` file; each rank reads only its own variables.

    Before partitioning the variables that exist (a built model's: all of them) are assigned at
    once, so `get_weights`, `save` and reading a variable see the loaded values; variables not
    allocated yet (a model built in `deferred_init`) are loaded right after partitioning (see
    `apply_pending`). Layer ``trainable`` flags are untouched, so frozen layers stay frozen.

    Raises:
        ValueError: another extension.
        CheckpointError: the file is missing or does not match the model (a dataset missing,
            another shape or another number of weights in a layer), raised on every rank before
            any variable changes. With ``skip_mismatch`` those variables are skipped instead.
    """
    path = str(os.fspath(filepath))
    _check_weights_path(path)
    if dm.rank_view is not None:
        _load_now(dm, path, skip_mismatch)
        return
    done = _load_now(dm, path, skip_mismatch)
    if any(isinstance(e.value, keras.Variable) and id(e.value) not in done
           for e in _layout(dm).entries):
        defer(dm, lambda m: _load_now(m, path, skip_mismatch, exclude=done, optimizer=False))
    if getattr(dm, "optimizer", None) is not None:  # its slots exist once partitioned
        defer(dm, lambda m: _load_optimizer_now(m, path), weights=False)


def _held_entries(dm: Any, layout: H5Layout, exclude: frozenset[int] = frozenset()
                  ) -> list[tuple[Entry, Any]]:
    """Entries of the variables this rank holds: after partitioning its stages', before it every
    allocated one; less ``exclude`` (ids of variables loaded already)."""
    from tfsmp.graph.deferred import is_deferred

    view = dm.rank_view
    if view is None:
        return [(e, e.value) for e in layout.entries if isinstance(e.value, keras.Variable)
                and not is_deferred(e.value) and id(e.value) not in exclude]
    held = {id(v) for v in view.held_variables().values()} - exclude
    return [(e, e.value) for e in layout.entries
            if isinstance(e.value, keras.Variable) and id(e.value) in held]


def _read_held(path: str, entries: list[tuple[Entry, Any]], layout: H5Layout,
               skip_mismatch: bool) -> tuple[list[tuple[Any, np.ndarray]], list[str], list[str]]:
    """(variable, value) pairs to assign, errors, and skipped-variable warnings."""
    _LAST_READ.clear()
    counts: dict[str, int] = {}
    for e in layout.entries:
        counts[e.group] = counts.get(e.group, 0) + 1
    out: list[tuple[Any, np.ndarray]] = []
    problems: list[str] = []
    with keras_h5.open_weights(path) as h5:
        for entry, v in entries:
            size = keras_h5.group_size(h5, entry.group)
            if size is not None and size != counts[entry.group]:
                problems.append(
                    f"Layer weights must match in number. Received: '{entry.group}' in {path!r} "
                    f"has {size} weights, the model's layer has {counts[entry.group]} "
                    f"(variable '{v.path}').")
                continue
            if not keras_h5.has_entry(h5, entry):
                problems.append(
                    f"Every model weight must be in the file. Received: '{entry.dataset}' "
                    f"(variable '{v.path}') is missing from {path!r}.")
                continue
            value = keras_h5.read_entry(h5, entry, path)
            if tuple(value.shape) != tuple(v.shape):
                problems.append(
                    f"Weight shapes must match. Received: '{entry.dataset}' in {path!r} has "
                    f"shape {tuple(value.shape)}, variable '{v.path}' has {tuple(v.shape)}.")
                continue
            out.append((v, value))
            _LAST_READ.append(entry.dataset)
    if skip_mismatch:
        return out, [], problems
    return out, problems, []


def _load_now(dm: Any, path: str, skip_mismatch: bool, exclude: frozenset[int] = frozenset(),
              optimizer: bool = True) -> frozenset[int]:
    """Reads and assigns the held variables, and once partitioned (``optimizer``) the
    optimizer's state the file holds (a collective call); returns the ids of the model
    variables it handled (assigned, or skipped with ``skip_mismatch``)."""
    world = dm.runtime_state().comm.world
    layout = _layout(dm)
    entries = _held_entries(dm, layout, exclude)
    errors: list[str] = []
    skipped: list[str] = []
    values: list[tuple[Any, np.ndarray]] = []
    notes: list[str] = []
    try:
        values, errors, skipped = _read_held(path, entries, layout, skip_mismatch)
        if optimizer and not errors:
            try:
                slots, notes = _read_optimizer(dm, path)
                values += slots
            except CheckpointError as e:  # with skip_mismatch, the optimizer's state is skipped
                if not skip_mismatch:
                    raise
                notes = [f"Skipped the optimizer's state while loading weights: {e}"]
    except Exception as e:  # every rank must learn of it before anyone assigns
        errors = [checksum.gatherable(e)]
    everyone = [e for part in world.allgather_obj(errors) for e in part]
    checksum.raise_gathered(everyone)  # an unreadable file: an OSError, no skip_mismatch advice
    if everyone:
        more = f" (and {len(everyone) - 1} more)" if len(everyone) > 1 else ""
        raise CheckpointError(everyone[0] + more + " Pass skip_mismatch=True to skip them.")
    for message in skipped:
        warnings.warn(f"Skipped while loading weights: {message}", stacklevel=3)
    for message in notes:
        warnings.warn(message, stacklevel=3)
    for v, value in values:
        v.assign(value)
    return frozenset(id(v) for _, v in entries)


def load_optimizer_later(dm: Any, archive: bytes) -> None:
    """Once ``dm`` is partitioned, loads the optimizer's state of a ``.keras`` archive held in
    memory (an unpickled model's), each rank its own variables."""
    defer(dm, lambda m: _load_optimizer_now(m, archive), weights=False)


def _load_optimizer_now(dm: Any, path: str | bytes) -> None:
    """Reads and assigns the optimizer's state of a weights file loaded before partitioning."""
    world = dm.runtime_state().comm.world
    errors: list[str] = []
    values: list[tuple[Any, np.ndarray]] = []
    notes: list[str] = []
    try:
        values, notes = _read_optimizer(dm, path)
    except Exception as e:
        errors = [checksum.gatherable(e)]
    everyone = [e for part in world.allgather_obj(errors) for e in part]
    checksum.raise_gathered(everyone)
    if everyone:
        raise CheckpointError(everyone[0])
    for message in notes:
        warnings.warn(message, stacklevel=3)
    for v, value in values:
        v.assign(value)


def _read_optimizer(dm: Any, source: str | bytes
                    ) -> tuple[list[tuple[Any, np.ndarray]], list[str]]:
    """The optimizer variables this rank holds with their values in ``source`` (a path, or a
    ``.keras`` archive as bytes; nothing when it has no optimizer state, or the model is not
    partitioned yet), and Keras's warning when the file's optimizer has another number of
    variables ([Note: Keras optimizer layout])."""
    optimizer = getattr(dm, "optimizer", None)
    if optimizer is None or dm.rank_view is None:
        return [], []
    path = source if isinstance(source, str) else "an archive in memory"
    out: list[tuple[Any, np.ndarray]] = []
    with keras_h5.open_weights(source) as h5:
        size = keras_h5.group_size(h5, keras_optimizer.GROUP)
        if size is None:
            return [], []
        order = keras_optimizer.keras_order(dm)
        if size != len(order):  # Keras's own words and behaviour (load_own_variables)
            return [], [f"Skipping variable loading for optimizer '{optimizer.name}', because it "
                        f"has {len(order)} variables whereas the saved optimizer has {size} "
                        f"variables."]
        slots, globals_ = keras_optimizer.local_state(dm)
        for i, (kind, name) in enumerate(order):
            var = slots.get(name) if kind == "slot" else globals_.get(name)
            if var is None:  # another rank holds it
                continue
            value = keras_h5.read_entry(h5, Entry(keras_optimizer.GROUP, str(i), None), path)
            if tuple(value.shape) != tuple(var.shape):
                raise CheckpointError(
                    f"Optimizer variables must match in shape. Received: "
                    f"'{keras_optimizer.GROUP}/{i}' in {path!r} has shape {tuple(value.shape)}, "
                    f"optimizer variable '{var.path}' has {tuple(var.shape)}. Fix: load into the "
                    f"model and optimizer the file was written from.")
            out.append((var, value))
    return out, []


# -- SavedModel --------------------------------------------------------------------------------

def fresh_instance(source: keras.Model) -> keras.Model:
    """A new instance of a subclassed model's class: from its config, or (SMP's usual subclass,
    ``__init__(self)``, whose config has keys its constructor does not take) with no arguments."""
    try:
        return type(source).from_config(source.get_config())
    except TypeError as config_error:
        try:
            return type(source)()
        except TypeError:
            raise config_error from None


def _standalone_copy(dm: Any, weights_file: str) -> keras.Model:
    """A fully materialized single-process copy of the model, with the saved weights.

    A Functional/Sequential model is read back from a ``.keras`` file of its config and these
    weights; a subclassed one is re-instantiated, built by a symbolic call of its ``call`` (a
    Functional model over its layers, as the tracer does), and given the weights."""
    from keras.src.models.functional import Functional
    from keras.src.saving import saving_lib

    source = dm.source_model()
    if isinstance(source, (Functional, keras.Sequential)):
        keras_file = os.path.join(os.path.dirname(weights_file), "model.keras")
        keras_h5.write_keras_archive(keras_file, source, weights_file)
        return keras.saving.load_model(keras_file, compile=False)
    copy = fresh_instance(source)
    specs = dm.rank_view.traced.input_specs
    inputs = [keras.Input(shape=tuple(s.shape)[1:], dtype=s.dtype) for s in specs]
    args = inputs[0] if len(inputs) == 1 else inputs
    functional = keras.Model(args, copy.call(args))
    copy.built = True
    from tfsmp.checkpoint.keras_saving import keras_original

    # a copy of an SMP-style `class M(smp.DistributedModel)` is one too: Keras's own load,
    # on this rank alone (the dispatch's collective load hung world rank 0 here)
    keras_original(saving_lib.load_weights_only)(copy, weights_file)
    # the source model's weight order (the functional's follows its graph): `_assign_exact`
    object.__setattr__(functional, _SOURCE_ORDER, list(copy.weights))
    return functional


_SOURCE_ORDER = "_tfsmp_weights_in_source_order"


def _exact_weights(dm: Any) -> tuple[int, dict[int, np.ndarray]] | None:
    """[Note: an exact copy] Every rank calls: where the model's Keras weights file does not
    store some layer's weights as they are (its ``save_own_variables`` stores a value computed
    from them: a quantized layer with LoRA stores its kernel with the LoRA product merged in
    and quantized again), those layers' weights as they are, gathered ({index in
    `model_weights`: array}, with the model's weight count); else None.

    A copy loaded from that file (`_standalone_copy`) computes what plain Keras's save and load
    compute, but an export must serve what the trained model computes (plain Keras's
    ``model.export`` traces the live variables): outputs differed by ~1e-3 before. Only those
    layers' weights are gathered: a whole-model gather would hold every weight on every rank."""
    computed = [e.layer for e in _layout(dm).entries
                if not isinstance(e.value, keras.Variable) and e.layer is not None]
    if not computed:
        return None
    wanted = {id(v) for layer in computed for v in getattr(layer, "weights", ())}
    weights = dm.model_weights()
    return len(weights), dm.weights_at({i for i, v in enumerate(weights) if id(v) in wanted})


def _assign_exact(copy: keras.Model, exact: tuple[int, dict[int, np.ndarray]] | None) -> None:
    """World rank 0: the copy's weights at `_exact_weights`'s indices set to its arrays (the
    same model rebuilt from its config holds its weights in the same order)."""
    if exact is None:
        return
    count, arrays = exact
    mine = list(getattr(copy, _SOURCE_ORDER, None) or copy.weights)
    if len(mine) == count and all(
            tuple(mine[i].shape) == tuple(np.shape(a)) for i, a in arrays.items()):
        for i, a in arrays.items():
            mine[i].assign(a)
        return
    raise CheckpointError(
        f"The exported copy of the model must hold the model's weights. Received: the copy has "
        f"{len(mine)} weights, the model {count} (or their shapes differ). Fix: export a model "
        f"whose config rebuilds it (custom layers registered, get_config complete).")


def _serving_signature(dm: Any, model: keras.Model) -> list[Any] | None:
    """One ``tf.TensorSpec`` per input with the dtype of the batches the model was fed (SMP
    traced its signature from the step's arguments); None before the first step."""
    import tensorflow as tf

    fed = _FED.get(dm)
    inputs = list(getattr(model, "inputs", None) or [])
    if isinstance(fed, dict):
        names = [str(getattr(t, "name", "")).split(":")[0] for t in inputs]
        fed = [fed[n] for n in names] if all(n in fed for n in names) else None
    if not fed or len(fed) != len(inputs):
        return None
    specs = [tf.TensorSpec((None, *tuple(t.shape)[1:]), dtype=d, name=getattr(t, "name", None))
             for t, d in zip(inputs, fed)]
    return [specs[0]] if len(specs) == 1 else [specs]


@collective_label("smp.save_model")
def save_model(dm: Any, save_path: str = "/opt/ml/model") -> None:
    """SMP's `save_model`: the whole unpartitioned model as a TensorFlow SavedModel.

    Every rank calls it; world rank 0 rebuilds the model in one process and exports it, so
    ``tf.saved_model.load(save_path).signatures["serving_default"](x)["output_0"]`` serves it.
    The signature takes inputs of the dtype the model was fed (float64 when a script fed
    ``x / 255.0``), cast to the model's own input dtype inside.
    """
    from tfsmp.checkpoint.layout import resolve_sagemaker_path

    save_path = resolve_sagemaker_path(os.fspath(save_path))
    export_model(dm, str(save_path), verbose=False, input_signature=None, fed_signature=True)


@collective_label("tf.saved_model.save")
def tf_saved_model_save(dm: Any, export_dir: Any, signatures: Any = None, options: Any = None,
                        original: Callable[..., Any] | None = None) -> None:
    """``tf.saved_model.save`` of a `DistributedModel` ([Note: Keras's saving functions] in
    tfsmp/checkpoint/keras_saving.py): every rank calls it; world rank 0 rebuilds the whole
    unpartitioned model in one process with the gathered weights and runs TensorFlow's own
    ``original`` save on it, so the directory is what plain Keras would write (its
    ``serving_default`` signature included), and every rank returns once it is written.

    Raises:
        CheckpointError: ``signatures`` given (they trace the partitioned model, whose
            variables live on several ranks), before any work; or the save failed on rank 0.
    """
    if signatures is not None:
        raise CheckpointError(
            "tf.saved_model.save of a DistributedModel writes the whole model with its default "
            "serving signature: signatures made of the pipelined model's functions would run "
            "every stage on one rank, whose variables live on several. Received: signatures="
            f"{type(signatures).__name__}. Fix: drop signatures=, or use "
            "model.export(path, input_signature=...), which exports the whole model.")
    if original is None:
        import tensorflow as tf

        original = tf.saved_model.save
    save = original
    _with_copy_on_rank_0(dm, lambda copy: save(copy, os.fspath(export_dir), options=options),
                         "The SavedModel could not be written")


@collective_label("DistributedModel.export")
def export_model(dm: Any, filepath: str, format: str = "tf_saved_model",
                 verbose: Any = None, input_signature: Any = None, *,
                 fed_signature: bool = False, **kwargs: Any) -> None:
    """Keras's ``model.export`` of the whole unpartitioned model (every rank calls): world
    rank 0 rebuilds the model in one process with the gathered weights and runs Keras's
    ``export`` on it with these arguments, so without ``input_signature`` the signature is
    Keras's (the model's own input dtypes). With ``fed_signature`` (SMP's `save_model`) and no
    ``input_signature``, it takes inputs of the dtype the model was fed instead."""
    def export(copy: keras.Model) -> None:
        signature = input_signature or (_serving_signature(dm, copy) if fed_signature else None)
        copy.export(filepath, format=format, verbose=verbose, input_signature=signature,
                    **kwargs)

    _with_copy_on_rank_0(dm, export, "The exported model could not be written")


def _with_copy_on_rank_0(dm: Any, work: Callable[[keras.Model], None], failed: str) -> None:
    """Every rank calls: world rank 0 runs ``work`` on a single-process copy of the whole
    model (`_standalone_copy`, with [Note: an exact copy]'s weights), and every rank returns
    once it has, raising its error (``failed``: what did not happen) if it failed."""
    world = dm.runtime_state().comm.world
    tmpdir = tempfile.mkdtemp(prefix=".tfsmp-export-") if world.rank == 0 else ""
    weights_file = os.path.join(tmpdir, "model.weights.h5")
    try:
        save_weights(dm, weights_file if world.rank == 0 else "unused.weights.h5")
        exact = _exact_weights(dm)  # [Note: an exact copy]
        outcome = None
        if world.rank == 0:
            try:
                copy = _standalone_copy(dm, weights_file)
                _assign_exact(copy, exact)
                work(copy)
            except Exception as e:  # every rank raises it
                outcome = f"{type(e).__name__}: {e}"
        outcome = world.bcast_obj(outcome, root=0)
        if outcome is not None:
            raise CheckpointError(
                f"{failed}. Received: {outcome}. Fix: check that the model can be rebuilt "
                f"from its config (custom layers registered).")
    finally:
        if tmpdir:
            shutil.rmtree(tmpdir, ignore_errors=True)
