"""The layer graph (pure IR) and, imported lazily, the Keras tracer, cost model and deferred init.

``import tfsmp.graph`` and ``tfsmp.graph.ir`` import neither TensorFlow nor Keras; the names
below that need them resolve on first use.
"""

from __future__ import annotations

from typing import Any

from tfsmp.graph.ir import LayerGraph, LayerNode, TensorInfo
from tfsmp.lazy import LazyNames

# public name -> module that defines it (these import Keras/TensorFlow)
_LAZY: dict[str, str] = {
    "Call": "tfsmp.graph.tracer",
    "TracedModel": "tfsmp.graph.tracer",
    "trace": "tfsmp.graph.tracer",
    "profile": "tfsmp.graph.costs",
    "deferred_scope": "tfsmp.graph.deferred",
    "is_deferred": "tfsmp.graph.deferred",
    "materialize": "tfsmp.graph.deferred",
    "release": "tfsmp.graph.deferred",
}

__all__ = ["LayerGraph", "LayerNode", "TensorInfo", *sorted(_LAZY)]


_NAMES = LazyNames(__name__, _LAZY)


def __getattr__(name: str) -> Any:
    return _NAMES.resolve(name)


def __dir__() -> list[str]:
    return _NAMES.listing()
