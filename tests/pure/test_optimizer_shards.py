"""The split of a rank's optimizer state among its data-parallel replicas, and its memory model."""

from __future__ import annotations

import itertools
import random

import graphs
import pytest

from tfsmp.config import load_config
from tfsmp.partitioning.memory import (
    EXCHANGE_COPIES,
    TIE_GRADIENT_COPIES,
    MemorySettings,
    predict_memory,
    settings_of,
    stage_memory,
    step_microbatches,
)
from tfsmp.partitioning.plan import StagePlan
from tfsmp.partitioning.shards import BUCKET_BYTES, exchange_bytes, largest_share, owners, split


def test_largest_first_to_the_least_loaded_replica() -> None:
    assert split([4096, 64, 4096], 2) == [0, 0, 1]
    assert split([10, 10, 10, 10], 2) == [0, 1, 0, 1]  # equal sizes alternate, in their order
    assert split([5, 3], 1) == [0, 0]
    assert split([5], 3) == [0]  # fewer variables than replicas: some own nothing
    assert split([], 2) == []


@pytest.mark.parametrize("parts", [1, 2, 3, 4, 8])
def test_every_variable_has_one_owner_and_shares_are_even_within_one_variable(parts: int) -> None:
    rng = random.Random(parts)
    for _ in range(50):
        sizes = [rng.choice([1, 64, 4096, 2**20]) * rng.randint(1, 4)
                 for _ in range(rng.randint(1, 30))]
        owner = split(sizes, parts)
        assert all(0 <= o < parts for o in owner)
        load = [sum(s for s, o in zip(sizes, owner) if o == p) for p in range(parts)]
        assert sum(load) == sum(sizes)
        assert max(load) <= sum(sizes) / parts + max(sizes)  # greedy's bound
        assert largest_share(sizes, parts) == max(load)
        if len(sizes) >= parts:
            assert all(load)  # each replica owns something when there is enough


def test_owners_do_not_depend_on_the_order_a_rank_lists_its_variables() -> None:
    sizes = {"d0/kernel": 4096, "d0/bias": 64, "d1/kernel": 4096, "ln/gamma": 64}
    first = owners(sizes, 2)
    for order in itertools.permutations(sizes):
        assert owners({k: sizes[k] for k in order}, 2) == first
    assert first == {"d0/bias": 0, "d0/kernel": 0, "d1/kernel": 1, "ln/gamma": 1}


def test_bad_arguments_say_what_must_hold() -> None:
    with pytest.raises(ValueError, match=r"at least one replica\. Received: parts=0"):
        split([1], 0)
    with pytest.raises(ValueError, match="sizes must be >= 0"):
        split([-1], 2)


def test_the_exchange_holds_one_bucket_or_one_larger_variable() -> None:
    assert exchange_bytes([10, 20]) == 30
    assert exchange_bytes([BUCKET_BYTES] * 4) == BUCKET_BYTES
    assert exchange_bytes([3 * BUCKET_BYTES, 10]) == 3 * BUCKET_BYTES
    assert exchange_bytes([]) == 0


