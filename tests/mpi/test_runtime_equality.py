"""Pipelined training equals plain Keras: losses and every weight after 3 steps (rtol 1e-5).

Each launch runs many configurations (`tests/mpi/scripts/runtime_cases.py` re-initializes tfsmp
per case). Models: an MLP, a residual CNN whose skip crosses a stage cut, a multi-input /
multi-output model, a model with a layer used twice, a small Transformer, and an embedding model
whose sparse gradients go through Adam. Stages p ∈ {1, 2, 4}, microbatches m ∈ {1, 2, 4, 8},
every pipeline (simple, interleaved, zb-h1, zb-v, looped-bfs), both `optimize` modes, 1 or 2 virtual
stages per rank, data-parallel degree
1, 2 and 4 (MPI and Horovod), and stage programs compiled with XLA (the `xla` parameter or
`compile(jit_compile=True)`, against plain Keras compiled with `jit_compile=True`), and
products run by tfsmp's OpenBLAS kernel (`blas='openblas'`, against plain Keras's own kernel).
Tolerance: rtol 1e-5, atol 1e-6 (float32).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.mpihelp import run_mpi, with_full

pytestmark = pytest.mark.mpi
SCRIPT = Path(__file__).parent / "scripts" / "runtime_cases.py"

# The default run keeps every model, schedule, optimize mode, virtual stages and data-parallel
# layout; the full run (CI) adds the second case of each pair.
TWO_RANKS = with_full([
    "mlp:2:1:interleaved:speed", "mlp:2:4:simple:memory", "mlp:2:8:interleaved:memory:adam",
    "mlp:1:4:interleaved:speed",                       # p=1, d=2 over MPI
    "rescnn:2:4:interleaved:speed",
    "multiio:2:4:interleaved:memory",
    "shared:2:4:interleaved:memory",
    "transformer:2:4:interleaved:speed", "transformer:2:8:simple:memory",
    "embed:2:4:interleaved:speed:adam", "embed:1:4:simple:memory:adam",  # sparse grads, d=2
    "mlp:2:4:interleaved:speed:v2", "rescnn:2:8:interleaved:memory:v2",   # 2 virtual stages/rank
    # BatchNormalization: moving statistics equal plain Keras at m = 1 (per-microbatch otherwise);
    # Dropout: at m = 1 the same masks as plain Keras; at m > 1 memory-mode recompute reuses the
    # forward's masks, so speed and memory training are bit-identical.
    "bn:2:1:interleaved:speed", "bn:2:1:simple:memory",
    "drop:2:1:interleaved:speed", "dropmodes:2:4",
    # zero-bubble: backward split into B (input gradients) and W (weight gradients)
    "mlp:2:8:zb-h1:memory:adam", "transformer:2:4:zb-h1:speed",
    "embed:2:4:zb-h1:speed:adam", "bn:2:1:zb-h1:memory",
    "multiio:2:4:zb-v:speed", "rescnn:2:4:zb-v:memory",
    # breadth-first looped (tfsmp/schedule/pipelines/looped_bfs.py): 2 chunks per rank
    "mlp:2:4:looped-bfs:memory:v2", "rescnn:2:4:looped-bfs:speed:v2",
    # XLA ([Note: jit_compile is xla] in tfsmp/keras/model.py): Dropout's masks are XLA's
    "mlp:2:8:interleaved:speed:jit", "drop:2:1:interleaved:speed:jit",
    "rescnn:2:4:interleaved:speed:v2,xla", "mlp:2:8:zb-h1:memory:adam,xla",
    # blas='openblas' ([Note: OpenBLAS products] in tfsmp/runtime/kernels): the products run
    # tfsmp's OpenBLAS kernel, in every program kind (fused, split B/W, p = 1's one call)
    "mlp:2:8:interleaved:speed:blas", "transformer:2:4:zb-h1:speed:blas",
    "mlp:1:1:interleaved:speed:blas",
], [
    "rescnn:2:4:simple:memory:blas", "embed:2:4:interleaved:speed:adam,blas",
    "multiio:2:4:zb-v:memory:blas",
    "transformer:2:4:zb-v:speed:xla", "embed:2:4:interleaved:speed:adam,jit",
    "bn:2:1:simple:memory:xla",
    "rescnn:2:8:simple:memory", "multiio:2:2:simple:speed", "shared:2:1:simple:speed",
    "transformer:2:4:interleaved:speed:v2", "drop:2:1:simple:memory", "mlp:2:4:zb-h1:speed",
    "shared:2:4:zb-h1:memory", "transformer:2:8:zb-v:speed",
])

FOUR_RANKS = with_full([
    "mlp:4:8:interleaved:speed", "mlp:4:4:simple:memory",
    "rescnn:4:4:interleaved:memory",
    "mlp:1:4:simple:speed",                                          # p=1, d=4
    "mlp:4:8:zb-h1:speed", "transformer:4:4:zb-v:memory",  # zb-v: 8 stages, the MLP has 6 layers
    "mlp:2:4:zb-h1:memory",                                          # zb-h1, p=2, d=2
    "mlp:2:4:interleaved:speed:jit",                                 # XLA, p=2, d=2
], [
    "mlp:4:1:interleaved:memory", "multiio:4:4:interleaved:speed",
    "transformer:4:8:interleaved:speed",
    "mlp:2:4:interleaved:speed", "transformer:2:4:simple:memory",  # p=2, d=2 over MPI
])

FOUR_RANKS_HOROVOD = [
    "mlp:2:4:simple:memory:horovod", "rescnn:2:4:interleaved:speed:horovod",
    "embed:2:4:interleaved:speed:adam,horovod", "mlp:2:4:zb-h1:speed:horovod",
    "mlp:2:4:interleaved:speed:horovod,jit",
]


def _run(np: int, cases: list[str], timeout: float) -> dict[str, dict[int, dict]]:
    result = run_mpi(np, [str(SCRIPT), *cases], timeout=timeout)
    out: dict[str, dict[int, dict]] = {}
    for line in result.stdout.splitlines():
        if "CASE {" in line:
            d = json.loads(line[line.index("CASE {") + 5:])
            out.setdefault(d["case"], {})[d["rank"]] = d
    assert result.returncode == 0, result.stderr[-4000:]
    return out


def _check(results: dict[str, dict[int, dict]], cases: list[str], np: int) -> None:
    failures = []
    for case in cases:
        ranks = results.get(case, {})
        assert sorted(ranks) == list(range(np)), f"{case}: missing ranks {sorted(ranks)}"
        for rank, d in sorted(ranks.items()):
            if not d["ok"]:
                failures.append(f"{case} rank {rank}: losses {d.get('losses')} vs "
                                f"{d.get('ref_losses')}, weight err {d.get('max_weight_err')}\n"
                                f"{d.get('error') or ''}")
            else:  # each rank holds exactly its stages' variables
                assert d["held_bytes"] == d["plan_bytes"], (case, rank, d)
                _check_zero_bubble(case, rank, d)
        if _pipeline(case).startswith("zb") and all(d["ok"] for d in ranks.values()):
            assert sum(d["deferred"] for d in ranks.values()) > 0, (case, ranks)
    assert not failures, "\n".join(failures)


def _pipeline(case: str) -> str:
    parts = case.split(":")
    return parts[3] if len(parts) > 3 else ""  # "dropmodes:2:4" names no pipeline


def _check_zero_bubble(case: str, rank: int, d: dict) -> None:
    """zb-*: a rank holds at most 1F1B's peak: p microbatches (zb-v: 2p half-size chunks).
    (`_check` also asserts that some rank deferred Dense weight gradients to W, so that B and
    W really ran apart; a rank of only convolutions defers none.)"""
    if not _pipeline(case).startswith("zb"):
        return
    _, p, m, pipeline = case.split(":")[:4]
    limit = min(int(p), int(m)) * (2 if pipeline == "zb-v" else 1)
    assert d["max_held"] <= limit, (case, rank, d["max_held"], limit)


@pytest.mark.timeout(600)
def test_two_ranks_equal_plain_keras() -> None:
    _check(_run(2, TWO_RANKS, timeout=540), TWO_RANKS, 2)


@pytest.mark.timeout(600)
def test_four_ranks_equal_plain_keras() -> None:
    _check(_run(4, FOUR_RANKS, timeout=540), FOUR_RANKS, 4)


@pytest.mark.horovod
@pytest.mark.timeout(400)
def test_four_ranks_horovod_reduction_equals_plain_keras() -> None:
    _check(_run(4, FOUR_RANKS_HOROVOD, timeout=360), FOUR_RANKS_HOROVOD, 4)
