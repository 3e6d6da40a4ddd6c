"""`tfsmp plan`: trace a Keras model, plan its stages, print the per-stage table, draw or save it.

Example::

    tfsmp plan my_models:build_resnet --partitions 4 --batch-size 32 --out plan.json --out plan.svg
    tfsmp plan path/to/model.py:make --partitions 2 --optimize memory
    tfsmp plan my_models:gpt --partitions 4 --batch-size 8 --microbatches 4 \
        --input-shape token_ids=1024 --memory-per-rank 2.5G     # fits? if not, what would

``FUNCTION`` is called without arguments and returns a Keras model. ``MODULE`` is a dotted module
name importable from the current directory, or a path to a ``.py`` file.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = ["input_shapes", "load_function", "register", "run"]

_OUT_SUFFIXES = (".json", ".png", ".svg", ".pdf")


def load_function(spec: str) -> Callable[[], Any]:
    """Resolves ``MODULE:FUNCTION`` (a dotted module or a ``.py`` path) to the function.

    Raises:
        ConfigError: The spec is malformed, or the module or function cannot be found.
    """
    from tfsmp.errors import ConfigError

    module_name, sep, func_name = spec.rpartition(":")
    if not sep or not module_name or not func_name:
        raise ConfigError(
            f"The model must be given as MODULE:FUNCTION. Received: {spec!r}. "
            f"Example: my_models:build or path/to/file.py:build.")
    if module_name.endswith(".py") or "/" in module_name or "\\" in module_name:
        module = _load_file(Path(module_name))
    else:
        if "" not in sys.path and str(Path.cwd()) not in sys.path:
            sys.path.insert(0, str(Path.cwd()))  # as `python -m` would
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as e:
            raise ConfigError(
                f"Cannot import the model's module. Received: MODULE={module_name!r} ({e}). "
                f"Run from the directory that holds it, or pass a file path.") from e
    func = getattr(module, func_name, None)
    if not callable(func):
        raise ConfigError(
            f"FUNCTION must be a callable returning a Keras model. Received: {func_name!r} "
            f"in {module_name!r} is {type(func).__name__}.")
    return func  # type: ignore[no-any-return]


def _load_file(path: Path) -> Any:
    from tfsmp.errors import ConfigError

    if not path.is_file():
        raise ConfigError(f"The model file must exist. Received: {str(path)!r}.")
    spec = importlib.util.spec_from_file_location(path.stem, path)
    if spec is None or spec.loader is None:
        raise ConfigError(f"Cannot load a module from {str(path)!r}.")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def run(args: argparse.Namespace) -> int:
    """Entry point of `tfsmp plan`; 0 on success, 2 for invalid input or an impossible plan."""
    from tfsmp.errors import ConfigError, PartitionError, TraceError

    bad = [p for p in args.out or [] if Path(p).suffix.lower() not in _OUT_SUFFIXES]
    if bad:
        print(f"tfsmp plan: error: --out must end in {', '.join(_OUT_SUFFIXES)}. "
              f"Received: {bad}.", file=sys.stderr)
        return 2
    from tfsmp.launch.viz import viz_missing

    missing = viz_missing("tfsmp plan", args.out or [])
    if missing:
        print(missing, file=sys.stderr)
        return 2
    try:
        return _plan(args)
    except (ConfigError, PartitionError, TraceError) as e:
        print(f"tfsmp plan: error: {e}", file=sys.stderr)
        return 2


def _plan(args: argparse.Namespace) -> int:
    from tfsmp.graph.planning import optimizer_name, plan_model
    from tfsmp.partitioning.report import draw_plan, format_report

    model = load_function(args.model)()
    optimizer = args.optimizer or optimizer_name(model)
    if _memory_wanted(args):
        plan, graph, memory_text = _memory_plan(args, model, optimizer)
    else:
        plan, graph = plan_model(
            model, args.partitions, optimize=args.optimize, batch_size=args.batch_size,
            memory_weight=args.memory_weight, method=args.method, optimizer=optimizer)
        memory_text = ""
    print(format_report(plan, graph, optimize=args.optimize, memory_weight=args.memory_weight,
                        optimizer=optimizer, batch_size=args.batch_size or 1))
    if memory_text:
        print(memory_text)
    for out in args.out or []:
        path = Path(out)
        if path.suffix.lower() == ".json":
            path.write_text(plan.to_json() + "\n")
        else:
            draw_plan(plan, graph, path)
        print(f"wrote {path}")
    return 0


def _memory_wanted(args: argparse.Namespace) -> bool:
    return any(getattr(args, name, None) for name in (
        "memory_per_rank", "input_shape", "microbatches", "pipeline", "baseline"))


def input_shapes(specs: list[str] | None) -> dict[str, tuple[int, ...]]:
    """``["token_ids=1024", "image=224x224x3"]`` -> ``{name: per-sample shape}``."""
    from tfsmp.errors import ConfigError

    out = {}
    for spec in specs or []:
        name, _, dims = spec.partition("=")
        try:
            out[name] = tuple(int(d) for d in dims.lower().split("x"))
        except ValueError:
            out[name] = ()
        if not name or not out[name] or min(out[name]) < 1:
            raise ConfigError(
                f"--input-shape takes NAME=D1xD2... (an input's per-sample shape). Received: "
                f"{spec!r}. Example: --input-shape token_ids=1024.")
    return out


def _memory_plan(args: argparse.Namespace, model: Any, optimizer: str | None
                 ) -> tuple[Any, Any, str]:
    """[Note: memory model] in tfsmp/partitioning/memory.py: the plan (within
    ``--memory-per-rank`` under ``--optimize memory``), each rank's predicted peak and, when it
    does not fit, what would."""
    from tfsmp.graph import costs
    from tfsmp.graph.tracer import trace
    from tfsmp.launch.memcap import parse_size
    from tfsmp.partitioning.memory import (
        BASELINE_BYTES,
        MemorySettings,
        predict_memory,
        step_microbatches,
    )
    from tfsmp.partitioning.memory_check import check_memory
    from tfsmp.partitioning.planner import plan_graph
    from tfsmp.partitioning.report import format_memory

    cap = parse_size(args.memory_per_rank) if args.memory_per_rank else None
    traced = trace(model, batch_size=args.batch_size)
    costs.resolve_dims(traced, input_shapes(args.input_shape))
    if not args.no_measure:
        costs.measure_activations(traced, costs.sample_batch(traced, rows=2))
    from tfsmp.schedule.registry import get

    pipeline = args.pipeline or "interleaved"
    settings = MemorySettings(
        partitions=args.partitions,
        microbatches=step_microbatches(args.microbatches or 1, args.batch_size or None),
        pipeline=pipeline, virtual_stages=get(pipeline).chunks_for(1),
        batch_size=args.batch_size or 1,
        optimize=args.optimize, optimizer=optimizer,
        baseline=parse_size(args.baseline) if args.baseline else BASELINE_BYTES)
    plan = plan_graph(traced.graph, args.partitions * settings.virtual_stages,
                      optimize=args.optimize, memory_weight=args.memory_weight,
                      method=args.method, optimizer=optimizer, batch_size=args.batch_size or 1,
                      memory=settings, memory_cap=cap)
    if cap is None:
        return plan, traced.graph, format_memory(predict_memory(plan, traced.graph, settings))
    # as `tfsmp run` decides ([Note: the launcher obeys the model] in memory_check.py): where
    # only the speed mode's drain split is over the cap, the plan written runs without it
    decision = check_memory(traced.graph, settings, cap, lambda _: plan)
    text = format_memory(decision.ranks, cap, decision.hints)
    if decision.changes:
        text += (f"\nwith {'; '.join(decision.changes)}: the plan written says so "
                 f"(drain_split false), as tfsmp run would run it")
    return decision.plan, traced.graph, text


def register(subparsers: Any) -> None:
    """Adds the `plan` sub-command."""
    p = subparsers.add_parser(
        "plan", help="plan a Keras model's pipeline stages and print the per-stage table",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", metavar="MODULE:FUNCTION",
                   help="a function returning a Keras model (dotted module or file.py path)")
    p.add_argument("--partitions", "-p", type=int, required=True, help="number of stages")
    p.add_argument("--optimize", choices=("speed", "memory"), default="memory",
                   help="as the config's `optimize` (default memory, the config's default: "
                        "what `tfsmp run` runs): speed keeps activations for backward, memory "
                        "recomputes and plans the best compute split within --memory-per-rank")
    p.add_argument("--batch-size", type=int, default=None,
                   help="samples per step, for the activation and traffic columns (default 1)")
    p.add_argument("--memory-weight", type=float, default=None,
                   help="weight of memory in the --optimize memory blend (default 0.8)")
    p.add_argument("--method", choices=("auto", "metis", "contiguous"), default="auto",
                   help="planner (auto: run both, keep the better objective)")
    p.add_argument("--optimizer", default=None,
                   help="optimizer name for optimizer-state memory (default: adam)")
    p.add_argument("--memory-per-rank", metavar="SIZE",
                   help="each rank's memory, e.g. 2.5G: report whether the plan fits and, if not, "
                        "what would (with --optimize memory, plan within it)")
    p.add_argument("--microbatches", type=int, default=None,
                   help="microbatches per step, for the memory prediction (default 1)")
    from tfsmp.schedule.registry import names

    p.add_argument("--pipeline", choices=names(), default=None,
                   help="schedule, for the memory prediction (default interleaved)")
    p.add_argument("--input-shape", action="append", metavar="NAME=D1xD2",
                   help="per-sample shape of an input with unknown dimensions, e.g. "
                        "token_ids=1024 (repeatable); costs use it")
    p.add_argument("--baseline", metavar="SIZE",
                   help="a rank's memory before any model (imports, MPI), if not the 248 MiB "
                        "measured with TensorFlow 2.21 on CPU (keras_hub adds about 45 MiB)")
    p.add_argument("--no-measure", action="store_true",
                   help="do not run the layers once to measure what they keep for backward "
                        "(estimate it from their outputs)")
    p.add_argument("--out", action="append", metavar="PATH",
                   help="write the plan: .json (StagePlan.to_json), .png/.svg/.pdf (drawing); "
                        "repeatable")
    p.set_defaults(func=run)
