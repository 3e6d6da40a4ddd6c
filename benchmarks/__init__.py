"""tfsmp's benchmarks: `python benchmarks/run.py [--quick]` (see benchmarks/run.py)."""
