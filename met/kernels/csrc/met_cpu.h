// The C++ side's only CPU checks. Which kernel runs is decided in Python, once
// (met/kernels/capability.py); these are the guards an op calls so that a wrong choice fails
// with an error instead of an illegal instruction, and the lane-width choice the clones make.
// Each answer is computed once per process.
#pragma once

#if defined(__x86_64__)
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace {
namespace met_cpu {

// __builtin_cpu_supports takes only a literal, hence a macro. The init call matters where
// this runs as a static initializer (the CPU data may not be set yet).
#if defined(__x86_64__)
#define MET_CPU_HAS(feature) (__builtin_cpu_init(), __builtin_cpu_supports(feature) != 0)
#else
#define MET_CPU_HAS(feature) false
#endif

inline bool avx2() { return MET_CPU_HAS("avx2") && MET_CPU_HAS("fma") && MET_CPU_HAS("f16c"); }

// F, BW, DQ and VL: the 16-lane variants of the clones (the x86-64-v4 test).
inline bool avx512() {
  return MET_CPU_HAS("avx512f") && MET_CPU_HAS("avx512bw") && MET_CPU_HAS("avx512dq") &&
         MET_CPU_HAS("avx512vl");
}

inline bool avx512_vnni() { return avx512() && MET_CPU_HAS("avx512vnni"); }

inline bool avx512_bf16() { return MET_CPU_HAS("avx512bw") && MET_CPU_HAS("avx512bf16"); }

// CPUID leaf 7 EDX bit `bit` (AMX: 22 bf16, 24 tile, 25 int8) and Linux's permission for
// this process to use the tile registers (asked once; oneDNN asks for the same one).
inline bool amx(unsigned bit) {
#if defined(__x86_64__)
  static const bool tiles = [] {
    unsigned a = 0, b = 0, c = 0, d = 0;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d) || !(d & (1u << 24))) return false;
    constexpr long kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  unsigned a = 0, b = 0, c = 0, d = 0;
  return tiles && __get_cpuid_count(7, 0, &a, &b, &c, &d) && (d & (1u << bit));
#else
  (void)bit;
  return false;
#endif
}

inline bool amx_int8() { return avx512_vnni() && amx(25); }
inline bool amx_bf16() { return amx_int8() && avx512_bf16() && amx(22); }

}  // namespace met_cpu
}  // namespace
