"""Package attributes that import their module on first use, so that ``import tfsmp`` (and
``tfsmp.graph``, ``tfsmp.checkpoint``) loads neither TensorFlow, Keras nor mpi4py.

Example (a package's ``__init__.py``)::

    _NAMES = LazyNames(__name__, {"trace": "tfsmp.graph.tracer"})

    def __getattr__(name: str) -> Any:
        return _NAMES.resolve(name)

    def __dir__() -> list[str]:
        return _NAMES.listing()

[Note: one lazy lookup] The module-level ``__getattr__`` stays a plain function in each package
(type checkers read only a `def` as the package's fallback), and it only delegates here.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Iterable, Mapping
from typing import Any

__all__ = ["LazyNames"]


class LazyNames:
    """A package's lazily imported names: ``names`` maps a public name to its defining module,
    ``submodules`` are the package's modules reachable as attributes, and ``before(module)``
    runs before a name's module is imported."""

    def __init__(self, package: str, names: Mapping[str, str], *,
                 submodules: Iterable[str] = (),
                 before: Callable[[str], None] | None = None) -> None:
        self.package = package
        self.names = dict(names)
        self.submodules = frozenset(submodules)
        self.before = before

    def resolve(self, name: str) -> Any:
        """The attribute ``name``, imported now and cached in the package."""
        if name in self.submodules:
            return importlib.import_module(f"{self.package}.{name}")
        module = self.names.get(name)
        if module is None:
            raise AttributeError(f"module '{self.package}' has no attribute '{name}'")
        if self.before is not None:
            self.before(module)
        value = getattr(importlib.import_module(module), name)
        vars(sys.modules[self.package])[name] = value
        return value

    def listing(self) -> list[str]:
        """``dir(package)``: what it holds now and what it can import."""
        return sorted(set(vars(sys.modules[self.package])) | set(self.names))
