"""tfsmp.config: the parameter table, validation messages, sources, and the generated docs."""

from __future__ import annotations

import contextlib
import json
import math
import re
import subprocess
import sys
from dataclasses import fields
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tfsmp.config import (
    COMPAT_KEYS,
    PARAMETERS,
    PYTORCH_ONLY,
    Config,
    check_world_size,
    load_config,
    parameter_table_markdown,
    parameters_doc_markdown,
    parse_mp_parameters,
    validate,
)
from tfsmp.errors import ConfigError
from tfsmp.schedule.registry import names

REPO = Path(__file__).resolve().parents[2]

# The two `smp_options` of AWS's "Run a SageMaker distributed model parallel training job" page.
SMP_OPTIONS_TF: dict[str, Any] = {
    "enabled": True,
    "parameters": {
        "partitions": 2,
        "microbatches": 4,
        "placement_strategy": "spread",
        "pipeline": "interleaved",
        "optimize": "speed",
        "horovod": True,
    },
}
SMP_OPTIONS_PYTORCH: dict[str, Any] = {
    "enabled": True,
    "parameters": {
        "pipeline_parallel_degree": 2,
        "microbatches": 4,
        "placement_strategy": "spread",
        "pipeline": "interleaved",
        "optimize": "speed",
        "ddp": True,
    },
}

