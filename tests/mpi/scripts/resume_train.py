"""A tiny fit with a backup callback that a test interrupts; it must end where an uninterrupted run ends.

Usage: resume_train.py OUT_DIR (or --out OUT_DIR) [--backup keras|tfsmp] [--save-freq N|epoch] [--epochs E]
                       [--kill RANK:STEP:POINT] [--term RANK:STEP] [--host-kill-file PATH:STEP]

The config arrives as SM_HP_MP_PARAMETERS (its `seed` makes the shuffles the same in every
attempt). STEP is a global step (epoch * steps per epoch + batch). Faults fire only in the first
attempt (TFSMP_RESTART_COUNT unset or 0):
  --kill R:S:POINT  rank R SIGKILLs itself at step S; POINT is where:
                    begin  before the step starts (on_train_batch_begin)
                    mid    inside the forward pass of one of its layers, mid-pipeline
                    save   while the first backup at or after step S is written (its weights file;
                           with --backup tfsmp, its checkpoint's arrays)
                    meta   after that backup's weights file, writing training_metadata.json
  --term R:S        rank R gets SIGTERM just before step S: the job must checkpoint after S
  --host-kill-file PATH:S  rank 0 creates PATH after step S and waits there (the test then kills
                    the other host)
  --ready-file PATH:S  rank 0 creates PATH after step S; from then on every step takes 0.5 s
                    longer (the test signals the launcher meanwhile)
Rank 0 prints `FIRST {"epoch": e, "step": s}` (the first step this attempt runs) and at the end
writes OUT_DIR/final.npz with every weight and optimizer variable, and prints `DONE {...}`.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras
import numpy as np
import tensorflow as tf

import tfsmp
import tfsmp.checkpoint

STEPS_PER_EPOCH = 8
BATCH = 8
_now = {"step": -1}
ARGS = argparse.Namespace()


def _first_attempt() -> bool:
    return os.environ.get("TFSMP_RESTART_COUNT", "0") in ("", "0")


def _die(where: str) -> None:
    print(f"KILL rank {tfsmp.rank()} at step {_now['step']} ({where}) {time.time():.3f}",
          flush=True)
    os.kill(os.getpid(), signal.SIGKILL)


def _parse(spec: str | None, parts: int) -> list[str] | None:
    return spec.split(":") if spec else None


def _kill_spec() -> tuple[int, int, str] | None:
    parts = _parse(ARGS.kill, 3)
    if parts is None or not _first_attempt():
        return None
    return int(parts[0]), int(parts[1]), parts[2]


def _mid_hook() -> None:
    spec = _kill_spec()
    if spec and spec[2] == "mid" and spec[0] == tfsmp.rank() and _now["step"] == spec[1]:
        _die("mid-step, in the forward pass")


class HookedDense(keras.layers.Dense):  # type: ignore[misc]
    """A Dense layer that runs `_mid_hook` in its forward pass (a stateful op, never pruned)."""

    def call(self, inputs: tf.Tensor) -> tf.Tensor:
        tf.py_function(_mid_hook, [], [])
        return super().call(inputs)


def build() -> tfsmp.DistributedModel:
    keras.utils.set_random_seed(11)
    x = keras.Input((6,), name="x")
    h = x
    for i in range(3):
        h = HookedDense(16, activation="tanh", name=f"d{i}")(h)
    dm = tfsmp.DistributedModel(keras.Model(x, HookedDense(1, name="out")(h), name="tiny"))
    dm.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
    return dm


def data() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(5)
    x = rng.normal(size=(STEPS_PER_EPOCH * BATCH, 6)).astype(np.float32)
    return x, (np.sin(x[:, :1]) + x[:, 1:2] ** 2).astype(np.float32)


class Injector(keras.callbacks.Callback):  # type: ignore[misc]
    """Keeps the global step, reports the first step run, fires the faults."""

    def __init__(self) -> None:
        super().__init__()
        self.epoch = 0
        self.first = True

    def on_epoch_begin(self, epoch: int, logs: object = None) -> None:
        self.epoch = epoch

    def on_train_batch_begin(self, batch: int, logs: object = None) -> None:
        _now["step"] = self.epoch * STEPS_PER_EPOCH + batch
        if self.first and tfsmp.rank() == 0:
            print("FIRST " + json.dumps({"epoch": self.epoch, "step": batch}), flush=True)
        self.first = False
        spec = _kill_spec()
        if spec and spec[2] == "begin" and spec[0] == tfsmp.rank() and _now["step"] == spec[1]:
            _die("before the step")
        term = _parse(ARGS.term, 2)
        if term and _first_attempt() and int(term[0]) == tfsmp.rank() \
                and _now["step"] == int(term[1]):
            print(f"TERM rank {tfsmp.rank()} at step {_now['step']} {time.time():.3f}", flush=True)
            os.kill(os.getpid(), signal.SIGTERM)

    def on_train_batch_end(self, batch: int, logs: object = None) -> None:
        host = _parse(ARGS.host_kill_file, 2)
        if host and _first_attempt() and _now["step"] == int(host[1]) and tfsmp.rank() == 0:
            open(host[0], "w").close()
            time.sleep(120)  # the test kills the other host; this job then ends
        ready = _parse(ARGS.ready_file, 2)
        if ready and _first_attempt() and _now["step"] >= int(ready[1]):
            if tfsmp.rank() == 0 and _now["step"] == int(ready[1]):
                open(ready[0], "w").close()
            time.sleep(0.5)


def _patch_saves() -> None:
    """For POINT save/meta: die during the first backup written at or after the kill step."""
    spec = _kill_spec()
    if spec is None or spec[2] not in ("save", "meta") or spec[0] != tfsmp.rank():
        return
    from keras.src.utils import file_utils

    from tfsmp.checkpoint import export, keras_h5

    if spec[2] == "save" and ARGS.backup == "tfsmp":  # a CheckpointManager save: its arrays
        from tfsmp.checkpoint import format as fmt

        write = fmt.write_array

        def write_then_die(*args, **kwargs):  # type: ignore[no-untyped-def]
            entry = write(*args, **kwargs)
            if _now["step"] >= spec[1]:
                _die("writing the backup checkpoint's arrays")
            return entry

        fmt.write_array = write_then_die
        return
    if spec[2] == "save":
        put, send = keras_h5.WeightsWriter.put, export._send_mine

        def put_then_die(self, entry, value):  # type: ignore[no-untyped-def]
            put(self, entry, value)
            if _now["step"] >= spec[1]:
                _die("writing the backup's weights file")

        def die_sending(*args, **kwargs):  # type: ignore[no-untyped-def]
            if _now["step"] >= spec[1]:
                _die("sending its weights for the backup")
            return send(*args, **kwargs)

        keras_h5.WeightsWriter.put = put_then_die
        export._send_mine = die_sending
        return
    opened = file_utils.File

    def open_then_die(path, mode="r"):  # type: ignore[no-untyped-def]
        handle = opened(path, mode)
        if "w" in mode and str(path).endswith("training_metadata.json") \
                and _now["step"] >= spec[1]:
            _die("writing training_metadata.json (empty)")
        return handle

    file_utils.File = open_then_die


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("out", nargs="?")
    p.add_argument("--out", dest="out_option")  # as an estimator's hyperparameter
    p.add_argument("--backup", default="keras", choices=["keras", "tfsmp"])
    p.add_argument("--save-freq", default="3")
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--kill")
    p.add_argument("--term")
    p.add_argument("--host-kill-file")
    p.add_argument("--ready-file")
    p.add_argument("--backup-dir")  # default OUT_DIR/backup
    p.parse_known_args(namespace=ARGS)  # an estimator adds --model_dir
    ARGS.out = ARGS.out_option or ARGS.out
    tfsmp.init()
    freq: str | int = ARGS.save_freq if ARGS.save_freq == "epoch" else int(ARGS.save_freq)
    backup_dir = ARGS.backup_dir or os.path.join(ARGS.out, "backup")
    backup = (keras.callbacks.BackupAndRestore(backup_dir, save_freq=freq)
              if ARGS.backup == "keras" else
              tfsmp.checkpoint.BackupAndRestore(backup_dir, save_freq=freq))
    _patch_saves()
    x, y = data()
    dm = build()
    dm.fit(x, y, batch_size=BATCH, epochs=ARGS.epochs, verbose=0, callbacks=[backup, Injector()])
    weights = dm.get_weights()
    optimizer = {str(i): v for i, v in enumerate(_optimizer_state(dm))}
    if tfsmp.rank() == 0:
        np.savez(os.path.join(ARGS.out, "final.npz"),
                 **{f"w{i}": w for i, w in enumerate(weights)}, **{f"o{k}": v for k, v in
                                                                   optimizer.items()})
        print("DONE " + json.dumps({"iterations": int(dm.optimizer.iterations.numpy()),
                                    "dp_size": tfsmp.dp_size(),
                                    "backup_left": os.path.exists(backup_dir)}), flush=True)


def _optimizer_state(dm: tfsmp.DistributedModel) -> list[np.ndarray]:
    """Every optimizer variable of the whole model, in Keras's order (gathered to every rank
    through a weights file: the same file a resumed run restores from)."""
    path = os.path.join(ARGS.out, "final.weights.h5")
    dm.save_weights(path)
    import h5py

    with h5py.File(path) as f:
        group = f["optimizer/vars"]
        return [np.asarray(group[str(i)]) for i in range(len(group))]


if __name__ == "__main__":
    main()
