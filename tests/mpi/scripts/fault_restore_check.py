"""After a save killed part-way (fault_inject.py save_kill): the previous checkpoint restores.

Usage: python fault_restore_check.py DIR   (one process, no mpirun: partitions=1)
Prints one JSON line: what ``DIR/ckpts`` holds, which checkpoint `restore()` picked, and whether
the restored weights equal the ones the job had when it wrote that checkpoint.
"""

from __future__ import annotations

import json
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np
import tensorflow as tf
from fault_inject import build_model, data

import tfsmp


def main(directory: str) -> None:
    root = os.path.join(directory, "ckpts")
    listing = sorted(os.listdir(root))
    with open(os.path.join(root, "latest")) as f:
        latest = f.read().strip()
    tfsmp.init({"partitions": 1})
    dm = tfsmp.DistributedModel(build_model())
    dm.compile(optimizer="sgd", loss="mse")
    x, _ = data()
    dm.partition(x[:8])
    manager = tfsmp.CheckpointManager(tf.train.Checkpoint(model=dm, optimizer=dm.optimizer),
                                      directory=root)
    restored = manager.restore()
    saved = np.load(os.path.join(directory, "ckpt1_weights.npz"))
    expected = [saved[f"arr_{i}"] for i in range(len(saved.files))]
    equal = all(np.array_equal(a, b) for a, b in zip(dm.get_weights(), expected))
    print(json.dumps({"listing": listing, "latest": latest,
                      "restored": os.path.basename(restored or ""), "equal": equal}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
