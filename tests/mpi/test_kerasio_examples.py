"""Official keras-io examples, verbatim but for `tfsmp.DistributedModel(...)`, train on 2 ranks.

One launch runs every example in turn (`kerasio/kerasio_run.py`, which supplies small synthetic
data of the datasets' shapes and dtypes and caps epochs with Keras's own `keras.config`
switches); each test asserts on its example's part. Each example runs as plain Keras and under
tfsmp with ``shuffle=False`` forced (their histories and evaluations must agree: m=1, so Dropout
masks and BatchNorm statistics are Keras's own, and every rank must report the same), and in its
own flow under tfsmp (it must train: finite losses, decreasing where the example trains for
several epochs, and the same history on every rank).

The functional API guide skips its own flow: it differs from its parity run only in
``shuffle=True``, and tfsmp shuffles by a row permutation that goes through the same row
selection as the unshuffled order (`BatchSource._array_epoch`), which the other examples' own
flows and `test_fit_parity` (shuffled ``validation_split``) already exercise; its parity run
still proves the guide trains (finite, equal to Keras) on every rank.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

from tests.mpihelp import FULL, run_mpi

pytestmark = pytest.mark.mpi
HARNESS = Path(__file__).parent / "kerasio" / "kerasio_run.py"
CONFIG = {"partitions": 2, "microbatches": 1}
RTOL = 1e-4

# example -> (modes, number of fit calls, do its losses decrease over its epochs). The example
# whose "unseeded" mode ends in a StepError runs last, so a failure there cannot stall the rest.
EXAMPLES: dict[str, tuple[str, int, bool]] = {
    "mnist_convnet": ("own,plain,parity", 1, True),
    "text_classification_with_transformer": ("own,plain,parity", 1, True),
    "functional_api": ("plain,parity", 3, False),  # 1 capped epoch each; no "own": see above
    "timeseries_classification_from_scratch": ("own,plain,parity,unseeded", 1, True),
}
if not FULL:  # the default run: a convnet and a transformer; CI (TFSMP_FULL_TESTS=1) all four
    EXAMPLES = {k: v for k, v in EXAMPLES.items()
                if k in ("mnist_convnet", "text_classification_with_transformer")}


@pytest.fixture(scope="module")
def reports() -> dict[str, list[dict[str, Any]]]:
    """example -> [rank 0's report, rank 1's report], from one launch of every example."""
    args = [f"{name}={modes}" for name, (modes, _, _) in EXAMPLES.items()]
    result = run_mpi(2, [HARNESS, *args], config=CONFIG, timeout=840)
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-6000:]
    found: dict[str, dict[int, dict[str, Any]]] = {name: {} for name in EXAMPLES}
    for line in result.stdout.splitlines():
        if "KERASIO {" in line:
            report = json.loads(line[line.index("KERASIO {") + 8:])
            found[report["example"]][report["rank"]] = report
    for name, per_rank in found.items():
        assert sorted(per_rank) == [0, 1], (name, result.stdout[-4000:])
    return {name: [per_rank[0], per_rank[1]] for name, per_rank in found.items()}


def _close(a: list[float], b: list[float]) -> bool:
    return len(a) == len(b) and all(math.isclose(x, y, rel_tol=RTOL, abs_tol=1e-6)
                                    for x, y in zip(a, b))


@pytest.mark.parametrize("name", list(EXAMPLES))
def test_kerasio_example_trains_and_agrees_with_keras(
        reports: dict[str, list[dict[str, Any]]], name: str) -> None:
    modes, n_fits, decreasing = EXAMPLES[name]
    a, b = reports[name]
    plain, parity = a["modes"]["plain"], a["modes"]["parity"]  # plain: rank 0
    run = a["modes"]["own"] if "own" in modes.split(",") else parity  # the example trains
    assert len(run["fits"]) == n_fits, run
    for h in run["fits"]:
        assert all(math.isfinite(v) for vs in h.values() for v in vs), h
        if decreasing:
            assert h["loss"][-1] < h["loss"][0], h["loss"]
    for mode in ("own", "parity"):                    # every rank reports the same history
        assert a["modes"].get(mode) == b["modes"].get(mode), mode
    assert len(parity["fits"]) == len(plain["fits"]) == n_fits
    for mine, ref in zip(parity["fits"], plain["fits"]):
        assert sorted(mine) == sorted(ref)                 # the same History keys as Keras ...
        for key in ref:                                   # ... and values
            assert _close(mine[key], ref[key]), (key, mine[key], ref[key])
    for mine, ref in zip(parity["evals"], plain["evals"]):
        assert _close(list(mine), list(ref)), (mine, ref)
    if "unseeded" in a["modes"]:  # the example's own unseeded np.random.permutation
        for r in (a, b):
            err = r["modes"]["unseeded"]["error"] or ""
            assert "got a different batch than rank 0 at step 0 of epoch 0" in err, err
