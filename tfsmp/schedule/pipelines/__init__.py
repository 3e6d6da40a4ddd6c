"""The schedules tfsmp runs, one module each ([Note: pipeline registry] in registry.py).

A module here registers one `tfsmp.schedule.registry.Pipeline`; `registry._load` imports every
module of this package, so adding a schedule is adding a file (and its golden files).
"""

__all__: list[str] = []
