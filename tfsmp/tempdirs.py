"""Private folders at predictable paths in the shared temp directory: mode 0700, owner checked.

Example::

    root = private_dir(os.path.join(tempfile.gettempdir(), "tfsmp-jobs"))

[Note: private temp folders] A folder whose name anyone can predict (`/tmp/tfsmp-jobs`, the
watchdog's `/tmp/tfsmp-watchdog-<job>`) can be made first by another user of the machine, as a
folder they own or a symlink to one of theirs, and then reads or replaces what tfsmp keeps
there. `private_dir` creates it with mode 0700 and then checks, on the folder itself (not through
a symlink), that it is a directory, owned by this user, with no access for group or others; a
folder of ours with a looser mode is tightened, anything else is refused with the path and the
owner. Unpredictable folders (`tempfile.mkdtemp`) are private already and need none of this.

Pure: the standard library only.
"""

from __future__ import annotations

import os
import stat

from tfsmp.errors import ConfigError

__all__ = ["private_dir"]


def private_dir(path: str) -> str:
    """Creates ``path`` (and missing parents) as a private folder, or checks the one there.

    Returns:
        ``path``.

    Raises:
        ConfigError: ``path`` is a symlink, not a directory, or owned by another user.
    """
    os.makedirs(path, mode=0o700, exist_ok=True)
    info = os.lstat(path)
    uid = os.geteuid() if hasattr(os, "geteuid") else None
    problem = None
    if stat.S_ISLNK(info.st_mode):
        problem = f"a symlink to {os.readlink(path)!r}"
    elif not stat.S_ISDIR(info.st_mode):
        problem = "not a directory"
    elif uid is not None and info.st_uid != uid:
        problem = f"owned by user id {info.st_uid}, not by this user ({uid})"
    if problem is not None:
        raise ConfigError(
            f"A private folder at a predictable path must be a directory of this user's. "
            f"Received: {path!r} is {problem}. Fix: remove it, or choose another location "
            f"(an output_path=, or TMPDIR).")
    if stat.S_IMODE(info.st_mode) & 0o077:
        os.chmod(path, 0o700)
    return path
