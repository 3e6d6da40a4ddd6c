"""`tfsmp export`: a tfsmp checkpoint -> a plain Keras file, in one process (no MPI).

Example::

    tfsmp export /opt/ml/checkpoints model.keras          # the latest checkpoint, whole model
    tfsmp export /opt/ml/checkpoints/ckpt-3 w.weights.h5  # one checkpoint, weights only
    tfsmp export /opt/ml/checkpoints serving/ --import my_layers   # TF SavedModel directory

The checkpoint must come from a Functional or Sequential model (its Keras config is stored in
the manifest); ``--import`` loads modules that register custom layers first.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from typing import Any

__all__ = ["register", "run"]


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "export", help="write a tfsmp checkpoint as a .keras / .weights.h5 file or SavedModel",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoint_dir", metavar="CHECKPOINT_DIR",
                        help="a checkpoint (…/ckpt-N) or a CheckpointManager directory (latest)")
    parser.add_argument("out", metavar="OUT",
                        help="*.keras (whole model), *.weights.h5, or a directory (SavedModel)")
    parser.add_argument("--import", dest="imports", action="append", default=[],
                        metavar="MODULE", help="import MODULE first (registers custom layers)")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import os

    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    from tfsmp.errors import CheckpointError

    if "" not in sys.path:
        sys.path.insert(0, "")
    try:
        for module in args.imports:
            importlib.import_module(module)
        from tfsmp.checkpoint.offline import export_checkpoint

        source = export_checkpoint(args.checkpoint_dir, args.out)
    except (CheckpointError, ImportError) as e:
        print(f"tfsmp export: {e}", file=sys.stderr)
        return 1
    print(f"exported {source} -> {args.out}")
    return 0
