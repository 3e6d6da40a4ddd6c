"""Entry point of a benchmark rank: ``python -m mpi4py -m benchmarks.worker MODULE FUNC ARGS``.

Calls ``benchmarks.MODULE.FUNC(args)`` on every rank and prints rank 0's result as one
``BENCH_JSON {...}`` line, which `benchmarks.common.launch` reads back.
"""

from __future__ import annotations

import importlib
import json
import os
import sys

from benchmarks.common import RESULT_PREFIX


def main(argv: list[str]) -> int:
    module_name, func_name, args_json = argv
    module = importlib.import_module(f"benchmarks.{module_name}")
    result = getattr(module, func_name)(json.loads(args_json))
    rank = int(os.environ.get("OMPI_COMM_WORLD_RANK", "0"))
    if rank == 0:
        print(RESULT_PREFIX + json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
