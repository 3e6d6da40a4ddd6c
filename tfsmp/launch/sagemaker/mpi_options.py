"""`mpi.custom_mpi_options`: the toolkit's parsing, and merging them with the built-in mpirun flags."""

from __future__ import annotations

import shlex
from collections.abc import Sequence

__all__ = ["merge_mpi_options"]


# (kind, name) identifies one setting: the same MCA parameter or -x variable given twice is one
# setting, and the later one wins. The duplicate-MCA failure of Open MPI 4 cannot happen.
_Key = tuple[str, str]
_MCA_FLAGS = ("-mca", "--mca", "-prtemca", "--prtemca", "-pmixmca", "--pmixmca", "-gmca", "--gmca")
_ONE_VALUE = {"-bind-to": "bind-to", "--bind-to": "bind-to", "-map-by": "map-by",
              "--map-by": "map-by"}


def _mca_name(name: str) -> str:
    # Open MPI 5 renamed btl vader to btl sm and keeps btl_vader_* as synonyms.
    return "btl_sm_" + name[len("btl_vader_"):] if name.startswith("btl_vader_") else name


def option_groups(tokens: Sequence[str]) -> list[tuple[_Key | None, list[str]]]:
    """Splits mpirun flags into settings: (key or None for an opaque token, its tokens)."""
    out: list[tuple[_Key | None, list[str]]] = []
    i = 0
    while i < len(tokens):
        tok = tokens[i]
        if tok in _MCA_FLAGS and i + 2 < len(tokens):
            out.append((("mca", _mca_name(tokens[i + 1])), list(tokens[i:i + 3])))
            i += 3
        elif tok in ("-x", "--x") and i + 1 < len(tokens):
            out.append((("x", tokens[i + 1].split("=", 1)[0]), list(tokens[i:i + 2])))
            i += 2
        elif tok in _ONE_VALUE and i + 1 < len(tokens):
            # Open MPI 5 reads the toolkit's single-dash `-bind-to` as other flags: respell it.
            out.append((("opt", _ONE_VALUE[tok]), [f"--{_ONE_VALUE[tok]}", tokens[i + 1]]))
            i += 2
        else:
            out.append((None, [tok]))
            i += 1
    return out


def merge_mpi_options(builtin: Sequence[str], custom: Sequence[str]) -> list[str]:
    """Built-in flags, then custom ones; a setting given twice appears once, with the later value.

    A setting is an MCA parameter (`--mca`/`--prtemca`/..., `btl_vader_*` counted as the
    `btl_sm_*` it is in Open MPI 5), an `-x` variable, `--bind-to` or `--map-by`. Other tokens are
    kept verbatim. So a custom `--mca btl_vader_single_copy_mechanism none` (which the AWS page
    once advised) cannot produce Open MPI 4's "listed multiple times" failure, and a custom
    `-x NCCL_DEBUG=WARN` replaces the built-in one (Open MPI keeps the first `-x` of a name).
    """
    groups = [*option_groups(builtin), *option_groups(custom)]
    last = {key: i for i, (key, _) in enumerate(groups) if key is not None}
    merged: list[str] = []
    for i, (key, toks) in enumerate(groups):
        if key is None or last[key] == i:
            merged += toks
    return merged


def parse_custom_options(custom: str) -> tuple[str, list[str]]:
    """The toolkit's `_parse_custom_mpi_options`: --NCCL_DEBUG replaces its default, rest verbatim."""
    tokens = shlex.split(custom)
    nccl_debug, rest, i = "INFO", [], 0
    while i < len(tokens):
        if tokens[i] == "--NCCL_DEBUG" and i + 1 < len(tokens):
            nccl_debug, i = tokens[i + 1], i + 2
        elif tokens[i].startswith("--NCCL_DEBUG="):
            nccl_debug, i = tokens[i].split("=", 1)[1], i + 1
        else:
            rest.append(tokens[i])
            i += 1
    return nccl_debug, rest
