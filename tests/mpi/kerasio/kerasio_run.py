"""Runs a verbatim keras-io example (this folder) on every rank, with synthetic data; reports.

    mpirun -np 2 python -m mpi4py kerasio_run.py NAME[=MODES] [NAME[=MODES] ...]
        [--modes own,plain,parity,unseeded]

Several examples run one after another in one launch (each TF process costs seconds to start);
``NAME=own,plain`` gives that example its own modes, else ``--modes`` applies.

The example's text is not edited beyond its `tfsmp.DistributedModel(...)` wrap: this harness
provides what the test machine lacks, before the script runs. Downloads become small synthetic
data of the same shapes and dtypes (`keras.datasets.*.load_data`, `np.loadtxt` of a URL),
`keras.utils.plot_model` (no pydot) and `sklearn.metrics` (no scikit-learn) are stubbed, and
`keras.config.set_max_epochs` / `set_max_steps_per_epoch` (Keras's own debugging caps, which
`DistributedModel.fit` honours like `keras.Model.fit`) keep runs short. Python, NumPy and TF are
seeded alike on every rank, as a launcher exporting one seed would be.

Modes (each a fresh run of the whole script):
- ``own``: the example's own flow (its shuffles) under tfsmp;
- ``plain`` (rank 0 only): the same script with `tfsmp.DistributedModel` replaced by the identity
  (plain Keras), and ``shuffle=False`` forced into every ``fit`` (kept from before tfsmp shuffled as Keras does);
- ``parity``: tfsmp with ``shuffle=False`` forced likewise, to compare with ``plain``;
- ``unseeded``: tfsmp with a different seed on every rank (what an unseeded script gets): the
  same-batch check must stop it.

Every rank prints one line per example ``KERASIO {"rank", "example", "modes": {mode: {"fits":
[history, ...], "evals": [...], "error": str | None}}}``.
"""

from __future__ import annotations

import argparse
import ast
import atexit
import contextlib
import json
import os
import shutil
import sys
import tempfile
import types
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("MPLBACKEND", "Agg")

import keras
import numpy as np
import tensorflow as tf

import tfsmp
from tfsmp.errors import StepError

HERE = Path(__file__).resolve().parent
SEED = 1234

EXAMPLES: dict[str, dict[str, Any]] = {
    "mnist_convnet": {"max_epochs": 2, "mnist": (600, 100)},
    "text_classification_with_transformer": {"imdb": (64, 32)},
    "timeseries_classification_from_scratch": {"max_epochs": 2, "forda": (160, 64)},
    # the guide hard-codes reshape(60000, 784): full-size MNIST rows, capped steps
    "functional_api": {"max_epochs": 1, "max_steps": 2, "mnist": (60000, 10000),
                       "cifar10": (1000, 100),
                       "skip": ("path_to_my_model", "vgg19", "feat_extraction_model")},
}


# -- synthetic data of the real shapes and dtypes ----------------------------------------------


