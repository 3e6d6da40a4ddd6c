"""Verified files ([Note: verified files] in tfsmp/checkpoint/checksum.py), in one process (p=1).

For every kind of file tfsmp reads — a `.weights.h5`, the weights inside a `.keras` archive, a
tfsmp checkpoint's array files and its manifest — a few flipped bytes inside a weight raise an
error that is an `OSError` (and a `CheckpointError`), with no `skip_mismatch` advice; plain Keras
refuses tfsmp's damaged file too; Keras's `BackupAndRestore(double_checkpoint=True)` falls back
to its `.bkp` copy; and a tfsmp backup folder without its manifest is reported, not passed over.
"""

from __future__ import annotations

import json
import zipfile
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

keras = pytest.importorskip("keras")
pytestmark = pytest.mark.tf

BATCH, SAMPLES = 8, 32


@pytest.fixture(scope="module")
def smp() -> Iterator[object]:
    import tfsmp

    if tfsmp.is_initialized():
        tfsmp.shutdown()
    tfsmp.init({"partitions": 1, "microbatches": 2, "seed": 5})
    yield tfsmp
    tfsmp.shutdown()


def _model() -> keras.Model:
    keras.utils.set_random_seed(2)
    x = keras.Input((6,), name="x")
    h = keras.layers.Dense(16, activation="tanh", name="d0")(x)
    return keras.Model(x, keras.layers.Dense(1, name="out")(h), name="net")


def _dm(smp: object) -> object:
    dm = smp.DistributedModel(_model())  # type: ignore[attr-defined]
    dm.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
    return dm


def _data() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(SAMPLES, 6)).astype(np.float32)
    return x, np.sin(x[:, :1]).astype(np.float32)


def _trained(smp: object) -> object:
    dm = _dm(smp)
    x, y = _data()
    dm.train_on_batch(x[:BATCH], y[:BATCH])  # type: ignore[attr-defined]
    return dm


def _data_offset(h5_path: Path, dataset: str) -> int:
    """Where the bytes of ``dataset`` start in the HDF5 file (its first chunk, or contiguous)."""
    import h5py

    with h5py.File(h5_path, "r") as f:
        ds = f[dataset]
        return int(ds.id.get_chunk_info(0).byte_offset if ds.chunks else ds.id.get_offset())


def _flip(path: Path, offset: int, count: int = 3) -> None:
    data = bytearray(path.read_bytes())
    for i in range(offset, offset + count):
        data[i] ^= 0x5A
    path.write_bytes(bytes(data))


KERNEL = "layers/dense/vars/0"  # d0's kernel in Keras's layout ([Note: Keras weights layout])


def _assert_corrupt(excinfo: pytest.ExceptionInfo[BaseException]) -> None:
    from tfsmp.checkpoint import CorruptFileError
    from tfsmp.errors import CheckpointError

    e = excinfo.value
    assert isinstance(e, OSError) and isinstance(e, CheckpointError), type(e).__mro__
    assert isinstance(e, CorruptFileError)
    assert "skip_mismatch" not in str(e), str(e)


def test_a_flipped_weight_in_a_weights_file_raises_an_oserror(smp: object, tmp_path: Path
                                                               ) -> None:
    dm = _trained(smp)
    path = tmp_path / "m.weights.h5"
    dm.save_weights(str(path))  # type: ignore[attr-defined]
    dm.load_weights(str(path))  # type: ignore[attr-defined]  # intact: loads
    _flip(path, _data_offset(path, KERNEL) + 40)
    with pytest.raises(OSError) as excinfo:
        dm.load_weights(str(path))  # type: ignore[attr-defined]
    _assert_corrupt(excinfo)
    assert "damaged" in str(excinfo.value) and "m.weights.h5" in str(excinfo.value)


def test_plain_keras_reads_tfsmp_files_and_refuses_damaged_ones(smp: object, tmp_path: Path
                                                                ) -> None:
    dm = _trained(smp)
    path = tmp_path / "m.weights.h5"
    dm.save_weights(str(path))  # type: ignore[attr-defined]
    plain = _model()
    plain.load_weights(str(path))  # the checksums are invisible to Keras
    for a, b in zip(plain.get_weights(), dm.get_weights()):  # type: ignore[attr-defined]
        np.testing.assert_array_equal(a, b)
    _flip(path, _data_offset(path, KERNEL) + 40)
    # HDF5's fletcher32 filter, checked by h5py itself (Keras wraps h5py's OSError in a
    # ValueError of its own: "A total of 1 objects could not be loaded")
    with pytest.raises((OSError, ValueError), match="filter returned failure"):
        _model().load_weights(str(path))


def test_a_scalar_is_checked_by_its_digest(smp: object, tmp_path: Path) -> None:
    """The optimizer's iteration count is a scalar: no HDF5 filter, the CRC-32 catches it."""
    import h5py

    dm = _trained(smp)
    path = tmp_path / "m.weights.h5"
    dm.save_weights(str(path))  # type: ignore[attr-defined]
    with h5py.File(path, "r+") as f:
        scalars = [n for n, o in _datasets(f) if o.ndim == 0]
        assert scalars, "the file holds no scalar dataset"
        f[scalars[0]][()] = f[scalars[0]][()] + 7  # changed in place: attributes kept
    with pytest.raises(OSError) as excinfo:
        dm.load_weights(str(path))  # type: ignore[attr-defined]
    _assert_corrupt(excinfo)
    assert "CRC-32" in str(excinfo.value)


def _datasets(f: object) -> list[tuple[str, object]]:
    import h5py

    out: list[tuple[str, object]] = []
    f.visititems(lambda n, o: out.append((n, o)) if isinstance(o, h5py.Dataset) else None)  # type: ignore[attr-defined]
    return out


