"""Checkpoint cases, many per launch (run by `tests/mpi/cases_runner.py`); files go to
``$TFSMP_CKPT_DIR``, which the test shares between its launches.

Phase A (4 ranks) trains and saves; phase B (4 ranks, a new job, another partitioning) restores
and compares. Every case re-initializes tfsmp with its own config.
"""

from __future__ import annotations

import json
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras
import numpy as np
import tensorflow as tf
from checkpoint_models import (
    BATCH,
    batch_of,
    build_mlp,
    build_rich,
    mlp_data,
    reinit,
    rel_err,
    rich_data,
)

import tfsmp
from tfsmp.checkpoint import BackupAndRestore, export, store
from tfsmp.errors import CheckpointError

DIR = os.environ.get("TFSMP_CKPT_DIR", "/tmp/tfsmp_ckpt_cases")
RTOL, ATOL = 1e-6, 1e-7



def _path(*parts: str) -> str:
    return os.path.join(DIR, *parts)



def _err(a: list[np.ndarray], b: list[np.ndarray]) -> float:
    """<= 1 means equal at rtol 1e-6 (`rel_err`)."""
    return rel_err(a, b, RTOL, ATOL)


def _mlp_model(seed: int = 1234) -> tfsmp.DistributedModel:
    dm = tfsmp.DistributedModel(build_mlp(seed))
    dm.compile(optimizer=keras.optimizers.Adam(1e-2), loss="mse")
    return dm


def _manager(dm: tfsmp.DistributedModel, name: str, **kw: object) -> tfsmp.CheckpointManager:
    ckpt = tf.train.Checkpoint(model=dm, optimizer=dm.optimizer)
    return tfsmp.CheckpointManager(ckpt, directory=_path(name), **kw)


# -- phase A ------------------------------------------------------------------------------------

def _straight(ctx: object, pipeline: str) -> dict[str, object]:
    """6 steps in one job (p=2, d=2); rank 0 also checks them against plain Keras."""
    reinit(partitions=2, pipeline=pipeline)
    x, y = mlp_data()
    dm = _mlp_model()
    for i in range(6):
        dm.train_on_batch(*batch_of(x, y, i))
    weights = dm.get_weights()
    if tfsmp.rank() != 0:
        return {"ref_err": 0.0}
    np.savez(_path(f"straight_{pipeline}.npz"), *weights)
    ref = build_mlp()
    ref.compile(optimizer=keras.optimizers.Adam(1e-2), loss="mse")
    for i in range(6):
        ref.train_on_batch(*batch_of(x, y, i))
    ref_err = max(float(np.max(np.abs(a - b) / (1e-6 + 1e-5 * np.abs(b))))
                  for a, b in zip(weights, ref.get_weights()))
    return {"ref_err": ref_err}


def _first_half(ctx: object, pipeline: str) -> dict[str, object]:
    """3 steps (p=2, d=2), then a checkpoint."""
    reinit(partitions=2, pipeline=pipeline)
    x, y = mlp_data()
    dm = _mlp_model()
    for i in range(3):
        dm.train_on_batch(*batch_of(x, y, i))
    path = _manager(dm, f"resume_{pipeline}").save()
    with open(os.path.join(path, "manifest.json")) as f:
        manifest = json.load(f)
    return {"path": path, "step": manifest["step"], "topology": manifest["topology"],
            "writers": sorted({e["rank"] for e in manifest["variables"].values()}),
            "slot_writers": sorted({e["rank"] for e in manifest["slots"].values()}),
            "num_variables": len(manifest["variables"]), "num_slots": len(manifest["slots"])}


def case_straight_interleaved(ctx: object) -> dict[str, object]:
    return _straight(ctx, "interleaved")


def case_straight_simple(ctx: object) -> dict[str, object]:
    return _straight(ctx, "simple")


def case_first_half_interleaved(ctx: object) -> dict[str, object]:
    return _first_half(ctx, "interleaved")


def case_first_half_simple(ctx: object) -> dict[str, object]:
    return _first_half(ctx, "simple")


