"""The SMP parameter table: names, aliases, defaults, validation, and the sources a run reads.

Example::

    cfg = load_config({"partitions": 2, "microbatches": 8}, world_size=4)
    cfg.num_stages, cfg.effective_memory_weight     # (2, 0.8)
    validate(cfg.to_dict()) == cfg                  # True

Pure: imports neither TensorFlow nor mpi4py. `python -m tfsmp.config > docs/parameters.md`
regenerates the parameter reference from `PARAMETERS`.

[Note: SMP compatibility] Where the SageMaker SDK's `validate_mp_config` had a rule, the message
starts with the SDK's sentence (tests pin it), then adds `Received: ...` and a fix. Deliberate
differences from the SDK, each documented in docs/parameters.md:
- bools must be real bools. The SDK tested `value in [True, False]`, which lets 0, 1 and 1.0
  through; here they are errors, as are strings such as "true". JSON true/false decode to bools.
- ints must be ints: not bools, floats (2.0) or strings ("2").
- `partitions` defaults to 1 (the SDK required it). `default_partition` has no default (SMP
  documented 0); it is required only when `auto_partition` is False, as the SDK enforced.
- `placement_strategy` letter forms ("DPT", ...) are PyTorch-only; the error names the
  equivalent of "cluster"/"spread".
- `pipeline: "_only_forward"` (hidden SDK value) is rejected.
- PyTorch-only keys are errors naming the TensorFlow equivalent. When both `ddp` and `horovod`
  are true, the SDK's conflict message wins, since its fix (drop `ddp`) is the whole fix.
"""

from __future__ import annotations

import json
import math
import numbers
import os
import sys
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from tfsmp.errors import ConfigError, closest, did_you_mean, short_repr

__all__ = [
    "ALIASES",
    "COMPAT_KEYS",
    "PARAMETERS",
    "PYTORCH_ONLY",
    "Config",
    "Param",
    "check_world_size",
    "load_config",
    "parameter_table_markdown",
    "parameters_doc_markdown",
    "parse_mp_parameters",
    "validate",
]

Checker = Callable[[str, Any], Any]


@dataclass(frozen=True)
class Config:
    """A validated set of tfsmp parameters. Constructing one validates it.

    Example::

        cfg = Config(partitions=2, microbatches=4, optimize="speed")
        cfg.effective_memory_weight    # 0.2
        Config(partitions=0)           # ConfigError: The number of partitions must be ...
    """

    partitions: int = 1
    microbatches: int = 1
    pipeline: str = "interleaved"
    optimize: str = "memory"
    placement_strategy: str = "cluster"
    auto_partition: bool = True
    default_partition: int | None = None
    contiguous: bool = True
    horovod: bool = False
    xla: bool = False
    blas: str = "tensorflow"
    active_microbatches: int | None = None
    memory_weight: float | None = None
    virtual_stages: int = 1
    stall_timeout: float = 600.0
    trace_dir: str | None = None
    nonfinite: str = "raise"
    seed: int | None = None
    partition_file: str | None = None
    shard_optimizer_state: bool = False

    def __post_init__(self) -> None:
        for f in fields(self):
            value = PARAMETERS[f.name].check(f.name, getattr(self, f.name))
            object.__setattr__(self, f.name, value)  # normalized: int(), float()
        _check_relations(self)

    def to_dict(self) -> dict[str, Any]:
        """Every field, JSON-serializable; `validate(cfg.to_dict()) == cfg`."""
        return asdict(self)

    @property
    def effective_memory_weight(self) -> float:
        """`memory_weight`, or SMP's default: 0.2 for optimize="speed", else 0.8."""
        if self.memory_weight is not None:
            return self.memory_weight
        return 0.2 if self.optimize == "speed" else 0.8

    @property
    def chunks(self) -> int:
        """Model chunks per pipeline rank: `virtual_stages`, or the count the pipeline needs
        (2 for ``zb-v``; [Note: pipeline registry] in tfsmp/schedule/registry.py)."""
        return int(_pipeline(self.pipeline).chunks_for(self.virtual_stages))

    @property
    def num_stages(self) -> int:
        """Pipeline stages (model chunks) of one replica: partitions × chunks."""
        return self.partitions * self.chunks


