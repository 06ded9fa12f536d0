"""The ceiling the AVX2 w4a8 kernel (met/kernels/csrc/w4a8_avx2.cpp) works under: how many
int8 multiply-adds a second this CPU's cores issue in the kernel's own inner step, VPMADDUBSW
(32 u8 × s8 products summed in pairs) then VPADDW into an int16 accumulator, with nothing
else in the loop (six independent accumulators, all in registers, no loads), and the same
for float32 FMAs.

    python benchmarks/int8_peak.py [--threads 2] [--seconds 1]

Prints one JSON line: GMAC/s of the int8 step and of FMA, per core and for --threads cores
together. The kernel's real rate (benchmarks/w4a8_linear.py, layer_gmacs) also pays for
unpacking the 4-bit weights, broadcasting activations and each 32-value block's float steps;
the ratio of the two says how much of the instruction budget those take. x86-64 with AVX2
only; the loop is compiled on first use (~20 s).
"""

from __future__ import annotations

import argparse
import json
import threading
import time

from torch.utils.cpp_extension import load_inline

SOURCE = r"""
#include <immintrin.h>
#include <cstdint>

#define PIN(x) __asm__("" : "+x"(x))

// n rounds of six VPMADDUBSW + VPADDW; returns a lane so the work is not dropped.
__attribute__((target("avx2"), noinline)) int64_t int8_rounds(int64_t n) {
  const __m256i a = _mm256_set1_epi8(3);
  __m256i b0 = _mm256_set1_epi8(1), b1 = _mm256_set1_epi8(2), b2 = _mm256_set1_epi8(-3),
          b3 = _mm256_set1_epi8(4), b4 = _mm256_set1_epi8(-5), b5 = _mm256_set1_epi8(6);
  __m256i s0 = _mm256_setzero_si256(), s1 = s0, s2 = s0, s3 = s0, s4 = s0, s5 = s0;
  for (int64_t i = 0; i < n; ++i) {
    PIN(b0); PIN(b1); PIN(b2); PIN(b3); PIN(b4); PIN(b5);
    s0 = _mm256_add_epi16(s0, _mm256_maddubs_epi16(a, b0));
    s1 = _mm256_add_epi16(s1, _mm256_maddubs_epi16(a, b1));
    s2 = _mm256_add_epi16(s2, _mm256_maddubs_epi16(a, b2));
    s3 = _mm256_add_epi16(s3, _mm256_maddubs_epi16(a, b3));
    s4 = _mm256_add_epi16(s4, _mm256_maddubs_epi16(a, b4));
    s5 = _mm256_add_epi16(s5, _mm256_maddubs_epi16(a, b5));
    PIN(s0); PIN(s1); PIN(s2); PIN(s3); PIN(s4); PIN(s5);
  }
  const __m256i s = _mm256_add_epi16(_mm256_add_epi16(_mm256_add_epi16(s0, s1),
                                                      _mm256_add_epi16(s2, s3)),
                                     _mm256_add_epi16(s4, s5));
  return _mm256_extract_epi16(s, 0);
}

// n rounds of ten independent 8-lane FMAs.
__attribute__((target("avx2,fma"), noinline)) double fma_rounds(int64_t n) {
  const __m256 a = _mm256_set1_ps(1.0001f), b = _mm256_set1_ps(0.9999f);
  __m256 s0 = _mm256_setzero_ps(), s1 = s0, s2 = s0, s3 = s0, s4 = s0, s5 = s0, s6 = s0,
         s7 = s0, s8 = s0, s9 = s0;
  for (int64_t i = 0; i < n; ++i) {
    s0 = _mm256_fmadd_ps(a, b, s0); s1 = _mm256_fmadd_ps(a, b, s1);
    s2 = _mm256_fmadd_ps(a, b, s2); s3 = _mm256_fmadd_ps(a, b, s3);
    s4 = _mm256_fmadd_ps(a, b, s4); s5 = _mm256_fmadd_ps(a, b, s5);
    s6 = _mm256_fmadd_ps(a, b, s6); s7 = _mm256_fmadd_ps(a, b, s7);
    s8 = _mm256_fmadd_ps(a, b, s8); s9 = _mm256_fmadd_ps(a, b, s9);
    PIN(s0); PIN(s1); PIN(s2); PIN(s3); PIN(s4); PIN(s5); PIN(s6); PIN(s7); PIN(s8); PIN(s9);
  }
  const __m256 t = _mm256_add_ps(
      _mm256_add_ps(_mm256_add_ps(s0, s1), _mm256_add_ps(s2, s3)),
      _mm256_add_ps(_mm256_add_ps(_mm256_add_ps(s4, s5), _mm256_add_ps(s6, s7)),
                    _mm256_add_ps(s8, s9)));
  return _mm256_cvtss_f32(t);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {  // without the GIL, so that threads run at once
  m.def("int8_rounds", &int8_rounds, pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("fma_rounds", &fma_rounds, pybind11::call_guard<pybind11::gil_scoped_release>());
}
"""

INT8_MACS_PER_ROUND = 6 * 32
FMA_MACS_PER_ROUND = 10 * 8


def _rate(fn, rounds: int, seconds: float, threads: int) -> float:
    """Rounds a second over `threads` OS threads running fn(rounds) back to back for
    ~seconds (the C++ loops release the GIL)."""
    done = [0] * threads

    def work(k: int) -> None:
        end = time.perf_counter() + seconds
        while time.perf_counter() < end:
            fn(rounds)
            done[k] += rounds

    pool = [threading.Thread(target=work, args=(k,)) for k in range(threads)]
    start = time.perf_counter()
    for t in pool:
        t.start()
    for t in pool:
        t.join()
    return sum(done) / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seconds", type=float, default=1.0)
    args = parser.parse_args()
    ops = load_inline("met_int8_peak", cpp_sources=[SOURCE], extra_cflags=["-O2"])
    ops.int8_rounds(1000)
    ops.fma_rounds(1000)
    rounds = 2_000_000
    result = {"bench": "int8_peak", "threads": args.threads}
    for name, fn, macs in (("int8_maddubs_addw", ops.int8_rounds, INT8_MACS_PER_ROUND),
                           ("float32_fma", ops.fma_rounds, FMA_MACS_PER_ROUND)):
        one = _rate(fn, rounds, args.seconds, 1) * macs / 1e9
        many = _rate(fn, rounds, args.seconds, args.threads) * macs / 1e9
        result[f"{name}_gmacs_per_core"] = round(one, 1)
        result[f"{name}_gmacs_all"] = round(many, 1)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
