"""The SMP process API: `init`, rank helpers and the object-level communication calls.

Example::

    import tfsmp as smp
    smp.init({"partitions": 2})
    if smp.mp_rank() == 0:
        smp.send({"step": 1}, 1, smp.RankType.MP_RANK)
    else:
        msg = smp.recv_from(0, smp.RankType.MP_RANK)
    smp.barrier()

Names, arguments and semantics follow SMP's common API ("MPI Basics", "Communication API"):
`broadcast` is called by the sender only and receivers call `recv_from`; `send` returns once the
matching `recv_from` was posted. These calls use their own communicators, so they never match the
pipeline's messages (see [Note: separate communicators] in `tfsmp.comm.base`).
"""

from __future__ import annotations

import contextlib
import enum
import importlib.util
import os
import shlex
import sys
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from types import FrameType
from typing import Any

from tfsmp import failure
from tfsmp.comm.base import Comm, Group, waitall
from tfsmp.comm.calls import collective_label
from tfsmp.config import Config, load_config
from tfsmp.errors import CommError, ConfigError, TfsmpError
from tfsmp.topology import Topology, select_gpu

__all__ = [
    "DP_GROUP", "MP_GROUP", "WORLD", "CommGroup", "RankType", "State",
    "allgather", "barrier", "broadcast", "dp_barrier", "dp_rank", "dp_size",
    "get_dp_group", "get_mp_group", "init", "is_initialized", "local_rank", "local_size",
    "mp_barrier", "mp_rank", "mp_size", "num_microbatches", "pp_rank", "pp_size", "rank",
    "rdp_rank", "rdp_size",
    "recv_from", "send", "shutdown", "size", "state", "tp_rank", "tp_size",
]

# Environment a launcher sets before MPI starts: world size (Open MPI 5's mpirun sets
# OMPI_COMM_WORLD_SIZE, MPICH's Hydra mpiexec PMI_SIZE).
_SIZE_ENV = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE")
_USER_TAG = 0


class CommGroup(enum.Enum):
    """The groups of SMP's communication API (PP/RDP are the same as MP/DP without tensor parallelism)."""

    WORLD = 0
    MP_GROUP = 1
    DP_GROUP = 2
    PP_GROUP = 1
    RDP_GROUP = 2


class RankType(enum.Enum):
    """How a rank number is read: a world rank, or an index in my MP or DP group."""

    WORLD_RANK = 0
    MP_RANK = 1
    DP_RANK = 2


WORLD = CommGroup.WORLD
MP_GROUP = CommGroup.MP_GROUP
DP_GROUP = CommGroup.DP_GROUP


@dataclass
class State:
    """Everything `init` set up for this process.

    Example::

        s = tfsmp.state()
        s.topology.mp_group(s.rank), s.comm.pipeline.rank == s.pipeline_rank
    """

    config: Config
    topology: Topology
    comm: Comm
    rank: int
    horovod: Any = None   # tfsmp.comm.horovod.HorovodReducer when config.horovod

    @property
    def pipeline_rank(self) -> int:
        """This rank's place in its pipeline (SMP's mp_rank); it runs one or more stages."""
        return self.topology.pipeline_rank_of(self.rank)

    @property
    def data_rank(self) -> int:
        return self.topology.data_rank_of(self.rank)

    def tag(self) -> str:
        """The error tag `rank R | pp_rank P`: P is the pipeline rank (SMP's `pp_rank()`; a
        "stage" is a model chunk, and a rank may run several)."""
        return f"rank {self.rank} | pp_rank {self.pipeline_rank}"


_STATE: State | None = None


def _launcher_world_size(environ: Mapping[str, str]) -> int | None:
    """The world size MPI is (or will be) running with; None for a plain `python script.py`."""
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is not None and mpi.Is_initialized():
        return int(mpi.COMM_WORLD.Get_size())
    for key in _SIZE_ENV:
        if environ.get(key, "").isdigit():
            return int(environ[key])
    if int(environ.get("HOROVOD_SIZE", "1") or 1) > 1:
        raise CommError("tfsmp needs MPI; `horovodrun --gloo` starts no MPI world. Received: "
                        f"HOROVOD_SIZE={environ['HOROVOD_SIZE']} without an MPI launcher. Fix: use "
                        "horovodrun in MPI mode, `mpirun`, or `tfsmp run`.")
    return None


