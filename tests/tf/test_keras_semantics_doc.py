"""docs/keras_semantics.md and the code agree: every conformance case has its row and every row
its case, every refusal case is documented, and every Keras hook tfsmp knows is listed with
what tfsmp does with it (`tfsmp.keras.overrides.HOOKS`)."""

from __future__ import annotations

import importlib.util
import inspect
import re
import sys
from pathlib import Path
from typing import Any

import pytest

from tfsmp.keras.overrides import HOOKS

pytestmark = pytest.mark.tf
ROOT = Path(__file__).resolve().parents[2]
DOC = (ROOT / "docs" / "keras_semantics.md").read_text()


def _cases() -> Any:
    sys.path.insert(0, str(ROOT / "tests" / "mpi" / "scripts"))
    spec = importlib.util.spec_from_file_location("conformance_cases",
                                                  ROOT / "tests/mpi/scripts/conformance_cases.py")
    module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    sys.modules["conformance_cases"] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module


def _section(title: str) -> str:
    return DOC.split(f"## {title}")[1].split("\n## ")[0]


def _rows(title: str) -> dict[str, list[str]]:
    rows = re.findall(r"^\| `(\w+)` \| (.+) \|$", _section(title), re.M)
    return {name: [c.strip() for c in rest.split(" | ")] for name, rest in rows}


def test_every_conformance_case_has_its_row_and_every_row_its_case() -> None:
    cases = _cases()
    rows = _rows("Features")
    assert set(rows) == set(cases.FEATURES)
    assert {r[-1] for r in rows.values()} <= {"equal", "per microbatch"}
    for name, feature in cases.FEATURES.items():
        assert feature.doc, name  # each case names the Keras documentation it follows


def test_every_refusal_case_is_documented() -> None:
    source = inspect.getsource(_cases().case_refusals)
    assert set(re.findall(r'"(\w+)": _refused', source)) == set(_rows("Refused, with the error"))


def test_every_keras_hook_is_listed_with_what_tfsmp_does() -> None:
    rows = _rows("Keras hooks a model may override")
    assert set(rows) == set(HOOKS)
    for name, (entries, _) in HOOKS.items():
        assert rows[name] == [f"refused ({', '.join(entries)})"], name
