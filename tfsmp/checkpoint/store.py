"""Collective save and restore of a partitioned model's full training state.

Example::

    path = save_state(dm, "/ckpts", "ckpt-3", optimizer=dm.optimizer, extras={"epoch": v},
                      position={"epoch": 1, "step": 0})           # every rank calls
    manifest = restore_state(dm, path, optimizer=dm.optimizer, extras={"epoch": v})

Saving, roughly (see [Note: checkpoint layout] in `format`):
    world rank 0: create <root>/ckpt-3.tmp                        -> bcast its name
    writers (data rank 0 of each pipeline rank): write their stages' variables and slots
    world rank 0 also: optimizer globals, extras, the random-generator state
    allgather entries and errors -> rank 0: manifest.json, rename .tmp -> ckpt-3, `latest`, prune
Restoring: rank 0 reads the manifest and broadcasts it; each rank reads and verifies only the
arrays it holds; errors are gathered from every rank and raised on all of them before any
variable is assigned, so a bad checkpoint changes nothing.
"""

from __future__ import annotations

import functools
import json
import os
import random
import secrets
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import keras
import numpy as np

from tfsmp.checkpoint import checksum
from tfsmp.checkpoint import format as fmt
from tfsmp.checkpoint.layout import optimizer_state
from tfsmp.errors import CheckpointError

if TYPE_CHECKING:
    from tfsmp.runtime.view import RankView

__all__ = ["last_read", "restore_state", "restore_unpartitioned", "save_state"]

_TOKEN = ".tfsmp-writers"
_LAST_READ: list[str] = []  # keys this process read in its last restore (tests check partial reads)


def last_read() -> list[str]:
    """The keys this process read in its most recent `restore_state` (model, slot, global)."""
    return list(_LAST_READ)


# -- helpers -----------------------------------------------------------------------------------

def _numpy(v: Any) -> np.ndarray:
    value = v.value if isinstance(v, keras.Variable) else v
    return np.asarray(keras.ops.convert_to_numpy(value))


def _dtype(v: Any) -> str:
    return str(keras.backend.standardize_dtype(v.dtype))


def _agree(world: Any, errors: list[str]) -> None:
    """Raises the same CheckpointError on every rank if any rank reported an error."""
    everyone = [e for part in world.allgather_obj(errors) for e in part]
    checksum.raise_gathered(everyone)  # a damaged file: CorruptFileError, an OSError too
    if everyone:
        more = f" (and {len(everyone) - 1} more problems)" if len(everyone) > 1 else ""
        raise CheckpointError(everyone[0] + more)


def _try(errors: list[str], fn: Callable[[], Any]) -> Any:
    try:
        return fn()
    except CheckpointError as e:
        errors.append(checksum.gatherable(e))
    except OSError as e:
        errors.append(fmt.describe_os_error(e, "the checkpoint directory"))
    except Exception as e:  # any failure must reach every rank, or the others wait forever
        errors.append(f"{type(e).__name__}: {e}")
    return None


def _require_view(dm: Any, what: str) -> RankView:
    view: RankView | None = dm.rank_view
    if view is None:
        raise CheckpointError(
            f"{what} needs the partitioned model. Received: a DistributedModel that has not run "
            f"a step yet. Fix: call it after the first step (or after model.partition(x)); "
            f"CheckpointManager.restore and load_weights may be called earlier and apply then.")
    return view


def rng_state() -> dict[str, Any]:
    """Python's and NumPy's global random states, JSON-serializable."""
    version, internal, gauss = random.getstate()
    kind, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)
    return {"python": [version, list(internal), gauss],
            "numpy": [kind, [int(k) for k in keys], int(pos), int(has_gauss), float(cached)]}


def set_rng_state(state: dict[str, Any]) -> None:
    if "python" in state:
        version, internal, gauss = state["python"]
        random.setstate((version, tuple(internal), gauss))
    if "numpy" in state:
        kind, keys, pos, has_gauss, cached = state["numpy"]
        np.random.set_state((kind, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))


def _keras_seed_state() -> Any:
    """The state variable of keras.random's global SeedGenerator, if one was created."""
    from keras.src.backend.common import global_state

    gen = global_state.get_global_attribute("global_seed_generator")
    return None if gen is None else gen.state


# -- save ---------------------------------------------------------------------------------------

