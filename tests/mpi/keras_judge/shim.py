"""Pytest plugin: every model a Keras test compiles trains as a `tfsmp.DistributedModel`.

Loaded with ``-p tests.mpi.keras_judge.shim --judge-mode wrap`` on every rank of an mpirun job
(tests/mpi/keras_judge/runner.py); ``--judge-mode probe`` (the plain run) wraps nothing and only
records which tests compile a model, so the wrapped run launches only those.

[Note: how a test's model is wrapped] Keras's `Trainer.compile` is patched. When a test compiles
a plain `keras.Model`, the patch compiles it as Keras does, then builds
``dm = tfsmp.DistributedModel(model)`` and compiles ``dm`` with the same arguments and the very
optimizer object the model now holds (so ``model.optimizer is dm.optimizer``). The model's class
is swapped for a subclass, cached per class and named as the class (so saving and registered
names do not change), whose ``__getattribute__`` sends the names in `FORWARDED` (the trainer's
entry points, weights, saving, metrics, ``optimizer``, ``stop_training``, ``history``) and
``model(x)`` to ``dm``, and Keras's saving functions (`saving_lib.save_model(model, ...)`...)
get ``dm`` for the model — but only from the test's own code: while a call into ``dm`` runs, the
model is itself again, which is what ``dm`` wraps. Compiling the same model again compiles its
``dm`` again (the issue's "compiling again"). The subclass defines no Keras hook of its own
(`train_step`, `get_metrics_result`...), so tfsmp's refusal of user overrides sees the user's
class as written.

Why not swap the class for a `DistributedModel` subclass: that would build on its internals (its
``__init__`` state, its step machinery), which issue 26's rewrite replaces; this shim uses only
what a user has: ``DistributedModel(model)``, ``compile`` and the Keras API, plus the public
`tfsmp.plan` and `tfsmp.errors`.

[Note: not wrapped] A model that cannot be a two-stage pipeline (one layer, such as a layer with
Keras's `Trainer` mixed in; a layer the tracer cannot read) is not wrapped, and
the test is reported "not wrapped (reason)", never as passing wrapped. Whether it can is asked of
`tfsmp.plan(model, 2)` on every rank (the same answer everywhere, no messages) before the first
step, because a model that fails to plan inside `DistributedModel` fails on rank 0 only, while
the other ranks wait in the plan's broadcast. A `TraceError`/`PartitionError` that
`DistributedModel` raises on its first step is also "not wrapped"; the step then runs plainly.

[Note: shared temporary directories] Ranks of a job share one file system, and a path a test
gives `save` must name the same file on every rank (rank 0 writes, all read). So in wrap mode
the temporary directories a test module asks for (`TestCase.get_temp_dir`, `tempfile.mkdtemp`,
`tempfile.TemporaryDirectory` called from a ``*_test`` module) are the same path on every rank,
under ``$TFSMP_JUDGE_TMP``, and are not deleted until the runner deletes that root (one rank
must not delete a file the other still reads). Library code keeps unique private directories.
A test that removes a file there itself (``os.remove`` from a ``*_test`` module, as the
`CSVLogger` and `ModelCheckpoint` tests do between their cases) removes it once: the ranks
meet, world rank 0 removes it, and they meet again.

[Note: ranks leave a test together] After each test (its outcome recorded), the ranks meet in a barrier of the shim's own
communicator and compare outcomes. A rank whose peer does not arrive within `PEER_GRACE`
seconds (the peer failed alone and left a collective half-matched, or hangs) aborts the job, and
so does a rank whose peer's outcome differs from its own (one rank failed: whatever messages it
left unmatched would corrupt the next test). The runner records the test as failed and relaunches
after it (runner.py, [Note: resuming a launch]); without this, a one-rank failure costs the whole
per-test timeout.
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

__all__ = ["FORWARDED", "METHODS", "TRAINER_ENTRIES"]

TRAINER_ENTRIES = frozenset({
    "fit", "evaluate", "predict", "train_on_batch", "test_on_batch", "predict_on_batch"})
FORWARDED = TRAINER_ENTRIES | frozenset({
    "get_weights", "set_weights", "save", "save_weights", "load_weights", "export",
    "get_metrics_result", "reset_metrics", "metrics", "metrics_names", "metrics_variables",
    "compiled_loss", "compiled_metrics", "optimizer", "stop_training", "history",
    # what Keras's tests compare `metrics` with: the trainer's own trackers
    "_loss_tracker", "_compile_metrics", "_compile_loss",
})
METHODS = TRAINER_ENTRIES | frozenset({
    "get_weights", "set_weights", "save", "save_weights", "load_weights", "export",
    "get_metrics_result", "reset_metrics"})
SET_FORWARDED = frozenset({"stop_training"})
# Instance-dict keys. The DistributedModel's is a dunder name: Keras's saving walks every other
# attribute of a model, and model -> DistributedModel -> model would never end.
DM_KEY = "__judge_distributed__"     # the model's DistributedModel, or None
CHECKED_KEY = "_judge_checked"       # the two-stage check already ran
REFUSED_KEY = "_judge_unwrappable"   # why it cannot be two stages
UNWRAPPABLE = ("TraceError", "PartitionError")

# The test now running: its id, the models it compiled/wrapped, the reasons some were not
# wrapped, whether a forwarded name was used, and its temporary directories handed out so far.
_TEST: dict[str, Any] = {}
_MODE: dict[str, str] = {"mode": "off"}
_ORIGINAL: dict[str, Any] = {}  # "compile": Keras's own Trainer.compile


class _Depth:
    """How deep the process is inside calls into a `DistributedModel` (0: test code). One
    count for every thread: TensorFlow runs parts of a step on threads of its own."""

    value = 0


_INSIDE = _Depth()


@contextlib.contextmanager
def inside_distributed() -> Iterator[None]:
    _INSIDE.value += 1
    try:
        yield
    finally:
        _INSIDE.value -= 1


def _reset_test(nodeid: str) -> None:
    _TEST.clear()
    _TEST.update(id=nodeid, compiled=[], wrapped=[], not_wrapped=[], used=False, temp=0,
                 failed=False)


# -- the forwarding subclass -------------------------------------------------------------------

_SUBCLASSES: dict[type, type] = {}


def _forwarding_class(cls: type) -> type:
    """``cls`` with `FORWARDED` names sent to the model's `DistributedModel` (cached)."""
    if cls in _SUBCLASSES:
        return _SUBCLASSES[cls]
    sub: type

    def __getattribute__(self: Any, name: str) -> Any:
        if name in FORWARDED and _INSIDE.value == 0:
            dm = object.__getattribute__(self, "__dict__").get(DM_KEY)
            if dm is not None:
                return _forwarded(self, dm, name)
        return super(sub, self).__getattribute__(name)

    def __setattr__(self: Any, name: str, value: Any) -> None:
        dm = self.__dict__.get(DM_KEY) if name in SET_FORWARDED else None
        if dm is not None and _INSIDE.value == 0:
            setattr(dm, name, value)
        super(sub, self).__setattr__(name, value)

    def __call__(self: Any, *args: Any, **kwargs: Any) -> Any:
        dm = self.__dict__.get(DM_KEY)
        if dm is None or _INSIDE.value or dm.plan is None:
            return super(sub, self).__call__(*args, **kwargs)
        _TEST["used"] = True
        with inside_distributed():
            return dm(*args, **kwargs)

    def __reduce__(self: Any) -> Any:
        # pickle.dumps(model) pickles what a user of tfsmp pickles, the DistributedModel;
        # an unwrapped model pickles as its own class (the subclass has the class's name)
        dm = self.__dict__.get(DM_KEY)
        if dm is not None and _INSIDE.value == 0 and not self.__dict__.get(CHECKED_KEY):
            self.__dict__[CHECKED_KEY] = True  # the unpickled DistributedModel must plan too
            reason = _two_stage_refusal(self, (), {})
            if reason is not None:
                _stop_wrapping(self, reason)
                dm = None
        if dm is not None and _INSIDE.value == 0:
            _TEST["used"] = True
            with inside_distributed():
                return dm.__reduce__()
        reduced = cls.__reduce__(self)
        if reduced and getattr(reduced[0], "__self__", None) is sub:  # KerasSaveable's
            reduced = (getattr(cls, reduced[0].__name__), *reduced[1:])
        return reduced

    sub = type(cls.__name__, (cls,), {
        "__getattribute__": __getattribute__, "__setattr__": __setattr__, "__call__": __call__,
        "__reduce__": __reduce__,
        "__module__": cls.__module__, "__qualname__": cls.__qualname__,
        "__doc__": cls.__doc__})
    from keras.src.saving import object_registration

    registered = object_registration.get_registered_name(cls)
    if registered != cls.__name__:  # saving writes the name the class is registered under
        object_registration.GLOBAL_CUSTOM_NAMES[sub] = registered
    _SUBCLASSES[cls] = sub
    return sub


