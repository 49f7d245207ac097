// pdserve.engine._cpu_kernels, int8: an int8 x bf16 GEMM for a CPU with AVX512-BF16, for the
// few rows of a decode step (a GGUF's Q8_0, Q6_K and Q5_K weights as the file stores them).
//
// A weight is int8 values q in groups of 16 or 32 input features, each group with a scale s
// (float16 or float32) and optionally a float32 min m: w = s * q + m. A GGUF's blocks map onto
// it exactly: Q8_0 (groups of 32, the float16 d), Q6_K (groups of 16, q - 32 with the float32
// d * sc) and Q5_K (groups of 32, the float32 d * sc and -dmin * mn); every product s * q is
// exact in float32. Per output row o:
//
//     y[o] = sum_g s[o, g] * dot(q[o, g], x[g]) + m[o, g] * sum(x[g])
//
// The dot product runs on VDPBF16PS over q as bf16 (exact: bf16 holds every integer from -256
// to 256), widened to float32 and narrowed to bf16 32 values at a time. Products of two bf16
// numbers are exact in float32, the sums are float32. (It used to split each q into two bf16
// words built with bit operations alone, 128 + its low seven bits and -128 or -256 for its
// sign: twice the VDPBF16PS, which share the FMA units with the scales' FMAs and bound a
// one-row call. One word per value runs the default model's one-row LM head about 18% faster,
// with the same results on random weights.) A call walks 32 input features at a time: its 16
// float32 lanes hold pairs of features, lanes 0-7 the first 16 and 8-15 the second, so a group
// of 16 takes its scale (and min) in half the lanes. A min multiplies the lanes' pair sums of x
// (computed once per call), in the same lanes. Every row of a call is computed alone, in the
// same order, so a row's result does not depend on the other rows (batch-invariant by
// construction). With a one-hot x a lane holds s * q (exact) + m, rounded once: the value
// gguf's dequantize computes.
//
// The weight is [out][in] int8 in the columns' own order and the scales and mins
// [out][in / group], as the file stores them: a tied embedding reads its rows from the same
// tensors.
#include "common.h"

