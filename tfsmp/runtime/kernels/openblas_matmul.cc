// tfsmp's OpenBLAS kernel for TensorFlow's MatMul (float32, CPU), registered under the kernel
// label "tfsmp_openblas": only MatMul nodes that carry that label run it (tfsmp/runtime/kernels/__init__.py
// labels the stage programs' products when the `blas` parameter is "openblas"); every other
// MatMul keeps TensorFlow's own kernel. Built once per machine by tfsmp.kernels.load().
//
// The product is OpenBLAS's sgemm from the scipy-openblas32 wheel, single-threaded per call; a
// product with many rows is split by rows of its output across TensorFlow's intra-op threads,
// so the kernel uses the threads TensorFlow is given and no others.
#include <algorithm>
#include <cstdint>
#include <limits>

#include "cblas.h"
#include "tensorflow/core/framework/op_kernel.h"
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

class OpenBlasMatMul : public OpKernel {
 public:
  explicit OpenBlasMatMul(OpKernelConstruction* ctx) : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("transpose_a", &transpose_a_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("transpose_b", &transpose_b_));
  }

  void Compute(OpKernelContext* ctx) override {
    const Tensor& a = ctx->input(0);
    const Tensor& b = ctx->input(1);
    OP_REQUIRES(ctx, TensorShapeUtils::IsMatrix(a.shape()) && TensorShapeUtils::IsMatrix(b.shape()),
                absl::InvalidArgumentError(absl::StrCat(
                    "MatMul takes two matrices. Received: ", a.shape().DebugString(), " and ",
                    b.shape().DebugString())));
    const int64_t m = a.dim_size(transpose_a_ ? 1 : 0);
    const int64_t k = a.dim_size(transpose_a_ ? 0 : 1);
    const int64_t k_b = b.dim_size(transpose_b_ ? 1 : 0);
    const int64_t n = b.dim_size(transpose_b_ ? 0 : 1);
    OP_REQUIRES(ctx, k == k_b,
                absl::InvalidArgumentError(absl::StrCat(
                    "Matrix size-incompatible: In[0]: ", a.shape().DebugString(), ", In[1]: ",
                    b.shape().DebugString())));
    constexpr int64_t kMax = std::numeric_limits<int>::max();
    OP_REQUIRES(ctx, a.dim_size(0) <= kMax && a.dim_size(1) <= kMax && b.dim_size(0) <= kMax &&
                         b.dim_size(1) <= kMax,
                absl::InvalidArgumentError(absl::StrCat(
                    "tfsmp's OpenBLAS MatMul takes dimensions below 2^31. Received: ",
                    a.shape().DebugString(), " and ", b.shape().DebugString())));
    Tensor* out = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({m, n}), &out));
    if (m == 0 || n == 0) return;
    float* c = out->flat<float>().data();
    if (k == 0) {
      std::fill(c, c + m * n, 0.0f);
      return;
    }
    const float* pa = a.flat<float>().data();
    const float* pb = b.flat<float>().data();
    const int lda = static_cast<int>(a.dim_size(1));
    const int ldb = static_cast<int>(b.dim_size(1));
    const bool ta = transpose_a_, tb = transpose_b_;
    // rows [begin, end) of the output: rows of A, or columns of A when it is transposed
    auto rows = [=](int64_t begin, int64_t end) {
      if (end <= begin) return;
      const float* a_rows = ta ? pa + begin : pa + begin * lda;
      scipy_cblas_sgemm(CblasRowMajor, ta ? CblasTrans : CblasNoTrans,
                        tb ? CblasTrans : CblasNoTrans, static_cast<int>(end - begin),
                        static_cast<int>(n), static_cast<int>(k), 1.0f, a_rows, lda, pb, ldb,
                        0.0f, c + begin * n, static_cast<int>(n));
    };
    auto* workers = ctx->device()->tensorflow_cpu_worker_threads();
    const int64_t shards = std::min<int64_t>(workers->num_threads, m / kMinRowsPerShard);
    if (shards <= 1) {
      rows(0, m);
      return;
    }
    const int64_t block = (m + shards - 1) / shards;
    tensorflow::Shard(static_cast<int>(shards), workers->workers, shards, /*cost_per_unit=*/
                      std::max<int64_t>(1, block * n * k),
                      [&](int64_t first, int64_t last) {
                        for (int64_t s = first; s < last; ++s)
                          rows(s * block, std::min(m, (s + 1) * block));
                      });
  }

 private:
  bool transpose_a_ = false;
  bool transpose_b_ = false;
};

REGISTER_KERNEL_BUILDER(Name("MatMul")
                            .Device(tensorflow::DEVICE_CPU)
                            .TypeConstraint<float>("T")
                            .Label("tfsmp_openblas"),
                        OpenBlasMatMul);

}  // namespace
}  // namespace tfsmp