def _forwarded(model: Any, dm: Any, name: str) -> Any:
    """``dm``'s attribute ``name``; a method is run as a call into ``dm``."""
    _TEST["used"] = True
    with inside_distributed():
        value = getattr(dm, name)
    if name not in METHODS:
        return value

    def call(*args: Any, **kwargs: Any) -> Any:
        if name in TRAINER_ENTRIES and not model.__dict__.get(CHECKED_KEY):
            model.__dict__[CHECKED_KEY] = True
            reason = _two_stage_refusal(model, args, kwargs)
            if reason is not None:
                return _unwrap_and_call(model, name, reason, args, kwargs)
        try:
            with inside_distributed():
                return value(*args, **kwargs)
        except Exception as e:
            if type(e).__name__ in UNWRAPPABLE and dm.plan is None:
                return _unwrap_and_call(model, name, f"{type(e).__name__}: {e}", args, kwargs)
            raise

    return call


def _unwrap_and_call(model: Any, name: str, reason: str, args: tuple[Any, ...],
                     kwargs: dict[str, Any]) -> Any:
    """Stops wrapping ``model`` ([Note: not wrapped]) and runs ``name`` as plain Keras."""
    _stop_wrapping(model, reason)
    return getattr(model, name)(*args, **kwargs)


def _stop_wrapping(model: Any, reason: str) -> None:
    model.__dict__[DM_KEY] = None
    model.__dict__[REFUSED_KEY] = _one_line(reason)
    _TEST["not_wrapped"].append(_one_line(reason))


