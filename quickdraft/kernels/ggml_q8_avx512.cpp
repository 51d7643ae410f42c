// The q8 GEMM of ggml_q8.h compiled a second time, for CPUs with AVX-512 VNNI (Zen 4, Ice Lake and
// later Xeons): dpbusd does the integer dot products in one instruction instead of three, and 32 vector
// registers hold the accumulators. The integer sums are exact either way and the float steps are
// the same code, so this build's results are bitwise equal to the AVX2 build's
// (tests/test_kernels_q8.py checks it). ggml_cpu.cpp picks the build once per process from the
// CPU's features (or QUICKDRAFT_ISA=avx2).
//
// Only this file's own functions carry the AVX-512 target: the standard headers are included first,
// under the command line's AVX2 flags, so the code the two builds share (std::vector, ...) is the
// AVX2 code; everything in ggml_cpu.h / ggml_q8.h lands in namespace qd_avx512vnni.

#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstring>
#include <vector>

#pragma GCC target("avx2,fma,f16c,avx512f,avx512bw,avx512dq,avx512vl,avx512vnni")

#define QD_NS qd_avx512vnni
#define QD_VNNI 1
#include "ggml_q8.h"

void qd_abi::gemm_multi_avx512vnni(const float* x, const int64_t* gstart, int64_t ngroups, int64_t K, Job* jobs,
                                   int njobs, int nthreads, const Tuning& tune) {
  qd_avx512vnni::q8::gemm_multi(x, gstart, ngroups, K, jobs, njobs, nthreads, tune);
}
double qd_abi::dot_rate_avx512vnni(int nthreads) { return qd_avx512vnni::q8::dot_rate(nthreads); }
