// Python bindings of stencild's CPU kernels. Built on first use by
// engine/kernels/__init__.py from the .cpp files of this directory:
//   attention.cpp  paged attention and KV writes
//   gemm.cpp       the small-batch linear layer
//   pointwise.cpp  SiLU-and-multiply, residual add + RMSNorm, rotary embedding, snake
//   masks.cpp      the grammar's token bitmask applied to logits
#include <torch/extension.h>

#include "kernels.h"

using namespace stencild;

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  // Release the GIL so the engine's host thread runs while a forward pass computes.
  using release = py::call_guard<py::gil_scoped_release>;
  m.def("silu_mul", &silu_mul, "silu(gate) * up for a fused gate|up projection", release());
  m.def("snake", &snake, "SNAC snake activation", release());
  m.def("pack_small_gemm", &pack_small_gemm, "weights into 16-feature blocks", release());
  m.def("small_gemm", &small_gemm, "linear layer for 1 to 16 rows", release());
  m.attr("has_avx512") = py::bool_(
#ifdef __AVX512F__
      true
#else
      false
#endif
  );
  m.def("write_kv", &write_kv, "write new keys/values into the paged cache", release());
  m.def("paged_attention", &paged_attention, "paged attention for short queries", release());
  m.def("add_rms_norm", &add_rms_norm, "fused residual add + RMSNorm, in place", release());
  m.def("rotary_embedding", &rotary_embedding, "rotary position embedding of interleaved pairs, in place",
        release());
  m.def("apply_token_bitmask", &apply_token_bitmask, "grammar mask: disallowed logits to -inf, in place",
        release());
}
