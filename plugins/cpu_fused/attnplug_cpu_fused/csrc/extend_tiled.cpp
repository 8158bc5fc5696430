// Tiled paged attention for long extends (prefill, chunked prefill) on CPU; entry in extend_tiled.h.
//
// Work items are (request, KV head, query range): a range holds ITEM_SUBS sub-tiles of QS = 128 / G
// consecutive queries of one request, each sub-tile's rows (query, head of the KV head's group), so the G
// query heads of a KV head share every key tile (GQA: each K/V row is read once per item, not once per query
// head). Per item: each sub-tile's queries are packed once, transposed ([D][rows], rows padded to a multiple
// of 16; through 16 x 16 register transposes under AVX-512), then key tiles of KT = 48 keys from the first
// key the item's first query sees (its window) to the last query's key (causal: tiles past the diagonal are
// never visited) are read once — without vdpbf16ps packed into contiguous float32 rows (bf16 widened: a
// page's rows of one head are a head's stride apart) — and go through every sub-tile that sees one of their
// keys (a sub-tile skips the tiles past its own last query's key and before its first query's window):
//   scores S^T[key][row] = K . Q^T  — a register tile of RB keys x (rows / 16) vectors, each key's
//     element broadcast from its packed row; bf16 under AVX-512 BF16 pinned (isa 4): pairs of elements
//     read in place through vdpbf16ps (exact products, float32 accumulation);
//   masking only on tiles that cross the diagonal or the window's edge (select -inf, never add);
//   online softmax vectorised across rows (a running maximum that moves only when passed by more than 8,
//     so most tiles leave the accumulators unscaled; exp through AVX-512's round and scale where it has
//     them);
//   O += P V — register tiles of 6 rows x 4 vectors (vdpbf16ps: 4 x 4, P rounded to bf16 to nearest
//     even, two keys' V rows interleaved once per tile); a tile holding a key hidden from some row adds a
//     value row to a row only where its probability is not 0 (0 * NaN is NaN: garbage in a later new
//     token never reaches an earlier query).
// Output rows are divided once by the softmax sum (plus exp(sink - max) with sinks; a row that sees
// no key is zeros) and rounded once to the model dtype.
//
// Where the CPU has AMX (and Linux grants this process the tile data) both dtypes run item_amx instead:
// query tiles of 256 / G queries, key tiles of 64 keys, S = Q K^T and O += P V through tdpbf16ps tiles
// (float32 as three bf16 parts an operand, six products), the softmax per row in float32.
//
// The instruction set is chosen at run time (cpuid through __builtin_cpu_supports): the body below is
// compiled once per ISA into its own namespace (this file includes itself with ET_NS / ET_TARGET set),
// every function of it carrying that ISA's target attribute, so the file builds the same whether the
// compiler runs with -march=native or for a baseline x86-64 (per-ISA objects).

#ifndef ATTNPLUG_ET_BODY

#include "extend_tiled.h"
#include "scratch.h"

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <algorithm>
#include <type_traits>
#include <utility>
#include <vector>
#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#include <immintrin.h>
#include <x86intrin.h>  // __rdtsc (bf16_choice)
#define ATTNPLUG_ET_X86 1
// the AMX body needs a compiler with the amx-tile / amx-bf16 targets (GCC 11, clang 12); an older one
// builds the other bodies and the CPU's best is then avx512bf16
#if (defined(__clang__) && __clang_major__ >= 12) || (!defined(__clang__) && defined(__GNUC__) && __GNUC__ >= 11)
#define ATTNPLUG_ET_AMX 1
#endif
#include "amx.h"  // amx_usable() and the tile configuration record, shared with attention.cpp
#endif

#pragma GCC diagnostic ignored "-Wpsabi"

namespace {

constexpr int KT = 48;     // keys per tile (a multiple of every register tile's key count: 24, 12, 8, 6)
constexpr int MROWS = 128;  // rows per query sub-tile at most (queries x G): each K/V row read serves them all
constexpr int ITEM_SUBS = 4;  // sub-tiles of one work item: each key tile is read and packed once for all
constexpr int AMROWS = 256;  // the same for the AMX tiles (measured 11% faster than 128: each key tile's
                             // K / V split, transposes and pairing serve twice the rows)
constexpr int PLAN = 8;    // int64 fields per plan row

typedef float vf __attribute__((vector_size(64)));
typedef int32_t vi __attribute__((vector_size(64)));
typedef uint32_t vu __attribute__((vector_size(64)));
typedef uint16_t vh __attribute__((vector_size(32)));

typedef int (*ItemFn)(const TiledArgs&, int b, int h, int i0, int i1, float* scratch);

using Scratch = attnplug_cpu_fused::ScratchBuffer<false>;  // one thread's scratch (scratch.h)
thread_local Scratch tl_tiled;

// floats of scratch one item needs (see item() and item_amx(): their layouts; the larger of the two)
size_t scratch_floats(int D, int Dv) {
  const size_t mp = MROWS;
  const size_t fma = ITEM_SUBS * (size_t(D) * mp + mp * Dv + 5 * mp) + KT * mp + KT / 2 * mp + KT / 2 * size_t(Dv) +
                     size_t(D > Dv ? D : Dv) + size_t(KT) * (D + Dv) + 64;
  const size_t dp = (size_t(D) + 31) / 32 * 32, akt = 64, am = AMROWS;  // item_amx: D padded to 32, key tiles of 64
  const size_t amx = am * Dv + am * akt + 3 * am * akt / 2 + 3 * am * dp / 2 + 3 * dp * akt / 2 + 3 * akt * Dv / 2 +
                     4 * am + (dp > size_t(Dv) ? dp : size_t(Dv)) + 16;  // float32: three bf16 parts an operand
  return fma > amx ? fma : amx;
}

}  // namespace

#define ATTNPLUG_ET_BODY 1

#define ET_NS et_portable
#define ET_TARGET
#define ET_DP 0
#include "extend_tiled.cpp"
#undef ET_NS
#undef ET_TARGET
#undef ET_DP

#ifdef ATTNPLUG_ET_X86
#define ET_NS et_avx2
#define ET_TARGET __attribute__((target("avx2,fma")))
#define ET_DP 0
#include "extend_tiled.cpp"
#undef ET_NS
#undef ET_TARGET
#undef ET_DP

#define ET_NS et_avx512
#define ET_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,fma")))
#define ET_DP 0
#define ET_X512 1
#include "extend_tiled.cpp"
#undef ET_NS
#undef ET_TARGET
#undef ET_DP
#undef ET_X512

#define ET_NS et_avx512bf16
#define ET_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,fma")))
#define ET_DP 1
#define ET_X512 1
#include "extend_tiled.cpp"
#undef ET_NS
#undef ET_TARGET
#undef ET_DP
#undef ET_X512

#ifdef ATTNPLUG_ET_AMX
// AMX (Sapphire Rapids and later): bf16 and float32 (as three bf16 parts) through tdpbf16ps tiles (item_amx)
#define ET_NS et_amx
#define ET_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,fma,amx-tile,amx-bf16")))
#define ET_DP 1
#define ET_AMX 1
#define ET_X512 1
#include "extend_tiled.cpp"
#undef ET_NS
#undef ET_TARGET
#undef ET_DP
#undef ET_AMX
#undef ET_X512
#endif  // ATTNPLUG_ET_AMX
#endif

namespace {

#ifdef ATTNPLUG_ET_X86
// AMX usable in this process (amx.h: CPU, OS tile state, Linux's grant of the tile data, the
// $ATTNPLUG_CPU_FUSED_AMX knob); never where this compiler built no AMX body
bool amx_usable() {
#if !defined(ATTNPLUG_ET_AMX) || !defined(__x86_64__)
  return false;
#else
  return attnplug_cpu_fused::amx_usable();
#endif
}
#endif

int cpu_isa() {
#ifdef ATTNPLUG_ET_X86
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq")) {
    if (!__builtin_cpu_supports("avx512bf16")) return 3;
    return amx_usable() ? 5 : 4;
  }
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return 2;
#endif
  return 1;
}

#ifdef ATTNPLUG_ET_X86
// -- the bf16 body without AMX, chosen by the measured rate of vdpbf16ps -------------------------------------
//
// A CPU with AVX-512 BF16 and no usable AMX runs bf16 extends either through vdpbf16ps (isa 4's bf16 body:
// two products an instruction, P rounded to bf16) or widened to float32 and the FMA tiles (isa 3's). Which
// is faster depends on how fast the core issues vdpbf16ps against vfmadd231ps, which cpuid does not say: on
// a Sapphire Rapids Xeon vdpbf16ps zmm issues at a quarter of the FMA's rate (half its flops: widening wins),
// a core issuing it at the FMA's rate gets twice the FMA's flops from it. So it is measured, once a process:
// 24 independent accumulators in registers, each loop 128 x 24 instructions of one kind (no memory operand),
// FMA and vdpbf16ps loops alternated 7 times after a warm-up, the fastest of each (a preempted or throttled
// loop only ever gets slower), timed with rdtsc (both loops in the same ticks: their ratio does not depend on
// the TSC's rate). About 20 us. docs/performance.md, "Non-AMX extend, fourth round (kext3)".
#define ET_ACC(ins, n) ins " %%zmm31, %%zmm30, %%zmm" #n "\n\t"
#define ET_ACC24(ins)                                                                                            \
  ET_ACC(ins, 0) ET_ACC(ins, 1) ET_ACC(ins, 2) ET_ACC(ins, 3) ET_ACC(ins, 4) ET_ACC(ins, 5) ET_ACC(ins, 6)        \
  ET_ACC(ins, 7) ET_ACC(ins, 8) ET_ACC(ins, 9) ET_ACC(ins, 10) ET_ACC(ins, 11) ET_ACC(ins, 12) ET_ACC(ins, 13)   \
  ET_ACC(ins, 14) ET_ACC(ins, 15) ET_ACC(ins, 16) ET_ACC(ins, 17) ET_ACC(ins, 18) ET_ACC(ins, 19)               \
  ET_ACC(ins, 20) ET_ACC(ins, 21) ET_ACC(ins, 22) ET_ACC(ins, 23)