def init(config: Mapping[str, Any] | str | Config | None = None) -> Config:
    """Starts tfsmp in this process: config, rank layout, communicators, failure handling.

    Args:
        config: SMP parameters (dict, JSON text or path, or Config). Merged over the env
            `SM_HP_MP_PARAMETERS` and `TFSMP_CONFIG`, as `tfsmp.config.load_config` documents.

    Returns:
        The validated Config.

    Raises:
        ConfigError: The config is invalid or does not fit the world size, partitions > 1
            without an MPI launcher, `horovod: True` without Horovod, or a second call with a
            different config. Uncaught, it ends the process as one line (no traceback unless
            TFSMP_DEBUG=1): [Note: setup errors] in `tfsmp.failure`.
    """
    try:
        if _STATE is not None:
            return _check_same_config(config)
        return _start(config)
    except TfsmpError as e:
        failure.mark_setup_error(e)
        raise


def _start(config: Mapping[str, Any] | str | Config | None) -> Config:
    global _STATE
    size = _launcher_world_size(os.environ)
    cfg = load_config(config, world_size=size)  # validated before anything starts
    if size is None and cfg.partitions > 1:
        raise ConfigError(_no_launcher_message(cfg.partitions, sys.argv))
    if cfg.horovod:
        from tfsmp.comm.horovod import require_horovod

        require_horovod()
    topology = Topology(world_size=size or 1, partitions=cfg.partitions,
                        placement=cfg.placement_strategy)
    comm = _create_comm(topology, use_mpi=size is not None or cfg.horovod)
    state = State(cfg, topology, comm, rank=comm.world.ranks[comm.world.rank])
    failure.install(state.tag)
    if size is not None:  # [Note: a launcher that leaves its job]
        from tfsmp.comm.launcher_watch import start as watch_launcher

        watch_launcher()
    _pin_gpu(comm.local_rank)
    _ensure_inter_op_threads()
    if cfg.seed is not None:  # same initial weights, dropout masks and shuffles on every rank
        import keras

        keras.utils.set_random_seed(cfg.seed)
    if cfg.horovod:
        from tfsmp.comm.horovod import init_horovod

        state.horovod = init_horovod(comm.data)
    _STATE = state
    return cfg


def _no_launcher_message(partitions: int, argv: list[str]) -> str:
    """What to do when a script with partitions > 1 runs as one plain process."""
    script = argv[0] if argv and argv[0] not in ("", "-c", "-m") else "train.py"
    line = shlex.join(["tfsmp", "run", "-np", str(partitions), script, *argv[1:]])
    return ("world size must be a multiple of partitions (world size = partitions x data-parallel "
            f"degree). Received: world_size=1, partitions={partitions}: one process, started "
            f"without an MPI launcher. Fix: launch {partitions} processes, e.g. `{line}` (or "
            f"`mpirun -np {partitions} python {shlex.join([script, *argv[1:]])}`).")


def _create_comm(topology: Topology, use_mpi: bool) -> Comm:
    if use_mpi:
        from tfsmp.comm.mpi import create_mpi_comm

        return create_mpi_comm(topology)
    from tfsmp.comm.local import create_local_comms

    return create_local_comms(topology)[0]


def _check_same_config(config: Mapping[str, Any] | str | Config | None) -> Config:
    current = state().config
    if config is None:
        return current
    wanted = load_config(config, world_size=state().topology.world_size)
    if wanted != current:
        changed = {k: v for k, v in wanted.to_dict().items() if current.to_dict().get(k) != v}
        raise ConfigError("tfsmp.init() was already called with a different config. Received: "
                          f"changed={changed}. Fix: call tfsmp.init() once, or tfsmp.shutdown() "
                          "before initializing again.")
    return current


def _host_has_gpu() -> bool:
    if os.environ.get("CUDA_VISIBLE_DEVICES", None) == "":
        return False
    return any(os.path.exists(p) for p in ("/dev/nvidia0", "/proc/driver/nvidia/gpus", "/dev/kfd"))


