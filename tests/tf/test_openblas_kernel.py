"""tfsmp's OpenBLAS MatMul kernel (`blas='openblas'`, [Note: OpenBLAS products] in
tfsmp/runtime/kernels): what it computes, that the stage programs' products really run it (a
fused Dense layer included, which Grappler's remapper would hand to TensorFlow's kernel), the
build cache, and the errors of a machine that cannot build it.

"Runs the kernel" is checked by rounding: OpenBLAS's sgemm, called here directly through
ctypes, sums in another order than TensorFlow's kernel, so a product that equals it bit for bit
(and differs from TensorFlow's) was computed by it.
"""

from __future__ import annotations

import ctypes
import os
import time
from collections.abc import Iterator
from pathlib import Path

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfsmp as smp
from tfsmp.errors import ConfigError
from tfsmp.runtime import kernels

pytestmark = pytest.mark.tf

scipy_openblas32 = pytest.importorskip("scipy_openblas32")


@pytest.fixture(scope="module", autouse=True)
def _loaded() -> Iterator[None]:
    kernels.load()
    yield
    kernels.use("tensorflow")  # the tests after these make programs of their own


def _threads() -> int:
    """The threads of TensorFlow's intra-op pool, which the kernel splits a product's rows over."""
    return tf.config.threading.get_intra_op_parallelism_threads() or len(os.sched_getaffinity(0))


