// The op attnplug_cpu_fused::attend: the fused kernel (attention.cpp) behind a torch op schema.
//
// Tensors in (no pointers baked by Python); the output rows of the work rows are written in place
// (`out` is declared mutated, so functionalization and torch.compile see the write). The kernel
// variant is chosen once per process from cpuid (`isa()`), and its work items run on torch's
// intra-op pool through at::parallel_for: one OpenMP runtime in the process, torch's.
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <cstdlib>
#include <cstring>
#include <initializer_list>
#include <string>

#include "extend_tiled.h"
#include "kernel.h"

namespace attnplug_cpu_fused {
namespace {

typedef int (*AttendFn)(const DecodeArgs*);

struct Variant { const char* name; AttendFn fn; };

Variant choose() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl") &&
      __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("fma")) {
    if (__builtin_cpu_supports("avx512bf16")) return {"avx512bf16", avx512bf16::attend};
    return {"avx512", avx512::attend};
  }
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c"))
    return {"avx2", avx2::attend};
#endif
  return {"portable", portable::attend};
}

// $ATTNPLUG_CPU_FUSED_ISA (tests, benchmarks) asks for a variant below the CPU's best
Variant selected() {
  Variant best = choose();
  const char* want = std::getenv("ATTNPLUG_CPU_FUSED_ISA");
  if (want == nullptr || *want == 0) return best;
  const Variant all[] = {{"avx512bf16", avx512bf16::attend}, {"avx512", avx512::attend}, {"avx2", avx2::attend},
                         {"portable", portable::attend}};
  bool below = false;
  for (const Variant& v : all) {
    if (std::strcmp(v.name, best.name) == 0) below = true;
    if (below && std::strcmp(v.name, want) == 0) return v;
  }
  TORCH_CHECK(false, "attnplug_cpu_fused: $ATTNPLUG_CPU_FUSED_ISA=", want,
              " is not a kernel variant this CPU runs (best: ", best.name,
              "; variants: avx512bf16, avx512, avx2, portable)");
}

const Variant& variant() {
  static const Variant v = selected();
  return v;
}

void run_parallel(int64_t workers, void* ctx, void (*body)(void*)) {
  at::parallel_for(0, workers, 1, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) body(ctx);
  });
}

int32_t code_of(c10::ScalarType t) {
  switch (t) {
    case at::kFloat: return 0;
    case at::kBFloat16: return 1;
    case at::kHalf: return 2;
    case at::kFloat8_e4m3fn: return 3;
    case at::kFloat8_e5m2: return 4;
    default: return -1;
  }
}

void check_cpu(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu(), "attnplug_cpu_fused::attend: ", name, " is on ", t.device(), " (CPU only)");
}

// the arguments both ops (`op`: attend, extend_tiled) take alike: the plan, the request-to-token table, err
void check_plan_args(const char* op, const at::Tensor& plan, const at::Tensor& req_to_token, const at::Tensor& err) {
  TORCH_CHECK(plan.scalar_type() == at::kLong && plan.dim() == 2 && plan.size(1) == 8 && plan.is_contiguous(),
              "attnplug_cpu_fused::", op, ": plan must be a contiguous int64 [B, 8]");
  TORCH_CHECK(req_to_token.scalar_type() == at::kLong && req_to_token.dim() == 2 && req_to_token.stride(1) == 1,
              "attnplug_cpu_fused::", op, ": req_to_token must be int64 [R, L] with a contiguous last dim");
  TORCH_CHECK(err.scalar_type() == at::kLong && err.numel() >= 4 && err.is_contiguous(),
              "attnplug_cpu_fused::", op, ": err must be a contiguous int64 tensor of 4");
}