def _images(n: int, shape: tuple[int, ...], classes: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """uint8 images whose class shows (a per-class pattern plus noise), so training learns."""
    rng = np.random.default_rng(seed)
    protos = rng.integers(0, 128, size=(classes, *shape), dtype=np.uint8)
    labels = rng.integers(0, classes, size=n).astype(np.uint8)
    noise = rng.integers(0, 128, size=(n, *shape), dtype=np.uint8)
    return protos[labels] + noise, labels  # uint8 throughout: 70000 MNIST rows stay cheap


def _mnist(n_train: int, n_test: int) -> Callable[..., Any]:
    def load_data(path: str = "mnist.npz") -> Any:
        x, y = _images(n_train + n_test, (28, 28), 10, seed=1)
        return (x[:n_train], y[:n_train]), (x[n_train:], y[n_train:])
    return load_data


def _cifar10(n_train: int, n_test: int) -> Callable[..., Any]:
    def load_data() -> Any:
        x, y = _images(n_train + n_test, (32, 32, 3), 10, seed=2)
        y = y.reshape(-1, 1)
        return (x[:n_train], y[:n_train]), (x[n_train:], y[n_train:])
    return load_data


def _imdb(n_train: int, n_test: int) -> Callable[..., Any]:
    def load_data(path: str = "imdb.npz", num_words: int | None = None, **_: Any) -> Any:
        rng = np.random.default_rng(3)
        top = num_words or 20000
        labels = rng.integers(0, 2, size=n_train + n_test)
        seqs = []
        for label in labels:  # positive reviews draw from the lower half of the vocabulary
            length = int(rng.integers(20, 260))
            lo, hi = (1, top // 2) if label else (top // 2, top)
            seqs.append([int(t) for t in rng.integers(lo, hi, size=length)])
        x = np.array(seqs, dtype=object)
        return (x[:n_train], labels[:n_train]), (x[n_train:], labels[n_train:])
    return load_data


def _forda(sizes: tuple[int, int], original: Callable[..., Any]) -> Callable[..., Any]:
    """FordA's TSV files: label (±1) then 500 z-normalized values; class sets the frequency."""
    def loadtxt(fname: Any, *args: Any, **kwargs: Any) -> Any:
        if not str(fname).startswith("http"):
            return original(fname, *args, **kwargs)
        n = sizes[0] if "TRAIN" in str(fname) else sizes[1]
        rng = np.random.default_rng(4 if "TRAIN" in str(fname) else 5)
        label = rng.choice([-1.0, 1.0], size=n)
        t = np.arange(500)
        x = np.sin(t[None, :] * (0.05 + 0.05 * (label[:, None] > 0)) + rng.uniform(0, 6, (n, 1)))
        x = x + 0.3 * rng.normal(size=x.shape)
        x = (x - x.mean(axis=1, keepdims=True)) / x.std(axis=1, keepdims=True)
        return np.concatenate([label[:, None], x], axis=1)
    return loadtxt


_LOADTXT = np.loadtxt  # restored before each example: only FordA's reads are synthetic


def _install_stubs(spec: dict[str, Any]) -> None:
    import keras.src.datasets.cifar10 as src_cifar10
    import keras.src.datasets.imdb as src_imdb
    import keras.src.datasets.mnist as src_mnist

    fakes = {"mnist": (src_mnist, _mnist), "cifar10": (src_cifar10, _cifar10),
             "imdb": (src_imdb, _imdb)}
    for key, (src, make) in fakes.items():
        if key in spec:
            fake = make(*spec[key])
            for ns in (keras.datasets, tf.keras.datasets):
                getattr(ns, key).load_data = fake
            src.load_data = fake
    np.loadtxt = _forda(spec["forda"], _LOADTXT) if "forda" in spec else _LOADTXT
    for ns in (keras.utils, tf.keras.utils):
        ns.plot_model = lambda *a, **k: None
    sklearn = types.ModuleType("sklearn")
    metrics = types.ModuleType("sklearn.metrics")
    metrics.accuracy_score = lambda a, b: float(np.mean(np.asarray(a) == np.asarray(b)))  # type: ignore[attr-defined]
    sklearn.metrics = metrics  # type: ignore[attr-defined]
    sys.modules.setdefault("sklearn", sklearn)
    sys.modules.setdefault("sklearn.metrics", metrics)
    keras.config.set_max_epochs(spec.get("max_epochs"))
    keras.config.set_max_steps_per_epoch(spec.get("max_steps"))


# -- running the script ---------------------------------------------------------------------------


def _run_script(path: Path, skip: tuple[str, ...]) -> None:
    """Executes the file statement by statement as ``__main__`` (skipping those naming ``skip``)."""
    source = path.read_text()
    tree = ast.parse(source, filename=str(path))
    scope: dict[str, Any] = {"__name__": "__main__", "__file__": str(path)}
    for node in tree.body:
        text = ast.get_source_segment(source, node) or ""
        if any(s in text for s in skip):
            continue
        exec(compile(ast.Module([node], type_ignores=[]), str(path), "exec"), scope)


@contextlib.contextmanager
def _recording(record: dict[str, Any], *, plain: bool, no_shuffle: bool) -> Iterator[None]:
    """Records every fit's history and every evaluate's result outside a fit; ``plain`` makes
    the `tfsmp.DistributedModel` wrap the identity."""
    classes = (keras.Model, tfsmp.DistributedModel)
    own = {(c, n): c.__dict__[n] for c in classes for n in ("fit", "evaluate") if n in c.__dict__}
    originals = {(c, n): getattr(c, n) for c in classes for n in ("fit", "evaluate")}
    depth = [0]
    wrap = tfsmp.DistributedModel

    def fit_of(orig: Callable[..., Any]) -> Callable[..., Any]:
        def fit(self: Any, *args: Any, **kwargs: Any) -> Any:
            if no_shuffle:
                kwargs["shuffle"] = False
            depth[0] += 1
            try:
                history = orig(self, *args, **kwargs)
            finally:
                depth[0] -= 1
            if depth[0] == 0:  # DistributedModel.fit runs keras.Model.fit inside: record once
                record["fits"].append({k: [float(v) for v in vs]
                                       for k, vs in history.history.items()})
            return history
        return fit

    def evaluate_of(orig: Callable[..., Any]) -> Callable[..., Any]:
        def evaluate(self: Any, *args: Any, **kwargs: Any) -> Any:
            outer = depth[0] == 0
            depth[0] += 1  # DistributedModel.evaluate runs keras.Model.evaluate inside
            try:
                out = orig(self, *args, **kwargs)
            finally:
                depth[0] -= 1
            if outer:
                record["evals"].append(out if isinstance(out, dict)
                                       else np.asarray(out, dtype=np.float64).tolist())
            return out
        return evaluate

    for c in classes:
        c.fit = fit_of(originals[(c, "fit")])
        c.evaluate = evaluate_of(originals[(c, "evaluate")])
    if plain:
        tfsmp.DistributedModel = lambda model: model  # type: ignore[assignment,misc]
    try:
        yield
    finally:
        tfsmp.DistributedModel = wrap  # type: ignore[misc]
        for c in classes:
            for n in ("fit", "evaluate"):
                if (c, n) in own:
                    setattr(c, n, own[(c, n)])
                else:
                    delattr(c, n)


def _run_mode(name: str, mode: str, shared_dir: str) -> dict[str, Any]:
    spec = EXAMPLES[name]
    record: dict[str, Any] = {"fits": [], "evals": [], "error": None}
    if mode == "plain" and _world_rank() != 0:  # one plain-Keras reference is enough
        return record
    if tfsmp.is_initialized():
        tfsmp.shutdown()
    keras.backend.clear_session()
    rank = _world_rank()
    keras.utils.set_random_seed(SEED + (rank if mode == "unseeded" else 0))
    cwd = _own_tmp(f"kerasio-{mode}-r{rank}-") if mode == "plain" else shared_dir
    os.chdir(cwd)
    with _recording(record, plain=mode == "plain", no_shuffle=mode in ("plain", "parity")):
        try:
            _run_script(HERE / f"kerasio_{name}.py", spec.get("skip", ()))
        except StepError as e:
            if mode != "unseeded":
                raise
            record["error"] = str(e)
    return record


def _world_rank() -> int:
    from mpi4py import MPI

    return int(MPI.COMM_WORLD.Get_rank())


def _shared_dir() -> str:
    from mpi4py import MPI

    world = MPI.COMM_WORLD
    path = _own_tmp("kerasio-") if world.Get_rank() == 0 else None
    return str(world.bcast(path, root=0))


def _own_tmp(prefix: str) -> str:
    """A new temp folder, removed when this rank's process ends (what the example wrote)."""
    path = tempfile.mkdtemp(prefix=prefix)
    atexit.register(shutil.rmtree, path, True)
    return path


def _example(text: str) -> tuple[str, str | None]:
    """``NAME`` or ``NAME=MODES`` -> (name, modes or None)."""
    name, _, modes = text.partition("=")
    if name not in EXAMPLES:
        raise SystemExit(f"example must be one of {sorted(EXAMPLES)}. Received: {name!r}")
    return name, modes or None


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("examples", nargs="+", type=_example, metavar="NAME[=MODES]")
    parser.add_argument("--modes", default="own,plain,parity")
    args = parser.parse_args(argv)
    for name, own_modes in args.examples:
        _install_stubs(EXAMPLES[name])
        shared = _shared_dir()
        modes = {m: _run_mode(name, m, shared) for m in (own_modes or args.modes).split(",")}
        print("KERASIO " + json.dumps({"rank": _world_rank(), "example": name, "modes": modes}),
              flush=True)
    if tfsmp.is_initialized():
        tfsmp.shutdown()


if __name__ == "__main__":
    main(sys.argv[1:])
