// The cpu_fused backend's kernel: paged attention on CPU, gather + attention in one pass over the
// cache, for every forward mode (decode, extend, mixed, target-verify).
//
// Compiled at install once per instruction set (isa_<name>.cpp defines ATTNPLUG_ISA and includes
// this file; setup.py gives each its -m flags), registered as the op attnplug_cpu_fused::attend by
// ops.cpp, which picks the variant this CPU runs; nothing here includes a torch header, and work
// items run on torch's thread pool through DecodeArgs.parallel (no OpenMP here). The semantics
// are torch_native's eager paths': per work row (a request's decode token, or a chunk of its
// new tokens), the visible cached keys are positions start .. start+ncached-1 read through
// req_to_token, then (self-attention) the request's new tokens from the arguments up to the
// chunk's last query, masked causally, by window and by the target-verify mask; nothing else
// of the cache is read. Scores, softmax and the value sum are float32 whatever the storage
// dtype (bf16 / fp16 / fp8 rows are widened in registers, one 16-key block at a time, never
// the whole K/V; on a CPU with AMX a bf16 layer's q.k and p.v products go through tdpbf16ps tiles
// instead, exact bf16 products of the stored rows with P split into two bf16 parts, accumulated in
// float32); the output is rounded once to the query dtype.
//
// Work items are (work row, range of KV heads); a thread walks the row's keys once for K and
// once for V, reading each key's row for all the item's heads together (one contiguous run of
// the nhd cache: page-scattered rows stay cheap), and prefetches rows ahead.
//
// Failures are return codes, never a signal: every slot a work item reads through req_to_token is
// checked against num_slots before the item reads any row (the table may have changed since the
// caller validated it), and a scratch allocation that fails is reported; either stops the call
// with the first failure recorded in DecodeArgs.err (the caller raises). Masked keys are selected
// out, never multiplied by zero: a hidden key's score is -inf whatever q.k gave, and in a block
// holding hidden keys a value row is added to a query's sum only where its probability is not 0
// (0 * NaN is NaN), for this forward's new tokens (causal, target-verify mask) as for the cache.

#ifndef ATTNPLUG_ISA
#error "compile attention.cpp through an isa_<name>.cpp that defines ATTNPLUG_ISA"
#endif
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <type_traits>
#if defined(__AVX512F__) || defined(__AVX512BF16__)
#include <immintrin.h>
#endif

#include "kernel.h"
#if defined(__AVX512BF16__) && defined(__x86_64__)
#include "amx.h"
#endif
#include "scratch.h"