// q [T, H, D]; k_new/v_new [T, Hkv, D/Dv] or None (cross-attention); k_cache/v_cache [slots, Hkv, D/Dv]
// (last dim contiguous); req_to_token [R, L] int64; plan [B, 8] int64 (contiguous); mask [B, E, E]
// bool/uint8 or None; sinks [H] float32 or None; out [T, H, Dv] written for the work rows' queries;
// err [4] int64: the first failure (code, work row, position, slot), also raised as an error;
// params [6] float64: group, window (-1: none), scale, cap (0: none), k_scale, v_scale (the layer's
// scalars in one tensor: each argument of the schema costs ~0.2 us of parsing per call from Python)
void attend(const at::Tensor& q, const std::optional<at::Tensor>& k_new, const std::optional<at::Tensor>& v_new,
            const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& req_to_token,
            const at::Tensor& plan, const std::optional<at::Tensor>& mask, const std::optional<at::Tensor>& sinks,
            at::Tensor& out, at::Tensor& err, const at::Tensor& params, int64_t heads_per_item) {
  check_cpu(q, "q");
  TORCH_CHECK(params.scalar_type() == at::kDouble && params.numel() == 6 && params.is_contiguous() &&
                  params.device().is_cpu(),
              "attnplug_cpu_fused::attend: params must be a contiguous float64 CPU tensor of 6 (group, window, "
              "scale, cap, k_scale, v_scale)");
  const double* pr = params.data_ptr<double>();
  const int64_t group = int64_t(pr[0]), window = int64_t(pr[1]);
  const double scale = pr[2], cap = pr[3], k_scale = pr[4], v_scale = pr[5];
  TORCH_CHECK(q.dim() == 3 && out.dim() == 3 && k_cache.dim() == 3 && v_cache.dim() == 3,
              "attnplug_cpu_fused::attend: q, out, k_cache and v_cache must be 3-d");
  TORCH_CHECK(q.stride(2) == 1 && out.stride(2) == 1 && k_cache.stride(2) == 1 && v_cache.stride(2) == 1,
              "attnplug_cpu_fused::attend: q, out, k_cache and v_cache need a contiguous last dim");
  TORCH_CHECK(out.scalar_type() == q.scalar_type(), "attnplug_cpu_fused::attend: out is ", out.scalar_type(),
              ", q is ", q.scalar_type());
  check_plan_args("attend", plan, req_to_token, err);
  const int64_t Hkv = k_cache.size(1), G = group, D = q.size(2), Dv = out.size(2);
  TORCH_CHECK(G > 0 && q.size(1) == Hkv * G && out.size(1) == q.size(1) && k_cache.size(2) == D &&
                  v_cache.size(2) == Dv && v_cache.size(1) == Hkv && out.size(0) == q.size(0),
              "attnplug_cpu_fused::attend: shapes disagree (q ", q.sizes(), ", k_cache ", k_cache.sizes(),
              ", v_cache ", v_cache.sizes(), ", out ", out.sizes(), ", group ", G, ")");
  DecodeArgs a{};
  a.q = q.data_ptr(); a.q_st = q.stride(0); a.q_sh = q.stride(1);
  a.k = k_cache.data_ptr(); a.k_ss = k_cache.stride(0); a.k_sh = k_cache.stride(1);
  a.v = v_cache.data_ptr(); a.v_ss = v_cache.stride(0); a.v_sh = v_cache.stride(1);
  TORCH_CHECK(k_new.has_value() == v_new.has_value(), "attnplug_cpu_fused::attend: k_new and v_new: both or neither");
  if (k_new.has_value()) {
    const at::Tensor &kn = *k_new, &vn = *v_new;
    TORCH_CHECK(kn.dim() == 3 && vn.dim() == 3 && kn.stride(2) == 1 && vn.stride(2) == 1 && kn.size(1) == Hkv &&
                    vn.size(1) == Hkv && kn.size(2) == D && vn.size(2) == Dv && kn.size(0) == q.size(0) &&
                    vn.size(0) == q.size(0),
                "attnplug_cpu_fused::attend: k_new/v_new must be [T, Hkv, D/Dv] with a contiguous last dim");
    TORCH_CHECK(kn.scalar_type() == vn.scalar_type() &&
                    (kn.scalar_type() == q.scalar_type() || kn.scalar_type() == at::kFloat),
                "attnplug_cpu_fused::attend: k_new/v_new must be in q's dtype or float32");
    a.kn = kn.data_ptr(); a.kn_st = kn.stride(0); a.kn_sh = kn.stride(1);
    a.vn = vn.data_ptr(); a.vn_st = vn.stride(0); a.vn_sh = vn.stride(1);
    a.new_f32 = kn.scalar_type() == at::kFloat ? 1 : 0;
  }
  a.r2t = req_to_token.data_ptr<int64_t>(); a.r2t_s = req_to_token.stride(0);
  a.plan = plan.data_ptr<int64_t>();
  if (mask.has_value()) {
    const at::Tensor& m = *mask;
    TORCH_CHECK((m.scalar_type() == at::kBool || m.scalar_type() == at::kByte) && m.dim() == 3 && m.stride(2) == 1 &&
                    m.size(0) == plan.size(0),
                "attnplug_cpu_fused::attend: mask must be bool/uint8 [B, E, E], one per plan row");
    a.mask = static_cast<const uint8_t*>(m.data_ptr()); a.m_sb = m.stride(0); a.m_sq = m.stride(1);
  }
  if (sinks.has_value()) {
    TORCH_CHECK(sinks->scalar_type() == at::kFloat && sinks->is_contiguous() && sinks->numel() == q.size(1),
                "attnplug_cpu_fused::attend: sinks must be contiguous float32 [H]");
    a.sinks = sinks->data_ptr<float>();
  }
  a.o = out.data_ptr(); a.o_st = out.stride(0); a.o_sh = out.stride(1);
  a.q_dtype = code_of(q.scalar_type());
  a.kv_dtype = code_of(k_cache.scalar_type());
  TORCH_CHECK(k_cache.scalar_type() == v_cache.scalar_type(), "attnplug_cpu_fused::attend: k_cache and v_cache dtypes differ");
  a.B = int32_t(plan.size(0)); a.Hkv = int32_t(Hkv); a.G = int32_t(G); a.D = int32_t(D); a.Dv = int32_t(Dv);
  a.window = int32_t(window);
  a.heads_per_item = int32_t(heads_per_item);
  a.nthreads = int32_t(at::get_num_threads());
  a.scale = float(scale); a.cap = float(cap); a.k_scale = float(k_scale); a.v_scale = float(v_scale);
  a.num_slots = k_cache.size(0);
  a.err = err.data_ptr<int64_t>();
  a.parallel = run_parallel;
  const int rc = variant().fn(&a);
  if (rc == RC_OK) return;
  if (rc == RC_SHAPE || rc == RC_DTYPE) err.data_ptr<int64_t>()[0] = rc;
  TORCH_CHECK(false, "attnplug_cpu_fused::attend failed with code ", rc,
              rc == RC_SHAPE ? " (a shape the kernel does not take: head dims must be multiples of 16)"
              : rc == RC_DTYPE ? " (a dtype pairing the kernel does not take)"
              : rc == RC_BAD_SLOT ? " (a slot read through req_to_token is out of range)"
              : rc == RC_NO_MEMORY ? " (scratch memory could not be allocated)"
                                   : " (a work row past the scratch sized for the call)",
              "; record in err: ", err.data_ptr<int64_t>()[0], " ", err.data_ptr<int64_t>()[1], " ",
              err.data_ptr<int64_t>()[2], " ", err.data_ptr<int64_t>()[3]);
}

