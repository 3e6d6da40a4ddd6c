"""A training job that injects one real fault; the test launches it under mpirun and watches it die.

Usage: fault_inject.py MODE MARKER [DIR]
  (the config arrives as SM_HP_MP_PARAMETERS; MARKER only tags the command line so the test can
  look for processes left behind; DIR is where the save_kill mode writes its checkpoints)

Modes (the fault fires at global step FAULT_STEP unless said otherwise):
  middle    an exception inside a layer's call, only on the middle stage (partitions=3)
  caught    the same exception on stage 0 of 2, inside a fit that the script catches on every
            rank and then calls again: the job must still end at once
  sigkill   the stage-1 rank SIGKILLs itself inside its forward pass, mid-step
  callback  a Keras callback raises on world rank 1 only
  data      the tf.data generator of data replica 1 raises (partitions=2, 2 replicas)
  stall     the last stage sleeps inside its forward pass; the peers' watchdog must fire
  skip      rank 1 runs one step fewer than rank 0 (a mismatch that would hang forever)
  allreduce as skip, with partitions=1 and 2 replicas: rank 0 waits in the gradient allreduce
  save_kill rank 1 SIGKILLs itself after writing its first array of the second checkpoint

Before injecting, the faulty rank prints ``FAULT <unix time> rank <r>`` (stdout, flushed), so the
test measures the time from the fault to the end of the job. A job that survives its fault prints
``UNREACHABLE``.
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

FAULT_STEP = 3
BATCH = 8
MODE = sys.argv[1]
_step = {"now": -1}


def announce() -> None:
    print(f"FAULT {time.time():.3f} rank {tfsmp.rank()}", flush=True)


def fire() -> None:
    """The fault of the compute-path modes, run inside a layer's forward pass."""
    announce()
    if MODE in ("middle", "caught"):
        raise RuntimeError(f"injected fault in stage {tfsmp.mp_rank()} at step {_step['now']}")
    if MODE == "sigkill":
        os.kill(os.getpid(), signal.SIGKILL)
    if MODE == "stall":
        time.sleep(120)  # the peers' watchdog aborts the job long before this returns


FIRES_ON = {"middle": 1, "caught": 0, "sigkill": 1, "stall": 2}  # mode -> stage whose layer fires


def _hook() -> None:
    if _step["now"] == FAULT_STEP and tfsmp.mp_rank() == FIRES_ON.get(MODE, -1):
        fire()


class FaultDense(keras.layers.Dense):  # type: ignore[misc]
    """A Dense layer that runs `_hook` on every forward pass (a stateful op, so never pruned)."""

    def call(self, inputs: tf.Tensor) -> tf.Tensor:
        tf.py_function(_hook, [], [])
        return super().call(inputs)


def build_model(layers: int = 5) -> keras.Model:
    keras.utils.set_random_seed(3)
    x = keras.Input((8,), name="x")
    h = x
    for i in range(layers - 1):
        h = FaultDense(16, activation="tanh", name=f"d{i}")(h)
    return keras.Model(x, FaultDense(1, name="out")(h), name="faulty")


def data(n: int = 8 * BATCH) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(5)
    x = rng.normal(size=(n, 8)).astype(np.float32)
    return x, x[:, :1] * 2.0


class StepCounter(keras.callbacks.Callback):  # type: ignore[misc]
    """Keeps the global step for `_hook`; in ``callback`` mode it is also the faulty callback."""

    def __init__(self) -> None:
        super().__init__()
        self.seen = 0

    def on_train_batch_begin(self, batch: int, logs: object = None) -> None:
        _step["now"] = self.seen
        self.seen += 1

    def on_train_batch_end(self, batch: int, logs: object = None) -> None:
        if MODE == "callback" and _step["now"] == FAULT_STEP and tfsmp.rank() == 1:
            announce()
            raise RuntimeError(f"injected callback fault on rank 1 at step {FAULT_STEP}")


def compiled() -> tfsmp.DistributedModel:
    dm = tfsmp.DistributedModel(build_model())
    dm.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse")
    return dm


def run_fit() -> None:
    x, y = data()
    dm = compiled()
    dm.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0, callbacks=[StepCounter()])


