// tfsmp's OpenBLAS kernels (tfsmp/runtime/kernels/__init__.py, [Note: OpenBLAS products]),
// built once per machine by tfsmp.runtime.kernels.load():
// - TensorFlow's MatMul (float32, CPU) under the kernel label "tfsmp_openblas": only MatMul
//   nodes that carry that label run it (the stage programs' products when the `blas` parameter
//   is "openblas"); every other MatMul keeps TensorFlow's own kernel.
// - TfsmpMatMulAccumulate: accumulator (a float32 resource variable) = or += op(a) @ op(b), the
//   product written straight into the variable by sgemm's beta (0: assign, 1: add), which saves
//   the product's own buffer and the separate pass of AssignAddVariableOp over it.
//
// The product is OpenBLAS's sgemm from the scipy-openblas32 wheel, single-threaded per call; a
// product with many rows is split by rows of its output across TensorFlow's intra-op threads,
// so the kernel uses the threads TensorFlow is given and no others.
#include <algorithm>
#include <cstdint>
#include <limits>

#include "cblas.h"
#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/resource_mgr.h"
#include "tensorflow/core/framework/resource_var.h"
#include "tensorflow/core/framework/shape_inference.h"
#include "tensorflow/core/framework/tensor.h"
#include "tensorflow/core/framework/tensor_shape.h"
#include "tensorflow/core/util/work_sharder.h"

namespace tfsmp {
namespace {

using tensorflow::OpKernel;
using tensorflow::OpKernelConstruction;
using tensorflow::OpKernelContext;
using tensorflow::Tensor;
using tensorflow::TensorShape;
using tensorflow::TensorShapeUtils;

// OpenBLAS's own threads would compete with TensorFlow's: one per call, set when the library
// loads (this OpenBLAS is a copy of its own, apart from NumPy's).
struct SingleThreaded {
  SingleThreaded() { scipy_openblas_set_num_threads(1); }
};
const SingleThreaded single_threaded;

constexpr int64_t kMinRowsPerShard = 64;

// The shape of op(a) @ op(b): (m, k) x (k, n), or an error in TensorFlow's words.
absl::Status ProductShape(const Tensor& a, const Tensor& b, bool ta, bool tb, int64_t* m,
                          int64_t* k, int64_t* n) {
  if (!TensorShapeUtils::IsMatrix(a.shape()) || !TensorShapeUtils::IsMatrix(b.shape())) {
    return absl::InvalidArgumentError(absl::StrCat("MatMul takes two matrices. Received: ",
                                                   a.shape().DebugString(), " and ",
                                                   b.shape().DebugString()));
  }
  *m = a.dim_size(ta ? 1 : 0);
  *k = a.dim_size(ta ? 0 : 1);
  *n = b.dim_size(tb ? 0 : 1);
  if (*k != b.dim_size(tb ? 1 : 0)) {
    return absl::InvalidArgumentError(absl::StrCat("Matrix size-incompatible: In[0]: ",
                                                   a.shape().DebugString(), ", In[1]: ",
                                                   b.shape().DebugString()));
  }
  constexpr int64_t kMax = std::numeric_limits<int>::max();
  if (a.dim_size(0) > kMax || a.dim_size(1) > kMax || b.dim_size(0) > kMax ||
      b.dim_size(1) > kMax) {
    return absl::InvalidArgumentError(absl::StrCat(
        "tfsmp's OpenBLAS MatMul takes dimensions below 2^31. Received: ",
        a.shape().DebugString(), " and ", b.shape().DebugString()));
  }
  return absl::OkStatus();
}

// c (m x n, row-major) = op(a) @ op(b) + beta * c. A product with many rows is split by rows of
// c across TensorFlow's intra-op threads: min(threads, m / 64) equal blocks, one sgemm each
// (OpenBLAS rounds a block by its size, so results depend on the thread count, as TensorFlow's
// own kernels' do).
void Product(OpKernelContext* ctx, const Tensor& a, const Tensor& b, bool ta, bool tb, int64_t m,
             int64_t k, int64_t n, float beta, float* c) {
  if (m == 0 || n == 0) return;
  if (k == 0) {
    if (beta == 0.0f) std::fill(c, c + m * n, 0.0f);
    return;
  }
  const float* pa = a.flat<float>().data();
  const float* pb = b.flat<float>().data();
  const int lda = static_cast<int>(a.dim_size(1));
  const int ldb = static_cast<int>(b.dim_size(1));
  // rows [begin, end) of the output: rows of A, or columns of A when it is transposed
  auto rows = [=](int64_t begin, int64_t end) {
    if (end <= begin) return;
    const float* a_rows = ta ? pa + begin : pa + begin * lda;
    scipy_cblas_sgemm(CblasRowMajor, ta ? CblasTrans : CblasNoTrans,
                      tb ? CblasTrans : CblasNoTrans, static_cast<int>(end - begin),
                      static_cast<int>(n), static_cast<int>(k), 1.0f, a_rows, lda, pb, ldb,
                      beta, c + begin * n, static_cast<int>(n));
  };
  auto* workers = ctx->device()->tensorflow_cpu_worker_threads();
  const int64_t shards = std::min<int64_t>(workers->num_threads, m / kMinRowsPerShard);
  if (shards <= 1) {
    rows(0, m);
    return;
  }
  const int64_t block = (m + shards - 1) / shards;
  tensorflow::Shard(static_cast<int>(shards), workers->workers, shards, /*cost_per_unit=*/
                    std::max<int64_t>(1, block * n * k), [&](int64_t first, int64_t last) {
                      for (int64_t s = first; s < last; ++s)
                        rows(s * block, std::min(m, (s + 1) * block));
                    });
}

class OpenBlasMatMul : public OpKernel {
 public:
  explicit OpenBlasMatMul(OpKernelConstruction* ctx) : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("transpose_a", &transpose_a_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("transpose_b", &transpose_b_));
  }