std::string isa() { return variant().name; }

// The tiled extend kernel (extend_tiled.cpp: query tiles x key tiles with an online softmax) for long
// extends: q [T, H, D]; k_new/v_new [T, Hkv, D/Dv] in q's dtype (float32 or bfloat16); plan [B, 8] with
// each request whole; isa 0: the best this CPU runs (1 portable, 2 avx2, 3 avx512, 4 avx512bf16, 5 amx:
// AVX-512 BF16 + AMX tiles where Linux grants this process the tile data; kernel.TILED_ISAS names them).
void extend_tiled(const at::Tensor& q, const at::Tensor& k_new, const at::Tensor& v_new, const at::Tensor& k_cache,
                  const at::Tensor& v_cache, const at::Tensor& req_to_token, const at::Tensor& plan,
                  const std::optional<at::Tensor>& sinks, at::Tensor& out, at::Tensor& err, int64_t group,
                  int64_t window, int64_t isa, double scale, double cap) {
  check_cpu(q, "q");
  TORCH_CHECK(q.dim() == 3 && out.dim() == 3 && k_cache.dim() == 3 && v_cache.dim() == 3 && k_new.dim() == 3 &&
                  v_new.dim() == 3,
              "attnplug_cpu_fused::extend_tiled: q, k_new, v_new, out, k_cache and v_cache must be 3-d");
  for (const at::Tensor* t : std::initializer_list<const at::Tensor*>{&q, &k_new, &v_new, &out, &k_cache, &v_cache})
    TORCH_CHECK(t->stride(2) == 1, "attnplug_cpu_fused::extend_tiled: every tensor needs a contiguous last dim");
  TORCH_CHECK(q.scalar_type() == at::kFloat || q.scalar_type() == at::kBFloat16,
              "attnplug_cpu_fused::extend_tiled: q must be float32 or bfloat16, got ", q.scalar_type());
  for (const at::Tensor* t : std::initializer_list<const at::Tensor*>{&k_new, &v_new, &out, &k_cache, &v_cache})
    TORCH_CHECK(t->scalar_type() == q.scalar_type(), "attnplug_cpu_fused::extend_tiled: every tensor must be in q's "
                "dtype ", q.scalar_type(), ", got ", t->scalar_type());
  check_plan_args("extend_tiled", plan, req_to_token, err);
  const int64_t Hkv = k_cache.size(1), G = group, D = q.size(2), Dv = out.size(2);
  TORCH_CHECK(G > 0 && q.size(1) == Hkv * G && out.size(1) == q.size(1) && k_cache.size(2) == D &&
                  v_cache.size(2) == Dv && v_cache.size(1) == Hkv && out.size(0) == q.size(0) &&
                  k_new.size(0) == q.size(0) && v_new.size(0) == q.size(0) && k_new.size(1) == Hkv &&
                  v_new.size(1) == Hkv && k_new.size(2) == D && v_new.size(2) == Dv,
              "attnplug_cpu_fused::extend_tiled: shapes disagree (q ", q.sizes(), ", k_cache ", k_cache.sizes(),
              ", v_cache ", v_cache.sizes(), ", out ", out.sizes(), ", group ", G, ")");
  TiledArgs a{};
  a.parallel = run_parallel;  // torch's intra-op pool: one OpenMP runtime in the process
  a.q = q.data_ptr(); a.q_st = q.stride(0); a.q_sh = q.stride(1);
  a.k = k_cache.data_ptr(); a.k_ss = k_cache.stride(0); a.k_sh = k_cache.stride(1);
  a.v = v_cache.data_ptr(); a.v_ss = v_cache.stride(0); a.v_sh = v_cache.stride(1);
  a.kn = k_new.data_ptr(); a.kn_st = k_new.stride(0); a.kn_sh = k_new.stride(1);
  a.vn = v_new.data_ptr(); a.vn_st = v_new.stride(0); a.vn_sh = v_new.stride(1);
  a.r2t = req_to_token.data_ptr<int64_t>(); a.r2t_s = req_to_token.stride(0);
  a.plan = plan.data_ptr<int64_t>();
  a.o = out.data_ptr(); a.o_st = out.stride(0); a.o_sh = out.stride(1);
  if (sinks.has_value()) {
    TORCH_CHECK(sinks->scalar_type() == at::kFloat && sinks->is_contiguous() && sinks->numel() == q.size(1),
                "attnplug_cpu_fused::extend_tiled: sinks must be contiguous float32 [H]");
    a.sinks = sinks->data_ptr<float>();
  }
  a.dtype = q.scalar_type() == at::kFloat ? 0 : 1;
  a.isa = int32_t(isa);
  a.B = int32_t(plan.size(0)); a.Hkv = int32_t(Hkv); a.G = int32_t(G); a.D = int32_t(D); a.Dv = int32_t(Dv);
  a.window = int32_t(window);
  a.nthreads = int32_t(at::get_num_threads());
  a.scale = float(scale); a.cap = float(cap);
  a.num_slots = k_cache.size(0);
  a.err = err.data_ptr<int64_t>();
  err.zero_();
  if (a.B == 0) return;
  const int rc = attnplug_extend_tiled(&a);
  if (rc == 0) return;
  if (err.data_ptr<int64_t>()[0] == 0) err.data_ptr<int64_t>()[0] = rc;
  TORCH_CHECK(false, "attnplug_cpu_fused::extend_tiled failed with code ", rc,
              rc == 1 ? " (a shape the kernel does not take)" : rc == 2 ? " (a dtype the kernel does not take)"
              : rc == 3 ? " (a slot read through req_to_token is out of range)"
              : rc == 4 ? " (scratch memory could not be allocated)"
              : rc == 6 ? " (the requested isa is not available on this CPU)" : "",
              "; record in err: ", err.data_ptr<int64_t>()[0], " ", err.data_ptr<int64_t>()[1], " ",
              err.data_ptr<int64_t>()[2], " ", err.data_ptr<int64_t>()[3]);
}

