"""tfsmp's own TensorFlow kernels: OpenBLAS matrix products for the stage programs.

[Note: OpenBLAS products]
TensorFlow's CPU kernel for ``MatMul`` (Eigen's contraction, or oneDNN's where TensorFlow turns
it on) runs a pipeline microbatch's products far below the CPU's speed on some hosts: on the AMD
EPYC hosts of these machines, one thread, 256 rows by a 1024 x 1024 kernel, ``x @ W`` at about
44 GFLOP/s and ``dY @ W^T`` at about 31, where OpenBLAS's ``sgemm`` (and torch's MKL) run at
80-90 (docs/performance.md, "The peer"). The ``blas`` parameter picks the kernel:

- ``"tensorflow"`` (the default): TensorFlow's own; nothing here runs.
- ``"openblas"``: `load` builds ``openblas_matmul.cc`` once per machine into a TensorFlow op
  library (the machine's C++ compiler, TensorFlow's headers, the scipy-openblas32 wheel's
  OpenBLAS; cached under ``TFSMP_KERNEL_DIR``, default ``~/.cache/tfsmp/kernels``, keyed by
  everything the build reads) and loads it. It registers a second CPU kernel for ``MatMul``
  under the kernel label `LABEL`, so only nodes that carry the label run it.
  `program` then makes each stage program a `tf.function` whose body is traced under
  ``{"MatMul": LABEL}`` (the forward's products and the gradients' alike, since the backward is
  traced in the same graph) and whose calls run with Grappler's remapper off: the remapper
  would otherwise fuse a product with its bias and activation into TensorFlow's
  ``_FusedMatMul``, which drops the label. Only these programs are affected: the option is the
  call's own (a thread-local `FunctionCallOptions`), not the process's.

[Note: products into accumulators]
A stage adds each microbatch's weight gradients into accumulators (`acc.assign_add(g)`, or
`acc.assign(g)` for the step's first). Where ``g`` is a labelled product, `accumulate` replaces
the pair with ``TfsmpMatMulAccumulate``: sgemm writes the product into the variable's buffer
with beta = 1 (add) or 0 (assign). The product's own 4 MB (a 1024 x 1024 kernel) is never
allocated, the add's pass over three such buffers is gone, and the step's first microbatch's
gradients are taken without a copy. The product node is left without consumers and pruned. A
buffer that a read of the variable still holds is copied first, as TensorFlow's own updates do.
The sum is the same sum; OpenBLAS adds the product into the accumulator block by block of the
inner dimension, so at more than one block (rows beyond a few hundred per microbatch) the
rounding differs from adding the finished product.

What it does not cover: products outside the stage programs (the taped fallback's backward,
which TensorFlow traces apart, and user code), ``BatchMatMul``/``Einsum`` (attention), and XLA,
which compiles its own products: ``blas='openblas'`` with ``xla=True`` (or Keras's
``jit_compile=True``) is refused. Products of other types than float32 (float64, mixed
precision's float16 and bfloat16, integers) keep TensorFlow's kernel. Results differ from
TensorFlow's kernel by float32 rounding (another summation order), as TensorFlow's kernels
differ from one another.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib.util
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from tfsmp.errors import ConfigError
from tfsmp.runtime.dispatch import Program

LABEL = "tfsmp_openblas"
SOURCE = Path(__file__).with_name("openblas_matmul.cc")
LIBRARY = "tfsmp_openblas_matmul.so"
BUILD_TIMEOUT = 600.0  # seconds; a build takes about 10

class _State:
    active = False
    path: Path | None = None
    ops: Any = None  # the loaded library's op wrappers (tfsmp_mat_mul_accumulate)


_state = _State()


def active() -> bool:
    """Whether this process loaded the kernel and labels its stage programs' products."""
    return _state.active


def library_path() -> Path | None:
    """The loaded library, or None."""
    return _state.path


def kernel_dir() -> Path:
    """Where built libraries are kept (``TFSMP_KERNEL_DIR``, else ``~/.cache/tfsmp/kernels``)."""
    env = os.environ.get("TFSMP_KERNEL_DIR")
    return Path(env) if env else Path.home() / ".cache" / "tfsmp" / "kernels"


