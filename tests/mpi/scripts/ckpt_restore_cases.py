"""Restore and load before the first step on 2 stages, and SMP's file helpers (cases for
`tests/mpi/test_aws_checkpoint_scripts.py`, run by `tests/mpi/cases_runner.py`).

Files go to ``$TFSMP_CKPT_CASES_DIR``. Every case re-initializes tfsmp (p=2, m=2).
"""

from __future__ import annotations

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from typing import Any

import keras
import numpy as np
import tensorflow as tf

import tfsmp
import tfsmp.utils

DIR = os.environ.get("TFSMP_CKPT_CASES_DIR", "/tmp/tfsmp_ckpt_restore_cases")
BATCH = 8


def _init() -> None:
    if tfsmp.is_initialized():
        tfsmp.shutdown()
    tfsmp.init({"partitions": 2, "microbatches": 2})


def _model(seed: int) -> keras.Model:
    keras.utils.set_random_seed(seed)
    x = keras.Input((6,), name="x")
    h = keras.layers.Dense(8, activation="tanh", name="d0")(x)
    h = keras.layers.Dense(8, activation="tanh", name="d1")(h)
    return keras.Model(x, keras.layers.Dense(3, name="head")(h), name="net")


def _dm(seed: int) -> tfsmp.DistributedModel:
    dm = tfsmp.DistributedModel(_model(seed))
    dm.compile(optimizer=keras.optimizers.Adam(0.05), loss="mse")
    return dm


def _data(i: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(100 + i)
    return (rng.normal(size=(BATCH, 6)).astype("float32"),
            rng.normal(size=(BATCH, 3)).astype("float32"))


def _manager(dm: tfsmp.DistributedModel, name: str, **extras: Any) -> tfsmp.CheckpointManager:
    ckpt = tf.train.Checkpoint(model=dm, optimizer=dm.optimizer, **extras)
    return tfsmp.CheckpointManager(ckpt, directory=os.path.join(DIR, name))


def _diff(a: list[np.ndarray], b: list[np.ndarray]) -> float:
    if len(a) != len(b):
        return float("inf")
    return max(float(np.max(np.abs(u - v))) for u, v in zip(a, b))


def case_restore_before_first_step_is_visible(ctx: Any) -> dict[str, float]:
    """A checkpoint restored at step 0 shows in get_weights, a weights file and a variable read,
    and training continues as the saving model does (the optimizer state follows)."""
    _init()
    saved = _dm(seed=1)
    for i in range(2):
        saved.train_on_batch(*_data(i))
    epoch = tf.Variable(7.0)
    _manager(saved, "visible", epoch=epoch).save()
    want = saved.get_weights()

    fresh = _dm(seed=2)  # other initial weights
    before = _diff(fresh.get_weights(), want)
    epoch_fresh = tf.Variable(0.0)
    _manager(fresh, "visible", epoch=epoch_fresh).restore()
    weights_file = os.path.join(DIR, "visible.weights.h5")
    fresh.save_weights(weights_file)  # every rank calls, world rank 0 writes
    plain = _model(seed=3)
    tfsmp.barrier()
    if tfsmp.rank() == 0:
        plain.load_weights(weights_file)
    read = [np.asarray(v.numpy()) for v in fresh.wrapped.weights]
    out = {"before": before, "get_weights": _diff(fresh.get_weights(), want),
           "variables": _diff(read, want), "epoch": float(epoch_fresh.numpy()),
           "weights_file": _diff(plain.get_weights(), want) if tfsmp.rank() == 0 else 0.0}
    for i in range(2, 4):  # Adam's moments and step count came back too
        saved.train_on_batch(*_data(i))
        fresh.train_on_batch(*_data(i))
    out["after_two_steps"] = _diff(fresh.get_weights(), saved.get_weights())
    return out


def case_load_weights_before_first_step_is_visible(ctx: Any) -> dict[str, float]:
    _init()
    source = _model(seed=4)
    path = os.path.join(DIR, "pretrained.weights.h5")
    if tfsmp.rank() == 0:
        source.save_weights(path)
    tfsmp.barrier()
    dm = _dm(seed=5)
    dm.load_weights(path)
    out = {"get_weights": _diff(dm.get_weights(), source.get_weights())}
    dm.train_on_batch(*_data(0))  # nothing pending re-applies the file over the trained step
    ref = _model(seed=4)
    ref.compile(optimizer=keras.optimizers.Adam(0.05), loss="mse")
    ref.train_on_batch(*_data(0))
    out["after_step"] = _diff(dm.get_weights(), ref.get_weights())
    return out


def case_send_receive_in_pieces(ctx: Any) -> dict[str, Any]:
    """Nested files, sizes around the piece size (0, 1, exactly 2 pieces, 2 pieces + 1), sent
    by pipeline rank 1 to pipeline rank 0, only the ``sub_dir`` files, then all."""
    _init()
    os.environ["SMP_CKPT_TRANSFER_CHUNK_SIZE"] = "1000"
    src = os.path.join(DIR, "send_src")
    sizes = {"mp_rank_1/a.bin": 0, "mp_rank_1/b.bin": 1, "mp_rank_1/deep/c.bin": 2000,
             "other/d.bin": 2001}
    rng = np.random.default_rng(0)
    payload = {name: rng.bytes(n) for name, n in sizes.items()}
    if tfsmp.rank() == 1:
        for name, data in payload.items():
            os.makedirs(os.path.dirname(os.path.join(src, name)), exist_ok=True)
            with open(os.path.join(src, name), "wb") as f:
                f.write(data)
        tfsmp.utils.send_checkpoint_files(src, 0, sub_dir=[os.path.join(src, "mp_rank_1")])
        tfsmp.utils.send_checkpoint_files(src, 0)
        tfsmp.utils.send_checkpoint_files(None, 0)
        return {}
    only = tfsmp.utils.receive_checkpoint_files(os.path.join(DIR, "recv_sub"), 1)
    everything = tfsmp.utils.receive_checkpoint_files(os.path.join(DIR, "recv_all"), 1)
    nothing = tfsmp.utils.receive_checkpoint_files(os.path.join(DIR, "recv_none"), 1)

    def same(root: str, names: list[str]) -> bool:
        for name in names:
            with open(os.path.join(root, name), "rb") as f:
                if f.read() != payload[name]:
                    return False
        return True

    return {"sub_dir": sorted(os.path.relpath(p, os.path.join(DIR, "recv_sub")) for p in only),
            "all": sorted(os.path.relpath(p, os.path.join(DIR, "recv_all")) for p in everything),
            "nothing": nothing,
            "sub_dir_equal": same(os.path.join(DIR, "recv_sub"), ["mp_rank_1/a.bin",
                                                                  "mp_rank_1/b.bin"]),
            "all_equal": same(os.path.join(DIR, "recv_all"), sorted(sizes))}