namespace attnplug_cpu_fused {
namespace ATTNPLUG_ISA {
namespace {

constexpr int W = 16;   // floats per vector
constexpr int KB = 16;  // keys per block
constexpr int PLAN = 8; // int64 fields per plan row (DecodeArgs.plan)

typedef float vf __attribute__((vector_size(64)));
typedef int32_t vi __attribute__((vector_size(64)));
typedef uint32_t vu __attribute__((vector_size(64)));
typedef uint16_t vh __attribute__((vector_size(32)));
typedef uint8_t vb __attribute__((vector_size(16)));
typedef _Float16 vhf __attribute__((vector_size(32)));

inline vf splat(float x) { return vf{} + x; }
inline vf loadf(const float* p) { vf v; std::memcpy(&v, p, sizeof v); return v; }
inline void storef(float* p, vf v) { std::memcpy(p, &v, sizeof v); }
inline vf bits(vu u) { vf f; std::memcpy(&f, &u, sizeof f); return f; }
inline vu bits_of(vf f) { vu u; std::memcpy(&u, &f, sizeof u); return u; }

// ---- storage types: load 16 values as float32, store one float32 ----------------------------
struct F32 {
  typedef float T;
  static vf load(const T* p) { return loadf(p); }
  static float one(const T* p) { return *p; }
  static void put(T* p, float x) { *p = x; }
};
struct BF16 {
  typedef uint16_t T;
  static vf load(const T* p) { vh h; std::memcpy(&h, p, sizeof h); return bits(__builtin_convertvector(h, vu) << 16); }
  static float one(const T* p) { uint32_t u = uint32_t(*p) << 16; float f; std::memcpy(&f, &u, 4); return f; }
  static void put(T* p, float x) {  // round to nearest even; NaN stays NaN
    uint32_t u; std::memcpy(&u, &x, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) { *p = uint16_t((u >> 16) | 0x40u); return; }
    u += 0x7fffu + ((u >> 16) & 1u);
    *p = uint16_t(u >> 16);
  }
};
struct F16 {
  typedef _Float16 T;
  static vf load(const T* p) { vhf h; std::memcpy(&h, p, sizeof h); return __builtin_convertvector(h, vf); }
  static float one(const T* p) { return float(*p); }
  static void put(T* p, float x) { *p = T(x); }
};
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
// fp8 through the half-precision converter: 16 bytes -> 16 halves -> 16 floats, no scalar lanes
struct E5M2 {  // the top byte of an IEEE half: shift it into place
  typedef uint8_t T;
  static vf load(const T* p) {
    const __m256i h = _mm256_slli_epi16(_mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 8);
    return (vf)_mm512_cvtph_ps(h);
  }
};
struct E4M3 {  // float8_e4m3fn: bias 7, no infinities, S.1111.111 is NaN
  typedef uint8_t T;
  // as half bits, S.EEEE.MMM -> S.0EEEE.MMM0000000 is the value * 2^-8 (bias 15 instead of 7), for
  // subnormals too (their half is subnormal as well); one multiply by 256 restores it
  static vf load(const T* p) {
    const __m256i u = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    const __m256i mag = _mm256_and_si256(u, _mm256_set1_epi16(0x7f));
    const __m256i h = _mm256_or_si256(_mm256_slli_epi16(mag, 7), _mm256_slli_epi16(_mm256_and_si256(u, _mm256_set1_epi16(0x80)), 8));
    const __mmask16 nan = _mm256_cmpeq_epi16_mask(mag, _mm256_set1_epi16(0x7f));
    const __m512 f = _mm512_mul_ps(_mm512_cvtph_ps(h), _mm512_set1_ps(256.0f));
    return (vf)_mm512_mask_blend_ps(nan, f, _mm512_set1_ps(NAN));
  }
};
#else
struct E5M2 {  // the top byte of an IEEE half
  typedef uint8_t T;
  static vf load(const T* p) {
    vb b; std::memcpy(&b, p, sizeof b);
    vh h = __builtin_convertvector(b, vh) << 8;
    vhf f; std::memcpy(&f, &h, sizeof f);
    return __builtin_convertvector(f, vf);
  }
};
struct E4M3 {  // float8_e4m3fn: bias 7, no infinities, S.1111.111 is NaN
  typedef uint8_t T;
  static vf load(const T* p) {
    vb b; std::memcpy(&b, p, sizeof b);
    vu u = __builtin_convertvector(b, vu);
    vu sign = (u & 0x80u) << 24, e = (u >> 3) & 0xfu, m = u & 0x7u;
    vf normal = bits(sign | ((e + 120u) << 23) | (m << 20));
    vf sub = __builtin_convertvector(__builtin_convertvector(m, vi), vf) * (1.0f / 512.0f);
    sub = bits(bits_of(sub) | sign);
    vf r = e == 0u ? sub : normal;
    return (u & 0x7fu) == 0x7fu ? splat(NAN) : r;
  }
  static vu bits_of(vf f) { vu u; std::memcpy(&u, &f, sizeof u); return u; }
};
#endif

// ---- float32 helpers -----------------------------------------------------------------------
inline float hsum(vf v) {
  typedef float v8 __attribute__((vector_size(32)));
  typedef float v4 __attribute__((vector_size(16)));
  v8 a = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) + __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
  v4 b = __builtin_shufflevector(a, a, 0, 1, 2, 3) + __builtin_shufflevector(a, a, 4, 5, 6, 7);
  return (b[0] + b[2]) + (b[1] + b[3]);
}

// lane j of the result = the sum of a[j]'s lanes (a transpose-and-add tree: 15 adds, 30 shuffles)
inline vf reduce16(const vf* a) {
  vf t[8], u[4], w[2];
  for (int i = 0; i < 8; ++i)
    t[i] = __builtin_shufflevector(a[2 * i], a[2 * i + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
           __builtin_shufflevector(a[2 * i], a[2 * i + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
  for (int i = 0; i < 4; ++i)
    u[i] = __builtin_shufflevector(t[2 * i], t[2 * i + 1], 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27) +
           __builtin_shufflevector(t[2 * i], t[2 * i + 1], 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
  for (int i = 0; i < 2; ++i)
    w[i] = __builtin_shufflevector(u[2 * i], u[2 * i + 1], 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29) +
           __builtin_shufflevector(u[2 * i], u[2 * i + 1], 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31);
  return __builtin_shufflevector(w[0], w[1], 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30) +
         __builtin_shufflevector(w[0], w[1], 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
}

#define ATTNPLUG_VEXP_ATTR
#include "vexp.h"
#undef ATTNPLUG_VEXP_ATTR

using Scratch = attnplug_cpu_fused::ScratchBuffer<true>;  // scratch.h
thread_local Scratch tl_scores, tl_misc, tl_amx;

}  // namespace


namespace {

// Scores of one query row against KB keys' rows: lane j = q . row j (DC vectors per row; DC = 0:
// the count is `chunks`, known only at run time).
template <int DC>
inline vf scores(const float* qr, const float* const* rp, int chunks) {
  vf part[KB];
  if constexpr (DC > 0) {
    vf qv[DC];
    for (int c = 0; c < DC; ++c) qv[c] = loadf(qr + c * W);
    for (int j = 0; j < KB; ++j) {
      vf s = qv[0] * loadf(rp[j]);
      for (int c = 1; c < DC; ++c) s += qv[c] * loadf(rp[j] + c * W);
      part[j] = s;
    }
  } else {
    for (int j = 0; j < KB; ++j) {
      vf s = vf{};
      for (int c = 0; c < chunks; ++c) s += loadf(qr + c * W) * loadf(rp[j] + c * W);
      part[j] = s;
    }
  }
  return reduce16(part);
}

// The 4 rows' scores from the 4 key groups' reductions (grp[g] lane 4k + r: key 4g + k, row r): sv[r] lane j =
// grp[j / 4] lane 4 (j % 4) + r
inline void regroup4(vf* sv, const vf* grp) {
#ifdef __AVX512F__
  for (int r = 0; r < 4; ++r) {  // lanes 0-7 of lo from grp[0] and grp[1], of hi from grp[2] and grp[3]
    const __m512i idx = _mm512_setr_epi32(r, 4 + r, 8 + r, 12 + r, 16 + r, 20 + r, 24 + r, 28 + r, 0, 0, 0, 0, 0, 0, 0, 0);
    const __m512 lo = _mm512_permutex2var_ps((__m512)grp[0], idx, (__m512)grp[1]);
    const __m512 hi = _mm512_permutex2var_ps((__m512)grp[2], idx, (__m512)grp[3]);
    sv[r] = (vf)_mm512_shuffle_f32x4(lo, hi, 0x44);
  }
#else
  for (int r = 0; r < 4; ++r) {
    vf lo, hi;
    for (int m = 0; m < 4; ++m) {
      lo[m] = grp[0][4 * m + r]; lo[4 + m] = grp[1][4 * m + r];
      hi[m] = grp[2][4 * m + r]; hi[4 + m] = grp[3][4 * m + r];
    }
    sv[r] = __builtin_shufflevector(lo, hi, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23);
  }
#endif
}

// scores<DC> of 4 query rows at once (qr: row r at qr + r * D): sv[r] lane j = q_r . row j, each key row
// loaded once for the 4 rows (4 keys x 4 rows of accumulators at a time, reduced together). Float32 sums of
// the same products, but not bit-identical to four scores<DC> calls as compiled (measured: 1-2 float32 ulp
// apart in ~70% of float32 outputs, max 2.1e-7 on outputs up to 1.04; float16 outputs 0.1% apart by one
// half ulp); held to the float64 reference like every path. Measured (kdec6, Zen 4, one thread): float32
// 4 x 256 decode 0.43-0.50 -> 0.32 ms (in cache), 32 x 1024 18.2-19.5 -> 18.1-18.4 ms (memory-bound).
template <int DC>
inline void scores_x4(vf* sv, const float* qr, int D, const float* const* rp, int chunks) {
  const int nc = DC > 0 ? DC : chunks;
  vf grp[KB / 4];
  for (int g = 0; g < KB / 4; ++g) {
    vf acc[16];
    for (int c = 0; c < nc; ++c) {
      vf qv[4];
      for (int r = 0; r < 4; ++r) qv[r] = loadf(qr + r * D + c * W);
      for (int k = 0; k < 4; ++k) {
        const vf kv = loadf(rp[4 * g + k] + c * W);
        for (int r = 0; r < 4; ++r) acc[4 * k + r] = c == 0 ? qv[r] * kv : acc[4 * k + r] + qv[r] * kv;
      }
    }
    grp[g] = reduce16(acc);
  }
  regroup4(sv, grp);
}

#ifdef __AVX512BF16__
// Unscaled scores of one bf16 query row against KB bf16 rows with the CPU's bf16 dot product
// (vdpbf16ps: pairs of bf16 products, exact in float32, accumulated in float32); `chunks` is the
// head dim / 32. The rows are read as stored: no widening.
inline vf scores_bf16(const uint16_t* qr, const uint16_t* const* rp, int chunks) {
  vf part[KB];
  for (int j = 0; j < KB; ++j) {
    __m512 acc = _mm512_setzero_ps();
    for (int c = 0; c < chunks; ++c)
      acc = _mm512_dpbf16_ps(acc, (__m512bh)_mm512_loadu_si512(qr + c * 32), (__m512bh)_mm512_loadu_si512(rp[j] + c * 32));
    part[j] = (vf)acc;
  }
  return reduce16(part);
}
// scores_bf16 of 4 query rows at once: sv[r] lane j = q_r . row j. Each key row is loaded once for the 4
// rows (4 keys x 4 rows of accumulators at a time, the 16 reduced together by reduce16, then regrouped
// per row by two permutes and a lane shuffle), instead of once per row. The same vdpbf16ps operands
// accumulated in the same order, and reduce16 sums each vector's lanes in the same tree whatever its
// position: bit-identical to four scores_bf16 calls.
inline void scores_bf16_x4(vf* sv, const uint16_t* const* qr, const uint16_t* const* rp, int chunks) {
  vf grp[KB / 4];  // lane 4k + r: key 4g + k, row r
  for (int g = 0; g < KB / 4; ++g) {
    __m512 acc[16];
    for (int i = 0; i < 16; ++i) acc[i] = _mm512_setzero_ps();
    for (int c = 0; c < chunks; ++c) {
      __m512bh qv[4];
      for (int r = 0; r < 4; ++r) qv[r] = (__m512bh)_mm512_loadu_si512(qr[r] + c * 32);
      for (int k = 0; k < 4; ++k) {
        const __m512bh kv = (__m512bh)_mm512_loadu_si512(rp[4 * g + k] + c * 32);
        for (int r = 0; r < 4; ++r) acc[4 * k + r] = _mm512_dpbf16_ps(acc[4 * k + r], qv[r], kv);
      }
    }
    vf part[16];
    for (int i = 0; i < 16; ++i) part[i] = (vf)acc[i];
    grp[g] = reduce16(part);
  }
  regroup4(sv, grp);
}
constexpr bool kNativeBF16 = true;
#else
inline void scores_bf16_x4(vf*, const uint16_t* const*, const uint16_t* const*, int) {}
inline vf scores_bf16(const uint16_t*, const uint16_t* const*, int) { return vf{}; }
constexpr bool kNativeBF16 = false;
#endif

#if defined(__AVX512BF16__) && defined(__x86_64__)
// Unscaled scores of a head's RH (<= 16) bf16 query rows against KB bf16 rows through AMX: C[key][row]
// += K[key][32 dims] . Q^T, one tdpbf16ps per 32 dims (pairs of bf16 products, exact in float32,
// accumulated in float32, like vdpbf16ps), so the FMA unit is left to the value pass. The K tile is
// loaded from the cache in place when the KB rows are KB consecutive slots (one page), else copied
// into kbuf first; qv holds the queries in the VNNI layout ([D/32][16 pairs][16 rows][2], see
// vnni_queries); tiles 0 (C), 1 (K), 2 (Q) are configured by the caller. sv[n] lane j = q_n . row j.
inline void scores_amx(vf* sv, int RH, const uint16_t* const* rp, int64_t row_stride, const uint16_t* qv, int D,
                       uint16_t* kbuf, float* cbuf) {
  bool contiguous = true;
  for (int j = 1; j < KB; ++j) contiguous &= rp[j] == rp[0] + j * row_stride;
  const uint16_t* base = rp[0];
  int64_t stride = row_stride * 2;
  if (!contiguous) {
    for (int j = 0; j < KB; ++j) std::memcpy(kbuf + j * D, rp[j], size_t(D) * 2);
    base = kbuf;
    stride = int64_t(D) * 2;
  }
  __asm__ volatile("" ::: "memory");  // the tile loads below read kbuf and qv (inline asm without memory operands)
  _tile_zero(0);
  for (int c = 0; c < D / 32; ++c) {
    _tile_loadd(1, base + c * 32, stride);
    _tile_loadd(2, qv + c * 512, 64);
    _tile_dpbf16ps(0, 1, 2);
  }
  _tile_stored(0, cbuf, 64);
  __asm__ volatile("" ::: "memory");
  const __m512i idx = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                         _mm512_set1_epi32(16));
  for (int r = 0; r < RH; ++r) sv[r] = (vf)_mm512_i32gather_ps(_mm512_add_epi32(idx, _mm512_set1_epi32(r)), cbuf, 4);
}
// qv[c][p][r][e] = row r's dim 32c + 2p + e (the Q tile of scores_amx: 16 pairs x up to 16 rows)
inline void vnni_queries(uint16_t* qv, const uint16_t* const* qrows, int RH, int D) {
  for (int r = 0; r < RH; ++r)
    for (int d = 0; d < D; ++d) qv[(d / 32) * 512 + ((d % 32) / 2) * 32 + r * 2 + (d % 2)] = qrows[r][d];
}
inline bool amx_scores_usable() { return amx_usable(); }
// tiles 0-2: the scores (scores_amx); 3-6: the value sum (values_amx): 3 a head's RH accumulator rows x
// 16 columns, 4 / 6 its P rows (hi / lo parts) x 32 keys, 5 the V pairs of 32 keys x 16 columns
inline void amx_configure(int RH) {
  TileConfig cfg;
  cfg.set(0, KB, RH * 4);
  cfg.set(1, KB, 64);
  cfg.set(2, 16, RH * 4);
  cfg.set(3, RH, 64);
  cfg.set(4, RH, 64);
  cfg.set(5, 16, 64);
  cfg.set(6, RH, 64);
  cfg.load();
}
inline void amx_done() { tile_release(); }

constexpr int PVK = 32;  // keys per value-pass block (one tdpbf16ps: 16 pairs)
// bf16 parts of P: hi + lo (P to ~2^-17 of itself, two products a tile). Measured against a float64
// reference (bf16 decode, 1 request x 256 / 4096 keys, 32/8 heads): the same errors as the float32 value
// pass (max 7.6e-4 / 2.0e-4, mean 1.1e-4 / 2.7e-5 of outputs up to 0.32 / 0.08); one part (P rounded to
// bf16) raised the mean error 1.5x and the max 1.4x at 4096 keys, for no speed measurable here.
constexpr int NPV = 2;

// 32 probabilities (x0: keys 0-15) as NPV bf16 parts, rounded to nearest even: hi = bf16(p), lo =
// bf16(p - hi) (the remainder exact in float32); returns what they add up to (float32)
inline vf p_parts(vf x0, vf x1, uint16_t* hi, uint16_t* lo) {
  const __m512i h = (__m512i)_mm512_cvtne2ps_pbh((__m512)x1, (__m512)x0);
  _mm512_storeu_si512(hi, h);
  const vf h0 = (vf)_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64(h, 0)), 16));
  const vf h1 = (vf)_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64(h, 1)), 16));
  if constexpr (NPV == 1) {
    (void)lo;
    return h0 + h1;
  } else {
    _mm512_storeu_si512(lo, (__m512i)_mm512_cvtne2ps_pbh((__m512)(x1 - h1), (__m512)(x0 - h0)));
    return x0 + x1;
  }
}

// whether PVK bf16 rows of Dv (a multiple of 32) hold no inf or NaN (a lane with every exponent bit set)
inline bool rows_finite(const uint16_t* const* vr, int Dv) {
  __mmask32 bad = 0;
  const __m512i e = _mm512_set1_epi16(0x7f80);
  for (int j = 0; j < PVK; ++j)
    for (int c = 0; c < Dv; c += 32) bad |= _mm512_cmpeq_epi16_mask(_mm512_and_si512(_mm512_loadu_si512(vr[j] + c), e), e);
  return bad == 0;
}

// acc[RH rows][Dv] += P[RH rows][PVK keys] . V[PVK keys][Dv] for one head through AMX: the PVK bf16 value
// rows vr interleaved in pairs into vv ([PVK/2][Dv] uint32: key 2k in the low half, 2k+1 in the high;
// the tile's right operand), then per 16 columns the accumulator tile loaded, multiplied by the NPV
// parts of P (ph / pl: rows p_stride elements apart) and stored back. Dv a multiple of 32.
inline void values_amx(float* acc, int Dv, const uint16_t* ph, const uint16_t* pl, int64_t p_stride,
                       const uint16_t* const* vr, uint32_t* vv) {
  const __m512i lo_idx = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8, 39, 7, 38, 6,
                                          37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
  const __m512i hi_idx = _mm512_add_epi16(lo_idx, _mm512_set1_epi16(16));
  for (int k2 = 0; k2 < PVK / 2; ++k2) {
    const uint16_t* ra = vr[2 * k2];
    const uint16_t* rb = vr[2 * k2 + 1];
    uint32_t* out = vv + size_t(k2) * Dv;
    for (int c = 0; c < Dv; c += 32) {
      const __m512i x = _mm512_loadu_si512(ra + c), y = _mm512_loadu_si512(rb + c);
      _mm512_storeu_si512(out + c, _mm512_permutex2var_epi16(x, lo_idx, y));
      _mm512_storeu_si512(out + c + 16, _mm512_permutex2var_epi16(x, hi_idx, y));
    }
  }
  __asm__ volatile("" ::: "memory");  // the tile loads below read vv, P and acc (asm without memory operands)
  _tile_loadd(4, ph, p_stride * 2);
  if constexpr (NPV == 2) _tile_loadd(6, pl, p_stride * 2);
  for (int c = 0; c < Dv; c += 16) {
    _tile_loadd(3, acc + c, Dv * 4);
    _tile_loadd(5, vv + c, Dv * 4);
    _tile_dpbf16ps(3, 4, 5);
    if constexpr (NPV == 2) _tile_dpbf16ps(3, 6, 5);
    _tile_stored(3, acc + c, Dv * 4);
  }
  __asm__ volatile("" ::: "memory");
}
#else
constexpr int PVK = 32;
constexpr int NPV = 1;
inline void scores_amx(vf*, int, const uint16_t* const*, int64_t, const uint16_t*, int, uint16_t*, float*) {}
inline void vnni_queries(uint16_t*, const uint16_t* const*, int, int) {}
inline bool amx_scores_usable() { return false; }
inline void amx_configure(int) {}
inline void amx_done() {}
inline vf p_parts(vf, vf, uint16_t*, uint16_t*) { return vf{}; }
inline void values_amx(float*, int, const uint16_t*, const uint16_t*, int64_t, const uint16_t* const*, uint32_t*) {}
inline bool rows_finite(const uint16_t* const*, int) { return true; }
#endif

// The decode passes' prefetch: one cached row (`bytes` from p) into L2, not L1 (prefetcht2). Each row read
// prefetches the same head's row a block of keys on; a block's 8 heads then have 16-64 KiB in flight, more
// than L1 holds and more misses than its fill buffers track: with prefetcht0 (into L1) a block's burst of
// line misses stalled the loads behind it. Measured (issue 25, kdec6, 2026-12-03, AMD EPYC family 25 /
// Zen 4, one thread, 32 x 1024 decode, 32/8 heads, d128, page 32, three alternated runs of one binary):
// float32 33.6-38.5 -> 19.9-22.6 ms (prefetcht1 alike; prefetchnta 34-38: no gain; 2 or 4 blocks ahead:
// no further gain); bf16 without AMX 17.1-20.3 -> 11.7-13.3 ms (this burst into L2 against kdec5's
// prefetcht0 spread over the key steps, which it replaces). On the Xeon of kdec5, prefetcht1 measured
// within noise of prefetcht0.
inline void prefetch_row_l2(const char* p, int64_t bytes) {
  for (int64_t o = 0; o < bytes; o += 64) __builtin_prefetch(p + o, 0, 1);
}

// Pointers to NK keys' bf16 rows of head h as stored (cache rows through slots, then new token
// rows; zeros past the end), prefetching the same head's row NK keys on (prefetch_row_l2). Measured (a scratch driver of
// this file, one thread, bf16 32 x 1024, caches flushed, side by side): prefetching instead each block's
// whole run of the cache (its keys x all the item's heads) in address order, 1, 2 or 4 blocks ahead,
// was 5-7% slower; prefetcht1 / nta, a line per 4 KiB page or none at all within noise of this.
template <int NK = KB>
inline void bf16_rows(const uint16_t** out, const uint16_t* zeros, const uint16_t* cache, int64_t c_ss, int64_t c_sh,
                      const uint16_t* nw, int64_t n_st, int64_t n_sh, const int64_t* slots, int64_t j0, int64_t nc,
                      int64_t n, int h, int dim, bool pf = true) {
  const int64_t row_bytes = int64_t(dim) * 2;
  for (int j = 0; j < NK; ++j) {
    const int64_t key = j0 + j;
    if (pf && key + NK < nc) {
      prefetch_row_l2(reinterpret_cast<const char*>(cache + slots[key + NK] * c_ss + h * c_sh), row_bytes);
    }
    out[j] = key >= n ? zeros : key < nc ? cache + slots[key] * c_ss + h * c_sh : nw + (key - nc) * n_st + h * n_sh;
  }
}

// The AMX passes' prefetch (bf16_rows' own off): step `step` of `steps` (one per head of the item) of the
// block of NK keys from j1, in address order: a share of its keys per step, each key's run of heads h0 .. h1-1
// (contiguous in nhd). Measured (issue 25, round 3: a scratch driver of this file, one thread, bf16 decode
// 32 x 1024, caches flushed, base and this side by side, six runs): 1.6-4% faster than each head prefetching
// its own rows of the next block (a head's rows are 2 KiB apart: a 4 KiB page touched in 256-byte pieces a
// head step apart); prefetcht1, every 4th line, or two blocks ahead: within noise of this.
template <int NK>
inline void prefetch_share(const uint16_t* cache, int64_t c_ss, int64_t c_sh, const int64_t* slots, int64_t j1,
                           int64_t nc, int h0, int h1, int dim, int step, int steps) {
  const int per = (NK + steps - 1) / steps;
  const int64_t bytes = int64_t(h1 - h0 - 1) * c_sh * 2 + int64_t(dim) * 2;
  for (int j = step * per; j < (step + 1) * per && j < NK; ++j) {
    const int64_t key = j1 + j;
    if (key >= nc) return;
    const char* p = reinterpret_cast<const char*>(cache + slots[key] * c_ss + h0 * c_sh);
    for (int64_t o = 0; o < bytes; o += 64) __builtin_prefetch(p + o);
  }
}

// acc[g][c] += sum over KB keys j of p[g][j] * row_j[c], for GN rows x CN vectors held in registers.
// SEL (blocks that hold hidden keys): a key whose probability is 0 for a row (hidden from it) adds
// nothing to that row, whatever its value row holds (0 * NaN is NaN: select, never multiply by zero)
template <int GN, int CN, bool SEL = false>
inline void accumulate(float* acc, int acc_stride, const float* p, int64_t p_stride, const float* const* rp, int col) {
  vf t[GN][CN];
  for (int g = 0; g < GN; ++g) for (int c = 0; c < CN; ++c) t[g][c] = loadf(acc + g * acc_stride + c * W);
  for (int j = 0; j < KB; ++j) {
    vf x[CN];
    for (int c = 0; c < CN; ++c) x[c] = loadf(rp[j] + col + c * W);
    for (int g = 0; g < GN; ++g) {
      const float pg = p[g * p_stride + j];
      if constexpr (SEL) {
        if (pg == 0.0f) continue;
      }
      const vf pj = splat(pg);
      for (int c = 0; c < CN; ++c) t[g][c] += pj * x[c];
    }
  }
  for (int g = 0; g < GN; ++g) for (int c = 0; c < CN; ++c) storef(acc + g * acc_stride + c * W, t[g][c]);
}

#ifdef __AVX512BF16__
// accumulate's form for bf16 value rows read as stored (run's `dp` path, Dv a multiple of 32): each 32 bf16 of
// a row widen in two operations into its even dims (x << 16) and its odd dims (x & 0xffff0000), so the
// accumulator holds each 32 columns as their 16 even then their 16 odd (dvperm: the output's order); the
// same products, summed in the same order, as accumulate over rows widened into a buffer. CN: vectors of
// 16 columns (even)
template <int GN, int CN, bool SEL = false>
inline void accumulate_bf16(float* acc, int acc_stride, const float* p, int64_t p_stride, const uint16_t* const* rp,
                            int col) {
  static_assert(CN % 2 == 0, "pairs of vectors: 32 bf16 columns");
  vf t[GN][CN];
  for (int g = 0; g < GN; ++g) for (int c = 0; c < CN; ++c) t[g][c] = loadf(acc + g * acc_stride + c * W);
  const __m512i hi = _mm512_set1_epi32(int32_t(0xffff0000u));
  for (int j = 0; j < KB; ++j) {
    vf x[CN];
    for (int c = 0; c < CN; c += 2) {
      const __m512i u = _mm512_loadu_si512(rp[j] + col + c * W);
      x[c] = (vf)_mm512_castsi512_ps(_mm512_slli_epi32(u, 16));
      x[c + 1] = (vf)_mm512_castsi512_ps(_mm512_and_si512(u, hi));
    }
    for (int g = 0; g < GN; ++g) {
      const float pg = p[g * p_stride + j];
      if constexpr (SEL) {
        if (pg == 0.0f) continue;
      }
      const vf pj = splat(pg);
      for (int c = 0; c < CN; ++c) t[g][c] += pj * x[c];
    }
  }
  for (int g = 0; g < GN; ++g) for (int c = 0; c < CN; ++c) storef(acc + g * acc_stride + c * W, t[g][c]);
}
#else
template <int GN, int CN, bool SEL = false>
inline void accumulate_bf16(float*, int, const float*, int64_t, const uint16_t* const*, int) {}
#endif
// where accumulate_bf16 keeps column d: each 32 columns as their 16 even then their 16 odd
inline int dvperm(int d) { return (d & ~31) + ((d & 31) >> 1) + ((d & 1) << 4); }

// record the first failure of a call (code, work row, position, slot)
inline void fail(const DecodeArgs& a, int64_t code, int64_t row, int64_t pos, int64_t slot) {
  int64_t none = 0;  // the first failure claims the record; the others leave it
  if (__atomic_compare_exchange_n(&a.err[0], &none, int64_t(-1), false, __ATOMIC_ACQ_REL, __ATOMIC_RELAXED)) {
    a.err[1] = row; a.err[2] = pos; a.err[3] = slot;
    __atomic_store_n(&a.err[0], code, __ATOMIC_RELEASE);
  }
}

// Run item(it) for it in [0, n) on the caller's pool: `workers` threads take items one at a time
// from a shared counter (dynamic scheduling: work rows differ in length). Each worker notes its thread
// (tl_marker's address, unique per live thread); the distinct threads are reported in a.threads_used.
thread_local char tl_marker;
template <class F>
void for_items(const DecodeArgs& a, int64_t n, const F& item) {
  constexpr int64_t NOTE = 64;
  struct Ctx { const F* item; int64_t n; int64_t next; int64_t started; const void* who[NOTE]; } ctx{&item, n, 0, 0, {}};
  auto body = [](void* p) {
    Ctx* c = static_cast<Ctx*>(p);
    const int64_t k = __atomic_fetch_add(&c->started, 1, __ATOMIC_RELAXED);
    if (k < NOTE) c->who[k] = &tl_marker;
    for (int64_t it; (it = __atomic_fetch_add(&c->next, 1, __ATOMIC_RELAXED)) < c->n;) (*c->item)(it);
  };
  const int64_t workers = a.nthreads < n ? a.nthreads : n;
  if (a.parallel == nullptr || workers <= 1) body(&ctx);
  else a.parallel(workers, &ctx, body);
  if (a.threads_used != nullptr) {
    const int64_t seen = ctx.started < NOTE ? ctx.started : NOTE;
    int64_t distinct = 0;
    for (int64_t i = 0; i < seen; ++i) {
      bool first = true;
      for (int64_t j = 0; j < i; ++j) first &= ctx.who[j] != ctx.who[i];
      distinct += first;
    }
    *a.threads_used = distinct;
  }
}

inline float hmax16(vf v) {
  typedef float v8 __attribute__((vector_size(32)));
  typedef float v4 __attribute__((vector_size(16)));
  v8 a0 = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7), a1 = __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
  v8 a = a0 > a1 ? a0 : a1;
  v4 b0 = __builtin_shufflevector(a, a, 0, 1, 2, 3), b1 = __builtin_shufflevector(a, a, 4, 5, 6, 7);
  v4 b = b0 > b1 ? b0 : b1;
  float m0 = b[0] > b[1] ? b[0] : b[1], m1 = b[2] > b[3] ? b[2] : b[3];
  return m0 > m1 ? m0 : m1;
}