@dataclass(frozen=True)
class Param:
    """One row of the parameter table (`PARAMETERS`)."""

    name: str
    type: str
    default: Any
    values: str
    help: str
    sdk: bool
    choices: tuple[Any, ...] = ()
    check: Checker = field(default=lambda key, value: value, repr=False, compare=False)


# ---------------------------------------------------------------------------------------------
# Value checkers: (key, value) -> normalized value, or ConfigError.


def _is_int(value: Any) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _is_real(value: Any) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _positive_int(key: str, value: Any) -> int:
    if _is_int(value) and value >= 1:
        return int(value)
    raise ConfigError(
        f"The number of {key} must be a positive integer. Received: {key}={short_repr(value)}. "
        f"Pass an int >= 1 (e.g. {key}=2; not a string, float or bool).")


def _bool(key: str, value: Any) -> bool:
    if isinstance(value, bool):
        return value
    hint = ("a string is not a bool: write true/false unquoted in JSON, True/False in Python"
            if isinstance(value, str) else
            "pass True or False; tfsmp does not read 0/1 or other values as bools")
    raise ConfigError(
        f"{key} must be a value in: [True, False]. Received: {key}={short_repr(value)}. Fix: {hint}.")


_CHOICE_HINTS: dict[str, dict[str, str]] = {
    "pipeline": {"gpipe": "simple", "1f1b": "interleaved", "_only_forward": "",
                 "interleaved1f1b": "interleaved"},
    # Letter forms list the most distant axis first; the right-most varies fastest over ranks.
    # Without tensor parallelism only the order of D and P matters (SMP's placement_strategy
    # documentation: "cluster" is DP-major, "spread" PD-major).
    "placement_strategy": {"dp": "cluster", "dpt": "cluster", "dtp": "cluster", "tdp": "cluster",
                           "pd": "spread", "ptd": "spread", "tpd": "spread", "pdt": "spread"},
}


def _choice_hint(key: str, value: Any, choices: tuple[str, ...]) -> str:
    if not isinstance(value, str):
        return f" Pass one of {list(choices)} as a string."
    if key == "pipeline" and value == "_only_forward":
        return (" '_only_forward' is a hidden SageMaker SDK value with no documented meaning; "
                "for forward-only runs use DistributedModel.predict/evaluate with either schedule.")
    mapped = _CHOICE_HINTS.get(key, {}).get(value.lower())
    if mapped and key == "placement_strategy":
        return (f" Letter forms are PyTorch-only (TensorFlow has no tensor parallelism); "
                f"{value!r} orders ranks like {mapped!r}: use placement_strategy={mapped!r}.")
    if mapped:
        return f" {value!r} is what tfsmp calls {mapped!r}: use {key}={mapped!r}."
    return did_you_mean(value.lower(), choices) or f" Pass one of {list(choices)}."


def _choice(*choices: str) -> Checker:
    def check(key: str, value: Any) -> str:
        if isinstance(value, str) and value in choices:
            return value
        raise ConfigError(f"{key} must be a value in: {list(choices)}. Received: {key}={short_repr(value)}."
                          + _choice_hint(key, value, choices))
    return check


def _optional(check: Checker) -> Checker:
    def optional(key: str, value: Any) -> Any:
        return None if value is None else check(key, value)
    return optional


def _index(key: str, value: Any) -> int:
    if _is_int(value) and value >= 0:
        return int(value)
    raise ConfigError(f"{key} must be a non-negative integer (a partition index) or None. "
                      f"Received: {key}={short_repr(value)}. Pass e.g. {key}=0.")


def _seed(key: str, value: Any) -> int:
    if _is_int(value) and 0 <= value < 2**63:
        return int(value)
    raise ConfigError(f"{key} must be an integer in [0, 2**63) or None. Received: {key}={short_repr(value)}. "
                      f"Pass e.g. {key}=1234, or None for unseeded runs.")


def _unit_interval(key: str, value: Any) -> float:
    if _is_real(value) and 0.0 <= value <= 1.0:
        return float(value)
    raise ConfigError(f"{key} must be between 0.0 and 1.0! Received: {key}={short_repr(value)}. "
                      f"Pass a number: 0.0 balances compute only, 1.0 memory only, "
                      f"or None for the default of the optimize setting.")


def _seconds(key: str, value: Any) -> float:
    if _is_real(value) and math.isfinite(value) and value >= 0:
        return float(value)
    raise ConfigError(f"{key} must be a finite number of seconds >= 0. Received: {key}={short_repr(value)}. "
                      f"Pass e.g. {key}=600, or 0 to disable the watchdog.")


