"""tfsmp: pipeline model parallelism for TensorFlow 2 / Keras 3, with the SMP v1 API.

Example::

    import tfsmp as smp
    smp.init({"partitions": 2, "microbatches": 4})
    model = smp.DistributedModel(build_keras_model())
    model.compile(optimizer="adam", loss="sparse_categorical_crossentropy")
    model.fit(x, y, batch_size=64, epochs=2)

Names resolve lazily, so ``import tfsmp`` imports neither TensorFlow nor mpi4py; the pure layers
(`tfsmp.config`, `tfsmp.topology`, `tfsmp.graph.ir`, `tfsmp.partitioning`, `tfsmp.schedule`) never do.
"""

from __future__ import annotations

import importlib
from typing import Any

from tfsmp.errors import (
    CheckpointError,
    CommError,
    ConfigError,
    PartitionError,
    ScheduleError,
    StepError,
    TfsmpError,
    TraceError,
)
from tfsmp.lazy import LazyNames

__version__ = "0.1.0"

# public name -> module that defines it
_LAZY: dict[str, str] = {
    **{name: "tfsmp.core" for name in (
        "init", "is_initialized", "shutdown", "state",
        "rank", "size", "local_rank", "local_size", "mp_rank", "mp_size", "dp_rank", "dp_size",
        "pp_rank", "pp_size", "tp_rank", "tp_size", "rdp_rank", "rdp_size",
        "get_mp_group", "get_dp_group", "CommGroup", "RankType", "WORLD", "MP_GROUP", "DP_GROUP",
        "broadcast", "send", "recv_from", "allgather", "barrier", "dp_barrier", "mp_barrier",
        "num_microbatches",
    )},
    "Config": "tfsmp.config",
    "Topology": "tfsmp.topology",
    "StagePlan": "tfsmp.partitioning.plan",
    "plan": "tfsmp.graph.planning",
    "DistributedModel": "tfsmp.keras.model",
    "deferred_init": "tfsmp.keras.model",
    "register_post_partition_hook": "tfsmp.keras.model",
    "step": "tfsmp.keras.step",
    "StepOutput": "tfsmp.keras.step",
    "partition": "tfsmp.graph.scopes",
    "CheckpointManager": "tfsmp.checkpoint.manager",
}

__all__ = [
    "CheckpointError", "CommError", "ConfigError", "PartitionError", "ScheduleError",
    "StepError", "TfsmpError", "TraceError", "__version__", *sorted(_LAZY),
]



def _keras_names_first(module: str) -> None:
    if module.startswith("tfsmp.keras"):  # SMP scripts' Keras 2 names (tfsmp/keras/porting.py)
        importlib.import_module("tfsmp.keras.porting")


# SMP scripts call smp.core.barrier(): those modules are attributes too.
_NAMES = LazyNames(__name__, _LAZY, submodules=("core", "config", "topology", "estimator", "utils"),
                   before=_keras_names_first)


def __getattr__(name: str) -> Any:
    return _NAMES.resolve(name)


def __dir__() -> list[str]:
    return _NAMES.listing()