def test_a_flipped_weight_in_a_keras_archive_raises_an_oserror(smp: object, tmp_path: Path
                                                               ) -> None:
    from tfsmp.checkpoint import keras_h5

    dm = _trained(smp)
    path = tmp_path / "m.keras"
    dm.save(str(path))  # type: ignore[attr-defined]
    with zipfile.ZipFile(path) as zf:  # stored, not deflated: the member's bytes are in place
        info = zf.getinfo(keras_h5.WEIGHTS_NAME)
        inner = tmp_path / "inner.weights.h5"
        inner.write_bytes(zf.read(keras_h5.WEIGHTS_NAME))
    raw = path.read_bytes()
    start = raw.index(inner.read_bytes()[:64], info.header_offset)
    _flip(path, start + _data_offset(inner, KERNEL) + 40)
    with pytest.raises(OSError) as excinfo:
        dm.load_weights(str(path))  # type: ignore[attr-defined]
    _assert_corrupt(excinfo)


def test_a_truncated_weights_file_raises_an_oserror(smp: object, tmp_path: Path) -> None:
    dm = _trained(smp)
    path = tmp_path / "m.weights.h5"
    dm.save_weights(str(path))  # type: ignore[attr-defined]
    path.write_bytes(path.read_bytes()[:300])
    with pytest.raises(OSError) as excinfo:
        dm.load_weights(str(path))  # type: ignore[attr-defined]
    _assert_corrupt(excinfo)


def test_keras_double_checkpoint_falls_back_to_its_bkp_file(smp: object, tmp_path: Path) -> None:
    """Keras's callback catches OSError from load_weights and restores its .bkp copy."""
    x, y = _data()
    backup = tmp_path / "backup"

    def fit(epochs: int) -> object:
        dm = _dm(smp)
        cb = keras.callbacks.BackupAndRestore(str(backup), double_checkpoint=True,
                                              delete_checkpoint=False)
        dm.fit(x, y, batch_size=BATCH, epochs=epochs, verbose=0, callbacks=[cb])  # type: ignore[attr-defined]
        return dm

    fit(2)  # two backups: latest.weights.h5 (epoch 2) and its .bkp (epoch 1)
    latest = backup / "latest.weights.h5"
    bkp = backup / "latest.weights.h5.bkp"
    assert latest.is_file() and bkp.is_file(), sorted(p.name for p in backup.iterdir())
    bkp_meta = json.loads((backup / "training_metadata.json.bkp").read_text())
    _flip(latest, _data_offset(latest, KERNEL) + 40)
    first: list[int] = []

    class Seen(keras.callbacks.Callback):  # type: ignore[misc]
        def on_epoch_begin(self, epoch: int, logs: object = None) -> None:
            first.append(epoch)

    dm = _dm(smp)
    cb = keras.callbacks.BackupAndRestore(str(backup), double_checkpoint=True)
    dm.fit(x, y, batch_size=BATCH, epochs=3, verbose=0, callbacks=[cb, Seen()])  # type: ignore[attr-defined]
    assert first[0] == bkp_meta["epoch"], (first, bkp_meta)  # resumed from the .bkp copy


# -- tfsmp checkpoints ---------------------------------------------------------------------------

def _manager(smp: object, dm: object, directory: Path) -> object:
    return smp.CheckpointManager({"model": dm, "optimizer": dm.optimizer},  # type: ignore[attr-defined]
                                 directory=str(directory), checkpoint_name="backup")


def test_a_flipped_byte_in_a_checkpoint_array_raises_an_oserror(smp: object, tmp_path: Path
                                                                ) -> None:
    dm = _trained(smp)
    path = Path(str(_manager(smp, dm, tmp_path).save()))  # type: ignore[attr-defined]
    manifest = json.loads((path / "manifest.json").read_text())
    entry = next(e for k, e in manifest["variables"].items() if k.endswith("kernel"))
    _flip(path / entry["file"], 200)
    with pytest.raises(OSError) as excinfo:
        _manager(smp, _trained(smp), tmp_path).restore()  # type: ignore[attr-defined]
    _assert_corrupt(excinfo)
    assert "checksum" in str(excinfo.value)


def test_a_damaged_manifest_raises_an_oserror(smp: object, tmp_path: Path) -> None:
    dm = _trained(smp)
    path = Path(str(_manager(smp, dm, tmp_path).save()))  # type: ignore[attr-defined]
    text = (path / "manifest.json").read_text()
    (path / "manifest.json").write_text(text[: len(text) // 2])
    with pytest.raises(OSError) as excinfo:
        _manager(smp, _trained(smp), tmp_path).restore()  # type: ignore[attr-defined]
    _assert_corrupt(excinfo)


def test_a_backup_folder_without_its_manifest_is_reported(smp: object, tmp_path: Path) -> None:
    """tfsmp's BackupAndRestore used to start over at epoch 0 without a word."""
    from tfsmp.checkpoint import BackupAndRestore

    x, y = _data()
    dm = _dm(smp)
    dm.fit(x, y, batch_size=BATCH, epochs=1, verbose=0,  # type: ignore[attr-defined]
           callbacks=[BackupAndRestore(str(tmp_path), delete_checkpoint=False)])
    folders = [p for p in tmp_path.iterdir() if p.is_dir() and p.name.startswith("backup-")]
    assert folders, sorted(p.name for p in tmp_path.iterdir())
    (folders[-1] / "manifest.json").unlink()
    dm = _dm(smp)
    with pytest.raises(OSError, match=r"must hold its manifest\.json.*'.*backup-\d+' has none"):
        dm.fit(x, y, batch_size=BATCH, epochs=2, verbose=0,  # type: ignore[attr-defined]
               callbacks=[BackupAndRestore(str(tmp_path))])