def _tables(dm: Any, optimizer: Any, extras: dict[str, Any]
            ) -> tuple[RankView, dict[tuple[str, str], Any], dict[str, Any], dict[str, Any]]:
    layout = _require_view(dm, "Saving a checkpoint")
    slots: dict[tuple[str, str], Any] = {}
    globals_: dict[str, Any] = {}
    if optimizer is not None and optimizer.built:
        slots, globals_ = optimizer_state(optimizer, layout)
    return layout, slots, globals_, extras


def _write_mine(tmp: str, layout: RankView, slots: dict[tuple[str, str], Any],
                globals_: dict[str, Any], extras: dict[str, Any], rank: int, globals_rank: int
                ) -> dict[str, dict[str, Any]]:
    """Writes this rank's arrays; returns their manifest entries by section (with the writer).

    ``globals_rank`` writes the optimizer's global values (a rank whose stages train nothing
    never builds its optimizer); world rank 0 writes the extras and the random state."""
    out: dict[str, dict[str, Any]] = {"variables": {}, "slots": {}, "optimizer": {},
                                      "extras": {}, "rng": {}}
    # a slot is written by the rank whose optimizer holds it: data rank 0's, or with sharded
    # optimizer state its owner's ([Note: optimizer shards] in tfsmp/partitioning/shards.py)
    slot_writer = layout.slot_writer or layout.writer
    for key in layout.writes:
        v = layout.variables[key]
        out["variables"][key] = fmt.write_array(tmp, fmt.array_file("model", key), _numpy(v),
                                                _dtype(v))
    for (key, slot), v in slots.items():
        if slot_writer.get(key) == layout.world_rank:
            name = f"{key}/{slot}"
            out["slots"][name] = fmt.write_array(tmp, fmt.array_file("slots", name), _numpy(v),
                                                 _dtype(v))
    if rank == globals_rank:
        for name, v in globals_.items():
            out["optimizer"][name] = fmt.write_array(tmp, fmt.array_file("optimizer", name),
                                                     _numpy(v), _dtype(v))
    if rank == 0:
        for name, v in extras.items():
            out["extras"][name] = fmt.write_array(tmp, fmt.array_file("extras", name),
                                                  _numpy(v), _dtype(v))
        seed = _keras_seed_state()
        if seed is not None:
            out["rng"]["keras"] = fmt.write_array(tmp, fmt.array_file("rng", "keras"),
                                                  _numpy(seed), _dtype(seed))
    for entries in out.values():
        for entry in entries.values():
            entry["rank"] = rank
    return out


def _model_info(dm: Any) -> dict[str, Any]:
    from tfsmp.checkpoint.keras_h5 import model_config

    source = dm.source_model()
    config, reason = model_config(source)
    return {"name": source.name, "class": type(source).__name__, "config": config,
            "config_unavailable": reason}


def _manifest(dm: Any, name: str, parts: list[dict[str, dict[str, Any]]], optimizer: Any,
              steps: list[int | None], position: dict[str, Any] | None, layout: RankView
              ) -> dict[str, Any]:
    view, st = dm.rank_view, dm.runtime_state()
    merged: dict[str, dict[str, Any]] = {}
    for part in parts:
        for section, entries in part.items():
            merged.setdefault(section, {}).update(entries)
    known = [s for s in steps if s is not None]
    step = max(known) if known else None
    return {
        "name": name, "step": step, "position": position, "created": time.time(),
        "config": st.config.to_dict(), "plan": json.loads(view.plan.to_json()),
        "topology": {"world_size": st.topology.world_size, "partitions": st.topology.partitions,
                     "placement": st.topology.placement, "dp_size": view.data_size},
        "stages": {k: layout.key_stage[k] for k in layout.variables},
        "model": _model_info(dm),
        "optimizer_info": None if optimizer is None else {
            "class": type(optimizer).__name__, "built": step is not None},
        "rng_state": rng_state(),
        "versions": _versions(),
        **{k: merged.get(k, {}) for k in ("variables", "slots", "optimizer", "extras", "rng")},
    }


def _versions() -> dict[str, str]:
    import tensorflow as tf

    import tfsmp

    return {"tfsmp": tfsmp.__version__, "keras": keras.__version__, "tensorflow": tf.__version__}


