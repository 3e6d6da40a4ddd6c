"""Per-rank memory caps: one memory cgroup per rank on CPU hosts, TensorFlow's device limit on GPUs.

Example::

    cap = parse_size("2.5G")                         # 2684354560 bytes (G = GiB)
    controller = find_controller()                   # raises ConfigError where cgroups are not writable
    prefix = rank_prefix(cap, job="tfsmp-123")       # put before `python -m mpi4py train.py`
    # under mpirun, each rank runs: python -m tfsmp.launch.memcap --bytes N --job J -- python ...
    peak_bytes()                                     # inside a rank: its cgroup's maximum usage

[Note: one cgroup per rank] `tfsmp run --memory-per-rank X` puts every rank in a memory cgroup of
its own whose limit is X, which is what a device's memory is to a GPU rank: a rank that needs
more than X is killed (the kernel's OOM killer, SIGKILL) and the job ends. The cgroups are made
*inside the launcher's own cgroup* (``/proc/self/cgroup``), so whatever contains the launcher (a
container, a CI job, systemd) still accounts for the ranks, and the host's other cgroups are left
alone. A small guard process per rank (this module's `main`) makes the rank's cgroup, starts the
rank inside it, waits, reports a rank killed for exceeding its cap with its peak, and removes the
cgroup. The guard itself stays outside, so its own few MB are not charged to the rank. Usage
counts what the kernel charges to the cgroup: anonymous memory, and page cache of files the rank
reads first (shared libraries already cached by another process are not charged again).

[Note: device caps] On a host with GPUs the same option bounds TensorFlow's memory on the rank's
device instead (`tf.config.set_logical_device_configuration(..., memory_limit=...)`, applied by
`tfsmp.init` from ``TFSMP_MEMORY_PER_RANK``): that is the memory that runs out first there.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tfsmp.launch import rankguard

__all__ = [
    "CAP_ENV",
    "Controller",
    "check_before_launch",
    "find_controller",
    "format_size",
    "host_has_gpu",
    "launch_setup",
    "main",
    "parse_size",
    "peak_bytes",
    "rank_prefix",
]

CAP_ENV = "TFSMP_MEMORY_PER_RANK"  # bytes; every rank reads it (the GPU path, and reports)
_ROOTS = ("/sys/fs/cgroup/memory", "/sys/fs/cgroup")  # cgroup v1 memory controller, then v2
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(i?b?)\s*$", re.IGNORECASE)


def parse_size(text: str | int) -> int:
    """Bytes of a size such as ``"2.5G"``, ``"2560M"``, ``"2.5GiB"`` or ``"2684354560"``.

    K, M, G and T are powers of 1024, as in cgroups, Docker and Kubernetes' ``Gi``.

    Raises:
        ConfigError: the text is not a positive size.
    """
    from tfsmp.errors import ConfigError

    if isinstance(text, int) and not isinstance(text, bool):
        value = text
    else:
        m = _SIZE.match(str(text))
        if m is None:
            raise ConfigError(
                f"A memory size is a number with an optional unit K, M, G or T (powers of "
                f"1024). Received: {text!r}. Fix: e.g. --memory-per-rank 2.5G.")
        scale = 1024 ** ("kmgt".find(m.group(2).lower()) + 1) if m.group(2) else 1
        value = int(float(m.group(1)) * scale)
    if value <= 0:
        raise ConfigError(f"A memory size must be positive. Received: {text!r}.")
    return value


def format_size(n: float) -> str:
    """``2684354560`` -> ``"2.50 GiB"``."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n:.0f} B"


def host_has_gpu() -> bool:
    """Whether this host shows an NVIDIA or AMD GPU (the checks `tfsmp.init` makes)."""
    if os.environ.get("CUDA_VISIBLE_DEVICES", None) == "":
        return False
    return any(os.path.exists(p) for p in ("/dev/nvidia0", "/proc/driver/nvidia/gpus", "/dev/kfd"))


