"""The plan report (table, imbalance reasons), the drawing, and `tfsmp plan` argument handling."""

from __future__ import annotations

import argparse
from pathlib import Path

import graphs
import pytest

from tfsmp.errors import ConfigError
from tfsmp.launch import cmd_plan
from tfsmp.partitioning.planner import plan_graph
from tfsmp.partitioning.report import draw_plan, explain_imbalance, format_report


def test_report_has_a_row_per_stage_with_every_column() -> None:
    g = graphs.chain(8, params=[1000] * 8)
    plan = plan_graph(g, 4)
    text = format_report(plan, g, batch_size=32)
    lines = text.splitlines()
    assert lines[0] == ("Plan of 'chain8': 4 stages, planner=contiguous, optimize=speed, "
                        "batch size 32")
    assert lines[1].split() == ["stage", "layers", "parameters", "FLOPs", "activations",
                                "memory", "bytes", "sent", "cost"]
    # stage 0: 2 layers, 2000 params, 2 x 3000 FLOPs x 32, activations 2 x 64 B x 32 = 4 KiB,
    # memory 4 KiB + 2000 x 4 B x (1 + 2 Adam slots) = 27.4 KiB, sent 64 B x 32 = 2 KiB
    assert lines[2].split() == ["0", "2", "2.00K", "192.00K", "4.0", "KiB", "27.4", "KiB",
                                "2.0", "KiB", "25.0%"]
    assert lines[6].startswith("imbalance (max/mean): cost 1.000, compute 1.000, memory 1.000")
    assert "layer granularity" not in text


def test_report_says_when_one_layer_is_too_big_to_balance() -> None:
    g = graphs.chain(5, flops=[1, 1, 10, 1, 1])
    plan = plan_graph(g, 3, flops_per_byte=0.0)
    reason = explain_imbalance(plan, g)
    assert reason is not None
    assert reason.startswith("imbalance 2.143 > 1.10: layer granularity: [l2] must stay on one "
                             "stage and carries 71.4% of the cost")
    assert reason in format_report(plan, g)


def test_report_says_when_contiguous_runs_cannot_balance() -> None:
    g = graphs.chain(3, flops=[3, 4, 3])
    plan = plan_graph(g, 2, flops_per_byte=0.0)
    reason = explain_imbalance(plan, g)
    assert reason is not None
    assert "no split of the layer order into 2 contiguous runs has max/mean below 1.400" in reason


def test_report_says_when_a_manual_plan_is_worse_than_possible() -> None:
    g = graphs.chain(4)
    plan = plan_graph(g, 2, method="manual", manual={"l3": 1}, default_partition=0)
    reason = explain_imbalance(plan, g)
    assert reason is not None
    assert "this manual plan accepted 1.500 where 1.000 is possible" in reason


def test_balanced_plans_need_no_explanation() -> None:
    g = graphs.chain(6)
    assert explain_imbalance(plan_graph(g, 3), g) is None


@pytest.mark.parametrize(("suffix", "magic"), [(".png", b"\x89PNG"), (".svg", b"<svg")])
def test_draw_plan_writes_images(tmp_path: Path, suffix: str, magic: bytes) -> None:
    g = graphs.skip()
    out = draw_plan(plan_graph(g, 3), g, tmp_path / f"plan{suffix}")
    assert magic in out.read_bytes()[:400]


def test_draw_plan_draws_a_strip_for_big_graphs(tmp_path: Path) -> None:
    g = graphs.random_dag(40)
    out = draw_plan(plan_graph(g, 4), g, tmp_path / "strip.svg", max_boxes=10)
    text = out.read_text()
    assert "40 layers in topological order" in text


def test_draw_plan_rejects_unknown_formats(tmp_path: Path) -> None:
    g = graphs.chain(2)
    with pytest.raises(ConfigError, match=r"draw_plan writes .png, .svg, .pdf files"):
        draw_plan(plan_graph(g, 1), g, tmp_path / "plan.gif")


def test_cli_loads_a_function_from_a_file_or_a_module(tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "my_models.py").write_text("def build():\n    return 42\n")
    assert cmd_plan.load_function(f"{tmp_path}/my_models.py:build")() == 42
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    assert cmd_plan.load_function("my_models:build")() == 42
    with pytest.raises(ConfigError, match=r"must be given as MODULE:FUNCTION. Received: 'my_models'"):
        cmd_plan.load_function("my_models")
    with pytest.raises(ConfigError, match=r"Received: 'nope' in 'my_models' is NoneType"):
        cmd_plan.load_function("my_models:nope")


def test_cli_rejects_unknown_output_formats(capsys: pytest.CaptureFixture[str]) -> None:
    args = argparse.Namespace(out=["plan.gif"])
    assert cmd_plan.run(args) == 2
    assert "--out must end in .json, .png, .svg, .pdf. Received: ['plan.gif']" in capsys.readouterr().err


def test_cli_registers_the_plan_command() -> None:
    from tfsmp.launch.cli import build_parser

    args = build_parser().parse_args(["plan", "m:f", "--partitions", "4", "--optimize", "memory",
                                      "--batch-size", "8", "--out", "a.json", "--out", "a.svg"])
    assert (args.model, args.partitions, args.optimize, args.batch_size, args.out) == (
        "m:f", 4, "memory", 8, ["a.json", "a.svg"])
