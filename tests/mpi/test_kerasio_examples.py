"""Official keras-io examples, verbatim but for `tfsmp.DistributedModel(...)`, train on 2 ranks.

One launch per example (`kerasio/kerasio_run.py`, which supplies small synthetic data of the
datasets' shapes and dtypes and caps epochs with Keras's own `keras.config` switches). Each
launch runs the script three times: in its own flow under tfsmp (it must train: finite losses,
decreasing where the example trains for several epochs, and the same history on every rank);
as plain Keras and under tfsmp with ``shuffle=False`` forced (their histories and evaluations
must agree: m=1, so Dropout masks and BatchNorm statistics are Keras's own).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

from tests.mpihelp import run_mpi

pytestmark = pytest.mark.mpi
HARNESS = Path(__file__).parent / "kerasio" / "kerasio_run.py"
CONFIG = {"partitions": 2, "microbatches": 1}
RTOL = 1e-4

# example -> (modes, number of fit calls, do its losses decrease over its epochs)
EXAMPLES: dict[str, tuple[str, int, bool]] = {
    "mnist_convnet": ("own,plain,parity", 1, True),
    "text_classification_with_transformer": ("own,plain,parity", 1, True),
    "timeseries_classification_from_scratch": ("own,plain,parity,unseeded", 1, True),
    "functional_api": ("own,plain,parity", 3, False),  # 1 capped epoch each
}


def _run(name: str) -> list[dict[str, Any]]:
    modes = EXAMPLES[name][0]
    result = run_mpi(2, [HARNESS, name, "--modes", modes], config=CONFIG, timeout=420)
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-6000:]
    reports = {}
    for line in result.stdout.splitlines():
        if "KERASIO {" in line:
            report = json.loads(line[line.index("KERASIO {") + 8:])
            reports[report["rank"]] = report
    assert sorted(reports) == [0, 1], result.stdout[-4000:]
    return [reports[0], reports[1]]


def _close(a: list[float], b: list[float]) -> bool:
    return len(a) == len(b) and all(math.isclose(x, y, rel_tol=RTOL, abs_tol=1e-6)
                                    for x, y in zip(a, b))


@pytest.mark.parametrize("name", list(EXAMPLES))
def test_kerasio_example_trains_and_agrees_with_keras(name: str) -> None:
    _, n_fits, decreasing = EXAMPLES[name]
    a, b = _run(name)
    own, plain, parity = (a["modes"][m] for m in ("own", "plain", "parity"))  # plain: rank 0
    assert len(own["fits"]) == n_fits, own
    for h in own["fits"]:
        assert all(math.isfinite(v) for vs in h.values() for v in vs), h
        if decreasing:
            assert h["loss"][-1] < h["loss"][0], h["loss"]
    assert a["modes"]["own"] == b["modes"]["own"]        # every rank reports the same history
    assert a["modes"]["parity"] == b["modes"]["parity"]
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
            assert "got a different batch than rank 0 in the first batch of epoch 0" in err, err
