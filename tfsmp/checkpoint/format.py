"""On-disk format of a tfsmp checkpoint: arrays, manifest, atomic commit, `latest`, pruning.

Example::

    tmp = begin(root, "ckpt-3")                         # <root>/ckpt-3.tmp, empty
    entry = write_array(tmp, "model/d0_kernel.npy", w)   # {"file", "shape", "dtype", "sha256", "bytes"}
    write_manifest(tmp, {"variables": {"d0/kernel": entry}, ...})
    commit(tmp, os.path.join(root, "ckpt-3"))           # one rename: complete or absent
    write_latest(root, "ckpt-3")
    manifest = read_manifest(os.path.join(root, "ckpt-3"))
    w = read_array(os.path.join(root, "ckpt-3"), "d0/kernel", manifest["variables"]["d0/kernel"])

[Note: checkpoint layout] A checkpoint is one directory ``<name>-<N>`` holding ``manifest.json``
and one ``.npy`` file per array, keyed in the manifest by variable path (layer name and weight
name), never by stage or rank, so any partitioning can read it. Each entry records the file
(relative to the checkpoint), shape, dtype, byte size and SHA-256 of the file. Arrays are plain
``.npy`` read with ``allow_pickle=False``; ``bfloat16`` is stored as its ``uint16`` bits. The
directory is written under ``<name>-<N>.tmp`` and renamed into place only after every file and
the manifest are on disk, so a process killed while saving leaves the previous checkpoints
complete and never a partial ``<name>-<N>``. ``latest`` names the newest checkpoint; it is
replaced atomically (write a temporary file, ``os.replace``).

This module imports neither TensorFlow nor MPI.
"""

from __future__ import annotations

import errno
import hashlib
import io
import json
import os
import re
import shutil
import time
from typing import Any

import numpy as np

from tfsmp.checkpoint.checksum import CorruptFileError
from tfsmp.errors import CheckpointError

__all__ = [
    "FORMAT", "LATEST", "MANIFEST", "VERSION", "array_file", "atomic_write_text", "begin",
    "checkpoint_number", "commit", "describe_os_error", "list_checkpoints", "prune",
    "read_array", "read_latest", "read_manifest", "resolve", "safe_join",
    "unusable_checkpoints", "verify_array", "write_array", "write_latest", "write_manifest",
    "write_smp_markers",
]

FORMAT = "tfsmp-checkpoint"
VERSION = 1
MANIFEST = "manifest.json"
LATEST = "latest"
TMP_SUFFIX = ".tmp"
# Test hook: seconds to sleep after each array file, so a test can SIGKILL a save part-way.
SLOW_SAVE_ENV = "TFSMP_TEST_SLOW_SAVE"
_REQUIRED = ("format", "format_version", "variables")
_STORED_AS = {"bfloat16": "uint16"}  # dtypes .npy cannot hold without pickle -> their bit pattern


# -- paths -----------------------------------------------------------------------------------

def array_file(section: str, key: str) -> str:
    """A file name for ``key`` that is readable, filesystem-safe and unique per key."""
    safe = re.sub(r"[^A-Za-z0-9_.-]+", "_", key).strip("._")[:80] or "var"
    digest = hashlib.sha1(key.encode()).hexdigest()[:10]
    return f"{section}/{safe}.{digest}.npy"


def safe_join(ckpt_dir: str, relpath: Any, key: str) -> str:
    """``ckpt_dir/relpath``, refusing anything that leaves the checkpoint directory.

    Raises:
        CheckpointError: ``relpath`` is not a string, is absolute, contains ``..``, or resolves
            (through symlinks) outside ``ckpt_dir``.
    """
    bad = (not isinstance(relpath, str) or not relpath or os.path.isabs(relpath)
           or ".." in relpath.replace("\\", "/").split("/"))
    full = os.path.realpath(os.path.join(ckpt_dir, relpath)) if not bad else ""
    root = os.path.realpath(ckpt_dir)
    if bad or os.path.commonpath([root, full]) != root:
        raise CheckpointError(
            f"A manifest file path must stay inside the checkpoint directory. Received: "
            f"file={relpath!r} for variable '{key}' in {os.path.join(ckpt_dir, MANIFEST)}. "
            f"The manifest was edited or is not a tfsmp manifest: restore another checkpoint.")
    return full


# -- arrays ----------------------------------------------------------------------------------

