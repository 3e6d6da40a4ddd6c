"""The Keras weights-file layout (``.weights.h5``, and inside ``.keras``), read and written in parts.

Example::

    layout = record_layout(model)                    # no variable is read
    entry = layout.by_variable()[id(v)]              # Entry(group="layers/dense/vars", key="0")
    with open_weights("pretrained.keras") as h5:     # reads only what is asked for
        value = read_entry(h5, entry, "pretrained.keras")
    with WeightsWriter("out.weights.h5", layout) as w:
        w.put(entry, value)                          # arrays may arrive in any order

[Note: Keras weights layout] Keras 3 (checked on 3.15, ``keras/src/saving/saving_lib.py``) walks
the model: a Functional or Sequential model first visits its ``layers`` (names from the class,
``dense``, ``dense_1``, … in layer order — not the layer names), then every attribute, in
sorted order; each object with ``save_own_variables`` writes ``<path>/vars/<i>`` (the root
writes ``vars/<i>``), and the group gets the attribute ``name`` = the object's name. Rather
than re-implementing that walk, `record_layout` runs Keras's own ``_save_state`` with a store
that records which variable goes where and reads nothing — so the layout is exact, including
nested models, and works while most variables live on other ranks. This module is the one
place tfsmp uses Keras's private saving API.

[Note: computed entries] Some layers store a value computed from their variables, not the
variables themselves (a quantized `Dense` with LoRA stores its kernel with the LoRA product
merged in and quantized again). Recording computes it, so on a rank that does not hold the
layer the walk would read released variables: it runs under `stand_in_reads` (zeros), and
each such entry records its layer, so that the rank holding the layer, which computed the real
value, is the one that sends it (`tfsmp.checkpoint.export._owners`); no rank ever writes a
stand-in.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import struct
import sys
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import h5py
import keras
import numpy as np
from keras.src.saving import saving_lib

from tfsmp.checkpoint import checksum
from tfsmp.errors import CheckpointError

__all__ = ["Entry", "H5Layout", "WeightsWriter", "model_config", "model_from_config",
           "open_weights", "read_entry", "record_layout", "write_keras_archive"]

WEIGHTS_NAME = "model.weights.h5"   # the weights member of a .keras archive
CONFIG_NAME = "config.json"
METADATA_NAME = "metadata.json"


@dataclass
class Entry:
    """One dataset of the weights file: ``<group>/<key>`` and what Keras stored there."""

    group: str
    key: str
    value: Any = field(repr=False)
    # for a value the layer computed ([Note: computed entries]): the layer whose
    # ``save_own_variables`` stored it
    layer: Any = field(default=None, repr=False, compare=False)

    @property
    def dataset(self) -> str:
        return f"{self.group}/{self.key}"


@dataclass
class H5Layout:
    """Groups (with their ``name`` attributes) and datasets of a model's weights file."""

    groups: list[tuple[str, dict[str, Any]]]
    entries: list[Entry]

    def by_variable(self) -> dict[int, Entry]:
        """``{id(variable): entry}`` for entries that store a variable itself."""
        return {id(e.value): e for e in self.entries if isinstance(e.value, keras.Variable)}


class _Recorder(saving_lib.H5IOStore):  # type: ignore[misc]
    """A write store for ``_save_state`` that records the layout and touches no value."""

    def __init__(self) -> None:  # no file: H5IOStore.__init__ would open one
        self.groups: list[tuple[str, dict[str, Any]]] = []
        self.entries: list[Entry] = []
        self._group = "vars"

    def __bool__(self) -> bool:
        return True

    def make(self, path: str, metadata: dict[str, Any] | None = None) -> _Recorder:
        self._group = f"{path}/vars" if path else "vars"
        if metadata:
            self.groups.append((self._group, dict(metadata)))
        return self

    def __setitem__(self, key: str, value: Any) -> None:
        layer = None
        if not isinstance(value, keras.Variable):  # [Note: computed entries]
            layer = sys._getframe(1).f_locals.get("self")  # the saving layer's method
        self.entries.append(Entry(self._group, str(key), value, layer))

    def close(self) -> None:
        pass


