"""Metrics updated inside an `smp.step`: found from the step function, given to every rank.

Example::

    @smp.step
    def test_step(images, labels):
        predictions = model(images, training=False)
        test_accuracy(labels, predictions)        # runs on the last stage, with real outputs
        return loss_object(labels, predictions)

    test_step(x, y)
    test_accuracy.result()                        # the same value on every rank of the pipeline

[Note: metrics in a step] Only the last stage runs the body past the model call (module
docstring of `tfsmp.keras.step`), so a metric updated there changes on that rank only. While the
body runs, every eager ``assign`` to a Keras variable is recorded. After the step, the last
stage sends the new values of the recorded variables with the step's outputs; every other rank
of the pipeline finds the same variables among the metrics its step function refers to (globals,
closure cells, attributes of those, one or two levels deep: the same objects on every rank,
since every rank runs the same script) and assigns them. A recorded variable that is neither a
model weight nor a variable of such a metric raises a StepError on every rank: it would
otherwise hold a value on the last stage and a stale one elsewhere.
"""

from __future__ import annotations

import inspect
import types
from collections.abc import Callable, Iterator
from typing import Any

import keras
import numpy as np
import tensorflow as tf

from tfsmp.errors import StepError

__all__ = ["MetricSync", "code_names", "referenced_metrics"]

_MAX_DEPTH = 3


def code_names(code: types.CodeType) -> Iterator[str]:
    """The global and attribute names ``code`` (and the functions nested in it) uses."""
    yield from code.co_names
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            yield from code_names(const)


def referenced_metrics(fn: Callable[..., Any]) -> list[keras.metrics.Metric]:
    """The Keras metrics ``fn`` can reach through its globals and closure cells (and their
    containers and attributes), in a deterministic order."""
    found: dict[int, keras.metrics.Metric] = {}
    seen: set[int] = set()

    def visit(value: Any, depth: int) -> None:
        if depth > _MAX_DEPTH or id(value) in seen:
            return
        seen.add(id(value))
        if isinstance(value, keras.metrics.Metric):
            found.setdefault(id(value), value)
        elif isinstance(value, (list, tuple)):
            for item in value:
                visit(item, depth + 1)
        elif isinstance(value, dict):
            for item in list(value.values()):
                visit(item, depth + 1)
        elif inspect.ismethod(value):
            visit(value.__self__, depth + 1)
            visit_function(value.__func__, depth + 1)
        elif inspect.isfunction(value):
            visit_function(value, depth + 1)
        elif isinstance(value, (types.ModuleType, type)) or not hasattr(value, "__dict__"):
            return
        else:
            for item in list(vars(value).values()):
                if isinstance(item, (keras.metrics.Metric, list, tuple, dict)):
                    visit(item, depth + 1)

    def visit_function(f: Any, depth: int) -> None:
        code = getattr(f, "__code__", None)
        if code is None:
            return
        names = dict.fromkeys(code_names(code))
        for name in names:
            if name in f.__globals__:
                visit(f.__globals__[name], depth)
        for cell in f.__closure__ or ():
            try:
                visit(cell.cell_contents, depth)
            except ValueError:  # an empty cell
                continue

    visit_function(inspect.unwrap(fn), 0)
    return list(found.values())


class MetricSync:
    """The metric state one step call changed on the last stage, and its copy to the others.

    See [Note: metrics in a step]."""

    def __init__(self, fn: Callable[..., Any], model_ids: set[int]) -> None:
        self.fn_name = getattr(fn, "__name__", "step")
        self.variables: list[Any] = []
        ids: set[int] = set()
        for metric in referenced_metrics(fn):
            for v in metric.variables:
                if id(v) not in ids:
                    ids.add(id(v))
                    self.variables.append(v)
        self.index = {id(v): i for i, v in enumerate(self.variables)}
        self.model_ids = model_ids  # the rank's model weights: the stage programs update them
        self.assigned: dict[int, Any] = {}

    def record(self, variable: Any) -> None:
        """Called for every Keras variable assignment while the body runs on the last stage."""
        if tf.executing_eagerly() and id(variable) not in self.model_ids:
            self.assigned.setdefault(id(variable), variable)

    def payload(self) -> dict[str, Any]:
        """What the last stage sends: (index, path, value) of each changed metric variable."""
        updates, unknown = [], []
        for vid, v in self.assigned.items():
            i = self.index.get(vid)
            if i is None:
                unknown.append(str(getattr(v, "path", getattr(v, "name", "?"))))
            else:
                updates.append((i, str(v.path), np.asarray(v.numpy())))
        return {"updates": updates, "unknown": unknown}

    def apply(self, state: dict[str, Any], is_last: bool) -> None:
        """Every rank: raise for variables no rank can match, else take the last stage's values."""
        if state["unknown"]:
            raise StepError(
                f"A variable updated inside an smp.step must be a model weight or belong to a "
                f"Keras metric the step function refers to (a global, a closure variable, or an "
                f"attribute of one), so that tfsmp can give its value to every rank: only the "
                f"last stage runs the step past the model call. Received: {self.fn_name} "
                f"updated {state['unknown']}. Fix: refer to the metric from {self.fn_name} "
                f"directly, or update it outside the step from the step's outputs, e.g. "
                f"`metric(labels, predictions.merge())`.")
        for i, path, value in state["updates"]:
            if i >= len(self.variables) or str(self.variables[i].path) != path:
                mine = str(self.variables[i].path) if i < len(self.variables) else "nothing"
                raise StepError(
                    f"Every rank must build the same metrics in the same order (each rank runs "
                    f"the same script). Received: the last stage updated metric variable "
                    f"{path!r} (number {i} of those {self.fn_name} refers to), but this rank "
                    f"has {mine!r} there. Fix: create metrics the same way on every rank.")
            if not is_last:
                self.variables[i].assign(value)
