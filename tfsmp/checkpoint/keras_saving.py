"""Keras's saving functions and pickling, handed a `DistributedModel`.

Example::

    keras.saving.save_model(dm, "m.keras")      # every rank calls: world rank 0 writes the file
    keras.saving.load_model("m.keras")          # ... that plain Keras wrote of the whole model
    saving_lib.save_weights_only(dm, "w.weights.h5"); saving_lib.load_weights_only(dm, ...)
    copy = pickle.loads(pickle.dumps(dm))       # every rank: a DistributedModel, same weights

[Note: Keras's saving functions] Keras's saving functions (``keras.saving.save_model``,
``save_weights``, ``load_weights``, ``keras.Model.save``, and `saving_lib`'s
``save_model``/``save_weights_only``/``load_weights_only`` they call) open the target file
themselves and then walk the model's attributes, reading every variable. A partitioned model
breaks both: each rank holds only its stages' variables (the walk reads released ones), and
every rank calls the function with the same path on a shared file system (every rank would
truncate and write the file another rank is writing or already reading). No hook of the model
runs before Keras opens the file, so the model's own seams (``get_config``,
``save_own_variables``) cannot stop a rank from writing. So tfsmp puts a dispatch in front of
those `saving_lib` functions (and of TensorFlow's ``tf.saved_model.save``, which traces the
model's call, every stage on one rank) (`install`, once, when the first `DistributedModel` is made):
given a `DistributedModel`, they run tfsmp's collective export and load
(tfsmp/checkpoint/export.py: world rank 0 writes what ``keras.Model.save`` would write of the
unpartitioned model, each rank reads only what it holds); given anything else, Keras's own
function runs unchanged. Keras's own argument checks (``save_format``, unknown arguments, the
extension) run first: ``keras.saving.save_model`` validates before it calls `saving_lib`, and
``DistributedModel.save`` is Keras's ``Model.save``. A file object (``io.BytesIO``) is private
to each rank, so every rank gets the whole archive in its own.

Pickling (``pickle``, ``copy.deepcopy``) is Keras's too: Keras pickles a model as its
``.keras`` archive; a `DistributedModel` pickles as the archive of the whole unpartitioned
model (`archive_bytes`) and unpickles as a `DistributedModel` wrapping the model it holds,
compiled as the original was, with the optimizer's state loaded once it is partitioned.
"""

from __future__ import annotations

import atexit
import io
import os
import shutil
from collections.abc import Callable
from typing import Any

from keras.src.legacy.saving import legacy_h5_format
from keras.src.saving import saving_lib

from tfsmp.checkpoint import export

__all__ = ["install", "keras_original", "reduce", "unpickle"]

_MARK = "_tfsmp_dispatch"  # on an installed dispatch: the function it stands in front of


def keras_original(function: Callable[..., Any]) -> Callable[..., Any]:
    """Keras's own function behind an installed dispatch (itself when none is installed), for
    tfsmp's single-process copies: an instance of a user's `DistributedModel` subclass made
    only to hold the gathered weights on one rank must not take the collective path."""
    return getattr(function, _MARK, function)


def _is_distributed(model: Any) -> bool:
    from tfsmp.keras.model import DistributedModel

    return isinstance(model, DistributedModel)


def _not_built(action: str) -> ValueError:  # Keras's own words (saving_lib)
    return ValueError(
        f"You are {action} a model that has not yet been built. Try building the model first "
        f"by calling it on some data or by using `build()`.")


def _refuse(argument: str, value: Any, fix: str) -> ValueError:
    return ValueError(
        f"A DistributedModel is saved and loaded whole, by every rank, without `{argument}`. "
        f"Received: {argument}={value!r}. {fix}")


def save_model(dm: Any, filepath: Any, weights_format: str = "h5", zipped: bool = True) -> None:
    """`saving_lib.save_model` of a `DistributedModel` ([Note: Keras's saving functions])."""
    if weights_format != "h5":
        raise _refuse("weights_format", weights_format, "Drop it: the weights are HDF5.")
    if not zipped:
        raise _refuse("zipped", zipped, "Save a zipped `.keras` file.")
    if isinstance(filepath, io.IOBase):
        filepath.write(export.archive_bytes(dm))
        return
    path = str(os.fspath(filepath))
    if not path.endswith(".keras"):
        raise ValueError("Invalid `filepath` argument: expected a `.keras` extension. "
                         f"Received: filepath={path}")
    export.save_keras(dm, path)


def save_weights_only(dm: Any, filepath: Any, max_shard_size: Any = None,
                      objects_to_skip: Any = None) -> None:
    """`saving_lib.save_weights_only` of a `DistributedModel`."""
    if not dm.built:
        raise _not_built("saving")
    if max_shard_size is not None:
        raise _refuse("max_shard_size", max_shard_size, "Save one `.weights.h5` file.")
    if objects_to_skip is not None:
        raise _refuse("objects_to_skip", objects_to_skip, "Save the whole model's weights.")
    export.save_weights(dm, str(os.fspath(filepath)))


