"""Keras hooks a user may override, and what a pipelined model does with each: run it or refuse it.

Example::

    check_overrides(distributed_model, "fit", rank_tag="[rank 0]")   # before any work

[Note: user overrides] Keras lets a model's class override the steps of its training loop.
A pipelined model runs each step as a schedule of stage programs across ranks, so a Python
override of a whole step cannot run as written: tfsmp never calls it, and training through it
silently would give other numbers than the user's code asks for. Every such hook is listed in
`HOOKS` with what tfsmp does; an overridden hook that tfsmp cannot honour is refused before any
work, on every rank, naming the hook and the way out. Hooks on layers (``call``,
``compute_mask``, ``build``, ``add_loss``...) run as written on their stage; hooks on optimizers
(``apply_gradients``, ``apply``, ``update_step``, ``_clip_gradients``) run as written on every
rank ([Note: optimizer options] in tfsmp/runtime/optimizer_options.py).
"""

from __future__ import annotations

from typing import Any

import keras

from tfsmp.errors import StepError
from tfsmp.runtime.memory import is_multi_optimizer

__all__ = ["HOOKS", "check_overrides", "check_trainable"]

# hook -> (the entry points it belongs to, why a pipeline cannot run it, what to do instead)
HOOKS: dict[str, tuple[tuple[str, ...], str]] = {
    "train_step": (("fit", "train_on_batch"),
                   "fit runs its step as stage programs on several ranks"),
    "test_step": (("fit", "evaluate", "test_on_batch"),
                  "evaluate runs its step as stage programs on several ranks"),
    "predict_step": (("predict", "predict_on_batch"),
                     "predict runs its step as stage programs on several ranks"),
    "compute_metrics": (("fit", "evaluate", "train_on_batch", "test_on_batch"),
                        "metrics are updated per microbatch on the last stage"),
    "make_train_function": (("fit", "train_on_batch"), "there is no single train function"),
    "make_test_function": (("fit", "evaluate", "test_on_batch"), "there is no single test function"),
    "make_predict_function": (("predict", "predict_on_batch"),
                              "there is no single predict function"),
}


def _overridden(obj: Any, name: str, base: type) -> bool:
    mine = getattr(type(obj), name, None)
    return mine is not None and mine is not getattr(base, name, None)


def check_overrides(model: Any, entry: str, *, rank_tag: str = "") -> None:
    """Refuses an override of a Keras hook that ``entry`` (fit, evaluate, predict...) would
    bypass, on the wrapped model's class or on a `DistributedModel` subclass ([Note: user
    overrides]).

    Raises:
        StepError: naming the hook, the class and what to do instead.
    """
    from tfsmp.keras.model import DistributedModel

    wrapped = getattr(model, "wrapped", None)
    owners = [(model, DistributedModel)] + ([(wrapped, keras.Model)] if wrapped is not None else [])
    for obj, base in owners:
        for name, (entries, why) in HOOKS.items():
            if entry in entries and _overridden(obj, name, base):
                raise StepError(
                    f"{rank_tag} A pipelined model cannot run a model's own {name}(): {why}. "
                    f"Received: {type(obj).__name__}.{name} overrides Keras's, for "
                    f"{entry}(). Move the custom logic into compute_loss(), layers, losses, metrics or "
                    f"callbacks (which tfsmp runs as written), or write the step with "
                    f"@smp.step (docs/keras_semantics.md).".strip())


# [Note: what a pipeline cannot train] Two things a model or optimizer may do that a pipelined
# step cannot honour exactly, refused before any work (on every rank alike, since every rank
# runs the same script):
# - an optimizer class that overrides ``apply`` or ``apply_gradients`` may read every gradient
#   at once (a global statistic, a schedule-free optimizer's own copies of the weights); with
#   several pipeline ranks each rank's optimizer sees its own stages' gradients only. Keras's
#   own optimizers, and overrides of ``update_step`` (one variable at a time), are fine.
# - Keras's MultiOptimizer keeps one optimizer per group of variables, each counting its own
#   steps. Each pipeline rank's MultiOptimizer holds only its own stages' variables, and a
#   sub-optimizer whose variables all live on other ranks counts the steps there anyway
#   ([Note: sub-optimizers elsewhere] in tfsmp/runtime/updates.py), which needs to know which
#   sub-optimizer every variable of the model has: given by an ``OptimizerMap`` (a lookup), not
#   by a function, which may make a new optimizer per call. A function map is refused at
#   partitions > 1.
# - a stateful RNN carries its state from one batch's rows to the next batch's same rows; split
#   into microbatches (or replicas), a batch's rows no longer meet their own state.
_KERAS_APPLY_OWNERS = ("keras.src.optimizers.",)


def _applies_all_at_once(optimizer: Any) -> str | None:
    """The name of the overridden method of a user optimizer class, or None."""
    from keras.src.optimizers.base_optimizer import BaseOptimizer

    for cls in type(optimizer).__mro__:
        if cls is BaseOptimizer or cls.__module__.startswith(_KERAS_APPLY_OWNERS):
            return None
        for name in ("apply", "apply_gradients"):
            if name in vars(cls):
                return f"{cls.__name__}.{name}"
    return None


def check_trainable(model: Any, *, pipeline_ranks: int, parts: int, rank_tag: str = "") -> None:
    """Refuses what a pipelined training step cannot honour ([Note: what a pipeline cannot
    train]): ``pipeline_ranks`` = partitions, ``parts`` = microbatches × data replicas.

    Raises:
        StepError: naming the optimizer method or the layer, and the way out.
    """
    optimizer = getattr(model, "optimizer", None)
    inner = getattr(optimizer, "inner_optimizer", optimizer)
    method = _applies_all_at_once(inner) if inner is not None and pipeline_ranks > 1 else None
    mapping = getattr(inner, "_optimizer_map", None)  # Keras keeps the map there alone
    if (pipeline_ranks > 1 and is_multi_optimizer(inner)
            and not isinstance(mapping, keras.optimizers.OptimizerMap)):
        raise StepError(
            f"{rank_tag} A MultiOptimizer at partitions > 1 must say by an OptimizerMap which "
            f"sub-optimizer updates each variable: each pipeline rank holds only its own "
            f"stages' variables, and counts the steps of sub-optimizers whose variables live "
            f"on other ranks, as plain Keras's does. Received: a MultiOptimizer mapping by "
            f"{type(mapping).__name__} with partitions={pipeline_ranks}. Fix: "
            f"MultiOptimizer(keras.optimizers.OptimizerMap(default, {{'<path regex>': "
            f"optimizer}})), or train with partitions=1.")
    if method is not None:
        raise StepError(
            f"{rank_tag} An optimizer that overrides apply() or apply_gradients() may read every "
            f"gradient at once, but each pipeline rank's optimizer sees only its own stages' "
            f"gradients. Received: {method} with partitions={pipeline_ranks}. Override "
            f"update_step() (one variable at a time) instead, or train with partitions=1.")
    if parts <= 1:
        return
    source = model.source_model()
    stateful = [layer.name for layer in source._flatten_layers(include_self=False)
                if getattr(layer, "stateful", False)]
    if stateful:
        raise StepError(
            f"{rank_tag} A stateful RNN carries its state from one batch's rows to the next "
            f"batch's, which a batch split into microbatches or replicas cannot do. Received: "
            f"stateful layer(s) {stateful} with {parts} parts per batch (microbatches × data "
            f"replicas). Fix: microbatches=1 and one replica per stage, or stateful=False.")
