"""A job that stops, kills or skips a rank around tfsmp's collectives; the test watches it end.

Usage: fault_collectives.py MODE MARKER DIR [RANK STEP]
  (the config arrives as SM_HP_MP_PARAMETERS; MARKER only tags the command line so the test can
  look for processes left behind; DIR holds checkpoints; RANK and STEP say where the fault fires)

Modes:
  stop_between  RANK SIGSTOPs itself after step STEP (in on_train_batch_end): its peers wait in
                fit's next per-step collective
  kill_between  the same with SIGKILL
  stop_backup   stop_between in a fit with Keras's BackupAndRestore: the peers wait in the
                per-step preemption check
  stop_mid      RANK SIGSTOPs itself inside its forward pass of step STEP
  stop_save     RANK SIGSTOPs itself after writing its first array of a CheckpointManager save
  kill_save     the same with SIGKILL
  get_weights   only rank 0 calls get_weights() (`if rank == 0`), rank 1 ends its script
  save          only rank 0 calls model.save(...)
  no_compile    every rank calls fit without compile (a tfsmp error after init)
  bad_label     a sparse label out of range in batch 2 (the last stage's loss fails)

The job trains under stall_timeout=600 until its stage programs are traced, then lowers it to
STALL_TIMEOUT (a first trace on a loaded machine may take longer). The faulty rank prints
``FAULT <unix time> rank <r>`` just before the fault; a job that survives prints ``UNREACHABLE``.
"""

from __future__ import annotations

import os
import signal
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras
import numpy as np
import tensorflow as tf

import tfsmp

STALL_TIMEOUT = 5.0
BATCH = 8
MODE, DIRECTORY = sys.argv[1], sys.argv[3]
RANK = int(sys.argv[4]) if len(sys.argv) > 4 else 1
STEP = int(sys.argv[5]) if len(sys.argv) > 5 else 3
_step = {"now": -1}
BETWEEN = ("stop_between", "kill_between", "stop_backup")


def fault(sig: int) -> None:
    print(f"FAULT {time.time():.3f} rank {tfsmp.rank()}", flush=True)
    os.kill(os.getpid(), sig)


def _hook() -> None:
    if MODE == "stop_mid" and _step["now"] == STEP and tfsmp.rank() == RANK:
        fault(signal.SIGSTOP)


class HookDense(keras.layers.Dense):  # type: ignore[misc]
    def call(self, inputs: tf.Tensor) -> tf.Tensor:
        tf.py_function(_hook, [], [])
        return super().call(inputs)


def build_model() -> keras.Model:
    keras.utils.set_random_seed(3)
    x = keras.Input((8,), name="x")
    h = x
    for i in range(3):
        h = HookDense(16, activation="tanh", name=f"d{i}")(h)
    return keras.Model(x, HookDense(1, name="out")(h), name="faulty")


def data(n: int = 8 * BATCH) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(5)
    x = rng.normal(size=(n, 8)).astype(np.float32)
    return x, x[:, :1] * 2.0


def lower_stall_timeout() -> None:
    object.__setattr__(tfsmp.state().config, "stall_timeout", STALL_TIMEOUT)


class Faults(keras.callbacks.Callback):  # type: ignore[misc]
    def __init__(self) -> None:
        super().__init__()
        self.seen = 0

    def on_train_batch_begin(self, batch: int, logs: object = None) -> None:
        _step["now"] = self.seen
        if self.seen == 1:
            lower_stall_timeout()
        self.seen += 1

    def on_train_batch_end(self, batch: int, logs: object = None) -> None:
        if _step["now"] == STEP and tfsmp.rank() == RANK and MODE in BETWEEN:
            fault(signal.SIGSTOP if MODE.startswith("stop") else signal.SIGKILL)


def compiled() -> tfsmp.DistributedModel:
    dm = tfsmp.DistributedModel(build_model())
    dm.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse")
    return dm


