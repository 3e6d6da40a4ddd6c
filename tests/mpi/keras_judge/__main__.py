"""``python -m tests.mpi.keras_judge``: Keras's shipped tests, plain and wrapped in tfsmp.

Examples::

    python -m tests.mpi.keras_judge                                  # every default file
    python -m tests.mpi.keras_judge --files callbacks/*_test.py -k early_stopping
    python -m tests.mpi.keras_judge --files saving/saving_api_test.py --json /tmp/s.json --md -

Prints the table. A run of every default file at the default settings also writes
docs/keras_tests.json and docs/keras_tests.md; any narrower run (``--files``, ``-k``,
``--partitions``, ``--reverse``) writes them into ``--workdir`` instead, if one is given, so that
a partial run does not replace the committed report of the whole set (``--json``/``--md`` name
a file, or ``-`` for nowhere).
"""

from __future__ import annotations

import argparse
import datetime
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from tests.mpi.keras_judge import report, runner
from tests.mpihelp import REPO_ROOT


def _versions() -> dict[str, str]:
    from importlib.metadata import version

    return {"keras": version("keras"), "tensorflow": version("tensorflow-cpu")}


def _commit() -> str:
    proc = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO_ROOT,
                          capture_output=True, text=True)
    return proc.stdout.strip() or "unknown"


def _merge(results: list[runner.RunResult]) -> runner.RunResult:
    merged = runner.RunResult()
    for r in results:
        merged.tests.update(r.tests)
        merged.collect_errors.update(r.collect_errors)
        merged.launches.extend(r.launches)
        merged.seconds += r.seconds
    return merged


def judge(groups: list[list[str]], keyword: str | None, workdir: Path, log: Any = print,
          reuse: bool = False) -> dict[str, Any]:
    """Runs each group of files plainly, then its tests that compile a model wrapped (group by
    group, so that a run cut short reports every group it reached); the report's data.
    ``reuse``: launch nothing, read what a run left in ``workdir``."""
    plains, wrappeds = [], []
    for i, files in enumerate(groups):
        where = workdir / f"group{i}"
        if reuse:
            if where.exists():
                plains.append(runner.load(where / "plain", 1))
                wrappeds.append(runner.load(where / "wrapped", 2))
            continue
        log(f"[{i + 1}/{len(groups)}] plain Keras, 1 process: {' '.join(files)}")
        plain = runner.run_plain(files, where / "plain", keyword, log=log)
        judged = {t for t, per in plain.tests.items() if per[0].outcome == "passed"
                  and (per[0].props.get("judge") or {}).get("compiled")}
        log(f"[{i + 1}/{len(groups)}] wrapped, 2 ranks: {len(judged)} of {len(plain.tests)} "
            f"tests compile a model and pass plain")
        plains.append(plain)
        wrappeds.append(runner.run_wrapped(files, where / "wrapped", judged, keyword, log=log))
    plain, wrapped = _merge(plains), _merge(wrappeds)
    tests = report.verdicts(plain, wrapped)
    return {
        **_versions(),
        "config": runner.CONFIG,
        "commit": _commit(),
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "command": " ".join(["python -m tests.mpi.keras_judge", *sys.argv[1:]]),
        "seconds": {"plain": round(plain.seconds, 1), "wrapped": round(wrapped.seconds, 1)},
        "launches": len(wrapped.launches),
        "launch_log": {"plain": plain.launches, "wrapped": wrapped.launches},
        "files": report.summarize(tests, {**plain.collect_errors, **wrapped.collect_errors}),
        "tests": tests,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.mpi.keras_judge",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--files", nargs="+", default=list(runner.DEFAULT_FILES),
                        help="test files or globs under keras/src, each a group run plain "
                             "then wrapped (default: %(default)s)")
    parser.add_argument("-k", dest="keyword", default=None, help="pytest -k expression")
    parser.add_argument("--json", default=None,
                        help="where to write the data ('-': nowhere; default: see above)")
    parser.add_argument("--md", default=None,
                        help="where to write the Markdown report ('-': nowhere; default: see "
                             "above)")
    parser.add_argument("--workdir", default=None, help="keep the per-rank records here")
    parser.add_argument("--reverse", action="store_true",
                        help="run each file's tests last to first: a second run started beside "
                             "a long one meets it halfway (--report-only then merges both)")
    parser.add_argument("--partitions", type=int, default=runner.DEFAULT_PARTITIONS,
                        help="pipeline stages per model (default: %(default)s); 1 runs every "
                             "model, one-layer ones included, as 2 data-parallel replicas")
    parser.add_argument("--report-only", action="store_true",
                        help="launch nothing: report what a run left in --workdir")
    args = parser.parse_args(argv)
    partial = _partial(args)
    groups = [runner.resolve_files([pattern]) for pattern in args.files]
    runner.REVERSE["on"] = args.reverse
    runner.CONFIG["partitions"] = args.partitions
    start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="tfsmp-keras-judge-") as tmp:
        workdir = Path(args.workdir) if args.workdir else Path(tmp)
        data = judge(groups, args.keyword, workdir, reuse=args.report_only)
    text = report.markdown(data)
    json_path, md_path = _outputs(args, partial)
    if json_path is not None:
        Path(json_path).write_text(json.dumps(data, indent=1, sort_keys=False) + "\n")
    if md_path is not None:
        Path(md_path).write_text(text)
    print(text)
    print(f"report written to: {', '.join(str(p) for p in (json_path, md_path) if p) or 'nowhere'}")
    print(f"total {time.monotonic() - start:.0f} s")
    return 0


def _partial(args: argparse.Namespace) -> bool:
    """Whether the run judges less than, or other than, the whole default set."""
    return (args.files != list(runner.DEFAULT_FILES) or args.keyword is not None
            or args.reverse or args.partitions != runner.DEFAULT_PARTITIONS)


def _outputs(args: argparse.Namespace, partial: bool) -> tuple[str | None, str | None]:
    """Where the data and the Markdown report go: what ``--json``/``--md`` name (``-``: nowhere);
    by default the committed docs for a run of the whole default set, the workdir (or nowhere)
    for a partial one."""
    docs = REPO_ROOT / "docs"
    out = []
    for given, name in ((args.json, "keras_tests.json"), (args.md, "keras_tests.md")):
        if given == "-":
            out.append(None)
        elif given is not None:
            out.append(given)
        elif not partial:
            out.append(str(docs / name))
        else:
            out.append(str(Path(args.workdir) / name) if args.workdir else None)
    return out[0], out[1]


if __name__ == "__main__":
    sys.exit(main())