# -- cgroups ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Controller:
    """A writable memory cgroup of this process (v1 or v2) under which rank cgroups are made."""

    path: Path
    version: int

    @property
    def limit_file(self) -> str:
        return "memory.limit_in_bytes" if self.version == 1 else "memory.max"

    @property
    def peak_file(self) -> str:
        return "memory.max_usage_in_bytes" if self.version == 1 else "memory.peak"


def _own_cgroup(version: int, proc_cgroup: str) -> str | None:
    """This process's cgroup path under the memory hierarchy of ``version``."""
    for line in proc_cgroup.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        if version == 1 and "memory" in parts[1].split(","):
            return parts[2]
        if version == 2 and parts[0] == "0" and parts[1] == "":
            return parts[2]
    return None


def _candidates(proc_cgroup: str) -> list[Controller]:
    out = []
    v1 = _own_cgroup(1, proc_cgroup)
    if v1 is not None and os.path.isfile(os.path.join(_ROOTS[0], "memory.limit_in_bytes")):
        out.append(Controller(Path(_ROOTS[0] + v1.rstrip("/")), 1))
    v2 = _own_cgroup(2, proc_cgroup)
    if v2 is not None and os.path.isfile(os.path.join(_ROOTS[1], "cgroup.controllers")):
        path = Path(_ROOTS[1] + v2.rstrip("/"))
        if "memory" in _read(path / "cgroup.subtree_control").split():
            out.append(Controller(path, 2))
    return out


def find_controller(proc_cgroup: str | None = None) -> Controller:
    """The memory cgroup this process may make rank cgroups in ([Note: one cgroup per rank]).

    Raises:
        ConfigError: no writable memory controller (no cgroups, not root, not delegated), with
            what would make one available.
    """
    from tfsmp.errors import ConfigError

    text = proc_cgroup if proc_cgroup is not None else _read(Path("/proc/self/cgroup"))
    found = _candidates(text)
    for c in found:
        if os.access(c.path, os.W_OK):
            return c
    seen = ", ".join(f"{c.path} (v{c.version}, not writable)" for c in found) or "none"
    raise ConfigError(
        "--memory-per-rank needs a memory cgroup this user may create cgroups in (cgroup v1's "
        "memory controller, or cgroup v2 with memory enabled in cgroup.subtree_control). "
        f"Received: memory controllers of this process: {seen}; uid {os.geteuid()}. Fix: run "
        "as root or in a container started with a writable cgroup (e.g. docker run "
        "--cgroupns=private), under a delegated systemd scope (systemd-run --user --scope -p "
        "Delegate=yes), or on a GPU host, where the option sets TensorFlow's device memory limit.")


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except OSError:
        return ""


def _make_rank_cgroup(controller: Controller, job: str, rank: str, limit: int) -> Path:
    group = controller.path / job / f"rank{rank}"
    group.mkdir(parents=True, exist_ok=True)
    (group / controller.limit_file).write_text(str(limit))
    if controller.version == 1:
        swap = group / "memory.memsw.limit_in_bytes"  # no swapping past the cap either
        with contextlib.suppress(OSError):
            swap.write_text(str(limit))
    else:
        with contextlib.suppress(OSError):
            (group / "memory.swap.max").write_text("0")
    return group


def _remove(group: Path) -> None:
    for path in (group, group.parent):
        with contextlib.suppress(OSError):
            path.rmdir()  # the job's directory goes once its last rank is gone


def _oom_kills(group: Path, version: int) -> int:
    name = "memory.oom_control" if version == 1 else "memory.events"
    for line in _read(group / name).splitlines():
        key, _, value = line.partition(" ")
        if key == "oom_kill":
            return int(value)
    return 0