namespace pdserve {
namespace {

constexpr int kChunk = 32;
constexpr int kRowBlock = 4;
// NOTE: 12 accumulator chains a call (output rows x input rows): with fewer, each group's two
// VDPBF16PS and FMA wait on their latency (a one-row LM head of 49152 x 576: 4 chains 1.4-1.6 ms,
// 8 chains 0.95, 12 chains 0.83, the read alone 0.78-0.85).
constexpr int kOutBlock = 48;
// NOTE: a one-row call streams its weight from memory once, so each block of OB output rows
// prefetches the rows kPrefetchBlocks blocks ahead (and each block of kOutBlock rows the next
// one's scales): without it the default model's one-row LM head read at about 23 GB/s, 1.2-1.4
// ms; with it 0.74-0.83 ms, about the machine's read bandwidth (2 blocks ahead: 1 was 0.83, 3
// 0.77; `python bench/int8_gemm.py`).
constexpr int kPrefetchBlocks = 2;

// A weight's layout: its group size and where its scales and mins are.
struct Layout {
  int group;               // 16 or 32
  bool scales_f32;         // float32 scales, else float16
  const void* scales;      // [out][in / group]
  const float* mins;       // [out][in / group] float32, or null
};

// The vector of a chunk's scales (or mins) from the group's float32 values `v` (of the chunk's
// first group): one value in every lane, or a group of 16's in its half of the lanes.
template <bool G16>
KERNEL_TARGET inline __m512 chunk_vector(const float* v) {
  if (G16) return _mm512_shuffle_f32x4(_mm512_set1_ps(v[0]), _mm512_set1_ps(v[1]), 0x00);
  return _mm512_set1_ps(v[0]);
}

// y[r][o] for R input rows and the output rows [o_begin, o_end), OB output rows at a time (their
// accumulators are independent chains; one chain would wait on each FMA's latency). `scales` and
// `mins` are the float32 values of the output rows from o_begin, [o - o_begin][num_groups];
// `xsums[r]` each chunk's pair sums of input row r (with mins).
template <int R, int OB, bool G16, bool MINS>
KERNEL_TARGET void rows_kernel(const uint16_t* const* x, const float* const* xsums, int num_chunks,
                               const int8_t* weight, const float* scales, const float* mins,
                               int o_begin, int o_end, uint16_t* const* out) {
  const size_t row_bytes = static_cast<size_t>(num_chunks) * kChunk;
  const int num_groups = G16 ? 2 * num_chunks : num_chunks;
  const size_t ahead = static_cast<size_t>(kPrefetchBlocks) * OB * row_bytes;  // a line every 2 chunks
  constexpr int kPerChunk = G16 ? 2 : 1;
  int o = o_begin;
  for (; o + OB <= o_end; o += OB) {
    __m512 total[OB][R];
    for (int b = 0; b < OB; ++b)
      for (int r = 0; r < R; ++r) total[b][r] = _mm512_setzero_ps();
    const int8_t* rows_w = weight + static_cast<size_t>(o) * row_bytes;
    const float* rows_s = scales + static_cast<size_t>(o - o_begin) * num_groups;
    const float* rows_m = MINS ? mins + static_cast<size_t>(o - o_begin) * num_groups : nullptr;
    for (int c = 0; c < num_chunks; ++c) {
      __m512i xs[R];
      for (int r = 0; r < R; ++r) xs[r] = _mm512_loadu_si512(x[r] + c * kChunk);
      for (int b = 0; b < OB; ++b) {
        const int8_t* w = rows_w + b * row_bytes + c * kChunk;
        if ((c & 1) == 0) _mm_prefetch(reinterpret_cast<const char*>(w + ahead), _MM_HINT_T0);
        // the chunk's 32 q as bf16 (exact), the first 16 in the low half
        const __m128i* bytes = reinterpret_cast<const __m128i*>(w);
        const __m512 first = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(bytes)));
        const __m512 second = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(bytes + 1)));
        const __m512bh q = _mm512_cvtne2ps_pbh(second, first);
        __m512 scale = chunk_vector<G16>(rows_s + b * num_groups + c * kPerChunk);
        __m512 min = MINS ? chunk_vector<G16>(rows_m + b * num_groups + c * kPerChunk) : scale;
        for (int r = 0; r < R; ++r) {
          const __m512 acc = _mm512_dpbf16_ps(_mm512_setzero_ps(), q, (__m512bh)xs[r]);
          total[b][r] = _mm512_fmadd_ps(acc, scale, total[b][r]);
          if (MINS) total[b][r] = _mm512_fmadd_ps(min, _mm512_loadu_ps(xsums[r] + c * 16), total[b][r]);
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
    const size_t skip = static_cast<size_t>(o - o_begin) * num_groups;
    rows_kernel<R, 1, G16, MINS>(x, xsums, num_chunks, weight, scales + skip,
                                 MINS ? mins + skip : nullptr, o, o_end, out);
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

// A call's output rows [begin, end), block after block of kOutBlock: the kernel team
// (team.cpp) splits a one-row call into parts of whole blocks (`run`); each output is computed
// as one thread computes it, so the bits do not depend on the parts.
template <bool G16, bool MINS>
struct Outputs {
  const uint16_t* x;
  const float* xsums;  // [rows][chunks][16] where MINS
  int num_rows, in_features, out_features;
  const int8_t* weight;
  Layout layout;
  uint16_t* out;

  KERNEL_TARGET void compute(int begin, int end) const {
    const int num_chunks = in_features / kChunk;
    const int num_groups = in_features / layout.group;
    thread_local std::vector<float> block_scales;
    if (!layout.scales_f32) block_scales.resize(static_cast<size_t>(kOutBlock) * num_groups);
    // NOTE: a block of output rows stays in cache while every block of input rows passes it.
    for (int o = begin; o < end; o += kOutBlock) {
      int o_end = o + kOutBlock < end ? o + kOutBlock : end;
      const size_t first = static_cast<size_t>(o) * num_groups;
      const float* s;
      if (layout.scales_f32) {
        s = static_cast<const float*>(layout.scales) + first;
      } else {
        widen_scales(static_cast<const uint16_t*>(layout.scales) + first,
                     static_cast<size_t>(o_end - o) * num_groups, block_scales.data());
        s = block_scales.data();
      }
      const float* m = MINS ? layout.mins + first : nullptr;
      {  // the next block's scales
        const size_t size = layout.scales_f32 ? sizeof(float) : sizeof(uint16_t);
        const char* base = static_cast<const char*>(layout.scales);
        const char* next = base + (first + static_cast<size_t>(kOutBlock) * num_groups) * size;
        const char* last = base + static_cast<size_t>(end) * num_groups * size;
        const size_t bytes = static_cast<size_t>(kOutBlock) * num_groups * size;
        for (size_t i = 0; i < bytes && next + i < last; i += 64) _mm_prefetch(next + i, _MM_HINT_T0);
      }
      for (int r = 0; r < num_rows; r += kRowBlock) {
        const uint16_t* xs[kRowBlock];
        const float* sums[kRowBlock];
        uint16_t* outs[kRowBlock];
        int block = num_rows - r < kRowBlock ? num_rows - r : kRowBlock;
        for (int i = 0; i < block; ++i) {
          xs[i] = x + static_cast<size_t>(r + i) * in_features;
          sums[i] = MINS ? xsums + static_cast<size_t>(r + i) * num_chunks * 16 : nullptr;
          outs[i] = out + static_cast<size_t>(r + i) * out_features;
        }
        switch (block) {
          case 4: rows_kernel<4, 3, G16, MINS>(xs, sums, num_chunks, weight, s, m, o, o_end, outs); break;
          case 3: rows_kernel<3, 4, G16, MINS>(xs, sums, num_chunks, weight, s, m, o, o_end, outs); break;
          case 2: rows_kernel<2, 6, G16, MINS>(xs, sums, num_chunks, weight, s, m, o, o_end, outs); break;
          default: rows_kernel<1, 12, G16, MINS>(xs, sums, num_chunks, weight, s, m, o, o_end, outs); break;
        }
      }
    }
  }

  // Part `part` of `parts`: whole blocks of output rows (`part_rows`).
  KERNEL_TARGET static void run(void* self, int part, int parts) {
    const auto& call = *static_cast<const Outputs*>(self);
    int begin, end;
    part_rows(call.out_features, kOutBlock, part, parts, &begin, &end);
    if (begin < end) call.compute(begin, end);
  }
};

template <bool G16, bool MINS>
KERNEL_TARGET void gemm(const uint16_t* x, int num_rows, int in_features, const int8_t* weight,
                        const Layout& layout, int out_features, uint16_t* out) {
  const int num_chunks = in_features / kChunk;
  thread_local std::vector<float> xsums;  // [rows][chunks][16]
  if (MINS) {
    // each input row's pair sums x[2i] + x[2i + 1] per chunk, the lanes its min multiplies
    xsums.resize(static_cast<size_t>(num_rows) * num_chunks * 16);
    const __m512i ones = _mm512_set1_epi16(0x3F80);  // bf16 1.0
    for (int r = 0; r < num_rows; ++r) {
      for (int c = 0; c < num_chunks; ++c) {
        __m512i xs = _mm512_loadu_si512(x + static_cast<size_t>(r) * in_features + c * kChunk);
        _mm512_storeu_ps(xsums.data() + (static_cast<size_t>(r) * num_chunks + c) * 16,
                         _mm512_dpbf16_ps(_mm512_setzero_ps(), (__m512bh)ones, (__m512bh)xs));
      }
    }
  }
  Outputs<G16, MINS> call{x, MINS ? xsums.data() : nullptr, num_rows, in_features, out_features, weight, layout, out};
  team_run(&Outputs<G16, MINS>::run, &call, num_rows);
}

// Rows `ids` of the weight as bf16 ``s * q + m`` (the product exact in float32, the sum rounded
// once in float32, then once to bf16, to nearest even), [len(ids)][in]: an embedding's lookup,
// or the whole weight for a GEMM of many rows. An id is checked against out_features by the
// caller.
KERNEL_TARGET void dequantize_rows(const int8_t* weight, const Layout& layout, int in_features,
                                   const int64_t* ids, int num_ids, uint16_t* out) {
  const int num_groups = in_features / layout.group;
  const int per_half = layout.group == 16 ? 1 : 0;  // a chunk's second half: group + per_half
  for (int i = 0; i < num_ids; ++i) {
    const size_t row = ids == nullptr ? static_cast<size_t>(i) : static_cast<size_t>(ids[i]);
    const int8_t* w = weight + row * in_features;
    const size_t first = row * num_groups;
    uint16_t* dest = out + static_cast<size_t>(i) * in_features;
    for (int c = 0; c < in_features / kChunk; ++c) {
      __m512 halves[2];
      for (int h = 0; h < 2; ++h) {
        const size_t g = first + static_cast<size_t>(c) * (1 + per_half) + h * per_half;
        const float scale = layout.scales_f32 ? static_cast<const float*>(layout.scales)[g]
                                              : _cvtsh_ss(static_cast<const uint16_t*>(layout.scales)[g]);
        __m512 value = _mm512_mul_ps(
            _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
                _mm_loadu_si128(reinterpret_cast<const __m128i*>(w + c * kChunk + 16 * h)))),
            _mm512_set1_ps(scale));
        if (layout.mins != nullptr) value = _mm512_add_ps(value, _mm512_set1_ps(layout.mins[g]));
        halves[h] = value;
      }
      _mm512_storeu_si512(dest + c * kChunk, (__m512i)_mm512_cvtne2ps_pbh(halves[1], halves[0]));
    }
  }
}

// The layout from the Python arguments, or null with an exception set.
bool parse_layout(int in_features, int group, int scales_f32, unsigned long long scales,
                  unsigned long long mins, Layout* layout) {
  if (!cpu_supported()) {
    PyErr_SetString(PyExc_RuntimeError, "this CPU lacks AVX512-BF16");
    return false;
  }
  if ((group != 16 && group != 32) || in_features <= 0 || in_features % kChunk != 0) {
    PyErr_SetString(PyExc_ValueError, "group must be 16 or 32, in_features a positive multiple of 32");
    return false;
  }
  *layout = Layout{group, scales_f32 != 0, reinterpret_cast<const void*>(scales),
                   reinterpret_cast<const float*>(mins)};
  return true;
}

}  // namespace

