"""Shapes of tensors crossing stages that are known only at run time, from input shapes alone.

Example::

    shapes = BoundaryShapes.for_plan(traced, plan)   # None when every boundary shape is static
    shapes.of(microbatch)                            # {boundary index: full shape}, cached

[Note: dynamic boundaries] A model with ``Input(shape=(None,))`` (a Transformer over sequences of
any length, a keras_hub backbone) has boundary tensors whose per-sample shape depends on the
batch. A receiver must know a message's size before it posts the receive, and receives are
posted before the step's first action ([Note: pre-posted receives] in `executor.py`; posting
late made the prototype slower than one process). Every rank of a pipeline sees the same global
batch, so each rank computes the shape of every boundary tensor itself from the microbatch's
input shapes: the traced calls that lead to the dynamic boundaries are run on
``keras.KerasTensor`` specs through each layer's ``compute_output_spec`` (a few milliseconds for
a BERT backbone; no weights are read), once per distinct input-shape signature. Nothing is
computed for a model whose boundaries are all static.

[Note: mask shapes] A Keras mask crossing stages is a boundary of its own ([Note: masks] in
`tfsmp.graph.tracer`), and ``compute_output_spec`` says nothing about masks. A call that writes a
mask is therefore run as Keras runs a layer without ``compute_output_shape``: on placeholders in
a scratch graph (`tfsmp.graph.reads.scratch_graph`), through `Call.run`, which attaches the
input masks and reads the output masks exactly as a stage does. That builds graph ops but runs
nothing and allocates no weights (variables read as placeholders).

Two checks keep a wrong shape from being silent: the sender compares each dynamic tensor it
sends with the resolved shape (a layer whose ``compute_output_spec`` disagrees with its ``call``),
and sends beside it a small header holding that shape, which the receiver compares with its own
before reading the tensor (ranks whose batches disagree, e.g. padded to different lengths).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import keras
from keras import tree

from tfsmp.errors import StepError
from tfsmp.graph.costs import accepted_kwargs
from tfsmp.graph.deferred import deferred_scope
from tfsmp.graph.reads import placeholder, scratch_graph
from tfsmp.partitioning.plan import Boundary, StagePlan

__all__ = ["BoundaryShapes", "ShapeResolver", "is_dynamic"]

Shape = tuple[int | None, ...]


def is_dynamic(shape: Iterable[int | None]) -> bool:
    """True if a per-sample shape has a dimension known only at run time."""
    return any(d is None for d in shape)


class ShapeResolver:
    """Shapes of some traced tensors for given input shapes, without running the model.

    Example::

        resolver = ShapeResolver(traced, ["encoder:0:0"])
        resolver.shapes({"tokens:0:0": (4, 12)})      # {"encoder:0:0": (4, 12, 32)}
    """

    def __init__(self, traced: Any, keys: Iterable[str]) -> None:
        self.traced = traced
        self.keys = list(dict.fromkeys(keys))
        self.calls = _ancestor_calls(traced.calls, set(self.keys))
        read = {k for c in self.calls for k in c.input_keys} | set(self.keys)
        self.input_keys = [k for k in traced.input_keys if k in read]

    def shapes(self, inputs: dict[str, Shape]) -> dict[str, Shape]:
        """The shapes (batch axis included) of ``keys`` given ``{input key: shape}``.

        Raises:
            StepError: when a layer's ``compute_output_spec`` fails for these shapes.
        """
        env: dict[str, Any] = {
            k: keras.KerasTensor(tuple(inputs[k]), dtype=self.traced.graph.tensors[k].dtype)
            for k in self.input_keys}
        with deferred_scope():  # a layer built here allocates nothing ([Note: deferred variables])
            for call in self.calls:
                _spec_call(call, env, inputs)
        return {k: tuple(env[k].shape) for k in self.keys}


def _ancestor_calls(calls: list[Any], wanted: set[str]) -> list[Any]:
    """The calls (in execution order) that the tensors ``wanted`` depend on."""
    needed, kept = set(wanted), []
    for call in reversed(calls):
        if needed.intersection(_writes(call)):
            kept.append(call)
            needed.update(call.input_keys, _masks(call.input_mask_keys))
    return kept[::-1]


def _masks(keys: Iterable[str | None]) -> list[str]:
    return [k for k in keys if k is not None]


def _writes(call: Any) -> list[str]:
    """The keys a call writes: its outputs and their masks ([Note: masks] in the tracer)."""
    return [*call.output_keys, *_masks(call.output_mask_keys)]


def _spec_call(call: Any, env: dict[str, Any], inputs: dict[str, Shape]) -> None:
    try:
        if _masks(call.output_mask_keys):
            env.update(_masked_spec(call, env))
            return
        values = {id(t): env[k] for t, k in zip(call.arguments.keras_tensors, call.input_keys)}
        args, kwargs = call.arguments.fill_in(values)
        out = call.layer.compute_output_spec(*args, **accepted_kwargs(call.layer, kwargs))
    except Exception as e:
        raise StepError(
            f"The shapes of tensors crossing stages are computed from the input shapes through "
            f"each layer's compute_output_spec. Received: layer '{call.layer_name}' raised "
            f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''} "
            f"for input shapes {dict(inputs)}. Fix the layer's compute_output_spec (or "
            f"compute_output_shape), or give the model's inputs fixed shapes.") from e
    for key, value in zip(call.output_keys, tree.flatten(out)):
        env[key] = value


def _masked_spec(call: Any, env: dict[str, Any]) -> dict[str, Any]:
    """The specs of a call's outputs and of their masks. [Note: mask shapes]"""
    reads = [*call.input_keys, *(k for k in _masks(call.input_mask_keys) if k in env)]
    writes = _writes(call)
    with scratch_graph():
        local = {k: placeholder(env[k]) for k in reads}
        call.run(local)
        return {k: keras.KerasTensor(tuple(local[k].shape), dtype=local[k].dtype.name)
                for k in writes}