// Pointers to KB keys' rows of head h, as float32: rows of a float32 cache are read in place;
// others are widened (stored * scale) into dst[j][dim]. Keys past the end point at zeros. Keys
// j < nc are cached (KV rows through slots), key nc + i is new token i (a Q row, or float32 when
// new_f32, at byte address nw + (i * n_st + h * n_sh) * its size). Each cached row read prefetches
// the same head's row KB keys on (prefetch_row_l2).
template <class Q, class KV>
void block_rows(const float** out, float* dst, const float* zeros, const typename KV::T* cache, int64_t c_ss,
                int64_t c_sh, const char* nw, int64_t n_st, int64_t n_sh, bool new_f32, const int64_t* slots,
                int64_t j0, int64_t nc, int64_t n, int h, int dim, float scale) {
  const int chunks = dim / W;
  const int64_t row_bytes = int64_t(dim) * int64_t(sizeof(typename KV::T));
  for (int j = 0; j < KB; ++j) {
    const int64_t key = j0 + j;
    float* d = dst + int64_t(j) * dim;
    if (key + KB < nc) {
      prefetch_row_l2(reinterpret_cast<const char*>(cache + slots[key + KB] * c_ss + h * c_sh), row_bytes);
    }
    if (key >= n) {
      out[j] = zeros;
    } else if (key < nc) {
      const typename KV::T* s = cache + slots[key] * c_ss + h * c_sh;
      if constexpr (std::is_same<KV, F32>::value) {
        if (scale == 1.0f) { out[j] = s; continue; }
      }
      if (scale == 1.0f) for (int c = 0; c < chunks; ++c) storef(d + c * W, KV::load(s + c * W));
      else for (int c = 0; c < chunks; ++c) storef(d + c * W, KV::load(s + c * W) * scale);
      out[j] = d;
    } else {
      const int64_t off = (key - nc) * n_st + h * n_sh;
      if (new_f32) { out[j] = reinterpret_cast<const float*>(nw) + off; continue; }
      const typename Q::T* s = reinterpret_cast<const typename Q::T*>(nw) + off;
      if constexpr (std::is_same<Q, F32>::value) { out[j] = s; continue; }
      for (int c = 0; c < chunks; ++c) storef(d + c * W, Q::load(s + c * W));
      out[j] = d;
    }
  }
}

