// Tiled (blocked) paged attention for long extends on CPU: the plain C entry of extend_tiled.cpp.
//
// No torch header: the caller passes pointers, strides in elements and a per-request plan. Query
// tiles x key tiles with an online softmax, causal tiles skipped, the G query heads of one KV head
// sharing each key tile; float32 and bfloat16 (bf16 products through AMX tiles where the CPU has AMX
// and Linux grants the tile data, else widened to float32 or pinned to vdpbf16ps; float32 accumulation). The instruction set is chosen at run time (cpuid), whatever
// flags the file was compiled with: every ISA-specific function carries its own target attribute.
#pragma once
#include <cstdint>

extern "C" {

// run body(ctx) on `workers` threads of the caller's pool, returning when all are done (each worker
// takes work items until none is left); null in TiledArgs.parallel: OpenMP where the file is built
// with it, else the calling thread alone
typedef void (*TiledParallelFn)(int64_t workers, void* ctx, void (*body)(void* ctx));

// Filled field by field from tensors in ops.cpp (extend_tiled_op).
struct TiledArgs {
  const void* q; int64_t q_st, q_sh;        // queries [T, Hkv*G, D] (strides in elements)
  const void* k; int64_t k_ss, k_sh;        // cache K [slots, Hkv, D]
  const void* v; int64_t v_ss, v_sh;        // cache V [slots, Hkv, Dv]
  const void* kn; int64_t kn_st, kn_sh;     // this forward's new K [T, Hkv, D]
  const void* vn; int64_t vn_st, vn_sh;     // this forward's new V [T, Hkv, Dv]
  const int64_t* r2t; int64_t r2t_s;        // req_to_token
  const int64_t* plan;                      // [B, 8] per request, attention.cpp's plan rows with the whole
                                            // request in one row: req_to_token row, first cached position
                                            // read (start), cached keys read (nc), first query token, queries
                                            // (nq), position of the first query (= start + nc), first new-key
                                            // token, 0. Key j (0 .. nc + nq - 1) is at position start + j:
                                            // cached through req_to_token below nc, new token j - nc above.
  void* o; int64_t o_st, o_sh;              // output [T, Hkv*G, Dv]
  const float* sinks;                       // [Hkv*G] or null
  int32_t dtype;                            // 0 float32, 1 bfloat16: queries, cache, new K/V and output alike
  int32_t isa;                              // 0 best this CPU runs; 1 portable, 2 avx2+fma, 3 avx512f,
                                            // 4 avx512f + avx512bf16, 5 AMX (avx512bf16 + amx-tile + amx-bf16,
                                            // tile data granted by Linux; bf16 through tdpbf16ps, float32 as 3)
                                            // (tests pin one; refused if the CPU lacks it)
  int32_t B, Hkv, G, D, Dv;
  int32_t window;                           // sliding window (-1: none): a query at position P sees keys >= P - window
  int32_t nthreads;
  float scale, cap;                         // cap 0: no soft-cap
  int64_t num_slots;                        // every slot read is checked against it
  int64_t* err;                             // [4] out: code, request, position, slot (first failure)
  TiledParallelFn parallel;                 // the caller's thread pool (e.g. at::parallel_for), or null
};

// 0 done; 1 a shape it does not take (head dims not multiples of 16, G > 64, a plan row that is not a
// whole request); 2 a dtype it does not take; 3 a slot out of range (details in err); 4 no memory;
// 6 the requested isa is not available on this CPU
int attnplug_extend_tiled(const TiledArgs* a);
// the struct size (checked against the ctypes mirror at load)
int64_t attnplug_extend_tiled_args_size(void);
// the isa code attnplug_extend_tiled runs with isa = 0 on this CPU
int32_t attnplug_extend_tiled_isa(void);
// the isa code a bf16 call runs with isa = 0 on this CPU (5 AMX; where the best is 4, AVX-512 BF16 without
// AMX: 4 where vdpbf16ps measured worth it, else 3, widened to float32; the best below 4: that one); info
// (3 doubles, or null): vdpbf16ps flops a cycle over vfmadd231ps's as measured (0: not measured), the
// power of two it rounds to (what the choice compares), 0 not measured / 1 measured / 2 taken from
// $ATTNPLUG_CPU_FUSED_DPBF16_RATE. Measured once a process, on the first call (about 20 us).
int32_t attnplug_extend_tiled_bf16_isa(double* info);

}  // extern "C"
