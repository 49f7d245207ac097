// pdserve's CPU kernels (pdserve.engine._cpu_kernels): what the kernels share.
#pragma once

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#include <vector>

#define KERNEL_TARGET __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,avx512bf16,fma,f16c")))

namespace pdserve {

inline float bf16_to_float(uint16_t v) {
  uint32_t bits = static_cast<uint32_t>(v) << 16;
  float f;
  memcpy(&f, &bits, sizeof f);
  return f;
}

inline uint16_t float_to_bf16(float f) {
  // Round to nearest even, as torch converts; a NaN stays a NaN.
  uint32_t bits;
  memcpy(&bits, &f, sizeof bits);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((bits >> 16) | 0x40);
  bits += 0x7fffu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>(bits >> 16);
}

// Whether this CPU runs the kernels: AVX-512 (F, BW, DQ, VL) with BF16, FMA and F16C.
bool cpu_supported();

PyObject* py_int4_gemm(PyObject*, PyObject* args);
PyObject* py_int4_dequantize(PyObject*, PyObject* args);
PyObject* py_decode_attention(PyObject*, PyObject* args);
PyObject* py_rms_norm(PyObject*, PyObject* args);

}  // namespace pdserve