# (parameters, literal text the message must contain; SDK sentences open the message)
_PIPELINES = list(names())  # every registered pipeline (tfsmp/schedule/registry.py)
BAD: list[tuple[Any, str]] = [
    ({"partitions": 0}, "The number of partitions must be a positive integer. Received: partitions=0."),
    ({"partitions": -1}, "The number of partitions must be a positive integer. Received: partitions=-1."),
    ({"partitions": "2"}, "The number of partitions must be a positive integer. Received: partitions='2'."),
    ({"partitions": 2.0}, "The number of partitions must be a positive integer. Received: partitions=2.0."),
    ({"partitions": True}, "The number of partitions must be a positive integer. Received: partitions=True."),
    ({"microbatches": 0}, "The number of microbatches must be a positive integer. Received: microbatches=0."),
    ({"microbatches": None}, "The number of microbatches must be a positive integer. Received: microbatches=None."),
    ({"active_microbatches": 0}, "The number of active_microbatches must be a positive integer."),
    ({"virtual_stages": 0}, "The number of virtual_stages must be a positive integer."),
    ({"pipeline_parallel_degree": 0}, "The number of pipeline_parallel_degree must be a positive integer."),
    ({"pipeline": "gpipe"}, f"pipeline must be a value in: {_PIPELINES}. Received: pipeline='gpipe'. 'gpipe' is what tfsmp calls 'simple'"),
    ({"pipeline": "1F1B"}, "use pipeline='interleaved'"),
    ({"pipeline": "interleave"}, f"pipeline must be a value in: {_PIPELINES}. Received: pipeline='interleave'. Did you mean 'interleaved'?"),
    ({"pipeline": "_only_forward"}, "'_only_forward' is a hidden SageMaker SDK value"),
    ({"optimize": "fast"}, "optimize must be a value in: ['speed', 'memory']. Received: optimize='fast'."),
    ({"optimize": "Speed"}, "Did you mean 'speed'?"),
    ({"placement_strategy": "DPT"}, "placement_strategy must be a value in: ['spread', 'cluster']. Received: placement_strategy='DPT'. Letter forms are PyTorch-only"),
    ({"placement_strategy": "DPT"}, "'DPT' orders ranks like 'cluster': use placement_strategy='cluster'."),
    ({"placement_strategy": "TPD"}, "use placement_strategy='spread'."),
    ({"placement_strategy": "PD"}, "use placement_strategy='spread'."),
    ({"placement_strategy": 1}, "placement_strategy must be a value in: ['spread', 'cluster']. Received: placement_strategy=1. Pass one of"),
    ({"auto_partition": "true"}, "auto_partition must be a value in: [True, False]. Received: auto_partition='true'. Fix: a string is not a bool"),
    ({"horovod": 1}, "horovod must be a value in: [True, False]. Received: horovod=1. Fix: pass True or False; tfsmp does not read 0/1"),
    ({"contiguous": None}, "contiguous must be a value in: [True, False]. Received: contiguous=None."),
    ({"xla": "False"}, "xla must be a value in: [True, False]. Received: xla='False'."),
    ({"blas": "mkl"}, "blas must be a value in: ['tensorflow', 'openblas']. Received: blas='mkl'."),
    ({"blas": "openblas", "xla": True}, "blas='openblas' chooses the kernel of TensorFlow's MatMul, and xla=True compiles the stage programs' products with XLA's own. Received: blas='openblas', xla=True. Set one of them: xla=False, or blas='tensorflow'."),
    ({"auto_partition": False}, "default_partition must be supplied if auto_partition is set to False! Received: auto_partition=False, default_partition=None."),
    ({"partitions": 2, "default_partition": 2}, "default_partition must be less than the number of partitions! Received: default_partition=2, partitions=2. Partitions are numbered 0..1."),
    ({"default_partition": -1}, "default_partition must be a non-negative integer (a partition index) or None. Received: default_partition=-1."),
    ({"memory_weight": 1.5}, "memory_weight must be between 0.0 and 1.0! Received: memory_weight=1.5."),
    ({"memory_weight": -0.1}, "memory_weight must be between 0.0 and 1.0! Received: memory_weight=-0.1."),
    ({"memory_weight": math.nan}, "memory_weight must be between 0.0 and 1.0! Received: memory_weight=nan."),
    ({"memory_weight": "0.5"}, "memory_weight must be between 0.0 and 1.0! Received: memory_weight='0.5'."),
    ({"partition_file": 3}, "'partition_file' must be a str. Received: partition_file=3."),
    ({"load_partition": True}, "load_partition=True requires partition_file."),
    ({"load_partition": False, "partition_file": "p.json"}, "load_partition=False contradicts partition_file"),
    ({"load_partition": "yes"}, "load_partition must be a value in: [True, False]. Received: load_partition='yes'."),
    ({"fork": "no"}, "fork must be a value in: [True, False]. Received: fork='no'."),
    ({"virtual_stages": 2, "pipeline": "simple"}, "virtual_stages > 1 needs pipeline='interleaved' (Megatron-style interleaving). Received: virtual_stages=2, pipeline='simple'."),
    ({"stall_timeout": -1}, "stall_timeout must be a finite number of seconds >= 0. Received: stall_timeout=-1."),
    ({"stall_timeout": math.inf}, "stall_timeout must be a finite number of seconds >= 0. Received: stall_timeout=inf."),
    ({"stall_timeout": True}, "stall_timeout must be a finite number of seconds >= 0. Received: stall_timeout=True."),
    ({"trace_dir": ""}, "trace_dir must be a str. Received: trace_dir=''. Pass a non-empty path, or None."),
    ({"trace_dir": 5}, "trace_dir must be a str. Received: trace_dir=5."),
    ({"nonfinite": "ignore"}, "nonfinite must be a value in: ['raise', 'skip']. Received: nonfinite='ignore'."),
    ({"seed": -1}, "seed must be an integer in [0, 2**63) or None. Received: seed=-1."),
    ({"seed": 2**63}, "seed must be an integer in [0, 2**63) or None."),
    ({"seed": 1.5}, "seed must be an integer in [0, 2**63) or None. Received: seed=1.5."),
    ({"microbatch": 4}, "Unknown parameter 'microbatch' (did you mean 'microbatches'?). Fix the name; every parameter is in docs/parameters.md."),
    ({"Partitions": 2}, "Unknown parameter 'Partitions' (did you mean 'partitions'?)."),
    ({"foo": 1, "bar": 2}, "Unknown parameters 'foo', 'bar'. Valid parameters:"),
    ({1: 2}, "Unknown parameter 1. Valid parameters:"),
    (SMP_OPTIONS_TF, "'enabled' belongs to the estimator's modelparallel dict, not to its parameters. Received: enabled=True. Pass only the inner dict: smp_options['parameters']."),
    ({"ddp": True}, "'ddp' is a PyTorch-only SMP parameter; TensorFlow SMP and tfsmp do not take it. Received: ddp=True. TensorFlow equivalent: horovod=True (Horovod allreduce across replicas)"),
    ({"ddp": True, "horovod": True}, "'ddp' and 'horovod' cannot be simultaneously enabled. Received: ddp=True, horovod=True. 'ddp' is PyTorch-only: remove it"),
    ({"ddp_port": 1234}, "'ddp_port' is a PyTorch-only SMP parameter"),
    ({"tensor_parallel_degree": 2}, "TensorFlow equivalent: none: TensorFlow has no tensor parallelism"),
    ({"fp16": True}, 'keras.mixed_precision.set_global_policy("mixed_float16")'),
    ({"bf16": True}, 'keras.mixed_precision.set_global_policy("mixed_bfloat16")'),
    ({"shard_optimizer_state": 1}, "shard_optimizer_state must be a value in: [True, False]. Received: shard_optimizer_state=1."),
    ({"delayed_parameter_initialization": True}, "build the model under tfsmp.deferred_init()"),
    ({"sdp_reduce_bucket_size": 5}, "'sdp_reduce_bucket_size' is a PyTorch-only SMP parameter"),
    ({"partitions": 2, "pipeline_parallel_degree": 4}, "partitions and pipeline_parallel_degree name the same parameter and must agree. Received: partitions=2, pipeline_parallel_degree=4."),
    ([("partitions", 2)], "parameters must be a dict. Received: parameters=[('partitions', 2)]."),
    ("partitions=2", "parameters must be a dict."),
]