def _slow_save_pause() -> None:
    delay = float(os.environ.get(SLOW_SAVE_ENV, "0") or 0)
    if delay > 0:
        time.sleep(delay)


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class _Digest(io.RawIOBase):
    """A write-only file that hashes and counts what passes through to ``out``."""

    def __init__(self, out: Any) -> None:
        self.out, self.sha, self.size = out, hashlib.sha256(), 0

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        self.sha.update(view)
        self.out.write(view)
        self.size += len(view)
        return len(view)


def write_array(ckpt_dir: str, relpath: str, value: Any, dtype: str | None = None
                ) -> dict[str, Any]:
    """Writes one array as ``.npy`` (fsynced) and returns its manifest entry.

    [Note: streaming arrays] An array goes to its file, and comes back from it, in place: the
    checksum is computed over the bytes as they pass (`np.lib.format` writes a non-file object
    in chunks of at most 16 MiB), and a read fills the array's own memory from the file. A
    process never holds a second copy of a variable, so a rank near its memory cap can save
    and restore a checkpoint (a 64 MiB variable used to take three extra copies to save and two
    to read).

    Args:
        ckpt_dir: The (temporary) checkpoint directory.
        relpath: File path inside it, e.g. from `array_file`.
        value: The array.
        dtype: The logical dtype name (e.g. ``"bfloat16"``); default: the array's own.

    Returns:
        ``{"file", "shape", "dtype", "bytes", "sha256"}``.
    """
    array = np.asarray(value)
    if not array.flags.c_contiguous:  # (np.ascontiguousarray would turn a scalar into shape (1,))
        array = array.copy(order="C")
    name = dtype or str(array.dtype)
    if name in _STORED_AS:
        array = array.view(_STORED_AS[name])
    path = os.path.join(ckpt_dir, relpath)
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as f:
            digest = _Digest(f)
            np.lib.format.write_array(digest, array, allow_pickle=False)
            f.flush()
            os.fsync(f.fileno())
    except OSError as e:  # a failed write() names no file: say which one (describe_os_error)
        if e.filename is None:
            e.filename = path
        raise
    _slow_save_pause()
    return {"file": relpath, "shape": [int(d) for d in array.shape], "dtype": name,
            "bytes": digest.size, "sha256": digest.sha.hexdigest()}


def read_array(ckpt_dir: str, key: str, entry: Any) -> np.ndarray:
    """Reads and verifies one array of a checkpoint ([Note: streaming arrays]).

    Raises:
        CheckpointError: the entry is malformed, the file is missing, truncated, fails its
            checksum, or holds another shape or dtype than the manifest says. The message names
            the file and the variable.
    """
    path = _checked_path(ckpt_dir, key, entry)
    with open(path, "rb") as f:
        array, digest = _read_npy(f, path, key, [int(d) for d in entry["shape"]])
    _check_digest(path, key, entry, digest)
    return _typed(array, path, key, entry)


def verify_array(ckpt_dir: str, key: str, entry: Any, chunk: int = 16 << 20) -> None:
    """Checks one array file's size and checksum without holding the array (16 MiB at a time).

    Raises:
        CheckpointError: as `read_array`.
    """
    path = _checked_path(ckpt_dir, key, entry)
    sha, size = hashlib.sha256(), 0
    with open(path, "rb") as f:
        while block := f.read(chunk):
            sha.update(block)
            size += len(block)
    _check_digest(path, key, entry, (size, sha.hexdigest()))


def _checked_path(ckpt_dir: str, key: str, entry: Any) -> str:
    if not isinstance(entry, dict) or not {"file", "shape", "dtype", "sha256"} <= set(entry):
        raise CheckpointError(
            f"Every manifest entry needs file, shape, dtype and sha256. Received: {entry!r} for "
            f"variable '{key}' in {os.path.join(ckpt_dir, MANIFEST)}. Restore another checkpoint.")
    path = safe_join(ckpt_dir, entry["file"], key)
    if not os.path.isfile(path):
        raise CorruptFileError(
            f"A checkpoint file is missing. Received: file '{path}' for variable '{key}' does "
            f"not exist. The checkpoint is incomplete: restore another one.")
    size, expected = os.path.getsize(path), entry.get("bytes")
    if isinstance(expected, int) and size != expected:
        _check_digest(path, key, entry, (size, ""))
    return path


def _check_digest(path: str, key: str, entry: dict[str, Any], found: tuple[int, str]) -> None:
    size, digest = found
    expected = entry.get("bytes")
    if isinstance(expected, int) and size != expected:
        raise CorruptFileError(
            f"A checkpoint file has the wrong size (truncated?). Received: file '{path}' for "
            f"variable '{key}' has {size} bytes, the manifest says {expected}. Restore "
            f"another checkpoint.")
    if digest != entry["sha256"]:
        raise CorruptFileError(
            f"A checkpoint file does not match its checksum (corrupted). Received: file "
            f"'{path}' for variable '{key}' has sha256 {digest[:16]}…, the manifest says "
            f"{str(entry['sha256'])[:16]}…. Restore another checkpoint.")