class BoundaryShapes:
    """The full shape of every boundary tensor of a microbatch. See [Note: dynamic boundaries]."""

    def __init__(self, traced: Any, boundaries: Iterable[Boundary]) -> None:
        self.boundaries = list(boundaries)
        self.dynamic = [b for b in self.boundaries if is_dynamic(b.shape)]
        self.resolver = ShapeResolver(traced, [b.tensor for b in self.dynamic])
        self._cache: dict[tuple[Shape, ...], dict[int, tuple[int, ...]]] = {}

    @classmethod
    def for_plan(cls, traced: Any, plan: StagePlan) -> BoundaryShapes | None:
        """The resolver of a plan's boundaries, or None when every boundary shape is static."""
        if not any(is_dynamic(b.shape) for b in plan.boundaries):
            return None
        return cls(traced, plan.boundaries)

    def of(self, mb: Any) -> dict[int, tuple[int, ...]]:
        """``{boundary index: (microbatch size, *per-sample shape)}`` for one microbatch.

        Raises:
            StepError: when a boundary's shape does not follow from the input shapes.
        """
        signature = tuple(tuple(mb.inputs[k].shape) for k in self.resolver.input_keys)
        found = self._cache.get((mb.size, *signature))
        if found is None:
            found = self._cache[(mb.size, *signature)] = self._resolve(mb.size, signature)
        return found

    def _resolve(self, size: int, signature: tuple[Shape, ...]) -> dict[int, tuple[int, ...]]:
        inputs = dict(zip(self.resolver.input_keys, signature))
        resolved = self.resolver.shapes(inputs)
        out = {b.index: (size, *_known(b.shape)) for b in self.boundaries
               if not is_dynamic(b.shape)}
        for b in self.dynamic:
            per_sample = resolved[b.tensor][1:]
            if is_dynamic(per_sample) or len(per_sample) != len(b.shape) or any(
                    want is not None and want != got for want, got in zip(b.shape, per_sample)):
                raise StepError(
                    f"The shape of a tensor crossing stages must follow from the shapes of the "
                    f"model's inputs. Received: '{b.tensor}' has per-sample shape "
                    f"{tuple(per_sample)} (traced as {b.shape}) for input shapes {inputs}. "
                    f"Partition the model so that this tensor stays inside one stage "
                    f"(smp.partition or partition_file), or give the inputs fixed shapes.")
            out[b.index] = (size, *_known(per_sample))
        return out


def _known(shape: Shape) -> tuple[int, ...]:
    return tuple(int(d) for d in shape if d is not None)
