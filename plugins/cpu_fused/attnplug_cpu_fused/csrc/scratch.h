// One thread's scratch for the kernels (attention.cpp's decode, extend_tiled.cpp's tiled extend): grown on
// demand and kept (torch's pool threads persist between calls); null when a grow fails, and then nothing
// is kept (a later smaller call allocates again). HEADROOM: grow to half as much again as asked (sizes
// that creep up call by call); without it exactly what is asked (the tiled kernel's size is known once).
#pragma once
#include <cstddef>
#include <cstdint>
#include <cstdlib>

namespace attnplug_cpu_fused {

template <bool HEADROOM>
struct ScratchBuffer {
  float* p = nullptr;
  size_t n = 0;
  ~ScratchBuffer() { std::free(p); }
  float* get(size_t want) {
    if (want > n) {
      std::free(p);
      p = nullptr;
      n = 0;
      const size_t grow = HEADROOM ? want + want / 2 : want;
      if (grow > (SIZE_MAX - 63) / 4) return nullptr;
      p = static_cast<float*>(std::aligned_alloc(64, ((grow * 4 + 63) / 64) * 64));
      if (p != nullptr) n = grow;
    }
    return p;
  }
};

}  // namespace attnplug_cpu_fused