def _path(key: str, value: Any) -> str:
    if isinstance(value, str) and value:
        return value
    start = f"'{key}' must be a str." if key == "partition_file" else f"{key} must be a str."
    raise ConfigError(f"{start} Received: {key}={short_repr(value)}. Pass a non-empty path, or None.")


# ---------------------------------------------------------------------------------------------
# The table.

def _registry() -> Any:
    from tfsmp.schedule import registry

    return registry


def _pipeline(name: str) -> Any:
    return _registry().get(name)


# The schedules a config may name: tfsmp/schedule/registry.py ([Note: pipeline registry]).
_PIPELINES = _registry().names()
_MEMORY = ("memory: keep only boundary tensors and recompute, and plan the best compute balance "
           "among the plans whose every rank fits its memory cap (tfsmp run --memory-per-rank)")
_PARAMS: list[Param] = [
    Param("partitions", "int", 1, ">= 1", sdk=True, check=_positive_int, help=(
        "Pipeline partitions: ranks that together hold one model replica. The world size must be a "
        "multiple of it; world_size // partitions replicas train data-parallel. Alias: "
        "pipeline_parallel_degree (SMP's PyTorch name). SMP TF required it; tfsmp defaults to 1.")),
    Param("microbatches", "int", 1, ">= 1", sdk=True, check=_positive_int, help=(
        "Microbatches each batch is split into (1 = no pipelining). fit takes any batch size: "
        "microbatches may differ by a row, a batch smaller than this runs fewer (smp.step, as "
        "SMP, needs its batch divisible by it).")),
    Param("pipeline", "str", "interleaved", "a registered pipeline", sdk=True,
          choices=_PIPELINES, check=_choice(*_PIPELINES), help=(
              "Schedule. interleaved: a backward pass runs as soon as it can (1F1B); simple: all "
              "forward passes, then all backward passes (GPipe); zb-h1: zero-bubble 1F1B, each "
              "backward split into input gradients (B) and weight gradients (W) that fill the "
              "bubbles, with 1F1B's peak memory; zb-v: zero-bubble with 2 model chunks per rank "
              "in a V (the first and the last chunk on rank 0); `tfsmp schedule --help` lists every "
              "registered pipeline (docs/schedules.md). Not in SMP.")),
    Param("optimize", "str", "memory", "speed, memory", sdk=True, choices=("speed", "memory"),
          check=_choice("speed", "memory"), help=(
              "speed: balance compute across stages, keep activations between forward and backward; "
              f"{_MEMORY}.")),
    Param("placement_strategy", "str", "cluster", "cluster, spread", sdk=True,
          choices=("cluster", "spread"), check=_choice("spread", "cluster"), help=(
              "Rank layout. cluster: a replica's stages sit on consecutive ranks "
              "(mp_rank = rank % partitions); spread: a stage's replicas sit on consecutive ranks "
              "(mp_rank = rank // dp_size).")),
    Param("auto_partition", "bool", True, "True, False", sdk=True, check=_bool, help=(
        "Split the model automatically. False: layers go where smp.partition(i) blocks put them, "
        "the rest to default_partition.")),
    Param("default_partition", "int or None", None, "0 .. partitions-1", sdk=True,
          check=_optional(_index), help=(
              "Partition for layers outside every smp.partition block. Required when auto_partition "
              "is False.")),
    Param("contiguous", "bool", True, "True, False", sdk=True, check=_bool, help=(
        "Each automatic partition is a connected part of the layer graph (unless the graph itself "
        "is disconnected).")),
    Param("horovod", "bool", False, "True, False", sdk=True, check=_bool, help=(
        "Reduce each stage's gradients across replicas with Horovod; tfsmp calls "
        "hvd.init(comm=dp_comm) itself, so scripts must not call hvd.init(). False: the same "
        "reduction over MPI.")),
    Param("xla", "bool", False, "True, False", sdk=True, check=_bool, help=(
        "Compile the stage programs with XLA (tf.function(jit_compile=True)); Keras's "
        "compile(jit_compile=True) asks for the same. Undocumented in SMP.")),
    Param("blas", "str", "tensorflow", "tensorflow, openblas", sdk=False,
          choices=("tensorflow", "openblas"), check=_choice("tensorflow", "openblas"), help=(
              "Kernel of the stage programs' float32 matrix products (MatMul: Dense layers and "
              "their gradients). tensorflow: TensorFlow's own. openblas: OpenBLAS's sgemm (the "
              "`blas` extra), built once per machine into a TensorFlow kernel with the "
              "machine's C++ compiler; on CPUs where TensorFlow's kernel is slow at a "
              "microbatch's rows it is up to twice as fast. Not with xla. Not in SMP.")),
    Param("active_microbatches", "int or None", None, ">= 1", sdk=True,
          check=_optional(_positive_int), help=(
              "Cap on microbatches in flight per rank, which bounds stashed activations. None: the "
              "schedule's own limit. SMP had it for PyTorch only.")),
    Param("memory_weight", "float or None", None, "0.0 .. 1.0", sdk=True,
          check=_optional(_unit_interval), help=(
              "Weight of memory against compute when auto-partitioning balances stages (a blend). "
              "None: compute only with optimize=speed; with optimize=memory, compute within the "
              "memory cap instead of a blend. SMP had it for PyTorch only.")),
    Param("virtual_stages", "int", 1, ">= 1", sdk=False, check=_positive_int, help=(
        "Model chunks per pipeline rank (Megatron interleaving): num_stages = partitions x "
        "virtual_stages, which divides the bubble by about virtual_stages for more messages. "
        "> 1 needs pipeline=interleaved; zb-v always runs 2.")),
    Param("stall_timeout", "float", 600.0, ">= 0 (seconds)", sdk=False, check=_seconds, help=(
        "Seconds a rank may wait for a pipeline message before the watchdog aborts the job with a "
        "report of what every rank waits for. 0 disables the watchdog.")),
    Param("trace_dir", "str or None", None, "a directory", sdk=False, check=_optional(_path), help=(
        "Write a per-rank timeline of every step here. Unset: the env var TFSMP_TRACE, if set.")),
    Param("nonfinite", "str", "raise", "raise, skip", sdk=False, choices=("raise", "skip"),
          check=_choice("raise", "skip"), help=(
              "On a NaN/Inf loss or gradient: raise on every rank, or skip that step's update on "
              "every rank.")),
    Param("seed", "int or None", None, "0 .. 2**63-1", sdk=False, check=_optional(_seed), help=(
        "Base seed for initial weights, dropout and shuffling, the same on every rank, so runs "
        "with different partitions agree. None: unseeded.")),
    Param("partition_file", "str or None", None, "a path", sdk=True, check=_optional(_path), help=(
        "Stage plan JSON (StagePlan.to_json) to use instead of partitioning the model. "
        "Undocumented in SMP.")),
    Param("shard_optimizer_state", "bool", False, "True, False", sdk=True, check=_bool, help=(
        "Shard the optimizer state across data-parallel replicas (DeepSpeed's ZeRO stage 1): each "
        "replica of a stage keeps the optimizer slots of, and updates, only the variables it owns "
        "(balanced by size), then sends their new values to the other replicas; training equals "
        "the unsharded run. Checkpoints and saved files hold the whole state, readable at any "
        "layout. No effect with one replica; refused by a training smp.step (the script applies "
        "its own optimizer). SMP had it for PyTorch only (docs/memory.md, \"Sharded optimizer state\").")),
]
PARAMETERS: dict[str, Param] = {p.name: p for p in _PARAMS}

