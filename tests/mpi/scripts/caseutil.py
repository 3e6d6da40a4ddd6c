"""Helpers shared by the case scripts (their folder is on sys.path when the runner imports them)."""

from __future__ import annotations

import tfsmp


def reinit(defaults: dict[str, object], **config: object) -> None:
    """Starts tfsmp afresh with ``defaults`` updated by ``config`` (each case sets its own)."""
    if tfsmp.is_initialized():
        tfsmp.shutdown()
    tfsmp.init({**defaults, **config})
