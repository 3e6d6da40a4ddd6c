"""The launcher and the ranks obey the memory model: a run whose plan does not fit its cap is
refused before launch (or before any rank takes its stages) with what would fit, and a plan that
fits is picked where one exists ([Note: the launcher obeys the model] in
tfsmp/partitioning/memory_check.py)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytestmark = pytest.mark.tf

keras = pytest.importorskip("keras")

import tfsmp as smp  # noqa: E402
from tfsmp.errors import ConfigError  # noqa: E402
from tfsmp.graph import costs  # noqa: E402
from tfsmp.graph.tracer import trace  # noqa: E402
from tfsmp.launch import memcap  # noqa: E402
from tfsmp.launch.cli import main as cli_main  # noqa: E402
from tfsmp.partitioning.memory import MemorySettings, predict_memory  # noqa: E402
from tfsmp.partitioning.memory_check import CHECK_ENV  # noqa: E402
from tfsmp.partitioning.plan import StagePlan  # noqa: E402
from tfsmp.partitioning.planner import plan_graph  # noqa: E402

MiB = 2**20
BATCH = 4096  # large enough that speed mode's stashed activations matter
_MODEL = """
import keras
def stack():
    x = keras.Input((1024,), name="x")
    h = x
    for i in range(8):
        h = keras.layers.Dense(1024, activation="relu", name=f"d{i}")(h)
    return keras.Model(x, h, name="stack")
