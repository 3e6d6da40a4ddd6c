"""The bad-input catalogue, part 1: configuration, estimator `distribution`, launch and schedules.

Each entry is a call that must fail with a clear message (what must hold, ``Received: ...``, a fix)
before anything starts: `tfsmp.init` leaves tfsmp uninitialized, an estimator creates no job
directory, `tfsmp run` exits 2 without launching. Part 2 (model tracing and partitioning) is
tests/tf/test_bad_input_model.py; part 3 (data and checkpoints on every rank of a running job)
is tests/mpi/test_bad_input.py. Parameter-by-parameter validation has its own suite in
tests/pure/test_config.py and tests/pure/test_sagemaker_validation.py; the cases here come in
through the other doors a user meets (environment, files, init, estimator, command line).
"""

from __future__ import annotations

import json
import re
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

import tfsmp.core as core
from tfsmp.config import check_world_size, load_config, validate
from tfsmp.errors import CommError, ConfigError, ScheduleError
from tfsmp.estimator import LOCAL_ROLE, TensorFlow
from tfsmp.launch import sagemaker as sm
from tfsmp.schedule import Action, Op, StageLinks, generate, lower, parse_schedule, simulate
from tfsmp.schedule.registry import names


@dataclass(frozen=True)
class Bad:
    call: Callable[[Path], Any]
    error: type[BaseException]
    match: str  # a regex searched in the message


# every registered pipeline, as a message lists them (tfsmp/schedule/registry.py)
_PIPELINES = re.escape(str(list(names())))


MP = {"smdistributed": {"modelparallel": {"enabled": True, "parameters": {"partitions": 2}}},
      "mpi": {"enabled": True, "processes_per_host": 2}}


def _env(**env: str) -> Callable[[Path], Any]:
    return lambda tmp: load_config({}, environ=env)


def _file(text: str) -> Callable[[Path], Any]:
    def call(tmp: Path) -> Any:
        path = tmp / "mp.json"
        path.write_text(text)
        return load_config(str(path))
    return call


def _init(config: Any = None, **env: str) -> Callable[[Path], Any]:
    def call(tmp: Path) -> Any:
        with pytest.MonkeyPatch.context() as mp:
            for key in ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "HOROVOD_SIZE", "SM_HP_MP_PARAMETERS",
                        "TFSMP_CONFIG"):
                mp.delenv(key, raising=False)
            for key, value in env.items():
                mp.setenv(key, value)
            return core.init(config)
    return call


def _estimator(**kwargs: Any) -> Callable[[Path], Any]:
    def call(tmp: Path) -> Any:
        (tmp / "src").mkdir(exist_ok=True)
        (tmp / "src" / "train.py").write_text("print('hi')\n")
        args: dict[str, Any] = dict(entry_point="train.py", source_dir=str(tmp / "src"),
                                    role=LOCAL_ROLE, instance_count=1, instance_type="local",
                                    framework_version="2.21", py_version="py311",
                                    output_path=str(tmp / "jobs"), distribution=MP)
        args.update(kwargs)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return TensorFlow(**args)
    return call


def _resolve(distribution: Any, count: int = 1) -> Callable[[Path], Any]:
    return lambda tmp: sm.resolve_distribution(
        distribution, instance_count=count, resources=sm.Resources("local", 0, 8))


def _mp(params: Any, **mpi: Any) -> dict[str, Any]:
    return {"smdistributed": {"modelparallel": {"enabled": True, "parameters": params}},
            "mpi": {"enabled": True, "processes_per_host": 2, **mpi}}


