"""The `viz` extra: commands that draw (plan, timeline, schedule) say how to install it.

Example::

    missing = viz_missing("tfsmp plan", ["plan.svg"])   # None when matplotlib is importable
    if missing:
        print(missing, file=sys.stderr)                  # ... Fix: pip install 'tfsmp[viz]'

matplotlib is not a dependency of the main install (`bash scripts/setup.sh`); the commands check
for it before any work (tracing a model, reading a trace) rather than fail at the end with
`ModuleNotFoundError: No module named 'matplotlib'`.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Sequence
from pathlib import Path

__all__ = ["PICTURES", "viz_missing"]

PICTURES = (".png", ".svg", ".pdf")


def viz_missing(command: str, outs: Sequence[str | None]) -> str | None:
    """The error line when one of ``outs`` is a picture and matplotlib is not installed."""
    pictures = [str(o) for o in outs if o and Path(str(o)).suffix.lower() in PICTURES]
    if not pictures or importlib.util.find_spec("matplotlib") is not None:
        return None
    return (f"{command}: error: drawing {', '.join(pictures)} needs matplotlib, which the main "
            f"install leaves out. Received: no module named 'matplotlib'. Fix: pip install "
            f"'tfsmp[viz]' (or bash scripts/setup.sh --test), or write a .json instead.")