@pytest.mark.parametrize(("params", "message"), BAD, ids=[f"bad{i}" for i in range(len(BAD))])
def test_bad_configuration_is_rejected_with_its_message(params: Any, message: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(message)):
        validate(params)


@pytest.mark.parametrize("sentence", [
    "The number of partitions must be a positive integer.",
    f"pipeline must be a value in: {_PIPELINES}.",
    "default_partition must be supplied if auto_partition is set to False!",
    "default_partition must be less than the number of partitions!",
    "memory_weight must be between 0.0 and 1.0!",
    "'partition_file' must be a str.",
    "'ddp' and 'horovod' cannot be simultaneously enabled.",
])
def test_sdk_sentences_open_their_messages(sentence: str) -> None:
    matching = [p for p, m in BAD if m.startswith(sentence)]
    assert matching, sentence
    for params in matching:
        with pytest.raises(ConfigError, match="^" + re.escape(sentence)):
            validate(params)


def test_config_error_is_a_value_error() -> None:
    with pytest.raises(ValueError):
        validate({"partitions": 0})


def test_constructing_config_directly_validates() -> None:
    with pytest.raises(ConfigError, match=re.escape("The number of partitions must be a positive")):
        Config(partitions=0)


# --- the AWS page's two estimator configurations -------------------------------------------


def test_aws_tensorflow_smp_options_give_a_valid_config() -> None:
    cfg = validate(SMP_OPTIONS_TF["parameters"], world_size=8)  # processes_per_host: 8
    assert cfg == Config(partitions=2, microbatches=4, placement_strategy="spread",
                         pipeline="interleaved", optimize="speed", horovod=True)
    assert cfg.effective_memory_weight == 0.2


def test_aws_pytorch_smp_options_fail_on_ddp_naming_horovod() -> None:
    with pytest.raises(ConfigError, match=r"^'ddp' is a PyTorch-only SMP parameter.*horovod=True"):
        validate(SMP_OPTIONS_PYTORCH["parameters"])


# --- defaults, alias, compat keys -----------------------------------------------------------


def test_defaults() -> None:
    cfg = validate({})
    assert cfg == Config()
    assert (cfg.partitions, cfg.microbatches, cfg.pipeline, cfg.optimize) == (1, 1, "interleaved", "memory")
    assert (cfg.placement_strategy, cfg.auto_partition, cfg.contiguous) == ("cluster", True, True)
    assert (cfg.horovod, cfg.xla, cfg.nonfinite, cfg.stall_timeout) == (False, False, "raise", 600.0)
    assert cfg.num_stages == 1


def test_table_defaults_match_config_fields() -> None:
    assert list(PARAMETERS) == [f.name for f in fields(Config)]
    for f in fields(Config):
        assert PARAMETERS[f.name].default == f.default, f.name


@pytest.mark.parametrize(("params", "weight"), [
    ({}, 0.8), ({"optimize": "memory"}, 0.8), ({"optimize": "speed"}, 0.2),
    ({"optimize": "speed", "memory_weight": 0.5}, 0.5), ({"memory_weight": 0}, 0.0),
    ({"memory_weight": 1}, 1.0),
])
def test_effective_memory_weight(params: dict[str, Any], weight: float) -> None:
    assert validate(params).effective_memory_weight == weight


def test_num_stages_is_partitions_times_virtual_stages() -> None:
    assert validate({"partitions": 3, "virtual_stages": 2}).num_stages == 6


