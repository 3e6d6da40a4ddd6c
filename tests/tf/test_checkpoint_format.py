"""Checkpoint format, bad checkpoints, Keras-file layout and export, in one process (p=1).

Multi-rank behaviour (other partitionings, SIGKILL, per-rank reads) is in
`tests/mpi/test_checkpoint.py`.
"""

from __future__ import annotations

import json
import os
import shutil
import warnings
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from tfsmp.checkpoint import format as fmt
from tfsmp.errors import CheckpointError

keras = pytest.importorskip("keras")
tf = pytest.importorskip("tensorflow")
pytestmark = pytest.mark.tf

RTOL, ATOL = 1e-5, 1e-6  # float32 equality, as the runtime equality tests


# -- the format, no model ---------------------------------------------------------------------

def test_arrays_round_trip_with_checksums(tmp_path: Path) -> None:
    import ml_dtypes

    values = {"w": np.arange(6, dtype=np.float32).reshape(2, 3), "it": np.int64(7),
              "half": np.array([1.5, -2.0], dtype=ml_dtypes.bfloat16)}
    for key, value in values.items():
        entry = fmt.write_array(str(tmp_path), fmt.array_file("model", key), value)
        assert entry["shape"] == list(np.shape(value)) and len(entry["sha256"]) == 64
        back = fmt.read_array(str(tmp_path), key, entry)
        assert back.dtype == np.asarray(value).dtype and np.array_equal(back, value)


def _one_array(tmp_path: Path) -> tuple[str, dict]:
    entry = fmt.write_array(str(tmp_path), "model/x.npy", np.ones((4, 4), np.float32))
    return str(tmp_path / "model" / "x.npy"), entry


def test_truncated_file_is_named_with_its_variable(tmp_path: Path) -> None:
    path, entry = _one_array(tmp_path)
    with open(path, "r+b") as f:
        f.truncate(entry["bytes"] - 8)
    with pytest.raises(CheckpointError, match=r"wrong size \(truncated\?\).*x\.npy' for variable 'd/kernel'"):
        fmt.read_array(str(tmp_path), "d/kernel", entry)


def test_flipped_bytes_fail_the_checksum(tmp_path: Path) -> None:
    path, entry = _one_array(tmp_path)
    with open(path, "r+b") as f:
        f.seek(-1, os.SEEK_END)
        f.write(b"\x07")
    with pytest.raises(CheckpointError, match=r"does not match its checksum.*variable 'd/kernel'"):
        fmt.read_array(str(tmp_path), "d/kernel", entry)


def test_array_of_another_shape_than_the_manifest_says(tmp_path: Path) -> None:
    _, entry = _one_array(tmp_path)
    with pytest.raises(CheckpointError, match=r"holds \(4, 4\) float32, the manifest says \(2, 8\)"):
        fmt.read_array(str(tmp_path), "d/kernel", {**entry, "shape": [2, 8]})


@pytest.mark.parametrize("relpath", ["../outside.npy", "/etc/passwd", "a/../../b.npy", 3, ""])
def test_manifest_paths_cannot_leave_the_checkpoint(tmp_path: Path, relpath: object) -> None:
    with pytest.raises(CheckpointError, match=r"stay inside the checkpoint directory.*'d/kernel'"):
        fmt.safe_join(str(tmp_path), relpath, "d/kernel")


def test_symlink_out_of_the_checkpoint_is_refused(tmp_path: Path) -> None:
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "secret.npy").write_bytes(b"x")
    os.symlink(tmp_path / "secret.npy", tmp_path / "ckpt" / "link.npy")
    with pytest.raises(CheckpointError, match=r"file='link\.npy'"):
        fmt.safe_join(str(tmp_path / "ckpt"), "link.npy", "k")


