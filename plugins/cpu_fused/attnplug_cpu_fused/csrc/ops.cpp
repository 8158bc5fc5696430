// The op attnplug_cpu_fused::attend: the fused kernel (attention.cpp) behind a torch op schema.
//
// Tensors in (no pointers baked by Python); the output rows of the work rows are written in place
// (`out` is declared mutated, so functionalization and torch.compile see the write; so is `work`, whose
// header holds the error record). The kernel
// variant is chosen once per process from cpuid (`isa()`), and its work items run on torch's
// intra-op pool through at::parallel_for: one OpenMP runtime in the process, torch's.
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <cstdlib>
#include <cstring>
#include <initializer_list>
#include <memory>
#include <string>
#include <tuple>

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

// extend_tiled's plan, request-to-token table and error record
void check_plan_args(const char* op, const at::Tensor& plan, const at::Tensor& req_to_token, const at::Tensor& err) {
  TORCH_CHECK(plan.scalar_type() == at::kLong && plan.dim() == 2 && plan.size(1) == 8 && plan.is_contiguous(),
              "attnplug_cpu_fused::", op, ": plan must be a contiguous int64 [B, 8]");
  TORCH_CHECK(req_to_token.scalar_type() == at::kLong && req_to_token.dim() == 2 && req_to_token.stride(1) == 1,
              "attnplug_cpu_fused::", op, ": req_to_token must be int64 [R, L] with a contiguous last dim");
  TORCH_CHECK(err.scalar_type() == at::kLong && err.numel() >= 4 && err.is_contiguous(),
              "attnplug_cpu_fused::", op, ": err must be a contiguous int64 tensor of 4");
}

// The op's per-forward and per-layer tensors. Each argument of the schema costs a call from Python
// ~0.1 us of parsing (an int or a None more than a tensor), so what depends only on the forward is one
// int64 tensor `work` and what depends only on the layer one float64 tensor `params`, each made once:
//
// work [1 + B + M, 8] int64 (contiguous): row 0 the header (B work rows, KV heads per work item, E: the
// target-verify mask's side (0: none), the threads the last call ran its work items on (written by the
// call), then the error record: code, work row, position, slot value,
// the kernel's first failure, also raised as an error; the code is 0 after a call that succeeded); rows
// 1 .. B the plan (kernel.h: DecodeArgs.plan); then, when E > 0, the mask [B, E, E] as bytes (1: the
// query sees the draft key), M = ceil(B * E * E / 64) rows.
constexpr int64_t WORK_COLS = 8, WORK_THREADS = 3, WORK_ERR = 4;
// params [7] or [7 + H] float64: group, window (-1: none), scale, cap (0: none), k_scale, v_scale, sinks
// (0: none; 1: the H query heads' sinks follow)
constexpr int64_t PARAMS = 7;

