"""Plans of real Keras architectures: valid ordered stages for 2, 4 and 8 stages, balanced within
1.10 max/mean wherever layer granularity allows it, and a report that says when it does not."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.tf

keras = pytest.importorskip("keras")
pytest.importorskip("tfsmp.graph.tracer", reason="the Keras tracer (tfsmp/graph/tracer.py) is not built yet")

import tfsmp  # noqa: E402
from tfsmp.graph.ir import LayerGraph  # noqa: E402
from tfsmp.graph.tracer import trace  # noqa: E402
from tfsmp.launch.cli import main as cli_main  # noqa: E402
from tfsmp.partitioning.plan import StagePlan  # noqa: E402
from tfsmp.partitioning.planner import IMBALANCE_TARGET, plan_graph  # noqa: E402
from tfsmp.partitioning.report import explain_imbalance, format_report  # noqa: E402


def transformer_encoder(seq: int = 64, vocab: int = 1000, d: int = 128, heads: int = 4,
                        blocks: int = 4, classes: int = 10) -> Any:
    """A BERT-style encoder classifier from stock Keras layers."""
    tokens = keras.Input((seq,), dtype="int32", name="tokens")
    x = keras.layers.Embedding(vocab, d, name="embed")(tokens)
    for i in range(blocks):
        a = keras.layers.MultiHeadAttention(heads, d // heads, name=f"mha{i}")(x, x)
        x = keras.layers.LayerNormalization(name=f"ln{i}a")(keras.layers.Add(name=f"add{i}a")([x, a]))
        f = keras.layers.Dense(4 * d, activation="gelu", name=f"ff{i}a")(x)
        f = keras.layers.Dense(d, name=f"ff{i}b")(f)
        x = keras.layers.LayerNormalization(name=f"ln{i}b")(keras.layers.Add(name=f"add{i}b")([x, f]))
    x = keras.layers.GlobalAveragePooling1D(name="pool")(x)
    return keras.Model(tokens, keras.layers.Dense(classes, name="head")(x), name="encoder")


MODELS = {
    "ResNet50": lambda: keras.applications.ResNet50(weights=None),
    "MobileNetV2": lambda: keras.applications.MobileNetV2(weights=None),
    "DenseNet121": lambda: keras.applications.DenseNet121(weights=None),
    "TransformerEncoder": transformer_encoder,
}


@pytest.fixture(scope="module")
def traced() -> dict[str, LayerGraph]:
    """Each model built and traced once for the whole module (it takes seconds)."""
    return {name: trace(make()).graph for name, make in MODELS.items()}


def check_ordered(graph: LayerGraph, plan: StagePlan) -> None:
    assert sorted(plan.stage_of) == sorted(n.name for n in graph if not n.is_input)
    assert sorted(set(plan.stage_of.values())) == list(range(plan.num_stages))
    for (src, dst) in graph.edges():
        if src in plan.stage_of:
            assert plan.stage_of[src] <= plan.stage_of[dst], (src, dst)
    for b in plan.boundaries:
        assert all(c > b.producer for c in b.consumers)


@pytest.mark.parametrize("stages", [2, 4, 8])
@pytest.mark.parametrize("name", sorted(MODELS))
def test_real_models_get_ordered_plans_balanced_or_explained(
        traced: dict[str, LayerGraph], name: str, stages: int) -> None:
    graph = traced[name]
    plan = plan_graph(graph, stages)
    check_ordered(graph, plan)
    assert StagePlan.from_json(plan.to_json()) == plan
    reason = explain_imbalance(plan, graph)
    if plan.imbalance() <= IMBALANCE_TARGET:
        assert reason is None
    else:
        assert reason is not None and "layer granularity" in reason, reason
        assert reason in format_report(plan, graph)


def test_balanced_where_granularity_allows(traced: dict[str, LayerGraph]) -> None:
    # Measured when written: every model at 2 and 4 stages, and ResNet50/MobileNetV2 at 8.
    for name in MODELS:
        for stages in (2, 4):
            assert plan_graph(traced[name], stages).imbalance() <= IMBALANCE_TARGET, (name, stages)
    for name in ("ResNet50", "MobileNetV2"):
        assert plan_graph(traced[name], 8).imbalance() <= IMBALANCE_TARGET, name


def test_memory_plans_balance_memory(traced: dict[str, LayerGraph]) -> None:
    for name, graph in traced.items():
        check_ordered(graph, plan_graph(graph, 4, optimize="memory", batch_size=32))
        # memory_weight=1, batch 1: the planner's weights are exactly StageCost.memory
        memory = plan_graph(graph, 4, optimize="memory", memory_weight=1.0)
        assert memory.memory_imbalance() <= plan_graph(graph, 4).memory_imbalance() + 1e-9, name


def test_public_plan_traces_and_plans_a_model() -> None:
    plan = tfsmp.plan(transformer_encoder(blocks=2), 2, batch_size=8)
    assert isinstance(plan, StagePlan) and plan.num_stages == 2
    assert plan.stage_of["embed"] == 0 and plan.stage_of["head"] == 1


def test_cli_prints_the_table_and_writes_json_and_svg(tmp_path: Path,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    script = tmp_path / "models.py"
    script.write_text(
        "import keras\n"
        "def small():\n"
        "    x = keras.Input((32,))\n"
        "    h = x\n"
        "    for i in range(6):\n"
        "        h = keras.layers.Dense(64, activation='relu', name=f'd{i}')(h)\n"
        "    return keras.Model(x, keras.layers.Dense(10, name='out')(h), name='small')\n")
    out_json, out_svg = tmp_path / "plan.json", tmp_path / "plan.svg"
    code = cli_main(["plan", f"{script}:small", "--partitions", "3", "--batch-size", "16",
                     "--out", str(out_json), "--out", str(out_svg)])
    printed = capsys.readouterr().out
    assert code == 0
    assert "Plan of 'small': 3 stages" in printed
    assert "imbalance (max/mean): cost" in printed
    plan = StagePlan.from_json(out_json.read_text())
    assert plan.num_stages == 3 and json.loads(out_json.read_text())["planner"] in (
        "metis", "contiguous")
    assert "<svg" in out_svg.read_text()[:400]


def test_cli_reports_an_impossible_plan(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    script = tmp_path / "tiny.py"
    script.write_text(
        "import keras\n"
        "def tiny():\n"
        "    x = keras.Input((4,))\n"
        "    return keras.Model(x, keras.layers.Dense(2, name='only')(x))\n")
    assert cli_main(["plan", f"{script}:tiny", "--partitions", "2"]) == 2
    assert "Every stage needs at least one layer" in capsys.readouterr().err