ALIASES: dict[str, str] = {"pipeline_parallel_degree": "partitions"}

# Keys SMP TF scripts pass that are not Config fields. Value: what tfsmp does with them.
COMPAT_KEYS: dict[str, str] = {
    "pipeline_parallel_degree": "Alias of partitions (SMP >= 1.6 PyTorch name). Giving both with "
                                "different values is an error.",
    "fork": "Accepted and ignored (a bool; AWS's DLC tests pass fork=False). tfsmp never forks.",
    "load_partition": "A bool. True requires partition_file; False together with partition_file "
                      "is an error, since tfsmp loads partition_file whenever it is set.",
}

_MIXED = 'a Keras mixed precision policy: keras.mixed_precision.set_global_policy("{}")'
# PyTorch-only SMP keys -> the TensorFlow/tfsmp equivalent (the fix in the error message).
PYTORCH_ONLY: dict[str, str] = {
    "ddp": "horovod=True (Horovod allreduce across replicas); without it tfsmp reduces "
           "gradients across replicas over MPI, so removing ddp keeps data parallelism",
    "ddp_port": "none needed: tfsmp ranks talk over MPI; remove it",
    "ddp_dist_backend": "use horovod=True (Horovod) or leave it False (MPI); remove it",
    "tensor_parallel_degree": "none: TensorFlow has no tensor parallelism in SMP or tfsmp; remove it",
    "fp16": "use " + _MIXED.format("mixed_float16"),
    "fp16_params": "use " + _MIXED.format("mixed_float16"),
    "bf16": "use " + _MIXED.format("mixed_bfloat16"),
    "offload_activations": "none; optimize='memory' keeps only boundary tensors; remove it",
    "activation_loading_horizon": "none (it tunes offload_activations); remove it",
    "prescaled_batch": "none (it applies to tensor parallelism); remove it",
    "skip_tracing": "none: tfsmp traces the Keras layer graph without allocating weights; remove it",
    "sharded_data_parallel_degree": "none: tfsmp has no sharded data parallelism; remove it",
    "delayed_parameter_initialization": "build the model under tfsmp.deferred_init()",
    "deterministic_server": "none: tfsmp schedules are deterministic by construction; remove it",
    "sdp_*": "none: tfsmp has no sharded data parallelism; remove it",
}