class _HashingReader(io.RawIOBase):
    def __init__(self, f: Any) -> None:
        self.f, self.sha, self.size = f, hashlib.sha256(), 0

    def readable(self) -> bool:
        return True

    def readinto(self, buf: Any) -> int:
        n = int(self.f.readinto(buf))
        self.sha.update(memoryview(buf)[:n])
        self.size += n
        return n


def _read_npy(f: Any, path: str, key: str, expected: list[int]
              ) -> tuple[np.ndarray, tuple[int, str]]:
    """The array of an open ``.npy`` file, read into its own memory, and (bytes, sha256) of
    the whole file. A header whose shape is not ``expected`` is refused before allocating."""
    reader = _HashingReader(f)
    stream = io.BufferedReader(reader, buffer_size=1 << 16)
    try:
        version = np.lib.format.read_magic(stream)
        read_header = (np.lib.format.read_array_header_1_0 if version == (1, 0)
                       else np.lib.format.read_array_header_2_0)
        shape, fortran, dtype = read_header(stream)
        if dtype.hasobject:
            raise ValueError("object arrays are not stored in checkpoints")
        if list(shape) != expected:
            raise CheckpointError(
                f"A checkpoint array must have the manifest's shape and dtype. Received: file "
                f"'{path}' for variable '{key}' holds {tuple(shape)} {dtype}, the manifest "
                f"says {tuple(expected)}. Restore another checkpoint.")
        array = np.empty(shape, dtype=dtype, order="F" if fortran else "C")
        view = array.reshape(-1, order="A").view(np.uint8).data
        done = 0
        while done < len(view):
            n = stream.readinto(view[done:])
            if not n:
                raise ValueError(f"the file ends after {done} of {len(view)} data bytes")
            done += n
        while stream.read(1 << 16):  # trailing bytes (none in a valid file) still count
            pass
    except (ValueError, OSError, EOFError) as e:
        raise CorruptFileError(
            f"A checkpoint file is not a readable .npy array. Received: file '{path}' for "
            f"variable '{key}': {e}. Restore another checkpoint.") from e
    return array, (reader.size, reader.sha.hexdigest())


def _typed(array: np.ndarray, path: str, key: str, entry: dict[str, Any]) -> np.ndarray:
    name = entry["dtype"]
    if name in _STORED_AS:
        import ml_dtypes

        array = array.view(getattr(ml_dtypes, name))
    if list(array.shape) != list(entry["shape"]) or str(array.dtype) != name:
        raise CheckpointError(
            f"A checkpoint array must have the manifest's shape and dtype. Received: file "
            f"'{path}' for variable '{key}' holds {tuple(array.shape)} {array.dtype}, the "
            f"manifest says {tuple(entry['shape'])} {name}. Restore another checkpoint.")
    return array


def describe_os_error(error: OSError, where: str) -> str:
    """What failed and where, for an ``OSError`` met while writing under ``where``: a full disk
    says so (and how much is free), a permission problem says so; never one for the other."""
    path = error.filename or where
    if error.errno in (errno.ENOSPC, errno.EDQUOT):
        try:
            free = f"; {shutil.disk_usage(os.path.dirname(path) or '.').free} bytes free there"
        except OSError:
            free = ""
        what = "disk quota exceeded" if error.errno == errno.EDQUOT else "no space left on device"
        return (f"A checkpoint needs room on its file system. Received: {what} while writing "
                f"'{path}'{free}. Fix: free space there, or save to another directory.")
    if error.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        return (f"A checkpoint directory must be writable. Received: {error.strerror} for "
                f"'{path}'. Fix: check the directory and its permissions, or save elsewhere.")
    return f"A checkpoint file could not be written or read. Received: {error} ('{path}')."


# -- manifest --------------------------------------------------------------------------------

def atomic_write_text(path: str, text: str) -> None:
    """Writes ``text`` to ``path`` so a reader sees the old or the new content, never a mix."""
    tmp = f"{path}.{os.getpid()}{TMP_SUFFIX}"
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(os.path.dirname(os.path.abspath(path)))


