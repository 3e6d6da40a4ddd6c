#!/usr/bin/env bash
# Installs tfsmp with its test extras, then Horovod (patched build; skipped when already built).
# Usage: bash scripts/setup.sh            (from the repository root)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
"$PY" -m pip install --quiet --disable-pip-version-check -e ".[test,viz]"
# keras-hub builds GPT-2/BERT from configs in the tests. Its requirement of tensorflow-text would
# install the full `tensorflow` wheel beside tensorflow-cpu (one package directory, two owners);
# tensorflow-text only serves its tokenizers, which the tests do not use. So: keras-hub without
# its dependencies, which the `test` extra lists instead (all but tensorflow-text).
"$PY" -m pip install --quiet --disable-pip-version-check --no-deps "keras-hub==0.32.*"
# Horovod 0.28.1 does not build against TF >= 2.16 as shipped; `tfsmp install-horovod` patches
# and builds it (about 6 minutes on 2 cores) and does nothing when a working build is present.
if [ "${TFSMP_SKIP_HOROVOD:-0}" != "1" ]; then
    "$PY" -m tfsmp install-horovod
fi
# pyenv keeps shims for console scripts; make newly installed ones (tfsmp, horovodrun) visible.
if command -v pyenv >/dev/null 2>&1; then pyenv rehash || true; fi