@pytest.mark.parametrize("text,match", [
    ('{"format": "tfsmp-checkpoint", "variab', "must be valid JSON.*truncated"),
    ('{"format": "other", "format_version": 1, "variables": {}}', "format='other'"),
    ('{"format": "tfsmp-checkpoint", "format_version": 99, "variables": {}}',
     "format_version=99"),
    ('{"format": "tfsmp-checkpoint", "format_version": 1}', "lacks.*variables"),
])
def test_bad_manifests(tmp_path: Path, text: str, match: str) -> None:
    (tmp_path / fmt.MANIFEST).write_text(text)
    with pytest.raises(CheckpointError, match=match):
        fmt.read_manifest(str(tmp_path))


def test_missing_manifest(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match=r"must hold manifest\.json"):
        fmt.read_manifest(str(tmp_path))


def _fake(root: Path, name: str) -> Path:
    path = root / name
    path.mkdir(parents=True)
    fmt.write_manifest(str(path), {"variables": {}})
    return path


def test_listing_latest_pruning_and_leftover_tmp(tmp_path: Path) -> None:
    for n in (1, 2, 10):
        _fake(tmp_path, f"ckpt-{n}")
    (tmp_path / "ckpt-11.tmp").mkdir()  # a save that was killed
    (tmp_path / "other-3").mkdir()
    assert [Path(p).name for p in fmt.list_checkpoints(str(tmp_path), "ckpt")] == [
        "ckpt-1", "ckpt-2", "ckpt-10"]
    assert fmt.read_latest(str(tmp_path), "ckpt").endswith("ckpt-10")  # no pointer: highest
    fmt.write_latest(str(tmp_path), "ckpt-2")
    assert fmt.read_latest(str(tmp_path), "ckpt").endswith("ckpt-2")
    deleted = fmt.prune(str(tmp_path), "ckpt", max_to_keep=1, keep=str(tmp_path / "ckpt-2"))
    assert sorted(Path(p).name for p in deleted) == ["ckpt-1"]
    assert sorted(os.listdir(tmp_path)) == ["ckpt-10", "ckpt-2", "latest", "other-3"]


def test_resolve_names_what_exists(tmp_path: Path) -> None:
    _fake(tmp_path, "ckpt-4")
    assert fmt.resolve(str(tmp_path), "ckpt", "ckpt-4") == str(tmp_path / "ckpt-4")
    with pytest.raises(CheckpointError, match=r"restore_prefix='ckpt-9'.*\['ckpt-4'\]"):
        fmt.resolve(str(tmp_path), "ckpt", "ckpt-9")
    assert fmt.resolve(str(tmp_path / "none"), "ckpt", None) is None


def test_commit_replaces_and_leaves_no_temporary(tmp_path: Path) -> None:
    old = _fake(tmp_path, "ckpt-1")
    (old / "stale").write_text("x")
    tmp = Path(fmt.begin(str(tmp_path), "ckpt-1"))
    fmt.write_manifest(str(tmp), {"variables": {"a": 1}})
    fmt.commit(str(tmp), str(old))
    assert sorted(os.listdir(tmp_path)) == ["ckpt-1"]
    assert fmt.read_manifest(str(old))["variables"] == {"a": 1}


# -- with a model (tfsmp in this process, one rank) -----------------------------------------------

@pytest.fixture(scope="module")
def smp() -> Iterator[object]:
    import tfsmp

    if tfsmp.is_initialized():
        tfsmp.shutdown()
    tfsmp.init({"partitions": 1, "microbatches": 2})
    yield tfsmp
    tfsmp.shutdown()


def _model(seed: int = 1, head: int = 2) -> keras.Model:
    keras.utils.set_random_seed(seed)
    L = keras.layers
    inner_in = keras.Input((8,), name="inner_in")
    inner = keras.Model(inner_in, L.Dense(8, activation="tanh", name="inner_d")(inner_in),
                        name="block")
    x = keras.Input((6,), name="x")
    h = L.Dense(8, activation="tanh", name="d0")(x)
    h = L.Dropout(0.2, name="drop")(h)
    h = L.BatchNormalization(name="bn")(inner(h))
    return keras.Model(x, L.Dense(head, name="head")(h), name="m")


def _data() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    return rng.normal(size=(16, 6)).astype("float32"), rng.normal(size=(16, 2)).astype("float32")


