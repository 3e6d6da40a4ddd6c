"""Optimizer state sharded across data-parallel replicas (``shard_optimizer_state``) equals plain Keras.

4 ranks (p=2 × d=2, and p=1 × d=4), many cases per launch (tests/mpi/scripts/runtime_cases.py
with the ``shard`` flag): Adam and SGD with momentum, ``global_clipnorm`` (the norm must cover
every gradient, not the owned ones), m = 1 and m > 1, interleaved, simple and zb-h1, sparse
gradients, tied copies, two stages a rank; losses and every weight at rtol 1e-5 (the equality
tests' tolerance), bit for bit the unsharded run's without clipping, and each replica holding
only its share of the optimizer's slots. (BatchNormalization is left out: at d = 2 its batch
statistics are each replica's, sharded or not.) Checkpoints stay layout-free: saved
sharded at p=2 × d=2, restored at d=1 unsharded and at d=4 sharded; the weights file a
sharded job writes holds the whole optimizer state (a plain Keras model loads it).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.mpi.test_runtime_equality import _check, _run
from tests.mpihelp import SCRIPTS, assert_ok, run_cases

pytestmark = pytest.mark.mpi

SHARDED = [
    "mlp:2:4:interleaved:speed:adam,shard", "mlp:2:4:interleaved:speed:adam",  # and unsharded
    "mlp:2:1:interleaved:memory:adam,shard",                       # m = 1
    "mlp:2:4:interleaved:memory:shard",                            # SGD with momentum
    "mlp:2:1:simple:speed:shard,clip", "mlp:2:8:interleaved:speed:adam,shard,clip",
    "mlp:2:8:zb-h1:memory:adam,shard", "mlp:2:4:zb-h1:speed:shard,clip",
    "transformer:2:4:interleaved:speed:shard,clip",
    "embed:2:4:interleaved:speed:adam,shard",                      # sparse gradients
    "mlp:1:4:interleaved:speed:adam,shard,clip",                   # p=1, d=4
    "shared:2:4:interleaved:memory:shard",                         # tied copies across stages
    "rescnn:2:4:interleaved:speed:v2,shard",                       # 2 stages a rank
]
HOROVOD = ["mlp:2:4:interleaved:speed:adam,shard,horovod,clip"]


def _rank_grid(np: int, p: int) -> list[tuple[int, int]]:
    """(pipeline rank, data rank) of each world rank under the default `cluster` placement."""
    return [(r % p, r // p) for r in range(np)]


@pytest.mark.timeout(720)
def test_sharded_optimizer_state_equals_plain_keras() -> None:
    results = _run(4, SHARDED, timeout=660)
    _check(results, SHARDED, 4)
    # each replica holds only its share: together the replicas of a pipeline rank hold what
    # one unsharded rank holds, and each less
    sharded, full = results["mlp:2:4:interleaved:speed:adam,shard"], \
        results["mlp:2:4:interleaved:speed:adam"]
    # without global_clipnorm the owners run the unsharded update's ops on the same values
    # and the exchange moves them exactly: the same losses, bit for bit
    assert all(sharded[r]["losses"] == full[r]["losses"] for r in range(4)), (sharded, full)
    assert all(sharded[r]["max_weight_err"] == full[r]["max_weight_err"] for r in range(4))
    for pipe in range(2):
        ranks = [r for r, (pr, _) in enumerate(_rank_grid(4, 2)) if pr == pipe]
        assert sum(sharded[r]["opt_bytes"] for r in ranks) == full[ranks[0]]["opt_bytes"]
        assert all(sharded[r]["opt_bytes"] < full[r]["opt_bytes"] for r in ranks)
    d4 = results["mlp:1:4:interleaved:speed:adam,shard,clip"]
    assert max(d["opt_bytes"] for d in d4.values()) < sum(d["opt_bytes"] for d in d4.values()) / 2


@pytest.mark.horovod
@pytest.mark.timeout(400)
def test_sharded_optimizer_state_with_horovod_reduction() -> None:
    _check(_run(4, HOROVOD, timeout=360), HOROVOD, 4)


CASES = SCRIPTS / "sharded_ckpt_cases.py"


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    directory = tmp_path_factory.mktemp("sharded_ckpt")
    results = run_cases(4, CASES, ["case_save_sharded", "case_smp_step_refuses_sharding"],
                        env={"TFSMP_CKPT_DIR": str(directory)}, timeout=360)
    assert_ok(results)
    return directory, results


@pytest.mark.timeout(420)
def test_sharded_save_writes_every_slot_from_its_owner(saved: tuple[Path, dict[str, Any]]
                                                       ) -> None:
    _, results = saved
    mine = {r: d["result"] for r, d in results["case_save_sharded"].items()}
    assert mine[0]["ref_err"] <= 1.0, mine[0]
    # the replicas' owned keys partition each pipeline rank's trainable variables
    for pipe in range(2):
        owned = [set(mine[r]["owned"]) for r, (pr, _) in enumerate(_rank_grid(4, 2)) if pr == pipe]
        assert owned[0] and owned[1] and not owned[0] & owned[1], owned
    # every rank writes slots (data rank 1's too), Adam's two per trainable variable
    assert mine[0]["slot_writers"] == [0, 1, 2, 3], mine[0]
    assert mine[0]["num_slots"] == 2 * 12  # 6 Dense/LayerNorm layers, kernel/bias or gamma/beta
    # the weights file: plain Keras loads the whole optimizer state, equal to its own
    assert mine[0]["num_opt_vars"][0] == mine[0]["num_opt_vars"][1], mine[0]
    assert mine[0]["file_opt_err"] <= 1.0 and mine[0]["file_weight_err"] <= 1.0, mine[0]


@pytest.mark.timeout(420)
def test_smp_step_refuses_sharded_optimizer_state(saved: tuple[Path, dict[str, Any]]) -> None:
    _, results = saved
    for d in results["case_smp_step_refuses_sharding"].values():
        assert d["result"]["error_type"] == "StepError", d
        assert "shard_optimizer_state shards the optimizer of compile() and fit()" in \
            d["result"]["message"], d
        assert "Fix: set shard_optimizer_state=False" in d["result"]["message"], d


@pytest.mark.timeout(600)
def test_sharded_checkpoint_restores_at_other_layouts(saved: tuple[Path, dict[str, Any]]) -> None:
    directory, _ = saved
    env = {"TFSMP_CKPT_DIR": str(directory)}
    d1 = run_cases(2, CASES, ["case_restore_unsharded_d1"], env=env, timeout=240)
    d4 = run_cases(4, CASES, ["case_restore_sharded_d4"], env=env, timeout=240)
    for results in (d1, d4):
        assert_ok(results)
        for ranks in results.values():
            for d in ranks.values():
                assert d["result"]["restored"] and d["result"]["iterations"] == 6, d
                assert d["result"]["err"] <= 1.0, d