#define ET_Z(n) "vpxord %%zmm" #n ", %%zmm" #n ", %%zmm" #n "\n\t"
#define ET_ZERO                                                                                                  \
  ET_Z(0) ET_Z(1) ET_Z(2) ET_Z(3) ET_Z(4) ET_Z(5) ET_Z(6) ET_Z(7) ET_Z(8) ET_Z(9) ET_Z(10) ET_Z(11) ET_Z(12)     \
  ET_Z(13) ET_Z(14) ET_Z(15) ET_Z(16) ET_Z(17) ET_Z(18) ET_Z(19) ET_Z(20) ET_Z(21) ET_Z(22) ET_Z(23) ET_Z(30)   \
  ET_Z(31)
#define ET_CLOBBERS                                                                                              \
  "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm8", "xmm9", "xmm10", "xmm11", "xmm12",     \
  "xmm13", "xmm14", "xmm15", "xmm16", "xmm17", "xmm18", "xmm19", "xmm20", "xmm21", "xmm22", "xmm23", "xmm30",   \
  "xmm31", "cc"

// rdtsc ticks of `iters` x 24 register-only vfmadd231ps (dp = false) or vdpbf16ps (dp = true) zmm on zeros
__attribute__((target("avx512f,avx512bf16"), noinline)) uint64_t rate_loop_ticks(bool dp, int64_t iters) {
  _mm_lfence();
  const uint64_t t0 = __rdtsc();
  _mm_lfence();
  if (dp)
    asm volatile(ET_ZERO "1:\n\t" ET_ACC24("vdpbf16ps") "dec %0\n\tjnz 1b\n\t" : "+r"(iters) : : ET_CLOBBERS);
  else
    asm volatile(ET_ZERO "1:\n\t" ET_ACC24("vfmadd231ps") "dec %0\n\tjnz 1b\n\t" : "+r"(iters) : : ET_CLOBBERS);
  _mm_lfence();
  return __rdtsc() - t0;
}
#undef ET_ACC
#undef ET_ACC24
#undef ET_Z
#undef ET_ZERO
#undef ET_CLOBBERS
#endif

// vdpbf16ps flops a cycle over vfmadd231ps's (each vdpbf16ps zmm is 64 flops, each FMA 32) where vdpbf16ps
// pays: the measured ratio rounded to the nearest power of two (issue rates are ratios of pipes and cycles
// an instruction: 1/2, 1, 2 ...; a measurement up to 40% off rounds the same, so the choice is the same
// every run on a CPU) at least this. The model (docs/performance.md, kext3): the vdpbf16ps body's time is
// its products' (inverse to this ratio) plus its rest, measured on a Sapphire Rapids Xeon at its ratio 0.52
// and, with every vdpbf16ps issued as an FMA (ATTNPLUG_ET_DP_TIMING_AS_FMA), at 2; it equals the widened
// body's near 0.87: at 0.5 widening wins by ~1.5x, at 1 (half the FMA's instruction rate) vdpbf16ps by
// ~1.1-1.2x, at 2 (the FMA's rate) by ~1.8x
constexpr double DP_PAYS_AT = 1.0;

struct Bf16Choice {
  int isa;         // the body bf16 runs at isa 0 (5 AMX, 4 vdpbf16ps, 3 or below: widened to float32)
  double ratio;    // the measured flop ratio (0: not measured: AMX runs bf16, or the CPU lacks AVX-512 BF16)
  double rounded;  // the ratio the choice used (rounded to a power of two)
  int how;         // 0 not measured, 1 measured, 2 set by $ATTNPLUG_CPU_FUSED_DPBF16_RATE
};

Bf16Choice bf16_choice(int avail) {
  Bf16Choice c{avail, 0.0, 0.0, 0};
  if (avail != 4) return c;  // AMX runs bf16 (5); no vdpbf16ps (3 and below): widened, nothing to measure
  const char* env = std::getenv("ATTNPLUG_CPU_FUSED_DPBF16_RATE");
  if (env != nullptr && *env != '\0') {  // what-if and tests: this flop ratio instead of the measured one
    char* end = nullptr;
    const double r = std::strtod(env, &end);
    if (end != env && *end == '\0' && r > 0.0 && std::isfinite(r)) {
      c.ratio = r;
      c.how = 2;
    }
  }
#ifdef ATTNPLUG_ET_X86
  if (c.how == 0) {
    constexpr int64_t N = 128;
    (void)rate_loop_ticks(false, 4 * N);  // warm-up (a core that lowers its clock for 512-bit work does it here)
    uint64_t fma = UINT64_MAX, dp = UINT64_MAX;
    for (int r = 0; r < 7; ++r) {
      const uint64_t f = rate_loop_ticks(false, N), d = rate_loop_ticks(true, N);
      fma = f < fma ? f : fma;
      dp = d < dp ? d : dp;
    }
    c.ratio = dp > 0 ? 2.0 * double(fma) / double(dp) : 0.0;
    c.how = 1;
  }
#endif
  c.rounded = c.ratio > 0.0 ? std::exp2(std::round(std::log2(c.ratio))) : 0.0;
  c.isa = c.how != 0 && c.rounded >= DP_PAYS_AT ? 4 : 3;
  return c;
}

ItemFn item_fn(int isa, int dtype) {
  switch (isa) {
#ifdef ATTNPLUG_ET_X86
#ifdef ATTNPLUG_ET_AMX
    case 5: return dtype == 0 ? et_amx::item_f32amx : et_amx::item_bf16;
#endif
    case 4: return dtype == 0 ? et_avx512bf16::item_f32 : et_avx512bf16::item_bf16;
    case 3: return dtype == 0 ? et_avx512::item_f32 : et_avx512::item_bf16;
    case 2: return dtype == 0 ? et_avx2::item_f32 : et_avx2::item_bf16;
#endif
    default: return dtype == 0 ? et_portable::item_f32 : et_portable::item_bf16;
  }
}

void fail(const TiledArgs& a, int64_t code, int64_t row, int64_t pos, int64_t slot) {  // the first failure wins
  int64_t none = 0;
  if (__atomic_compare_exchange_n(&a.err[0], &none, code, false, __ATOMIC_ACQ_REL, __ATOMIC_RELAXED)) {
    a.err[1] = row;
    a.err[2] = pos;
    a.err[3] = slot;
  }
}

// a call's work items, taken one at a time by every worker (dynamic schedule: items differ in keys)
struct Work {
  const TiledArgs* a;
  ItemFn fn;
  const int32_t* items;  // (request, KV head, first query) triples
  int64_t n;
  size_t want;  // scratch floats per item
  int QT;
  int64_t next;
  int failed;  // set once any item failed: the others stop early
};

void run_items(void* ctx) {
  Work& w = *static_cast<Work*>(ctx);
  const TiledArgs& a = *w.a;
  for (;;) {
    const int64_t it = __atomic_fetch_add(&w.next, 1, __ATOMIC_RELAXED);
    if (it >= w.n || __atomic_load_n(&w.failed, __ATOMIC_RELAXED)) return;
    float* scr = tl_tiled.get(w.want);
    if (scr == nullptr) {
      fail(a, 4, w.items[3 * it], -1, int64_t(w.want * 4));
      __atomic_store_n(&w.failed, 1, __ATOMIC_RELAXED);
      return;
    }
    const int b = w.items[3 * it], h = w.items[3 * it + 1], i0 = w.items[3 * it + 2];
    const int nq = int(a.plan[PLAN * b + 4]);
    w.fn(a, b, h, i0, i0 + w.QT < nq ? i0 + w.QT : nq, scr);
  }
}

}  // namespace