_WRAPPER_KEYS = ("enabled", "parameters")


# ---------------------------------------------------------------------------------------------
# Validation.


def _check_relations(cfg: Config) -> None:
    """Rules across fields, checked after every field is valid on its own."""
    if not cfg.auto_partition and cfg.default_partition is None:
        raise ConfigError(
            "default_partition must be supplied if auto_partition is set to False! Received: "
            "auto_partition=False, default_partition=None. Add default_partition=<index> (the "
            "partition of layers outside every smp.partition block), or set auto_partition=True.")
    if cfg.default_partition is not None and cfg.default_partition >= cfg.partitions:
        raise ConfigError(
            "default_partition must be less than the number of partitions! Received: "
            f"default_partition={cfg.default_partition}, partitions={cfg.partitions}. Partitions "
            f"are numbered 0..{cfg.partitions - 1}.")
    if cfg.blas == "openblas" and cfg.xla:
        raise ConfigError(
            "blas='openblas' chooses the kernel of TensorFlow's MatMul, and xla=True compiles "
            "the stage programs' products with XLA's own. Received: blas='openblas', xla=True. "
            "Set one of them: xla=False, or blas='tensorflow'.")
    record = _pipeline(cfg.pipeline)
    need = record.chunks
    if need is not None and need > 1 and cfg.virtual_stages not in (1, need):
        raise ConfigError(
            f"pipeline={cfg.pipeline!r} runs {need} model chunks per rank. Received: "
            f"virtual_stages={cfg.virtual_stages}, pipeline={cfg.pipeline!r}. Leave "
            f"virtual_stages unset (or {need}) with {cfg.pipeline}, or use "
            f"pipeline='interleaved' for other chunk counts.")
    if cfg.virtual_stages > 1 and (need == 1 or (need is None and not record.loops)):
        looping = [p.name for p in _registry().pipelines() if p.loops]
        raise ConfigError(
            "virtual_stages > 1 needs pipeline='interleaved' (Megatron-style interleaving). "
            f"Received: virtual_stages={cfg.virtual_stages}, pipeline={cfg.pipeline!r}. Set "
            f"pipeline='interleaved', or virtual_stages=1. Pipelines with model chunks: "
            f"{looping}.")


def _pytorch_key(key: str) -> str | None:
    if key in PYTORCH_ONLY:
        return key
    return "sdp_*" if key.startswith("sdp_") else None


def _check_foreign_keys(params: Mapping[Any, Any]) -> None:
    """Keys of the estimator wrapper and PyTorch-only keys, with their fixes."""
    if params.get("ddp") is True and params.get("horovod") is True:
        raise ConfigError(
            "'ddp' and 'horovod' cannot be simultaneously enabled. Received: ddp=True, "
            "horovod=True. 'ddp' is PyTorch-only: remove it; horovod=True already gives "
            "data parallelism across replicas.")
    for key, value in params.items():
        if key in _WRAPPER_KEYS:
            raise ConfigError(
                f"'{key}' belongs to the estimator's modelparallel dict, not to its parameters. "
                f"Received: {key}={short_repr(value)}. Pass only the inner dict: "
                "smp_options['parameters'].")
        row = _pytorch_key(key) if isinstance(key, str) else None
        if row is not None:
            raise ConfigError(
                f"'{key}' is a PyTorch-only SMP parameter; TensorFlow SMP and tfsmp do not take "
                f"it. Received: {key}={short_repr(value)}. TensorFlow equivalent: {PYTORCH_ONLY[row]}.")