def record_layout(model: keras.Model, skip: tuple[Any, ...] = ()) -> H5Layout:
    """The weights-file layout of ``model``; objects in ``skip`` (e.g. its optimizer) are left
    out. See [Note: Keras weights layout]."""
    from tfsmp.graph.deferred import stand_in_reads

    recorder = _Recorder()
    with stand_in_reads():  # [Note: computed entries]
        saving_lib._save_state(model, weights_store=recorder, assets_store=None,
                               inner_path="", visited_saveables={id(o) for o in skip
                                                                 if o is not None})
    return H5Layout(recorder.groups, recorder.entries)


def model_config(model: keras.Model) -> tuple[dict[str, Any] | None, str | None]:
    """The model's Keras serialization (what ``config.json`` of a ``.keras`` file holds), or
    (None, reason) when the model is not Functional/Sequential or does not serialize."""
    from keras.src.models.functional import Functional

    if not isinstance(model, (Functional, keras.Sequential)):
        return None, (f"{type(model).__name__} is a subclassed model: rebuild it in code and "
                      f"call load_weights, or export from the training script with model.save")
    try:
        config_json, _ = saving_lib._serialize_model_as_json(model)
    except Exception as e:  # any serialization failure only disables offline export
        return None, f"{type(e).__name__}: {e}"
    return dict(json.loads(config_json)), None


def model_from_config(config: dict[str, Any]) -> keras.Model:
    """Rebuilds a model from `model_config`'s output, as ``keras.models.load_model`` does
    (safe mode: no arbitrary code)."""
    from keras.src.saving import serialization_lib

    with serialization_lib.ObjectSharingScope():
        model: keras.Model = serialization_lib.deserialize_keras_object(config, safe_mode=True)
    return model


# -- reading ------------------------------------------------------------------------------------

class _Window(io.RawIOBase):
    """A read-only file view of bytes [start, start + size) of a file (an uncompressed zip member)."""

    def __init__(self, path: str, start: int, size: int) -> None:
        self._f = open(path, "rb")  # noqa: SIM115 - closed in close()
        self._start, self._size, self._pos = start, size, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._size}[whence]
        self._pos = max(0, base + offset)
        return self._pos

    def readinto(self, buffer: Any) -> int:
        n = max(0, min(len(buffer), self._size - self._pos))
        self._f.seek(self._start + self._pos)
        data = self._f.read(n)
        buffer[:len(data)] = data
        self._pos += len(data)
        return len(data)

    def close(self) -> None:
        self._f.close()
        super().close()


def _member_window(path: str, zf: zipfile.ZipFile, name: str) -> io.RawIOBase | None:
    info = zf.getinfo(name)
    if info.compress_type != zipfile.ZIP_STORED:
        return None
    with open(path, "rb") as f:
        f.seek(info.header_offset)
        header = f.read(30)
    if len(header) != 30 or header[:4] != b"PK\x03\x04":
        return None
    name_len, extra_len = struct.unpack("<HH", header[26:30])
    return _Window(path, info.header_offset + 30 + name_len + extra_len, info.file_size)


@contextlib.contextmanager
def open_weights(filepath: str | bytes) -> Iterator[h5py.File]:
    """Opens the weights of a ``.weights.h5`` or ``.keras`` file for partial reads.

    A ``.keras`` archive stores its weights uncompressed, so they are read in place; a
    compressed member is read into memory, and so is an archive given as bytes.

    Raises:
        CheckpointError: the file is missing.
        CorruptFileError: it cannot be opened as a Keras weights file (an OSError too).
    """
    if isinstance(filepath, (bytes, bytearray)):  # a .keras archive in memory (unpickling)
        with zipfile.ZipFile(io.BytesIO(filepath)) as zf:
            memory = io.BytesIO(zf.read(WEIGHTS_NAME))
        h5 = h5py.File(memory, "r")
        try:
            yield h5
        finally:
            h5.close()
        return
    if not os.path.isfile(filepath):
        raise CheckpointError(
            f"The weights file must exist. Received: filepath={filepath!r}. Pass the path of a "
            f".weights.h5 or .keras file.")
    handle: Any = None
    try:
        if filepath.endswith(".keras"):
            with zipfile.ZipFile(filepath) as zf:
                if WEIGHTS_NAME not in zf.namelist():
                    raise CheckpointError(
                        f"A .keras file must hold {WEIGHTS_NAME}. Received: {filepath!r} "
                        f"holds {zf.namelist()}. Save it with keras' model.save().")
                handle = _member_window(filepath, zf, WEIGHTS_NAME) or io.BytesIO(
                    zf.read(WEIGHTS_NAME))
            h5 = h5py.File(handle, "r")
        else:
            h5 = h5py.File(filepath, "r")
    except (OSError, zipfile.BadZipFile) as e:  # an OSError still: Keras's fallbacks catch it
        raise checksum.CorruptFileError(
            f"The weights file must be a Keras .weights.h5 or .keras file. Received: "
            f"{filepath!r} cannot be read ({e}); it is damaged, truncated or of another format: "
            f"restore an earlier copy.") from e
    try:
        yield h5
    finally:
        h5.close()
        if handle is not None:
            handle.close()


