"""The judge's verdicts: each test plain and wrapped, per-file counts, failure classes, tables.

A test's wrapped verdict ([Note: verdicts]):

- ``passed`` / ``failed`` / ``skipped``: every model it compiled was a `DistributedModel` and the
  test reached it (a trainer call, weights, saving or metrics went through it); ``passed`` only
  if it passed on both ranks; ``failed`` if it failed on either (or a rank died in it);
- ``not wrapped``: it compiled a model that could not be wrapped (a model the tracer cannot
  split into two stages, a Trainer mixed into a layer), or never reached its `DistributedModel`;
  its reason is listed, and it never counts as passing wrapped;
- ``no model``: it compiles no model in plain Keras, so the wrapped run does not launch it;
- ``not run``: it does not pass in plain Keras (nothing to compare with), so the wrapped run does
  not launch it (or a run cut short did not reach it).
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Mapping
from typing import Any

from tests.mpi.keras_judge.runner import Outcome, RunResult

__all__ = ["CLASSES", "classify", "markdown", "summarize", "verdicts"]

# (class, pattern over "file :: reason"), first match wins; the file's area is the fallback.
CLASSES: tuple[tuple[str, str], ...] = (
    ("tracer refusal", r"TraceError|PartitionError"),
    ("refused override", r"cannot run a model's own"),
    ("rank died or hung", r"died or hung|did not finish|ended .* differently|Timeout"),
    # a rank reads a variable another stage owns (Keras code walking model.weights)
    ("weights released on other ranks", r"storage was released"),
    ("callbacks not called", r"Non-finite values"),  # raises where TerminateOnNaN would stop
    ("data", r"same batch|shuffle|PyDataset|generator|Dataset|steps_per_epoch|batch_size"),
    ("saving", r"save|load|\.keras|\.h5|[Cc]heckpoint|compile\(\)|serializ"),
    ("metrics", r"metric|get_metrics_result|compiled_metrics|0-dimensional arrays"),
    ("optimizer", r"optimizer|iterations|learning_rate|\bema\b|EMA|gradient"),
    ("callbacks not called", r"callback|on_(train|test|predict|epoch|batch)_|History|call_count"),
)
AREAS = (("callbacks/", "callbacks not called"), ("saving/", "saving"),
         ("optimizers/", "optimizer"))


def classify(test_id: str, reason: str) -> str:
    """The failure class of a failing wrapped test (the issue's kinds, roughly)."""
    text = f"{test_id} :: {reason}"
    for name, pattern in CLASSES:
        if re.search(pattern, reason if name != "data" else text):
            return name
    for prefix, name in AREAS:
        if test_id.startswith(prefix):
            return name
    return "other"


def _merged(per_rank: Mapping[int, Outcome]) -> Outcome:
    """One outcome over ranks: failed if any failed (that rank's reason), passed if all did."""
    outcomes = [per_rank[r] for r in sorted(per_rank)]
    failed = [(r, o) for r, o in sorted(per_rank.items()) if o.outcome == "failed"]
    props = next((o.props for o in outcomes if o.props), {})
    seconds = max((o.seconds for o in outcomes), default=0.0)
    if failed:
        real = [(r, o) for r, o in failed if "died or hung" not in o.reason] or failed
        rank, first = real[0]
        return Outcome("failed", f"[rank {rank}] {first.reason}", seconds, props)
    if all(o.outcome == "skipped" for o in outcomes):
        return Outcome("skipped", outcomes[0].reason, seconds, props)
    return Outcome("passed", "", seconds, props)


def _not_wrapped_reason(props: Mapping[str, Any]) -> str | None:
    judge = props.get("judge") or {}
    if judge.get("not_wrapped"):
        return str(judge["not_wrapped"][0])
    if not judge.get("wrapped"):
        return "compiles no keras.Model"
    if not judge.get("used"):
        return "compiles a model but never trains, evaluates, saves or reads it"
    return None


def verdicts(plain: RunResult, wrapped: RunResult) -> dict[str, dict[str, Any]]:
    """[Note: verdicts] Every test's plain outcome and wrapped verdict, with reasons."""
    out: dict[str, dict[str, Any]] = {}
    for test_id in sorted(plain.tests):
        p = plain.tests[test_id][0]
        rec: dict[str, Any] = {"plain": p.outcome, "plain_reason": p.reason,
                               "plain_seconds": round(p.seconds, 2)}
        if not (p.props.get("judge") or {}).get("compiled"):
            rec.update(wrapped="no model", reason="compiles no model in plain Keras")
        elif test_id not in wrapped.tests:
            why = ("fails or skips in plain Keras, so not run wrapped" if p.outcome != "passed"
                   else "not reached: the wrapped run was cut short")
            rec.update(wrapped="not run", reason=why)
        else:
            w = _merged(wrapped.tests[test_id])
            rec["wrapped_seconds"] = round(w.seconds, 2)
            why = _not_wrapped_reason(w.props) if w.props else None
            if why is not None:
                rec.update(wrapped="not wrapped", reason=why)
            else:
                rec.update(wrapped=w.outcome, reason=w.reason)
                if w.outcome == "failed":
                    rec["class"] = classify(test_id, w.reason)
        out[test_id] = rec
    return out


def summarize(tests: Mapping[str, Mapping[str, Any]],
              collect_errors: Mapping[str, str]) -> dict[str, dict[str, Any]]:
    """Per-file counts: tests, pass plain, pass/fail wrapped, not wrapped, skipped, no model."""
    files: dict[str, dict[str, Any]] = {}
    for test_id, rec in tests.items():
        row = files.setdefault(test_id.split("::")[0], Counter())
        row["tests"] += 1
        row["pass plain"] += rec["plain"] == "passed"
        row["skipped plain"] += rec["plain"] == "skipped"
        verdict = rec["wrapped"]
        row["pass wrapped"] += verdict == "passed"
        row["fail wrapped"] += verdict == "failed"
        row["not wrapped"] += verdict == "not wrapped"
        row["no model"] += verdict == "no model"
        row["not run"] += verdict == "not run"
        row["regressions"] += rec["plain"] == "passed" and verdict == "failed"
    result = {name: dict(row) for name, row in sorted(files.items())}
    for name, why in collect_errors.items():
        result.setdefault(name, {})["collect error"] = why
    return result


COLUMNS = ("tests", "pass plain", "pass wrapped", "fail wrapped", "not wrapped", "no model",
           "not run", "regressions")


def markdown(data: Mapping[str, Any]) -> str:
    """The report as Markdown: how it was made, the per-file table, classes, failing tests."""
    files, tests = data["files"], data["tests"]
    lines = [
        "# Keras's own tests, run against `DistributedModel`",
        "",
        "Generated by `python -m tests.mpi.keras_judge` (tests/mpi/keras_judge/; do not edit by "
        "hand). Each file of Keras's shipped tests runs twice: plainly, in one process, and on "
        f"2 ranks with every compiled `keras.Model` wrapped in `tfsmp.DistributedModel` "
        f"(config `{data['config']}`; the test bodies unchanged, "
        "tests/mpi/keras_judge/shim.py says how). Keras "
        f"{data['keras']}, TensorFlow {data['tensorflow']}, tfsmp at `{data['commit']}`, "
        f"{data['date']}; plain run {data['seconds']['plain']:.0f} s, wrapped run "
        f"{data['seconds']['wrapped']:.0f} s ({data['launches']} launches) on this 2-core machine.",
        "",
        f"Command: `{data['command']}`.",
        "",
        "Columns: *pass wrapped* passed on both ranks with every compiled model wrapped; *fail "
        "wrapped* failed on a rank (or a rank died in it); *not wrapped* compiled a model that "
        "could not be wrapped, or never reached it (reasons below; never counted as passing); "
        "*no model* compile no model at all; *not run* do not pass plain (or were not reached); "
        "neither of the last two is launched wrapped; *regressions* pass plain and fail "
        "wrapped.",
        "",
        "| file | " + " | ".join(COLUMNS) + " |",
        "| --- |" + " ---: |" * len(COLUMNS),
    ]
    total: Counter[str] = Counter()
    for name, row in files.items():
        if "collect error" in row:
            lines.append(f"| {name} | collection error: {row['collect error'][:120]} |"
                         + " |" * (len(COLUMNS) - 1))
            continue
        total.update({c: row.get(c, 0) for c in COLUMNS})
        lines.append(f"| {name} | " + " | ".join(str(row.get(c, 0)) for c in COLUMNS) + " |")
    lines.append("| **total** | " + " | ".join(f"**{total[c]}**" for c in COLUMNS) + " |")
    failing = {k: v for k, v in tests.items() if v["wrapped"] == "failed"}
    classes = Counter(v["class"] for v in failing.values())
    lines += ["", "## Failure classes (wrapped failures)", "",
              "| class | tests | of which pass plain |", "| --- | ---: | ---: |"]
    for name, count in classes.most_common():
        plain_ok = sum(1 for v in failing.values() if v["class"] == name and v["plain"] == "passed")
        lines.append(f"| {name} | {count} | {plain_ok} |")
    lines += ["", "## Failing wrapped", ""]
    for test_id, rec in failing.items():
        mark = "" if rec["plain"] == "passed" else f" (plain: {rec['plain']})"
        lines.append(f"- `{test_id}`{mark} — {rec['class']}: {_short(rec['reason'])}")
    not_wrapped = Counter(v["reason"] for v in tests.values() if v["wrapped"] == "not wrapped")
    lines += ["", "## Not wrapped (reasons)", "", "| reason | tests |", "| --- | ---: |"]
    for why, count in not_wrapped.most_common():
        lines.append(f"| {_short(why, 160)} | {count} |")
    return "\n".join(lines) + "\n"


def _short(text: str, limit: int = 240) -> str:
    line = " ".join(str(text).split()).replace("|", "\\|")
    return line if len(line) <= limit else line[:limit - 3] + "..."