def load_weights_only(dm: Any, filepath: Any, skip_mismatch: bool = False,
                      objects_to_skip: Any = None) -> None:
    """`saving_lib.load_weights_only` of a `DistributedModel`."""
    if not dm.built:
        raise _not_built("loading weights into")
    if objects_to_skip is not None:
        raise _refuse("objects_to_skip", objects_to_skip, "Load the whole model's weights.")
    export.load_weights(dm, str(os.fspath(filepath)), skip_mismatch=skip_mismatch)


def save_model_to_hdf5(dm: Any, filepath: Any, overwrite: bool = True,
                       include_optimizer: bool = True) -> None:
    """`legacy_h5_format.save_model_to_hdf5` of a `DistributedModel` (``.h5``)."""
    if not isinstance(filepath, (str, os.PathLike)):
        raise _refuse("filepath", type(filepath).__name__, "Pass a path ending in `.h5`.")
    export.save_legacy_h5(dm, str(os.fspath(filepath)), overwrite, include_optimizer)


# -- legacy `.h5` weights -------------------------------------------------------------------
# [Note: legacy h5 weights] Keras reads a legacy `.h5` file (``model.save("m.h5")`` of tf.keras
# days) layer by layer in the model's order (or by layer name), through two functions that take
# the open file first and the model second. A partitioned model has no such walk: its layers'
# variables live on other ranks. So a whole single-process copy of the model (its own fresh
# variables) takes Keras's own legacy read, and its weights then reach the `DistributedModel`
# as a `.weights.h5` file would (each rank assigns only what it holds, now or, for variables
# made in `deferred_init`, once partitioned). The copy holds the whole model on every rank for
# the duration: for models beyond one rank's memory load `.weights.h5` or `.keras` files, which
# each rank reads only its share of. Before partitioning, a model whose variables all exist
# (not made in `deferred_init`) is read into directly, as plain Keras does.


def _whole_copy(dm: Any) -> Any:
    """A plain copy of ``dm``'s source model with every variable allocated."""
    import keras
    from keras.src.models.functional import Functional

    source = dm.source_model()
    if isinstance(source, (Functional, keras.Sequential)) and not _is_distributed(source):
        return keras.models.clone_model(source)
    if dm.rank_view is None:
        raise ValueError(
            "A subclassed DistributedModel built in `deferred_init` reads a legacy `.h5` file "
            "once partitioned. Received: load_weights of a `.h5` file before partitioning. "
            "Fix: call `dm.partition(x)` (or train a step) first, or load a `.weights.h5` file.")
    copy = export.fresh_instance(source)
    specs = dm.rank_view.traced.input_specs
    inputs = [keras.Input(shape=tuple(s.shape)[1:], dtype=s.dtype) for s in specs]
    copy(inputs[0] if len(inputs) == 1 else inputs)
    return copy


def _load_legacy(dm: Any, read: Callable[[Any], None], skip_mismatch: bool) -> None:
    """Keras's legacy read ``read(model)`` of a `DistributedModel` ([Note: legacy h5 weights])."""
    import tempfile

    from tfsmp.graph.deferred import is_deferred

    source = dm.source_model()
    if dm.rank_view is None and not any(is_deferred(v) for v in source.weights):
        read(source)  # before partitioning every variable is here: Keras's own read
        return
    copy = _whole_copy(dm)
    read(copy)
    folder = tempfile.mkdtemp(prefix="tfsmp-legacy-h5-")
    weights = os.path.join(folder, "legacy.weights.h5")
    keras_original(saving_lib.save_weights_only)(copy, weights)
    del copy
    if dm.rank_view is not None:  # read now: the folder goes with it
        try:
            export.load_weights(dm, weights, skip_mismatch=skip_mismatch)
        finally:
            shutil.rmtree(folder, ignore_errors=True)
        return
    export.load_weights(dm, weights, skip_mismatch=skip_mismatch)  # some read when partitioned
    atexit.register(shutil.rmtree, folder, True)


def load_weights_from_hdf5_group(f: Any, dm: Any, *args: Any, **kwargs: Any) -> None:
    """`legacy_h5_format.load_weights_from_hdf5_group` into a `DistributedModel`."""
    original = keras_original(legacy_h5_format.load_weights_from_hdf5_group)
    _load_legacy(dm, lambda model: original(f, model, *args, **kwargs), skip_mismatch=False)


