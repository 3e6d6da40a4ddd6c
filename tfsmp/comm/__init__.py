"""Communication seam: one `Comm` interface over mpi4py (`mpi`) or threads (`local`).

mpi4py is imported only when an MPI communicator is created, so importing this package is cheap.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from tfsmp.comm.base import REDUCE_OPS, Comm, Group, Request, waitall
from tfsmp.comm.calls import collective_label
from tfsmp.comm.local import create_local_comms

if TYPE_CHECKING:
    from tfsmp.topology import Topology

__all__ = ["REDUCE_OPS", "Comm", "Group", "Request", "collective_label", "create_local_comms",
           "create_mpi_comm", "waitall"]


def create_mpi_comm(topology: Topology) -> Comm:
    """Builds this rank's `Comm` from MPI's COMM_WORLD (see `tfsmp.comm.mpi.create_mpi_comm`)."""
    from tfsmp.comm.mpi import create_mpi_comm as create

    return create(topology)
