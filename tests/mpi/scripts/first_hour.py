"""Scripts of a new user's first hour (tests/mpi/test_first_hour_ranks.py), chosen by argv[1].

typo:   every rank calls init with a misspelt key.
rank1:  only rank 1 does (rank 0's init is fine and waits for rank 1 in MPI).
tf:     imports TensorFlow, then a good init: prints what TensorFlow printed at start-up.
"""

import os
import sys

mode = sys.argv[1]
rank = int(os.environ.get("OMPI_COMM_WORLD_RANK", "0"))
if mode == "tf":
    import tensorflow as tf  # noqa: F401  (its start-up lines are the point)
import tfsmp as smp  # noqa: E402  (after TensorFlow in mode "tf", as a script would)

bad = mode == "typo" or (mode == "rank1" and rank == 1)
smp.init({"partitons": 2} if bad else {"partitions": 2})
print(f"rank {smp.rank()} initialized", flush=True)
smp.barrier()