def test_alias_pipeline_parallel_degree() -> None:
    assert validate({"pipeline_parallel_degree": 4}).partitions == 4
    assert validate({"pipeline_parallel_degree": 4, "partitions": 4}).partitions == 4


def test_compat_keys_are_accepted_and_not_fields() -> None:
    cfg = validate({"partitions": 2, "fork": False, "load_partition": True, "partition_file": "plan.json"})
    assert cfg.partition_file == "plan.json"
    assert "fork" not in cfg.to_dict() and "load_partition" not in cfg.to_dict()
    assert validate({"load_partition": False}) == Config()


def test_manual_partitioning_config() -> None:
    cfg = validate({"partitions": 2, "auto_partition": False, "default_partition": 1})
    assert (cfg.auto_partition, cfg.default_partition) == (False, 1)


def test_values_are_normalized() -> None:
    cfg = validate({"stall_timeout": 5, "memory_weight": 1})
    assert isinstance(cfg.stall_timeout, float) and isinstance(cfg.memory_weight, float)


def test_json_decoded_values_validate() -> None:
    text = '{"partitions": 2, "horovod": true, "xla": false, "memory_weight": 0.3, "seed": 7}'
    cfg = validate(json.loads(text))
    assert (cfg.horovod, cfg.xla, cfg.memory_weight, cfg.seed) == (True, False, 0.3, 7)


def test_every_pytorch_only_key_is_rejected() -> None:
    for key in PYTORCH_ONLY:
        name = "sdp_gradient_clipping" if key == "sdp_*" else key
        with pytest.raises(ConfigError, match=re.escape(f"'{name}' is a PyTorch-only SMP parameter")):
            validate({name: True})


# --- world size -----------------------------------------------------------------------------


def test_world_size_must_be_a_multiple_of_partitions() -> None:
    assert validate({"partitions": 2}, world_size=8).partitions == 2
    assert validate({"partitions": 2, "virtual_stages": 3}, world_size=4).num_stages == 6
    with pytest.raises(ConfigError, match=re.escape(
            "world size must be a multiple of partitions (world size = partitions x data-parallel "
            "degree). Received: world_size=4, partitions=3. Launch 3 or 6 processes, or set "
            "partitions to a divisor of 4: [1, 2, 4].")):
        validate({"partitions": 3}, world_size=4)
    with pytest.raises(ConfigError, match=re.escape("Received: world_size=2, partitions=4. Launch 4 processes")):
        validate({"partitions": 4}, world_size=2)


@pytest.mark.parametrize("world", [0, -1, True, 2.0])
def test_world_size_must_be_a_positive_int(world: Any) -> None:
    with pytest.raises(ConfigError, match=re.escape("world size must be a positive integer. Received:")):
        check_world_size(Config(), world)


# --- parse_mp_parameters and sources ---------------------------------------------------------


def test_parse_mp_parameters(tmp_path: Path) -> None:
    path = tmp_path / "mp.json"
    path.write_text('{"partitions": 2}')
    assert parse_mp_parameters({"partitions": 2}) == {"partitions": 2}
    assert parse_mp_parameters(str(path)) == {"partitions": 2}
    assert parse_mp_parameters(path) == {"partitions": 2}
    assert parse_mp_parameters(' {"partitions": 3}') == {"partitions": 3}


def test_parse_mp_parameters_errors(tmp_path: Path) -> None:
    missing = str(tmp_path / "nope.json")
    with pytest.raises(ConfigError, match=re.escape(
            "Expected a string path to an existing modelparallel config, or a dictionary. "
            f"Received: {missing}.")):
        parse_mp_parameters(missing)
    with pytest.raises(ConfigError, match=re.escape("Expected a string path to an existing "
                                                    "modelparallel config, or a dictionary. Received: 5.")):
        parse_mp_parameters(5)  # type: ignore[arg-type]
    bad = tmp_path / "bad.json"
    bad.write_text("{partitions: 2}")
    with pytest.raises(ConfigError, match=re.escape(f"Cannot parse {bad} as a json file.")):
        parse_mp_parameters(str(bad))
    listed = tmp_path / "list.json"
    listed.write_text("[1, 2]")
    with pytest.raises(ConfigError, match=re.escape(f"Cannot parse {listed} as a json file of parameters: it holds a list")):
        parse_mp_parameters(str(listed))
    with pytest.raises(ConfigError, match=re.escape(f"Cannot parse {tmp_path} as a json file.")):
        parse_mp_parameters(str(tmp_path))  # a directory
    with pytest.raises(ConfigError, match=re.escape("Cannot parse the parameter text as JSON:")):
        parse_mp_parameters("{'partitions': 2}")


