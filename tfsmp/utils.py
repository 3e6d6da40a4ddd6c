"""SMP's checkpoint file helpers: ship a directory tree of files from one rank to another.

Example (AWS's DLC test ``send_receive_checkpoint.py``)::

    import tfsmp.utils as utils                    # smdistributed.modelparallel.tensorflow.utils
    if smp.rank() != 0:
        utils.send_checkpoint_files("./ckpts", 0)  # every file under ./ckpts, relative paths kept
    else:
        utils.receive_checkpoint_files("./copy", 1)  # ./copy/mp_rank_1/... on rank 0

As in SMP, ``dest_rank``/``src_rank`` are read as pipeline (``mp``) ranks by default, files are
sent in chunks of at most ``SMP_CKPT_TRANSFER_CHUNK_SIZE`` bytes (default 256 MiB), and a file
the receiver already has is replaced. tfsmp's own checkpoints need no shipping (every rank
reads a shared directory); these helpers exist so that SMP scripts run unchanged.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

from tfsmp import core
from tfsmp.core import RankType
from tfsmp.errors import CommError

__all__ = ["receive_checkpoint_files", "send_checkpoint_files"]

_TAG = 0x7C4C  # the file transfer's own tag: never mixed with smp.send or pipeline messages
_CHUNK_ENV = "SMP_CKPT_TRANSFER_CHUNK_SIZE"
_DEFAULT_CHUNK = 256 * 1024 * 1024  # pickled messages stay far below MPI's 2 GiB count limit


def _chunk_size() -> int:
    text = os.environ.get(_CHUNK_ENV, "") or str(_DEFAULT_CHUNK)
    if not text.isdigit() or int(text) < 1:
        raise CommError(f"{_CHUNK_ENV} must be a positive number of bytes. Received: "
                        f"{_CHUNK_ENV}={text!r}. Unset it or pass e.g. 1073741824.")
    return int(text)


def _files(root: str, sub_dir: list[str] | None) -> list[str]:
    """Paths of every file under ``root``, relative to it, sorted; only those directly in
    ``sub_dir`` directories when given (as SMP)."""
    wanted = None if sub_dir is None else {os.path.realpath(d) for d in sub_dir}
    out = []
    for folder, _, names in os.walk(root):
        if wanted is not None and os.path.realpath(folder) not in wanted:
            continue
        out += [os.path.relpath(os.path.join(folder, n), root) for n in names]
    return sorted(out)


def _pieces(root: str, relpath: str, size: int) -> Iterator[bytes]:
    with open(os.path.join(root, relpath), "rb") as f:
        while True:
            data = f.read(size)
            yield data
            if len(data) < size:
                return


def _peer(rank: int, rank_type: RankType, what: str) -> int:
    peer = core.to_world_rank(rank, rank_type)
    if peer == core.rank():
        raise CommError(f"Files go to another rank. Received: {what}={rank} "
                        f"({rank_type.name}), which is this process (world rank {peer}).")
    return peer


def send_checkpoint_files(ckpt_path: str | None, dest_rank: int, sub_dir: list[str] | None = None,
                          rank_type: RankType = RankType.MP_RANK) -> None:
    """Sends every file under ``ckpt_path`` to ``dest_rank``, which calls
    `receive_checkpoint_files`. Returns when the receiver has taken every piece.

    Args:
        ckpt_path: The directory to send (None or empty: send nothing, the receiver returns).
        dest_rank: The receiver, read as ``rank_type`` (default: its pipeline rank, as SMP).
        sub_dir: Send only the files directly inside these directories.
        rank_type: How ``dest_rank`` is read (``smp.RankType``).

    Raises:
        CommError: ``dest_rank`` is this process or out of range.
    """
    dest = _peer(dest_rank, rank_type, "dest_rank")
    world = core.state().comm.user_world
    size = _chunk_size()
    root = os.path.realpath(ckpt_path) if ckpt_path else ""
    files = _files(root, sub_dir) if root else []
    world.isend_obj(len(files), dest, _TAG, sync=True).wait()
    for relpath in files:  # one file at a time: the receiver never holds more than one
        for piece in _pieces(root, relpath, size):
            world.isend_obj((relpath, piece), dest, _TAG, sync=True).wait()


def receive_checkpoint_files(ckpt_path: str, src_rank: int,
                             rank_type: RankType = RankType.MP_RANK) -> list[str]:
    """Receives the files `send_checkpoint_files` sends from ``src_rank`` into ``ckpt_path``,
    keeping their paths relative to the sender's directory.

    Returns:
        The paths written.
    """
    src = _peer(src_rank, rank_type, "src_rank")
    world = core.state().comm.user_world
    size = _chunk_size()
    count = int(world.recv_obj(src, _TAG))
    written = []
    for _ in range(count):
        written.append(_receive_file(world, src, ckpt_path, size))
    return written


def _receive_file(world: Any, src: int, root: str, size: int) -> str:
    relpath, piece = world.recv_obj(src, _TAG)
    if os.path.isabs(relpath) or ".." in relpath.replace("\\", "/").split("/"):
        raise CommError(f"A received file must stay inside the target directory. Received: "
                        f"{relpath!r} from world rank {src}.")
    path = os.path.join(root, relpath)
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    tmp = path + ".part"
    with open(tmp, "wb") as f:
        f.write(piece)
        while len(piece) == size:  # a full piece: more of this file follows
            _, piece = world.recv_obj(src, _TAG)
            f.write(piece)
    os.replace(tmp, path)
    return path