def case_export_four_stages(ctx: object) -> dict[str, object]:
    """4 stages: save .keras/.weights.h5/SavedModel and a checkpoint, record the predictions."""
    reinit(partitions=4)
    x, y = rich_data()
    dm = tfsmp.DistributedModel(build_rich())
    dm.compile(optimizer=keras.optimizers.Adam(1e-2), loss="mse")
    for i in range(2):
        dm.train_on_batch(*batch_of(x, y, i))
    pred = dm.predict(x, batch_size=BATCH)
    dm.save(_path("export4.keras"))
    dm.save(_path("export4.weights.h5"))
    dm.save_model(_path("export4_savedmodel"))
    _manager(dm, "export_ckpt").save()
    if tfsmp.rank() == 0:
        np.save(_path("export4_pred.npy"), pred)
        np.save(_path("export4_x.npy"), x)
    return {"stages": dm._engine.stages, "exists": os.path.isfile(_path("export4.keras"))}


# -- phase B ------------------------------------------------------------------------------------

def _resume(ctx: object, pipeline: str) -> dict[str, object]:
    """A new job with 4 stages and 1 replica restores the p=2, d=2 checkpoint at step 0."""
    reinit(partitions=4, pipeline=pipeline)
    x, y = mlp_data()
    # Other initial weights: the restore must replace them all. Built in deferred_init, so no
    # variable exists before partitioning and each rank reads only its own stages' (a built
    # model's restore at step 0 reads every variable, so that get_weights shows it at once).
    dm = tfsmp.DistributedModel(lambda: build_mlp(99))
    dm.compile(optimizer=keras.optimizers.Adam(1e-2), loss="mse")
    restored = _manager(dm, f"resume_{pipeline}").restore()
    for i in range(3, 6):
        dm.train_on_batch(*batch_of(x, y, i))
    weights = dm.get_weights()
    with np.load(_path(f"straight_{pipeline}.npz")) as f:
        straight = [f[f"arr_{i}"] for i in range(len(f.files))]
    layout = dm.rank_view
    read = set(store.last_read())
    return {"restored": restored, "err": _err(weights, straight),
            "iterations": int(dm.optimizer.iterations.numpy()),
            "read_model": sorted(read & set(layout.variables)), "held": sorted(layout.held),
            "all": sorted(layout.variables), "read_count": len(read)}


def case_resume_interleaved(ctx: object) -> dict[str, object]:
    return _resume(ctx, "interleaved")


def case_resume_simple(ctx: object) -> dict[str, object]:
    return _resume(ctx, "simple")


def case_restore_after_kill(ctx: object) -> dict[str, object]:
    """The job killed mid-save (p=2, d=1) left ckpt-1; restore it under p=2, d=2, save again."""
    reinit(partitions=2)
    x, y = mlp_data()
    dm = _mlp_model(seed=5)
    manager = _manager(dm, "kill")
    before = {"latest": manager.latest_checkpoint,
              "listing": sorted(os.listdir(_path("kill")))}
    restored = manager.restore()
    dm.partition(x[:BATCH])
    with np.load(_path("kill_ckpt1.npz")) as f:
        saved = [f[f"arr_{i}"] for i in range(len(f.files))]
    exact = all(np.array_equal(a, b) for a, b in zip(dm.get_weights(), saved))
    dm.train_on_batch(*batch_of(x, y, 0))
    again = manager.save()
    return {"restored": restored, "exact": exact, "before": before, "again": again,
            "after": sorted(os.listdir(_path("kill"))), "checkpoints": manager.checkpoints}