def _compiler() -> str | None:
    for name in (os.environ.get("CXX"), "g++", "c++", "clang++"):
        if name and shutil.which(name):
            return str(shutil.which(name))
    return None


def _openblas() -> tuple[str, str, str]:
    """(include dir, lib dir, version) of the scipy-openblas32 wheel."""
    if importlib.util.find_spec("scipy_openblas32") is None:
        raise ConfigError(
            "blas='openblas' needs OpenBLAS from the scipy-openblas32 package, which is not "
            "installed. Received: blas='openblas'. Fix: pip install 'tfsmp[blas]' (or pip "
            "install scipy-openblas32), or leave blas='tensorflow'.")
    import scipy_openblas32 as ob

    version = getattr(ob, "__version__", "") or ob.get_openblas_config()
    return ob.get_include_dir(), ob.get_lib_dir(), str(version)


def build_command(output: Path) -> list[str]:
    """The compiler command that builds the library into ``output``."""
    import tensorflow as tf

    cxx = _compiler()
    if cxx is None:
        raise ConfigError(
            "blas='openblas' builds its TensorFlow kernel once per machine with a C++ compiler, "
            "and none was found (CXX, g++, c++, clang++). Received: blas='openblas'. Fix: "
            "install one (apt-get install g++), or leave blas='tensorflow'.")
    include, lib, _ = _openblas()
    return [cxx, "-std=c++17", "-shared", "-fPIC", "-O2", "-w", str(SOURCE), "-o", str(output),
            *tf.sysconfig.get_compile_flags(), f"-I{include}", *tf.sysconfig.get_link_flags(),
            f"-L{lib}", "-lscipy_openblas", f"-Wl,-rpath,{lib}"]


def _key() -> str:
    """Everything the build reads: the source, TensorFlow's version and flags, OpenBLAS's
    version and place, the compiler."""
    import tensorflow as tf

    include, lib, version = _openblas()
    parts = [SOURCE.read_text(), tf.__version__, " ".join(tf.sysconfig.get_compile_flags()),
             " ".join(tf.sysconfig.get_link_flags()), include, lib, version, _compiler() or "",
             sys.version]
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:16]


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    """An exclusive lock on ``path`` (the ranks of a job build once, the others wait)."""
    import fcntl

    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _kill_group(proc: subprocess.Popen[str]) -> None:
    with contextlib.suppress(ProcessLookupError):  # it may have ended meanwhile
        os.killpg(proc.pid, signal.SIGKILL)


def build() -> Path:
    """The library for this machine, built first if no build with the same inputs is kept."""
    target = kernel_dir() / _key() / LIBRARY
    if target.exists():
        return target
    with _locked(target.parent.with_suffix(".lock")):
        if target.exists():  # another rank built it while this one waited
            return target
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, scratch = tempfile.mkstemp(suffix=".so", dir=target.parent)
        os.close(fd)
        cmd = build_command(Path(scratch))
        # its own process group: a stopped build takes the compiler's children with it
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                start_new_session=True)
        try:
            _, stderr = proc.communicate(timeout=BUILD_TIMEOUT)
        except subprocess.TimeoutExpired:  # the ranks waiting on the lock must not wait longer
            _kill_group(proc)
            proc.communicate()
            Path(scratch).unlink(missing_ok=True)
            raise ConfigError(
                f"blas='openblas' builds its TensorFlow kernel in seconds, and the compiler "
                f"ran longer than {BUILD_TIMEOUT:g} s. Received: {' '.join(cmd[:2])} ... "
                f"still running (stopped). Fix: check the machine's load and compiler, or "
                f"leave blas='tensorflow'.") from None
        finally:
            if proc.poll() is None:  # interrupted while waiting: no compiler outlives it
                _kill_group(proc)
        if proc.returncode != 0:
            Path(scratch).unlink(missing_ok=True)
            tail = "\n".join(stderr.strip().splitlines()[-15:])
            raise ConfigError(
                "blas='openblas' could not build its TensorFlow kernel. Received: exit status "
                f"{proc.returncode} from {' '.join(cmd[:2])} ...:\n{tail}\nFix: check the "
                "compiler and TensorFlow's headers (tf.sysconfig.get_include()), or leave "
                "blas='tensorflow'.")
        os.replace(scratch, target)
    return target