"""


def _stack() -> Any:
    x = keras.Input((1024,), name="x")
    h = x
    for i in range(8):
        h = keras.layers.Dense(1024, activation="relu", name=f"d{i}")(h)
    return keras.Model(x, h, name="stack")


@pytest.fixture(scope="module")
def peaks() -> dict[str, int]:
    """The largest rank's predicted peak at p=2, m=2 in speed mode (as the runtime runs it,
    with its drain split; and without it: ``speed_plain``) and in memory mode."""
    traced = trace(_stack(), batch_size=BATCH)
    costs.measure_activations(traced, costs.sample_batch(traced, rows=2))
    out = {}
    for key, mode, drain in (("speed", "speed", None), ("speed_plain", "speed", 0),
                             ("memory", "memory", None)):
        s = MemorySettings(partitions=2, microbatches=2, batch_size=BATCH, optimize=mode,
                           optimizer="adam", drain=drain)
        plan = plan_graph(traced.graph, 2, optimize=mode, optimizer="adam", batch_size=BATCH,
                          step_samples=BATCH, memory=s)
        out[key] = max(r.total for r in predict_memory(plan, traced.graph, s))
    return out


def _launch(tmp_path: Path, cap: int, optimize: str) -> int:
    (tmp_path / "mc_models.py").write_text(_MODEL)
    config = json.dumps({"partitions": 2, "microbatches": 2, "optimize": optimize})
    return cli_main(["run", "-np", "2", "--memory-per-rank", str(cap), "--model",
                     f"{tmp_path / 'mc_models.py'}:stack", "--batch-size", str(BATCH),
                     "--config", config, "--dry-run", "train.py"])


@pytest.fixture()
def cgroups() -> None:
    try:
        memcap.find_controller()
    except ConfigError:
        pytest.skip("no writable memory cgroup on this host")
    if memcap.host_has_gpu():
        pytest.skip("a GPU host caps the device, not a cgroup")


def test_run_refuses_before_launch_a_plan_that_does_not_fit(
        tmp_path: Path, peaks: dict[str, int], capsys: pytest.CaptureFixture[str],
        cgroups: None) -> None:
    cap = min(peaks.values()) - 4 * MiB
    assert _launch(tmp_path, cap, "memory") == 2
    out = capsys.readouterr()
    assert "mpirun" not in out.out  # nothing launched
    assert "tfsmp run: error: Every rank's predicted peak memory must be within its cap" in out.err
    assert "optimize='memory'" in out.err and "microbatches=2" in out.err
    assert "Fix: " in out.err and "partitions=" in out.err  # what would fit


def test_run_picks_recomputation_where_that_fits(
        tmp_path: Path, peaks: dict[str, int], capsys: pytest.CaptureFixture[str],
        cgroups: None) -> None:
    # the case this test needs: below speed mode even without its drain split
    assert peaks["memory"] + 8 * MiB < peaks["speed_plain"] <= peaks["speed"], peaks
    cap = (peaks["memory"] + peaks["speed_plain"]) // 2
    assert _launch(tmp_path, cap, "speed") == 0
    out = capsys.readouterr()
    assert "with optimize='memory' (recomputation" in out.err
    config = json.loads(out.out.split("SM_HP_MP_PARAMETERS=")[1].split("'")[0])
    assert config["optimize"] == "memory" and config["microbatches"] == 2
    plan = StagePlan.from_json(Path(config["partition_file"]).read_text())
    assert plan.num_stages == 2
    Path(config["partition_file"]).unlink()


def test_run_drops_the_drain_split_where_only_that_fits(
        tmp_path: Path, peaks: dict[str, int], capsys: pytest.CaptureFixture[str],
        cgroups: None) -> None:
    assert peaks["speed_plain"] + 8 * MiB < peaks["speed"], peaks  # the case this test needs
    assert _launch(tmp_path, (peaks["speed_plain"] + peaks["speed"]) // 2, "speed") == 0
    out = capsys.readouterr()
    assert "no drain split" in out.err and "recomputation" not in out.err
    config = json.loads(out.out.split("SM_HP_MP_PARAMETERS=")[1].split("'")[0])
    assert config["optimize"] == "speed"
    plan = StagePlan.from_json(Path(config["partition_file"]).read_text())
    assert not plan.drain_split
    Path(config["partition_file"]).unlink()


def test_plan_reports_and_writes_the_drain_split_off_where_only_that_fits(
        tmp_path: Path, peaks: dict[str, int], capsys: pytest.CaptureFixture[str]) -> None:
    """`tfsmp plan` decides as `tfsmp run` does: a speed-mode plan over the cap only with its
    drain split fits without it, and the plan it writes says so."""
    (tmp_path / "mc_models.py").write_text(_MODEL)
    out = tmp_path / "plan.json"

    def plan(cap: int) -> str:
        assert cli_main(["plan", f"{tmp_path / 'mc_models.py'}:stack", "-p", "2",
                         "--optimize", "speed", "--batch-size", str(BATCH), "--microbatches",
                         "2", "--memory-per-rank", str(cap), "--out", str(out)]) == 0
        return capsys.readouterr().out

    text = plan((peaks["speed_plain"] + peaks["speed"]) // 2)
    assert "fits: every rank within" in text and "with no drain split" in text
    assert not StagePlan.from_json(out.read_text()).drain_split
    text = plan(peaks["speed"] + 16 * MiB)
    assert "fits: every rank within" in text and "drain split" not in text
    assert StagePlan.from_json(out.read_text()).drain_split


def test_run_launches_a_plan_that_fits_unchanged(
        tmp_path: Path, peaks: dict[str, int], capsys: pytest.CaptureFixture[str],
        cgroups: None) -> None:
    assert _launch(tmp_path, peaks["speed"] + 16 * MiB, "speed") == 0
    out = capsys.readouterr()
    config = json.loads(out.out.split("SM_HP_MP_PARAMETERS=")[1].split("'")[0])
    assert config["optimize"] == "speed"
    assert "The plan fits" in out.err and "recomputation" not in out.err
    Path(config["partition_file"]).unlink()


def _fit(cap: int, monkeypatch: pytest.MonkeyPatch, check: str = "") -> None:
    monkeypatch.setenv("TFSMP_MEMORY_PER_RANK", str(cap))
    monkeypatch.setenv(CHECK_ENV, check)
    if smp.is_initialized():
        smp.shutdown()
    smp.init({"partitions": 1, "microbatches": 2})
    try:
        with smp.deferred_init():
            model = smp.DistributedModel(_stack())
        model.compile(optimizer="adam", loss="mse")
        x = np.zeros((8, 1024), np.float32)
        model.fit(x, x, batch_size=8, epochs=1, verbose=0)
    finally:
        smp.shutdown()


def test_ranks_refuse_before_taking_their_stages(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ConfigError, match=r"\[rank 0.*must be within its cap .*Fix: partitions="):
        _fit(350 * MiB, monkeypatch)  # predicted: p=1 0.37 GiB, p=2 0.32


def test_the_check_can_be_turned_off_for_capacity_measurements(
        monkeypatch: pytest.MonkeyPatch) -> None:
    _fit(200 * MiB, monkeypatch, check="off")  # no cgroup here: nothing enforces the cap