def _valid_keys() -> list[str]:
    return [*PARAMETERS, *COMPAT_KEYS]


def _check_unknown_keys(params: Mapping[Any, Any]) -> None:
    valid = _valid_keys()
    unknown = [key for key in params if key not in valid]
    if not unknown:
        return
    parts, guessed = [], 0
    for key in unknown:
        close = closest(str(key).lower(), valid)
        parts.append(f"{key!r}" + (f" (did you mean {close!r}?)" if close else ""))
        guessed += bool(close)
    noun = "parameter" if len(unknown) == 1 else "parameters"
    if guessed == len(unknown):  # a typo: the guess is the fix, the whole list would bury it
        raise ConfigError(f"Unknown {noun} {', '.join(parts)}. Fix the name; every parameter is "
                          "in docs/parameters.md.")
    raise ConfigError(f"Unknown {noun} {', '.join(parts)}. Valid parameters: {sorted(valid)}. "
                      "See docs/parameters.md.")


def _resolve_alias(params: Mapping[Any, Any]) -> dict[Any, Any]:
    """Rename pipeline_parallel_degree to partitions; both given must agree."""
    out = dict(params)
    for alias, name in ALIASES.items():
        if alias not in out:
            continue
        value = _positive_int(alias, out.pop(alias))
        if name in out and out[name] != value:
            raise ConfigError(
                f"{name} and {alias} name the same parameter and must agree. Received: "
                f"{name}={short_repr(out[name])}, {alias}={value}. Keep only one of them.")
        out.setdefault(name, value)
    return out


def _pop_compat(params: dict[Any, Any]) -> None:
    """Check and drop `fork` and `load_partition`, which are not Config fields."""
    if "fork" in params:
        _bool("fork", params.pop("fork"))
    if "load_partition" not in params:
        return
    load = _bool("load_partition", params.pop("load_partition"))
    file = params.get("partition_file")
    if load and file is None:
        raise ConfigError(
            "load_partition=True requires partition_file. Received: load_partition=True, "
            "partition_file=None. Add partition_file='<plan.json>' or remove load_partition.")
    if not load and file is not None:
        raise ConfigError(
            "load_partition=False contradicts partition_file: tfsmp loads partition_file whenever "
            f"it is set. Received: load_partition=False, partition_file={short_repr(file)}. Remove "
            "load_partition (or set it True), or remove partition_file to partition automatically.")


def validate(params: Mapping[str, Any], world_size: int | None = None) -> Config:
    """Validate one dict of SMP/tfsmp parameters.

    Args:
        params: parameter name -> value, as SMP scripts pass it to `smp.init`.
        world_size: if given, the number of processes; it must be a multiple of `partitions`.

    Returns:
        The `Config`.

    Raises:
        ConfigError: a key is unknown or PyTorch-only, or a value breaks a rule; the message
            says what must hold, what was received, and how to fix it.
    """
    if not isinstance(params, Mapping):
        raise ConfigError(
            "parameters must be a dict. Received: parameters="
            f"{short_repr(params)}. Pass e.g. {{'partitions': 2, 'microbatches': 4}}.")
    _check_foreign_keys(params)
    _check_unknown_keys(params)
    values = _resolve_alias(params)
    _pop_compat(values)
    config = Config(**values)
    if world_size is not None:
        check_world_size(config, world_size)
    return config