def _dm(smp: object, seed: int = 1, head: int = 2) -> object:
    dm = smp.DistributedModel(_model(seed, head))  # type: ignore[attr-defined]
    dm.compile(optimizer=keras.optimizers.Adam(1e-2), loss="mse")
    return dm


def _manager(smp: object, dm: object, directory: Path, **kw: object) -> object:
    ckpt = tf.train.Checkpoint(model=dm, optimizer=dm.optimizer, epoch=tf.Variable(0))
    return smp.CheckpointManager(ckpt, directory=str(directory), **kw)  # type: ignore[attr-defined]


def test_keys_are_layer_and_weight_names(smp: object) -> None:
    from tfsmp.checkpoint.layout import variable_keys
    from tfsmp.graph.tracer import trace

    keys = set(variable_keys(trace(_model())).values())
    assert {"d0/kernel", "inner_d/bias", "bn/moving_mean", "head/kernel",
            "drop/seed_generator_state"} <= keys


def test_restore_at_step_zero_resumes_exactly(smp: object, tmp_path: Path) -> None:
    x, y = _data()
    dm = _dm(smp)
    for _ in range(2):
        dm.train_on_batch(x, y)
    manager = _manager(smp, dm, tmp_path, max_to_keep=2)
    manager.checkpoint.epoch.assign(4)
    assert manager.save().endswith("ckpt-1")
    straight = [float(dm.train_on_batch(x, y)) for _ in range(2)]
    other = _dm(smp, seed=9)
    resumed_manager = _manager(smp, other, tmp_path)
    assert resumed_manager.restore() == str(tmp_path / "ckpt-1")  # applied at the first step
    resumed = [float(other.train_on_batch(x, y)) for _ in range(2)]
    assert resumed == straight
    for a, b in zip(other.get_weights(), dm.get_weights()):
        np.testing.assert_array_equal(a, b)
    assert int(other.optimizer.iterations.numpy()) == 4
    assert int(resumed_manager.checkpoint.epoch.numpy()) == 4
    for _ in range(3):
        manager.save()
    assert [Path(p).name for p in manager.checkpoints] == ["ckpt-3", "ckpt-4"]
    assert (tmp_path / "latest").read_text().strip() == "ckpt-4"
    assert manager.restore("ckpt-3") == str(tmp_path / "ckpt-3")


def test_restore_without_checkpoints_returns_none(smp: object, tmp_path: Path) -> None:
    assert _manager(smp, _dm(smp), tmp_path / "empty").restore() is None


def test_save_before_the_first_step_says_when(smp: object, tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match=r"has not run a step yet.*after the first step"):
        _manager(smp, _dm(smp), tmp_path).save()


@pytest.fixture(scope="module")
def good_checkpoint(smp: object, tmp_path_factory: pytest.TempPathFactory) -> Path:
    x, y = _data()
    dm = _dm(smp)
    dm.train_on_batch(x, y)
    root = tmp_path_factory.mktemp("good")
    _manager(smp, dm, root).save()
    return root / "ckpt-1"


def _corrupt(path: Path, kind: str) -> None:
    manifest_path = path / fmt.MANIFEST
    manifest = json.loads(manifest_path.read_text())
    entry = manifest["variables"]["head/kernel"]
    file = path / entry["file"]
    if kind == "checksum":
        data = bytearray(file.read_bytes())
        data[-1] ^= 0xFF
        file.write_bytes(bytes(data))
    elif kind == "truncated":
        file.write_bytes(file.read_bytes()[:-5])
    elif kind == "missing":
        del manifest["variables"]["head/kernel"]
    elif kind == "escape":
        entry["file"] = "../../head.npy"
    elif kind == "manifest":
        manifest_path.write_text(manifest_path.read_text()[:200])
        return
    manifest_path.write_text(json.dumps(manifest))