def write_manifest(ckpt_dir: str, manifest: dict[str, Any]) -> None:
    """Writes ``manifest.json`` (adding the format name and version)."""
    body = {"format": FORMAT, "format_version": VERSION, **manifest}
    atomic_write_text(os.path.join(ckpt_dir, MANIFEST), json.dumps(body, indent=1, sort_keys=True))


def read_manifest(ckpt_dir: str) -> dict[str, Any]:
    """Reads and checks ``manifest.json`` of a checkpoint directory.

    Raises:
        CheckpointError: missing, not JSON (e.g. truncated), another format, a newer version, or
            without a ``variables`` table.
    """
    path = os.path.join(ckpt_dir, MANIFEST)
    if not os.path.isfile(path):
        raise CheckpointError(
            f"A checkpoint directory must hold {MANIFEST}. Received: '{ckpt_dir}' has none. "
            f"Pass a checkpoint written by tfsmp (e.g. CheckpointManager.latest_checkpoint).")
    try:
        with open(path) as f:
            manifest = json.load(f)
    except (ValueError, UnicodeDecodeError) as e:
        raise CorruptFileError(
            f"A checkpoint manifest must be valid JSON. Received: '{path}' does not parse "
            f"({e}); it is truncated or corrupted. Restore another checkpoint.") from e
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        got = manifest.get("format") if isinstance(manifest, dict) else type(manifest).__name__
        raise CheckpointError(
            f"The manifest must be a tfsmp checkpoint manifest. Received: format={got!r} in "
            f"'{path}'. Pass a directory written by tfsmp.")
    version = manifest.get("format_version")
    if not isinstance(version, int) or version > VERSION:
        raise CheckpointError(
            f"This tfsmp reads checkpoint format versions up to {VERSION}. Received: "
            f"format_version={version!r} in '{path}'. Upgrade tfsmp to read it.")
    missing = [k for k in _REQUIRED if k not in manifest]
    if missing or not isinstance(manifest["variables"], dict):
        raise CheckpointError(
            f"A checkpoint manifest needs the fields {list(_REQUIRED)}. Received: '{path}' lacks "
            f"{missing or ['a variables table']}. Restore another checkpoint.")
    return manifest


# -- directories of checkpoints ---------------------------------------------------------------

def checkpoint_number(name: str, prefix: str) -> int | None:
    """N for a directory named ``<prefix>-N``, else None."""
    m = re.fullmatch(re.escape(prefix) + r"-(\d+)", name)
    return int(m.group(1)) if m else None


def list_checkpoints(root: str, prefix: str) -> list[str]:
    """Complete checkpoints ``<root>/<prefix>-N`` (with a manifest), oldest (lowest N) first."""
    if not os.path.isdir(root):
        return []
    found = []
    for name in os.listdir(root):
        n = checkpoint_number(name, prefix)
        if n is not None and os.path.isfile(os.path.join(root, name, MANIFEST)):
            found.append((n, os.path.join(root, name)))
    return [path for _, path in sorted(found)]


def unusable_checkpoints(root: str, prefix: str) -> list[str]:
    """Folders ``<root>/<prefix>-N`` without a manifest, oldest first. A save never leaves one
    (it writes ``<prefix>-N.tmp`` and renames it only once complete, [Note: checkpoint layout]),
    so such a folder was damaged or edited."""
    if not os.path.isdir(root):
        return []
    found = []
    for name in os.listdir(root):
        n = checkpoint_number(name, prefix)
        path = os.path.join(root, name)
        if n is not None and os.path.isdir(path) and not os.path.isfile(
                os.path.join(path, MANIFEST)):
            found.append((n, path))
    return [path for _, path in sorted(found)]


def read_latest(root: str, prefix: str) -> str | None:
    """The checkpoint ``latest`` names if it is complete, else the highest complete one.

    Raises:
        CorruptFileError: ``latest`` names a folder that lacks its manifest, or the newest
            ``<prefix>-N`` folder does: a backup that looks present but cannot be used is
            reported, never silently passed over for an older one or for none.
    """
    pointer = os.path.join(root, LATEST)
    complete = list_checkpoints(root, prefix)
    bad = unusable_checkpoints(root, prefix)
    named = None
    if os.path.isfile(pointer):
        with open(pointer) as f:
            named = os.path.join(root, f.read().strip())
    newest_bad = bad[-1] if bad else None
    if named in bad or (newest_bad is not None and (
            not complete or _number(newest_bad, prefix) > _number(complete[-1], prefix))):
        _unusable(root, named if named in bad else newest_bad, complete)
    if named is not None and named in complete:
        return named
    return complete[-1] if complete else None


def _number(path: str, prefix: str) -> int:
    return checkpoint_number(os.path.basename(path), prefix) or 0


