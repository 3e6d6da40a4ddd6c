#!/usr/bin/env bash
# Installs tfsmp. Usage (from anywhere; paths are relative to this repository):
#
#   bash scripts/setup.sh           # the main job: tfsmp and what it runs on (TensorFlow, Keras,
#                                   # mpi4py, the Open MPI wheel, pymetis, NumPy); about a minute
#   bash scripts/setup.sh --test    # the tests too: test and viz extras, keras-hub, and Horovod,
#                                   # patched and built by `tfsmp install-horovod` (~6-9 min on
#                                   # 2 cores; skipped when a working build is present, or with
#                                   # TFSMP_SKIP_HOROVOD=1; a new environment installs the wheel
#                                   # an earlier build kept in ~/.cache/tfsmp/horovod-wheels)
#
# Horovod only serves `horovod: True` (data-parallel reduction through Horovod); without it tfsmp
# reduces over MPI, and `horovod: True` without a build says to run `tfsmp install-horovod`.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
PIP=("$PY" -m pip install --quiet --disable-pip-version-check)
case "${1:-}" in
    "") TEST=0 ;;
    --test) TEST=1 ;;
    *) echo "scripts/setup.sh: the argument must be nothing (main job) or --test (the tests). Received: $1" >&2
       exit 2 ;;
esac
if [ "$TEST" = 0 ]; then
    "${PIP[@]}" -e .
else
    "${PIP[@]}" -e ".[test,viz]"
    # keras-hub builds GPT-2/BERT from configs in the tests. Its requirement of tensorflow-text
    # would install the full `tensorflow` wheel beside tensorflow-cpu (one package directory, two
    # owners); tensorflow-text only serves its tokenizers, which the tests do not use. So:
    # keras-hub without its dependencies, which the `test` extra lists instead (all but
    # tensorflow-text).
    "${PIP[@]}" --no-deps "keras-hub==0.32.*"
    # Horovod 0.28.1 does not build against TF >= 2.16 as shipped; `tfsmp install-horovod`
    # patches and builds it and does nothing when a working build is present.
    if [ "${TFSMP_SKIP_HOROVOD:-0}" != "1" ]; then
        "$PY" -m tfsmp install-horovod
    fi
fi
# pyenv keeps shims for console scripts; make newly installed ones (tfsmp, horovodrun) visible.
if command -v pyenv >/dev/null 2>&1; then pyenv rehash || true; fi