def run_caught() -> None:
    """A script that catches a failed fit and trains on ([Note: a step that fails partway] in
    tfsmp/failure.py): stage 1 waits for activations stage 0 will never send. Before, rank 0
    raised into this ``except`` and rank 1 waited out stall_timeout (600 s)."""
    try:
        run_fit()
    except Exception as e:
        print(f"CAUGHT on rank {tfsmp.rank()}: {type(e).__name__}", flush=True)
    run_fit()


def run_data() -> None:
    x, y = data()
    replica = tfsmp.dp_rank()

    def batches():  # type: ignore[no-untyped-def]
        for i in range(len(x) // BATCH):
            if replica == 1 and i == FAULT_STEP:
                announce()
                raise RuntimeError(f"injected data pipeline fault on replica {replica} at batch {i}")
            yield x[i * BATCH:(i + 1) * BATCH], y[i * BATCH:(i + 1) * BATCH]

    spec = (tf.TensorSpec((BATCH, 8), tf.float32), tf.TensorSpec((BATCH, 1), tf.float32))
    ds = tf.data.Dataset.from_generator(batches, output_signature=spec)
    compiled().fit(ds, epochs=1, verbose=0, callbacks=[StepCounter()])


def lower_stall_timeout(seconds: float) -> None:
    """The stall tests warm up (trace every stage program) under a generous limit, then lower
    it: a first trace on a loaded CI machine can take longer than the short test limit."""
    object.__setattr__(tfsmp.state().config, "stall_timeout", seconds)


def run_stall() -> None:
    x, y = data()
    dm = compiled()
    counter = StepCounter()
    for i in range(2 * FAULT_STEP):
        if i == 2:
            lower_stall_timeout(3.0)
        counter.on_train_batch_begin(i)
        dm.train_on_batch(x[i * BATCH:(i + 1) * BATCH], y[i * BATCH:(i + 1) * BATCH])


def run_skip(lower: bool = True) -> None:
    """Rank 1 skips a step. With ``lower`` False the limit stays at its default (600 s): the
    watchdog finds the certain deadlock long before it ([Note: certain deadlocks])."""
    x, y = data()
    dm = compiled()
    steps = 4 if tfsmp.rank() == 0 else 3
    for i in range(steps):
        if i == 2 and lower:
            lower_stall_timeout(3.0)
        if i == 3:
            announce()  # rank 0 starts a step rank 1 will never run
        dm.train_on_batch(x[i * BATCH:(i + 1) * BATCH], y[i * BATCH:(i + 1) * BATCH])
    tfsmp.barrier()  # rank 1 waits here while rank 0 waits for a pipeline message


def run_save_kill(directory: str) -> None:
    from tfsmp.checkpoint import format as fmt

    x, y = data()
    dm = compiled()
    manager = tfsmp.CheckpointManager(tf.train.Checkpoint(model=dm, optimizer=dm.optimizer),
                                      directory=os.path.join(directory, "ckpts"))
    for i in range(2):
        dm.train_on_batch(x[i * BATCH:(i + 1) * BATCH], y[i * BATCH:(i + 1) * BATCH])
    manager.save()
    weights = dm.get_weights()
    if tfsmp.rank() == 0:
        np.savez(os.path.join(directory, "ckpt1_weights.npz"), *weights)
    dm.train_on_batch(x[2 * BATCH:3 * BATCH], y[2 * BATCH:3 * BATCH])
    write = fmt.write_array

    def write_then_die(*args, **kwargs):  # type: ignore[no-untyped-def]
        entry = write(*args, **kwargs)
        announce()
        os.kill(os.getpid(), signal.SIGKILL)
        return entry

    if tfsmp.rank() == 1:
        fmt.write_array = write_then_die
    manager.save()


def main() -> None:
    tfsmp.init()
    if MODE in ("middle", "sigkill", "callback"):
        run_fit()
    elif MODE == "caught":
        run_caught()
    elif MODE == "data":
        run_data()
    elif MODE == "stall":
        run_stall()
    elif MODE in ("skip", "allreduce"):
        run_skip()
    elif MODE == "deadlock":
        run_skip(lower=False)
    elif MODE == "save_kill":
        run_save_kill(sys.argv[3])
    else:
        raise SystemExit(f"unknown mode {MODE!r}")
    tfsmp.barrier()
    print("UNREACHABLE: the job survived its fault", flush=True)


if __name__ == "__main__":
    main()