def run_fit() -> None:
    x, y = data()
    callbacks: list[keras.callbacks.Callback] = [Faults()]
    if MODE == "stop_backup":
        callbacks.append(keras.callbacks.BackupAndRestore(os.path.join(DIRECTORY, "backup")))
    compiled().fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0,
                   callbacks=callbacks)


def run_save() -> None:
    from tfsmp.checkpoint import format as fmt

    x, y = data()
    dm = compiled()
    manager = tfsmp.CheckpointManager(tf.train.Checkpoint(model=dm, optimizer=dm.optimizer),
                                      directory=os.path.join(DIRECTORY, "ckpts"))
    for i in range(2):
        dm.train_on_batch(x[i * BATCH:(i + 1) * BATCH], y[i * BATCH:(i + 1) * BATCH])
    lower_stall_timeout()
    write = fmt.write_array

    def write_then_fault(*args, **kwargs):  # type: ignore[no-untyped-def]
        entry = write(*args, **kwargs)
        fault(signal.SIGSTOP if MODE == "stop_save" else signal.SIGKILL)
        return entry

    if tfsmp.rank() == RANK:
        fmt.write_array = write_then_fault
    manager.save()


def run_one_rank_only() -> None:
    x, y = data()
    dm = compiled()
    dm.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    lower_stall_timeout()
    if tfsmp.rank() == 0:
        print(f"FAULT {time.time():.3f} rank 0", flush=True)
        if MODE == "get_weights":
            dm.get_weights()
        else:
            dm.save(os.path.join(DIRECTORY, "model.keras"))
        print("UNREACHABLE: the one-rank call returned", flush=True)


def run_different_calls() -> None:
    """Rank 0 evaluates while rank 1 predicts: their first collectives meet at one call number
    ([Note: the same call] in tfsmp/comm/calls.py)."""
    x, y = data()
    dm = compiled()
    dm.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    print(f"FAULT {time.time():.3f} rank {tfsmp.rank()}", flush=True)
    if tfsmp.rank() == 0:
        dm.evaluate(x, y, batch_size=BATCH, verbose=0)
    else:
        dm.predict(x, batch_size=BATCH, verbose=0)
    print("UNREACHABLE: the different calls returned", flush=True)


def run_no_compile() -> None:
    x, y = data()
    dm = tfsmp.DistributedModel(build_model())
    print(f"FAULT {time.time():.3f} rank {tfsmp.rank()}", flush=True)
    dm.fit(x, y, batch_size=BATCH, epochs=1, verbose=0)


def run_bad_label() -> None:
    keras.utils.set_random_seed(3)
    x = keras.Input((8,), name="x")
    h = keras.layers.Dense(16, activation="tanh", name="d0")(x)
    h = keras.layers.Dense(16, activation="tanh", name="d1")(h)
    dm = tfsmp.DistributedModel(keras.Model(x, keras.layers.Dense(3, name="out")(h)))
    dm.compile(optimizer=keras.optimizers.SGD(0.01),
               loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    features, _ = data()
    labels = np.zeros((len(features),), np.int32)
    labels[2 * BATCH + 1] = 5  # classes are 0, 1, 2
    print(f"FAULT {time.time():.3f} rank {tfsmp.rank()}", flush=True)
    dm.fit(features, labels, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)


def main() -> None:
    tfsmp.init()
    if MODE in (*BETWEEN, "stop_mid"):
        run_fit()
    elif MODE in ("stop_save", "kill_save"):
        run_save()
    elif MODE in ("get_weights", "save"):
        run_one_rank_only()
        return  # rank 1 ends its script here; rank 0 waits in the collective
    elif MODE == "no_compile":
        run_no_compile()
    elif MODE == "different_calls":
        run_different_calls()
    elif MODE == "bad_label":
        run_bad_label()
    else:
        raise SystemExit(f"unknown mode {MODE!r}")
    tfsmp.barrier()
    print("UNREACHABLE: the job survived its fault", flush=True)


if __name__ == "__main__":
    main()
