"""The Horovod backend: data-parallel reduction of a stage's gradients with Horovod's TF ops.

With `horovod: True`, `tfsmp.init` calls `hvd.init(comm=<a Dup of the data-parallel communicator>)`
(as SMP did; scripts must not call `hvd.init()` themselves). Horovod's world is then the ranks that
hold this rank's stage: `hvd.rank() == smp.dp_rank()`, `hvd.size() == smp.dp_size()`, and a plain
`hvd.allreduce(g)` in a script sums over the replicas of one stage only. Horovod has no
point-to-point ops, so pipeline traffic stays on mpi4py. See docs/horovod.md.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Sequence
from typing import Any

import numpy as np

from tfsmp.comm.base import Group, check_buffer
from tfsmp.comm.calls import GROUP_NAMES
from tfsmp.comm.watchdog import watched
from tfsmp.errors import CommError, ConfigError

__all__ = ["HorovodReducer", "horovod_installed", "init_horovod", "require_horovod"]

_INSTALL_HINT = "Fix: run `tfsmp install-horovod` (see docs/horovod.md), or set horovod: False."


def horovod_installed() -> bool:
    """True when a `horovod` package can be imported (cheap: does not import it)."""
    return importlib.util.find_spec("horovod") is not None


def require_horovod() -> None:
    """Raises ConfigError unless Horovod is installed (checked before any MPI setup).

    Raises:
        ConfigError: `horovod` is not importable.
    """
    if not horovod_installed():
        raise ConfigError("horovod: True needs Horovod built with TensorFlow and MPI. "
                          f"Received: horovod=True, but `import horovod` fails. {_INSTALL_HINT}")


def _import_hvd() -> Any:
    try:
        import horovod.tensorflow as hvd
    except ImportError as e:  # installed, but its TF ops do not load (TF upgraded since the build)
        raise ConfigError(f"horovod.tensorflow must import. Received: {e}. "
                          "Fix: run `tfsmp install-horovod --force`.") from e
    return hvd


class HorovodReducer:
    """Sums tensors over the data-parallel group through Horovod (after `init_horovod`).

    Example::

        reducer = init_horovod(comm.data)
        grads = reducer.grouped_allreduce(grads, average=True)
    """

    index = GROUP_NAMES.index("horovod")  # for the watchdog: [Note: watched collectives]

    def __init__(self, hvd: Any, mpi_comm: Any, ranks: Sequence[int] = ()) -> None:
        self.hvd = hvd
        self._mpi_comm = mpi_comm
        self._count = 0
        self.ranks = list(ranks)   # the data-parallel group's world ranks
        self.calls = 0

    @property
    def size(self) -> int:
        return int(self.hvd.size())

    def _name(self, name: str | None) -> str:
        # Horovod matches collectives across ranks by name; every rank calls these in the same order.
        self._count += 1
        return name or f"tfsmp_allreduce_{self._count}"

    def grouped_allreduce(self, tensors: Sequence[Any], *, average: bool = False,
                          name: str | None = None) -> list[Any]:
        """Reduces a list of tensors in one fused Horovod operation."""
        op = self.hvd.Average if average else self.hvd.Sum
        with watched(self, "grouped_allreduce"):
            return list(self.hvd.grouped_allreduce(list(tensors), op=op, name=self._name(name)))

    def allreduce_(self, buf: np.ndarray) -> None:
        """Sums a numpy buffer over the group, in place (the mpi backend's `allreduce_` contract)."""
        check_buffer(buf, writable=True)
        with watched(self, "allreduce_"):
            out = self.hvd.allreduce(buf, op=self.hvd.Sum, name=self._name(None))
            buf[...] = np.asarray(out)

    def shutdown(self) -> None:
        """Stops Horovod's background thread and frees its communicator."""
        self.hvd.shutdown()
        from mpi4py import MPI

        if not MPI.Is_finalized():
            self._mpi_comm.Free()


def init_horovod(data: Group) -> HorovodReducer:
    """Initializes Horovod on (a duplicate of) the data-parallel communicator.

    Args:
        data: The mpi backend's data-parallel group (`Comm.data`).

    Returns:
        A reducer over that group.

    Raises:
        ConfigError: Horovod is missing or its TF ops do not load.
        CommError: `data` is not an MPI group, or Horovod's size disagrees with it.
    """
    require_horovod()
    mpi_comm = getattr(data, "mpi_comm", None)
    if mpi_comm is None:
        raise CommError("horovod: True needs the mpi comm backend. Received: a "
                        f"{type(data).__name__}. Fix: launch with `tfsmp run` or mpirun.")
    hvd = _import_hvd()
    # Horovod's background thread issues collectives on its communicator; a Dup keeps them from
    # interleaving with tfsmp's own reductions on `data` (see [Note: separate communicators]).
    hvd_comm = mpi_comm.Dup()
    hvd.init(comm=hvd_comm)
    if hvd.size() != data.size or hvd.rank() != data.rank:
        raise CommError("Horovod's world must be the data-parallel group. Received: "
                        f"hvd.rank()={hvd.rank()}, hvd.size()={hvd.size()}, dp_rank={data.rank}, "
                        f"dp_size={data.size}. Fix: do not call hvd.init() before tfsmp.init().")
    _keras3_broadcast_compat(hvd)
    return HorovodReducer(hvd, hvd_comm, data.ranks)


def _keras3_broadcast_compat(hvd: Any) -> None:
    """[Note: Keras 3 variables in Horovod] SMP's hybrid scripts call
    ``hvd.broadcast_variables(model.variables, 0)``. Horovod 0.28.1 traces that into a
    tf.function, where a Keras 3 variable becomes a tensor without ``assign``; its underlying
    ``tf.Variable`` (``v.value``) works. Wrap the function once so the SMP pattern runs as
    written (tests/mpi/aws_scripts/tf2_hvd.py does)."""
    import horovod.tensorflow.functions as functions

    original = functions.broadcast_variables
    if getattr(original, "_tfsmp_compat", False):
        return

    def broadcast_variables(variables: Any, root_rank: int, *args: Any, **kwargs: Any) -> Any:
        # another stage's variables (and optimizer slots) are not held here: that stage's
        # replicas broadcast them among themselves ([Note: remote reads] in remote_reads.py)
        held = [v for v in variables if getattr(v, "_value", True) is not None]
        plain = [getattr(v, "value", v) if not hasattr(v, "assign") or
                 type(v).__module__.startswith("keras") else v for v in held]
        return original(plain, root_rank, *args, **kwargs)

    broadcast_variables._tfsmp_compat = True  # type: ignore[attr-defined]
    functions.broadcast_variables = broadcast_variables
    hvd.broadcast_variables = broadcast_variables
