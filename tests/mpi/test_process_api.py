"""The SMP process API under real MPI: rank tables for 8 ranks, communication calls on 4 ranks."""

from __future__ import annotations

import json

import pytest
from mpihelp import SCRIPTS, assert_ok, run_cases, run_mpi

pytestmark = pytest.mark.mpi

# SMP's documented tables for 8 processes, partitions=2 (its placement_strategy documentation).
SMP_TABLES = {
    "cluster": {"mp": [[0, 1], [2, 3], [4, 5], [6, 7]], "dp": [[0, 2, 4, 6], [1, 3, 5, 7]]},
    "spread": {"mp": [[0, 4], [1, 5], [2, 6], [3, 7]], "dp": [[0, 1, 2, 3], [4, 5, 6, 7]]},
}


def _group_of(groups: list[list[int]], rank: int) -> list[int]:
    return next(g for g in groups if rank in g)


@pytest.mark.parametrize("placement", ["spread", "cluster"])
def test_tfsmp_run_reproduces_smp_rank_table(placement: str) -> None:
    res = run_mpi(8, [SCRIPTS / "print_ranks.py"], launcher="tfsmp", timeout=90,
                  config={"partitions": 2, "placement_strategy": placement})
    assert res.returncode == 0, res.describe()
    table = SMP_TABLES[placement]
    for rank in range(8):
        (rec,) = res.json_lines(rank)
        mp_group, dp_group = _group_of(table["mp"], rank), _group_of(table["dp"], rank)
        assert rec["get_mp_group"] == mp_group
        assert rec["get_dp_group"] == dp_group
        assert rec["mp_rank"] == rec["pp_rank"] == mp_group.index(rank)
        assert rec["dp_rank"] == rec["rdp_rank"] == dp_group.index(rank)
        assert (rec["rank"], rec["size"], rec["mp_size"], rec["dp_size"]) == (rank, 8, 2, 4)
        assert (rec["tp_rank"], rec["tp_size"], rec["local_size"]) == (0, 1, 8)
        assert rec["tensorflow_imported"] is False
    if placement == "spread":  # the doc's spot checks
        assert [res.json_lines(r)[0]["mp_rank"] for r in range(8)] == [0] * 4 + [1] * 4
        assert res.json_lines(6)[0]["dp_rank"] == 2
    assert sorted(res.json_lines(r)[0]["local_rank"] for r in range(8)) == list(range(8))


def _mp(r: int) -> list[int]:
    return [r % 2, r % 2 + 2]      # spread, 4 ranks, 2 partitions


def _dp(r: int) -> list[int]:
    return [r - r % 2, r - r % 2 + 1]


CASES = [
    "case_rank_helpers", "case_broadcast_world", "case_broadcast_mp", "case_broadcast_dp",
    "case_send_world_ring", "case_send_mp", "case_send_dp", "case_send_broadcast_fifo",
    "case_allgather", "case_barriers", "case_dp_barrier_scope", "case_mp_barrier_scope",
    "case_comm_isend_irecv", "case_comm_fifo_same_tag", "case_comm_allreduce",
    "case_comm_objects", "case_comm_send_recv_obj", "case_user_and_runtime_isolated",
    "case_tag_ub", "case_errors", "case_init_again",
]


@pytest.fixture(scope="module")
def api_results() -> dict[str, dict[int, dict]]:
    results = run_cases(4, SCRIPTS / "cases_process_api.py", CASES, timeout=120,
                        config={"partitions": 2, "placement_strategy": "spread"})
    assert_ok(results)
    return {case: {r: rec["result"] for r, rec in per_rank.items()}
            for case, per_rank in results.items()}


def test_rank_helpers(api_results) -> None:
    for r, got in api_results["case_rank_helpers"].items():
        assert got == {
            "rank": r, "size": 4, "mp_rank": r // 2, "mp_size": 2, "dp_rank": r % 2,
            "dp_size": 2, "pp_rank": r // 2, "pp_size": 2, "tp_rank": 0, "tp_size": 1,
            "rdp_rank": r % 2, "rdp_size": 2, "get_mp_group": _mp(r), "get_dp_group": _dp(r),
            "local_size": 4, "local_ranks": [0, 1, 2, 3]}


def test_broadcast_then_recv_from_in_every_group(api_results) -> None:
    world = api_results["case_broadcast_world"]
    assert world[1] == "sent"
    assert all(world[r] == {"from": 1, "payload": [1, 2, 3]} for r in (0, 2, 3))
    mp, dp = api_results["case_broadcast_mp"], api_results["case_broadcast_dp"]
    assert (mp[0], mp[1], mp[2], mp[3]) == (["mp", 2], ["mp", 3], "sent", "sent")
    assert (dp[0], dp[1], dp[2], dp[3]) == (["dp", 1], "sent", ["dp", 3], "sent")


def test_send_recv_from_with_each_rank_type(api_results) -> None:
    for r in range(4):
        assert api_results["case_send_world_ring"][r] == ["ring", (r - 1) % 4]
        assert api_results["case_send_mp"][r] == ["mp", (r + 2) % 4]
        assert api_results["case_send_dp"][r] == ["dp", r ^ 1]


