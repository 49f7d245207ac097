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
// The float32 kernels' (f32_gemm.cpp, and the float32 forms in decode_attention.cpp and
// rms_norm.cpp): AVX2, FMA and F16C.
#define F32_TARGET __attribute__((target("avx2,fma,f16c")))

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

inline __mmask16 first_lanes(int count) {
  return count >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << count) - 1u);
}

// Each of four vectors' 16 lanes summed, in one order for every vector (so a row's sum does not
// depend on which rows share the call): lanes i and i + 2 of each 128-bit chunk, then the two
// halves of the chunk, then the chunks as (0 + 2) + (1 + 3).
KERNEL_TARGET inline __m128 sum4(__m512 a, __m512 b, __m512 c, __m512 d) {
  __m512 ab = _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));
  __m512 cd = _mm512_add_ps(_mm512_unpacklo_ps(c, d), _mm512_unpackhi_ps(c, d));
  __m512 chunks = _mm512_add_ps(_mm512_shuffle_ps(ab, cd, 0x44), _mm512_shuffle_ps(ab, cd, 0xEE));
  __m256 halves = _mm256_add_ps(_mm512_castps512_ps256(chunks), _mm512_extractf32x8_ps(chunks, 1));
  return _mm_add_ps(_mm256_castps256_ps128(halves), _mm256_extractf128_ps(halves, 1));
}

// The eight lanes summed in one order: lanes i and i + 4, then i and i + 2, then the two left.
F32_TARGET inline float sum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// exp of eight lanes: Cody-Waite reduction by ln 2, a degree-5 polynomial (Cephes' expf),
// then 2^n; within 2 ulp over [-87, 88].
F32_TARGET inline __m256 exp8(__m256 x) {
  x = _mm256_min_ps(x, _mm256_set1_ps(88.3762626647949f));
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.3365447504019f));
  __m256 n = _mm256_floor_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f)));
  x = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  x = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), x);
  __m256 y = _mm256_set1_ps(1.9875691500e-4f);
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507e-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073e-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894e-2f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459e-1f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201e-1f));
  y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.0f)));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}

// Whether this CPU runs the kernels: AVX-512 (F, BW, DQ, VL) with BF16, FMA and F16C.
bool cpu_supported();

PyObject* py_int4_gemm(PyObject*, PyObject* args);
PyObject* py_int4_dequantize(PyObject*, PyObject* args);
PyObject* py_int8_gemm(PyObject*, PyObject* args);
PyObject* py_int8_dequantize(PyObject*, PyObject* args);
PyObject* py_decode_attention(PyObject*, PyObject* args);
PyObject* py_rms_norm(PyObject*, PyObject* args);
// amx_gemm.cpp: an int4 GEMM on AMX tiles in one summation order for every row count.
PyObject* py_amx_supported(PyObject*, PyObject*);
PyObject* py_amx_int4_gemm(PyObject*, PyObject* args);

// Whether this CPU runs the float32 kernels (f32_gemm.cpp): AVX2, FMA and F16C.
bool f32_supported();
// f32_supported, or false with a Python RuntimeError set (a float32 kernel's Python entry).
bool f32_supported_or_error();

// Whether a call's rows and row size are sound, or false with a Python ValueError set.
inline bool rows_or_error(int rows, int size) {
  if (rows >= 0 && size > 0) return true;
  PyErr_SetString(PyExc_ValueError, "rows and size must be positive");
  return false;
}
PyObject* py_f32_supported(PyObject*, PyObject*);
PyObject* py_int4_gemm_f32(PyObject*, PyObject* args);
PyObject* py_int4_dequantize_f32(PyObject*, PyObject* args);
PyObject* py_int8_gemm_f32(PyObject*, PyObject* args);
PyObject* py_decode_attention_f32(PyObject*, PyObject* args);
PyObject* py_rms_norm_f32(PyObject*, PyObject* args);
PyObject* py_silu_mul_f32(PyObject*, PyObject* args);
PyObject* py_decode_layers_f32(PyObject*, PyObject* args);

// The float32 kernels as the fused decode step (fused_decode.cpp) calls them, each as its
// Python entry does (arguments as there, addresses as pointers).
void int4_gemm_f32(const float* x, int num_rows, int in_features, const uint8_t* weight, const void* scales,
                   const void* mins, int out_features, float* out, bool half_scales, const uint16_t* table = nullptr);
void int8_gemm_f32(const float* x, int num_rows, int in_features, const int8_t* weight, const void* scales,
                   bool scales_f32, int group, const float* mins, int out_features, float* out);
void rms_norm_f32(const float* x, int rows, int size, const float* weight, float eps, float* out);

// The bf16 kernels as the fused decode step calls them (AVX512-BF16; bf16 as uint16_t).
void int4_gemm_bf16(const uint16_t* x, int num_rows, int in_features, const uint8_t* weight, const void* scales,
                    const void* mins, int out_features, uint16_t* out, bool half_scales, const uint16_t* table = nullptr);
void int8_gemm_bf16(const uint16_t* x, int num_rows, int in_features, const int8_t* weight, const void* scales,
                    bool scales_f32, int group, const float* mins, int out_features, uint16_t* out);
void rms_norm_bf16(const uint16_t* x, int rows, int size, const uint16_t* weight, float eps, bool scaled_in_float32,
                   uint16_t* out);
PyObject* py_silu_mul(PyObject*, PyObject* args);
PyObject* py_decode_layers(PyObject*, PyObject* args);

// The decode attention as the fused decode step calls it (no window, no sinks), T float
// (float32) or uint16_t (bf16; decode_attention.cpp instantiates both).
template <typename T>
void decode_attention_plain(const T* q, const T* k_cache, const T* v_cache, const int32_t* tables, int table_stride,
                            const int32_t* lens, int num_seqs, int num_heads, int num_kv_heads, int head_dim,
                            int block_size, float scale, T* out);

// The kernel team (team.cpp): `part(context, i, parts)` for every i in [0, parts), i = 0 on the
// calling thread, for a call of `rows` input rows; parts is 1 (this thread alone) where the team
// has one thread, the call has more rows than the team takes, the team is busy with another
// call, or the caller is one of its threads.
using PartFn = void (*)(void* context, int part, int parts);

// The output rows of part `part` of `parts`, in whole units of `unit` rows: units
// [units * part / parts, units * (part + 1) / parts) of the `count` rows' ceil(count / unit),
// as [*begin, *end) (empty where *begin >= *end).
inline void part_rows(int count, int unit, int part, int parts, int* begin, int* end) {
  const int64_t units = (count + unit - 1) / unit;
  *begin = static_cast<int>(units * part / parts) * unit;
  *end = static_cast<int>(units * (part + 1) / parts) * unit;
  if (*end > count) *end = count;
}

// Whether the CPU runs a kernel set (`supported`), or false with a Python RuntimeError saying
// `unsupported`.
inline bool supported_or_error(bool supported, const char* unsupported) {
  if (!supported) PyErr_SetString(PyExc_RuntimeError, unsupported);
  return supported;
}
void team_run(PartFn part, void* context, int rows);
PyObject* py_set_team_threads(PyObject*, PyObject* args);
PyObject* py_team_threads(PyObject*, PyObject*);

}  // namespace pdserve