@pytest.mark.parametrize("kind,match", [
    ("checksum", r"does not match its checksum.*model/head_kernel\..*\.npy' for variable 'head/kernel'"),
    ("truncated", r"wrong size \(truncated\?\).*'head/kernel'"),
    ("missing", r"'head/kernel' is missing from .*manifest\.json"),
    ("escape", r"stay inside the checkpoint directory.*'\.\./\.\./head\.npy'.*'head/kernel'"),
    ("manifest", r"must be valid JSON.*manifest\.json"),
])
def test_bad_checkpoints_change_no_weight(smp: object, good_checkpoint: Path, tmp_path: Path,
                                         kind: str, match: str) -> None:
    bad = tmp_path / "ckpt-1"
    shutil.copytree(good_checkpoint, bad)
    _corrupt(bad, kind)
    dm = _dm(smp, seed=5)
    dm.partition(_data()[0])
    before = dm.get_weights()
    with pytest.raises(CheckpointError, match=match):
        _manager(smp, dm, tmp_path).restore()
    for a, b in zip(before, dm.get_weights()):
        np.testing.assert_array_equal(a, b)


def test_other_shape_is_named_with_file_and_variable(smp: object, good_checkpoint: Path) -> None:
    dm = _dm(smp, head=3)
    dm.partition(_data()[0])
    with pytest.raises(CheckpointError, match=r"'head/kernel' has shape \(8, 2\) in file .*the model's is \(8, 3\)"):
        _manager(smp, dm, good_checkpoint.parent).restore()


# -- Keras files ---------------------------------------------------------------------------------

def _h5_tree(path: Path) -> list[tuple[str, dict, object]]:
    """Groups and datasets with attributes and values, less tfsmp's checksum attribute
    ([Note: verified files] in tfsmp/checkpoint/checksum.py; checked by _checksummed)."""
    import h5py

    from tfsmp.checkpoint.checksum import DIGEST_ATTR

    out: list[tuple[str, dict, object]] = []
    with h5py.File(path, "r") as f:
        f.visititems(lambda n, o: out.append(
            (n, {k: v for k, v in o.attrs.items() if k != DIGEST_ATTR},
             o[()].tolist() if hasattr(o, "shape") else None)))
    return out


def _checksummed(path: Path) -> bool:
    """Every dataset carries tfsmp's CRC-32, and every non-scalar one HDF5's fletcher32."""
    import h5py

    from tfsmp.checkpoint.checksum import DIGEST_ATTR

    found: list[bool] = []
    with h5py.File(path, "r") as f:
        f.visititems(lambda n, o: found.append(
            DIGEST_ATTR in o.attrs and (o.ndim == 0 or o.fletcher32))
            if isinstance(o, h5py.Dataset) else None)
    return bool(found) and all(found)


