"""Rank 3 (on the second host) dies while the others wait in a barrier.

Usage: die_on_host.py kill|raise — SIGKILL itself, or raise an exception. Before dying it prints
`dying at <time.time()>` so the test can time how long the job takes to end after it.
"""

import os
import signal
import sys
import time

import tfsmp as smp

smp.init()
print(f"rank {smp.rank()} ready", flush=True)
smp.barrier()
if smp.rank() == 3:
    time.sleep(0.5)  # let the others reach the barrier first
    print(f"dying at {time.time():.3f}", flush=True)
    if sys.argv[1] == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    raise RuntimeError("boom on rank 3")
smp.barrier()
print("unreachable: the job should have been aborted", flush=True)