extern "C" {

int32_t attnplug_extend_tiled_isa(void) {
  static const int isa = cpu_isa();
  return isa;
}

int32_t attnplug_extend_tiled_bf16_isa(double* info) {
  static const Bf16Choice c = bf16_choice(attnplug_extend_tiled_isa());  // measured once, on first use
  if (info != nullptr) {
    info[0] = c.ratio;
    info[1] = c.rounded;
    info[2] = c.how;
  }
  return c.isa;
}

int64_t attnplug_extend_tiled_args_size(void) { return int64_t(sizeof(TiledArgs)); }

int attnplug_extend_tiled(const TiledArgs* ap) {
  if (ap == nullptr || ap->err == nullptr) return 1;
  const TiledArgs& a = *ap;
  a.err[0] = a.err[1] = a.err[2] = a.err[3] = 0;
  if (a.D <= 0 || a.Dv <= 0 || a.D % 16 || a.Dv % 16 || a.G <= 0 || a.G > 64 || a.Hkv <= 0 || a.B < 0 ||
      a.num_slots < 0 || a.nthreads <= 0)
    return 1;
  if (a.dtype != 0 && a.dtype != 1) return 2;
  const int avail = attnplug_extend_tiled_isa();
  int isa = a.isa == 0 ? avail : a.isa;
  if (isa < 1 || isa > avail) return 6;
  // Per CPU, with isa = 0 (the table in docs/performance.md, "The tiled extend kernel"):
  //   AMX usable (5)       float32: tdpbf16ps tiles, 3 bf16 parts an operand, 6 products; bf16: tdpbf16ps tiles
  //   AVX-512 BF16, no AMX float32: the avx512 FMA tiles;  bf16: vdpbf16ps where its measured flop rate pays
  //                        (bf16_choice: an AMD Zen 4 / Zen 5 is expected to), else widened to float32 and
  //                        the FMA tiles (a Sapphire Rapids Xeon with AMX refused: vdpbf16ps at half the
  //                        FMA's flops)
  //   AVX-512 (3), AVX2 (2), portable (1): that ISA's FMA tiles, bf16 widened
  // isa = 3 / 4 pin either bf16 body
  if (a.isa == 0 && isa == 4 && a.dtype == 1) isa = attnplug_extend_tiled_bf16_isa(nullptr);
  const ItemFn fn = item_fn(isa, a.dtype);
  const int QT = isa == 5 ? AMROWS / a.G : MROWS / a.G * ITEM_SUBS;
  std::vector<int32_t> items;  // (request, KV head, first query) triples
  for (int b = 0; b < a.B; ++b) {
    const int64_t* pl = a.plan + PLAN * b;
    const int64_t start = pl[1], nc = pl[2], nq = pl[4];
    // a whole request per row, keys at positions start + j, and indices that fit int32
    if (pl[7] != 0 || pl[5] != start + nc || nc < 0 || nq < 0 || nc + nq > INT32_MAX / 2) return 1;
    const int64_t* slots = a.r2t + pl[0] * a.r2t_s + start;
    for (int64_t j = 0; j < nc; ++j)
      if (slots[j] < 0 || slots[j] >= a.num_slots) {
        fail(a, 3, b, start + j, slots[j]);
        return 3;
      }
    for (int h = 0; h < a.Hkv; ++h)
      for (int64_t i0 = 0; i0 < nq; i0 += QT) {
        items.push_back(b);
        items.push_back(h);
        items.push_back(int32_t(i0));
      }
  }
  // largest items first (their queries x the keys they see; stable: a fixed order for given inputs): the
  // threads take items one at a time, and the last ones taken are the small ones, so none waits long for
  // another's last item (in request order the last items of a long request are its largest)
  if (a.nthreads > 1 && items.size() > 3) {
    const size_t n = items.size() / 3;
    std::vector<std::pair<int64_t, size_t>> cost(n);
    for (size_t it = 0; it < n; ++it) {
      const int64_t* pl = a.plan + PLAN * items[3 * it];
      const int64_t nc = pl[2], nq = pl[4], i0 = items[3 * it + 2], i1 = i0 + QT < nq ? i0 + QT : nq;
      int64_t keys = nc + (i0 + i1 + 1) / 2;  // the mean query's keys (causal)
      if (a.window >= 0 && keys > a.window + 1) keys = a.window + 1;
      cost[it] = {-(i1 - i0) * keys, it};
    }
    std::stable_sort(cost.begin(), cost.end(),
                     [](const std::pair<int64_t, size_t>& x, const std::pair<int64_t, size_t>& y) { return x.first < y.first; });
    std::vector<int32_t> sorted(items.size());
    for (size_t k = 0; k < n; ++k)
      for (int f = 0; f < 3; ++f) sorted[3 * k + f] = items[3 * cost[k].second + f];
    items.swap(sorted);
  }
  Work w{&a, fn, items.data(), int64_t(items.size() / 3), scratch_floats(a.D, a.Dv), QT, 0, 0};
  if (w.n == 0) return 0;
  if (a.parallel != nullptr) {
    a.parallel(w.n < a.nthreads ? w.n : a.nthreads, &w, run_items);
  } else {
#pragma omp parallel num_threads(a.nthreads)
    run_items(&w);
  }
  return int(a.err[0]);
}

}  // extern "C"

#else  // ATTNPLUG_ET_BODY: the kernel, once per instruction set

namespace ET_NS {

ET_TARGET inline vf splat(float x) { return vf{x, x, x, x, x, x, x, x, x, x, x, x, x, x, x, x}; }  // a broadcast (0 + x is not x for -0)
ET_TARGET inline vf loadf(const float* p) { vf v; std::memcpy(&v, p, sizeof v); return v; }
ET_TARGET inline void storef(float* p, vf v) { std::memcpy(p, &v, sizeof v); }
ET_TARGET inline vi loadi(const int32_t* p) { vi v; std::memcpy(&v, p, sizeof v); return v; }
ET_TARGET inline vf bits(vu u) { vf f; std::memcpy(&f, &u, sizeof f); return f; }
ET_TARGET inline vu ubits(vf f) { vu u; std::memcpy(&u, &f, sizeof u); return u; }

struct F32 {
  typedef float T;
  ET_TARGET static inline vf load(const T* p) { return loadf(p); }
  ET_TARGET static inline float one(const T* p) { return *p; }
  ET_TARGET static inline void put(T* p, float x) { *p = x; }
};
struct BF16 {
  typedef uint16_t T;
  ET_TARGET static inline vf load(const T* p) {
    vh h;
    std::memcpy(&h, p, sizeof h);
    return bits(__builtin_convertvector(h, vu) << 16);
  }
  ET_TARGET static inline float one(const T* p) { uint32_t u = uint32_t(*p) << 16; float f; std::memcpy(&f, &u, 4); return f; }
  ET_TARGET static inline void put(T* p, float x) {  // round to nearest even; NaN stays NaN
    uint32_t u;
    std::memcpy(&u, &x, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) { *p = uint16_t((u >> 16) | 0x40u); return; }
    u += 0x7fffu + ((u >> 16) & 1u);
    *p = uint16_t(u >> 16);
  }
};

// 16 float32 -> bf16 bits (in the low half of each lane), round to nearest even; NaN stays NaN
ET_TARGET inline vu to_bf16(vf x) {
  const vu u = ubits(x);
  const vu r = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  return (u & 0x7fffffffu) > 0x7f800000u ? (u >> 16) | 0x40u : r;
}

// 16 output values in the model dtype (bf16: rounded as BF16::put rounds one)
ET_TARGET inline void store16(float* p, vf x) { storef(p, x); }
ET_TARGET inline void store16(uint16_t* p, vf x) {
  const vh b = __builtin_convertvector(to_bf16(x), vh);
  std::memcpy(p, &b, sizeof b);
}

#define ATTNPLUG_VEXP_ATTR ET_TARGET
#include "vexp.h"
#undef ATTNPLUG_VEXP_ATTR

#if ET_X512
// 16 x 16 uint32 transpose: row p of the result (16 lanes) is lane p of the rows r[0..15]
ET_TARGET inline void tr16(__m512i* r) {
  __m512i t[16], u[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  }
  for (int g = 0; g < 4; ++g) {  // rows 4g .. 4g+3: u[4g + e] holds element 4L + e of each 128-bit lane L
    u[4 * g + 0] = _mm512_unpacklo_epi64(t[4 * g], t[4 * g + 2]);
    u[4 * g + 1] = _mm512_unpackhi_epi64(t[4 * g], t[4 * g + 2]);
    u[4 * g + 2] = _mm512_unpacklo_epi64(t[4 * g + 1], t[4 * g + 3]);
    u[4 * g + 3] = _mm512_unpackhi_epi64(t[4 * g + 1], t[4 * g + 3]);
  }
  for (int e = 0; e < 4; ++e) {
    const __m512i v0 = _mm512_shuffle_i32x4(u[e], u[4 + e], 0x44), v1 = _mm512_shuffle_i32x4(u[e], u[4 + e], 0xEE);
    const __m512i w0 = _mm512_shuffle_i32x4(u[8 + e], u[12 + e], 0x44), w1 = _mm512_shuffle_i32x4(u[8 + e], u[12 + e], 0xEE);
    r[0 + e] = _mm512_shuffle_i32x4(v0, w0, 0x88);
    r[4 + e] = _mm512_shuffle_i32x4(v0, w0, 0xDD);
    r[8 + e] = _mm512_shuffle_i32x4(v1, w1, 0x88);
    r[12 + e] = _mm512_shuffle_i32x4(v1, w1, 0xDD);
  }
}

// exp as vexp (vexp.h: the same reduction and polynomial, 0 below -87, NaN kept) with AVX-512's round and
// scale instructions in place of the floor and the exponent bits: the FMA tiles' softmax
ET_TARGET inline vf vexp_x(vf xv) {
  __m512 x;
  std::memcpy(&x, &xv, sizeof x);
  const __m512 xc = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));  // a NaN lane: -87 here, NaN again below
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(xc, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), xc);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  __m512 res = _mm512_scalef_ps(p, n);
  res = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.0f), _CMP_LT_OQ), res, _mm512_setzero_ps());
  res = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), res, x);
  vf out;
  std::memcpy(&out, &res, sizeof out);
  return out;
}
#define ET_EXP vexp_x
#else
#define ET_EXP vexp
#endif

// st[j][row] = sum over d of K_j[d] * qt[d][row], RB keys x NVR row vectors in registers; each key's
// element broadcast from its row (qt already holds q * scale)
template <class S, int NVR>
ET_TARGET void qk(float* st, int MP, const float* qt, const typename S::T* const* kr, int ktp, int D) {
  constexpr int RB = 24 / NVR;
  for (int j = 0; j < ktp; j += RB) {
    vf acc[RB][NVR];
    for (int jj = 0; jj < RB; ++jj)
      for (int v = 0; v < NVR; ++v) acc[jj][v] = vf{};
    const typename S::T* rp[RB];
    for (int jj = 0; jj < RB; ++jj) rp[jj] = kr[j + jj];
    for (int d = 0; d < D; ++d) {
      vf qv[NVR];
      for (int v = 0; v < NVR; ++v) qv[v] = loadf(qt + d * MP + 16 * v);
      for (int jj = 0; jj < RB; ++jj) {
        const vf kb = splat(S::one(rp[jj] + d));
        for (int v = 0; v < NVR; ++v) acc[jj][v] += kb * qv[v];
      }
    }
    for (int jj = 0; jj < RB; ++jj)
      for (int v = 0; v < NVR; ++v) storef(st + (j + jj) * MP + 16 * v, acc[jj][v]);
  }
}

