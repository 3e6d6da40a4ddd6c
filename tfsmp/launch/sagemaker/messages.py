"""How the SageMaker launch contract's error messages quote values and suggest names."""

from __future__ import annotations

import difflib
from collections.abc import Sequence
from typing import Any

__all__: list[str] = []


def _r(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 200 else text[:197] + "..."


def _did_you_mean(key: Any, valid: Sequence[str]) -> str:
    close = difflib.get_close_matches(str(key), list(valid), n=1, cutoff=0.6)
    return f" Did you mean {close[0]!r}?" if close else ""