def test_source_precedence(tmp_path: Path) -> None:
    path = tmp_path / "cfg.json"
    path.write_text(json.dumps({"partitions": 4, "microbatches": 4, "pipeline": "simple", "seed": 1}))
    env_path = {"TFSMP_CONFIG": str(path)}
    assert load_config(environ=env_path) == Config(partitions=4, microbatches=4, pipeline="simple", seed=1)
    env_text = {"TFSMP_CONFIG": '{"partitions": 3, "microbatches": 3, "pipeline": "simple"}'}
    assert load_config(environ=env_text) == Config(partitions=3, microbatches=3, pipeline="simple")
    env = {**env_text, "SM_HP_MP_PARAMETERS": '{"partitions": 2, "microbatches": 2}'}
    # SM_HP_MP_PARAMETERS beats TFSMP_CONFIG key by key; the rest still comes from below.
    assert load_config(environ=env) == Config(partitions=2, microbatches=2, pipeline="simple")
    # The dict beats both.
    assert load_config({"partitions": 1}, environ=env) == Config(partitions=1, microbatches=2, pipeline="simple")


def test_alias_counts_as_partitions_across_sources() -> None:
    env = {"SM_HP_MP_PARAMETERS": '{"pipeline_parallel_degree": 4}'}
    assert load_config({"partitions": 2}, environ=env).partitions == 2
    assert load_config({"pipeline_parallel_degree": 2}, environ={"SM_HP_MP_PARAMETERS": '{"partitions": 4}'}).partitions == 2


def test_empty_sources_are_ignored() -> None:
    assert load_config(environ={"SM_HP_MP_PARAMETERS": "{}", "TFSMP_CONFIG": " "}) == Config()
    assert load_config(environ={}) == Config()


def test_load_config_accepts_a_config_and_a_path(tmp_path: Path) -> None:
    cfg = Config(partitions=2, microbatches=8)
    assert load_config(cfg, environ={}) == cfg
    path = tmp_path / "cfg.json"
    path.write_text('{"partitions": 2}')
    assert load_config(str(path), environ={}).partitions == 2


def test_tfsmp_trace_sets_trace_dir_when_no_source_does() -> None:
    assert load_config(environ={"TFSMP_TRACE": "/tmp/t"}).trace_dir == "/tmp/t"
    assert load_config({"trace_dir": "/x"}, environ={"TFSMP_TRACE": "/tmp/t"}).trace_dir == "/x"
    assert load_config({"trace_dir": None}, environ={"TFSMP_TRACE": "/tmp/t"}).trace_dir == "/tmp/t"


def test_load_config_world_size() -> None:
    with pytest.raises(ConfigError, match=re.escape("Received: world_size=3, partitions=2.")):
        load_config({"partitions": 2}, environ={}, world_size=3)


def test_load_config_reads_os_environ_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TFSMP_CONFIG", raising=False)
    monkeypatch.delenv("TFSMP_TRACE", raising=False)
    monkeypatch.setenv("SM_HP_MP_PARAMETERS", '{"microbatches":4,"partitions":2,"pipeline":"interleaved"}')
    assert load_config() == Config(partitions=2, microbatches=4)


def test_source_errors_name_the_source() -> None:
    with pytest.raises(ConfigError, match=re.escape("Cannot parse SM_HP_MP_PARAMETERS as JSON:")):
        load_config(environ={"SM_HP_MP_PARAMETERS": "{partitions: 2}"})
    with pytest.raises(ConfigError, match=re.escape("SM_HP_MP_PARAMETERS must hold a JSON object of parameters.")):
        load_config(environ={"SM_HP_MP_PARAMETERS": "[2]"})
    with pytest.raises(ConfigError, match=r"^Expected a string path .*\(from env TFSMP_CONFIG"):
        load_config(environ={"TFSMP_CONFIG": "/no/such/file.json"})
    with pytest.raises(ConfigError, match=r"^The number of partitions must be a positive integer\. "
                                          r"Received: partitions=0\..*Parameters merged from, highest "
                                          r"first: SM_HP_MP_PARAMETERS\.\)$"):
        load_config(environ={"SM_HP_MP_PARAMETERS": '{"partitions": 0}'})


# --- properties -------------------------------------------------------------------------------