def _plan(n: int = 8, k: int = 2) -> tuple[object, StagePlan]:
    g = graphs.chain(n, params=[16_000_000] * n, widths=[4096] * n)  # 64 MB a layer
    names = [node.name for node in g if not node.is_input]
    per = len(names) // k
    return g, StagePlan.from_assignment(g, {x: min(i // per, k - 1) for i, x in enumerate(names)}, k)


@pytest.mark.parametrize("optimizer", ["adam", "sgd_momentum"])
def test_memory_model_predicts_each_replicas_share_of_the_optimizer_state(optimizer: str) -> None:
    g, plan = _plan()
    layer = 4 * 16_000_000
    base = dict(partitions=2, microbatches=4, batch_size=8, optimizer=optimizer, data_parallel=2)
    full = predict_memory(plan, g, MemorySettings(**base))
    half = predict_memory(plan, g, MemorySettings(**base, shard_optimizer_state=True))
    slots = 2 if optimizer == "adam" else 1
    for f, h in zip(full, half):
        assert f.optimizer == slots * 4 * layer  # 4 layers a rank
        assert h.optimizer == slots * 2 * layer  # 2 of them each replica
        assert (h.weights, h.accumulators, h.activations) == (f.weights, f.accumulators,
                                                               f.activations)
        # the exchange's bucket (one 64 MB layer), in and out of TensorFlow
        assert h.buffers == f.buffers + EXCHANGE_COPIES * exchange_bytes([layer] * 4)
        # Adam saves 2 layers' slots per replica, more than the exchange's two copies of a
        # layer (SGD's one layer about pays for them here; more layers a rank would gain)
        if optimizer == "adam":
            assert h.total < f.total - layer
    one_replica = predict_memory(plan, g, MemorySettings(**{**base, "data_parallel": 1}))
    for f, o in zip(full, one_replica):  # linear layers' gradients at the step's end, from
        # every replica's rows: no accumulator to sum ([Note: late weights across replicas])
        assert f.accumulators == o.accumulators == 0 and f.buffers == o.buffers
    summed = predict_memory(plan, g, MemorySettings(**base, direct=False))
    unsummed = predict_memory(plan, g, MemorySettings(**{**base, "data_parallel": 1},
                                                      direct=False))
    for f, o in zip(summed, unsummed):  # d > 1 with accumulators: the sums' shared buffer
        assert f.buffers == o.buffers + exchange_bytes([layer] * 4)
    one = predict_memory(plan, g, MemorySettings(**{**base, "data_parallel": 1},
                                                 shard_optimizer_state=True))
    assert [r.optimizer for r in one] == [f.optimizer for f in full]  # one replica: no effect


def test_the_exchange_and_the_tied_sum_hold_their_host_copies_in_turn() -> None:
    # [Note: host copies in turn]: the step's end sums the tied copies' gradients, then
    # updates, then exchanges the weights; each frees its host copies before the next
    g = graphs.tied_embedding(n=4, params=4_000_000)  # a 16 MB embedding, tied to the head
    plan = StagePlan.from_assignment(
        g, {"emb": 0, "l0": 0, "l1": 0, "l2": 1, "l3": 1, "head": 1, "tail": 1}, 2)
    base = dict(partitions=2, microbatches=2, batch_size=8, optimizer="adam", data_parallel=2)
    full = predict_memory(plan, g, MemorySettings(**base))
    half = predict_memory(plan, g, MemorySettings(**base, shard_optimizer_state=True))
    for f, h in zip(full, half):
        stage = stage_memory(plan, g, f.rank, "adam")
        tied_sum = TIE_GRADIENT_COPIES * stage.tied
        exchange = EXCHANGE_COPIES * exchange_bytes(list(stage.trainable_units))
        assert tied_sum > 0 and exchange > 0
        assert h.buffers - f.buffers == max(tied_sum, exchange) - tied_sum


def test_a_replica_with_fewer_rows_than_microbatches_runs_one_microbatch_a_row() -> None:
    # as `Batching.step_shape` splits a batch: 8 microbatches of 4 rows run as 4 of one row
    assert step_microbatches(8, 4) == 4
    assert step_microbatches(4, 64) == 4
    assert step_microbatches(4, 0) == 1
    config = load_config({"partitions": 2, "microbatches": 8}, world_size=2)
    assert settings_of(config, "adam", batch_size=4).microbatches == 4


def test_a_batch_not_yet_known_keeps_the_configured_microbatches() -> None:
    config = load_config({"partitions": 2, "microbatches": 8}, world_size=2)
    assert settings_of(config, "adam", batch_size=None).microbatches == 8
    assert settings_of(config, "adam", batch_size=None).batch_size == 1
