"""Which variables a checkpoint holds, under which keys, and which rank reads or writes each.

Example::

    view = dm.rank_view                          # after partitioning (a RankView)
    view.keys[id(v)]                             # "d0/kernel": layer name / weight name
    view.held                                    # keys this rank's stages hold
    view.writes                                  # keys this rank writes (one writer per key)
    slots, globals_ = optimizer_state(dm.optimizer, view)
    slots[("d0/kernel", "momentum")]             # Adam's first moment of d0/kernel

Keys are the runtime's: [Note: variable keys] in tfsmp/runtime/checkpoint_keys.py; which rank
holds and writes each comes from the model's `RankView` ([Note: one writer per key] in
tfsmp/runtime/view.py), which is the checkpoint's layout: nothing here copies it.

[Note: slot keys] Keras 3 names an optimizer slot ``<model variable path with / -> _>_<slot>``
(``add_variable_from_reference``), e.g. ``d0_kernel_momentum``. A slot is keyed by
(model key, slot name), found by the longest model-variable prefix of the same shape; the
optimizer's iteration count and learning rate are global (the same on every rank). An
optimizer that applies through others has one of each per optimizer, all named alike (a
LossScaleOptimizer's own and its inner optimizer's; a MultiOptimizer's own and each
sub-optimizer's): an inner optimizer's are keyed ``inner_optimizer/<name>``, a sub-optimizer's
``optimizers/<i>/<name>`` by its place in ``optimizer.optimizers`` (`global_names`). Before,
the two ``iteration`` collided and neither tfsmp's checkpoints nor a weights file could hold
such an optimizer's state. Slots, one optimizer's per model variable, keep their keys.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

import keras

from tfsmp.errors import CheckpointError
from tfsmp.runtime.checkpoint_keys import variable_keys
from tfsmp.runtime.memory import is_multi_optimizer

if TYPE_CHECKING:
    from tfsmp.runtime.view import RankView

__all__ = ["classify", "global_names", "layout_of", "optimizer_parts", "optimizer_state",
           "variable_keys"]


def layout_of(dm: Any) -> RankView:
    """The checkpoint layout of a partitioned `DistributedModel`: its `RankView`.

    Raises:
        CheckpointError: the model is not partitioned yet.
    """
    view = dm.rank_view
    if view is None:
        raise CheckpointError(
            "A checkpoint layout needs the partitioned model. Received: a DistributedModel "
            "that has not run a step yet. Fix: call model.partition(x) or run a step first.")
    return view  # type: ignore[no-any-return]


def optimizer_parts(optimizer: Any, prefix: str = "") -> list[tuple[str, Any]]:
    """``optimizer`` and the optimizers it applies through (a loss-scale wrapper's
    ``inner_optimizer``, a MultiOptimizer's ``optimizers``), each with the key prefix of its
    global variables: "", ``inner_optimizer/``, ``optimizers/<i>/`` ([Note: slot keys])."""
    out = [(prefix, optimizer)]
    inner = getattr(optimizer, "inner_optimizer", None)
    if inner is not None:
        out += optimizer_parts(inner, f"{prefix}inner_optimizer/")
    if is_multi_optimizer(optimizer):
        for i, sub in enumerate(optimizer.optimizers):
            out += optimizer_parts(sub, f"{prefix}optimizers/{i}/")
    return out


def global_names(optimizer: Any) -> dict[int, str]:
    """``{id(variable): key}`` of the global variables (iteration count, learning rate) of the
    optimizer and those it applies through (`optimizer_parts`, [Note: slot keys])."""
    return {id(v): prefix + str(v.name) for prefix, opt in optimizer_parts(optimizer)
            for v in (getattr(opt, "_iterations", None), getattr(opt, "_learning_rate", None))
            if isinstance(v, keras.Variable)}


def optimizer_state(optimizer: Any, layout: RankView
                    ) -> tuple[dict[tuple[str, str], Any], dict[str, Any]]:
    """This rank's optimizer variables: ``{(model key, slot): var}`` and ``{name: var}`` globals.

    See [Note: slot keys].

    Raises:
        CheckpointError: a non-scalar optimizer variable matches no model variable, or two
            optimizer variables map to one key.
    """
    refs = getattr(optimizer, "_trainable_variables", None) or [
        layout.variables[k] for k in layout.held]
    slots: dict[tuple[str, str], Any] = {}
    globals_: dict[str, Any] = {}
    for ov, kind, key in classify(optimizer, refs, layout.keys):
        if kind == "global":
            _put(globals_, key, ov, "optimizer variable")
        else:
            _put(slots, key, ov, "optimizer slot")
    return slots, globals_


def classify(optimizer: Any, references: Iterable[Any], keys: Mapping[int, str]
             ) -> Iterator[tuple[Any, str, Any]]:
    """Each of ``optimizer``'s variables as ``(variable, "global", name)`` or ``(variable,
    "slot", (model key, slot name))``, its model variable found among ``references`` by name
    ([Note: slot keys]; ``keys``: id(model variable) -> its checkpoint key).

    Raises:
        CheckpointError: a non-scalar optimizer variable matches no model variable.
    """
    prefixes = sorted(((str(v.path).replace("/", "_") + "_", v) for v in references
                       if id(v) in keys), key=lambda p: -len(p[0]))
    from tfsmp.keras.porting import rank_variables

    glob = global_names(optimizer)
    for ov in rank_variables(optimizer):  # this rank's, not the whole model's list
        name = str(ov.name)
        ref = None if id(ov) in glob else _slot_reference(name, ov, prefixes)
        if ref is None:
            if id(ov) not in glob and len(ov.shape) > 0:
                raise CheckpointError(
                    f"Every optimizer variable must belong to a model variable (named "
                    f"<variable path>_<slot>) or be a scalar. Received: optimizer variable "
                    f"'{ov.path}' of shape {tuple(ov.shape)}. Fix: use a Keras optimizer whose "
                    f"slots are created with add_variable_from_reference.")
            yield ov, "global", glob.get(id(ov), name)
            continue
        prefix, v = ref
        yield ov, "slot", (keys[id(v)], name[len(prefix):])


def _slot_reference(name: str, ov: Any, prefixes: list[tuple[str, Any]]) -> tuple[str, Any] | None:
    for prefix, v in prefixes:
        if name.startswith(prefix) and tuple(ov.shape) == tuple(v.shape):
            return prefix, v
    return None


def _put(table: dict[Any, Any], key: Any, value: Any, what: str) -> None:
    if key in table:
        raise CheckpointError(
            f"Each {what} must have a distinct name. Received: two named {key!r}. Fix: give "
            f"the layers distinct names.")
    table[key] = value


def resolve_sagemaker_path(path: str) -> str:
    """A path under ``/opt/ml`` as a job sees it: inside a local SageMaker-style job (the
    estimator sets ``SAGEMAKER_BASE_DIR``, ``SM_MODEL_DIR``, ``TFSMP_CHECKPOINT_DIR``) the job
    directory stands for ``/opt/ml``, so SMP scripts that rely on the default paths write into
    the job; elsewhere the path is returned unchanged."""
    import os

    norm = path.rstrip("/")
    local = "/opt/ml/checkpoints"  # checkpoint_local_path's default: the folder kept across attempts
    if (norm == local or norm.startswith(local + "/")) and os.environ.get("TFSMP_CHECKPOINT_DIR"):
        return os.environ["TFSMP_CHECKPOINT_DIR"] + norm[len(local):]
    if norm == "/opt/ml/model" and os.environ.get("SM_MODEL_DIR"):
        return os.environ["SM_MODEL_DIR"]
    base = os.environ.get("SAGEMAKER_BASE_DIR")
    if base and (norm == "/opt/ml" or norm.startswith("/opt/ml/")):
        return os.path.join(base, norm[len("/opt/ml/"):]) if norm != "/opt/ml" else base
    return path