def test_weights_file_has_the_groups_attributes_and_values_keras_writes(smp: object, tmp_path: Path) -> None:
    x, y = _data()
    dm = _dm(smp)
    dm.train_on_batch(x, y)
    dm.save_weights(str(tmp_path / "ours.weights.h5"))
    plain = _model()  # compiled as dm is: Keras's file then holds its optimizer's state too
    plain.compile(optimizer=keras.optimizers.Adam(1e-2, name=dm.optimizer.name), loss="mse")
    plain.optimizer.build(plain.trainable_variables)
    plain.set_weights(dm.get_weights())
    state = {v.name: v.numpy() for v in dm.optimizer.variables}  # p=1: every slot is here
    for v in plain.optimizer.variables:  # by name, so the file's order is Keras's own
        v.assign(state[v.name])
    plain.save_weights(str(tmp_path / "keras.weights.h5"))
    assert _h5_tree(tmp_path / "ours.weights.h5") == _h5_tree(tmp_path / "keras.weights.h5")
    assert _checksummed(tmp_path / "ours.weights.h5")
    dm.save(str(tmp_path / "m.keras"))
    loaded = keras.models.load_model(str(tmp_path / "m.keras"))
    # the project's float32 tolerance, not bit equality: on some CPUs (an AMD EPYC host,
    # 2026-12-06) TensorFlow's product kernel rounds some rows differently between Keras's
    # predict and the runtime's (9.3e-7 relative at the most)
    np.testing.assert_allclose(loaded.predict(x, verbose=0), dm.predict(x), rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("suffix", [".keras", ".weights.h5"])
def test_load_weights_written_by_plain_keras(smp: object, tmp_path: Path, suffix: str) -> None:
    from tfsmp.checkpoint import export

    plain = _model(seed=3)
    path = str(tmp_path / f"pre{suffix}")
    plain.save(path) if suffix == ".keras" else plain.save_weights(path)
    dm = _dm(smp, seed=4)
    dm.load_weights(path)  # pending until partitioning
    dm.partition(_data()[0])
    for a, b in zip(dm.get_weights(), plain.get_weights()):
        np.testing.assert_array_equal(a, b)
    assert "layers/functional/layers/dense/vars/0" in export.last_read()  # the nested model


def test_load_weights_mismatch_and_skip(smp: object, tmp_path: Path) -> None:
    path = str(tmp_path / "other.weights.h5")
    _model(seed=3, head=5).save_weights(path)
    dm = _dm(smp, seed=4)
    dm.partition(_data()[0])
    before = dm.get_weights()
    with pytest.raises(CheckpointError, match=r"Weight shapes must match.*other\.weights\.h5.*head/kernel.*skip_mismatch=True"):
        dm.load_weights(path)
    for a, b in zip(before, dm.get_weights()):
        np.testing.assert_array_equal(a, b)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        dm.load_weights(path, skip_mismatch=True)
    assert any("head/kernel" in str(w.message) for w in caught)
    np.testing.assert_array_equal(dm.get_weights()[0], _model(seed=3).get_weights()[0])


@pytest.mark.parametrize("path,match", [  # Keras's own error, and tfsmp's ways out
    ("m.pb", r"Invalid filepath extension for saving.*save_model\(directory\)"),
    ("m", r"Invalid filepath extension for saving.*CheckpointManager"),
])
def test_save_needs_a_keras_extension(smp: object, path: str, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        _dm(smp).save(path)


def test_load_weights_rejects_other_files(smp: object, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"`\.weights\.h5` or `\.keras`.*CheckpointManager"):
        _dm(smp).load_weights(str(tmp_path / "ckpt-1"))
    with pytest.raises(CheckpointError, match="must exist"):
        _dm(smp).load_weights(str(tmp_path / "none.keras"))


def test_tfsmp_export_writes_plain_keras(smp: object, good_checkpoint: Path, tmp_path: Path,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    from tfsmp.launch.cli import main

    out = tmp_path / "exported.keras"
    assert main(["export", str(good_checkpoint.parent), str(out)]) == 0
    assert "exported" in capsys.readouterr().out
    x, _ = _data()
    dm = _dm(smp, seed=6)
    _manager(smp, dm, good_checkpoint.parent).restore()
    np.testing.assert_allclose(keras.models.load_model(str(out)).predict(x, verbose=0),
                               dm.predict(x), rtol=RTOL, atol=ATOL)  # as above
    assert main(["export", str(tmp_path), str(tmp_path / "x.keras")]) == 1
    assert "holds no manifest.json" in capsys.readouterr().err


def test_save_model_serves_a_subclassed_model(smp: object, tmp_path: Path) -> None:
    L = keras.layers

    class Net(smp.DistributedModel):  # type: ignore[name-defined,misc]
        def __init__(self, **kwargs: object) -> None:
            super().__init__(**kwargs)
            self.d1, self.d2 = L.Dense(8, activation="tanh"), L.Dense(3)

        def call(self, x: object) -> object:
            return self.d2(self.d1(x))

    x, _ = _data()
    net = Net()
    net.partition(x)
    net.save_model(str(tmp_path / "serving"))
    w = net.get_weights()
    serving = tf.saved_model.load(str(tmp_path / "serving"))
    got = serving.signatures["serving_default"](tf.constant(x))["output_0"].numpy()
    np.testing.assert_allclose(got, np.tanh(x @ w[0] + w[1]) @ w[2] + w[3], rtol=1e-5, atol=1e-6)