int64_t tiled_isa() { return attnplug_extend_tiled_isa(); }

// attend_write: `attend` into a fresh output, then -- only once the attention returned -- this forward's new
// K/V rows written into the caches at `slots` (k_cache[slots[i]] = k_new[i], the same for V): what the
// skeleton's write after the kernel does with two index_copy_ calls, in the same call. k_new/v_new [T, Hkv,
// D/Dv] in the caches' dtype; slots int64 [T], each in [0, slots of the cache). Every check runs before
// anything is written: a call that raises (a bad argument, a slot out of range, the kernel's own failure
// record) leaves the caches as they were. Returns the output [T, H, Dv] in q's dtype (every row the work
// rows cover is written; the caller passes work rows covering every token).
at::Tensor attend_write(const at::Tensor& q, const at::Tensor& k_new, const at::Tensor& v_new, at::Tensor& k_cache,
                        at::Tensor& v_cache, const at::Tensor& req_to_token, const at::Tensor& plan,
                        const std::optional<at::Tensor>& mask, const std::optional<at::Tensor>& sinks, at::Tensor& err,
                        const at::Tensor& params, int64_t heads_per_item, const at::Tensor& slots) {
  check_cpu(q, "q");
  TORCH_CHECK(k_cache.dim() == 3 && v_cache.dim() == 3 && k_new.dim() == 3 && v_new.dim() == 3,
              "attnplug_cpu_fused::attend_write: k_new, v_new, k_cache and v_cache must be 3-d");
  TORCH_CHECK(k_new.scalar_type() == k_cache.scalar_type() && v_new.scalar_type() == v_cache.scalar_type(),
              "attnplug_cpu_fused::attend_write: k_new/v_new are ", k_new.scalar_type(), "/", v_new.scalar_type(),
              ", the caches ", k_cache.scalar_type(), "/", v_cache.scalar_type(),
              " (the rows are written as they are: convert them first)");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.dim() == 1 && slots.size(0) == k_new.size(0) &&
                  slots.device().is_cpu(),
              "attnplug_cpu_fused::attend_write: slots must be an int64 CPU tensor [T] (one per new token), got ",
              slots.scalar_type(), " ", slots.sizes());
  const int64_t n = slots.size(0), num_slots = k_cache.size(0), s_st = slots.stride(0);
  const int64_t* sp = slots.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i)
    TORCH_CHECK(sp[i * s_st] >= 0 && sp[i * s_st] < num_slots && sp[i * s_st] < v_cache.size(0),
                "attnplug_cpu_fused::attend_write: slots[", i, "]=", sp[i * s_st],
                " is out of range (expected 0 <= slot < ", num_slots, "); nothing was written");
  at::Tensor out = at::empty({q.size(0), q.size(1), v_cache.size(2)}, q.options());
  attend(q, k_new, v_new, k_cache, v_cache, req_to_token, plan, mask, sinks, out, err, params, heads_per_item);
  // attend returned (it raises on any failure, before this point): it checked k_new/v_new against the caches
  // (shapes [T, Hkv, D/Dv], a contiguous last dim), so each head's row is one contiguous run in both
  const int64_t Hkv = k_cache.size(1);
  const auto put = [&](const at::Tensor& src, at::Tensor& dst) {
    const int64_t es = dst.element_size(), row = dst.size(2) * es;
    const char* s = static_cast<const char*>(src.data_ptr());
    char* d = static_cast<char*>(dst.data_ptr());
    for (int64_t i = 0; i < n; ++i)
      for (int64_t h = 0; h < Hkv; ++h)
        std::memcpy(d + (sp[i * s_st] * dst.stride(0) + h * dst.stride(1)) * es,
                    s + (i * src.stride(0) + h * src.stride(1)) * es, size_t(row));
  };
  put(k_new, k_cache);
  put(v_new, v_cache);
  return out;
}

}  // namespace
}  // namespace attnplug_cpu_fused