def _prepare(world: Any, root: str, name: str) -> str:
    """Rank 0 creates the temporary directory; every rank checks it sees the same one."""
    made: tuple[str, str] | str
    if world.rank == 0:
        try:
            os.makedirs(root, exist_ok=True)
            tmp = fmt.begin(root, name)
            token = secrets.token_hex(8)
            with open(os.path.join(tmp, _TOKEN), "w") as f:
                f.write(token)
            made = (tmp, token)
        except OSError as e:
            made = fmt.describe_os_error(e, root)
    else:
        made = ""
    made = world.bcast_obj(made, root=0)
    if isinstance(made, str):
        raise CheckpointError(made)
    tmp, token = made
    errors: list[str] = []
    path = os.path.join(tmp, _TOKEN)
    seen = None
    if os.path.isfile(path):
        with open(path) as f:
            seen = f.read()
    if seen != token:
        errors.append(
            f"Every rank must see the checkpoint directory on a shared filesystem. Received: "
            f"rank {world.rank} does not see '{tmp}' that rank 0 created. Fix: put directory= "
            f"on storage every host mounts (e.g. FSx, EFS, NFS).")
    _agree(world, errors)
    return str(tmp)


def save_state(dm: Any, root: str, name: str, *, optimizer: Any = None,
               extras: dict[str, Any] | None = None, position: dict[str, Any] | None = None,
               max_to_keep: int | None = None, prefix: str | None = None) -> str:
    """Writes checkpoint ``<root>/<name>`` from every rank (a collective call); returns its path.

    Args:
        dm: The partitioned `DistributedModel`.
        root: Directory holding the checkpoints (shared by every rank).
        name: The checkpoint's directory name, ``<prefix>-N``.
        optimizer: The optimizer whose slots and iteration count are saved (None: none).
        extras: Further variables by name (``tf.Variable`` or ``keras.Variable``), saved from
            world rank 0.
        position: The training position, e.g. ``{"epoch": 2, "step": 0}``.
        max_to_keep: Keep at most this many checkpoints of ``prefix`` (None: all).
        prefix: The checkpoint name prefix (for ``latest`` and pruning); default: ``name``'s.

    Raises:
        CheckpointError: before the first step, or a rank could not write (on every rank).
    """
    world = _require_view(dm, "Saving a checkpoint").groups.world
    layout, slots, globals_, extra = _tables(dm, optimizer, dict(extras or {}))
    built = optimizer is not None and optimizer.built
    steps = world.allgather_obj(int(_numpy(optimizer.iterations)) if built else None)
    # The optimizer of a rank whose stages train nothing is never applied, so its count lags.
    known = [s for s in steps if s is not None]
    globals_rank = steps.index(max(known)) if known else 0
    tmp = _prepare(world, root, name)
    errors: list[str] = []
    part = _try(errors, functools.partial(_write_mine, tmp, layout, slots, globals_, extra,
                                          world.rank, globals_rank)) or {}
    gathered = world.allgather_obj((part, errors))
    failed = [e for _, errs in gathered for e in errs]
    result: str | None = None
    if world.rank == 0:
        result = _finish(dm, root, name, tmp, [p for p, _ in gathered], failed,
                         (optimizer, steps), position, max_to_keep,
                         prefix or name.rsplit("-", 1)[0], layout)
    outcome = world.bcast_obj(result, root=0)
    if not isinstance(outcome, str) or outcome.startswith("ERROR:"):
        raise CheckpointError(str(outcome)[len("ERROR:"):])
    return outcome


def _finish(dm: Any, root: str, name: str, tmp: str, parts: list[Any], failed: list[str],
            optimizer_steps: tuple[Any, list[int | None]], position: dict[str, Any] | None,
            max_to_keep: int | None, prefix: str, layout: RankView) -> str:
    import shutil

    if failed:
        shutil.rmtree(tmp, ignore_errors=True)
        return "ERROR:" + failed[0]
    try:
        os.remove(os.path.join(tmp, _TOKEN))
        optimizer, steps = optimizer_steps
        fmt.write_manifest(tmp, _manifest(dm, name, parts, optimizer, steps, position, layout))
        final = os.path.join(root, name)
        fmt.commit(tmp, final)
        fmt.write_latest(root, name)
        fmt.write_smp_markers(root, name, dm.rank_view.pipeline_size)  # [Note: SMP layout markers]
        fmt.prune(root, prefix, max_to_keep, keep=final)
    except Exception as e:  # reported on every rank, not only here
        shutil.rmtree(tmp, ignore_errors=True)
        return f"ERROR:The checkpoint could not be committed. Received: {type(e).__name__}: {e}."
    return final


