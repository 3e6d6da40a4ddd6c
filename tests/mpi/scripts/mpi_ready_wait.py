"""A tiny MPI job for tests/mpi/test_one_host_exposure.py: every rank joins an allreduce (so MPI's
transports are up), writes DIR/ready-<rank>, then waits for DIR/done (at most 60 s).

    python mpi_ready_wait.py DIR MARKER
"""

from __future__ import annotations

import os
import sys
import time

from mpi4py import MPI

out = sys.argv[1]
comm = MPI.COMM_WORLD
total = comm.allreduce(comm.rank + 1)
assert total == comm.size * (comm.size + 1) // 2
comm.send(comm.rank, dest=(comm.rank + 1) % comm.size)  # point-to-point traffic too
comm.recv(source=(comm.rank - 1) % comm.size)
open(os.path.join(out, f"ready-{comm.rank}"), "w").close()
deadline = time.monotonic() + 60
while not os.path.exists(os.path.join(out, "done")) and time.monotonic() < deadline:
    time.sleep(0.05)