def _one_line(text: str, limit: int = 200) -> str:
    line = " ".join(str(text).split())
    return line if len(line) <= limit else line[:limit - 3] + "..."


# -- can it be a two-stage pipeline? ------------------------------------------------------------

def _first_x(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """A small batch of the inputs a trainer entry point was given (None: cannot tell)."""
    import numpy as np
    import tensorflow as tf

    data = kwargs.get("x", args[0] if args else None)
    if isinstance(data, tf.data.Dataset):
        data = next(iter(data.take(1)))
        return data[0] if isinstance(data, tuple) else data
    if hasattr(data, "__getitem__") and hasattr(data, "num_batches"):  # a PyDataset
        batch = data[0]
        return batch[0] if isinstance(batch, tuple) else batch
    leaves = tf.nest.flatten(data) if data is not None else []
    if not leaves or not all(isinstance(v, np.ndarray | tf.Tensor) for v in leaves):
        return None
    return tf.nest.map_structure(lambda v: v[:2], data)


def _two_stage_refusal(model: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str | None:
    """Why ``model`` cannot be planned into two stages (None: it can, or it cannot be told
    before its first step). Builds the model on a sample first, as Keras's fit does, so that
    the planner's trace builds nothing."""
    import tfsmp

    with inside_distributed():
        if not model.built:
            x = _first_x(args, kwargs)
            if x is None:
                return None
            try:
                model(x)
            except Exception:
                return None  # the real call raises the same, through DistributedModel
        try:
            tfsmp.plan(model, tfsmp.mp_size())  # the job's partitions (the judge's --partitions)
        except Exception as e:
            if type(e).__name__ in UNWRAPPABLE:
                return f"{type(e).__name__}: {e}"
            return None
    return None


# -- the patched compile -----------------------------------------------------------------------

def _patched_compile(original: Callable[..., Any]) -> Callable[..., Any]:
    def compile(self: Any, *args: Any, **kwargs: Any) -> Any:
        if _INSIDE.value or not _TEST:  # DistributedModel's own compile, or outside a test
            return original(self, *args, **kwargs)
        with inside_distributed():  # a wrapped model compiles as itself
            result = original(self, *args, **kwargs)
        import tfsmp

        if isinstance(self, tfsmp.DistributedModel):
            return result
        _TEST["compiled"].append(type(self).__name__)
        if _MODE["mode"] != "wrap":
            return result
        _wrap(self, args, kwargs)  # a keras.Model, or a layer with Keras's Trainer mixed in
        return result

    return compile


def _compile_arguments(model: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
    """``compile``'s arguments as keywords, with the optimizer object ``model`` now holds."""
    import inspect

    bound = inspect.signature(_ORIGINAL["compile"]).bind(model, *args, **kwargs)
    arguments = dict(bound.arguments)
    arguments.pop("self")
    arguments.update(arguments.pop("kwargs", {}))
    arguments["optimizer"] = model.__dict__.get("optimizer", arguments.get("optimizer"))
    return arguments


def _wrap(model: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    import tfsmp

    if model.__dict__.get(REFUSED_KEY):  # compiled again: still not two stages
        _TEST["not_wrapped"].append(model.__dict__[REFUSED_KEY])
        return
    arguments = _compile_arguments(model, args, kwargs)
    dm = model.__dict__.get(DM_KEY)
    with inside_distributed():
        if dm is None:
            dm = tfsmp.DistributedModel(model)
        dm.compile(**arguments)
    if type(model) not in _SUBCLASSES.values():
        model.__class__ = _forwarding_class(type(model))
    model.__dict__[DM_KEY] = dm
    _TEST["wrapped"].append(type(model).__name__)


# -- Keras's saving functions take the DistributedModel ------------------------------------------

def _redirect_saving() -> None:
    """``saving_lib.save_model(model, path)`` and the other functions of Keras's saving API that
    take a model (and ``tf.saved_model.save``) get the model's `DistributedModel`, as ``model.save`` does: a user of tfsmp
    hands them the model they train."""
    import keras
    import tensorflow as tf
    from keras.src.saving import saving_api, saving_lib

    for module, name in ((saving_lib, "save_model"), (saving_lib, "save_weights_only"),
                         (saving_lib, "load_weights_only"), (saving_api, "save_model"),
                         (saving_api, "save_weights"), (saving_api, "load_weights"),
                         (keras.saving, "save_model"), (keras.models, "save_model"),
                         (tf.saved_model, "save")):
        setattr(module, name, _taking_distributed(module, name, getattr(module, name)))


# Keras's (and TensorFlow's) functions that write a file: of a model the test runs plainly
# (not wrapped, or one that never compiled), only world rank 0 writes ([Note: one writer]).
_WRITERS = frozenset({"save_model", "save_weights_only", "save_weights", "save"})
_WRITING = {"depth": 0}


def _written_once(function: Callable[..., Any], model: Any, *args: Any, **kwargs: Any) -> Any:
    """[Note: one writer] Ranks share the test's temporary directory, so a plain model's save
    on every rank is two processes writing one file (a corrupt or truncated file that a later
    read fails on, counted against the wrapped run): as a multi-rank script does, world rank 0
    writes, and every rank goes on once it has (the same error on every rank if it failed)."""
    comm = _COMM["comm"]
    result, error = None, None
    if comm.Get_rank() == 0:
        _WRITING["depth"] += 1
        try:
            result = function(model, *args, **kwargs)
        except Exception as e:
            error = e
        finally:
            _WRITING["depth"] -= 1
    _meet("write a plain model's file")
    text = comm.bcast(None if error is None else f"{type(error).__name__}: {error}", root=0)
    if error is not None:
        raise error
    if text is not None:
        raise RuntimeError(f"world rank 0 failed to write the file: {text}")
    return result


def _taking_distributed(module: Any, name: str, function: Callable[..., Any]
                        ) -> Callable[..., Any]:
    def redirected(model: Any, *args: Any, **kwargs: Any) -> Any:
        dm = getattr(model, "__dict__", {}).get(DM_KEY) if _INSIDE.value == 0 else None
        if dm is None:
            target = args[0] if args else kwargs.get("filepath", kwargs.get("export_dir"))
            if (name in _WRITERS and _INSIDE.value == 0 and _WRITING["depth"] == 0
                    and "comm" in _COMM and isinstance(target, (str, os.PathLike))
                    and not _is_tfsmp(model)):
                return _written_once(function, model, *args, **kwargs)
            return function(model, *args, **kwargs)
        _TEST["used"] = True
        with inside_distributed():
            # what the module holds now: tfsmp puts its dispatch of a DistributedModel in
            # front of Keras's saving functions when it makes one (after this redirect)
            return getattr(module, name)(dm, *args, **kwargs)

    return redirected


def _is_tfsmp(model: Any) -> bool:
    import tfsmp

    return isinstance(model, tfsmp.DistributedModel)


# -- shared temporary directories ([Note: shared temporary directories]) -------------------------

def _from_test_module(depth: int = 2) -> bool:
    return str(sys._getframe(depth).f_globals.get("__name__", "")).endswith("_test")


def _shared_dir() -> str:
    _TEST["temp"] = _TEST.get("temp", 0) + 1
    name = re.sub(r"[^A-Za-z0-9_.-]+", "_", str(_TEST.get("id", "none")))[-120:]
    path = Path(os.environ["TFSMP_JUDGE_TMP"]) / name / str(_TEST["temp"])
    path.mkdir(parents=True, exist_ok=True)
    return str(path)


class _SharedDirectory:
    """`tempfile.TemporaryDirectory`'s interface over a shared directory it never deletes."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __enter__(self) -> str:
        return self.name

    def __exit__(self, *exc: Any) -> None:
        return None

    def cleanup(self) -> None:
        return None


def _share_temp_dirs() -> None:
    from keras.src.testing import test_case

    mkdtemp, temporary_directory = tempfile.mkdtemp, tempfile.TemporaryDirectory

    def shared_mkdtemp(*args: Any, **kwargs: Any) -> Any:
        return _shared_dir() if _from_test_module() else mkdtemp(*args, **kwargs)

    def shared_temporary_directory(*args: Any, **kwargs: Any) -> Any:
        if _from_test_module():
            return _SharedDirectory(_shared_dir())
        return temporary_directory(*args, **kwargs)

    tempfile.mkdtemp = shared_mkdtemp  # type: ignore[assignment]
    _share_removals()
    tempfile.TemporaryDirectory = shared_temporary_directory  # type: ignore[assignment,misc]
    test_case.TestCase.get_temp_dir = lambda self: _shared_dir()


def _share_removals() -> None:
    """A test module's ``os.remove``/``os.unlink`` of a file in a shared directory: the ranks
    meet, world rank 0 removes it, and they meet again, so that no rank reads a file another
    already removed, or removes it twice ([Note: shared temporary directories])."""
    root = os.path.realpath(os.environ["TFSMP_JUDGE_TMP"])
    for name in ("remove", "unlink"):
        setattr(os, name, _removing_once(getattr(os, name), root))


def _removing_once(remove: Callable[..., Any], root: str) -> Callable[..., Any]:
    def once(path: Any, *args: Any, **kwargs: Any) -> Any:
        shared = (isinstance(path, (str, os.PathLike)) and _from_test_module()
                  and os.path.realpath(path).startswith(root + os.sep))
        if not shared:
            return remove(path, *args, **kwargs)
        from mpi4py import MPI

        _meet(f"remove {path}")
        try:
            if MPI.COMM_WORLD.Get_rank() == 0:
                remove(path, *args, **kwargs)
        finally:
            _meet(f"see {path} removed")
        return None

    return once


# -- pytest hooks ---------------------------------------------------------------------------------

def pytest_addoption(parser: pytest.Parser) -> None:
    parser.getgroup("keras judge").addoption(
        "--judge-mode", default="probe", choices=("probe", "wrap"),
        help="probe: record which tests compile a model; wrap: train them with tfsmp")


def pytest_configure(config: pytest.Config) -> None:
    from keras.src.trainers.trainer import Trainer

    _MODE["mode"] = config.getoption("--judge-mode")
    _same_seed_everywhere()
    _ORIGINAL["compile"] = Trainer.compile
    Trainer.compile = _patched_compile(Trainer.compile)
    if _MODE["mode"] == "wrap":
        import tfsmp

        tfsmp.init()  # the job's config arrives as SM_HP_MP_PARAMETERS (runner.py)
        from mpi4py import MPI

        _COMM["comm"] = MPI.COMM_WORLD.Dup()  # collective: here, where every rank is
        if "TFSMP_JUDGE_TMP" not in os.environ:
            raise pytest.UsageError("--judge-mode wrap needs TFSMP_JUDGE_TMP: a directory "
                                    "every rank sees. Received: it is not set.")
        _share_temp_dirs()
        _redirect_saving()


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    """Every rank seeds alike, as a multi-rank script must (README: every rank must see the
    same batches); the plain run seeds the same way, so both runs draw the same data."""
    import zlib

    import keras

    _reset_test(item.nodeid)
    keras.utils.set_random_seed(zlib.crc32(item.nodeid.encode()) % 2**31)


def _same_seed_everywhere() -> None:
    """``np.random.seed(None)`` (Keras's `test_utils.get_test_data` default) draws a seed from
    the OS, so ranks would build different data; inside a test it seeds from the test's id and
    how many times it was called instead, alike on every rank and in both runs."""
    import zlib

    import numpy as np

    seed = np.random.seed

    def same_seed(value: Any = None) -> None:
        if value is None and _TEST:
            _TEST["seeds"] = _TEST.get("seeds", 0) + 1
            value = zlib.crc32(f"{_TEST['id']}#{_TEST['seeds']}".encode()) % 2**31
        seed(value)

    np.random.seed = same_seed


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Iterator[None]:
    yield
    props = {"compiled": list(_TEST["compiled"]), "wrapped": list(_TEST["wrapped"]),
             "not_wrapped": list(_TEST["not_wrapped"]), "used": _TEST["used"]}
    item.user_properties.append(("judge", props))


@pytest.hookimpl(trylast=True)
def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if _MODE["mode"] != "wrap":
        return
    if report.failed:
        _TEST["failed"] = True
    if report.when == "teardown":
        _leave_together(report.nodeid, bool(_TEST.get("failed")))


def _meet(what: str) -> None:
    """A barrier of the shim's communicator; a peer that does not arrive within `PEER_GRACE`
    seconds aborts the job ([Note: ranks leave a test together])."""
    import time

    request = _COMM["comm"].Ibarrier()
    deadline = time.monotonic() + PEER_GRACE
    while not request.Test():
        if time.monotonic() > deadline:
            _abort(f"a peer rank did not {what} within {PEER_GRACE:.0f} s of this rank")
        time.sleep(0.02)


def _leave_together(nodeid: str, failed: bool) -> None:
    """[Note: ranks leave a test together]."""
    comm = _COMM["comm"]
    _meet(f"finish {nodeid}")
    outcomes = comm.allgather(failed)
    if len(set(outcomes)) > 1:
        _abort(f"ranks ended {nodeid} differently (failed per rank: {outcomes})")


def _abort(why: str) -> None:
    from mpi4py import MPI

    print(f"[judge] rank {MPI.COMM_WORLD.Get_rank()}: {why}; aborting the job so that the "
          f"runner relaunches after this test", file=sys.stderr, flush=True)
    MPI.COMM_WORLD.Abort(3)


PEER_GRACE = 15.0
_COMM: dict[str, Any] = {}
