"""Runs one of the verbatim AWS checkpoint scripts in this folder, then reports what it left.

    mpirun -np 2 python -m mpi4py aws_ckpt_runner.py SCRIPT [--cwd DIR] [--report NAME]

The script runs unchanged through ``runpy`` (as ``__main__``, in ``--cwd``); its own asserts
stay its own. Afterwards every rank prints one JSON line ``{"rank", "report"}`` built from the
script's globals, which `tests/mpi/test_aws_checkpoint_scripts.py` holds against a plain-Keras
reference computed here by code of ours (``tf2_checkpoint_test``: the same model, optimizer and
5 steps on the same data, with TF's own tape).
"""

from __future__ import annotations

import argparse
import json
import os
import runpy
import sys
from collections.abc import Callable
from typing import Any

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


def _plain_reference() -> dict[str, Any]:
    """tf2_checkpoint_test.py's training in one process: losses of the 5 steps, weights after 2."""
    import numpy as np
    import tensorflow as tf
    from tensorflow.keras.layers import Dense

    d1 = Dense(4, activation="relu", kernel_initializer=tf.keras.initializers.GlorotNormal(seed=192))
    d2 = Dense(1, kernel_initializer=tf.keras.initializers.GlorotNormal(seed=126))
    model = tf.keras.Sequential([tf.keras.Input((1,)), d1, d2])
    schedule = tf.keras.optimizers.schedules.ExponentialDecay(0.085, decay_steps=5,
                                                              decay_rate=0.96, staircase=False)
    optimizer = tf.keras.optimizers.Adam(learning_rate=schedule)
    x, y = np.ones((8, 1), np.float32), np.ones((8, 1), np.float32) * 2
    losses, after_two = [], None
    for step in range(5):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.keras.losses.MSE(y, model(x)))
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        losses.append(float(loss))
        if step == 1:
            after_two = [w.tolist() for w in model.get_weights()]
    return {"losses": losses, "weights_after_2": after_two}


def _report_tf2_checkpoint_test(g: dict[str, Any]) -> dict[str, Any]:
    directory = g["checkpoint_directory"]
    return {"loss_list": [float(v) for v in g["loss_list"]],
            "test_var": float(g["test_variable"].numpy()),
            "iterations": int(g["optimizer"].iterations.numpy()),
            "weights": [w.tolist() for w in g["model"].get_weights()],
            "checkpoints": sorted(os.listdir(directory)) if os.path.isdir(directory) else [],
            "marker": _first_line(os.path.join(directory, "mp_rank_1", "checkpoint")),
            "reference": _plain_reference()}


def _first_line(path: str) -> str:
    if not os.path.isfile(path):
        return ""
    with open(path) as f:
        return f.readline().strip()


def _report_none(g: dict[str, Any]) -> dict[str, Any]:
    return {}


REPORTS: dict[str, Callable[[dict[str, Any]], dict[str, Any]]] = {
    "none": _report_none, "tf2_checkpoint_test": _report_tf2_checkpoint_test}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("script")
    parser.add_argument("--cwd", default=None)
    parser.add_argument("--report", choices=sorted(REPORTS), default="none")
    args, rest = parser.parse_known_args()
    script = os.path.abspath(args.script)
    if args.cwd:
        os.chdir(args.cwd)
    sys.argv = [script, *rest]
    g = runpy.run_path(script, run_name="__main__")
    from mpi4py import MPI

    report = REPORTS[args.report](g)
    print(json.dumps({"rank": MPI.COMM_WORLD.Get_rank(), "report": report}), flush=True)


if __name__ == "__main__":
    main()