def _sgemm(a: np.ndarray, b: np.ndarray, ta: bool = False, tb: bool = False) -> np.ndarray:
    """OpenBLAS's own product, one call per block of rows as the kernel splits them (the
    kernel's rule: min(threads, rows // 64) equal blocks; OpenBLAS rounds a block by its size):
    the reference the kernel must equal bit for bit."""
    lib = ctypes.CDLL(os.path.join(scipy_openblas32.get_lib_dir(), "libscipy_openblas.so"))
    lib.scipy_openblas_set_num_threads(1)
    a, b = np.ascontiguousarray(a, np.float32), np.ascontiguousarray(b, np.float32)
    m, k = (a.shape[1], a.shape[0]) if ta else a.shape
    n = b.shape[0] if tb else b.shape[1]
    c = np.zeros((m, n), np.float32)
    if not (m and n and k):
        return c
    shards = max(1, min(_threads(), m // 64))
    block = -(-m // shards)
    for begin in range(0, m, block):
        rows = min(block, m - begin)
        a_at = a.ctypes.data + 4 * (begin if ta else begin * a.shape[1])
        lib.scipy_cblas_sgemm(101, 112 if ta else 111, 112 if tb else 111, rows, n, k,
                              ctypes.c_float(1.0), ctypes.c_void_p(a_at), a.shape[1],
                              ctypes.c_void_p(b.ctypes.data), b.shape[1], ctypes.c_float(0.0),
                              ctypes.c_void_p(c.ctypes.data + 4 * begin * n), n)
    return c


def _product(ta: bool, tb: bool) -> tuple[object, object]:
    """The same product as a labelled program and as a plain tf.function."""
    def f(a: tf.Tensor, b: tf.Tensor) -> tf.Tensor:
        return tf.matmul(a, b, transpose_a=ta, transpose_b=tb)

    return kernels.program(f), tf.function(f)


@pytest.mark.parametrize("ta,tb", [(False, False), (True, False), (False, True), (True, True)])
@pytest.mark.parametrize("m,k,n", [(256, 1024, 512), (300, 17, 65), (3, 5, 7), (0, 4, 3),
                                   (4, 0, 3), (4, 3, 0), (1, 1, 1)])
def test_the_kernel_is_openblas_sgemm(ta: bool, tb: bool, m: int, k: int, n: int) -> None:
    rng = np.random.default_rng(m * 7 + k * 3 + n)
    a = rng.standard_normal((k, m) if ta else (m, k)).astype(np.float32)
    b = rng.standard_normal((n, k) if tb else (k, n)).astype(np.float32)
    labelled, plain = _product(ta, tb)
    got = labelled(tf.constant(a), tf.constant(b)).numpy()
    exact = (a.T if ta else a).astype(np.float64) @ (b.T if tb else b).astype(np.float64)
    assert got.shape == (m, n)
    np.testing.assert_allclose(got, exact, rtol=1e-4, atol=1e-4 * max(k, 1))
    assert np.array_equal(got, _sgemm(a, b, ta, tb))
    if m * n * k >= 10**6:  # large enough that the two kernels' orders show
        assert not np.array_equal(got, plain(tf.constant(a), tf.constant(b)).numpy())


def _stack() -> keras.Model:
    keras.utils.set_random_seed(3)
    x = keras.Input((512,))
    h = keras.layers.Dense(512, activation="relu", name="d0")(x)
    return keras.Model(x, keras.layers.Dense(256, name="d1")(h))


def test_a_fused_dense_layer_and_its_gradients_run_the_kernel() -> None:
    """Dense(relu) is MatMul + bias + Relu, which Grappler's remapper fuses into TensorFlow's
    `_FusedMatMul` unless the program's call turns the remapper off; the backward's products
    (x^T dY, dY W^T) are traced in the same labelled graph."""
    model = _stack()
    rng = np.random.default_rng(0)
    x = rng.standard_normal((256, 512)).astype(np.float32)
    y = rng.standard_normal((256, 256)).astype(np.float32)

    def step(x: tf.Tensor, y: tf.Tensor) -> list[tf.Tensor]:
        with tf.GradientTape() as tape:
            tape.watch(x)
            out = model(x)
            loss = tf.reduce_sum((out - y) ** 2) / 2.0
        return [out, *tape.gradient(loss, [x, model.layers[1].kernel, model.layers[2].kernel])]

    out, dx, dw0, dw1 = (t.numpy() for t in kernels.program(step)(tf.constant(x), tf.constant(y)))
    w0, b0 = (v.numpy() for v in model.layers[1].weights)
    w1, b1 = (v.numpy() for v in model.layers[2].weights)
    h = np.maximum(_sgemm(x, w0) + b0, np.float32(0))
    ref_out = _sgemm(h, w1) + b1
    assert np.array_equal(out, ref_out)
    dy = ref_out - y  # the loss's gradient: out - y
    assert np.array_equal(dw1, _sgemm(h, dy, ta=True))
    dh = _sgemm(dy, w1, tb=True) * (h > 0)
    assert np.array_equal(dw0, _sgemm(x, dh, ta=True))
    assert np.array_equal(dx, _sgemm(dh, w0, tb=True))
    plain = tf.function(step)(tf.constant(x), tf.constant(y))[0].numpy()
    assert not np.array_equal(plain, out)  # TensorFlow's kernel rounds otherwise


def test_a_program_leaves_the_callers_options_as_they_were() -> None:
    from tensorflow.python.eager import context

    before = context.context().function_call_options.config_proto_serialized
    labelled, _ = _product(False, False)
    labelled(tf.ones((2, 2)), tf.ones((2, 2)))
    assert context.context().function_call_options.config_proto_serialized == before
    with pytest.raises(ValueError, match="Dimensions must be equal"):  # and after an error
        labelled(tf.ones((2, 3)), tf.ones((2, 3)))
    assert context.context().function_call_options.config_proto_serialized == before


def test_xla_programs_and_the_default_blas_are_plain_tf_functions() -> None:
    assert isinstance(kernels.program(lambda: 1), kernels.OpenBlasProgram)
    assert not isinstance(kernels.program(lambda: 1, jit_compile=True), kernels.OpenBlasProgram)
    kernels.use("tensorflow")
    try:
        assert not isinstance(kernels.program(lambda: 1), kernels.OpenBlasProgram)
    finally:
        kernels.use("openblas")


def test_the_build_is_kept_and_reused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TFSMP_KERNEL_DIR", str(tmp_path))
    first = kernels.build()
    assert first.is_file() and first.parent.parent == tmp_path
    stamp = first.stat().st_mtime_ns
    assert kernels.build() == first and first.stat().st_mtime_ns == stamp  # not rebuilt
    assert list(tmp_path.glob("*/*.so")) == [first]  # no scratch file left behind


def test_a_machine_without_a_compiler_gets_a_clear_error(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TFSMP_KERNEL_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("PATH", str(tmp_path))  # no g++, c++ or clang++ on it
    monkeypatch.delenv("CXX", raising=False)
    with pytest.raises(ConfigError, match=r"with a C\+\+ compiler, and none was found.*Received: "
                                          r"blas='openblas'.*apt-get install g\+\+.*blas='tensorflow'"):
        kernels.build()


def test_a_failed_build_shows_the_compilers_words(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    broken = tmp_path / "broken-cxx"
    broken.write_text("#!/bin/sh\necho 'fatal error: tensorflow/core/framework/op_kernel.h: "
                      "No such file' >&2\nexit 1\n")
    broken.chmod(0o755)
    monkeypatch.setenv("TFSMP_KERNEL_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("CXX", str(broken))
    with pytest.raises(ConfigError, match=r"(?s)could not build.*exit status 1.*op_kernel.h: No such"):
        kernels.build()
    assert not list((tmp_path / "cache").glob("*/*.so"))  # nothing half-built is kept


def _data() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(1)
    return (rng.standard_normal((64, 512)).astype(np.float32),
            rng.standard_normal((64, 256)).astype(np.float32))


def test_one_stage_trains_as_keras_with_the_kernel() -> None:
    x, y = _data()
    ref = _stack()
    init = ref.get_weights()
    ref.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse")
    ref_hist = ref.fit(x, y, batch_size=32, epochs=2, shuffle=False, verbose=0).history
    smp.init({"blas": "openblas", "microbatches": 2})
    try:
        model = _stack()
        model.set_weights(init)
        dm = smp.DistributedModel(model)
        dm.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse")
        hist = dm.fit(x, y, batch_size=32, epochs=2, shuffle=False, verbose=0).history
        programs = dm._engine.programs.values()
        assert all(isinstance(p._fwd, kernels.OpenBlasProgram) for p in programs)
        np.testing.assert_allclose(hist["loss"], ref_hist["loss"], rtol=1e-5)
        for a, b in zip(dm.get_weights(), ref.get_weights()):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    finally:
        smp.shutdown()
        kernels.use("openblas")


def test_jit_compile_with_the_kernel_is_refused_before_any_update() -> None:
    x, y = _data()
    smp.init({"blas": "openblas"})
    try:
        dm = smp.DistributedModel(_stack())
        dm.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse", jit_compile=True)
        with pytest.raises(ConfigError, match=r"Received: jit_compile=True, blas='openblas'\. "
                                              r"Use one of them"):
            dm.fit(x, y, batch_size=32, verbose=0)
    finally:
        smp.shutdown()
        kernels.use("openblas")


def test_products_go_straight_into_their_accumulators() -> None:
    """[Note: products into accumulators]: the step's first microbatch assigns its product
    (no copy), a later one adds it; a value read before the update keeps what it read."""
    from tfsmp.runtime.stage import _accumulate_into

    rng = np.random.default_rng(5)
    xs = [rng.standard_normal((64, 96)).astype(np.float32) for _ in range(2)]
    dys = [rng.standard_normal((64, 48)).astype(np.float32) for _ in range(2)]
    acc = tf.Variable(tf.fill((96, 48), 7.0))

    def step(x: tf.Tensor, dy: tf.Tensor, first: bool) -> tf.Tensor:
        w = tf.zeros((96, 48))
        with tf.GradientTape() as tape:
            tape.watch(w)
            out = tf.matmul(x, w)
        g = tape.gradient(out, w, output_gradients=dy)  # the tape's x^T dy
        return _accumulate_into(acc, g, first)

    first, later = kernels.program(lambda x, dy: step(x, dy, True)), kernels.program(
        lambda x, dy: step(x, dy, False))
    first(tf.constant(xs[0]), tf.constant(dys[0]))
    ops = [o.type for o in first.get_concrete_function(tf.constant(xs[0]), tf.constant(dys[0]))
           .graph.get_operations()]
    assert "TfsmpMatMulAccumulate" in ops
    assert "AssignVariableOp" not in ops and "AssignAddVariableOp" not in ops
    p0, p1 = _sgemm(xs[0], dys[0], ta=True), _sgemm(xs[1], dys[1], ta=True)
    assert np.array_equal(acc.numpy(), p0)  # assigned: the 7s are gone
    held = acc.value()  # shares the variable's buffer until the next update
    later(tf.constant(xs[1]), tf.constant(dys[1]))
    assert np.array_equal(held.numpy(), p0)  # copy on write
    assert np.array_equal(acc.numpy(), p0 + p1)  # one block of the inner dimension: p0 + p1


def test_other_gradients_accumulate_as_before() -> None:
    from tfsmp.runtime.stage import _accumulate_into

    acc = tf.Variable(tf.ones((3,)))
    kernels.program(lambda: _accumulate_into(acc, tf.constant([1.0, 2.0, 3.0]), False))()
    np.testing.assert_array_equal(acc.numpy(), [2.0, 3.0, 4.0])
    plain = tf.Variable(tf.ones((2, 2)))  # a product of an unlabelled graph
    tf.function(lambda: _accumulate_into(plain, tf.matmul(tf.ones((2, 2)), tf.ones((2, 2))),
                                         False))()
    np.testing.assert_array_equal(plain.numpy(), np.full((2, 2), 3.0))


@pytest.mark.parametrize("dtype", ["float64", "float16", "bfloat16", "int32"])
def test_products_of_other_types_keep_tensorflows_kernel(dtype: str) -> None:
    """The kernel is float32's: a labelled node of another type would find no kernel at all."""
    a = tf.cast(tf.reshape(tf.range(12), (3, 4)), dtype)
    b = tf.cast(tf.reshape(tf.range(8), (4, 2)), dtype)
    labelled, plain = _product(False, False)
    assert np.array_equal(labelled(a, b).numpy(), plain(a, b).numpy())


def test_a_mixed_precision_dense_layer_trains_in_a_labelled_program() -> None:
    layer = keras.layers.Dense(8, dtype="mixed_float16")
    layer.build((None, 4))
    x = tf.ones((3, 4))

    def step() -> list[tf.Tensor]:
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(tf.cast(layer(x), tf.float32))
        return tape.gradient(loss, layer.trainable_variables)

    got = kernels.program(step)()
    for g, ref in zip(got, tf.function(step)()):
        np.testing.assert_array_equal(g.numpy(), ref.numpy())


def test_a_build_that_does_not_end_is_stopped(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    stuck = tmp_path / "stuck-cxx"
    pid_file = tmp_path / "child.pid"
    stuck.write_text(f"#!/bin/sh\nsleep 60 &\necho $! > {pid_file}\nwait\n")
    stuck.chmod(0o755)
    monkeypatch.setenv("TFSMP_KERNEL_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("CXX", str(stuck))
    monkeypatch.setattr(kernels, "BUILD_TIMEOUT", 1.0)
    start = time.monotonic()
    with pytest.raises(ConfigError, match=r"ran longer than 1 s\. Received: .*stuck-cxx"):
        kernels.build()
    # not the child's 60 s: a child left running would hold the output pipes open till then
    assert time.monotonic() - start < 30
    assert not list((tmp_path / "cache").glob("*/*.so"))
    child = int(pid_file.read_text())  # the compiler's own child was stopped with it
    deadline = time.monotonic() + 5
    while Path(f"/proc/{child}").exists() and "Z" not in _state_of(child):
        assert time.monotonic() < deadline, "the compiler's child outlived the stopped build"
        time.sleep(0.05)


def _state_of(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0]
    except OSError:
        return "Z"