def has_entry(h5: h5py.File, entry: Entry) -> bool:
    return entry.dataset in h5


def read_entry(h5: h5py.File, entry: Entry, filepath: str) -> np.ndarray:
    """The array stored for ``entry``, read with Keras's safety checks (no links, no bombs).

    Raises:
        CheckpointError: the dataset is missing or unsafe.
        CorruptFileError: it cannot be read, or fails its checksum (an OSError too).
    """
    try:
        group = saving_lib.safe_get_h5_group(h5, entry.group)
        dataset = saving_lib.safe_get_h5_dataset(group, entry.key)
    except (KeyError, ValueError) as e:
        raise CheckpointError(
            f"The weights file must hold dataset '{entry.dataset}'. Received: {filepath!r}: "
            f"{e}.") from e
    try:  # HDF5 checks the fletcher32 filter here ([Note: verified files] in checksum.py)
        value = np.asarray(dataset)
    except OSError as e:
        raise checksum.corrupt(filepath, f"dataset '{entry.dataset}'", f"cannot be read ({e})"
                               ) from e
    checksum.verify(dataset, value, filepath)
    if dataset.attrs.get("dtype") == "bfloat16":
        import ml_dtypes

        value = value.astype(ml_dtypes.bfloat16)
    return value


def group_size(h5: h5py.File, group: str) -> int | None:
    """How many datasets the file has in ``group`` (None: no such group)."""
    node = h5.get(group)
    return len(node.keys()) if isinstance(node, h5py.Group) else None


# -- writing ------------------------------------------------------------------------------------

class WeightsWriter:
    """Writes a Keras weights file group by group, as `H5IOStore` would (datasets in any order)."""

    def __init__(self, path: str, layout: H5Layout, attrs: dict[str, str] | None = None) -> None:
        self.h5 = h5py.File(path, "w")
        for k, v in (attrs or {}).items():  # root attributes: Keras's loader reads none
            self.h5.attrs[k] = v
        for group, metadata in layout.groups:
            node = self.h5.require_group(group)
            for k, v in metadata.items():
                node.attrs[k] = v

    def put(self, entry: Entry, value: Any) -> None:
        """Writes one dataset with its checksums ([Note: verified files] in checksum.py)."""
        node = self.h5.require_group(entry.group)
        array = np.asarray(value)
        dataset = node.create_dataset(entry.key, data=array, **checksum.dataset_options(array))
        if keras.backend.standardize_dtype(array.dtype) == "bfloat16":
            dataset.attrs["dtype"] = "bfloat16"
        checksum.stamp(dataset, array)

    def close(self) -> None:
        self.h5.close()

    def __enter__(self) -> WeightsWriter:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def write_keras_archive(path: str, model: keras.Model, weights_file: str,
                        compile_config: dict[str, Any] | None = None) -> None:
    """Writes a ``.keras`` zip (metadata, config, weights) exactly as Keras lays it out; with
    ``compile_config`` (a compiled `DistributedModel`'s, the wrapped model being uncompiled)
    in the config, as Keras writes a compiled model's, so ``load_model`` compiles it."""
    config_json, metadata_json = saving_lib._serialize_model_as_json(model)
    if compile_config is not None:
        config = json.loads(config_json)
        config["compile_config"] = compile_config
        config_json = json.dumps(config)
    with zipfile.ZipFile(path, "w") as zf:  # stored, not deflated: as keras writes it
        zf.writestr(METADATA_NAME, metadata_json)
        zf.writestr(CONFIG_NAME, config_json)
        zf.write(weights_file, WEIGHTS_NAME)