def load() -> Path:
    """Builds (once per machine) and loads the kernel; from now on `program` labels products."""
    if _state.path is not None:
        _state.active = True
        return _state.path
    import tensorflow as tf

    path = build()
    _state.ops = tf.load_op_library(str(path))
    _state.path, _state.active = path, True
    return path


def use(blas: str) -> None:
    """Follow the `blas` parameter: load the kernel for "openblas"; "tensorflow" labels nothing
    from now on (programs already made keep what they were made with)."""
    if blas == "openblas":
        load()
    else:
        _state.active = False


@contextlib.contextmanager
def labels() -> Iterator[None]:
    """Inside a graph being traced: its ``MatMul`` nodes made here run the OpenBLAS kernel."""
    import tensorflow as tf

    graph = tf.compat.v1.get_default_graph()
    with graph._kernel_label_map({"MatMul": LABEL}):  # noqa: SLF001 (TensorFlow's label map)
        yield


def accumulate(acc: Any, g: Any, assign: bool) -> Any:
    """``acc = g`` (``assign``) or ``acc += g`` with the product that made ``g`` written
    straight into ``acc`` ([Note: products into accumulators]); None where ``g`` is not a
    labelled product of this graph (the caller updates ``acc`` its own way)."""
    import tensorflow as tf

    op = getattr(g, "op", None)
    if (not active() or not isinstance(assign, bool) or op is None or op.type != "MatMul"
            or g.dtype != tf.float32
            or acc.dtype != tf.float32 or not tf.inside_function()
            or g.graph is not tf.compat.v1.get_default_graph()):
        return None
    try:
        labelled = op.get_attr("_kernel") == LABEL.encode()
    except ValueError:
        labelled = False
    handle = getattr(acc, "handle", None)  # a resource variable's
    if not labelled or handle is None:  # not a labelled program's product (XLA's, user code's)
        return None
    _state.ops.tfsmp_mat_mul_accumulate(
        handle, op.inputs[0], op.inputs[1], transpose_a=op.get_attr("transpose_a"),
        transpose_b=op.get_attr("transpose_b"), assign=assign)
    return acc.read_value()


def _float32_only(graph: Any) -> None:
    """The label map labels every MatMul, but the kernel is float32's only: products of other
    types (float64 models, float16/bfloat16 under mixed precision, integers) drop the label and
    keep TensorFlow's kernel, which a labelled node could not find."""
    import tensorflow as tf

    for op in graph.get_operations():
        if op.type != "MatMul" or op.get_attr("T") == tf.float32:
            continue
        try:
            op.get_attr("_kernel")
        except ValueError:
            continue
        op._clear_attr("_kernel")  # noqa: SLF001 (TensorFlow's node attributes)


def _call_options() -> Any:
    """The eager context's call options with Grappler's remapper off."""
    from tensorflow.core.protobuf import rewriter_config_pb2
    from tensorflow.python.eager import context

    config = context.context().config  # a copy
    config.graph_options.rewrite_options.remapping = rewriter_config_pb2.RewriterConfig.OFF
    return context.FunctionCallOptions(config_proto=config)


class OpenBlasProgram(Program):
    """A `tf.function` traced under `labels` whose calls run with the remapper off ([Note:
    program dispatch] in tfsmp/runtime/dispatch.py: called flat once traced); anything else
    (``get_concrete_function``, ...) is the function's own."""

    def __init__(self, fn: Any) -> None:
        super().__init__(fn, call_options=_call_options())


def program(f: Callable[..., Any], **options: Any) -> Any:
    """``tf.function(f, **options)`` as a `Program` ([Note: program dispatch]); with the
    kernel active, an `OpenBlasProgram` of it."""
    import tensorflow as tf

    if not active() or options.get("jit_compile"):
        return Program(tf.function(f, **options))

    @functools.wraps(f)
    def labelled(*args: Any, **kwargs: Any) -> Any:
        with labels():
            out = f(*args, **kwargs)
        _float32_only(tf.compat.v1.get_default_graph())
        return out

    return OpenBlasProgram(tf.function(labelled, **options))