#if ET_DP
#ifdef ATTNPLUG_ET_DP_TIMING_AS_FMA
// timing only, never in a build that computes (setup.py never defines it; wrong results): every vdpbf16ps of
// the bf16 body issued as a vfmadd231ps on the same registers, to time that body as a CPU issuing vdpbf16ps at
// the FMA's rate would run it (docs/performance.md, "Non-AMX extend, fourth round (kext3)")
#define ET_DPBF16(acc, x, y) _mm512_fmadd_ps(_mm512_castsi512_ps(x), _mm512_castsi512_ps(y), acc)
#else
#define ET_DPBF16(acc, x, y) _mm512_dpbf16_ps(acc, (__m512bh)(x), (__m512bh)(y))
#endif
// the same for bf16 through vdpbf16ps: qp[d/2][row] holds the row's bf16 pair (q[d], q[d+1]) (unscaled),
// each key's pair is broadcast from its row; scores scaled here, in float32
template <int NVR>
ET_TARGET void qk_dp(float* st, int MP, const uint32_t* qp, const uint16_t* const* kr, int ktp, int D, float scale) {
  constexpr int RB = 24 / NVR;
  for (int j = 0; j < ktp; j += RB) {
    __m512 acc[RB][NVR];
    for (int jj = 0; jj < RB; ++jj)
      for (int v = 0; v < NVR; ++v) acc[jj][v] = _mm512_setzero_ps();
    const uint16_t* rp[RB];
    for (int jj = 0; jj < RB; ++jj) rp[jj] = kr[j + jj];
    for (int d2 = 0; d2 < D / 2; ++d2) {
      __m512i qv[NVR];
      for (int v = 0; v < NVR; ++v) qv[v] = _mm512_loadu_si512(qp + d2 * MP + 16 * v);
      for (int jj = 0; jj < RB; ++jj) {
        uint32_t kk;
        std::memcpy(&kk, rp[jj] + 2 * d2, 4);
        const __m512i kb = _mm512_set1_epi32(int(kk));
        for (int v = 0; v < NVR; ++v) acc[jj][v] = ET_DPBF16(acc[jj][v], kb, qv[v]);
      }
    }
    const __m512 sc = _mm512_set1_ps(scale);
    for (int jj = 0; jj < RB; ++jj)
      for (int v = 0; v < NVR; ++v) _mm512_storeu_ps(st + (j + jj) * MP + 16 * v, _mm512_mul_ps(acc[jj][v], sc));
  }
}

// 16 lanes of two float32 vectors -> 16 bf16 pairs (lo in the low half of each lane), rounded to nearest even
// by vcvtne2ps2bf16 (which also reads and writes float32 denormals as zeros: a probability below 2^-126 of the
// row's maximum adds nothing)
ET_TARGET inline __m512i bf16_pairs(vf lo, vf hi) {
  __m512 l, h;
  std::memcpy(&l, &lo, sizeof l);
  std::memcpy(&h, &hi, sizeof h);
  const __m512i both = (__m512i)_mm512_cvtne2ps_pbh(h, l);  // lo's 16 in the low half, hi's in the high half
  const __m512i idx = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22, 6,
                                       21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  return _mm512_permutexvar_epi16(idx, both);
}

// acc[r][c..] += sum over key pairs of P pairs (bf16) x interleaved V pairs (bf16), RR rows x NV vectors
template <int RR, int NV>
ET_TARGET inline void pv_dp_block(float* acc, int Dv, const uint32_t* pp, int MP, const uint32_t* vp, int kp, int r0, int c0) {
  __m512 t[RR][NV];
  for (int rr = 0; rr < RR; ++rr)
    for (int v = 0; v < NV; ++v) t[rr][v] = _mm512_loadu_ps(acc + (r0 + rr) * Dv + c0 + 16 * v);
  for (int jp = 0; jp < kp; ++jp) {
    __m512i x[NV];
    for (int v = 0; v < NV; ++v) x[v] = _mm512_loadu_si512(vp + jp * Dv + c0 + 16 * v);
    for (int rr = 0; rr < RR; ++rr) {
      const __m512i p = _mm512_set1_epi32(int(pp[jp * MP + r0 + rr]));
      for (int v = 0; v < NV; ++v) t[rr][v] = ET_DPBF16(t[rr][v], p, x[v]);
    }
  }
  for (int rr = 0; rr < RR; ++rr)
    for (int v = 0; v < NV; ++v) _mm512_storeu_ps(acc + (r0 + rr) * Dv + c0 + 16 * v, t[rr][v]);
}
#endif

// acc[r][c..] += sum over keys j of st[j][r] * V_j[c..], RR rows x NV vectors in registers, V rows in place
template <class S, int RR, int NV>
ET_TARGET inline void pv_block(float* acc, int Dv, const float* st, int MP, const typename S::T* const* vr, int ktp,
                               int r0, int c0) {
  vf t[RR][NV];
  for (int rr = 0; rr < RR; ++rr)
    for (int v = 0; v < NV; ++v) t[rr][v] = loadf(acc + (r0 + rr) * Dv + c0 + 16 * v);
  for (int j = 0; j < ktp; ++j) {
    vf x[NV];
    for (int v = 0; v < NV; ++v) x[v] = S::load(vr[j] + c0 + 16 * v);
    for (int rr = 0; rr < RR; ++rr) {
      const vf p = splat(st[j * MP + r0 + rr]);
      for (int v = 0; v < NV; ++v) t[rr][v] += p * x[v];
    }
  }
  for (int rr = 0; rr < RR; ++rr)
    for (int v = 0; v < NV; ++v) storef(acc + (r0 + rr) * Dv + c0 + 16 * v, t[rr][v]);
}

// a tile holding keys hidden from some rows: a value row is added to a row only where its probability
// is not 0 (select, never multiply by zero: 0 * NaN is NaN)
template <class S>
ET_TARGET void pv_select(float* acc, int Dv, const float* st, int MP, const typename S::T* const* vr, int ktp, int M) {
  for (int r = 0; r < M; ++r) {
    float* ar = acc + r * Dv;
    for (int j = 0; j < ktp; ++j) {
      const float p = st[j * MP + r];
      if (p == 0.0f) continue;
      const vf pv = splat(p);
      for (int c = 0; c < Dv; c += 16) storef(ar + c, loadf(ar + c) + pv * S::load(vr[j] + c));
    }
  }
}

// What one work item (request b, KV head h, queries i0 .. i1 - 1 of the request) reads, built once per item
// (both bodies): the queries, the cache's K and V, this forward's new K / V rows of head h from the request's
// first new token, the request's slots from its first cached position read, its cached keys, its first query
// token, and the keys its queries see: jbeg (the first query's window) .. jend - 1 (causal: the last
// query's own key)
template <class T>
struct ItemSrc {
  const T *Q, *K, *V, *KN, *VN;
  const int64_t* slots;
  int64_t nc, t0, jbeg, jend;
};
template <class T>
ET_TARGET inline ItemSrc<T> item_src(const TiledArgs& a, int b, int h, int i0, int i1) {
  const int64_t* pl = a.plan + PLAN * b;
  const int64_t row = pl[0], start = pl[1], nc = pl[2], kn_t0 = pl[6];
  return {static_cast<const T*>(a.q),
          static_cast<const T*>(a.k),
          static_cast<const T*>(a.v),
          static_cast<const T*>(a.kn) + kn_t0 * a.kn_st + int64_t(h) * a.kn_sh,
          static_cast<const T*>(a.vn) + kn_t0 * a.vn_st + int64_t(h) * a.vn_sh,
          a.r2t + row * a.r2t_s + start,
          nc,
          pl[3],
          a.window >= 0 ? (nc + i0 - a.window > 0 ? nc + i0 - a.window : 0) : 0,
          nc + i1};
}

// the K and V rows of keys j0 .. j0 + ktp - 1 of one request and KV head (both bodies): a cached key's
// through its slot, a key of this forward's in place, past the causal end the zero row
template <class T>
ET_TARGET inline void key_rows(const TiledArgs& a, int h, const int64_t* slots, int64_t nc, int64_t jend,
                               const T* K, const T* V, const T* KN, const T* VN, const T* zeros, int64_t j0,
                               int ktp, const T** kr, const T** vr) {
  for (int j = 0; j < ktp; ++j) {
    const int64_t key = j0 + j;
    if (key >= jend) {
      kr[j] = vr[j] = zeros;
    } else if (key < nc) {
      kr[j] = K + slots[key] * a.k_ss + int64_t(h) * a.k_sh;
      vr[j] = V + slots[key] * a.v_ss + int64_t(h) * a.v_sh;
    } else {
      kr[j] = KN + (key - nc) * a.kn_st;
      vr[j] = VN + (key - nc) * a.vn_st;
    }
  }
}