CATALOGUE: dict[str, Bad] = {
    # -- configuration through the environment, files and init ---------------------------------
    "env_tfsmp_config_not_json": Bad(_env(TFSMP_CONFIG="{partitions: 2}"), ConfigError,
                                     r"^Cannot parse the parameter text as JSON: .*\(from env "
                                     r"TFSMP_CONFIG, which holds JSON text or a path\)"),
    "env_tfsmp_config_missing_file": Bad(_env(TFSMP_CONFIG="/no/such/mp.json"), ConfigError,
                                         r"^Expected a string path to an existing modelparallel "
                                         r"config, or a dictionary\. Received: /no/such/mp\.json"),
    "env_sm_hp_not_an_object": Bad(_env(SM_HP_MP_PARAMETERS="[2, 4]"), ConfigError,
                                   r"^SM_HP_MP_PARAMETERS must hold a JSON object of parameters\. "
                                   r"Received: '\[2, 4\]'"),
    "env_merged_sources_are_named": Bad(
        lambda tmp: load_config({"microbatches": 2},
                                environ={"SM_HP_MP_PARAMETERS": '{"partitions": 0}'}),
        ConfigError, r"^The number of partitions must be a positive integer\. Received: "
        r"partitions=0\. .*\(Parameters merged from, highest first: config argument, "
        r"SM_HP_MP_PARAMETERS\.\)$"),
    "file_not_json": Bad(_file('{"partitions": 2,}'), ConfigError,
                         r"^Cannot parse .*mp\.json as a json file\. .*Fix the file"),
    "file_not_an_object": Bad(_file("[1, 2]"), ConfigError,
                              r"^Cannot parse .*mp\.json as a json file of parameters: it holds a "
                              r"list, not a JSON object\."),
    "file_unknown_key": Bad(_file('{"partitons": 2}'), ConfigError,
                            r"^Unknown parameter 'partitons' \(did you mean 'partitions'\?\)\."),
    "world_size_not_a_multiple": Bad(lambda tmp: check_world_size(validate({"partitions": 4}), 6),
                                     ConfigError, r"^world size must be a multiple of partitions "
                                     r".*Received: world_size=6, partitions=4\. Launch 4 or 8 "
                                     r"processes, or set partitions to a divisor of 6: "
                                     r"\[1, 2, 3, 6\]\."),
    "init_world_size_mismatch": Bad(_init({"partitions": 2}, OMPI_COMM_WORLD_SIZE="3"),
                                    ConfigError, r"^world size must be a multiple of partitions "
                                    r".*Received: world_size=3, partitions=2\."),
    "init_horovod_without_mpi": Bad(_init({"partitions": 1}, HOROVOD_SIZE="2"), CommError,
                                    r"^tfsmp needs MPI; `horovodrun --gloo` starts no MPI world\. "
                                    r"Received: HOROVOD_SIZE=2 without an MPI launcher\."),
    "init_config_path_missing": Bad(_init("/no/such/config.json"), ConfigError,
                                    r"^Expected a string path to an existing modelparallel "
                                    r"config, or a dictionary\."),
    "init_bad_value": Bad(_init({"microbatches": 0}), ConfigError,
                          r"^The number of microbatches must be a positive integer\. Received: "
                          r"microbatches=0\."),
    "init_pytorch_key": Bad(_init({"tensor_parallel_degree": 2}), ConfigError,
                            r"^'tensor_parallel_degree' is a PyTorch-only SMP parameter"),
    # -- the estimator's distribution ----------------------------------------------------------
    "distribution_not_a_dict": Bad(_resolve(["smdistributed"]), ConfigError,
                                   r"^distribution must be a dict\. Received: "
                                   r"distribution=\['smdistributed'\]\."),
    "distribution_mpi_not_a_dict": Bad(_resolve({"mpi": True}), ConfigError,
                                       r"^distribution\['mpi'\] must be a dict\. Received: "
                                       r"mpi=True\."),
    "distribution_mpi_enabled_not_bool": Bad(_resolve({"mpi": {"enabled": "yes"}}), ConfigError,
                                             r"^mpi enabled must be a value in: \[True, False\]\."
                                             r" Received: "),
    "distribution_modelparallel_not_a_dict": Bad(
        _resolve({"smdistributed": {"modelparallel": True}, "mpi": {"enabled": True}}),
        ConfigError, r"^smdistributed\.modelparallel must be a dict\. Received: "
        r"modelparallel=True"),
    "distribution_bad_parameter": Bad(_resolve(_mp({"partitions": 2, "microbatches": "4"})),
                                      ConfigError, r"^The number of microbatches must be a "
                                      r"positive integer\. Received: microbatches='4'\."),
    "distribution_processes_not_a_multiple": Bad(
        _resolve(_mp({"partitions": 4}, processes_per_host=3)), ConfigError,
        r"^processes_per_host × instance_count must be a multiple of partitions"),
    "estimator_bad_distribution": Bad(_estimator(distribution=_mp({"partitions": 2,
                                                                   "pipeline": "1f1b"})),
                                      ConfigError, rf"^pipeline must be a value in: {_PIPELINES}\. "
                                      r"Received: pipeline='1f1b'\. '1f1b' is "
                                      r"what tfsmp calls 'interleaved'"),
    "estimator_mp_without_mpi": Bad(_estimator(distribution={"smdistributed": MP["smdistributed"]}),
                                    ConfigError, r"^modelparallel needs MPI"),
    "estimator_instance_count": Bad(_estimator(instance_count=0), ConfigError,
                                    r"^instance_count must be a positive integer\. Received: "),
    "estimator_pipe_mode": Bad(_estimator(input_mode="Pipe"), ConfigError,
                               r"^input_mode='Pipe' streams S3 data through named pipes"),
    "run_options_without_process_count": Bad(
        lambda tmp: sm.run_options({"smdistributed": MP["smdistributed"]}), ConfigError,
        r"^the number of processes must be given\. Received: no -np and no "
        r"mpi\.processes_per_host\."),
    # -- schedules -----------------------------------------------------------------------------
    "schedule_unknown_pipeline": Bad(lambda tmp: generate("gpipe", 2, 4), ScheduleError,
                                     rf"^pipeline must be one of {_PIPELINES}\. "
                                     r"Received: pipeline='gpipe'"),
    "schedule_zero_microbatches": Bad(lambda tmp: generate("interleaved", 2, 0), ScheduleError,
                                      r"^num_microbatches must be a positive integer\. Received: "
                                      r"num_microbatches=0"),
    "schedule_plan_stage_count": Bad(
        lambda tmp: lower(generate("interleaved", 2, 2), StageLinks(3, {0: [1], 1: [2]}), 2),
        ScheduleError, r"^The plan and the schedule must have the same number of stages\. "
        r"Received: plan\.num_stages=3, schedule stages=2\."),
    "schedule_lowered_twice": Bad(lambda tmp: lower(lower(generate("simple", 2, 2))),
                                  ScheduleError, r"^lower\(\) takes compute actions \(F/B/W\) only\."),
    "schedule_text": Bad(lambda tmp: parse_schedule("0: 0F0 0X1"), ScheduleError,
                         r"^An action reads like '1F3'"),
    "schedule_times_per_stage": Bad(lambda tmp: simulate(generate("simple", 2, 2),
                                                         forward_time=[1.0, 2.0, 3.0]),
                                    ScheduleError, r"^forward_time needs one value per stage\. "
                                    r"Received: 3 values for 2 stages\."),
    "schedule_action_fields": Bad(lambda tmp: Action(0, Op.FORWARD, None), ScheduleError,
                                  r"Received: stage=0, op=Op\.FORWARD, microbatch=None"),
}


@pytest.fixture(autouse=True)
def _not_initialized() -> Iterator[None]:
    core.shutdown()
    yield
    core.shutdown()


@pytest.mark.parametrize("name", sorted(CATALOGUE))
def test_bad_input_fails_clearly_before_anything_starts(name: str, tmp_path: Path) -> None:
    bad = CATALOGUE[name]
    with pytest.raises(bad.error, match=bad.match):
        bad.call(tmp_path)
    assert not core.is_initialized()        # init validated first, started nothing
    assert not (tmp_path / "jobs").exists()  # an estimator created no job directory


@pytest.mark.timeout(60)
def test_tfsmp_run_with_a_bad_distribution_exits_2_without_launching(
        capsys: pytest.CaptureFixture[str]) -> None:
    from tfsmp.launch.cli import main

    dist = json.dumps(_mp({"partitions": 2, "optimize": "fast"}))
    assert main(["run", "--distribution", dist, "no_such_script.py"]) == 2
    err = capsys.readouterr().err
    assert re.search(r"optimize must be a value in: \['speed', 'memory'\]\. Received: "
                     r"optimize='fast'\.", err), err