# -- restore ------------------------------------------------------------------------------------

def _read_manifest_everywhere(world: Any, path: str) -> dict[str, Any]:
    got: Any
    if world.rank == 0:
        try:
            got = fmt.read_manifest(path)
        except CheckpointError as e:
            got = "ERROR:" + checksum.gatherable(e)
    else:
        got = None
    got = world.bcast_obj(got, root=0)
    if isinstance(got, str):
        checksum.raise_gathered([got[len("ERROR:"):]])
        raise CheckpointError(got[len("ERROR:"):])
    return dict(got)


def _check_shape(key: str, entry: Any, v: Any, path: str) -> None:
    shape = tuple(entry.get("shape", ())) if isinstance(entry, dict) else None
    if shape != tuple(v.shape):
        file = entry.get("file") if isinstance(entry, dict) else "?"
        raise CheckpointError(
            f"A checkpoint variable must have the model variable's shape. Received: "
            f"'{key}' has shape {shape} in file '{os.path.join(path, str(file))}', the model's "
            f"is {tuple(v.shape)}. Fix: restore into the same architecture.")


def _missing(key: str, what: str, path: str) -> str:
    return (f"Every {what} of the model must be in the checkpoint. Received: '{key}' is missing "
            f"from {os.path.join(path, fmt.MANIFEST)}. Fix: restore a checkpoint of this model "
            f"(same layer names).")


def _plan_reads(manifest: dict[str, Any], path: str, wanted: list[tuple[str, dict[str, Any], str]],
                errors: list[str]) -> list[tuple[str, Any, Any]]:
    """(key, manifest entry, variable) for every array this rank must read; problems go to
    ``errors``. ``wanted`` lists (manifest section, {key: variable}, what to call a key)."""
    reads: list[tuple[str, Any, Any]] = []
    for section, table_wanted, what in wanted:
        table = manifest.get(section) or {}
        for key, v in table_wanted.items():
            if key not in table:
                errors.append(_missing(key, what, path))
                continue
            try:
                _check_shape(key, table[key], v, path)
            except CheckpointError as e:
                errors.append(str(e))
                continue
            reads.append((key, table[key], v))
    return reads


def _wanted(manifest: dict[str, Any], layout: RankView, slots: dict[tuple[str, str], Any],
            globals_: dict[str, Any], extras: dict[str, Any], skip: frozenset[int] = frozenset(),
            rng: bool = True) -> list[tuple[str, dict[str, Any], str]]:
    held = {k: v for k, v in layout.held_variables().items() if id(v) not in skip}
    wanted: list[tuple[str, dict[str, Any], str]] = [
        ("variables", held, "variable"),
        ("optimizer", globals_, "optimizer variable"),
        ("extras", extras, "checkpointed object")]
    if slots and (manifest.get("optimizer_info") or {}).get("built", False):
        wanted.append(("slots", {f"{k}/{s}": v for (k, s), v in slots.items()}, "optimizer slot"))
    seed = _keras_seed_state()
    if rng and seed is not None and "keras" in (manifest.get("rng") or {}):
        wanted.append(("rng", {"keras": seed}, "random-generator state"))
    return wanted


def _unexpected(manifest: dict[str, Any], layout: RankView, path: str) -> list[str]:
    extra = sorted(set(manifest["variables"]) - set(layout.variables))
    if not extra:
        return []
    return [f"A checkpoint must hold only variables of the model. Received: {len(extra)} "
            f"variables the model lacks, e.g. '{extra[0]}', in "
            f"{os.path.join(path, fmt.MANIFEST)}. Fix: restore a checkpoint of this model."]


def restore_state(dm: Any, path: str, *, optimizer: Any = None,
                  extras: dict[str, Any] | None = None, skip: frozenset[int] = frozenset(),
                  rng: bool = True) -> dict[str, Any]:
    """Restores checkpoint ``path`` into the partitioned model (a collective call).

    Each rank reads only the arrays of its own stages (and their slots). Every problem on any
    rank raises the same `CheckpointError` on every rank before a variable is assigned.

    Args:
        skip: ids of model variables not to assign (restored already, before partitioning).
        rng: whether to restore the random-generator states too.

    Returns:
        The checkpoint's manifest (``position``, ``step``, ...).
    """
    view = _require_view(dm, "Restoring a checkpoint")
    world = view.groups.world
    manifest = _read_manifest_everywhere(world, path)
    errors: list[str] = []
    slots: dict[tuple[str, str], Any] = {}
    globals_: dict[str, Any] = {}
    if optimizer is not None:
        if not optimizer.built:  # slots must exist to receive their values
            optimizer.build(view.optimizer_variables)  # its replica's, when sharded
        slots, globals_ = _try(errors, lambda: optimizer_state(optimizer, view)) or ({}, {})
    if world.rank == 0:
        errors += _unexpected(manifest, view, path)
    reads = _plan_reads(manifest, path, _wanted(manifest, view, slots, globals_,
                                                dict(extras or {}), skip, rng), errors)
    _assign_all(world, path, reads, errors)
    state = manifest.get("rng_state")
    if rng and isinstance(state, dict):
        set_rng_state(state)
    return manifest