// a query tile's output rows (both bodies): the value sums over the softmax sum plus the sink's share; a
// row that saw no key (every score -inf; a NaN score makes the sum NaN) is zeros, sinks or not
template <class S>
ET_TARGET inline void store_rows(const TiledArgs& a, int h, int i0, int G, int M, int Dv, int64_t t0,
                                 const float* mx, const float* ls, const float* acc) {
  typedef typename S::T T;
  T* O = static_cast<T*>(a.o);
  for (int r = 0; r < M; ++r) {
    const int qi = i0 + r / G, g = r % G, head = h * G + g;
    float den = ls[r];
    if (a.sinks != nullptr && mx[r] != -INFINITY) den += std::exp(a.sinks[head] - mx[r]);
    const bool none = mx[r] == -INFINITY && ls[r] == 0.0f;
    const float inv = none ? 0.0f : 1.0f / den;
    T* orow = O + (t0 + qi) * a.o_st + int64_t(head) * a.o_sh;
    const vf vinv = splat(inv);
    for (int d = 0; d < Dv; d += 16) store16(orow + d, none ? vf{} : loadf(acc + r * Dv + d) * vinv);
  }
}

template <class S>
ET_TARGET int item(const TiledArgs& a, int b, int h, int i0, int i1, float* scr) {
  typedef typename S::T T;
  // the item's queries i0 .. i1 - 1 go in sub-tiles of QS = MROWS / G queries (rows = queries x the group's
  // heads, at most MROWS), each with its own queries, accumulators and softmax state; every key tile is read
  // (and packed) once for all of them, and a sub-tile skips the tiles past its own causal end
  const int G = a.G, D = a.D, Dv = a.Dv, QS = MROWS / G, nsub = (i1 - i0 + QS - 1) / QS;
  const auto [Q, K, V, KN, VN, slots, nc, t0, jbeg, jend] = item_src<T>(a, b, h, i0, i1);
#if ET_DP
  constexpr bool dp = std::is_same<S, BF16>::value;
#else
  constexpr bool dp = false;
#endif
  // without vdpbf16ps each key tile's K and V rows are packed once into contiguous float32 rows (bf16
  // widened): the tiles read them from there, not through a page's head stride
  constexpr bool pack = !dp;
  typedef typename std::conditional<pack, F32, S>::type SC;
  // scratch (item_floats): per sub-tile its queries, accumulators, per-row max / sum / alpha / limits; then
  // the scores, P pairs, V pairs, zeros and the packed key tile, shared
  const size_t per_sub = size_t(D) * MROWS + size_t(MROWS) * Dv + 5 * MROWS;
  float* st = scr + per_sub * nsub;                                 // [KT][MP]
  uint32_t* pp = reinterpret_cast<uint32_t*>(st + KT * MROWS);     // [KT/2][MP]
  uint32_t* vp = pp + KT / 2 * MROWS;                              // [KT/2][Dv]
  T* zeros = reinterpret_cast<T*>(vp + size_t(KT / 2) * Dv);        // [max(D, Dv)]
  std::memset(zeros, 0, sizeof(float) * (D > Dv ? D : Dv));
  float* kw = reinterpret_cast<float*>(zeros) + (D > Dv ? D : Dv);  // [KT][D]: the key tile's K packed
  float* vw = kw + size_t(KT) * D;                                  // [KT][Dv]: and its V
  struct Sub {
    float *qt, *acc, *mx, *ls, *al;
    int32_t *hi, *lo;
    int i0, i1, M, NVR, MP;
    int64_t jbeg, jend;
  };
  Sub sub[ITEM_SUBS];
  for (int s = 0; s < nsub; ++s) {
    Sub& u = sub[s];
    u.qt = scr + per_sub * s;                                       // [D][MP] (dp: uint32 [D/2][MP])
    u.acc = u.qt + size_t(D) * MROWS;                               // [MP][Dv]
    u.mx = u.acc + size_t(MROWS) * Dv;
    u.ls = u.mx + MROWS;
    u.al = u.ls + MROWS;
    u.hi = reinterpret_cast<int32_t*>(u.al + MROWS);
    u.lo = u.hi + MROWS;
    u.i0 = i0 + s * QS;
    u.i1 = u.i0 + QS < i1 ? u.i0 + QS : i1;
    u.M = (u.i1 - u.i0) * G;
    u.NVR = (u.M + 15) / 16;  // row vectors (rows padded to 16s)
    u.MP = u.NVR * 16;
    u.jbeg = a.window >= 0 ? (nc + u.i0 - a.window > 0 ? nc + u.i0 - a.window : 0) : 0;
    u.jend = nc + u.i1;
    // the queries transposed 16 rows at a time (each store fills a row vector of qt; padding rows are
    // zeros, see nothing, and their output is never written)
    const int M = u.M, MP = u.MP;
    for (int r0 = 0; r0 < MP; r0 += 16) {
      const T* qr[16];
      for (int rr = 0; rr < 16; ++rr) {
        const int r = r0 + rr;
        if (r < M) {
          const int qi = u.i0 + r / G, g = r % G;
          qr[rr] = Q + (t0 + qi) * a.q_st + int64_t(h * G + g) * a.q_sh;
          u.hi[r] = int32_t(nc + qi);
          u.lo[r] = a.window >= 0 ? int32_t(nc + qi - a.window) : INT32_MIN;
        } else {
          qr[rr] = zeros;
          u.hi[r] = -1;
          u.lo[r] = 0;
        }
        u.mx[r] = -INFINITY;
        u.ls[r] = 0.0f;
      }
      if (dp) {
        uint32_t* qp = reinterpret_cast<uint32_t*>(u.qt);
        int d2 = 0;
#if ET_X512
        for (; 2 * d2 + 32 <= D; d2 += 16) {  // 16 rows x 16 pairs through a 16 x 16 register transpose
          __m512i blk[16];
          for (int rr = 0; rr < 16; ++rr) std::memcpy(&blk[rr], qr[rr] + 2 * d2, sizeof blk[rr]);
          tr16(blk);
          for (int p = 0; p < 16; ++p) std::memcpy(qp + (d2 + p) * MP + r0, &blk[p], sizeof blk[p]);
        }
#endif
        for (; d2 < D / 2; ++d2)
          for (int rr = 0; rr < 16; ++rr) std::memcpy(qp + d2 * MP + r0 + rr, qr[rr] + 2 * d2, 4);
      } else {
#if ET_X512
        const vf sc = splat(a.scale);
        for (int d0 = 0; d0 < D; d0 += 16) {  // 16 x 16 blocks through registers (D is a multiple of 16)
          __m512i blk[16];
          for (int rr = 0; rr < 16; ++rr) {
            const vf x = S::load(qr[rr] + d0);
            std::memcpy(&blk[rr], &x, sizeof x);
          }
          tr16(blk);
          for (int p = 0; p < 16; ++p) {
            vf x;
            std::memcpy(&x, &blk[p], sizeof x);
            storef(u.qt + (d0 + p) * MP + r0, x * sc);
          }
        }
#else
        for (int d = 0; d < D; ++d) {
          float* dst = u.qt + d * MP + r0;
          for (int rr = 0; rr < 16; ++rr) dst[rr] = S::one(qr[rr] + d) * a.scale;
        }
#endif
      }
    }
    std::memset(u.acc, 0, sizeof(float) * MP * Dv);
  }
  constexpr int KSTEP = 24;  // a multiple of every register tile's key count (24 / row vectors: 24, 12, 8, 6)
  const T* kr[KT];
  const T* vr[KT];
  for (int64_t j0 = jbeg; j0 < jend; j0 += KT) {
    const int kt = int(jend - j0 < KT ? jend - j0 : KT);
    const int ktp = (kt + KSTEP - 1) / KSTEP * KSTEP;  // whole register tiles, an even count (key pairs)
    key_rows(a, h, slots, nc, jend, K, V, KN, VN, zeros, j0, ktp, kr, vr);
    const typename SC::T* kc[KT];
    const typename SC::T* vc[KT];
    if constexpr (pack) {
      for (int j = 0; j < ktp; ++j) {
        for (int c = 0; c < D; c += 16) storef(kw + j * D + c, S::load(kr[j] + c));
        for (int c = 0; c < Dv; c += 16) storef(vw + j * Dv + c, S::load(vr[j] + c));
        kc[j] = kw + j * D;
        vc[j] = vw + j * Dv;
      }
    } else {
      for (int j = 0; j < ktp; ++j) {
        kc[j] = reinterpret_cast<const typename SC::T*>(kr[j]);
        vc[j] = reinterpret_cast<const typename SC::T*>(vr[j]);
      }
    }
#if ET_DP
    if constexpr (dp) {  // the tile's V rows interleaved in pairs once for every sub-tile
      const __m512i lo_idx = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8, 39, 7,
                                              38, 6, 37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
      const __m512i hi_idx = _mm512_add_epi16(lo_idx, _mm512_set1_epi16(16));
      for (int jp = 0; jp < ktp / 2; ++jp) {
        const uint16_t* ra = reinterpret_cast<const uint16_t*>(vr[2 * jp]);
        const uint16_t* rb = reinterpret_cast<const uint16_t*>(vr[2 * jp + 1]);
        int c = 0;
        for (; c + 32 <= Dv; c += 32) {  // 32 columns of two rows -> 32 pairs
          const __m512i x = _mm512_loadu_si512(ra + c), y = _mm512_loadu_si512(rb + c);
          _mm512_storeu_si512(vp + jp * Dv + c, _mm512_permutex2var_epi16(x, lo_idx, y));
          _mm512_storeu_si512(vp + jp * Dv + c + 16, _mm512_permutex2var_epi16(x, hi_idx, y));
        }
        for (; c < Dv; c += 16) {
          vh ha, hb;
          std::memcpy(&ha, ra + c, sizeof ha);
          std::memcpy(&hb, rb + c, sizeof hb);
          const vu w = __builtin_convertvector(ha, vu) | (__builtin_convertvector(hb, vu) << 16);
          std::memcpy(vp + jp * Dv + c, &w, sizeof w);
        }
      }
    }
#endif
    for (int s = 0; s < nsub; ++s) {
      const Sub& u = sub[s];
      // a tile past this sub-tile's last key (causal) or before its first query's window: nothing it sees
      if (j0 >= u.jend || j0 + kt <= u.jbeg) continue;
      const int NVR = u.NVR, MP = u.MP, M = u.M;
      float* const qt = u.qt;
      float* const acc = u.acc;
      float* const mx = u.mx;
      float* const ls = u.ls;
      float* const al = u.al;
      const int32_t* const hi = u.hi;
      const int32_t* const lo = u.lo;
      const int kts = int(u.jend - j0 < kt ? u.jend - j0 : kt);  // keys up to this sub-tile's causal end
      const int ktps = (kts + KSTEP - 1) / KSTEP * KSTEP;
      // scores in passes of at most 4 row vectors (64 rows: 24 accumulators), then the rest
#if ET_DP
      if constexpr (dp) {
        const uint32_t* qp = reinterpret_cast<const uint32_t*>(qt);
        const uint16_t* const* k16 = reinterpret_cast<const uint16_t* const*>(kr);
        int v0 = 0;
        for (; v0 + 4 <= NVR; v0 += 4) qk_dp<4>(st + 16 * v0, MP, qp + 16 * v0, k16, ktps, D, a.scale);
        switch (NVR - v0) {
          case 3: qk_dp<3>(st + 16 * v0, MP, qp + 16 * v0, k16, ktps, D, a.scale); break;
          case 2: qk_dp<2>(st + 16 * v0, MP, qp + 16 * v0, k16, ktps, D, a.scale); break;
          case 1: qk_dp<1>(st + 16 * v0, MP, qp + 16 * v0, k16, ktps, D, a.scale); break;
          default: break;
        }
      } else
#endif
      {
        int v0 = 0;
        for (; v0 + 4 <= NVR; v0 += 4) qk<SC, 4>(st + 16 * v0, MP, qt + 16 * v0, kc, ktps, D);
        switch (NVR - v0) {
          case 3: qk<SC, 3>(st + 16 * v0, MP, qt + 16 * v0, kc, ktps, D); break;
          case 2: qk<SC, 2>(st + 16 * v0, MP, qt + 16 * v0, kc, ktps, D); break;
          case 1: qk<SC, 1>(st + 16 * v0, MP, qt + 16 * v0, kc, ktps, D); break;
          default: break;
        }
      }
      // every key of the tile visible to every real row of the sub-tile: nothing to mask (and no padding key)
      const bool full = kts == ktps && j0 + kts - 1 <= nc + u.i0 && (a.window < 0 || j0 >= nc + u.i1 - 1 - a.window);
      for (int j = 0; j < ktps; ++j) {
        float* sr = st + j * MP;
        if (a.cap > 0.0f)
          for (int r = 0; r < MP; ++r) sr[r] = a.cap * std::tanh(sr[r] / a.cap);
        if (!full) {
          const vi key = vi{} + int32_t(j0 + j);
          for (int v = 0; v < NVR; ++v) {
            const vi seen = (key <= loadi(hi + 16 * v)) & (key >= loadi(lo + 16 * v));
            storef(sr + 16 * v, seen ? loadf(sr + 16 * v) : splat(-INFINITY));
          }
        }
      }
      // online softmax, vectorised across rows: running maximum (NaN scores do not move it), the
      // accumulators' rescale factor, probabilities in place of the scores, running sums
      for (int v = 0; v < NVR; ++v) {
        const vf m_old = loadf(mx + 16 * v);
        vf m = m_old;
        for (int j = 0; j < ktps; ++j) {
          const vf x = loadf(st + j * MP + 16 * v);
          m = x > m ? x : m;
        }
        // the running maximum moves only when a score passes it by more than 8 (or the row saw nothing
        // yet): probabilities stay below e^8 and most tiles leave the accumulators unscaled (the output
        // divides by the sum over the same shift, so any shift gives the same result; as item_amx)
        m = (m > m_old) & ((m_old == splat(-INFINITY)) | (m - m_old > 8.0f)) ? m : m_old;
        const vf mu = m == splat(-INFINITY) ? splat(0.0f) : m;  // a row that saw nothing yet: any finite shift
        const vf alpha = m == m_old ? splat(1.0f) : ET_EXP(m_old - mu);
        vf sum = vf{};
#if ET_DP
        if constexpr (dp) {  // P as bf16 pairs of two keys (rounded to nearest even) for vdpbf16ps, straight
                             // from the exponentials; as float32 too where the select path may need them
          for (int jp = 0; jp < ktps / 2; ++jp) {
            const vf p0 = ET_EXP(loadf(st + (2 * jp) * MP + 16 * v) - mu);
            const vf p1 = ET_EXP(loadf(st + (2 * jp + 1) * MP + 16 * v) - mu);
            if (!full) {
              storef(st + (2 * jp) * MP + 16 * v, p0);
              storef(st + (2 * jp + 1) * MP + 16 * v, p1);
            }
            _mm512_storeu_si512(pp + jp * MP + 16 * v, bf16_pairs(p0, p1));
            sum += p0 + p1;
          }
        } else
#endif
        for (int j = 0; j < ktps; ++j) {
          const vf p = ET_EXP(loadf(st + j * MP + 16 * v) - mu);
          storef(st + j * MP + 16 * v, p);
          sum += p;
        }
        storef(ls + 16 * v, loadf(ls + 16 * v) * alpha + sum);
        storef(mx + 16 * v, m);
        storef(al + 16 * v, alpha);
      }
      for (int r = 0; r < M; ++r) {
        if (al[r] == 1.0f) continue;
        const vf f = splat(al[r]);
        for (int c = 0; c < Dv; c += 16) storef(acc + r * Dv + c, loadf(acc + r * Dv + c) * f);
      }
      if (!full) {
        // a hidden key's probability is exactly 0, which the register tiles may multiply only by a finite
        // value row: a tile whose value rows are all finite goes through them, else the select path
        bool finite = true;
        for (int j = 0; j < ktps && finite; ++j) {
          vi bad = vi{};
          for (int c = 0; c < Dv; c += 16) {
            const vu w = ubits(SC::load(vc[j] + c));
            bad |= (vi)((w & 0x7f800000u) == 0x7f800000u);
          }
          for (int l = 0; l < 16; ++l) finite = finite && bad[l] == 0;
        }
        if (!finite) {
          pv_select<SC>(acc, Dv, st, MP, vc, ktps, M);
          continue;
        }
      }
#if ET_DP
      if constexpr (dp) {
        const int kp = ktps / 2;  // pp: written by the softmax above
        // blocks of 6 rows x 64 columns (24 accumulators, as the FMA tiles), then the rows left in 4s and 2s
        int r0 = 0;
        for (; r0 + 6 <= MP; r0 += 6) {
          int c0 = 0;
          for (; c0 + 64 <= Dv; c0 += 64) pv_dp_block<6, 4>(acc, Dv, pp, MP, vp, kp, r0, c0);
          for (; c0 < Dv; c0 += 16) pv_dp_block<6, 1>(acc, Dv, pp, MP, vp, kp, r0, c0);
        }
        for (; r0 < MP; r0 += 2) {
          int c0 = 0;
          for (; c0 + 64 <= Dv; c0 += 64) pv_dp_block<2, 4>(acc, Dv, pp, MP, vp, kp, r0, c0);
          for (; c0 < Dv; c0 += 16) pv_dp_block<2, 1>(acc, Dv, pp, MP, vp, kp, r0, c0);
        }
        continue;
      }
#endif
      // P V in blocks of 6 rows x 64 columns (24 accumulators; rows padded to 16s: a last block of 2 or 4)
      int r0 = 0;
      for (; r0 + 6 <= MP; r0 += 6) {
        int c0 = 0;
        for (; c0 + 64 <= Dv; c0 += 64) pv_block<SC, 6, 4>(acc, Dv, st, MP, vc, ktps, r0, c0);
        for (; c0 < Dv; c0 += 16) pv_block<SC, 6, 1>(acc, Dv, st, MP, vc, ktps, r0, c0);
      }
      for (; r0 < MP; r0 += 2) {
        int c0 = 0;
        for (; c0 + 64 <= Dv; c0 += 64) pv_block<SC, 2, 4>(acc, Dv, st, MP, vc, ktps, r0, c0);
        for (; c0 < Dv; c0 += 16) pv_block<SC, 2, 1>(acc, Dv, st, MP, vc, ktps, r0, c0);
      }
    }
  }
  for (int s = 0; s < nsub; ++s) {
    const Sub& u = sub[s];
    store_rows<S>(a, h, u.i0, G, u.M, Dv, t0, u.mx, u.ls, u.acc);
  }
  return 0;
}

