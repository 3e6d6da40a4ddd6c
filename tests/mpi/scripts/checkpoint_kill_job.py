"""A job the test kills with SIGKILL in the middle of writing its second checkpoint.

Usage (under mpirun, 2 ranks): checkpoint_kill_job.py DIR
Writes each rank's PID to ``DIR/kill_pids/rank<r>``, saves ``DIR/kill/ckpt-1`` (and the weights
it holds to ``DIR/kill_ckpt1.npz``), trains on, then
starts ``ckpt-2`` with every array write slowed down by ``TFSMP_TEST_SLOW_SAVE`` seconds (taken
from the environment for that save only) and prints ``SAVING 2``; the test kills it then.
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras
import numpy as np
import tensorflow as tf
from checkpoint_models import BATCH, build_mlp, mlp_data

import tfsmp

SLOW = os.environ.pop("TFSMP_TEST_SLOW_SAVE", "2")  # read at each write: off for ckpt-1
directory = sys.argv[1]
tfsmp.init({"partitions": 2, "microbatches": 4})
os.makedirs(os.path.join(directory, "kill_pids"), exist_ok=True)
with open(os.path.join(directory, "kill_pids", f"rank{tfsmp.rank()}"), "w") as f:
    f.write(str(os.getpid()))  # the test SIGKILLs exactly these processes
x, y = mlp_data()
dm = tfsmp.DistributedModel(build_mlp())
dm.compile(optimizer=keras.optimizers.Adam(1e-2), loss="mse")
manager = tfsmp.CheckpointManager(tf.train.Checkpoint(model=dm, optimizer=dm.optimizer),
                                  directory=os.path.join(directory, "kill"), max_to_keep=3)
for i in range(2):
    dm.train_on_batch(x[i * BATCH:(i + 1) * BATCH], y[i * BATCH:(i + 1) * BATCH])
manager.save()
weights = dm.get_weights()
if tfsmp.rank() == 0:
    np.savez(os.path.join(directory, "kill_ckpt1.npz"), *weights)
dm.train_on_batch(x[2 * BATCH:3 * BATCH], y[2 * BATCH:3 * BATCH])
tfsmp.barrier()
os.environ["TFSMP_TEST_SLOW_SAVE"] = SLOW
print("SAVING 2", flush=True)
manager.save()
print("SAVED 2 (the test should have killed this job)", flush=True)
