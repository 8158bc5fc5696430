// AMX helpers shared by the kernels (attention.cpp's decode scores; extend_tiled.cpp may use them too):
// whether this process may run AMX tile instructions, and the tile configuration record.
#pragma once
#if defined(__x86_64__)
#include <cpuid.h>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#ifdef __linux__
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace attnplug_cpu_fused {

// AMX usable in this process: the CPU has AMX-TILE and AMX-BF16 (cpuid leaf 7: EDX bits 24, 22), the OS
// enabled the tile state in XCR0 (bits 17, 18), Linux granted this process the tile data
// (arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA); refused: no AMX), and $ATTNPLUG_CPU_FUSED_AMX
// is not "0" (the knob that makes the process behave as if it were refused: tests, benchmarks).
// Asked once per process (the permission is per process).
inline bool amx_usable() {
  static const bool usable = [] {
    const char* knob = std::getenv("ATTNPLUG_CPU_FUSED_AMX");
    if (knob != nullptr && std::strcmp(knob, "0") == 0) return false;
    unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
    if (!__get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx)) return false;
    if (!(edx & (1u << 24)) || !(edx & (1u << 22))) return false;
    if (!__get_cpuid(1, &eax, &ebx, &ecx, &edx) || !(ecx & (1u << 27))) return false;  // OSXSAVE
    unsigned xlo, xhi;
    __asm__ volatile("xgetbv" : "=a"(xlo), "=d"(xhi) : "c"(0));
    if ((xlo & (3u << 17)) != (3u << 17)) return false;
#ifdef __linux__
    if (syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XFEATURE_XTILEDATA */) != 0) return false;
#else
    return false;
#endif
    return true;
  }();
  return usable;
}

// ldtilecfg's 64-byte record (palette 1): rows and bytes per row of each of the 8 tiles
struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
  void set(int tile, int rows_, int colsb_) { rows[tile] = uint8_t(rows_); colsb[tile] = uint16_t(colsb_); }
  // ldtilecfg with the whole record as its operand (the compiler's _tile_loadconfig names only its first
  // 8 bytes, so the stores of the rest may be dropped); tile_release() undoes it
  void load() const { __asm__ volatile("ldtilecfg %0" ::"m"(*this)); }
};
inline void tile_release() { __asm__ volatile("tilerelease" ::); }

}  // namespace attnplug_cpu_fused
#endif