def _pin_gpu(local_rank: int) -> None:
    """Makes only the GPU of this local rank visible to TensorFlow (skipped on CPU-only hosts)."""
    if "tensorflow" not in sys.modules and (
            not _host_has_gpu() or importlib.util.find_spec("tensorflow") is None):
        return  # never import TensorFlow (seconds) on a CPU-only host just to find no GPU
    import tensorflow as tf

    gpus = tf.config.list_physical_devices("GPU")
    index = select_gpu(local_rank, len(gpus))
    if index is None:
        return
    try:
        tf.config.set_visible_devices(gpus[index], "GPU")
        cap = os.environ.get("TFSMP_MEMORY_PER_RANK")  # `tfsmp run --memory-per-rank` on GPUs
        if cap:
            tf.config.set_logical_device_configuration(
                gpus[index], [tf.config.LogicalDeviceConfiguration(memory_limit=int(cap) >> 20)])
    except RuntimeError as e:  # TF already created its GPU devices
        warnings.warn(f"tfsmp could not pin GPU {index} for local rank {local_rank}: {e}. "
                      "Call tfsmp.init() before running any TensorFlow op.", stacklevel=3)


def _ensure_inter_op_threads() -> None:
    """At least two TF inter-op threads: an `smp.step` called inside a tf.function runs the
    pipeline in a tf.py_function, and the stage functions it calls need a second thread."""
    if "tensorflow" not in sys.modules:
        os.environ["TF_NUM_INTEROP_THREADS"] = str(max(2, int(os.environ.get("TF_NUM_INTEROP_THREADS") or 2)))
        return
    import tensorflow as tf

    current = tf.config.threading.get_inter_op_parallelism_threads()
    env = int(os.environ.get("TF_NUM_INTEROP_THREADS") or 0)
    if current == 1 or (current == 0 and env == 1):
        # if the runtime already started, smp.step reports it where it matters
        with contextlib.suppress(RuntimeError):
            tf.config.threading.set_inter_op_parallelism_threads(2)


def is_initialized() -> bool:
    """True between `init()` and `shutdown()`."""
    return _STATE is not None


def shutdown() -> None:
    """Stops Horovod (if tfsmp started it) and frees tfsmp's communicators; `init` may follow."""
    global _STATE
    if _STATE is None:
        return
    s, _STATE = _STATE, None
    if s.horovod is not None:
        s.horovod.shutdown()
    s.comm.free()


def state() -> State:
    """The process state set up by `init`.

    Raises:
        CommError: `init` was not called.
    """
    if _STATE is None:
        raise CommError(f"tfsmp.init() must be called before tfsmp.{_api_caller()}(). Received: "
                        "tfsmp is not initialized. Fix: call tfsmp.init() first.")
    return _STATE


def _api_caller() -> str:
    """The outermost function of this module on the stack: the API call the user made."""
    frame: FrameType | None = sys._getframe(1)
    name = "state"
    while frame is not None:
        if frame.f_code.co_filename == __file__:
            name = frame.f_code.co_name
        frame = frame.f_back
    return name


# Rank helpers (SMP "MPI Basics"); groups are lists of global ranks. --------------------------
def rank() -> int:
    """This process's global rank."""
    return state().rank


def num_microbatches() -> int:
    """The number of microbatches each `smp.step` call splits its batch into."""
    return state().config.microbatches


def size() -> int:
    """The number of processes."""
    return state().topology.world_size


def local_rank() -> int:
    """This process's index among the processes of its host."""
    return state().comm.local_rank


def local_size() -> int:
    """The number of processes on this host."""
    return state().comm.local_size


def mp_rank() -> int:
    """Index in my model-parallel group, i.e. my pipeline rank (SMP's partition id)."""
    return state().pipeline_rank


def mp_size() -> int:
    """The number of partitions."""
    return state().topology.partitions


def dp_rank() -> int:
    """Index in my data-parallel group (the ranks at my pipeline rank)."""
    return state().data_rank


def dp_size() -> int:
    """The number of model replicas."""
    return state().topology.dp_size


def pp_rank() -> int:
    """Same as `mp_rank` (tfsmp has no tensor parallelism)."""
    return state().pipeline_rank


def pp_size() -> int:
    """Same as `mp_size`."""
    return state().topology.partitions


def tp_rank() -> int:
    """Always 0: tfsmp has no tensor parallelism."""
    state()
    return 0


def tp_size() -> int:
    """Always 1: tfsmp has no tensor parallelism."""
    state()
    return 1


def rdp_rank() -> int:
    """Same as `dp_rank` (reduced data parallelism equals data parallelism without TP)."""
    return state().data_rank


def rdp_size() -> int:
    """Same as `dp_size`."""
    return state().topology.dp_size


def get_mp_group() -> list[int]:
    """Global ranks of my model-parallel group, ordered by pipeline rank."""
    s = state()
    return list(s.topology.mp_group(s.rank))


def get_dp_group() -> list[int]:
    """Global ranks of my data-parallel group, ordered by data rank."""
    s = state()
    return list(s.topology.dp_group(s.rank))


