// The fused CPU kernel's entry points, shared by the op registration (ops.cpp, built with torch's
// headers) and the per-ISA kernel translation units (isa_*.cpp, each including attention.cpp with
// its own -m flags; no torch header, no OpenMP). ops.cpp fills a DecodeArgs from the op's tensors,
// picks the variant this CPU runs (cpuid, once) and hands the kernel torch's thread pool through
// `parallel` (at::parallel_for), so the process has one OpenMP runtime: torch's.
#pragma once
#include <cstdint>

namespace attnplug_cpu_fused {

// run body(ctx, worker) on `workers` threads of the caller's pool and return when all are done
typedef void (*ParallelFn)(int64_t workers, void* ctx, void (*body)(void* ctx));

struct DecodeArgs {
  const void* q; int64_t q_st, q_sh;        // queries [T, Hkv*G, D] (strides in elements)
  const void* k; int64_t k_ss, k_sh;        // cache K [slots, Hkv, D]
  const void* v; int64_t v_ss, v_sh;        // cache V [slots, Hkv, Dv]
  const void* kn; int64_t kn_st, kn_sh;     // this forward's new K [T, Hkv, D] (null: none, cross-attention)
  const void* vn; int64_t vn_st, vn_sh;
  const int64_t* r2t; int64_t r2t_s;        // req_to_token
  const int64_t* plan;                      // [B, 8] per work row (a request, or a chunk of its queries):
                                            // req_to_token row, first cached position read, cached keys
                                            // read, first query token, queries, position of the first
                                            // query, the request's first new-key token, the chunk's first
                                            // query within the request (new keys 0 .. that + queries - 1)
  // the mask's rows are per work row (b * m_sb), indexed by query within the request
  const uint8_t* mask; int64_t m_sb, m_sq;  // target-verify [B, E, E] (1: query sees draft key), or null
  void* o; int64_t o_st, o_sh;              // output [T, Hkv*G, Dv]
  const float* sinks;                       // [Hkv*G] or null
  int32_t q_dtype, kv_dtype;                // 0 f32, 1 bf16, 2 f16; kv also 3 e4m3fn, 4 e5m2
  int32_t new_f32;                          // 1: kn/vn are float32 (an fp8 cache's dequantized new tokens)
  int32_t B, Hkv, G, D, Dv;
  int32_t window;                           // sliding window (-1: none): a query at position P sees keys >= P - window
  int32_t heads_per_item, nthreads;
  float scale, cap, k_scale, v_scale;       // cap 0: none; k/v_scale multiply stored cache values
  int64_t num_slots;                        // slots of the cache: every slot read is checked against it
  int64_t* err;                             // [4] out: code (0 none, 3 bad slot, 4 no memory, 5 a work row
                                            // past the scratch sized for the call: a bug here), work row,
                                            // position, slot value (the first failure recorded)
  ParallelFn parallel;                      // the thread pool (null: run on the calling thread)
  int64_t* threads_used;                    // out (or null): how many distinct threads ran the call's work
                                            // items (the pool's use is observable: a call that never reaches
                                            // the pool reports 1 whatever torch's thread count)
};

// return codes: 0 done; 1 a shape the kernel does not take; 2 a dtype pairing it does not take;
// 3 a slot read through req_to_token is out of range; 4 scratch memory could not be allocated;
// 5 a work row past the scratch sized for the call (3-5: details in err, the output is incomplete)
enum { RC_OK = 0, RC_SHAPE = 1, RC_DTYPE = 2, RC_BAD_SLOT = 3, RC_NO_MEMORY = 4, RC_SCRATCH_PLAN = 5 };

// one variant per instruction set, each compiled from attention.cpp with its own flags (setup.py)
namespace avx512bf16 { int attend(const DecodeArgs* a); }
namespace avx512 { int attend(const DecodeArgs* a); }
namespace avx2 { int attend(const DecodeArgs* a); }
namespace portable { int attend(const DecodeArgs* a); }

}  // namespace attnplug_cpu_fused