#if ET_AMX


// bf16 pairs of 16 lanes <-> float32: lanes 16k .. 16k+15 of 32 bf16 widened
ET_TARGET inline __m512 widen_half(__m512i v, int k) {
  const __m256i h = k ? _mm512_extracti64x4_epi64(v, 1) : _mm512_extracti64x4_epi64(v, 0);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
// 32 float32 (x0: the first 16) -> NP parts of 32 bf16 each, rounded to nearest even: part 0 = bf16(x),
// part i = bf16 of what parts 0 .. i-1 leave (each remainder exact in float32): x = sum of the parts
// + O(2^-(9 NP) |x|)
template <int NP>
ET_TARGET inline void split32(__m512 x0, __m512 x1, __m512i* part) {
  for (int i = 0; i < NP; ++i) {
    part[i] = (__m512i)_mm512_cvtne2ps_pbh(x1, x0);
    if (i + 1 < NP) {
      x0 = _mm512_sub_ps(x0, widen_half(part[i], 0));
      x1 = _mm512_sub_ps(x1, widen_half(part[i], 1));
    }
  }
}
// 16 float32 -> NP parts, each bf16 widened to a uint32 lane (the low half)
template <int NP>
ET_TARGET inline void split16(__m512 x, __m512i* part) {
  for (int i = 0; i < NP; ++i) {
    part[i] = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(x));
    if (i + 1 < NP) x = _mm512_sub_ps(x, _mm512_castsi512_ps(_mm512_slli_epi32(part[i], 16)));
  }
}

