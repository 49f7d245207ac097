// pdserve.engine._cpu_kernels, int8: an int8 x bf16 GEMM for a CPU with AVX512-BF16, for the
// few rows of a decode step (the LM head of a GGUF whose embedding is Q8_0).
//
// A weight is int8 values q (-128..127) in groups of 32 input features, each group with a
// float16 scale d: w = d * q (a GGUF's Q8_0 blocks, exactly: the product of a float16 and an
// int8 is exact in float32). Per output row o:
//
//     y[o] = sum_g d[o, g] * dot(q[o, g], x[g])
//
// The dot product runs on VDPBF16PS over two bf16 words per value, both exact: with q's low
// seven bits r and its sign bit b (q = r - 128 b),
//
//     lo = 128 + r           (bf16 0x4300 | r)
//     hi = -128 - 128 b      (bf16 0xC300 | (b << 7): -128, or -256 for a negative q)
//
// so lo + hi = q and dot(lo, x) + dot(hi, x) = dot(q, x): products of two bf16 numbers are
// exact in float32, the sums are float32. Every row of a call is computed alone, in the same
// order, so a row's result does not depend on the other rows (batch-invariant by construction).
//
// The weight is [out][in] int8 in the columns' own order and the scales [out][in / 32] float16,
// as the file stores them: a tied embedding reads its rows from the same tensors.
#include "common.h"

namespace pdserve {
namespace {

constexpr int kGroup = 32;
constexpr int kRowBlock = 4;
// NOTE: 12 accumulator chains a call (output rows x input rows): with fewer, each group's two
// VDPBF16PS and FMA wait on their latency (a one-row LM head of 49152 x 576: 4 chains 1.4-1.6 ms,
// 8 chains 0.95, 12 chains 0.83, the read alone 0.78-0.85).
constexpr int kOutBlock = 48;

// y[r][o] for R input rows and the output rows [o_begin, o_end), OB output rows at a time (their
// accumulators are independent chains; one chain would wait on each FMA's latency). `scales` are
// the float32 scales of the output rows from o_begin, [o - o_begin][G].
template <int R, int OB>
KERNEL_TARGET void rows_kernel(const uint16_t* const* x, int num_groups, const int8_t* weight,
                               const float* scales, int o_begin, int o_end, uint16_t* const* out) {
  const size_t row_bytes = static_cast<size_t>(num_groups) * kGroup;
  const __m512i low7 = _mm512_set1_epi16(0x007F);
  const __m512i plus128 = _mm512_set1_epi16(0x4300);  // bf16 128.0
  const __m512i sign = _mm512_set1_epi16(0x0080);
  const __m512i minus128 = _mm512_set1_epi16(static_cast<short>(0xC300));  // bf16 -128.0
  int o = o_begin;
  for (; o + OB <= o_end; o += OB) {
    __m512 total[OB][R];
    for (int b = 0; b < OB; ++b)
      for (int r = 0; r < R; ++r) total[b][r] = _mm512_setzero_ps();
    const int8_t* rows_w = weight + static_cast<size_t>(o) * row_bytes;
    const float* rows_s = scales + static_cast<size_t>(o - o_begin) * num_groups;
    for (int g = 0; g < num_groups; ++g) {
      __m512i xs[R];
      for (int r = 0; r < R; ++r) xs[r] = _mm512_loadu_si512(x[r] + g * kGroup);
      for (int b = 0; b < OB; ++b) {
        const int8_t* w = rows_w + b * row_bytes + g * kGroup;
        // q sign-extended to 16 bits: bit 7 is the sign bit b
        __m512i wide = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w)));
        __m512i lo = _mm512_ternarylogic_epi32(wide, low7, plus128, 0xEA);   // (w & 0x7F) | 0x4300
        __m512i hi = _mm512_ternarylogic_epi32(wide, sign, minus128, 0xEA);  // (w & 0x80) | 0xC300
        __m512 scale = _mm512_set1_ps(rows_s[b * num_groups + g]);
        for (int r = 0; r < R; ++r) {
          __m512 acc = _mm512_dpbf16_ps(_mm512_setzero_ps(), (__m512bh)lo, (__m512bh)xs[r]);
          acc = _mm512_dpbf16_ps(acc, (__m512bh)hi, (__m512bh)xs[r]);
          total[b][r] = _mm512_fmadd_ps(acc, scale, total[b][r]);
        }
      }
    }
    for (int r = 0; r < R; ++r) {
      for (int b = 0; b < OB; b += 4) {
        const __m512 zero = _mm512_setzero_ps();
        __m128 sums = sum4(total[b][r], b + 1 < OB ? total[b + 1][r] : zero,
                           b + 2 < OB ? total[b + 2][r] : zero, b + 3 < OB ? total[b + 3][r] : zero);
        float lanes[4];
        _mm_storeu_ps(lanes, sums);
        for (int i = 0; i < 4 && b + i < OB; ++i) out[r][o + b + i] = float_to_bf16(lanes[i]);
      }
    }
  }
  if (o < o_end) {
    rows_kernel<R, 1>(x, num_groups, weight, scales + static_cast<size_t>(o - o_begin) * num_groups, o,
                      o_end, out);
  }
}

// float16 scales of `count` values to float32 (exact).
KERNEL_TARGET void widen_scales(const uint16_t* half, size_t count, float* out) {
  size_t i = 0;
  for (; i + 16 <= count; i += 16) {
    _mm512_storeu_ps(out + i, _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(half + i))));
  }
  for (; i < count; ++i) out[i] = _cvtsh_ss(half[i]);
}

