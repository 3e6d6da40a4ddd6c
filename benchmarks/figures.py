"""The figures the docs quote: named values computed from `results.json`, and counts from the code.

[Note: docs figures] A number in README.md or docs/*.md that reports a measurement or a count is
written with a marker naming its key, e.g. ``1.037<!--fig:overhead.ratio-->`` (an HTML comment:
invisible on the rendered page). Keys name

- a figure of a benchmark, computed by one of the functions below from that benchmark's stored
  result in `benchmarks/results.json` (written by ``python benchmarks/run.py``, or by
  ``python benchmarks/bench_multihost.py`` for the cross-host figures); run.py keeps them under
  ``"figures"`` in results.json;
- a count read from the code (``code.*``, e.g. the bad-input catalogue's size), by `code_counts`.

``python benchmarks/run.py --write-docs`` recomputes the figures from the stored results (nothing
is measured again) and rewrites every marked number from them, with the decimals the doc shows.
`tests/pure/test_docs_figures.py` fails when a marked number disagrees, a key is unknown, a
results table holds a number without a marker, or results.json's figures are stale. To quote a
new figure: return it from its benchmark's function here (or from `code_counts`), run
``--write-docs``, and put ``<!--fig:KEY-->`` after the number in the doc.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

__all__ = ["DOCS", "FIGURES", "all_figures", "check_text", "code_counts", "figures",
           "rewrite_text", "unmarked_in_tables"]

REPO = Path(__file__).resolve().parents[1]
DOCS = ("README.md", "docs/*.md")
MARKER = re.compile(r"(?P<num>-?\d+(?:\.\d+)?)<!--fig:(?P<key>[A-Za-z0-9_.\-]+)-->")
# A number that reads as a figure: not part of a word (1F1B, zb-h1, Dense(1024), p2p) and not a
# marker's key. [Note: docs figures]
_NUMBER = re.compile(r"(?<![\w.\-])\d+(?:\.\d+)?(?![\w.]|\))")
_CODE = re.compile(r"`[^`]*`")
_COMMENT = re.compile(r"<!--.*?-->")
_SETTING = re.compile(r"(?:=|×|≤|≥|<|>)\s*$")  # m = 8, Dense(1024)×8, ≤ 1.03: inputs, not results
Figures = dict[str, float]


def _median(x: dict[str, Any]) -> float:
    return float(x["median"])


def _overhead(r: dict[str, Any]) -> Figures:
    from benchmarks.bench_overhead import GOAL as OVERHEAD_GOAL

    row = r["rows"][0]
    return {"overhead.ratio": _median(row["overhead"]), "overhead.q1": row["overhead"]["q1"],
            "overhead.q3": row["overhead"]["q3"], "overhead.extra_ms": row["overhead_ms"],
            "overhead.keras_ms": 1000 * row["keras_step"],
            "overhead.missed_by": _median(row["overhead"]) - OVERHEAD_GOAL,
            "overhead.tracing_on": _median(row["tracing_on"]),
            "overhead.cpu": _median(row["overhead_cpu"])}


def _speedup(r: dict[str, Any]) -> Figures:
    from benchmarks.bench_speedup import GOAL, ZB_GOAL, zero_bubble_gains

    out: Figures = {"speedup.eta": _median(r["eta"])}
    for row in r["rows"]:
        key = f"speedup.{row['pipeline']}.m{row['m']}"
        out[f"{key}.speedup"] = _median(row["speedup"])
        out[f"{key}.of_ideal"] = row["fraction_of_ideal"]
        out[f"{key}.ideal"] = row["ideal"]
    for g in zero_bubble_gains(r):
        m = g["m"]
        key = f"speedup.zb.m{m}"
        out[f"{key}.gain"], out[f"{key}.q1"], out[f"{key}.q3"] = (
            g["gain"]["median"], g["gain"]["q1"], g["gain"]["q3"])
        out[f"{key}.ideal"] = (3 * m / (3 * m + 1)) / (m / (m + 1))
    out["speedup.missed_by"] = GOAL - out["speedup.interleaved.m8.of_ideal"]
    for m in (4, 8):
        if f"speedup.zb.m{m}.gain" in out:
            out[f"speedup.zb.m{m}.missed_by"] = ZB_GOAL - out[f"speedup.zb.m{m}.gain"]
    return out


def _memory(r: dict[str, Any]) -> Figures:
    out: Figures = {}
    for row in r["rows"]:
        p = row["p"]
        states = [(k["variables"] + k["optimizer"]) / row["per_rank_goal"] for k in row["ranks"]]
        out[f"memory.p{p}.state_ratio"] = max(states)
        out[f"memory.p{p}.peak_rss_mb"] = max(k["peak_rss"] for k in row["ranks"]) / 2**20
    return out


def _size(n: int) -> str:
    return f"{n // 2**20}MB" if n >= 2**20 else f"{n // 2**10}KB"


def _p2p(r: dict[str, Any], prefix: str = "p2p") -> Figures:
    from benchmarks.bench_p2p import GOAL as P2P_GOAL

    out: Figures = {f"{prefix}.missed_by": P2P_GOAL - min(row["ratio"]["median"] for row in r["rows"])}
    for row in r["rows"]:
        key = f"{prefix}.{_size(row['bytes'])}"
        out[f"{key}.ratio"], out[f"{key}.q1"], out[f"{key}.q3"] = (
            row["ratio"]["median"], row["ratio"]["q1"], row["ratio"]["q3"])
        out[f"{key}.tfsmp_gbps"], out[f"{key}.raw_gbps"] = row["tfsmp_gbps"], row["raw_gbps"]
        if "kept_ratio" in row:  # every received tensor held to the step's end
            out[f"{key}.kept_ratio"] = row["kept_ratio"]["median"]
        for name in ("floor_ratio", "of_floor"):  # [Note: the Python floor] in bench_p2p.py
            if name in row:
                out[f"{key}.{name}"] = row[name]["median"]
    return out


def _partition(r: dict[str, Any]) -> Figures:
    def span(plan: str) -> list[float]:
        return [q[plan]["max_over_mean"] for q in r["quality"]]

    return {"partition.tfsmp.min": min(span("tfsmp")), "partition.tfsmp.max": max(span("tfsmp")),
            "partition.equal.min": min(span("equal layers")),
            "partition.equal.max": max(span("equal layers"))}


def _bubble(r: dict[str, Any]) -> Figures:
    from benchmarks.bench_bubble import GOAL as BUBBLE_GOAL

    out: Figures = {"bubble.eta": _median(r["eta"])}
    for row in r["rows"]:
        key = f"bubble.{row['pipeline']}"
        for rank in (0, 1):
            out[f"{key}.measured.r{rank}"] = row["measured"][rank]
            out[f"{key}.predicted.r{rank}"] = row["predicted"][rank]
        out[f"{key}.gap_points"] = 100 * max(
            abs(a - b) for a, b in zip(row["measured"], row["predicted"]))
        for name, value in row["breakdown"].items():
            out[f"{key}.{name}"] = value
        out[f"{key}.microbatch_cost"] = row["microbatch_cost"]
        # speed-up / ideal with a free runtime: schedule and window ideal, only the microbatch
        # size inflating the work
        out[f"{key}.ceiling"] = 1 / row["microbatch_cost"]
        out[f"{key}.missed_by_points"] = out[f"{key}.gap_points"] - 100 * BUBBLE_GOAL
        for i, stage in enumerate(("s0", "s1")):
            out[f"{key}.forward_ms.{stage}"] = 1000 * row["forward"][i]
            out[f"{key}.backward_ms.{stage}"] = 1000 * row["backward"][i]
            out[f"{key}.weight_ms.{stage}"] = 1000 * row["weight"][i]
    return out


def _reduction(r: dict[str, Any]) -> Figures:
    out: Figures = {}
    for row in r["rows"]:
        out[f"reduction.{row['model']}.horovod_over_mpi"] = row["horovod_over_mpi"]["median"]
        out[f"reduction.{row['model']}.mpi_over_raw"] = row["mpi_over_raw"]["median"]
    return out


def _memory_model(r: dict[str, Any]) -> Figures:
    """Worst |predicted / measured - 1| in percent: per (model, pipeline) over its unsharded
    rows, per row (``.mM``, ``.sharded``), per (pipeline, m, sharding) over the models, per
    model and sharding (``.unsharded``, ``.sharded``), and over everything
    (``memory_model.worst_pct``); speed-mode rows apart (``memory_model.speed.*``)."""
    out: Figures = {}

    def worst(key: str, value: float) -> None:
        out[key] = max(out.get(key, 0.0), value)

    for row in r["rows"]:
        pct = 100 * max(abs(x - 1.0) for x in row["ratios"])
        if row.get("optimize", "memory") == "speed":  # its own figures ([Note: speed rows])
            worst(f"memory_model.speed.{row['model']}.worst_pct", pct)
            worst("memory_model.speed.worst_pct", pct)
            continue
        tail = ".sharded" if row.get("sharded") else ""
        if not tail:
            worst(f"memory_model.{row['model']}.{row['pipeline']}.worst_pct", pct)
        if "m" in row:
            worst(f"memory_model.{row['model']}.{row['pipeline']}.m{row['m']}{tail}.worst_pct",
                  pct)
            worst(f"memory_model.{row['pipeline']}.m{row['m']}{tail}.worst_pct", pct)
        if tail:
            worst("memory_model.sharded.worst_pct", pct)
        worst(f"memory_model.{row['model']}{tail or '.unsharded'}.worst_pct", pct)
        worst(f"memory_model.{row['model']}.worst_pct", pct)
        worst("memory_model.worst_pct", pct)
    if "memory_model.worst_pct" in out:  # the goal is within 10 % on every rank
        out["memory_model.missed_by_pct"] = max(out["memory_model.worst_pct"] - 10.0, 0.0)
    if "memory_model.speed.worst_pct" in out:
        out["memory_model.speed.missed_by_pct"] = max(out["memory_model.speed.worst_pct"] - 10.0,
                                                      0.0)
    return out


def _memory_cap(r: dict[str, Any]) -> Figures:
    out: Figures = {}
    for m in r["rows"]:
        out[f"memory_cap.{m['model']}.plain"] = m["plain"]
        out[f"memory_cap.{m['model']}.cap_gib"] = m["cap"] / 2**30
        for row in m["rows"]:
            if "largest" not in row:  # skipped (not enough free memory)
                continue
            d = f"d{row['d']}" if row.get("d", 1) > 1 else ""  # sharded: p4d2
            out[f"memory_cap.{m['model']}.p{row['p']}{d}.largest"] = row["largest"]
            out[f"memory_cap.{m['model']}.p{row['p']}{d}.ratio"] = row["ratio"]
    ck = r.get("checkpoint")
    if ck:
        out["memory_cap.checkpoint.depth"] = ck["depth"]
        out["memory_cap.checkpoint.p"] = ck["p"]
        for phase in ("train", "save", "export"):
            out[f"memory_cap.checkpoint.{phase}_anon_mib"] = max(
                k[f"anon_{phase}"] for k in ck["save"]["peaks"]) / 2**20
        out["memory_cap.checkpoint.restore_anon_mib"] = max(ck["restore"]["anon"]) / 2**20
        out["memory_cap.checkpoint.cap_mib"] = ck["cap"] / 2**20
    return out


# benchmark name in results.json -> its figures
def _bytes_per_param(r: dict[str, Any]) -> Figures:
    from benchmarks.bench_bytes_per_param import per_param

    base = r["baseline"]
    out: Figures = {}
    worst = 0.0
    for row in r["rows"]:
        key = f"bytes_per_param.{row['optimizer']}.m{row['m']}"
        plain = per_param(row["plain"], base)
        mine = [per_param(x, base) for x in row["ranks"]]
        out[f"{key}.plain"] = plain
        for rank, b in enumerate(mine):
            out[f"{key}.rank{rank}"] = b
        out[f"{key}.ratio"] = max(mine) / plain
        worst = max(worst, max(mine) / plain)
    out["bytes_per_param.worst_ratio"] = worst
    return out


def _torch(r: dict[str, Any]) -> Figures:
    from benchmarks.bench_torch import GOAL as TORCH_GOAL
    from benchmarks.bench_torch import analyse

    if "skipped" in r:
        return {}
    a = analyse(r)
    out: Figures = {"torch.best.vs_best": a["best"]["vs_best"]["median"],
                    "torch.best.q1": a["best"]["vs_best"]["q1"],
                    "torch.best.q3": a["best"]["vs_best"]["q3"],
                    "torch.f1b.vs_1f1b": a["f1b"]["vs_1f1b"]["median"],
                    "torch.f1b.q1": a["f1b"]["vs_1f1b"]["q1"],
                    "torch.f1b.q3": a["f1b"]["vs_1f1b"]["q3"]}
    out["torch.best.missed_by"] = TORCH_GOAL - out["torch.best.vs_best"]
    out["torch.f1b.missed_by"] = TORCH_GOAL - out["torch.f1b.vs_1f1b"]
    for row in a["rows"]:
        key = "torch.tfsmp." + row["tfsmp"].replace(" ", "_").replace("=", "")
        out[f"{key}.vs_1f1b"] = row["vs_1f1b"]["median"]
        out[f"{key}.vs_best"] = row["vs_best"]["median"]
        out[f"{key}.of_ideal"] = row["of_ideal"]
        out[f"{key}.step"] = row["step"]
    for row in a["torch_rows"]:
        out[f"torch.torch.{row['torch']}.of_ideal"] = row["of_ideal"]
        out[f"torch.torch.{row['torch']}.step"] = row["step"]
    for row in a["rows"]:  # the taped backward's step over the compiled one's, same rounds
        if row["compiled_gain"]["n"]:
            key = "torch.compiled_gain." + row["tfsmp"]
            out[key] = row["compiled_gain"]["median"]
            out[key + ".q1"], out[key + ".q3"] = row["compiled_gain"]["q1"], row["compiled_gain"]["q3"]
    return out


FIGURES: dict[str, Callable[[dict[str, Any]], Figures]] = {
    "overhead": _overhead, "speedup": _speedup, "memory": _memory, "p2p": _p2p,
    "partition": _partition, "bubble": _bubble, "reduction": _reduction,
    "multihost": lambda r: _p2p(r, "multihost"), "memory_model": _memory_model,
    "memory_cap": _memory_cap, "bytes_per_param": _bytes_per_param, "torch": _torch,
}


def figures(results: dict[str, Any]) -> Figures:
    """Every benchmark figure computable from `results` (a results.json document)."""
    out: Figures = {}
    for name, entry in results.get("benchmarks", {}).items():
        if name in FIGURES and "result" in entry:
            out.update(FIGURES[name](entry["result"]))
    return out


# -- counts from the code --------------------------------------------------------------------------

# Comment lines that open a section of a catalogue dict, by how they start (others are notes).
SECTIONS = {"configuration": "config", "the estimator": "estimator", "schedules": "schedules",
            "data": "data", "model": "boundary", "checkpoints": "checkpoints",
            "a replica runs out": "data"}


def _dict_sections(path: Path, name: str) -> dict[str, int]:
    """Keys per section of the dict literal `name` in `path` ("all" before any section)."""
    source = path.read_text()
    for node in ast.parse(source).body:
        target = node.targets[0] if isinstance(node, ast.Assign) else getattr(node, "target", None)
        value = getattr(node, "value", None)
        if isinstance(target, ast.Name) and target.id == name and isinstance(value, ast.Dict):
            lines = source.splitlines()
            key_lines = {k.lineno for k in value.keys if k is not None}
            counts: dict[str, int] = {}
            section = "all"
            for lineno in range(node.lineno, (node.end_lineno or node.lineno) + 1):
                text = lines[lineno - 1].strip().lstrip("#- ").lower()
                if lines[lineno - 1].strip().startswith("#"):
                    section = next((v for k, v in SECTIONS.items() if text.startswith(k)), section)
                if lineno in key_lines:
                    counts[section] = counts.get(section, 0) + 1
            return counts
    raise ValueError(f"{path} must define a dict literal {name}. Received: none found.")


def code_counts(repo: Path = REPO) -> Figures:
    """Counts the docs quote, read from the code (without importing TensorFlow)."""
    pure = _dict_sections(repo / "tests/pure/test_bad_input_catalogue.py", "CATALOGUE")
    model = _dict_sections(repo / "tests/tf/test_bad_input_model.py", "CATALOGUE")
    mpi = _dict_sections(repo / "tests/mpi/test_bad_input.py", "EXPECTED")
    out: Figures = {f"code.bad_input.{k}": float(v) for k, v in {**pure, **mpi}.items()}
    out["code.bad_input.model"] = float(sum(model.values()))
    out["code.bad_input.total"] = float(sum(pure.values()) + sum(model.values())
                                        + sum(mpi.values()))
    out["code.setup_grace"] = _constant(repo / "tfsmp/failure.py", "SETUP_GRACE")
    return out


def _constant(path: Path, name: str) -> float:
    """The value of the module-level number `name` in `path`."""
    for node in ast.parse(path.read_text()).body:
        target = node.targets[0] if isinstance(node, ast.Assign) else getattr(node, "target", None)
        value = getattr(node, "value", None)
        if isinstance(target, ast.Name) and target.id == name and isinstance(value, ast.Constant):
            return float(value.value)
    raise ValueError(f"{path} must set {name} to a number. Received: no such assignment.")


def all_figures(results: dict[str, Any], repo: Path = REPO) -> Figures:
    """The benchmark figures of `results` and the code counts: every key a marker may name."""
    return {**figures(results), **code_counts(repo)}


# -- the docs --------------------------------------------------------------------------------------

def doc_paths(repo: Path = REPO) -> list[Path]:
    return sorted(p for pattern in DOCS for p in repo.glob(pattern))


def _shown(value: float, like: str) -> str:
    """`value` with as many decimals as `like` (the number as the doc writes it) has."""
    decimals = len(like.split(".", 1)[1]) if "." in like else 0
    return f"{value:.{decimals}f}"


def check_text(text: str, values: Figures, where: str = "") -> list[str]:
    """Problems with the marked figures of `text`: unknown keys and numbers that disagree."""
    problems = []
    for m in MARKER.finditer(text):
        line = text.count("\n", 0, m.start()) + 1
        key, num = m["key"], m["num"]
        if key not in values:
            problems.append(f"{where}:{line}: unknown figure key {key!r}")
        elif _shown(values[key], num) != num:
            problems.append(f"{where}:{line}: {key} is {_shown(values[key], num)} in "
                            f"benchmarks/results.json (or the code), the doc says {num}")
    return problems


def rewrite_text(text: str, values: Figures) -> str:
    """`text` with every marked number replaced by its figure (unknown keys are left alone)."""
    def one(m: re.Match[str]) -> str:
        key = m["key"]
        num = _shown(values[key], m["num"]) if key in values else m["num"]
        return f"{num}<!--fig:{key}-->"

    return MARKER.sub(one, text)


def _tables(lines: list[str]) -> Iterable[tuple[int, list[list[str]]]]:
    """(first line number, rows of cells) of each Markdown table."""
    rows: list[list[str]] = []
    start = 0
    for i, line in enumerate([*lines, ""], start=1):
        if line.startswith("|"):
            if not rows:
                start = i
            rows.append(re.split(r"(?<!\\)\|", line.strip().strip("|")))
        elif rows:
            yield start, rows
            rows = []


def unmarked_in_tables(text: str, where: str = "") -> list[str]:
    """Numbers without a marker in a results column: a column of a table where a cell has a
    marker. Numbers inside `code`, or right after =, ×, ≤, ≥, < or > (settings and goals), are
    not results."""
    problems = []
    for start, rows in _tables(text.splitlines()):
        body = rows[2:]  # header, rule
        marked = {j for row in body for j, cell in enumerate(row) if "<!--fig:" in cell}
        for i, row in enumerate(body):
            for j in sorted(marked):
                if j >= len(row):
                    continue
                cell = _COMMENT.sub(" ", MARKER.sub(" ", _CODE.sub(" ", row[j])))
                for m in _NUMBER.finditer(cell):
                    if _SETTING.search(cell[:m.start()]):
                        continue
                    problems.append(f"{where}:{start + 2 + i}: {m.group()!r} in column "
                                    f"{rows[0][j].strip()!r} has no <!--fig:KEY--> marker")
    return problems