def _unusable(root: str, path: str | None, complete: list[str]) -> None:
    older = (f"restore the previous one by name ({os.path.basename(complete[-1])!r}) or remove "
             f"'{path}' to resume from it" if complete else f"remove '{path}' (or all of "
             f"'{root}') to start over")
    raise CorruptFileError(
        f"A checkpoint folder must hold its {MANIFEST}. Received: '{path}' has none, so the "
        f"backup there cannot be used (a save in progress writes a '.tmp' folder instead: this "
        f"one was damaged or edited). Fix: {older}.")


def write_latest(root: str, name: str) -> None:
    atomic_write_text(os.path.join(root, LATEST), name + "\n")


def write_smp_markers(root: str, name: str, partitions: int) -> None:
    """``<root>/mp_rank_<i>/checkpoint`` for every pipeline rank i, naming ``<name>``.

    [Note: SMP layout markers] SMP wrote one TensorFlow checkpoint per partition under
    ``mp_rank_<i>/`` with TF's ``checkpoint`` state file beside it, and scripts check for those
    files (AWS's DLC ``tf2_conv.py`` asserts them; resume logic tests ``mp_rank_0/checkpoint``).
    tfsmp's checkpoint is one partition-independent directory, so these are markers only, in
    TF's state-file syntax: ``model_checkpoint_path: "../ckpt-N"``. TensorFlow finds no TF
    checkpoint there (no ``.index``), which is right: restore through `CheckpointManager`.
    """
    text = f'model_checkpoint_path: "../{name}"\nall_model_checkpoint_paths: "../{name}"\n'
    for i in range(partitions):
        folder = os.path.join(root, f"mp_rank_{i}")
        os.makedirs(folder, exist_ok=True)
        atomic_write_text(os.path.join(folder, "checkpoint"), text)


def resolve(root: str, prefix: str, restore_prefix: str | None) -> str | None:
    """The checkpoint directory for ``restore_prefix`` (a name, a path, or None for the latest).

    Raises:
        CheckpointError: ``restore_prefix`` names no complete checkpoint.
    """
    if restore_prefix is None:
        return read_latest(root, prefix)
    candidates = [str(restore_prefix), os.path.join(root, str(restore_prefix))]
    for path in candidates:
        if os.path.isfile(os.path.join(path, MANIFEST)):
            return path
    names = [os.path.basename(p) for p in list_checkpoints(root, prefix)]
    raise CheckpointError(
        f"restore_prefix must name a complete checkpoint. Received: restore_prefix="
        f"{restore_prefix!r}; '{root}' holds {names or 'no checkpoints'}. Pass one of those, "
        f"or None for the latest.")


def begin(root: str, name: str) -> str:
    """Creates an empty ``<root>/<name>.tmp`` (removing a stale one) and returns it."""
    tmp = os.path.join(root, name + TMP_SUFFIX)
    if os.path.exists(tmp):
        shutil.rmtree(tmp)
    os.makedirs(tmp)
    return tmp


def commit(tmp: str, final: str) -> None:
    """Moves a finished ``tmp`` directory to ``final`` in one rename (replacing ``final``)."""
    for dirpath, _, _ in os.walk(tmp):
        _fsync_dir(dirpath)
    old = None
    if os.path.exists(final):  # rename cannot replace a non-empty directory: move it aside first
        old = f"{final}.old{TMP_SUFFIX}"
        if os.path.exists(old):
            shutil.rmtree(old)
        os.rename(final, old)
    os.rename(tmp, final)
    _fsync_dir(os.path.dirname(os.path.abspath(final)))
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def prune(root: str, prefix: str, max_to_keep: int | None, keep: str | None = None) -> list[str]:
    """Deletes the oldest complete checkpoints beyond ``max_to_keep`` (never ``keep``) and any
    leftover ``.tmp`` directories; returns the deleted paths."""
    deleted: list[str] = []
    if max_to_keep is not None:
        complete = list_checkpoints(root, prefix)
        for path in complete[:max(len(complete) - max_to_keep, 0)]:
            if keep is None or os.path.abspath(path) != os.path.abspath(keep):
                shutil.rmtree(path, ignore_errors=True)
                deleted.append(path)
    for name in os.listdir(root) if os.path.isdir(root) else []:
        stem = name[:-len(TMP_SUFFIX)] if name.endswith(TMP_SUFFIX) else ""
        if stem and checkpoint_number(stem.removesuffix(".old"), prefix) is not None:
            shutil.rmtree(os.path.join(root, name), ignore_errors=True)
    return deleted