def test_send_and_broadcast_keep_order_per_pair(api_results) -> None:
    got = api_results["case_send_broadcast_fifo"]
    assert got == {0: "sent", 1: ["second"], 2: ["second"], 3: ["first", "second", "third"]}


def test_allgather_orders_by_group_rank(api_results) -> None:
    for r, got in api_results["case_allgather"].items():
        assert got["WORLD"] == [["x", i] for i in range(4)]
        assert got["MP_GROUP"] == [["x", i] for i in _mp(r)]
        assert got["DP_GROUP"] == [["x", i] for i in _dp(r)]


def test_barriers_wait_only_for_their_group(api_results) -> None:
    assert all(api_results["case_barriers"].values())
    dp_wait, mp_wait = api_results["case_dp_barrier_scope"], api_results["case_mp_barrier_scope"]
    # Rank 3 sleeps 2 s before entering: its group partner waits, the other group does not.
    assert dp_wait[2] >= 1.5 and dp_wait[0] < 1.0 and dp_wait[1] < 1.0, dp_wait
    assert mp_wait[1] >= 1.5 and mp_wait[0] < 1.0 and mp_wait[2] < 1.0, mp_wait


def test_comm_isend_irecv_match_by_tag(api_results) -> None:
    for r, got in api_results["case_comm_isend_irecv"].items():
        peers = {"world": 3 - r, "pipeline": (r + 2) % 4, "data": r ^ 1}
        for name, peer in peers.items():
            assert got[name]["peer"] == peer
            assert got[name]["a"] == [10.0 * peer + 1] * 5
            assert got[name]["b"] == [[100 * peer + i for i in range(3)],
                                      [100 * peer + i for i in range(3, 6)]]
    fifo = api_results["case_comm_fifo_same_tag"]
    assert fifo[0] == fifo[1] == "sent" and fifo[2] == fifo[3] == [0, 1, 2]


def test_comm_allreduce_sums_in_each_group(api_results) -> None:
    for r, got in api_results["case_comm_allreduce"].items():
        assert got["world"] == [10.0] * 4
        assert got["pipeline"] == [float(sum(i + 1 for i in _mp(r)))] * 4
        assert got["data"] == [float(sum(i + 1 for i in _dp(r)))] * 4


def test_comm_object_collectives(api_results) -> None:
    for r, got in api_results["case_comm_objects"].items():
        for name, members in {"world": [0, 1, 2, 3], "pipeline": _mp(r), "data": _dp(r)}.items():
            g = got[name]
            assert (g["ranks"], g["rank"], g["size"]) == (members, members.index(r), len(members))
            assert g["bcast"] == {"root": members[-1]}
            assert g["allgather"] == members
            assert (g["sum"], g["max"], g["min"]) == (sum(members), max(members), min(members))
            assert g["and"] is (3 not in members) and g["or"] is (3 in members)
    got = api_results["case_comm_send_recv_obj"]
    assert got == {0: {"y": 1}, 1: {"x": 0}, 2: {"y": 3}, 3: {"x": 2}}


def test_user_messages_never_match_runtime_messages(api_results) -> None:
    assert api_results["case_user_and_runtime_isolated"][1] == ["user message", 7.0]
    assert all(ub >= 32767 for ub in api_results["case_tag_ub"].values())


def test_misuse_raises_comm_error_with_a_fix(api_results) -> None:
    for errors in api_results["case_errors"].values():
        assert "a rank cannot send to itself" in errors["send_self"]
        assert "a MP_RANK must be in [0, 2). Received: rank=2" in errors["bad_mp_rank"]
        assert "rank_type must be smp.RankType" in errors["bad_rank_type"]
        assert "group must be smp.WORLD, smp.MP_GROUP or smp.DP_GROUP" in errors["bad_group"]


def test_second_init_returns_config_or_rejects_a_different_one(api_results) -> None:
    for got in api_results["case_init_again"].values():
        assert got["same"] is True and got["initialized"] is True
        assert "already called with a different config" in got["error"]
        assert "microbatches" in got["error"]


def test_case_runner_reports_failures_per_rank_and_keeps_going(tmp_path) -> None:
    module = tmp_path / "cases_demo.py"
    module.write_text(
        "def case_fail_on_1(ctx):\n"
        "    if ctx.rank == 1:\n        raise ValueError('only rank 1')\n    return ctx.rank\n"
        "def case_after(ctx):\n    ctx.store['n'] = ctx.store.get('n', 0) + 1\n"
        "    return [ctx.size, ctx.store['n']]\n")
    results = run_cases(2, module, ["case_fail_on_1", "case_after"], timeout=60)
    assert results["case_fail_on_1"][0]["ok"] and results["case_fail_on_1"][0]["result"] == 0
    assert not results["case_fail_on_1"][1]["ok"]
    assert "ValueError: only rank 1" in results["case_fail_on_1"][1]["error"]
    assert [results["case_after"][r]["result"] for r in (0, 1)] == [[2, 1], [2, 1]]
    with pytest.raises(AssertionError, match=r"case_fail_on_1 on rank 1"):
        assert_ok(results)
    assert json.dumps(results)  # reports are plain JSON