// one work item of up to AMROWS rows through AMX tiles (tdpbf16ps: 16 x 16 float32 += 16 x 32 bf16 .
// 32 x 16 bf16, the right operand in pairs). bf16 (X3 false): the operands as stored, P rounded to bf16. float32 (X3 true): every
// operand split into three bf16 parts (a = a0 + a1 + a2 + O(2^-27 |a|)) and each product taken as the six
// terms i + j < 3 (a0 b0, a0 b1, a1 b0, a0 b2, a1 b1, a2 b0; the rest below 2^-25 of |a b|): errors
// against the float64 reference at or below the FMA tiles' (docs/performance.md has them measured); with
// two parts (three products) they reached 2^-17 of |q k| and of |v|, 10x the FMA tiles' at |v| ~ 30.
// Layout (rows = queries x group, padded to 32; D padded to 32 with zeros):
//   S[row][key] = Q[row][.] . K^T   A: the item's queries packed once, row-major bf16 [MP][Dp];
//                                   B: each key tile's K transposed as bf16 pairs [Dp/2][AKT] (read in
//                                      place from the paged cache, 16 x 16 transposes of uint32 pairs)
//   softmax per row (float32, scaled, capped, masked as the FMA tiles do), P in bf16 [MP][AKT]
//   O[row][.] += P . V             A: P; B: V rows interleaved in pairs [AKT/2][Dv]; O in float32 in
//                                  scratch, loaded / stored as tiles around each key tile's products
// Tiles: 0-3 accumulators (2 x 2 blocks of 16 x 16), 4-5 left operands, 6-7 right operands.
constexpr int AKT = 64;  // keys per tile (P rows are 2 x 32 keys: two tdpbf16ps per accumulator tile)

// C0..C3 (+)= A(rows r, r + 16) . B(cols c, c + 16) over nks steps of 32, the operands in NP bf16 parts
// (part i of A times part j of B for i + j < NP: 1 part as stored; 3: the six products down to 2^-25 of
// |a b|). a_part / b_part: the distance between parts (elements).
template <int NP, bool TWO_COLS>
ET_TARGET inline void mm_2x2(const uint16_t* a, int a_stride, int64_t a_row16, int64_t a_part, const uint32_t* bb,
                             int b_stride, int64_t b_part, int nks, int64_t a_ks, int64_t b_ks) {
  for (int ks = 0; ks < nks; ++ks) {
    for (int i = 0; i < NP; ++i) {
      const uint16_t* ap = a + ks * a_ks + i * a_part;
      _tile_loadd(4, ap, a_stride);
      _tile_loadd(5, ap + a_row16, a_stride);
      for (int j = 0; i + j < NP; ++j) {
        const uint32_t* bp = bb + ks * b_ks + j * b_part;
        _tile_loadd(6, bp, b_stride);
        if (TWO_COLS) _tile_loadd(7, bp + 16, b_stride);
        _tile_dpbf16ps(0, 4, 6);
        if (TWO_COLS) _tile_dpbf16ps(1, 4, 7);
        _tile_dpbf16ps(2, 5, 6);
        if (TWO_COLS) _tile_dpbf16ps(3, 5, 7);
      }
    }
  }
}

// 32 elements d0 .. d0 + 31 of a K or Q row (zeros past D, a multiple of 16) as bf16 hi (and lo)
template <int NP, class T>
ET_TARGET inline void row32(const T* p, int d0, int D, __mmask16 dtail, __m512i* part) {
  if constexpr (std::is_same<T, float>::value) {
    const __m512 x0 = _mm512_loadu_ps(p + d0);
    const __m512 x1 = d0 + 32 > D ? _mm512_setzero_ps() : _mm512_loadu_ps(p + d0 + 16);
    split32<NP>(x0, x1, part);
  } else {
    part[0] = _mm512_maskz_loadu_epi32(d0 + 32 > D ? dtail : __mmask16(0xffff), p + d0);
  }
}

