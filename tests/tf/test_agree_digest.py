"""`batch_digest`: equal for equal batches, different for permuted or resized ones, bounded cost."""

from __future__ import annotations

import numpy as np
import pytest

from tfsmp.keras import data
from tfsmp.keras.data import batch_digest, different_ranks, same_batch_error


def test_equal_batches_have_equal_digests() -> None:
    x = np.random.default_rng(0).normal(size=(32, 5)).astype(np.float32)
    y = np.arange(32)
    assert batch_digest((x, y)) == batch_digest((x.copy(), y.copy()))
    assert batch_digest({"a": x, "b": [y, 3]}) == batch_digest({"b": [y, 3], "a": x})


def test_permuted_resized_or_retyped_batches_differ() -> None:
    x = np.random.default_rng(0).normal(size=(32, 5)).astype(np.float32)
    perm = np.random.default_rng(1).permutation(32)
    assert batch_digest(x) != batch_digest(x[perm])
    assert batch_digest(x) != batch_digest(x[:16])
    assert batch_digest(x) != batch_digest(x.astype(np.float64))
    assert batch_digest((x, 1)) != batch_digest((x, 2))  # Python values enter by value


def test_bfloat16_and_float8_batches_are_digested_by_their_bytes() -> None:
    # Keras's mixed_bfloat16 and quantized policies feed ml_dtypes arrays, which have no buffer
    # format: the digest raised "cannot include dtype 'E' in a buffer" before every step
    import ml_dtypes

    x = np.random.default_rng(0).normal(size=(32, 5)).astype(ml_dtypes.bfloat16)
    assert batch_digest(x) == batch_digest(x.copy())
    assert batch_digest(x) != batch_digest(x[::-1])
    assert batch_digest(x) != batch_digest(x.view(np.float16))  # same bytes, another dtype
    e4m3 = np.array(1.5, ml_dtypes.float8_e4m3fn)  # a 0-d leaf
    assert batch_digest(e4m3) == batch_digest(e4m3.copy()) != batch_digest(e4m3 * 2)


def test_large_leaves_hash_a_row_sample_that_still_sees_a_permutation(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(data, "DIGEST_BYTES", 1 << 12)  # 4 KB: the 64 KB batch is sampled
    x = np.random.default_rng(0).normal(size=(256, 64)).astype(np.float32)
    perm = np.random.default_rng(1).permutation(256)
    assert batch_digest(x) == batch_digest(x.copy())
    assert batch_digest(x) != batch_digest(x[perm])


def test_the_error_names_the_ranks_and_the_sizes() -> None:
    a, b = batch_digest(np.zeros((16, 2))), batch_digest(np.zeros((8, 2)))
    assert different_ranks([a, a, b], [0, 1, 2]) == [2]
    msg = str(same_batch_error("[rank 0 | pp_rank 0]", [a, a, b], [0, 1, 2], "at step 3 of epoch 1"))
    assert msg.startswith("[rank 0 | pp_rank 0] Ranks that train on one batch together")
    assert "rank(s) [2] got a different batch than rank 0 at step 3 of epoch 1 (batch sizes " \
        "differ: rank 0: 16, rank 1: 16, rank 2: 8)" in msg
    assert "Seed it alike on every rank" in msg
