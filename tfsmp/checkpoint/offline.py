"""Offline export of a tfsmp checkpoint to plain Keras files, in one process (no MPI).

Example::

    export_checkpoint("/opt/ml/checkpoints", "model.keras")        # the latest checkpoint
    export_checkpoint("/opt/ml/checkpoints/ckpt-3", "w.weights.h5")
    export_checkpoint("/opt/ml/checkpoints", "serving/")           # a TF SavedModel directory

The model is rebuilt from the Keras config the manifest stores (Functional and Sequential
models), every variable is assigned from the checkpoint by its key ([Note: variable keys] in
`tfsmp.checkpoint.layout`), checksums verified, and plain Keras writes the file.
"""

from __future__ import annotations

import os

import keras

from tfsmp.checkpoint import format as fmt
from tfsmp.checkpoint.keras_h5 import model_from_config
from tfsmp.errors import CheckpointError

__all__ = ["export_checkpoint"]


def _find_checkpoint(path: str) -> str:
    if os.path.isfile(os.path.join(path, fmt.MANIFEST)):
        return path
    prefixes = {n.rsplit("-", 1)[0] for n in (os.listdir(path) if os.path.isdir(path) else [])
                if os.path.isfile(os.path.join(path, n, fmt.MANIFEST))}
    latest_file = os.path.join(path, fmt.LATEST)
    if os.path.isfile(latest_file):
        with open(latest_file) as f:
            prefixes = {f.read().strip().rsplit("-", 1)[0]} | prefixes
    for prefix in sorted(prefixes):
        found = fmt.read_latest(path, prefix)
        if found is not None:
            return found
    raise CheckpointError(
        f"CHECKPOINT_DIR must be a tfsmp checkpoint or a directory of them. Received: "
        f"{path!r} holds no {fmt.MANIFEST}. Pass the CheckpointManager directory.")


def export_checkpoint(checkpoint_dir: str, out: str) -> str:
    """Writes a tfsmp checkpoint as a plain Keras file, in this one process (no MPI).

    Args:
        checkpoint_dir: A checkpoint (``.../ckpt-3``) or a `CheckpointManager` directory (its
            latest checkpoint).
        out: ``*.keras`` (whole model), ``*.weights.h5``, or a directory (TF SavedModel).

    Returns:
        The checkpoint that was exported.

    Raises:
        CheckpointError: no model config in the checkpoint (subclassed model), or a bad
            checkpoint (missing, corrupt or mismatched arrays).
    """
    from tfsmp.checkpoint.layout import variable_keys
    from tfsmp.graph.tracer import trace

    path = _find_checkpoint(checkpoint_dir)
    manifest = fmt.read_manifest(path)
    info = manifest.get("model") or {}
    if not info.get("config"):
        raise CheckpointError(
            f"Offline export needs the model's Keras config in the checkpoint. Received: "
            f"{path!r} has none ({info.get('config_unavailable')}). Fix: export from the "
            f"training script with model.save('m.keras').")
    model = model_from_config(info["config"])
    keys = variable_keys(trace(model))
    table = manifest["variables"]
    for v in model.variables:
        key = keys.get(id(v))
        if key is None:
            continue
        if key not in table:
            raise CheckpointError(
                f"Every model variable must be in the checkpoint. Received: '{key}' is missing "
                f"from {os.path.join(path, fmt.MANIFEST)}.")
        value = fmt.read_array(path, key, table[key])
        if tuple(value.shape) != tuple(v.shape):
            raise CheckpointError(
                f"Checkpoint shapes must match the model config. Received: '{key}' has shape "
                f"{tuple(value.shape)} in {path!r}, the model's is {tuple(v.shape)}.")
        v.assign(value)
    _write_plain(model, out)
    return path


def _write_plain(model: keras.Model, out: str) -> None:
    if out.endswith(".keras"):
        model.save(out)
    elif out.endswith(".weights.h5"):
        model.save_weights(out)
    else:
        model.export(out, format="tf_saved_model", verbose=False)