template <class Q, class KV, int DC>
int run(const DecodeArgs& a) {
  typedef typename Q::T QT;
  typedef typename KV::T KT;
  const QT* q = static_cast<const QT*>(a.q);
  const KT* K = static_cast<const KT*>(a.k);
  const KT* V = static_cast<const KT*>(a.v);
  QT* O = static_cast<QT*>(a.o);
  const int G = a.G, D = a.D, Dv = a.Dv, HC = a.heads_per_item;
  const int NH = (a.Hkv + HC - 1) / HC;
  const bool has_new = a.kn != nullptr;
  const int64_t new_size = a.new_f32 ? int64_t(sizeof(float)) : int64_t(sizeof(QT));
  int64_t most_keys = 1, most_rows = 1;
  for (int b = 0; b < a.B; ++b) {
    const int64_t* pl = a.plan + PLAN * b;
    const int64_t n = pl[2] + (has_new ? pl[7] + pl[4] : 0);
    if (n > most_keys) most_keys = n;
    if (pl[4] > most_rows) most_rows = pl[4];
  }
  const int64_t npad_max = (most_keys + KB - 1) / KB * KB;
  const int dmax = D > Dv ? D : Dv;

  int failed = 0;  // set once any item failed: the others stop early
  for_items(a, int64_t(a.B) * NH, [&](int64_t it) {
    if (__atomic_load_n(&failed, __ATOMIC_RELAXED)) return;
    const int b = int(it / NH), h0 = int(it % NH) * HC, h1 = h0 + HC < a.Hkv ? h0 + HC : a.Hkv;
    const int64_t* pl = a.plan + PLAN * b;
    const int64_t row = pl[0], start = pl[1], nc = pl[2], t0 = pl[3], pos0 = pl[5], kn_t0 = pl[6], a0 = pl[7];
    const int nq = int(pl[4]);
    const int nh = h1 - h0, RH = nq * G, R = nh * RH;  // rows r = (h - h0) * RH + query * G + g
    const int64_t n = nc + (has_new ? a0 + nq : 0);  // the request's new keys up to the chunk's last query
    auto out_row = [&](int r) {
      const int hh = r / RH, qi = (r % RH) / G, g = r % G;
      return O + (t0 + qi) * a.o_st + int64_t((h0 + hh) * G + g) * a.o_sh;
    };
    if (nq == 0) return;
    if (n == 0) {  // nothing visible (an empty encoder): zeros, sinks or not
      for (int r = 0; r < R; ++r) { QT* op = out_row(r); for (int d = 0; d < Dv; ++d) Q::put(op + d, 0.0f); }
      return;
    }
    const int64_t* slots = a.r2t + row * a.r2t_s + start;
    {  // every slot this item reads is a slot of the cache (req_to_token may have changed since the check)
      int64_t bad = -1;
      for (int64_t key = 0; key < nc; ++key)
        if (slots[key] < 0 || slots[key] >= a.num_slots) { bad = key; break; }
      if (bad >= 0) {
        fail(a, 3, b, start + bad, slots[bad]);
        __atomic_store_n(&failed, 1, __ATOMIC_RELAXED);
        return;
      }
    }
    const int64_t npad = (n + KB - 1) / KB * KB;
    if (npad > npad_max || nq > most_rows) {  // the scratch below is sized for npad_max keys, most_rows queries
      fail(a, 5, b, -1, npad);
      __atomic_store_n(&failed, 1, __ATOMIC_RELAXED);
      return;
    }
    float* sc = tl_scores.get(size_t(R) * npad_max);                    // [R][npad] scores, then exp(s - m)
    float* misc = tl_misc.get(size_t(nh) * most_rows * G * (D + Dv + 2) + size_t(KB + 1) * dmax);
    if (sc == nullptr || misc == nullptr) {
      fail(a, 4, b, -1, int64_t(size_t(R) * npad_max * 4));
      __atomic_store_n(&failed, 1, __ATOMIC_RELAXED);
      return;
    }
    float* qf = misc;                                        // [R][D] queries, scaled
    float* acc = qf + size_t(R) * D;                         // [R][Dv]
    float* mx = acc + size_t(R) * Dv;                        // [R]
    float* den = mx + R;                                     // [R]
    float* rows = den + R;                                   // [KB][dmax]: one head's widened rows
    float* zeros = rows + size_t(KB) * dmax;                 // [dmax]
    std::memset(zeros, 0, sizeof(float) * dmax);
    const float* rp[KB];
    for (int r = 0; r < R; ++r) {
      const int hh = r / RH, qi = (r % RH) / G, g = r % G;
      const QT* qp = q + (t0 + qi) * a.q_st + int64_t((h0 + hh) * G + g) * a.q_sh;
      for (int c = 0; c < D / W; ++c) storef(qf + r * D + c * W, Q::load(qp + c * W) * a.scale);
      mx[r] = -INFINITY;
    }
    const char* kn = has_new ? static_cast<const char*>(a.kn) + kn_t0 * a.kn_st * new_size : nullptr;
    const char* vn = has_new ? static_cast<const char*>(a.vn) + kn_t0 * a.vn_st * new_size : nullptr;
    const uint8_t* mask = a.mask ? a.mask + b * a.m_sb : nullptr;

    // bf16 model and cache on a CPU with bf16 dot products: scores straight from the stored rows.
    // Measured (one thread, bf16 decode 32 x 1024): 3-10% faster at 1-4 query heads per KV head,
    // 13% slower at 8 (widening a row once serves 8 queries), so only up to 4.
    constexpr bool bf16_pair = std::is_same<Q, BF16>::value && std::is_same<KV, BF16>::value;
    // With AMX (tdpbf16ps) the scores leave the FMA unit entirely: a head's RH <= 16 query rows x KB keys
    // per 32 dims in one tile multiply (measured below in docs/performance.md, issue 25).
    const bool amx = bf16_pair && D % 32 == 0 && RH <= 16 && !a.new_f32 && amx_scores_usable();
    const bool dp = !amx && bf16_pair && kNativeBF16 && D % 32 == 0 && G <= 4 && !a.new_f32;
    // four rows a head (a decode step of G = 4, or 2 queries x G = 2, ...): the 4 rows' scores in one pass over
    // the block's K rows (scores_bf16_x4). Measured (kdec6, Zen 4, one thread, alternated in one binary):
    // 32 x 1024 14.3-14.8 -> 11.5-12.1 ms, 4 x 256 0.44-0.46 -> 0.35-0.36 ms; outputs bit-identical
    const bool dp4 = dp && RH == 4;
    // the same for the float32 rows (float32 caches, widened fp16 / fp8 rows): scores_x4
    const bool fx4 = !amx && !dp && RH == 4;
    // and the value sum too (P in NPV bf16 parts times V as stored), where the value rows are pairs of 16
    const bool amx_pv = amx && Dv % 32 == 0;
    const int64_t np32 = (npad + PVK - 1) / PVK * PVK;  // P's row stride (bf16 elements)
    const uint16_t* rp16[KB];
    uint16_t* qv = nullptr;  // AMX: the queries of each head in the VNNI layout, then a block's K rows, C,
    uint16_t* kbuf = nullptr;  // P's parts and a block's V pairs
    float* cbuf = nullptr;
    uint16_t* pb = nullptr;
    uint32_t* vv = nullptr;
    vf sv[16];
    if (amx) {
      const size_t want = size_t(nh) * D * 8 + size_t(KB) * D / 2 + KB * 16 +
                          (amx_pv ? size_t(R) * np32 * NPV / 2 + size_t(PVK / 2) * Dv : 0);
      float* ab = tl_amx.get(want);
      if (ab == nullptr) {
        fail(a, 4, b, -1, int64_t(want * 4));
        __atomic_store_n(&failed, 1, __ATOMIC_RELAXED);
        return;
      }
      qv = reinterpret_cast<uint16_t*>(ab);
      kbuf = qv + size_t(nh) * D * 16;
      cbuf = reinterpret_cast<float*>(kbuf + size_t(KB) * D);
      pb = reinterpret_cast<uint16_t*>(cbuf + KB * 16);         // NPV x [R][np32] bf16
      vv = reinterpret_cast<uint32_t*>(pb + size_t(NPV) * R * np32);  // [PVK/2][Dv] V pairs
      for (int hh = 0; hh < nh; ++hh) {
        const uint16_t* qrows[16];
        for (int r = 0; r < RH; ++r)
          qrows[r] = reinterpret_cast<const uint16_t*>(q + (t0 + r / G) * a.q_st + int64_t((h0 + hh) * G + r % G) * a.q_sh);
        vnni_queries(qv + size_t(hh) * D * 16, qrows, RH, D);
      }
      amx_configure(RH);
    }
    // pass 1: scores, a block of KB keys and one head at a time
    for (int64_t j0 = 0; j0 < n; j0 += KB) {
      for (int h = h0; h < h1; ++h) {
        if (amx) {
          prefetch_share<KB>(reinterpret_cast<const uint16_t*>(K), a.k_ss, a.k_sh, slots, j0 + KB, nc, h0, h1, D,
                             h - h0, h1 - h0);
          bf16_rows(rp16, reinterpret_cast<const uint16_t*>(zeros), reinterpret_cast<const uint16_t*>(K), a.k_ss,
                    a.k_sh, reinterpret_cast<const uint16_t*>(kn), a.kn_st, a.kn_sh, slots, j0, nc, n, h, D, false);
        } else if (dp) {
          bf16_rows(rp16, reinterpret_cast<const uint16_t*>(zeros), reinterpret_cast<const uint16_t*>(K), a.k_ss,
                    a.k_sh, reinterpret_cast<const uint16_t*>(kn), a.kn_st, a.kn_sh, slots, j0, nc, n, h, D);
        }
        else
          block_rows<Q, KV>(rp, rows, zeros, K, a.k_ss, a.k_sh, kn, a.kn_st, a.kn_sh, a.new_f32 != 0, slots, j0,
                            nc, n, h, D, a.k_scale);
        if (amx) scores_amx(sv, RH, rp16, a.k_ss, qv + size_t(h - h0) * D * 16, D, kbuf, cbuf);
        if (dp4) {
          const uint16_t* qrs[4];
          for (int r = 0; r < 4; ++r)
            qrs[r] = reinterpret_cast<const uint16_t*>(q + (t0 + r / G) * a.q_st + int64_t(h * G + r % G) * a.q_sh);
          scores_bf16_x4(sv, qrs, rp16, D / 32);
        }
        if (fx4) scores_x4<DC>(sv, qf + size_t(h - h0) * RH * D, D, rp, D / W);
        for (int qi = 0; qi < nq; ++qi) {
          // keys a query cannot see in this block: past the end, a new token after it (causal) or
          // hidden by the target-verify mask, a cached key before its window
          const int64_t pos = pos0 + qi, lo = a.window >= 0 ? pos - a.window : INT64_MIN;
          const bool partial = j0 + KB > nc || start + j0 < lo;
          for (int g = 0; g < G; ++g) {
            const int r = (h - h0) * RH + qi * G + g;
            vf s;
            if (amx || dp4) {
              s = sv[qi * G + g] * a.scale;
            } else if (fx4) {
              s = sv[qi * G + g];
            } else if (dp) {
              const QT* qp = q + (t0 + qi) * a.q_st + int64_t(h * G + g) * a.q_sh;
              s = scores_bf16(reinterpret_cast<const uint16_t*>(qp), rp16, D / 32) * a.scale;
            } else {
              s = scores<DC>(qf + r * D, rp, D / W);
            }
            if (a.cap > 0.0f) for (int j = 0; j < KB; ++j) s[j] = a.cap * std::tanh(s[j] / a.cap);
            if (partial) {
              for (int j = 0; j < KB; ++j) {
                const int64_t key = j0 + j;
                bool seen;
                if (key >= n) seen = false;
                else if (key < nc) seen = start + key >= lo;
                else seen = key - nc <= a0 + qi && pos0 - a0 + (key - nc) >= lo &&
                            (!mask || mask[(a0 + qi) * a.m_sq + (key - nc)]);
                if (!seen) s[j] = -INFINITY;
              }
            }
            storef(sc + r * npad + j0, s);
            const float m = hmax16(s);
            mx[r] = m > mx[r] ? m : mx[r];
          }
        }
      }
    }
    if (amx && !amx_pv) amx_done();
    // softmax numerators and denominators (a sink adds exp(sink - m) to the denominator only); a
    // row that sees no key at all outputs zeros, sinks or not
    for (int r = 0; r < R; ++r) {
      const bool none = mx[r] == -INFINITY;
      float m = mx[r];
      const float sink = a.sinks ? a.sinks[h0 * G + (r / RH) * G + r % G] : -INFINITY;
      if (a.sinks && sink > m) m = sink;
      if (std::isinf(m)) m = 0.0f;
      float* s = sc + r * npad;
      vf sum = vf{};
      if (amx_pv) {  // P as bf16 parts (keys npad .. np32 - 1: 0); the sum is over what the parts add up to
        uint16_t* ph = pb + size_t(r) * np32;
        for (int64_t j = 0; j < np32; j += PVK) {
          const vf x0 = vexp(loadf(s + j) - m);
          const vf x1 = j + W < npad ? vexp(loadf(s + j + W) - m) : vf{};
          sum += p_parts(x0, x1, ph + j, ph + size_t(R) * np32 + j);
        }
      } else {
        for (int64_t j = 0; j < npad; j += W) {
          vf x = vexp(loadf(s + j) - m);
          storef(s + j, x);
          sum += x;
        }
      }
      den[r] = none ? 0.0f : hsum(sum) + (a.sinks ? std::exp(sink - m) : 0.0f);
    }
    // pass 2: the probability-weighted sum of V, register tiles of 4 rows x 4 vectors; a block that
    // may hold a key hidden from some row (a new token, past the end, before the first query's
    // window) selects per row and key instead of multiplying by a zero probability
    std::memset(acc, 0, sizeof(float) * R * Dv);
    const int64_t lo_last = a.window >= 0 ? pos0 + nq - 1 - a.window : INT64_MIN;  // the last query's window
    // AMX: blocks of PVK keys; a block that may hold a key hidden from some row goes through the tiles
    // only when its value rows are all finite (a hidden key's P is 0, and 0 * NaN is NaN), else each
    // row adds the rows of the keys whose P is not 0, one by one
    for (int64_t j0 = 0; amx_pv && j0 < n; j0 += PVK) {
      const bool hidden = j0 + PVK > nc || start + j0 < lo_last;
      for (int h = h0; h < h1; ++h) {
        const uint16_t* vr[PVK];
        prefetch_share<PVK>(reinterpret_cast<const uint16_t*>(V), a.v_ss, a.v_sh, slots, j0 + PVK, nc, h0, h1, Dv,
                            h - h0, h1 - h0);
        bf16_rows<PVK>(vr, reinterpret_cast<const uint16_t*>(zeros), reinterpret_cast<const uint16_t*>(V), a.v_ss,
                       a.v_sh, reinterpret_cast<const uint16_t*>(vn), a.vn_st, a.vn_sh, slots, j0, nc, n, h, Dv, false);
        const int hr = (h - h0) * RH;
        const uint16_t* ph = pb + size_t(hr) * np32 + j0;
        if (hidden) {
          if (!rows_finite(vr, Dv)) {
            for (int g = 0; g < RH; ++g)
              for (int j = 0; j < PVK; ++j) {
                float pj = 0.0f;
                for (int i = 0; i < NPV; ++i) pj += BF16::one(ph + size_t(i) * R * np32 + size_t(g) * np32 + j);
                if (pj == 0.0f) continue;
                const vf pv = splat(pj);
                float* ar = acc + size_t(hr + g) * Dv;
                for (int c = 0; c < Dv; c += W) storef(ar + c, loadf(ar + c) + pv * BF16::load(vr[j] + c));
              }
            continue;
          }
        }
        values_amx(acc + size_t(hr) * Dv, Dv, ph, ph + size_t(R) * np32, np32, vr, vv);
      }
    }
    if (amx_pv) amx_done();
    // bf16 without AMX (dp): the value rows read as stored, widened in registers (accumulate_bf16)
    const bool dpv = dp && Dv % 32 == 0;
    for (int64_t j0 = 0; dpv && j0 < n; j0 += KB) {
      const bool hidden = j0 + KB > nc || start + j0 < lo_last;
      for (int h = h0; h < h1; ++h) {
        bf16_rows(rp16, reinterpret_cast<const uint16_t*>(zeros), reinterpret_cast<const uint16_t*>(V), a.v_ss,
                  a.v_sh, reinterpret_cast<const uint16_t*>(vn), a.vn_st, a.vn_sh, slots, j0, nc, n, h, Dv);
        const int hr = (h - h0) * RH;
        const float* p0 = sc + size_t(hr) * npad + j0;
        float* a0r = acc + size_t(hr) * Dv;
        if (hidden) {
          int g0 = 0;
          for (; g0 + 4 <= RH; g0 += 4)
            for (int c0 = 0; c0 < Dv; c0 += 32)
              accumulate_bf16<4, 2, true>(a0r + g0 * Dv + c0, Dv, p0 + g0 * npad, npad, rp16, c0);
          for (; g0 < RH; ++g0)
            for (int c0 = 0; c0 < Dv; c0 += 32)
              accumulate_bf16<1, 2, true>(a0r + g0 * Dv + c0, Dv, p0 + g0 * npad, npad, rp16, c0);
          continue;
        }
        int g0 = 0;
        for (; g0 + 4 <= RH; g0 += 4) {
          int c0 = 0;
          for (; c0 + 64 <= Dv; c0 += 64) accumulate_bf16<4, 4>(a0r + g0 * Dv + c0, Dv, p0 + g0 * npad, npad, rp16, c0);
          for (; c0 < Dv; c0 += 32) accumulate_bf16<4, 2>(a0r + g0 * Dv + c0, Dv, p0 + g0 * npad, npad, rp16, c0);
        }
        for (; g0 < RH; ++g0) {
          int c0 = 0;
          for (; c0 + 64 <= Dv; c0 += 64) accumulate_bf16<1, 4>(a0r + g0 * Dv + c0, Dv, p0 + g0 * npad, npad, rp16, c0);
          for (; c0 < Dv; c0 += 32) accumulate_bf16<1, 2>(a0r + g0 * Dv + c0, Dv, p0 + g0 * npad, npad, rp16, c0);
        }
      }
    }
    for (int64_t j0 = 0; !amx_pv && !dpv && j0 < n; j0 += KB) {
      const bool hidden = j0 + KB > nc || start + j0 < lo_last;
      for (int h = h0; h < h1; ++h) {
        block_rows<Q, KV>(rp, rows, zeros, V, a.v_ss, a.v_sh, vn, a.vn_st, a.vn_sh, a.new_f32 != 0, slots, j0, nc,
                          n, h, Dv, a.v_scale);
        const int hr = (h - h0) * RH;
        if (hidden) {
          int g0 = 0;
          for (; g0 + 4 <= RH; g0 += 4)
            for (int c0 = 0; c0 < Dv / W; ++c0)
              accumulate<4, 1, true>(acc + (hr + g0) * Dv + c0 * W, Dv, sc + (hr + g0) * npad + j0, npad, rp, c0 * W);
          for (; g0 < RH; ++g0)
            for (int c0 = 0; c0 < Dv / W; ++c0)
              accumulate<1, 1, true>(acc + (hr + g0) * Dv + c0 * W, Dv, sc + (hr + g0) * npad + j0, npad, rp, c0 * W);
          continue;
        }
        int g0 = 0;
        for (; g0 + 4 <= RH; g0 += 4) {
          int c0 = 0;
          for (; c0 + 4 <= Dv / W; c0 += 4) accumulate<4, 4>(acc + (hr + g0) * Dv + c0 * W, Dv, sc + (hr + g0) * npad + j0, npad, rp, c0 * W);
          for (; c0 < Dv / W; ++c0) accumulate<4, 1>(acc + (hr + g0) * Dv + c0 * W, Dv, sc + (hr + g0) * npad + j0, npad, rp, c0 * W);
        }
        for (; g0 < RH; ++g0) {
          int c0 = 0;
          for (; c0 + 4 <= Dv / W; c0 += 4) accumulate<1, 4>(acc + (hr + g0) * Dv + c0 * W, Dv, sc + (hr + g0) * npad + j0, npad, rp, c0 * W);
          for (; c0 < Dv / W; ++c0) accumulate<1, 1>(acc + (hr + g0) * Dv + c0 * W, Dv, sc + (hr + g0) * npad + j0, npad, rp, c0 * W);
        }
      }
    }
    for (int r = 0; r < R; ++r) {
      const float inv = den[r] > 0.0f ? 1.0f / den[r] : 0.0f;
      QT* op = out_row(r);
      if (dpv) for (int d = 0; d < Dv; ++d) Q::put(op + d, acc[r * Dv + dvperm(d)] * inv);
      else for (int d = 0; d < Dv; ++d) Q::put(op + d, acc[r * Dv + d] * inv);
    }
  });
  return int(a.err[0]);
}