def case_load_pretrained_frozen(ctx: object) -> dict[str, object]:
    """Plain-Keras weights into a deferred 2-stage model with frozen layers; train; check."""
    reinit(partitions=2, microbatches=2)
    if tfsmp.rank() == 0:
        plain = build_mlp(seed=3)
        plain.save(_path("pretrained.keras"))
        plain.save_weights(_path("pretrained.weights.h5"))
        plain.save(_path("pretrained.h5"))  # tf.keras's legacy whole-model file
    tfsmp.barrier()
    pretrained = build_mlp(seed=3).get_weights()
    x, y = mlp_data()
    with tfsmp.deferred_init():
        inner = build_mlp(seed=77)
    for name in ("d0", "d1"):
        inner.get_layer(name).trainable = False
    dm = tfsmp.DistributedModel(inner)
    dm.load_weights(_path("pretrained.keras"))  # before partitioning: applied at the first step
    dm.compile(optimizer=keras.optimizers.Adam(1e-2), loss="mse")
    dm.train_on_batch(*batch_of(x, y, 0))
    read = export.last_read()
    dm.train_on_batch(*batch_of(x, y, 1))
    after = dm.get_weights()
    names = [v.path for v in inner.weights]
    frozen = [i for i, n in enumerate(names) if n.split("/")[0] in ("d0", "d1")]
    trained = [i for i, n in enumerate(names) if n.split("/")[0] == "head"]
    held = len(dm.rank_view.held)
    second = tfsmp.DistributedModel(build_mlp(seed=78))
    second.partition(x[:BATCH])
    second.load_weights(_path("pretrained.weights.h5"))  # after partitioning: applied now
    same = all(np.array_equal(a, b) for a, b in zip(second.get_weights(), pretrained))
    # a legacy `.h5`: after partitioning, and (by layer name) into a deferred model before it
    legacy = tfsmp.DistributedModel(build_mlp(seed=79))
    legacy.partition(x[:BATCH])
    legacy.load_weights(_path("pretrained.h5"))
    with tfsmp.deferred_init():
        inner_by_name = build_mlp(seed=80)
    by_name = tfsmp.DistributedModel(inner_by_name)
    keras.saving.load_weights(by_name, _path("pretrained.h5"), by_name=True)
    by_name.partition(x[:BATCH])
    try:
        by_name.load_weights(_path("pretrained.keras"), by_name=True)
        refused = ""
    except ValueError as e:  # Keras's own argument check
        refused = str(e)
    return {"frozen_same": all(np.array_equal(after[i], pretrained[i]) for i in frozen),
            "head_changed": all(not np.array_equal(after[i], pretrained[i]) for i in trained),
            "read": read, "held": held, "total": len(pretrained), "h5_same": same,
            "legacy_same": _same(legacy.get_weights(), pretrained),
            "by_name_same": _same(by_name.get_weights(), pretrained), "by_name_keras": refused}


def _same(a: list[np.ndarray], b: list[np.ndarray]) -> bool:
    return len(a) == len(b) and all(np.array_equal(u, v) for u, v in zip(a, b))


def case_load_mismatch_fails_everywhere(ctx: object) -> dict[str, object]:
    reinit(partitions=2, microbatches=2)
    if tfsmp.rank() == 0:
        build_mlp(seed=3, head=5).save_weights(_path("other_head.weights.h5"))
    tfsmp.barrier()
    x, _ = mlp_data()
    dm = tfsmp.DistributedModel(build_mlp(seed=4))
    dm.partition(x[:BATCH])
    before = dm.get_weights()
    try:
        dm.load_weights(_path("other_head.weights.h5"))
        message = None
    except CheckpointError as e:
        message = str(e)
    unchanged = all(np.array_equal(a, b) for a, b in zip(before, dm.get_weights()))
    dm.load_weights(_path("other_head.weights.h5"), skip_mismatch=True)
    return {"message": message, "unchanged": unchanged}


def case_bad_checkpoint_changes_nothing(ctx: object) -> dict[str, object]:
    """A corrupt array of the last stage only: every rank raises, no rank changes a weight."""
    reinit(partitions=2)
    x, y = mlp_data()
    dm = _mlp_model()
    dm.train_on_batch(*batch_of(x, y, 0))
    path = _manager(dm, "bad").save()
    with open(os.path.join(path, "manifest.json")) as f:
        manifest = json.load(f)
    last = max(manifest["stages"].values())
    key = next(k for k, s in manifest["stages"].items() if s == last and k.endswith("kernel"))
    file = os.path.join(path, manifest["variables"][key]["file"])
    if tfsmp.rank() == 0:
        with open(file, "r+b") as f:
            f.seek(-4, os.SEEK_END)
            f.write(b"\x00\x01\x02\x03")
    tfsmp.barrier()
    other = _mlp_model(seed=8)
    other.partition(x[:BATCH])
    before = other.get_weights()
    try:
        _manager(other, "bad").restore()
        message = None
    except CheckpointError as e:
        message = str(e)
    unchanged = all(np.array_equal(a, b) for a, b in zip(before, other.get_weights()))
    return {"message": message, "unchanged": unchanged, "key": key, "file": file,
            "holds_key": key in other.rank_view.held}