def load_weights_from_hdf5_group_by_name(f: Any, dm: Any, skip_mismatch: bool = False,
                                         *args: Any, **kwargs: Any) -> None:
    """`legacy_h5_format.load_weights_from_hdf5_group_by_name` into a `DistributedModel`
    (the copy's layers keep the model's names, so names match as they would in Keras)."""
    original = keras_original(legacy_h5_format.load_weights_from_hdf5_group_by_name)
    _load_legacy(dm, lambda model: original(f, model, skip_mismatch, *args, **kwargs),
                 skip_mismatch=skip_mismatch)


# (module, function, tfsmp's function, the position of the model among its arguments): the
# legacy `.h5` readers take the open file first and the model second
_DISPATCH: tuple[tuple[Any, str, Callable[..., Any], int], ...] = (
    (saving_lib, "save_model", save_model, 0),
    (saving_lib, "save_weights_only", save_weights_only, 0),
    (saving_lib, "load_weights_only", load_weights_only, 0),
    (legacy_h5_format, "save_model_to_hdf5", save_model_to_hdf5, 0),
    (legacy_h5_format, "load_weights_from_hdf5_group", load_weights_from_hdf5_group, 1),
    (legacy_h5_format, "load_weights_from_hdf5_group_by_name",
     load_weights_from_hdf5_group_by_name, 1),
)


def _dispatch(original: Callable[..., Any], ours: Callable[..., Any], position: int
              ) -> Callable[..., Any]:
    def dispatch(*args: Any, **kwargs: Any) -> Any:
        model = args[position] if len(args) > position else kwargs.get("model")
        return (ours if _is_distributed(model) else original)(*args, **kwargs)

    return _as_original(dispatch, original)


def _saved_model_dispatch(original: Callable[..., Any]) -> Callable[..., Any]:
    """``tf.saved_model.save(obj, export_dir, signatures=None, options=None)``: a
    `DistributedModel` goes to tfsmp's collective save, anything else to TensorFlow's."""
    def save(obj: Any, export_dir: Any, signatures: Any = None, options: Any = None) -> Any:
        if _is_distributed(obj):
            return export.tf_saved_model_save(obj, export_dir, signatures, options,
                                              original=original)
        return original(obj, export_dir, signatures=signatures, options=options)

    return _as_original(save, original)


def _saved_model_modules() -> list[Any]:
    """Where ``tf.saved_model.save`` is looked up: the public API module (``tf.saved_model``,
    whose attribute was bound at import) and TensorFlow's own module."""
    import sys

    import tensorflow as tf

    modules = [tf.saved_model, sys.modules.get("tensorflow.python.saved_model.save")]
    compat = getattr(getattr(getattr(tf, "compat", None), "v2", None), "saved_model", None)
    return [m for m in (*modules, compat) if m is not None and hasattr(m, "save")]


def _as_original(dispatch: Callable[..., Any], original: Callable[..., Any]
                 ) -> Callable[..., Any]:
    """``dispatch`` named and documented as ``original``, which `keras_original` finds."""
    dispatch.__name__ = dispatch.__qualname__ = original.__name__
    dispatch.__doc__ = original.__doc__
    setattr(dispatch, _MARK, original)
    return dispatch


def install() -> None:
    """Puts the dispatch in front of Keras's saving functions ([Note: Keras's saving
    functions]); idempotent."""
    for module, name, ours, position in _DISPATCH:
        current = getattr(module, name)
        if getattr(current, _MARK, None) is None:
            setattr(module, name, _dispatch(current, ours, position))
    for module in _saved_model_modules():
        current = module.save
        if getattr(current, _MARK, None) is None:
            module.save = _saved_model_dispatch(current)


# -- pickling -------------------------------------------------------------------------------

def reduce(dm: Any) -> tuple[Callable[..., Any], tuple[Any, ...]]:
    """``dm.__reduce__()``: the whole model's ``.keras`` archive (a collective call once
    partitioned) and the function that rebuilds a `DistributedModel` from it."""
    return unpickle, (export.archive_bytes(dm), dm.name)


def unpickle(archive: bytes, name: str) -> Any:
    """A `DistributedModel` of the model in ``archive``, compiled as the saved one was; the
    optimizer's state is loaded once it is partitioned. Not safe with untrusted data: neither
    is Keras's (or any) unpickling."""
    from tfsmp.keras.model import DistributedModel

    model = saving_lib.load_model(io.BytesIO(archive), compile=False, safe_mode=False)
    config = _compile_config(archive)
    # a DistributedModel subclass (SMP-style) is its own source model: it comes back as itself
    dm = model if isinstance(model, DistributedModel) else DistributedModel(model, name=name)
    if config is not None:
        dm.compile_from_config(config)
        export.load_optimizer_later(dm, archive)
    return dm


def _compile_config(archive: bytes) -> Any:
    import json
    import zipfile

    with zipfile.ZipFile(io.BytesIO(archive)) as zf:
        config = json.loads(zf.read("config.json"))
    return config.get("compile_config")