template <class Q, class KV>
int dispatch_dim(const DecodeArgs& a) {  // head dims 64 and 128 get unrolled score loops
  if (a.D == 64) return run<Q, KV, 4>(a);
  if (a.D == 128) return run<Q, KV, 8>(a);
  return run<Q, KV, 0>(a);
}

template <class Q>
int dispatch_kv(const DecodeArgs& a) {
  if (a.kv_dtype == a.q_dtype) return dispatch_dim<Q, Q>(a);
  if (a.kv_dtype == 3) return dispatch_dim<Q, E4M3>(a);
  if (a.kv_dtype == 4) return dispatch_dim<Q, E5M2>(a);
  return 2;
}

}  // namespace

// the return codes: kernel.h (RC_*)
int attend(const DecodeArgs* a) {
  if (a->D % W || a->Dv % W || a->D <= 0 || a->Dv <= 0 || a->G <= 0 || a->heads_per_item <= 0) return RC_SHAPE;
  if (a->err == nullptr || a->num_slots < 0) return RC_SHAPE;
  a->err[0] = 0;
  switch (a->q_dtype) {
    case 0: return dispatch_kv<F32>(*a);
    case 1: return dispatch_kv<BF16>(*a);
    case 2: return dispatch_kv<F16>(*a);
    default: return RC_DTYPE;
  }
}

}  // namespace ATTNPLUG_ISA
}  // namespace attnplug_cpu_fused