def peak_bytes() -> int | None:
    """This process's cgroup's maximum memory usage so far, or None outside a memory cgroup
    with a peak counter (the figure `tfsmp run --memory-per-rank` holds each rank to)."""
    text = _read(Path("/proc/self/cgroup"))
    for version in (1, 2):
        own = _own_cgroup(version, text)
        if own is None or own == "/":
            continue
        c = Controller(Path(_ROOTS[version - 1] + own.rstrip("/")), version)
        value = _read(c.path / c.peak_file).strip()
        if value.isdigit():
            return int(value)
    return None


def reset_peak() -> bool:
    """Resets this process's cgroup maximum to its current usage (cgroup v1); whether it could."""
    own = _own_cgroup(1, _read(Path("/proc/self/cgroup")))
    if own is None or own == "/":
        return False
    try:
        Path(_ROOTS[0] + own.rstrip("/"), "memory.max_usage_in_bytes").write_text("0")
    except OSError:
        return False
    return True


# -- the launcher's side ------------------------------------------------------------------------


def launch_setup(size: str | int, job: str | None = None) -> tuple[list[str], dict[str, str]]:
    """What `tfsmp run --memory-per-rank SIZE` adds to the mpirun line: the per-rank prefix
    (empty on a GPU host, [Note: device caps]) and the variables every rank gets.

    Raises:
        ConfigError: a malformed size, or a CPU host where no memory cgroup can be made.
    """
    limit = parse_size(size)
    env = {CAP_ENV: str(limit)}
    if host_has_gpu():
        return [], env
    find_controller()
    return rank_prefix(limit, job or f"tfsmp-{os.getpid()}"), env


# -- the memory model before launch -------------------------------------------------------------