  void Compute(OpKernelContext* ctx) override {
    const Tensor& a = ctx->input(0);
    const Tensor& b = ctx->input(1);
    int64_t m = 0, k = 0, n = 0;
    OP_REQUIRES_OK(ctx, ProductShape(a, b, transpose_a_, transpose_b_, &m, &k, &n));
    Tensor* out = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({m, n}), &out));
    Product(ctx, a, b, transpose_a_, transpose_b_, m, k, n, 0.0f, out->flat<float>().data());
  }

 private:
  bool transpose_a_ = false;
  bool transpose_b_ = false;
};

class MatMulAccumulate : public OpKernel {
 public:
  explicit MatMulAccumulate(OpKernelConstruction* ctx) : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("transpose_a", &transpose_a_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("transpose_b", &transpose_b_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("assign", &assign_));
  }

  void Compute(OpKernelContext* ctx) override {
    tensorflow::core::RefCountPtr<tensorflow::Var> var;
    OP_REQUIRES_OK(ctx, tensorflow::LookupResource(ctx, tensorflow::HandleFromInput(ctx, 0), &var));
    const Tensor& a = ctx->input(1);
    const Tensor& b = ctx->input(2);
    int64_t m = 0, k = 0, n = 0;
    OP_REQUIRES_OK(ctx, ProductShape(a, b, transpose_a_, transpose_b_, &m, &k, &n));
    tensorflow::mutex_lock lock(*var->mu());
    Tensor* acc = var->tensor();
    OP_REQUIRES(ctx, var->is_initialized && acc->dtype() == tensorflow::DT_FLOAT &&
                         acc->shape() == TensorShape({m, n}),
                absl::InvalidArgumentError(absl::StrCat(
                    "TfsmpMatMulAccumulate needs an initialized float32 variable of the "
                    "product's shape [", m, ",", n, "]. Received: ",
                    tensorflow::DataTypeString(acc->dtype()), " ", acc->shape().DebugString())));
    if (!acc->RefCountIsOne()) {
      // a value read from the variable still holds this buffer: write a fresh one, as
      // TensorFlow's own updates do (copy on write)
      Tensor fresh;
      OP_REQUIRES_OK(ctx, ctx->allocate_temp(tensorflow::DT_FLOAT, acc->shape(), &fresh));
      if (!assign_) std::copy_n(acc->flat<float>().data(), m * n, fresh.flat<float>().data());
      *acc = fresh;
    }
    Product(ctx, a, b, transpose_a_, transpose_b_, m, k, n, assign_ ? 0.0f : 1.0f,
            acc->flat<float>().data());
  }

 private:
  bool transpose_a_ = false;
  bool transpose_b_ = false;
  bool assign_ = false;
};

REGISTER_KERNEL_BUILDER(Name("MatMul")
                            .Device(tensorflow::DEVICE_CPU)
                            .TypeConstraint<float>("T")
                            .Label("tfsmp_openblas"),
                        OpenBlasMatMul);

REGISTER_OP("TfsmpMatMulAccumulate")
    .Input("accumulator: resource")
    .Input("a: float")
    .Input("b: float")
    .Attr("transpose_a: bool = false")
    .Attr("transpose_b: bool = false")
    .Attr("assign: bool = false")
    .SetIsStateful()
    .SetShapeFn(tensorflow::shape_inference::NoOutputs);

REGISTER_KERNEL_BUILDER(Name("TfsmpMatMulAccumulate").Device(tensorflow::DEVICE_CPU),
                        MatMulAccumulate);

}  // namespace
}  // namespace tfsmp