KERNEL_TARGET void gemm(const uint16_t* x, int num_rows, int in_features, const int8_t* weight,
                        const uint16_t* scales, int out_features, uint16_t* out) {
  const int num_groups = in_features / kGroup;
  thread_local std::vector<float> block_scales;
  block_scales.resize(static_cast<size_t>(kOutBlock) * num_groups);
  // NOTE: a block of output rows stays in cache while every block of input rows passes it.
  for (int o = 0; o < out_features; o += kOutBlock) {
    int o_end = o + kOutBlock < out_features ? o + kOutBlock : out_features;
    widen_scales(scales + static_cast<size_t>(o) * num_groups,
                 static_cast<size_t>(o_end - o) * num_groups, block_scales.data());
    for (int r = 0; r < num_rows; r += kRowBlock) {
      const uint16_t* xs[kRowBlock];
      uint16_t* outs[kRowBlock];
      int block = num_rows - r < kRowBlock ? num_rows - r : kRowBlock;
      for (int i = 0; i < block; ++i) {
        xs[i] = x + static_cast<size_t>(r + i) * in_features;
        outs[i] = out + static_cast<size_t>(r + i) * out_features;
      }
      const float* s = block_scales.data();
      switch (block) {
        case 4: rows_kernel<4, 3>(xs, num_groups, weight, s, o, o_end, outs); break;
        case 3: rows_kernel<3, 4>(xs, num_groups, weight, s, o, o_end, outs); break;
        case 2: rows_kernel<2, 6>(xs, num_groups, weight, s, o, o_end, outs); break;
        default: rows_kernel<1, 12>(xs, num_groups, weight, s, o, o_end, outs); break;
      }
    }
  }
}

// Rows `ids` of the weight as bf16 ``d * q`` (exact in float32, rounded once, to nearest even),
// [len(ids)][in]: an embedding's lookup, or the whole weight for a GEMM of many rows. An id is
// checked against out_features by the caller.
KERNEL_TARGET void dequantize_rows(const int8_t* weight, const uint16_t* scales, int in_features,
                                   const int64_t* ids, int num_ids, uint16_t* out) {
  const int num_groups = in_features / kGroup;
  for (int i = 0; i < num_ids; ++i) {
    const size_t row = ids == nullptr ? static_cast<size_t>(i) : static_cast<size_t>(ids[i]);
    const int8_t* w = weight + row * in_features;
    const uint16_t* s = scales + row * num_groups;
    uint16_t* dest = out + static_cast<size_t>(i) * in_features;
    for (int g = 0; g < num_groups; ++g) {
      const __m512 scale = _mm512_set1_ps(_cvtsh_ss(s[g]));
      const __m512 first = _mm512_mul_ps(
          _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + g * kGroup)))),
          scale);
      const __m512 second = _mm512_mul_ps(
          _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + g * kGroup + 16)))),
          scale);
      _mm512_storeu_si512(dest + g * kGroup, (__m512i)_mm512_cvtne2ps_pbh(second, first));
    }
  }
}

}  // namespace

PyObject* py_int8_gemm(PyObject*, PyObject* args) {
  unsigned long long x, weight, scales, out;
  int num_rows, in_features, out_features;
  if (!PyArg_ParseTuple(args, "KiiKKiK", &x, &num_rows, &in_features, &weight, &scales, &out_features,
                        &out)) {
    return nullptr;
  }
  if (!cpu_supported()) {
    PyErr_SetString(PyExc_RuntimeError, "this CPU lacks AVX512-BF16");
    return nullptr;
  }
  if (num_rows < 0 || in_features <= 0 || in_features % kGroup != 0 || out_features <= 0) {
    PyErr_SetString(PyExc_ValueError, "in_features must be a positive multiple of 32");
    return nullptr;
  }
  Py_BEGIN_ALLOW_THREADS
  gemm(reinterpret_cast<const uint16_t*>(x), num_rows, in_features, reinterpret_cast<const int8_t*>(weight),
       reinterpret_cast<const uint16_t*>(scales), out_features, reinterpret_cast<uint16_t*>(out));
  Py_END_ALLOW_THREADS
  Py_RETURN_NONE;
}

PyObject* py_int8_dequantize(PyObject*, PyObject* args) {
  unsigned long long weight, scales, ids, out;
  int in_features, num_ids;
  if (!PyArg_ParseTuple(args, "KKiKiK", &weight, &scales, &in_features, &ids, &num_ids, &out)) {
    return nullptr;
  }
  if (!cpu_supported()) {
    PyErr_SetString(PyExc_RuntimeError, "this CPU lacks AVX512-BF16");
    return nullptr;
  }
  if (num_ids < 0 || in_features <= 0 || in_features % kGroup != 0) {
    PyErr_SetString(PyExc_ValueError, "in_features must be a positive multiple of 32");
    return nullptr;
  }
  Py_BEGIN_ALLOW_THREADS
  dequantize_rows(reinterpret_cast<const int8_t*>(weight), reinterpret_cast<const uint16_t*>(scales),
                  in_features, reinterpret_cast<const int64_t*>(ids), num_ids,
                  reinterpret_cast<uint16_t*>(out));
  Py_END_ALLOW_THREADS
  Py_RETURN_NONE;
}

}  // namespace pdserve
