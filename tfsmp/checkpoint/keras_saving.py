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
those `saving_lib` functions (`install`, once, when the first `DistributedModel` is made):
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

import io
import os
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


_DISPATCH: tuple[tuple[Any, str, Callable[..., Any]], ...] = (
    (saving_lib, "save_model", save_model),
    (saving_lib, "save_weights_only", save_weights_only),
    (saving_lib, "load_weights_only", load_weights_only),
    (legacy_h5_format, "save_model_to_hdf5", save_model_to_hdf5),
)


def _dispatch(original: Callable[..., Any], ours: Callable[..., Any]) -> Callable[..., Any]:
    def dispatch(model: Any, *args: Any, **kwargs: Any) -> Any:
        if _is_distributed(model):
            return ours(model, *args, **kwargs)
        return original(model, *args, **kwargs)

    dispatch.__name__ = dispatch.__qualname__ = original.__name__
    dispatch.__doc__ = original.__doc__
    setattr(dispatch, _MARK, original)
    return dispatch


def install() -> None:
    """Puts the dispatch in front of Keras's saving functions ([Note: Keras's saving
    functions]); idempotent."""
    for module, name, ours in _DISPATCH:
        current = getattr(module, name)
        if getattr(current, _MARK, None) is None:
            setattr(module, name, _dispatch(current, ours))


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