// q [T, H, D]; k_new/v_new [T, Hkv, D/Dv] or None (cross-attention); k_cache/v_cache [slots, Hkv, D/Dv]
// (last dim contiguous); req_to_token [R, L] int64; params, work: above; out [T, H, Dv] written for the
// work rows' queries
void attend(const at::Tensor& q, const std::optional<at::Tensor>& k_new, const std::optional<at::Tensor>& v_new,
            const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& req_to_token,
            const at::Tensor& params, at::Tensor& work, at::Tensor& out) {
  check_cpu(q, "q");
  TORCH_CHECK(params.scalar_type() == at::kDouble && params.dim() == 1 && params.numel() >= PARAMS &&
                  params.is_contiguous() && params.device().is_cpu(),
              "attnplug_cpu_fused::attend: params must be a contiguous float64 CPU tensor of 7 (group, window, "
              "scale, cap, k_scale, v_scale, sinks 0/1) followed by the H sinks when sinks is 1");
  const double* pr = params.data_ptr<double>();
  const int64_t group = int64_t(pr[0]), window = int64_t(pr[1]);
  const double scale = pr[2], cap = pr[3], k_scale = pr[4], v_scale = pr[5];
  const bool has_sinks = pr[6] != 0.0;
  TORCH_CHECK(work.scalar_type() == at::kLong && work.dim() == 2 && work.sizes()[1] == WORK_COLS &&
                  work.sizes()[0] >= 1 && work.is_contiguous() && work.device().is_cpu(),
              "attnplug_cpu_fused::attend: work must be a contiguous int64 CPU tensor [1 + B + M, 8] (a header "
              "row, the plan's B rows, the mask's M rows)");
  int64_t* wk = work.data_ptr<int64_t>();
  const int64_t B = wk[0], heads_per_item = wk[1], E = wk[2];
  TORCH_CHECK(B >= 0 && B < (int64_t(1) << 31) && heads_per_item >= 1 && heads_per_item < (int64_t(1) << 31) &&
                  E >= 0 && E <= 4096,
              "attnplug_cpu_fused::attend: work's header holds B=", B, ", heads per item ", heads_per_item, ", E=", E,
              " (expected 0 <= B < 2^31, 1 <= heads per item, 0 <= E <= 4096)");
  const int64_t mask_rows = (B * E * E + 8 * WORK_COLS - 1) / (8 * WORK_COLS);
  TORCH_CHECK(work.sizes()[0] == 1 + B + mask_rows, "attnplug_cpu_fused::attend: work has ", work.sizes()[0],
              " rows; its header (B=", B, ", mask side E=", E, ") needs ", 1 + B + mask_rows);
  TORCH_CHECK(q.dim() == 3 && out.dim() == 3 && k_cache.dim() == 3 && v_cache.dim() == 3,
              "attnplug_cpu_fused::attend: q, out, k_cache and v_cache must be 3-d");
  // sizes and strides read once (TensorImpl::size(d) / stride(d) are out-of-line calls with a dim wrap)
  const c10::IntArrayRef q_sz = q.sizes(), q_str = q.strides(), o_sz = out.sizes(), o_str = out.strides();
  const c10::IntArrayRef k_sz = k_cache.sizes(), k_str = k_cache.strides(), v_sz = v_cache.sizes(), v_str = v_cache.strides();
  TORCH_CHECK(q_str[2] == 1 && o_str[2] == 1 && k_str[2] == 1 && v_str[2] == 1,
              "attnplug_cpu_fused::attend: q, out, k_cache and v_cache need a contiguous last dim");
  TORCH_CHECK(out.scalar_type() == q.scalar_type(), "attnplug_cpu_fused::attend: out is ", out.scalar_type(),
              ", q is ", q.scalar_type());
  TORCH_CHECK(req_to_token.scalar_type() == at::kLong && req_to_token.dim() == 2 && req_to_token.strides()[1] == 1,
              "attnplug_cpu_fused::attend: req_to_token must be int64 [R, L] with a contiguous last dim");
  const int64_t T = q_sz[0], H = q_sz[1], Hkv = k_sz[1], G = group, D = q_sz[2], Dv = o_sz[2];
  TORCH_CHECK(G > 0 && H == Hkv * G && o_sz[1] == H && k_sz[2] == D && v_sz[2] == Dv && v_sz[1] == Hkv && o_sz[0] == T,
              "attnplug_cpu_fused::attend: shapes disagree (q ", q_sz, ", k_cache ", k_sz, ", v_cache ", v_sz, ", out ", o_sz,
              ", group ", G, ")");
  TORCH_CHECK(params.numel() == (has_sinks ? PARAMS + H : PARAMS), "attnplug_cpu_fused::attend: params has ",
              params.numel(), " values; with sinks ", has_sinks ? 1 : 0, " it needs ", has_sinks ? PARAMS + H : PARAMS,
              " (", H, " query heads)");
  DecodeArgs a{};
  a.q = q.data_ptr(); a.q_st = q_str[0]; a.q_sh = q_str[1];
  a.k = k_cache.data_ptr(); a.k_ss = k_str[0]; a.k_sh = k_str[1];
  a.v = v_cache.data_ptr(); a.v_ss = v_str[0]; a.v_sh = v_str[1];
  TORCH_CHECK(k_new.has_value() == v_new.has_value(), "attnplug_cpu_fused::attend: k_new and v_new: both or neither");
  if (k_new.has_value()) {
    const at::Tensor &kn = *k_new, &vn = *v_new;
    TORCH_CHECK(kn.dim() == 3 && vn.dim() == 3, "attnplug_cpu_fused::attend: k_new/v_new must be 3-d");
    const c10::IntArrayRef kn_sz = kn.sizes(), kn_str = kn.strides(), vn_sz = vn.sizes(), vn_str = vn.strides();
    TORCH_CHECK(kn_str[2] == 1 && vn_str[2] == 1 && kn_sz[1] == Hkv && vn_sz[1] == Hkv && kn_sz[2] == D && vn_sz[2] == Dv &&
                    kn_sz[0] == T && vn_sz[0] == T,
                "attnplug_cpu_fused::attend: k_new/v_new must be [T, Hkv, D/Dv] with a contiguous last dim");
    TORCH_CHECK(kn.scalar_type() == vn.scalar_type() &&
                    (kn.scalar_type() == q.scalar_type() || kn.scalar_type() == at::kFloat),
                "attnplug_cpu_fused::attend: k_new/v_new must be in q's dtype or float32");
    a.kn = kn.data_ptr(); a.kn_st = kn_str[0]; a.kn_sh = kn_str[1];
    a.vn = vn.data_ptr(); a.vn_st = vn_str[0]; a.vn_sh = vn_str[1];
    a.new_f32 = kn.scalar_type() == at::kFloat ? 1 : 0;
  }
  a.r2t = req_to_token.data_ptr<int64_t>(); a.r2t_s = req_to_token.strides()[0];
  a.plan = wk + WORK_COLS;
  if (E > 0) {
    a.mask = reinterpret_cast<const uint8_t*>(wk + WORK_COLS * (1 + B)); a.m_sb = E * E; a.m_sq = E;
  }
  float sinks[256];  // the sinks as float32 (the kernel's type); more heads than this: rare, on the heap
  std::unique_ptr<float[]> more;
  if (has_sinks) {
    float* s = sinks;
    if (H > 256) { more.reset(new float[H]); s = more.get(); }
    for (int64_t h = 0; h < H; ++h) s[h] = float(pr[PARAMS + h]);
    a.sinks = s;
  }
  a.o = out.data_ptr(); a.o_st = o_str[0]; a.o_sh = o_str[1];
  a.q_dtype = code_of(q.scalar_type());
  a.kv_dtype = code_of(k_cache.scalar_type());
  TORCH_CHECK(k_cache.scalar_type() == v_cache.scalar_type(), "attnplug_cpu_fused::attend: k_cache and v_cache dtypes differ");
  a.B = int32_t(B); a.Hkv = int32_t(Hkv); a.G = int32_t(G); a.D = int32_t(D); a.Dv = int32_t(Dv);
  a.window = int32_t(window);
  a.heads_per_item = int32_t(heads_per_item);
  a.nthreads = int32_t(at::get_num_threads());
  a.scale = float(scale); a.cap = float(cap); a.k_scale = float(k_scale); a.v_scale = float(v_scale);
  a.num_slots = k_sz[0];
  int64_t* err = wk + WORK_ERR;
  a.err = err;
  a.parallel = run_parallel;  // torch's intra-op pool: one OpenMP runtime in the process
  a.threads_used = wk + WORK_THREADS;
  const int rc = variant().fn(&a);
  if (rc == RC_OK) return;
  if (rc == RC_SHAPE || rc == RC_DTYPE) err[0] = rc;
  TORCH_CHECK(false, "attnplug_cpu_fused::attend failed with code ", rc,
              rc == RC_SHAPE ? " (a shape the kernel does not take: head dims must be multiples of 16)"
              : rc == RC_DTYPE ? " (a dtype pairing the kernel does not take)"
              : rc == RC_BAD_SLOT ? " (a slot read through req_to_token is out of range)"
              : rc == RC_NO_MEMORY ? " (scratch memory could not be allocated)"
                                   : " (a work row past the scratch sized for the call)",
              "; record in work[0, 4:8]: ", err[0], " ", err[1], " ", err[2], " ", err[3]);
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

// the body a bf16 extend runs at isa 0 and why (extend_tiled.h: attnplug_extend_tiled_bf16_isa): the isa code,
// vdpbf16ps flops a cycle over the float32 FMA's as measured, the power of two the choice compared, and how
// it was had (0 not measured, 1 measured, 2 $ATTNPLUG_CPU_FUSED_DPBF16_RATE)
std::tuple<int64_t, double, double, int64_t> tiled_bf16_isa() {
  double info[3] = {0.0, 0.0, 0.0};
  const int64_t isa = attnplug_extend_tiled_bf16_isa(info);
  return {isa, info[0], info[1], int64_t(info[2])};
}

// attend_write: `attend` into a fresh output, then -- only once the attention returned -- this forward's new
// K/V rows written into the caches at `slots` (k_cache[slots[i]] = k_new[i], the same for V): what the
// skeleton's write after the kernel does with two index_copy_ calls, in the same call. k_new/v_new [T, Hkv,
// D/Dv] in the caches' dtype; slots int64 [T], each in [0, slots of the cache). Every check runs before
// anything is written: a call that raises (a bad argument, a slot out of range, the kernel's own failure
// record) leaves the caches as they were. Returns the output [T, H, Dv] in q's dtype (every row the work
// rows cover is written; the caller passes work rows covering every token).
at::Tensor attend_write(const at::Tensor& q, const at::Tensor& k_new, const at::Tensor& v_new, at::Tensor& k_cache,
                        at::Tensor& v_cache, const at::Tensor& req_to_token, const at::Tensor& params,
                        at::Tensor& work, const at::Tensor& slots) {
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
  attend(q, k_new, v_new, k_cache, v_cache, req_to_token, params, work, out);
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
      "Tensor params, Tensor(a!) work, Tensor(b!) out) -> ()");
  m.def("isa() -> str", &attnplug_cpu_fused::isa);
  m.def(
      "extend_tiled(Tensor q, Tensor k_new, Tensor v_new, Tensor k_cache, Tensor v_cache, Tensor req_to_token, "
      "Tensor plan, Tensor? sinks, Tensor(a!) out, Tensor(b!) err, int group, int window, int isa, float scale, "
      "float cap) -> ()");
  m.def("tiled_isa() -> int", &attnplug_cpu_fused::tiled_isa);
  m.def("tiled_bf16_isa() -> (int, float, float, int)", &attnplug_cpu_fused::tiled_bf16_isa);
  m.def(
      "attend_write(Tensor q, Tensor k_new, Tensor v_new, Tensor(a!) k_cache, Tensor(b!) v_cache, "
      "Tensor req_to_token, Tensor params, Tensor(c!) work, Tensor slots) -> Tensor");
}

TORCH_LIBRARY_IMPL(attnplug_cpu_fused, CPU, m) {
  m.impl("attend", &attnplug_cpu_fused::attend);
  m.impl("extend_tiled", &attnplug_cpu_fused::extend_tiled);
  m.impl("attend_write", &attnplug_cpu_fused::attend_write);
}
