"""A Keras mask crossing a stage cut trains exactly like plain Keras (issue 19, masks).

One launch of 2 ranks runs every case of `scripts/mask_cases.py`: Embedding(mask_zero=True) on
stage 0, MultiHeadAttention (which reads the mask) on stage 1, Adam, 3 steps, m = 1 and 4,
interleaved and zb-h1, and a sequence length known only at run time. Before masks crossed cuts
as boundary tensors the attention attended to padding on stage 1 and every case failed (the
embedding weights were off).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.mpihelp import run_cases

pytestmark = pytest.mark.mpi
SCRIPTS = Path(__file__).parent / "scripts"
CASES = ["case_interleaved_m1", "case_interleaved_m4", "case_zb_h1_m1", "case_zb_h1_m4",
         "case_interleaved_m4_dynamic"]


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict:
    folder = tmp_path_factory.mktemp("masks")
    return run_cases(2, SCRIPTS / "mask_cases.py", CASES, timeout=600,
                     env={"TFSMP_MASK_DIR": str(folder)})


@pytest.mark.parametrize("case", CASES)
def test_masked_attention_across_a_cut_trains_like_keras(results: dict, case: str) -> None:
    for rank in (0, 1):
        r = results[case][rank]
        assert r["ok"], r["error"]
        out = r["result"]
        assert out["ok"], {k: out[k] for k in ("weight_err", "worst_weight", "losses",
                                               "ref_losses")}
        assert out["mask_boundaries"] == ["emb:0:0#mask"], out["boundaries"]
