// The delta rule of delta_head.h compiled a second time, for CPUs with AVX-512 (16 floats a vector instead
// of 8): delta_cpu.cpp calls it where the q8 GEMM runs its AVX-512 VNNI build (qd_api::wide_vectors), so
// QUICKDRAFT_ISA=avx2 keeps every kernel on AVX2. The same elementwise operations in the same order: the
// same bits as the AVX2 build (tests/test_qwen3_5.py).
//
// As in ggml_q8_avx512.cpp, the standard headers come first, under the command line's AVX2 flags; only
// this file's own functions carry the AVX-512 target.

#include <cstdint>

#pragma GCC target("avx2,fma,f16c,avx512f,avx512bw,avx512dq,avx512vl,prefer-vector-width=512")

#define QD_DELTA_NS qd_delta_avx512
#include "delta_head.h"

void qd_abi::delta_head_read_avx512(const float* sp, const float* k, float decay, int64_t dk, int64_t dv, float* r) {
  qd_delta_avx512::head_read(sp, k, decay, dk, dv, r);
}

void qd_abi::delta_head_write_avx512(const float* sp, float* sn, const float* k, const float* q, const float* v,
                                     float beta, float decay, int64_t dk, int64_t dv, float* r, float* o,
                                     const float* next_k, float next_decay, float* next_r) {
  qd_delta_avx512::head_write(sp, sn, k, q, v, beta, decay, dk, dv, r, o, next_k, next_decay, next_r);
}