def _assign_all(world: Any, path: str, reads: list[tuple[str, Any, Any]], errors: list[str]
                ) -> None:
    """Verifies every planned array, agrees with every rank that nothing failed, then reads
    and assigns them one at a time.

    [Note: restoring within memory] A rank never holds its stages' arrays all at once besides
    its variables: that would double what its weights and optimizer state take, enough to put
    a rank near its memory cap over it. The first pass checks each file's size and checksum in
    chunks (`fmt.verify_array`); once every rank agrees the checkpoint is sound, the second
    reads each array into its own memory, assigns it and lets it go ([Note: streaming arrays]).
    A file that changes between the passes still fails its checksum, on every rank alike.
    """
    for key, entry, _ in reads:
        _try(errors, functools.partial(fmt.verify_array, path, key, entry))
    _agree(world, errors)
    _LAST_READ[:] = [key for key, _, _ in reads]
    late: list[str] = []
    for key, entry, v in reads:
        array = _try(late, functools.partial(fmt.read_array, path, key, entry))
        if array is not None:
            v.assign(array)
        del array
    _agree(world, late)


def _trace_built(model: Any) -> Any:
    """The traced model if it has allocated variables and traces without a sample, else None
    (then everything waits for partitioning, where the first batch is the sample)."""
    from tfsmp.graph.deferred import is_deferred
    from tfsmp.graph.tracer import trace

    if all(is_deferred(v) for v in model.weights):
        return None
    try:
        return trace(model)
    except Exception:  # e.g. a subclassed model built by a call: traced at partitioning
        return None


def restore_unpartitioned(dm: Any, path: str, *, extras: dict[str, Any] | None = None
                          ) -> tuple[dict[str, Any], frozenset[int]]:
    """Restores, before partitioning, what already exists: the model's allocated variables (a
    built model's: all), ``extras`` and the random-generator states, so everything the user can
    read shows the checkpoint at once. A collective call; errors as in `restore_state`.

    Returns:
        The manifest, and the ids of the model variables assigned (the optimizer's state and
        variables not allocated yet are left for `restore_state` after partitioning).
    """
    from tfsmp.checkpoint.layout import variable_keys
    from tfsmp.graph.deferred import is_deferred

    world = dm.runtime_state().comm.world
    manifest = _read_manifest_everywhere(world, path)
    errors: list[str] = []
    model_vars: dict[str, Any] = {}
    traced = _trace_built(dm.source_model())
    if traced is not None:
        keys = variable_keys(traced)
        model_vars = {keys[id(v)]: v for v in traced.variables_of(set(traced.uses))
                      if id(v) in keys and not is_deferred(v)}
        extra = sorted(set(manifest["variables"]) - set(keys.values()))
        if extra and world.rank == 0:
            errors.append(
                f"A checkpoint must hold only variables of the model. Received: {len(extra)} "
                f"variables the model lacks, e.g. '{extra[0]}', in "
                f"{os.path.join(path, fmt.MANIFEST)}. Fix: restore a checkpoint of this model.")
    wanted: list[tuple[str, dict[str, Any], str]] = [
        ("variables", model_vars, "variable"), ("extras", dict(extras or {}), "checkpointed object")]
    seed = _keras_seed_state()
    if seed is not None and "keras" in (manifest.get("rng") or {}):
        wanted.append(("rng", {"keras": seed}, "random-generator state"))
    _assign_all(world, path, _plan_reads(manifest, path, wanted, errors), errors)
    state = manifest.get("rng_state")
    if isinstance(state, dict):
        set_rng_state(state)
    return manifest, frozenset(id(v) for v in model_vars.values())
