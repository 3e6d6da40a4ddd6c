"""Verified files: checksums in every weights file tfsmp writes, checked on every load.

Example::

    node.create_dataset(key, data=array, **dataset_options(array))  # HDF5's fletcher32 filter
    stamp(node[key], array)                                        # + attribute tfsmp_crc32
    ...
    verify(node[key], value, "backup/latest.weights.h5")           # CorruptFileError if changed

[Note: verified files] HDF5 keeps no checksum of a dataset's bytes unless asked, so a Keras
``.weights.h5`` (or the weights inside a ``.keras`` archive) with a few flipped bytes inside a
weight loads silently with other numbers. tfsmp's writer (`keras_h5.WeightsWriter`) therefore
asks for two checks that plain Keras reads straight past:

* HDF5's own ``fletcher32`` filter on every non-scalar dataset: the HDF5 library verifies each
  chunk as it reads it and fails the read with an ``OSError`` ("filter returned failure"), in
  plain Keras (`keras.Model.load_weights`) as in tfsmp — so Keras's own fallbacks work even
  without tfsmp;
* a CRC-32 of the array's bytes in the dataset's attribute `DIGEST_ATTR` (scalars too, which
  HDF5 cannot chunk, and whatever a filter does not cover), which tfsmp checks after the read.

A file that fails either check, that HDF5 cannot open, or a tfsmp checkpoint array that fails its
SHA-256 (tfsmp/checkpoint/format.py), raises `CorruptFileError`: a `CheckpointError` that is
also an ``OSError``, which is what Keras's ``BackupAndRestore(double_checkpoint=True)`` catches to
fall back to its ``.bkp`` copy. The message says the file is damaged and to restore another copy;
``skip_mismatch`` cannot help a file that cannot be read, so it is never suggested for one.

Errors of a collective load travel between ranks as text; `gatherable` marks a corrupt file's
message with `CORRUPT_MARK` and `raise_gathered` raises the right class from the gathered texts,
so that every rank raises the same `CorruptFileError`.

Pure: numpy and zlib only (the HDF5 objects are passed in).
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence
from typing import Any

import numpy as np

from tfsmp.errors import CheckpointError

__all__ = ["CORRUPT_MARK", "DIGEST_ATTR", "CorruptFileError", "corrupt", "dataset_options",
           "digest", "gatherable", "raise_gathered", "stamp", "verify"]

DIGEST_ATTR = "tfsmp_crc32"
CORRUPT_MARK = "[corrupt file] "
_ADVICE = ("The file is damaged: restore an earlier copy (Keras's BackupAndRestore with "
           "double_checkpoint=True falls back to its .bkp file by itself).")


class CorruptFileError(CheckpointError, OSError):
    """A weights file or checkpoint that cannot be read back as written: a `CheckpointError`
    and an ``OSError`` (as h5py's own read errors), so Keras's fallbacks catch it."""


def corrupt(filepath: str, what: str, cause: str) -> CorruptFileError:
    """The error for ``what`` (a dataset, an array file) of ``filepath``."""
    return CorruptFileError(f"A weights file must read back as it was written. Received: "
                            f"{filepath!r}: {what} {cause}. {_ADVICE}")


def dataset_options(array: np.ndarray) -> dict[str, Any]:
    """`h5py` dataset options: the fletcher32 filter where HDF5 allows one (chunked data: not
    for scalars or empty arrays)."""
    return {"fletcher32": True} if array.ndim > 0 and array.size > 0 else {}


def digest(array: np.ndarray) -> int:
    """CRC-32 of the array's bytes in C order."""
    data = np.ascontiguousarray(array)
    return zlib.crc32(data.reshape(-1).view(np.uint8).data) if data.size else zlib.crc32(b"")


def stamp(dataset: Any, array: np.ndarray) -> None:
    """Records ``array``'s digest on the HDF5 ``dataset`` it was written to."""
    dataset.attrs[DIGEST_ATTR] = np.uint32(digest(array))


def verify(dataset: Any, value: np.ndarray, filepath: str) -> None:
    """Checks a value read from ``dataset`` against its recorded digest (none: nothing to check,
    e.g. a file Keras itself wrote).

    Raises:
        CorruptFileError: the digest differs.
    """
    expected = dataset.attrs.get(DIGEST_ATTR)
    if expected is None:
        return
    found = digest(np.asarray(value))
    if int(expected) != found:
        raise corrupt(filepath, f"dataset '{dataset.name}'",
                      f"has CRC-32 {found:08x}, the file recorded {int(expected):08x}")


def gatherable(error: BaseException) -> str:
    """The text of ``error`` to gather from every rank (marked if it is a corrupt file)."""
    if isinstance(error, CorruptFileError):
        return CORRUPT_MARK + str(error)
    if isinstance(error, CheckpointError):
        return str(error)
    return f"{type(error).__name__}: {error}"


def raise_gathered(messages: Sequence[str]) -> None:
    """Raises `CorruptFileError` if any gathered message is a corrupt file's (nothing else)."""
    bad = [m[len(CORRUPT_MARK):] for m in messages if m.startswith(CORRUPT_MARK)]
    if bad:
        more = f" (and {len(bad) - 1} more)" if len(bad) > 1 else ""
        raise CorruptFileError(bad[0] + more)