def _divisors(n: int) -> list[int]:
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return sorted(set(small) | {n // d for d in small})


def check_world_size(config: Config, world_size: int) -> None:
    """Check `world_size = partitions × data-parallel degree`.

    Raises:
        ConfigError: world_size is not a positive multiple of `config.partitions`.
    """
    if not _is_int(world_size) or world_size < 1:
        raise ConfigError(f"world size must be a positive integer. Received: world_size={short_repr(world_size)}.")
    p = config.partitions
    if world_size % p == 0:
        return
    lower, upper = (world_size // p) * p, (world_size // p + 1) * p
    sizes = f"{lower} or {upper}" if lower else f"{upper}"
    raise ConfigError(
        "world size must be a multiple of partitions (world size = partitions x data-parallel "
        f"degree). Received: world_size={world_size}, partitions={p}. Launch {sizes} processes, "
        f"or set partitions to a divisor of {world_size}: {_divisors(world_size)}.")


# ---------------------------------------------------------------------------------------------
# Sources.


def _parse_json_text(text: str, what: str) -> dict[str, Any]:
    try:
        parsed = json.loads(text)
    except json.JSONDecodeError as e:
        raise ConfigError(f"Cannot parse {what} as JSON: {e.msg} at line {e.lineno} column "
                          f"{e.colno}. Received: {short_repr(text)}. Write a JSON object, e.g. "
                          '{"partitions": 2}.') from None
    if not isinstance(parsed, dict):
        raise ConfigError(f"{what} must hold a JSON object of parameters. Received: {short_repr(text)}. "
                          'Write e.g. {"partitions": 2}.')
    return parsed


def _read_json_file(path: str) -> dict[str, Any]:
    try:
        with open(path, encoding="utf-8") as fp:
            parsed = json.load(fp)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConfigError(f"Cannot parse {path} as a json file. ({e}) Fix the file: a JSON object "
                          'such as {"partitions": 2}; true/false lowercase, keys in double quotes.'
                          ) from None
    if not isinstance(parsed, dict):
        raise ConfigError(f"Cannot parse {path} as a json file of parameters: it holds a "
                          f"{type(parsed).__name__}, not a JSON object. Write e.g. "
                          '{"partitions": 2}.')
    return parsed


def parse_mp_parameters(params: Mapping[str, Any] | str | os.PathLike[str]) -> dict[str, Any]:
    """Read parameters the way the SageMaker SDK's `parse_mp_parameters` does.

    Args:
        params: a dict; or the path of a JSON file holding one; or (tfsmp extension) JSON text
            starting with ``{``.

    Returns:
        The parameters as a new dict (not yet validated).

    Raises:
        ConfigError: the path does not exist or the JSON cannot be parsed.
    """
    if isinstance(params, Mapping):
        return dict(params)
    if isinstance(params, os.PathLike):
        params = os.fspath(params)
    if isinstance(params, str) and params.lstrip().startswith("{"):
        return _parse_json_text(params, "the parameter text")
    if isinstance(params, str) and os.path.exists(params):
        return _read_json_file(params)
    raise ConfigError(
        "Expected a string path to an existing modelparallel config, or a dictionary. "
        f"Received: {params}. Pass a dict, the path of a JSON file, or JSON text.")


def _env_sources(env: Mapping[str, str]) -> list[tuple[str, dict[str, Any]]]:
    """(name, params) of the environment sources, lowest precedence first."""
    sources: list[tuple[str, dict[str, Any]]] = []
    text = env.get("TFSMP_CONFIG", "").strip()
    if text:
        try:
            sources.append(("TFSMP_CONFIG", parse_mp_parameters(text)))
        except ConfigError as e:
            raise ConfigError(f"{e} (from env TFSMP_CONFIG, which holds JSON text or a path)") from None
    text = env.get("SM_HP_MP_PARAMETERS", "").strip()
    if text and text != "{}":  # the training toolkit's own test for "model parallel enabled"
        sources.append(("SM_HP_MP_PARAMETERS", _parse_json_text(text, "SM_HP_MP_PARAMETERS")))
    return sources


def load_config(config: Mapping[str, Any] | str | Config | None = None,
                environ: Mapping[str, str] | None = None,
                world_size: int | None = None) -> Config:
    """Merge the parameter sources key by key and validate the result.

    Sources, highest precedence first: `config`; env ``SM_HP_MP_PARAMETERS`` (JSON, as SageMaker
    sets it); env ``TFSMP_CONFIG`` (JSON text, or the path of a JSON file). A key in a higher
    source beats the same key below it; `pipeline_parallel_degree` counts as `partitions`.
    Env ``TFSMP_TRACE`` sets `trace_dir` when no source does.

    Args:
        config: parameters as a dict, a JSON file path or text, or a `Config`.
        environ: the environment; `os.environ` when None.
        world_size: if given, it must be a multiple of `partitions`.

    Returns:
        The `Config`.

    Raises:
        ConfigError: a source cannot be read, or the merged parameters are invalid.
    """
    env = os.environ if environ is None else environ
    sources = _env_sources(env)
    if isinstance(config, Config):
        sources.append(("config argument", config.to_dict()))
    elif config is not None:
        sources.append(("config argument", parse_mp_parameters(config)))
    merged: dict[Any, Any] = {}
    for _, params in sources:
        merged.update(_resolve_alias(params))
    if merged.get("trace_dir") is None and env.get("TFSMP_TRACE"):
        merged["trace_dir"] = env["TFSMP_TRACE"]
    try:
        return validate(merged, world_size)
    except ConfigError as e:
        names = [name for name, _ in reversed(sources)]
        if names in ([], ["config argument"]):
            raise
        raise ConfigError(f"{e} (Parameters merged from, highest first: {', '.join(names)}.)"
                          ) from None


# ---------------------------------------------------------------------------------------------
# Documentation.


def _cell(value: Any) -> str:
    return str(value).replace("|", "\\|").replace("\n", " ")


def parameter_table_markdown() -> str:
    """The markdown table of `PARAMETERS` (for the README and docs/parameters.md)."""
    lines = ["| name | type | default | values | meaning | origin |", "|---|---|---|---|---|---|"]
    for p in PARAMETERS.values():
        origin = "SMP" if p.sdk else "tfsmp"
        lines.append(f"| `{p.name}` | {_cell(p.type)} | `{p.default!r}` | {_cell(p.values)} | "
                     f"{_cell(p.help)} | {origin} |")
    return "\n".join(lines) + "\n"


_DOC_NOTES = """\
## Sources

Highest precedence first, merged key by key: the dict passed to `smp.init(...)`; env
`SM_HP_MP_PARAMETERS` (JSON; set by SageMaker); env `TFSMP_CONFIG` (JSON text, or the path of a
JSON file). Env `TFSMP_TRACE` sets `trace_dir` when no source does. With a world size known, it
must be a multiple of `partitions` (world size = partitions x data-parallel degree).

## Differences from the SageMaker SDK's validation

- bools must be real bools: the SDK tested `value in [True, False]`, which accepted 0, 1 and 1.0;
  tfsmp rejects them, and strings such as `"true"`. JSON `true`/`false` are bools.
- ints must be ints: not bools, floats (2.0) or strings ("2").
- `partitions` defaults to 1 (the SDK required it). `default_partition` has no default (SMP
  documented 0); it is required only when `auto_partition` is False, as the SDK enforced.
- `placement_strategy` takes only `cluster` and `spread`, as the SDK did. PyTorch letter forms are
  rejected with the equivalent named: `"DPT"`/`"DP"` order ranks like `cluster`, `"TPD"`/`"PD"`
  like `spread` (the right-most letter varies fastest over ranks).
- `pipeline: "_only_forward"` (a hidden SDK value) is rejected.
- Unknown keys are errors with a did-you-mean (the SDK ignored them).
- PyTorch-only keys are errors naming the TensorFlow equivalent (table above). If both `ddp` and
  `horovod` are true, the SDK's message `'ddp' and 'horovod' cannot be simultaneously enabled.`
  comes first, since removing `ddp` is then the whole fix.
"""


def parameters_doc_markdown() -> str:
    """The whole of docs/parameters.md."""
    compat = ["| key | what tfsmp does |", "|---|---|"]
    compat += [f"| `{k}` | {_cell(v)} |" for k, v in COMPAT_KEYS.items()]
    torch = ["| key | TensorFlow / tfsmp equivalent |", "|---|---|"]
    torch += [f"| `{k}` | {_cell(v)} |" for k, v in PYTORCH_ONLY.items()]
    return "\n".join([
        "# tfsmp parameters",
        "",
        "<!-- Generated by `python -m tfsmp.config > docs/parameters.md`; do not edit. -->",
        "",
        "Pass them as `smp.init({...})` or the SageMaker estimator's "
        '`distribution={"smdistributed": {"modelparallel": {"enabled": True, "parameters": {...}}}}`.',
        "Origin `SMP`: a key of SageMaker model parallel v1; `tfsmp`: new here.",
        "",
        parameter_table_markdown(),
        "## Compatibility keys",
        "",
        *compat,
        "",
        "## PyTorch-only SMP keys (errors)",
        "",
        *torch,
        "",
        _DOC_NOTES,
    ])


if __name__ == "__main__":
    sys.stdout.write(parameters_doc_markdown())
