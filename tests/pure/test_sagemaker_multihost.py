"""`instance_count` > 1 across machines: when the estimator launches across hosts, its mpirun line
(`--host algo-1:N,algo-2:N`, TCP interface, each host's own SM_* in its app context) and the errors
where the hosts cannot be reached. The run itself: tests/multihost/test_estimator_hosts.py."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest

from tfsmp.errors import ConfigError
from tfsmp.estimator import LOCAL_ROLE, TensorFlow
from tfsmp.estimator import plan as job_plan
from tfsmp.launch import sagemaker as sm

HOSTS = ["algo-1", "algo-2"]
DIST = {"smdistributed": {"modelparallel": {"enabled": True, "parameters": {"partitions": 2}}},
        "mpi": {"enabled": True, "processes_per_host": 2}}


def _resolve(name: str) -> str | None:
    return {"algo-1": "10.0.0.1", "algo-2": "10.0.0.2"}.get(name)


@pytest.mark.parametrize(("setting", "hostname", "hosts", "across"), [
    (None, "algo-1", HOSTS, True),          # a SageMaker container, an emulated host
    ("auto", "algo-1", HOSTS, True),
    (None, "laptop", HOSTS, False),         # elsewhere: the hosts are emulated on this machine
    ("local", "algo-1", HOSTS, False),
    ("ssh", "algo-1", ["algo-1"], False),   # one host needs no other
    (" SSH ", "algo-1", HOSTS, True),
])
def test_when_a_job_runs_across_hosts(setting: str | None, hostname: str, hosts: list[str],
                                      across: bool) -> None:
    assert sm.runs_across_hosts(hosts, setting=setting, hostname=hostname,
                                resolve=_resolve) is across


def test_unreachable_hosts_are_named_with_a_fix() -> None:
    with pytest.raises(ConfigError, match=r"instance_count=3 runs across hosts algo-1, algo-2, "
                       r"algo-3.*Received: algo-3 cannot be resolved on algo-1\. Fix: add them to "
                       r"/etc/hosts.*TFSMP_SAGEMAKER_HOSTS=local"):
        sm.runs_across_hosts(["algo-1", "algo-2", "algo-3"], setting=None, hostname="algo-1",
                             resolve=_resolve)


def test_ssh_from_another_host_and_unknown_settings_are_errors() -> None:
    with pytest.raises(ConfigError, match=r"launched from the first host.*Received: "
                       r"TFSMP_SAGEMAKER_HOSTS='ssh' on host 'laptop'.*Fix: run it on algo-1"):
        sm.runs_across_hosts(HOSTS, setting="ssh", hostname="laptop", resolve=_resolve)
    with pytest.raises(ConfigError, match=r"TFSMP_SAGEMAKER_HOSTS must be one of auto, local, "
                       r"ssh\. Received: TFSMP_SAGEMAKER_HOSTS='remote'"):
        sm.runs_across_hosts(HOSTS, setting="remote", hostname="algo-1", resolve=_resolve)


@pytest.fixture
def on_algo_1(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(sm.HOSTS_SETTING, raising=False)
    monkeypatch.setenv("SM_NETWORK_INTERFACE_NAME", "eth7")
    monkeypatch.setattr(job_plan.socket, "gethostname", lambda: "algo-1")
    monkeypatch.setattr(job_plan, "_resolve", _resolve)


def _tf(tmp_path: Path, **kwargs: Any) -> TensorFlow:
    (tmp_path / "src").mkdir(exist_ok=True)
    (tmp_path / "src" / "train.py").write_text("print('hi')\n")
    args: dict[str, Any] = dict(entry_point="train.py", source_dir=str(tmp_path / "src"),
                                role=LOCAL_ROLE, instance_count=2, instance_type="local",
                                framework_version="2.21", py_version="py311", distribution=DIST,
                                output_path=str(tmp_path / "jobs"))
    args.update(kwargs)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return TensorFlow(**args)


def _contexts(argv: list[str]) -> list[dict[str, str]]:
    """The `-x NAME=VALUE` pairs of each app context (the first holds the global flags too)."""
    out: list[dict[str, str]] = [{}]
    for i, tok in enumerate(argv):
        if tok == ":":
            out.append({})
        elif tok == "-x" and "=" in argv[i + 1]:
            name, value = argv[i + 1].split("=", 1)
            out[-1][name] = value
    return out


def test_launch_across_hosts_is_the_toolkits_with_each_hosts_own_environment(
        tmp_path: Path, on_algo_1: None) -> None:
    argv = _tf(tmp_path).mpi_command({"training": str(tmp_path)}, job_name="j")
    base = str(tmp_path / "jobs" / "j")
    assert argv[argv.index("--host") + 1] == "algo-1:2,algo-2:2" and "--hostfile" not in argv
    for param in ("btl_tcp_if_include", "oob_tcp_if_include"):
        assert argv[argv.index(param) + 1] == "eth7"
    first, second = _contexts(argv)
    assert first["SM_CURRENT_HOST"] == "algo-1" and second["SM_CURRENT_HOST"] == "algo-2"
    assert first["SAGEMAKER_BASE_DIR"] == base
    assert second["SAGEMAKER_BASE_DIR"] == f"{base}/hosts/algo-2"
    assert second["SM_MODEL_DIR"] == f"{base}/hosts/algo-2/model"
    assert second["SM_CHANNEL_TRAINING"] == f"{base}/hosts/algo-2/input/data/training"
    assert '"current_host":"algo-2"' in second["SM_TRAINING_ENV"]
    assert set(second) <= set(first)  # the same names (the first has the global -x too)
    # What is the same everywhere is exported once, by name; a per-host name never is.
    bare = {argv[i + 1] for i, t in enumerate(argv) if t == "-x" and "=" not in argv[i + 1]}
    assert {"SM_HOSTS", "SM_NUM_CPUS", "SM_HP_MP_PARAMETERS", "PATH"} <= bare
    assert not bare & set(second)
    assert argv.count("-np") == 2 and argv[argv.index("-np") + 1] == "2"


def test_across_hosts_without_mpi_is_an_error(tmp_path: Path, on_algo_1: None) -> None:
    est = _tf(tmp_path, distribution=None)
    with pytest.raises(ConfigError, match=r"a job across hosts runs under mpirun from algo-1\. "
                       r"Received: instance_count=2 without distribution=.*Fix: enable mpi"):
        est.fit(str(tmp_path), job_name="j")


def test_elsewhere_the_hosts_stay_emulated_on_this_machine(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(sm.HOSTS_SETTING, "local")
    argv = _tf(tmp_path).mpi_command(job_name="j")
    assert "--hostfile" in argv and "--host" not in argv
    assert _contexts(argv)[1] == {"SM_CURRENT_HOST": "algo-2"}