class _Epochs(keras.callbacks.Callback):  # type: ignore[misc]
    def __init__(self) -> None:
        super().__init__()
        self.seen: list[int] = []

    def on_epoch_begin(self, epoch: int, logs: object = None) -> None:
        self.seen.append(epoch)


class _Interrupt(keras.callbacks.Callback):  # type: ignore[misc]
    def on_epoch_begin(self, epoch: int, logs: object = None) -> None:
        if epoch == 2:
            raise RuntimeError("interrupted")


def _rich_fit(seed: int, callbacks: list[object]) -> tfsmp.DistributedModel:
    x, y = rich_data()
    dm = tfsmp.DistributedModel(build_rich(seed))
    dm.compile(optimizer=keras.optimizers.Adam(1e-2), loss="mse")
    dm.fit(x, y, batch_size=BATCH, epochs=3, shuffle=False, verbose=0, callbacks=callbacks)
    return dm


def case_fit_backup_and_restore(ctx: object) -> dict[str, object]:
    """fit interrupted in epoch 3, resumed by a fresh model: the same weights as uninterrupted
    (dropout masks too: the seed-generator state is part of the checkpoint). One replica:
    BatchNormalization statistics are per replica, and a checkpoint keeps data rank 0's."""
    reinit(partitions=4)
    straight = _rich_fit(21, []).get_weights()
    backup = _path("backup")
    try:
        _rich_fit(21, [BackupAndRestore(backup), _Interrupt()])
        interrupted = False
    except RuntimeError:
        interrupted = True
    saved = sorted(os.listdir(backup))
    callback, epochs = BackupAndRestore(backup), _Epochs()
    resumed = _rich_fit(5, [callback, epochs])
    return {"interrupted": interrupted, "saved": saved, "position": callback.restored_position,
            "epochs_run": epochs.seen, "err": _err(resumed.get_weights(), straight),
            "deleted": not os.path.exists(backup)}


def case_model_checkpoint_callback(ctx: object) -> dict[str, object]:
    """Keras's ModelCheckpoint during fit writes plain Keras files on every rank's call (one
    replica: with several, each predicts with its own BatchNormalization statistics)."""
    reinit(partitions=4)
    x, y = rich_data()
    dm = tfsmp.DistributedModel(build_rich())
    dm.compile(optimizer=keras.optimizers.Adam(1e-2), loss="mse")
    # ModelCheckpoint runs `if not exists(dir): os.makedirs(dir)` on every rank: the rank that
    # loses that race raises FileExistsError and leaves the collective save. Until fit creates
    # ModelCheckpoint directories on one rank first, create it here.
    if tfsmp.rank() == 0:
        os.makedirs(_path("mc"), exist_ok=True)
    tfsmp.barrier()
    callbacks = [keras.callbacks.ModelCheckpoint(_path("mc", "epoch{epoch}.keras")),
                 keras.callbacks.ModelCheckpoint(_path("mc", "last.weights.h5"),
                                                 save_weights_only=True)]
    dm.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0, callbacks=callbacks)
    pred = dm.predict(x, batch_size=BATCH)
    err = None
    if tfsmp.rank() == 0:
        plain = keras.models.load_model(_path("mc", "epoch2.keras"))
        err = float(np.max(np.abs(plain.predict(x, verbose=0) - pred)))
        weights_only = build_rich(seed=1)
        weights_only.load_weights(_path("mc", "last.weights.h5"))
        err = max(err, float(np.max(np.abs(weights_only.predict(x, verbose=0) - pred))))
    return {"files": sorted(os.listdir(_path("mc"))), "err": err}


def teardown(ctx: object) -> None:
    tf.keras.backend.clear_session()