template <bool X3>
ET_TARGET int item_amx(const TiledArgs& a, int b, int h, int i0, int i1, float* scr) {
  typedef typename std::conditional<X3, F32, BF16>::type S;
  typedef typename S::T T;
  // bf16 parts of Q and K, and of P and V: float32 in three parts each (six products; a score's and a
  // value sum's dropped terms below 2^-24 of |q k| and |p v|), bf16 as stored
  constexpr int NQ = X3 ? 3 : 1, NV = X3 ? 3 : 1;
  const int G = a.G, D = a.D, Dv = a.Dv, M = (i1 - i0) * G;
  const int MP = (M + 31) / 32 * 32, Dp = (D + 31) / 32 * 32;
  const auto [Q, K, V, KN, VN, slots, nc, t0, jbeg, jend] = item_src<T>(a, b, h, i0, i1);
  // scratch (64-byte aligned pieces; scratch_floats() sizes it for float32); each bf16 operand's parts
  // follow one another
  const int64_t QA = int64_t(AMROWS) * Dp, KTS = int64_t(Dp / 2) * AKT, PB = int64_t(AMROWS) * AKT,
                VV = int64_t(AKT / 2) * Dv;
  float* acc = scr;                                                       // [MP][Dv] float32
  float* st = acc + size_t(AMROWS) * Dv;                                   // [MP][AKT] scores
  uint16_t* pb = reinterpret_cast<uint16_t*>(st + AMROWS * AKT);           // NV x [MP][AKT] P, bf16
  uint16_t* qa = pb + NV * PB;                                            // NQ x [MP][Dp] queries, bf16
  uint32_t* kt = reinterpret_cast<uint32_t*>(qa + NQ * QA);               // NQ x [Dp/2][AKT] K^T pairs
  uint32_t* vv = kt + NQ * KTS;                                           // NV x [AKT/2][Dv] V pairs
  float* mx = reinterpret_cast<float*>(vv + NV * VV);
  float* ls = mx + AMROWS;
  int32_t* hi = reinterpret_cast<int32_t*>(ls + AMROWS);
  int32_t* lo = hi + AMROWS;
  T* zeros = reinterpret_cast<T*>(lo + AMROWS);                            // [max(Dp, Dv)]
  std::memset(zeros, 0, sizeof(T) * (Dp > Dv ? Dp : Dv));
  const __mmask16 dtail = D % 32 ? __mmask16(0x00ff) : __mmask16(0xffff);  // pairs in the last 32-wide step
  for (int r = 0; r < MP; ++r) {
    uint16_t* qr = qa + size_t(r) * Dp;
    if (r < M) {
      const int qi = i0 + r / G, g = r % G;
      const T* src = Q + (t0 + qi) * a.q_st + int64_t(h * G + g) * a.q_sh;
      for (int d0 = 0; d0 < Dp; d0 += 32) {
        __m512i part[NQ];
        row32<NQ>(src, d0, D, dtail, part);
        for (int i = 0; i < NQ; ++i) _mm512_storeu_si512(qr + i * QA + d0, part[i]);
      }
      hi[r] = int32_t(nc + qi);
      lo[r] = a.window >= 0 ? int32_t(nc + qi - a.window) : INT32_MIN;
    } else {
      for (int i = 0; i < NQ; ++i) std::memset(qr + i * QA, 0, sizeof(uint16_t) * Dp);
      for (int i = 0; i < NV; ++i) std::memset(pb + i * PB + size_t(r) * AKT, 0, sizeof(uint16_t) * AKT);  // P stays 0
      hi[r] = -1;
      lo[r] = 0;
    }
    mx[r] = -INFINITY;
    ls[r] = 0.0f;
  }
  std::memset(acc, 0, sizeof(float) * MP * Dv);
  attnplug_cpu_fused::TileConfig cfg;  // ldtilecfg of the whole record (amx.h: why not _tile_loadconfig)
  for (int t = 0; t < 8; ++t) cfg.set(t, 16, 64);
  cfg.load();
  const __m512i iota = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const T* kr[AKT];
  const T* vr[AKT];
  for (int64_t j0 = jbeg; j0 < jend; j0 += AKT) {
    const int kt_n = int(jend - j0 < AKT ? jend - j0 : AKT);
    const int ktp = (kt_n + 31) / 32 * 32, nkb = ktp / 16;
    key_rows(a, h, slots, nc, jend, K, V, KN, VN, zeros, j0, ktp, kr, vr);
    // the next key tile's K and V rows on their way to the cache while this one computes (rows of
    // a page are a head's stride apart: no hardware prefetcher follows them)
    for (int64_t key = j0 + AKT; key < jend && key < j0 + 2 * AKT; ++key) {
      const char* kp = reinterpret_cast<const char*>(key < nc ? K + slots[key] * a.k_ss + int64_t(h) * a.k_sh
                                                              : KN + (key - nc) * a.kn_st);
      const char* vp = reinterpret_cast<const char*>(key < nc ? V + slots[key] * a.v_ss + int64_t(h) * a.v_sh
                                                              : VN + (key - nc) * a.vn_st);
      for (int c = 0; c < int(sizeof(T)) * D; c += 64) __builtin_prefetch(kp + c);
      for (int c = 0; c < int(sizeof(T)) * Dv; c += 64) __builtin_prefetch(vp + c);
    }
    // K^T as bf16 pairs: kt[d2][key] (and its lo part)
    for (int kb = 0; kb < nkb; ++kb)
      for (int ks = 0; ks < Dp / 32; ++ks) {
        __m512i rows[NQ][16];
        for (int i = 0; i < 16; ++i) {
          __m512i part[NQ];
          row32<NQ>(kr[16 * kb + i], 32 * ks, D, dtail, part);
          for (int q = 0; q < NQ; ++q) rows[q][i] = part[q];
        }
        for (int q = 0; q < NQ; ++q) {
          tr16(rows[q]);
          for (int p = 0; p < 16; ++p)
            _mm512_storeu_si512(kt + q * KTS + size_t(16 * ks + p) * AKT + 16 * kb, rows[q][p]);
        }
      }
    // S = Q . K^T
    for (int rb = 0; rb < MP / 16; rb += 2) {
      for (int kb = 0; kb < nkb; kb += 2) {
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        mm_2x2<NQ, true>(qa + size_t(16 * rb) * Dp, Dp * 2, 16 * Dp, QA, kt + 16 * kb, AKT * 4, KTS, Dp / 32, 32,
                         16 * AKT);
        _tile_stored(0, st + (16 * rb) * AKT + 16 * kb, AKT * 4);
        _tile_stored(1, st + (16 * rb) * AKT + 16 * kb + 16, AKT * 4);
        _tile_stored(2, st + (16 * rb + 16) * AKT + 16 * kb, AKT * 4);
        _tile_stored(3, st + (16 * rb + 16) * AKT + 16 * kb + 16, AKT * 4);
      }
    }
    const bool full = kt_n == ktp && j0 + kt_n - 1 <= nc + i0 && (a.window < 0 || j0 >= nc + i1 - 1 - a.window);
    // online softmax per row: scale, cap, mask, running maximum (NaN does not move it), P in bf16
    const __m512 vscale = _mm512_set1_ps(a.scale);
    for (int r = 0; r < M; ++r) {
      float* sr = st + r * AKT;
      __m512 x[AKT / 16];
      __m512 vm = _mm512_set1_ps(-INFINITY);
      for (int v = 0; v < nkb; ++v) {
        x[v] = _mm512_mul_ps(_mm512_loadu_ps(sr + 16 * v), vscale);
        if (a.cap > 0.0f) {
          alignas(64) float tmp[16];
          _mm512_store_ps(tmp, x[v]);
          for (int l = 0; l < 16; ++l) tmp[l] = a.cap * std::tanh(tmp[l] / a.cap);
          x[v] = _mm512_load_ps(tmp);
        }
        if (!full) {
          const __m512i key = _mm512_add_epi32(_mm512_set1_epi32(int32_t(j0 + 16 * v)), iota);
          const __mmask16 seen = _mm512_cmple_epi32_mask(key, _mm512_set1_epi32(hi[r])) &
                                 _mm512_cmpge_epi32_mask(key, _mm512_set1_epi32(lo[r]));
          x[v] = _mm512_mask_blend_ps(seen, _mm512_set1_ps(-INFINITY), x[v]);
        }
        vm = _mm512_max_ps(x[v], vm);  // a NaN lane of x keeps vm's
      }
      // the running maximum moves only when a score passes it by more than 8 (or the row saw nothing
      // yet): probabilities stay below e^8 and most tiles leave the accumulators unscaled (alpha 1;
      // the output divides by the sum over the same shift, so any shift gives the same result)
      const float m_old = mx[r], mt = _mm512_reduce_max_ps(vm);
      const float m = mt > m_old && (m_old == -INFINITY || mt - m_old > 8.0f) ? mt : m_old;
      const float mu = m == -INFINITY ? 0.0f : m;
      const float alpha = m == m_old ? 1.0f : m_old == -INFINITY ? 0.0f : std::exp(m_old - mu);
      const vf vmu = splat(mu);
      vf sum = vf{};
      __m512 p[AKT / 16];
      for (int v = 0; v < nkb; ++v) {
        vf xv;
        std::memcpy(&xv, &x[v], sizeof xv);
        const vf e = vexp(xv - vmu);
        sum += e;
        std::memcpy(&p[v], &e, sizeof e);
      }
      for (int v = 0; v < nkb; v += 2) {
        __m512i part[NV];
        split32<NV>(p[v], p[v + 1], part);
        for (int i = 0; i < NV; ++i) _mm512_storeu_si512(pb + i * PB + r * AKT + 16 * v, part[i]);
      }
      __m512 s512;
      std::memcpy(&s512, &sum, sizeof s512);
      ls[r] = ls[r] * alpha + _mm512_reduce_add_ps(s512);
      mx[r] = m;
      if (alpha != 1.0f) {
        const __m512 f = _mm512_set1_ps(alpha);
        for (int c = 0; c < Dv; c += 16)
          _mm512_storeu_ps(acc + r * Dv + c, _mm512_mul_ps(_mm512_loadu_ps(acc + r * Dv + c), f));
      }
    }
    if (!full) {
      // a hidden key's probability is exactly 0, which the tiles may multiply only by a finite value row:
      // a tile with a non-finite value row adds each row's visible values one by one (select, as the FMA
      // tiles do)
      bool finite = true;
      for (int j = 0; j < ktp && finite; ++j)
        for (int c = 0; c < Dv && finite; c += 16) {
          const vu u = ubits(S::load(vr[j] + c));
          vi bad = (vi)((u & 0x7f800000u) == 0x7f800000u);
          for (int l = 0; l < 16; ++l) finite = finite && bad[l] == 0;
        }
      if (!finite) {
        for (int r = 0; r < M; ++r)
          for (int j = 0; j < ktp; ++j) {
            float pj = 0.0f;
            for (int i = 0; i < NV; ++i) pj += BF16::one(pb + i * PB + r * AKT + j);
            if (pj == 0.0f) continue;
            const vf pv = splat(pj);
            for (int c = 0; c < Dv; c += 16) storef(acc + r * Dv + c, loadf(acc + r * Dv + c) + pv * S::load(vr[j] + c));
          }
        continue;
      }
    }
    // V rows interleaved in pairs: vv[k2][c] = (V[2 k2][c], V[2 k2 + 1][c]) (and the lo parts)
    for (int k2 = 0; k2 < ktp / 2; ++k2)
      for (int c = 0; c < Dv; c += 16) {
        if constexpr (X3) {
          __m512i pa[NV], pb2[NV];
          split16<NV>(_mm512_loadu_ps(vr[2 * k2] + c), pa);
          split16<NV>(_mm512_loadu_ps(vr[2 * k2 + 1] + c), pb2);
          for (int i = 0; i < NV; ++i)
            _mm512_storeu_si512(vv + i * VV + size_t(k2) * Dv + c, _mm512_or_si512(pa[i], _mm512_slli_epi32(pb2[i], 16)));
        } else {
          const __m512i va = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(vr[2 * k2] + c)));
          const __m512i vb = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(vr[2 * k2 + 1] + c)));
          _mm512_storeu_si512(vv + size_t(k2) * Dv + c, _mm512_or_si512(va, _mm512_slli_epi32(vb, 16)));
        }
      }
    // O += P . V
    const int nrb = (M + 15) / 16;  // row blocks holding a real row (a pair may hold one padding block)
    for (int rb = 0; rb < nrb; rb += 2) {
      int cb = 0;
      for (; cb + 2 <= Dv / 16; cb += 2) {
        float* c00 = acc + size_t(16 * rb) * Dv + 16 * cb;
        _tile_loadd(0, c00, Dv * 4);
        _tile_loadd(1, c00 + 16, Dv * 4);
        _tile_loadd(2, c00 + 16 * Dv, Dv * 4);
        _tile_loadd(3, c00 + 16 * Dv + 16, Dv * 4);
        mm_2x2<NV, true>(pb + (16 * rb) * AKT, AKT * 2, 16 * AKT, PB, vv + 16 * cb, Dv * 4, VV, ktp / 32, 32,
                         16 * Dv);
        _tile_stored(0, c00, Dv * 4);
        _tile_stored(1, c00 + 16, Dv * 4);
        _tile_stored(2, c00 + 16 * Dv, Dv * 4);
        _tile_stored(3, c00 + 16 * Dv + 16, Dv * 4);
      }
      if (cb < Dv / 16) {  // an odd last column block
        float* c00 = acc + size_t(16 * rb) * Dv + 16 * cb;
        _tile_loadd(0, c00, Dv * 4);
        _tile_loadd(2, c00 + 16 * Dv, Dv * 4);
        mm_2x2<NV, false>(pb + (16 * rb) * AKT, AKT * 2, 16 * AKT, PB, vv + 16 * cb, Dv * 4, VV, ktp / 32, 32,
                          16 * Dv);
        _tile_stored(0, c00, Dv * 4);
        _tile_stored(2, c00 + 16 * Dv, Dv * 4);
      }
    }
  }
  _tile_release();
  store_rows<S>(a, h, i0, G, M, Dv, t0, mx, ls, acc);
  return 0;
}
#endif

ET_TARGET int item_f32(const TiledArgs& a, int b, int h, int i0, int i1, float* scr) { return item<F32>(a, b, h, i0, i1, scr); }
#if ET_AMX
ET_TARGET int item_bf16(const TiledArgs& a, int b, int h, int i0, int i1, float* scr) { return item_amx<false>(a, b, h, i0, i1, scr); }
ET_TARGET int item_f32amx(const TiledArgs& a, int b, int h, int i0, int i1, float* scr) { return item_amx<true>(a, b, h, i0, i1, scr); }
#else
ET_TARGET int item_bf16(const TiledArgs& a, int b, int h, int i0, int i1, float* scr) { return item<BF16>(a, b, h, i0, i1, scr); }
#endif

}  // namespace ET_NS

#endif  // ATTNPLUG_ET_BODY