TORCH_LIBRARY(attnplug_cpu_fused, m) {
  m.def(
      "attend(Tensor q, Tensor? k_new, Tensor? v_new, Tensor k_cache, Tensor v_cache, Tensor req_to_token, "
      "Tensor plan, Tensor? mask, Tensor? sinks, Tensor(a!) out, Tensor(b!) err, Tensor params, "
      "int heads_per_item) -> ()");
  m.def("isa() -> str", &attnplug_cpu_fused::isa);
  m.def(
      "extend_tiled(Tensor q, Tensor k_new, Tensor v_new, Tensor k_cache, Tensor v_cache, Tensor req_to_token, "
      "Tensor plan, Tensor? sinks, Tensor(a!) out, Tensor(b!) err, int group, int window, int isa, float scale, "
      "float cap) -> ()");
  m.def("tiled_isa() -> int", &attnplug_cpu_fused::tiled_isa);
  m.def(
      "attend_write(Tensor q, Tensor k_new, Tensor v_new, Tensor(a!) k_cache, Tensor(b!) v_cache, "
      "Tensor req_to_token, Tensor plan, Tensor? mask, Tensor? sinks, Tensor(c!) err, Tensor params, "
      "int heads_per_item, Tensor slots) -> Tensor");
}

TORCH_LIBRARY_IMPL(attnplug_cpu_fused, CPU, m) {
  m.impl("attend", &attnplug_cpu_fused::attend);
  m.impl("extend_tiled", &attnplug_cpu_fused::extend_tiled);
  m.impl("attend_write", &attnplug_cpu_fused::attend_write);
}
