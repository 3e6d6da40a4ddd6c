"""Checkpoints and the Keras API read the partitioned model through `RankView`
(tfsmp/runtime/view.py), not the engine's or its programs' attributes.

A source scan: the checkpoint package never names the engine at all (it reads
``DistributedModel.rank_view``); the Keras API calls the engine's methods but reads no attribute
of it besides ``view``, and no private one.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2] / "tfsmp"

# What an engine reach-in looks like: a private attribute, the programs, or the structure the
# view now carries.
PRIVATE = re.compile(r"engine\._[a-z]|\._engine\._|\.programs\b|\._programs\b")
STRUCTURE = re.compile(
    r"engine\.(traced|plan|stages|comm|variables|accumulators|dp_size|num_ranks|pipe_rank|"
    r"is_last_rank|last_rank|config|m|ties|optimizer)\b")


def _lines(package: str) -> list[tuple[str, int, str]]:
    out = []
    for path in sorted((ROOT / package).glob("*.py")):
        for n, line in enumerate(path.read_text().splitlines(), 1):
            out.append((f"{path.relative_to(ROOT.parent)}:{n}", n, line))
    return out


def test_checkpoints_never_touch_the_engine() -> None:
    bad = [f"{where}: {line.strip()}" for where, _, line in _lines("checkpoint")
           if "_engine" in line or PRIVATE.search(line) or STRUCTURE.search(line)]
    assert not bad, "checkpoint code must read dm.rank_view:\n" + "\n".join(bad)


def test_the_keras_api_reads_no_engine_attribute_but_its_view() -> None:
    bad = [f"{where}: {line.strip()}" for where, _, line in _lines("keras")
           if PRIVATE.search(line) or STRUCTURE.search(line)]
    assert not bad, "Keras API code must read engine.view:\n" + "\n".join(bad)


def test_the_scan_catches_a_reach_in() -> None:
    for line in ("engine._apply_fn = None", "prog = engine.programs[s]", "dm._engine._tracer",
                 "engine.comm.pipeline.bcast_obj(x)", "if engine.is_last_rank:"):
        assert PRIVATE.search(line) or STRUCTURE.search(line), line
    for line in ("engine.view.traced", "engine.train_step(x, y)", "engine.collected(s)"):
        assert not (PRIVATE.search(line) or STRUCTURE.search(line)), line


# [Note: one driver] (tfsmp/runtime/hooks.py): only the executor starts a program's step; the
# engine sets no per-step flag on a program and reads results, not program attributes.
PROGRAM_FLAGS = re.compile(
    r"\b(prog|program|p)\.(collect|split|loss_scaler|fresh|fresh_w|collected|sparse_parts)\s*=(?!=)"
    r"|\b(prog|program|p)\.(scale\.assign|reset_accumulators|begin_step|finite_status)\(")


def test_the_engine_sets_no_flag_on_stage_programs() -> None:
    path = ROOT / "runtime" / "engine.py"
    bad = [f"engine.py:{n}: {line.strip()}" for n, line in
           enumerate(path.read_text().splitlines(), 1) if PROGRAM_FLAGS.search(line)]
    assert not bad, "the executor drives programs; the engine implements StepHooks:\n" + "\n".join(bad)


def test_the_program_scan_catches_a_flag() -> None:
    for line in ("prog.collect = True", "prog.scale.assign(1.0)", "p.finite_status()",
                 "prog.sparse_parts = {}"):
        assert PROGRAM_FLAGS.search(line), line
    assert not PROGRAM_FLAGS.search("if prog.collect == x:")


# [Note: results own their gradients] (tfsmp/runtime/gradients.py): a step's gradients belong to
# its result. Outside the program's own module, no runtime or API code reads them from a program
# (its current step's state or its accumulators), so a phase can never see another step's.
PROGRAM_GRADIENTS = re.compile(
    r"(\b(prog|program|p|stage_program)|programs\[[^\]]+\]|\._program)\.(grads|accumulators|_store)\b")


def _sources_outside_stage() -> list[Path]:
    paths = [*sorted((ROOT / "runtime").glob("*.py")), *sorted((ROOT / "keras").glob("*.py")),
             *sorted((ROOT / "checkpoint").glob("*.py"))]
    return [p for p in paths if p.name != "stage.py"]


def test_no_code_outside_a_program_reads_its_gradients() -> None:
    bad = [f"{path.relative_to(ROOT.parent)}:{n}: {line.strip()}"
           for path in _sources_outside_stage()
           for n, line in enumerate(path.read_text().splitlines(), 1)
           if PROGRAM_GRADIENTS.search(line)]
    assert not bad, "read gradients from the step's result (StageResult.grads):\n" + "\n".join(bad)


def test_the_gradient_scan_catches_a_reach_in() -> None:
    for line in ("grads = self.programs[s].grads", "prog.grads.sparse.get(i)",
                 "accs = program.accumulators", "self._program.grads.collected[i] = g"):
        assert PROGRAM_GRADIENTS.search(line), line
    for line in ("grads = result.stages[s].grads", "r.grads.losses", "grads[s].accumulators"):
        assert not PROGRAM_GRADIENTS.search(line), line
