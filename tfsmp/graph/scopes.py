"""`smp.partition(i)`: manual placement of layers on stages, recorded while the model is traced.

Example::

    class Net(smp.DistributedModel):
        def call(self, x):
            with smp.partition(0):
                x = self.conv(x)
            with smp.partition(1):
                return self.head(x)

Honoured when ``auto_partition`` is false (SMP's rule; ignored otherwise); layers called outside
any scope go to ``default_partition``. The innermost scope wins. A layer called under two
different scopes would need its variables on two stages: that is an error naming the layer.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

from tfsmp.errors import PartitionError

__all__ = ["partition", "recording"]

_local = threading.local()


def _stack() -> list[int]:
    if not hasattr(_local, "stack"):
        _local.stack = []
    return _local.stack  # type: ignore[no-any-return]


@contextlib.contextmanager
def partition(index: int) -> Iterator[None]:
    """Places every layer called inside this scope on stage ``index`` (see the module doc)."""
    if not isinstance(index, int) or isinstance(index, bool) or index < 0:
        raise PartitionError(
            f"smp.partition takes a stage index >= 0. Received: index={index!r}")
    _stack().append(index)
    try:
        yield
    finally:
        _stack().pop()


@contextlib.contextmanager
def recording() -> Iterator[dict[int, tuple[str, int]]]:
    """While active, records ``id(operation) -> (name, stage)`` for every Keras operation
    (layer or `keras.ops` call) called inside an `smp.partition` scope."""
    from keras.src.ops.operation import Operation

    placed: dict[int, tuple[str, int]] = {}
    original = Operation.__call__

    def record(op: Any, *args: Any, **kwargs: Any) -> Any:
        stack = _stack()
        if stack:
            stage = stack[-1]
            seen = placed.get(id(op))
            if seen is not None and seen[1] != stage:
                raise PartitionError(
                    f"A layer's variables live on one stage, so a layer cannot be called under "
                    f"two smp.partition scopes. Received: '{op.name}' called under "
                    f"smp.partition({seen[1]}) and smp.partition({stage}). Call it under one "
                    f"scope (shared/tied layers must share a stage).")
            placed.setdefault(id(op), (op.name, stage))
        return original(op, *args, **kwargs)

    Operation.__call__ = record
    try:
        yield placed
    finally:
        Operation.__call__ = original


def assignment(traced: Any, placed: dict[int, tuple[str, int]]) -> dict[str, int]:
    """Layer name (as traced) -> stage, for the operations recorded inside scopes."""
    out: dict[str, int] = {}
    for call in traced.calls:
        hit = placed.get(id(call.layer))
        if hit is not None:
            out[call.layer_name] = hit[1]
    return out
