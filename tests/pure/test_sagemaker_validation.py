"""Validation parity with the SageMaker SDK (its messages), and what tfsmp adds to it."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from tfsmp.errors import ConfigError
from tfsmp.launch import sagemaker as sm

CPU8 = sm.Resources("local", 0, 8)


def mp(params: Any, **mpi: Any) -> dict[str, Any]:
    """A distribution dict as the AWS page writes it."""
    return {"smdistributed": {"modelparallel": {"enabled": True, "parameters": params}},
            "mpi": {"enabled": True, "processes_per_host": 2, **mpi}}


def resolve(dist: Any, count: int = 1, resources: sm.Resources = CPU8) -> sm.Distribution:
    return sm.resolve_distribution(dist, instance_count=count, resources=resources)


# -- the SDK's own messages ------------------------------------------------------------------

def test_smdistributed_must_be_a_dict() -> None:
    with pytest.raises(ConfigError, match=r"^smdistributed strategy requires a dictionary"):
        resolve({"smdistributed": ["modelparallel"]})


def test_modelparallel_and_dataparallel_together_are_rejected() -> None:
    dist = {"smdistributed": {"modelparallel": {"enabled": True}, "dataparallel": {"enabled": True}}}
    with pytest.raises(ConfigError, match=re.escape(
            "Cannot use more than 1 smdistributed strategy. \nChoose one of the following "
            "supported strategies:['dataparallel', 'modelparallel']")):
        resolve(dist)


def test_options_not_nested_under_modelparallel_get_the_sdk_message_and_the_fix() -> None:
    # The AWS page's generic-Estimator example passes {"smdistributed": smp_options}.
    smp_options = {"enabled": True, "parameters": {"partitions": 2}}
    with pytest.raises(ConfigError, match=r"(?s)^Cannot use more than 1 smdistributed strategy.*"
                       r"nest them, \{'smdistributed': \{'modelparallel': smp_options\}\}"):
        resolve({"smdistributed": smp_options, "mpi": {"enabled": True}})


def test_unknown_strategy_uses_the_sdk_message() -> None:
    with pytest.raises(ConfigError, match=re.escape(
            "Invalid smdistributed strategy provided: modelparalel \nSupported strategies: "
            "['dataparallel', 'modelparallel'] Did you mean 'modelparallel'?")):
        resolve({"smdistributed": {"modelparalel": {"enabled": True}}})


def test_parameters_may_be_a_json_file(tmp_path: Path) -> None:
    path = tmp_path / "mp.json"
    path.write_text(json.dumps({"partitions": 2, "microbatches": 4}))
    dist = resolve(mp(str(path)))
    assert dist.mp_parameters == {"partitions": 2, "microbatches": 4}
    assert dist.config is not None and dist.config.microbatches == 4


def test_parameters_must_be_a_dict_or_an_existing_path() -> None:
    with pytest.raises(ConfigError, match=re.escape(
            "Expected a string path to an existing modelparallel config, or a dictionary. "
            "Received: /no/such/file.json.")):
        resolve(mp("/no/such/file.json"))


def test_parameters_file_must_parse(tmp_path: Path) -> None:
    path = tmp_path / "bad.json"
    path.write_text("{partitions: 2")
    with pytest.raises(ConfigError, match=re.escape(f"Cannot parse {path} as a json file.")):
        resolve(mp(str(path)))


def test_partitions_is_required() -> None:
    with pytest.raises(ConfigError, match=r"^'partitions' is a required parameter."):
        resolve(mp({"microbatches": 4}))


@pytest.mark.parametrize(("params", "message"), [
    ({"partitions": 2, "microbatches": 0}, "The number of microbatches must be a positive integer."),
    ({"partitions": 0}, "The number of partitions must be a positive integer."),
    ({"partitions": 2, "pipeline": "gpipe"}, "pipeline must be a value in: "),
    ({"partitions": 2, "placement_strategy": "DPT"}, "placement_strategy must be a value in: "
                                                      "['spread', 'cluster']."),
    ({"partitions": 2, "optimize": "fast"}, "optimize must be a value in: ['speed', 'memory']."),
    ({"partitions": 2, "horovod": "yes"}, "horovod must be a value in: [True, False]."),
    ({"partitions": 2, "partition_file": 3}, "'partition_file' must be a str."),
    ({"partitions": 2, "auto_partition": False},
     "default_partition must be supplied if auto_partition is set to False!"),
    ({"partitions": 2, "auto_partition": False, "default_partition": 2},
     "default_partition must be less than the number of partitions!"),
    ({"partitions": 2, "ddp": True, "horovod": True},
     "'ddp' and 'horovod' cannot be simultaneously enabled."),
])
def test_per_key_checks_start_with_the_sdk_sentence(params: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=r"^" + re.escape(message)):
        resolve(mp(params))


def test_disabled_modelparallel_is_ignored_as_the_sdk_does() -> None:
    dist = resolve({"smdistributed": {"modelparallel": {"enabled": False,
                                                        "parameters": {"partitions": 0}}},
                    "mpi": {"enabled": True}})
    assert dist.mp_parameters is None and dist.config is None


# -- what the SDK missed ---------------------------------------------------------------------

def test_mpi_key_typo_gets_a_did_you_mean() -> None:
    dist = {"smdistributed": {"modelparallel": {"enabled": True, "parameters": {"partitions": 2}}},
            "mpi": {"enabled": True, "process_per_host": 8}}
    with pytest.raises(ConfigError, match=re.escape(
            "Unknown key 'process_per_host' in distribution['mpi']. Received: mpi keys "
            "['enabled', 'process_per_host']. Did you mean 'processes_per_host'?")):
        resolve(dist)


def test_modelparallel_key_typo_gets_a_did_you_mean() -> None:
    dist = {"smdistributed": {"modelparallel": {"enabled": True, "parameter": {"partitions": 2}}},
            "mpi": {"enabled": True}}
    with pytest.raises(ConfigError, match=r"Unknown key 'parameter' in smdistributed.modelparallel"
                                          r".*Did you mean 'parameters'\?"):
        resolve(dist)


def test_unknown_distribution_key_gets_a_did_you_mean() -> None:
    with pytest.raises(ConfigError, match=r"Unknown distribution key 'smdistributd'.*Did you "
                                          r"mean 'smdistributed'\?"):
        resolve({"smdistributd": {}})


@pytest.mark.parametrize("key", ["parameter_server", "torch_distributed"])
def test_other_strategies_are_refused(key: str) -> None:
    with pytest.raises(ConfigError, match=rf"distribution\['{key}'\].*is not something tfsmp runs"):
        resolve({key: {"enabled": True}})


def test_dataparallel_is_refused_with_the_modelparallel_equivalent() -> None:
    with pytest.raises(ConfigError, match=r"smdistributed dataparallel .* partitions=1"):
        resolve({"smdistributed": {"dataparallel": {"enabled": True}}})


def test_modelparallel_needs_mpi() -> None:
    dist = {"smdistributed": {"modelparallel": {"enabled": True, "parameters": {"partitions": 2}}}}
    with pytest.raises(ConfigError, match=r"^modelparallel needs MPI"):
        resolve(dist)


@pytest.mark.parametrize(("ppn", "count", "partitions"), [(3, 1, 2), (1, 3, 2), (4, 1, 8)])
def test_processes_must_be_a_multiple_of_partitions(ppn: int, count: int, partitions: int) -> None:
    with pytest.raises(ConfigError, match=re.escape(
            "processes_per_host × instance_count must be a multiple of partitions") +
            f".*Received: processes_per_host={ppn}, instance_count={count} "
            rf"\({ppn * count} processes\), partitions={partitions}\."):
        resolve(mp({"partitions": partitions}, processes_per_host=ppn), count=count)


def test_processes_may_span_hosts() -> None:
    dist = resolve(mp({"partitions": 4}, processes_per_host=2), count=2)
    assert dist.processes_per_host == 2


def test_more_processes_than_gpus_is_refused_on_gpu_hosts() -> None:
    g4 = sm.instance_resources("ml.g4dn.12xlarge", local_gpus=0, local_cpus=2)
    with pytest.raises(ConfigError, match=re.escape(
            "processes_per_host must not exceed the GPUs of one host (SMP's runtime fails with "
            "'The number of node-local MPI processes 8 cannot be larger than the device count 4')."
            " Received: processes_per_host=8, instance_type='ml.g4dn.12xlarge' with 4 GPUs.")):
        resolve(mp({"partitions": 2}, processes_per_host=8), resources=g4)


def test_more_processes_than_cpus_is_a_warning_on_cpu_hosts() -> None:
    dist = resolve(mp({"partitions": 2}, processes_per_host=4), resources=sm.Resources("local", 0, 2))
    assert dist.warnings == ("processes_per_host=4 exceeds the 2 CPUs of instance_type='local': "
                             "ranks share cores (oversubscribed), which is slow but works.",)


def test_processes_per_host_defaults_to_one_per_gpu() -> None:
    p3 = sm.instance_resources("ml.p3.16xlarge", local_gpus=0, local_cpus=2)
    dist = resolve({"mpi": {"enabled": True}}, resources=p3)
    assert (dist.processes_per_host, dist.processes_per_host_given) == (8, None)
    assert resolve({"mpi": {"enabled": True}}).processes_per_host == 1


@pytest.mark.parametrize("value", [0, -1, 2.0, True, "4"])
def test_processes_per_host_must_be_a_positive_int(value: Any) -> None:
    with pytest.raises(ConfigError, match=r"^processes_per_host must be a positive integer"):
        resolve({"mpi": {"enabled": True, "processes_per_host": value}})


def test_custom_mpi_options_must_be_a_string() -> None:
    with pytest.raises(ConfigError, match=r"^custom_mpi_options must be a str"):
        resolve({"mpi": {"enabled": True, "custom_mpi_options": ["-x", "A"]}})


# -- instance types --------------------------------------------------------------------------

def test_ml_types_report_the_instance_and_local_types_this_machine() -> None:
    assert sm.instance_resources("ml.p3.16xlarge", local_gpus=0, local_cpus=2) == \
        sm.Resources("ml.p3.16xlarge", 8, 64)
    assert sm.instance_resources("local", local_gpus=0, local_cpus=2) == sm.Resources("local", 0, 2)


def test_unknown_ml_type_reports_this_machine_with_a_warning() -> None:
    res = sm.instance_resources("ml.p9.96xlarge", local_gpus=0, local_cpus=2)
    assert not res.known
    assert "is not in tfsmp's table" in resolve({"mpi": {"enabled": True}}, resources=res).warnings[0]


@pytest.mark.parametrize("value", ["p3.16xlarge", "gpu", None, 3])
def test_instance_type_must_be_local_or_ml(value: Any) -> None:
    with pytest.raises(ConfigError, match=r"^instance_type must be 'local', 'local_gpu' or a "
                                          r"SageMaker type"):
        sm.instance_resources(value, local_gpus=0, local_cpus=2)


def test_local_gpu_needs_a_gpu() -> None:
    with pytest.raises(ConfigError, match=r"^instance_type='local_gpu' needs an NVIDIA GPU"):
        sm.instance_resources("local_gpu", local_gpus=0, local_cpus=2)


# -- `tfsmp run --distribution` ---------------------------------------------------------------

def test_run_options_from_json_text() -> None:
    text = json.dumps(mp({"partitions": 2}, processes_per_host=4,
                         custom_mpi_options="--NCCL_DEBUG WARN -x A=1"))
    opts = sm.run_options(text)
    assert (opts.np, opts.parameters, opts.mpi_args) == (4, {"partitions": 2}, ["-x", "A=1"])


def test_run_options_np_overrides_and_is_checked() -> None:
    assert sm.run_options(mp({"partitions": 2}), np=6).np == 6
    with pytest.raises(ConfigError, match=r"must be a multiple of partitions"):
        sm.run_options(mp({"partitions": 2}), np=3)


def test_run_options_needs_a_process_count() -> None:
    dist = {"smdistributed": {"modelparallel": {"enabled": True, "parameters": {"partitions": 2}}}}
    with pytest.raises(ConfigError, match=r"^the number of processes must be given"):
        sm.run_options(dist)
