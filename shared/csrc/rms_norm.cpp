// pdserve.engine._cpu_kernels, RMSNorm of bf16 rows in float32 (pdserve.engine.layers.RMSNorm):
// h = x / sqrt(mean(x^2) + eps), then either rounded to bf16 and scaled by the bf16 weight
// (Llama's order: each product rounded once more) or scaled in float32 and rounded once
// (gpt-oss's). One call for all rows instead of eight tensor ops per norm. float32 rows (AVX2,
// where `--dtype auto` is float32) likewise: one call instead of torch's composite.
#include "common.h"

namespace pdserve {
namespace {

KERNEL_TARGET inline __m512 load_bf16(const uint16_t* p, __mmask16 mask) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(mask, p)), 16));
}

KERNEL_TARGET inline __m512 round_bf16(__m512 v) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(v)), 16));
}

KERNEL_TARGET void rms_norm(const uint16_t* x, int rows, int size, const uint16_t* weight, float eps,
                            bool scaled_in_float32, uint16_t* out) {
  for (int r = 0; r < rows; ++r) {
    const uint16_t* row = x + static_cast<size_t>(r) * size;
    uint16_t* dest = out + static_cast<size_t>(r) * size;
    __m512 squares = _mm512_setzero_ps();
    for (int i = 0; i < size; i += 16) {
      __mmask16 mask = size - i >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << (size - i)) - 1u);
      __m512 h = load_bf16(row + i, mask);
      squares = _mm512_fmadd_ps(h, h, squares);
    }
    const __m512 inverse = _mm512_set1_ps(1.0f / sqrtf(_mm512_reduce_add_ps(squares) / size + eps));
    for (int i = 0; i < size; i += 16) {
      __mmask16 mask = size - i >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << (size - i)) - 1u);
      __m512 h = _mm512_mul_ps(load_bf16(row + i, mask), inverse);
      __m512 w = load_bf16(weight + i, mask);
      __m512 o = scaled_in_float32 ? _mm512_mul_ps(w, h) : _mm512_mul_ps(w, round_bf16(h));
      _mm256_mask_storeu_epi16(dest + i, mask, (__m256i)_mm512_cvtneps_pbh(o));
    }
  }
}

}  // namespace

void rms_norm_bf16(const uint16_t* x, int rows, int size, const uint16_t* weight, float eps, bool scaled_in_float32,
                   uint16_t* out) {
  rms_norm(x, rows, size, weight, eps, scaled_in_float32, out);
}

PyObject* py_rms_norm(PyObject*, PyObject* args) {
  unsigned long long x, weight, out;
  int rows, size, scaled_in_float32;
  float eps;
  if (!PyArg_ParseTuple(args, "KiiKfpK", &x, &rows, &size, &weight, &eps, &scaled_in_float32, &out)) {
    return nullptr;
  }
  if (!cpu_supported()) {
    PyErr_SetString(PyExc_RuntimeError, "this CPU lacks AVX512-BF16");
    return nullptr;
  }
  if (!rows_or_error(rows, size)) return nullptr;
  Py_BEGIN_ALLOW_THREADS
  rms_norm_bf16(reinterpret_cast<const uint16_t*>(x), rows, size, reinterpret_cast<const uint16_t*>(weight), eps,
                scaled_in_float32 != 0, reinterpret_cast<uint16_t*>(out));
  Py_END_ALLOW_THREADS
  Py_RETURN_NONE;
}


namespace {

// float32 rows (AVX2): h = x / sqrt(mean(x^2) + eps), then w * h, each row alone (the sum of
// squares in eight lanes, added in one order).
F32_TARGET void rms_norm_f32_rows(const float* x, int rows, int size, const float* weight, float eps, float* out) {
  for (int r = 0; r < rows; ++r) {
    const float* row = x + static_cast<size_t>(r) * size;
    float* dest = out + static_cast<size_t>(r) * size;
    __m256 squares = _mm256_setzero_ps();
    int i = 0;
    for (; i + 8 <= size; i += 8) {
      const __m256 h = _mm256_loadu_ps(row + i);
      squares = _mm256_fmadd_ps(h, h, squares);
    }
    float sum = sum8(squares);
    for (int j = i; j < size; ++j) sum = __builtin_fmaf(row[j], row[j], sum);
    const float inverse = 1.0f / sqrtf(sum / size + eps);
    const __m256 scale = _mm256_set1_ps(inverse);
    for (i = 0; i + 8 <= size; i += 8) {
      _mm256_storeu_ps(dest + i, _mm256_mul_ps(_mm256_loadu_ps(weight + i),
                                               _mm256_mul_ps(_mm256_loadu_ps(row + i), scale)));
    }
    for (int j = i; j < size; ++j) dest[j] = weight[j] * (row[j] * inverse);
  }
}

}  // namespace

void rms_norm_f32(const float* x, int rows, int size, const float* weight, float eps, float* out) {
  rms_norm_f32_rows(x, rows, size, weight, eps, out);
}

PyObject* py_rms_norm_f32(PyObject*, PyObject* args) {
  unsigned long long x, weight, out;
  int rows, size;
  float eps;
  if (!PyArg_ParseTuple(args, "KiiKfK", &x, &rows, &size, &weight, &eps, &out)) return nullptr;
  if (!f32_supported_or_error() || !rows_or_error(rows, size)) return nullptr;
  Py_BEGIN_ALLOW_THREADS
  rms_norm_f32(reinterpret_cast<const float*>(x), rows, size, reinterpret_cast<const float*>(weight), eps,
               reinterpret_cast<float*>(out));
  Py_END_ALLOW_THREADS
  Py_RETURN_NONE;
}

}  // namespace pdserve
