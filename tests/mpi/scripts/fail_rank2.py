"""Rank 2 raises while the other ranks wait (rank 0 in recv_from(2), the rest in a barrier).

Usage: fail_rank2.py [main|thread] — where rank 2's exception is raised.
"""

import sys
import threading
import time

import tfsmp as smp


def explode() -> None:
    raise RuntimeError("boom on rank 2")


smp.init({"partitions": 2})
mode = sys.argv[1] if len(sys.argv) > 1 else "main"
print(f"rank {smp.rank()} ready", flush=True)
if smp.rank() == 2:
    time.sleep(0.5)  # let the others reach their waits first
    if mode == "thread":
        worker = threading.Thread(target=explode, name="stage-worker")
        worker.start()
        worker.join()
        time.sleep(30)  # the thread's failure must end the job; never reached
    else:
        explode()
elif smp.rank() == 0:
    smp.recv_from(2)
else:
    smp.barrier()
print("unreachable: the job should have been aborted", flush=True)