void int8_gemm_bf16(const uint16_t* x, int num_rows, int in_features, const int8_t* weight, const void* scales,
                    bool scales_f32, int group, const float* mins, int out_features, uint16_t* out) {
  const Layout layout{group, scales_f32, scales, mins};
  if (group == 16) {
    if (mins) gemm<true, true>(x, num_rows, in_features, weight, layout, out_features, out);
    else gemm<true, false>(x, num_rows, in_features, weight, layout, out_features, out);
  } else {
    if (mins) gemm<false, true>(x, num_rows, in_features, weight, layout, out_features, out);
    else gemm<false, false>(x, num_rows, in_features, weight, layout, out_features, out);
  }
}

PyObject* py_int8_gemm(PyObject*, PyObject* args) {
  unsigned long long x, weight, scales, mins, out;
  int num_rows, in_features, group, scales_f32, out_features;
  if (!PyArg_ParseTuple(args, "KiiKKiiKiK", &x, &num_rows, &in_features, &weight, &scales, &scales_f32,
                        &group, &mins, &out_features, &out)) {
    return nullptr;
  }
  Layout layout;
  if (!parse_layout(in_features, group, scales_f32, scales, mins, &layout)) return nullptr;
  if (num_rows < 0 || out_features <= 0) {
    PyErr_SetString(PyExc_ValueError, "rows must be >= 0 and out_features positive");
    return nullptr;
  }
  Py_BEGIN_ALLOW_THREADS
  int8_gemm_bf16(reinterpret_cast<const uint16_t*>(x), num_rows, in_features, reinterpret_cast<const int8_t*>(weight),
                 layout.scales, layout.scales_f32, layout.group, layout.mins, out_features,
                 reinterpret_cast<uint16_t*>(out));
  Py_END_ALLOW_THREADS
  Py_RETURN_NONE;
}

PyObject* py_int8_dequantize(PyObject*, PyObject* args) {
  unsigned long long weight, scales, mins, ids, out;
  int in_features, group, scales_f32, num_ids;
  if (!PyArg_ParseTuple(args, "KKiiKiKiK", &weight, &scales, &scales_f32, &group, &mins, &in_features,
                        &ids, &num_ids, &out)) {
    return nullptr;
  }
  Layout layout;
  if (!parse_layout(in_features, group, scales_f32, scales, mins, &layout)) return nullptr;
  if (num_ids < 0) {
    PyErr_SetString(PyExc_ValueError, "num_ids must be >= 0");
    return nullptr;
  }
  Py_BEGIN_ALLOW_THREADS
  dequantize_rows(reinterpret_cast<const int8_t*>(weight), layout, in_features,
                  reinterpret_cast<const int64_t*>(ids), num_ids, reinterpret_cast<uint16_t*>(out));
  Py_END_ALLOW_THREADS
  Py_RETURN_NONE;
}

}  // namespace pdserve
