"""Sharded optimizer state and checkpoints (run by `tests/mpi/cases_runner.py`): files go to
``$TFSMP_CKPT_DIR``, shared by the test's launches.

Save (4 ranks, p=2, d=2, ``shard_optimizer_state``): 3 Adam steps, a checkpoint and a
``.weights.h5`` with the optimizer's state, then 3 more steps. Restore: a new job at p=2, d=1
(unsharded) or p=1, d=4 (sharded) restores the checkpoint and trains the last 3 steps; the
weights must equal the 6 straight steps, and those plain Keras's.
"""

from __future__ import annotations

import json
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras
import numpy as np
import tensorflow as tf
from checkpoint_models import BATCH, batch_of, build_mlp, mlp_data, reinit, rel_err

import tfsmp
from tfsmp.keras.porting import rank_variables  # what this rank holds

DIR = os.environ.get("TFSMP_CKPT_DIR", "/tmp/tfsmp_sharded_ckpt_cases")
RTOL, ATOL = 1e-5, 1e-6



def _path(*parts: str) -> str:
    return os.path.join(DIR, *parts)



def _err(a: list[np.ndarray], b: list[np.ndarray]) -> float:
    """<= 1 means equal at rtol 1e-5 (`rel_err`)."""
    return rel_err(a, b, RTOL, ATOL)


def _model(seed: int = 1234) -> tfsmp.DistributedModel:
    dm = tfsmp.DistributedModel(lambda: build_mlp(seed))
    dm.compile(optimizer=keras.optimizers.Adam(1e-2), loss="mse")
    return dm


def _manager(dm: tfsmp.DistributedModel) -> tfsmp.CheckpointManager:
    ckpt = tf.train.Checkpoint(model=dm, optimizer=dm.optimizer)
    return tfsmp.CheckpointManager(ckpt, directory=_path("sharded"))


def _plain(steps: int) -> keras.Model:
    x, y = mlp_data()
    ref = build_mlp()
    ref.compile(optimizer=keras.optimizers.Adam(1e-2), loss="mse")
    for i in range(steps):
        ref.train_on_batch(*batch_of(x, y, i))
    return ref


def _slot_bytes(optimizer: keras.optimizers.Optimizer) -> int:
    return sum(int(np.prod(v.shape)) * 4 for v in rank_variables(optimizer) if len(v.shape))


def case_save_sharded(ctx: object) -> dict[str, object]:
    """p=2, d=2 sharded: 3 steps, checkpoint and weights file, 3 more steps."""
    reinit(partitions=2, shard_optimizer_state=True)
    x, y = mlp_data()
    dm = _model()
    for i in range(3):
        dm.train_on_batch(*batch_of(x, y, i))
    path = _manager(dm).save()
    dm.save_weights(_path("sharded3.weights.h5"))
    for i in range(3, 6):
        dm.train_on_batch(*batch_of(x, y, i))
    weights = dm.get_weights()
    with open(os.path.join(path, "manifest.json")) as f:
        manifest = json.load(f)
    out: dict[str, object] = {
        "slot_writers": sorted({e["rank"] for e in manifest["slots"].values()}),
        "num_slots": len(manifest["slots"]), "slot_bytes": _slot_bytes(dm.optimizer),
        "owned": sorted(dm.rank_view.owned or []), "held": list(dm.rank_view.held)}
    if tfsmp.rank() == 0:
        np.savez(_path("straight.npz"), *weights)
        ref = _plain(6)
        out["ref_err"] = _err(weights, ref.get_weights())
        # the weights file holds the whole optimizer state, gathered from its owners: a plain
        # Keras model loads it, and its slots equal plain Keras's after the same 3 steps
        ref3, loaded = _plain(3), build_mlp(99)
        loaded.compile(optimizer=keras.optimizers.Adam(1e-2), loss="mse")
        loaded.optimizer.build(loaded.trainable_variables)
        loaded.load_weights(_path("sharded3.weights.h5"))
        out["file_opt_err"] = _err([np.asarray(v) for v in loaded.optimizer.variables],
                                   [np.asarray(v) for v in ref3.optimizer.variables])
        out["file_weight_err"] = _err(loaded.get_weights(), ref3.get_weights())
        out["num_opt_vars"] = [len(loaded.optimizer.variables), len(ref3.optimizer.variables)]
    return out


def case_smp_step_refuses_sharding(ctx: object) -> dict[str, object]:
    """A training smp.step applies the script's own optimizer: sharding is refused, clearly."""
    reinit(partitions=2, shard_optimizer_state=True)
    x, y = mlp_data()
    model = tfsmp.DistributedModel(build_mlp())

    @tfsmp.step
    def grads(xb: tf.Tensor, yb: tf.Tensor) -> object:
        with tf.GradientTape() as tape:
            loss = keras.losses.mean_squared_error(yb, model(xb, training=True))
        return tape.gradient(loss, model.trainable_variables), loss

    try:
        grads(tf.constant(x[:BATCH]), tf.constant(y[:BATCH]))
    except Exception as e:  # the StepError, on every rank
        return {"error_type": type(e).__name__, "message": str(e)}
    return {"error_type": None, "message": ""}


def _restore(**config: object) -> dict[str, object]:
    reinit(**config)
    x, y = mlp_data()
    dm = _model(seed=99)  # other initial weights: the restore must replace them all
    restored = _manager(dm).restore()
    for i in range(3, 6):
        dm.train_on_batch(*batch_of(x, y, i))
    with np.load(_path("straight.npz")) as f:
        straight = [f[f"arr_{i}"] for i in range(len(f.files))]
    return {"restored": restored, "err": _err(dm.get_weights(), straight),
            "iterations": int(dm.optimizer.iterations.numpy())}


def case_restore_unsharded_d1(ctx: object) -> dict[str, object]:
    """2 ranks: p=2, d=1, unsharded."""
    return _restore(partitions=2)


def case_restore_sharded_d4(ctx: object) -> dict[str, object]:
    """4 ranks: p=1, d=4, sharded."""
    return _restore(partitions=1, shard_optimizer_state=True)


def teardown(ctx: object) -> None:
    if tfsmp.is_initialized():
        tfsmp.shutdown()