@st.composite
def valid_configs(draw: st.DrawFn) -> Config:
    partitions = draw(st.integers(1, 16))
    auto = draw(st.booleans())
    index = st.integers(0, partitions - 1)
    pipeline = draw(st.sampled_from(["interleaved", "simple"]))
    maybe_text = st.none() | st.text(min_size=1, max_size=20)
    return Config(
        partitions=partitions,
        microbatches=draw(st.integers(1, 64)),
        pipeline=pipeline,
        optimize=draw(st.sampled_from(["speed", "memory"])),
        placement_strategy=draw(st.sampled_from(["cluster", "spread"])),
        auto_partition=auto,
        default_partition=draw(st.none() | index if auto else index),
        contiguous=draw(st.booleans()),
        horovod=draw(st.booleans()),
        xla=draw(st.booleans()),
        active_microbatches=draw(st.none() | st.integers(1, 64)),
        memory_weight=draw(st.none() | st.floats(0.0, 1.0)),
        virtual_stages=draw(st.integers(1, 4)) if pipeline == "interleaved" else 1,
        stall_timeout=draw(st.floats(0.0, 1e6) | st.integers(0, 10**6)),
        trace_dir=draw(maybe_text),
        nonfinite=draw(st.sampled_from(["raise", "skip"])),
        seed=draw(st.none() | st.integers(0, 2**63 - 1)),
        partition_file=draw(maybe_text),
    )


@settings(max_examples=200, deadline=None)
@given(valid_configs())
def test_valid_configs_round_trip(cfg: Config) -> None:
    assert validate(cfg.to_dict()) == cfg
    assert validate(json.loads(json.dumps(cfg.to_dict()))) == cfg
    assert load_config(cfg.to_dict(), environ={}) == cfg


_KEYS = [*PARAMETERS, *COMPAT_KEYS, *PYTORCH_ONLY, "enabled", "sdp_x"]
_NEAR = st.sampled_from(["interleaved", "simple", "speed", "memory", "cluster", "spread", "raise",
                         "skip", "DPT", "true", 0, 1, 2, 3, -1, True, False, None, 0.5, 2.0, "p.json"])
_JUNK = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8) | _NEAR,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3),
    max_leaves=8)
_JUNK_PARAMS = (st.dictionaries(st.sampled_from(_KEYS) | st.text(max_size=12) | st.integers(),
                                _NEAR | _JUNK, max_size=8) | _JUNK)


@settings(max_examples=400, deadline=None)
@given(_JUNK_PARAMS, st.none() | st.integers(-2, 24))
def test_junk_validates_or_raises_config_error(params: Any, world: int | None) -> None:
    try:
        cfg = validate(params, world_size=world)
    except ConfigError:
        return
    assert validate(cfg.to_dict()) == cfg


@settings(max_examples=200, deadline=None)
@given(st.text(max_size=40), st.text(max_size=40), st.text(max_size=8))
def test_junk_environment_validates_or_raises_config_error(sm: str, tf: str, trace: str) -> None:
    env = {"SM_HP_MP_PARAMETERS": sm, "TFSMP_CONFIG": tf, "TFSMP_TRACE": trace}
    with contextlib.suppress(ConfigError):
        load_config(environ=env)


# --- docs ----------------------------------------------------------------------------------------


def test_parameter_table_lists_every_parameter() -> None:
    table = parameter_table_markdown()
    for name, param in PARAMETERS.items():
        assert f"| `{name}` |" in table
        assert ("| SMP |" if param.sdk else "| tfsmp |") in table.split(f"| `{name}` |")[1].splitlines()[0]


def test_checked_in_docs_match_the_generated_text() -> None:
    # Regenerate with: python -m tfsmp.config > docs/parameters.md
    assert (REPO / "docs" / "parameters.md").read_text() == parameters_doc_markdown()


def test_readme_parameter_table_is_the_generated_one() -> None:
    """README's "Parameters" table says it is generated from PARAMETERS: it is that table."""
    readme = (REPO / "README.md").read_text()
    section = readme[readme.index("## Parameters"):]
    section = section[:section.index("\n## ", 1)]
    assert parameter_table_markdown().strip() in section


def test_main_hook_prints_the_docs() -> None:
    out = subprocess.run([sys.executable, "-m", "tfsmp.config"], capture_output=True, text=True,
                         check=True, cwd=REPO, timeout=60).stdout
    assert out == parameters_doc_markdown()