# Communication API ----------------------------------------------------------------------------
def _members(group: CommGroup) -> list[int]:
    if group is CommGroup.WORLD:
        return list(range(size()))
    if group is CommGroup.MP_GROUP:
        return get_mp_group()
    if group is CommGroup.DP_GROUP:
        return get_dp_group()
    raise CommError("group must be smp.WORLD, smp.MP_GROUP or smp.DP_GROUP. "
                    f"Received: group={group!r}")


def _user_group(group: CommGroup) -> Group:
    comm = state().comm
    if not isinstance(group, CommGroup):
        raise CommError("group must be smp.WORLD, smp.MP_GROUP or smp.DP_GROUP. "
                        f"Received: group={group!r}")
    return {CommGroup.WORLD: comm.user_world, CommGroup.MP_GROUP: comm.user_pipeline,
            CommGroup.DP_GROUP: comm.user_data}[group]


def to_world_rank(peer: int, rank_type: RankType) -> int:
    """Reads `peer` as `rank_type` (relative to my groups) and returns the world rank."""
    s = state()
    if not isinstance(rank_type, RankType):
        raise CommError("rank_type must be smp.RankType.WORLD_RANK, MP_RANK or DP_RANK. "
                        f"Received: rank_type={rank_type!r}")
    bound = {RankType.WORLD_RANK: s.topology.world_size, RankType.MP_RANK: s.topology.partitions,
             RankType.DP_RANK: s.topology.dp_size}[rank_type]
    if not isinstance(peer, int) or not 0 <= peer < bound:
        raise CommError(f"a {rank_type.name} must be in [0, {bound}). Received: rank={peer!r}")
    if rank_type is RankType.MP_RANK:
        return s.topology.rank_of(peer, s.data_rank)
    if rank_type is RankType.DP_RANK:
        return s.topology.rank_of(s.pipeline_rank, peer)
    return peer


@collective_label("smp.send")
def send(obj: Any, dest_rank: int, rank_type: RankType = RankType.WORLD_RANK) -> None:
    """Sends a picklable object; returns once the matching `recv_from` was posted.

    Args:
        obj: Any picklable object.
        dest_rank: The receiver, read as `rank_type`.
        rank_type: WORLD_RANK, or MP_RANK/DP_RANK (an index in my MP/DP group).

    Raises:
        CommError: The rank is out of range or is this process.
    """
    dest = to_world_rank(dest_rank, rank_type)
    if dest == rank():
        raise CommError(f"a rank cannot send to itself. Received: dest_rank={dest_rank}, "
                        f"rank_type={rank_type.name} (world rank {dest}).")
    state().comm.user_world.isend_obj(obj, dest, _USER_TAG, sync=True).wait()


@collective_label("smp.recv_from")
def recv_from(src_rank: int, rank_type: RankType = RankType.WORLD_RANK) -> Any:
    """Receives the next object that `src_rank` sent to me with `send` or `broadcast`."""
    src = to_world_rank(src_rank, rank_type)
    if src == rank():
        raise CommError(f"a rank cannot receive from itself. Received: src_rank={src_rank}, "
                        f"rank_type={rank_type.name} (world rank {src}).")
    return state().comm.user_world.recv_obj(src, _USER_TAG)


@collective_label("smp.broadcast")
def broadcast(obj: Any, group: CommGroup = CommGroup.WORLD) -> None:
    """Sends `obj` to every other member of `group`; they call `recv_from(my rank, ...)`.

    Returns once every receiver has matched (SMP's synchronous semantics).
    """
    me, user_world = rank(), state().comm.user_world
    reqs = [user_world.isend_obj(obj, r, _USER_TAG, sync=True) for r in _members(group) if r != me]
    waitall(reqs)


@collective_label("smp.allgather")
def allgather(obj: Any, group: CommGroup = CommGroup.WORLD) -> list[Any]:
    """Returns every member's `obj`; element i comes from the i-th rank of `group`."""
    return _user_group(group).allgather_obj(obj)


@collective_label("smp.barrier")
def barrier(group: CommGroup = CommGroup.WORLD) -> None:
    """Returns once every member of `group` reached the barrier."""
    _user_group(group).barrier()


def dp_barrier() -> None:
    """Barrier over my data-parallel group."""
    barrier(CommGroup.DP_GROUP)


def mp_barrier() -> None:
    """Barrier over my model-parallel group."""
    barrier(CommGroup.MP_GROUP)
