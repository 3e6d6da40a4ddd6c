"""The stall watchdog, under its old name: it lives in `tfsmp.comm.watchdog` now.

It moved into the comm layer so that every collective of the comm seam can go through it
([Note: watched collectives] there); the runtime's executor and engine keep importing it from
here. This module *is* that module (the same object in ``sys.modules``), so patching either
name patches both.
"""

from __future__ import annotations

import sys

from tfsmp.comm import watchdog as _impl
from tfsmp.comm.watchdog import (  # the names the runtime and tests use
    DIR_ENV,
    Status,
    Watchdog,
    collective_label,
    default_directory,
    for_process,
)

__all__ = ["DIR_ENV", "Status", "Watchdog", "collective_label", "default_directory", "for_process"]

sys.modules[__name__] = _impl