def check_before_launch(args: Any, np: int, config_json: str | None,
                        environ: Mapping[str, str] | None = None) -> tuple[str | None, str]:
    """`tfsmp run --memory-per-rank SIZE --model MODULE:FUNCTION`: the memory model decides
    before mpirun starts ([Note: the launcher obeys the model] in
    tfsmp/partitioning/memory_check.py). Returns the config JSON to launch with (the plan that
    fits, written to a file and named by ``partition_file``; ``optimize`` switched to
    recomputation where that is what fits) and a line saying what was decided; without
    ``--model`` (or a cap) both unchanged and empty: the ranks then decide on world rank 0
    before taking their stages.

    Raises:
        ConfigError: no plan fits; the message names each rank's predicted peak and what would.
    """
    import json
    import tempfile

    from tfsmp.config import load_config
    from tfsmp.partitioning.memory import settings_of
    from tfsmp.partitioning.memory_check import check_memory

    size, spec = getattr(args, "memory_per_rank", None), getattr(args, "model", None)
    if not size or not spec:
        return config_json, ""
    cap = parse_size(size)
    params = json.loads(config_json) if config_json else None
    config = load_config(params, environ=dict(os.environ if environ is None else environ),
                         world_size=np)
    dp = max(np // config.partitions, 1)
    batch = getattr(args, "batch_size", None) or config.microbatches * dp
    graph, optimizer = _traced(spec, getattr(args, "input_shape", None), batch,
                               getattr(args, "optimizer", None))
    plan_for = _planner(graph, config, optimizer, batch, cap)
    settings = settings_of(config, optimizer, max(batch // dp, 1), dp)
    decision = check_memory(graph, settings, cap, plan_for, allow_changes=True)
    if not decision.fits:
        from tfsmp.errors import ConfigError

        raise ConfigError(decision.message())
    fd, path = tempfile.mkstemp(prefix="tfsmp-plan-", suffix=".json")
    with os.fdopen(fd, "w") as f:
        f.write(decision.plan.to_json() + "\n")
    chosen = {**(params or {}), "partition_file": path, "optimize": decision.settings.optimize}
    return json.dumps(chosen), f"{decision.message()} Plan: {path}."


def _traced(spec: str, input_shape: list[str] | None, batch: int, optimizer: str | None
            ) -> tuple[Any, str | None]:
    """The model's layer graph, costed for ``batch`` as `tfsmp plan` costs it, and its
    optimizer's name (``--optimizer``, else the model's compiled one, else Adam's)."""
    from tfsmp.graph import costs
    from tfsmp.graph.planning import optimizer_name
    from tfsmp.graph.tracer import trace
    from tfsmp.launch.cmd_plan import input_shapes, load_function

    model = load_function(spec)()
    traced = trace(model, batch_size=batch)
    costs.resolve_dims(traced, input_shapes(input_shape))
    costs.measure_activations(traced, costs.sample_batch(traced, rows=2))
    return traced.graph, optimizer or optimizer_name(model)


def _planner(graph: Any, config: Any, optimizer: str | None, batch: int, cap: int) -> Any:
    """``settings -> plan``: the config's ``partition_file``, else the planner as the ranks call
    it (`tfsmp.runtime.setup.make_plan`, which the launcher may not import)."""
    from tfsmp.partitioning.plan import StagePlan
    from tfsmp.partitioning.planner import plan_graph

    if config.partition_file:
        with open(config.partition_file) as f:
            fixed = StagePlan.from_json(f.read())
        fixed = StagePlan.from_assignment(graph, fixed.stage_of, fixed.num_stages, planner="file")
        return lambda s: fixed
    method = "auto" if config.auto_partition else "manual"

    def plan_for(s: Any) -> StagePlan:
        weight = config.memory_weight if s.optimize == "memory" else \
            config.effective_memory_weight
        return plan_graph(graph, config.num_stages, optimize=s.optimize, memory_weight=weight,
                          method=method, default_partition=config.default_partition,
                          contiguous=config.contiguous, optimizer=optimizer, batch_size=batch,
                          step_samples=batch, memory=s, memory_cap=cap)

    return plan_for


# -- the rank guard -----------------------------------------------------------------------------


def rank_prefix(limit: int, job: str, python: str = sys.executable) -> list[str]:
    """The argv that runs a rank under its capped cgroup (before ``python -m mpi4py ...``)."""
    return [python, "-m", "tfsmp.launch.memcap", "--bytes", str(limit), "--job", job, "--"]


def _rank() -> str:
    return os.environ.get("OMPI_COMM_WORLD_RANK", os.environ.get("PMIX_RANK", "0"))


def _report(rank: str, limit: int, group: Path, controller: Controller, code: int) -> None:
    peak = _read(group / controller.peak_file).strip()
    kills = _oom_kills(group, controller.version)
    if code == -signal.SIGKILL and kills:
        sys.stderr.write(
            f"[rank {rank}] exceeded its memory cap (--memory-per-rank {format_size(limit)}, "
            f"peak {format_size(int(peak or 0))}) and was killed by the kernel's OOM killer. "
            f"Fix: more partitions, optimize 'memory', more microbatches, or a larger cap "
            f"(`tfsmp plan --memory-per-rank` says what fits).\n")
        sys.stderr.flush()


def main(argv: Sequence[str]) -> int:
    """``--bytes N --job NAME -- COMMAND...``: runs COMMAND in this rank's capped cgroup."""
    args = list(argv)
    if "--" not in args or len(args) < 6 or args[0] != "--bytes" or args[2] != "--job":
        sys.stderr.write("usage: python -m tfsmp.launch.memcap --bytes N --job NAME -- "
                         "COMMAND...\n")
        return 2
    limit, job, command = int(args[1]), args[3], args[args.index("--") + 1:]
    controller = find_controller()
    rank = _rank()
    group = _make_rank_cgroup(controller, job, rank, limit)
    procs = str(group / "cgroup.procs")

    def join() -> None:  # in the child, before exec: only the rank is capped, not this guard
        with open(procs, "w") as f:
            f.write(str(os.getpid()))

    env = {**os.environ, CAP_ENV: str(limit)}
    child = subprocess.Popen(command, preexec_fn=join, env=env)  # a guard process: no threads
    code, _ = rankguard.wait_forwarding(child)
    _report(rank, limit, group, controller, code)
    _remove(group)
    return rankguard.die_like(code)  # die as the rank died, so mpirun's status is unchanged


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
