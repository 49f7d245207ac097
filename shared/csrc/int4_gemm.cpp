// pdserve.engine._cpu_kernels, int4: an int4 x bf16 GEMM for a CPU with AVX512-BF16, for the
// few rows of a decode step (a one-row step streams every weight once and does little else).
//
// A weight is 4-bit values q (0..15) in groups of 32 input features, each group with a scale s
// and a min m: w = s * q + m (a GGUF's Q4_0, Q4_1 and Q4_K blocks, exactly). Per output row o:
//
//     y[o] = sum_g s[o, g] * dot(q[o, g], x[g]) + m[o, g] * sum(x[g])
//
// The dot product runs on VDPBF16PS: a value q becomes the bf16 number 128 + q (exact: bf16
// holds the integers 128..255), so dot(128 + q, x) - 128 * sum(x) = dot(q, x), with each lane's
// own -128 * sum(x) as the accumulator's start. Products of two bf16 numbers are exact in
// float32; the sums are float32. Every row of a call is computed alone, in the same order, so a
// row's result does not depend on the other rows (batch-invariant by construction).
//
// The weight layout (`pack` in pdserve.engine.int4_kernel): a row is P = in / 64 pairs of
// groups, 32 bytes each. Byte k = 4t + 2g + e (t 0..7, g 0..1, e 0..1) of pair p holds, for group
// 2p + g, column j = 2t + e in its low nibble and column 16 + j in its high one, so 16-bit lane
// pair L = 2t + g of the widened bytes belongs to group g: the pair's two scales broadcast as
// [s0, s1, s0, s1, ...]. Scales are [out][G]; mins are transposed, [G][out], so that the mins'
// share of 16 output rows is one FMA per group.
//
// With a table the 4-bit values are codes: w = s * table[q] (+ m), the table 16 bf16 numbers
// (MXFP4's e2m1 values: gpt-oss's experts as released, their e8m0 block scales the group
// scales, no mins). One VPERMW turns a code into its bf16 value and the same VDPBF16PS takes
// it, with no offset to take back: exact products, float32 sums, as above.
#include <algorithm>

#include "common.h"

namespace pdserve {
namespace {

constexpr int kGroup = 32;
constexpr int kRowBlock = 4;
// NOTE: a call streams its weight, scales and mins from memory once (a one-row step's 30 layers
// of them do not stay in cache), so it prefetches them ahead of use: the weight kPrefetchBlocks
// blocks of output rows ahead, the next block's scales while a block runs, the next strip of
// mins, and the first kStartRows rows and block of scales before the rows are prepared. Without
// them the default model's projections at one row read at half the machine's bandwidth.
constexpr int kOutBlock = 48;
constexpr int kPrefetchBlocks = 3;
constexpr int kStartRows = 36;



// One row of x, laid out for the kernel.
struct PreparedRow {
  const uint16_t* words;  // [P][64]: the pair's 32 low-nibble columns, then its 32 high ones
  const float* starts;    // [P][16]: -128 * the sum of the four x a lane multiplies
  const float* sums;      // [G]: each group's sum of x
  const float* mins_term; // [out]: sum_g mins[o][g] * sums[g]
};

void prepare_row(const uint16_t* x, int num_pairs, uint16_t* words, float* starts, float* sums) {
  for (int p = 0; p < num_pairs; ++p) {
    uint16_t* lo = words + p * 64;
    uint16_t* hi = lo + 32;
    for (int t = 0; t < 8; ++t) {
      for (int g = 0; g < 2; ++g) {
        const uint16_t* group = x + (2 * p + g) * kGroup;
        for (int e = 0; e < 2; ++e) {
          int k = 4 * t + 2 * g + e;
          int j = 2 * t + e;
          lo[k] = group[j];
          hi[k] = group[16 + j];
        }
      }
    }
    for (int lane = 0; lane < 16; ++lane) {
      float sum = bf16_to_float(lo[2 * lane]) + bf16_to_float(lo[2 * lane + 1]) +
                  bf16_to_float(hi[2 * lane]) + bf16_to_float(hi[2 * lane + 1]);
      starts[p * 16 + lane] = -128.0f * sum;
    }
    for (int g = 0; g < 2; ++g) {
      const uint16_t* group = x + (2 * p + g) * kGroup;
      float sum = 0.0f;
      for (int j = 0; j < kGroup; ++j) sum += bf16_to_float(group[j]);
      sums[2 * p + g] = sum;
    }
  }
}

template <typename S>
KERNEL_TARGET inline __m512 load_pair(const S* values);

template <>
KERNEL_TARGET inline __m512 load_pair<float>(const float* values) {
  __m128 two = _mm_castsi128_ps(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(values)));
  return _mm512_broadcast_f32x2(two);
}

template <>
KERNEL_TARGET inline __m512 load_pair<uint16_t>(const uint16_t* values) {
  int32_t bits;
  memcpy(&bits, values, sizeof bits);
  return _mm512_broadcast_f32x2(_mm_cvtph_ps(_mm_cvtsi32_si128(bits)));
}

template <typename S>
KERNEL_TARGET inline __m512 load16(const S* values, __mmask16 mask);

template <>
KERNEL_TARGET inline __m512 load16<float>(const float* values, __mmask16 mask) {
  return _mm512_maskz_loadu_ps(mask, values);
}

template <>
KERNEL_TARGET inline __m512 load16<uint16_t>(const uint16_t* values, __mmask16 mask) {
  return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mask, values));
}

template <typename S>
KERNEL_TARGET inline float load1(const S* value);

template <>
KERNEL_TARGET inline float load1<float>(const float* value) {
  return *value;
}

template <>
KERNEL_TARGET inline float load1<uint16_t>(const uint16_t* value) {
  return _cvtsh_ss(*value);
}

// mins_term[o] = sum_g mins[g][o] * sums[g] for the output rows [begin, end) (mins transposed:
// [G][out]), 64 output rows at a time: four independent chains, each group's 128 bytes of mins in
// one pass (each lane sums its groups in the same order whatever the block or the range).
template <typename S>
KERNEL_TARGET void mins_terms(const S* mins, const float* sums, int num_groups, int out_features, int begin,
                              int end, float* mins_term) {
  int o = begin;
  for (; o + 64 <= end; o += 64) {
    __m512 acc[4];
    for (int i = 0; i < 4; ++i) acc[i] = _mm512_setzero_ps();
    const S* m = mins + o;
    for (int g = 0; g < num_groups; ++g, m += out_features) {
      const __m512 sum = _mm512_set1_ps(sums[g]);
      _mm_prefetch(reinterpret_cast<const char*>(m + 64), _MM_HINT_T0);  // the next strip
      _mm_prefetch(reinterpret_cast<const char*>(m + 64) + 64, _MM_HINT_T0);
      for (int i = 0; i < 4; ++i) acc[i] = _mm512_fmadd_ps(load16<S>(m + 16 * i, 0xFFFF), sum, acc[i]);
    }
    for (int i = 0; i < 4; ++i) _mm512_storeu_ps(mins_term + o + 16 * i, acc[i]);
  }
  for (; o < end; o += 16) {
    __mmask16 mask = first_lanes(end - o);
    __m512 acc = _mm512_setzero_ps();
    for (int g = 0; g < num_groups; ++g) {
      acc = _mm512_fmadd_ps(load16<S>(mins + static_cast<size_t>(g) * out_features + o, mask),
                            _mm512_set1_ps(sums[g]), acc);
    }
    _mm512_mask_storeu_ps(mins_term + o, mask, acc);
  }
}

// y[r][o] for R input rows and the output rows [o_begin, o_end), OB output rows at a time (their
// accumulators are independent chains; one chain would wait on each FMA's latency). `scales` are
// the float32 scales of the output rows from o_begin, [o - o_begin][G]; each output row's
// weight and scales are read through pointers set once per block of OB rows.
template <int R, int OB, bool kTable>
KERNEL_TARGET void rows_kernel(const PreparedRow* rows, int num_pairs, const uint8_t* weight,
                               const float* scales, __m512i table, int o_begin, int o_end,
                               uint16_t* const* out) {
  const size_t num_groups = 2 * static_cast<size_t>(num_pairs);
  const size_t row_bytes = static_cast<size_t>(num_pairs) * 32;
  const size_t ahead = static_cast<size_t>(kPrefetchBlocks) * OB * row_bytes;  // a 64-byte line every 2 pairs
  const __m512i nibble = _mm512_set1_epi16(0x000F);
  const __m512i offset = _mm512_set1_epi16(0x4300);  // bf16 128.0
  const uint16_t* words[R];
  const float* starts[R];
  for (int r = 0; r < R; ++r) {
    words[r] = rows[r].words;
    starts[r] = rows[r].starts;
  }
  int o = o_begin;
  for (; o + OB <= o_end; o += OB) {
    __m512 total[OB][R];
    for (int b = 0; b < OB; ++b)
      for (int r = 0; r < R; ++r) total[b][r] = _mm512_setzero_ps();
    const uint8_t* rows_w = weight + static_cast<size_t>(o) * row_bytes;
    const float* rows_s = scales + static_cast<size_t>(o - o_begin) * num_groups;
    for (int p = 0; p < num_pairs; ++p) {
      __m512 start[R];
      __m512i lo_x[R], hi_x[R];
      for (int r = 0; r < R; ++r) {
        start[r] = kTable ? _mm512_setzero_ps() : _mm512_loadu_ps(starts[r] + static_cast<size_t>(p) * 16);
        lo_x[r] = _mm512_loadu_si512(words[r] + static_cast<size_t>(p) * 64);
        hi_x[r] = _mm512_loadu_si512(words[r] + static_cast<size_t>(p) * 64 + 32);
      }
      const uint8_t* w = rows_w + static_cast<size_t>(p) * 32;
      const float* s = rows_s + static_cast<size_t>(p) * 2;
      for (int b = 0; b < OB; ++b, w += row_bytes, s += num_groups) {
        if ((p & 1) == 0) _mm_prefetch(reinterpret_cast<const char*>(w + ahead), _MM_HINT_T0);
        __m512i wide = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w)));
        __m512i lo, hi;
        if constexpr (kTable) {
          // table[q]: VPERMW reads an index's low 5 bits, and the table's 32 words are its 16
          // twice, so the high nibble's low bit (bit 4 of the low index) selects nothing
          lo = _mm512_permutexvar_epi16(wide, table);
          hi = _mm512_permutexvar_epi16(_mm512_srli_epi16(wide, 4), table);
        } else {
          // (wide & 0xF) | 0x4300 and (wide >> 4) | 0x4300: bf16 128 + q
          lo = _mm512_ternarylogic_epi32(wide, nibble, offset, 0xEA);
          hi = _mm512_or_si512(_mm512_srli_epi16(wide, 4), offset);
        }
        // the pair's two scales [s0, s1] as one 64-bit broadcast: [s0, s1, s0, s1, ...]
        double two;
        memcpy(&two, s, sizeof two);
        __m512 scale = _mm512_castpd_ps(_mm512_set1_pd(two));
        for (int r = 0; r < R; ++r) {
          __m512 acc = _mm512_dpbf16_ps(start[r], (__m512bh)lo, (__m512bh)lo_x[r]);
          acc = _mm512_dpbf16_ps(acc, (__m512bh)hi, (__m512bh)hi_x[r]);
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
        for (int i = 0; i < 4 && b + i < OB; ++i) {
          out[r][o + b + i] = float_to_bf16(lanes[i] + rows[r].mins_term[o + b + i]);
        }
      }
    }
  }
  if (o < o_end) {
    rows_kernel<R, 1, kTable>(rows, num_pairs, weight, scales + static_cast<size_t>(o - o_begin) * num_groups,
                              table, o, o_end, out);
  }
}

// The scales of `count` values as float32 (exact from float16).
KERNEL_TARGET inline void widen_scales(const float* values, size_t count, float* out) {
  memcpy(out, values, count * sizeof(float));
}

KERNEL_TARGET inline void widen_scales(const uint16_t* half, size_t count, float* out) {
  size_t i = 0;
  for (; i + 16 <= count; i += 16) {
    _mm512_storeu_ps(out + i, _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(half + i))));
  }
  for (; i < count; ++i) out[i] = _cvtsh_ss(half[i]);
}

// A table's 16 bf16 words twice over, as VPERMW reads them (zero where there is none).
KERNEL_TARGET inline __m512i table_words(const uint16_t* table) {
  if (table == nullptr) return _mm512_setzero_si512();
  const __m256i sixteen = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(table));
  return _mm512_inserti64x4(_mm512_castsi256_si512(sixteen), sixteen, 1);
}

// rows_kernel for a block of 1-4 input rows, as many output rows at a time as registers allow.
template <bool kTable>
KERNEL_TARGET inline void rows_block(int block, const PreparedRow* rows, int num_pairs, const uint8_t* weight,
                                     const float* s, __m512i table, int o, int o_end, uint16_t* const* outs) {
  switch (block) {
    case 4: rows_kernel<4, 3, kTable>(rows, num_pairs, weight, s, table, o, o_end, outs); break;
    case 3: rows_kernel<3, 4, kTable>(rows, num_pairs, weight, s, table, o, o_end, outs); break;
    case 2: rows_kernel<2, 6, kTable>(rows, num_pairs, weight, s, table, o, o_end, outs); break;
    default: rows_kernel<1, 8, kTable>(rows, num_pairs, weight, s, table, o, o_end, outs); break;
  }
}

// A call's output rows [begin, end) over its prepared input rows: the mins' terms of those
// rows, then block after block of kOutBlock output rows. The kernel team (team.cpp) splits a
// one-row call into parts of whole blocks (`run`); each output is computed as one thread
// computes it, so the bits do not depend on the parts.
template <typename S>
struct Outputs {
  const PreparedRow* prepared;
  float* sums;   // [rows][G]
  float* terms;  // [rows][out]
  int num_rows, num_pairs, out_features;
  const uint8_t* weight;
  const S* scales;
  const S* mins;           // null: none
  const uint16_t* table;   // null: w = s * q + m; else 16 bf16 values, w = s * table[q] + m
  uint16_t* out;

  KERNEL_TARGET void compute(int begin, int end) const {
    const int num_groups = num_pairs * 2;
    {  // the part's first rows of the weight, and block of scales
      const char* w = reinterpret_cast<const char*>(weight) + static_cast<size_t>(begin) * num_pairs * 32;
      const size_t rows = end - begin < kStartRows ? end - begin : kStartRows;
      for (size_t i = 0; i < rows * num_pairs * 32; i += 64) _mm_prefetch(w + i, _MM_HINT_T0);
      const char* sc = reinterpret_cast<const char*>(scales + static_cast<size_t>(begin) * num_groups);
      const size_t bytes = static_cast<size_t>(kOutBlock < end - begin ? kOutBlock : end - begin) * num_groups * sizeof(S);
      for (size_t i = 0; i < bytes; i += 64) _mm_prefetch(sc + i, _MM_HINT_T0);
    }
    for (int r = 0; r < num_rows; ++r) {
      float* row_terms = terms + static_cast<size_t>(r) * out_features;
      if (mins == nullptr) {
        std::fill(row_terms + begin, row_terms + end, 0.0f);
      } else {
        mins_terms<S>(mins, sums + static_cast<size_t>(r) * num_groups, num_groups, out_features, begin, end,
                      row_terms);
      }
    }
    const __m512i lookup = table_words(table);
    thread_local std::vector<float> block_scales;
    block_scales.resize(static_cast<size_t>(kOutBlock) * num_groups);
    // NOTE: a block of output rows stays in cache while every block of input rows passes it.
    for (int o = begin; o < end; o += kOutBlock) {
      int o_end = o + kOutBlock < end ? o + kOutBlock : end;
      {  // the next block's scales
        const char* next = reinterpret_cast<const char*>(scales + static_cast<size_t>(o_end) * num_groups);
        const char* last = reinterpret_cast<const char*>(scales + static_cast<size_t>(end) * num_groups);
        const size_t bytes = static_cast<size_t>(kOutBlock) * num_groups * sizeof(S);
        for (size_t i = 0; i < bytes && next + i < last; i += 64) _mm_prefetch(next + i, _MM_HINT_T0);
      }
      widen_scales(scales + static_cast<size_t>(o) * num_groups, static_cast<size_t>(o_end - o) * num_groups,
                   block_scales.data());
      const float* s = block_scales.data();
      for (int r = 0; r < num_rows; r += kRowBlock) {
        uint16_t* outs[kRowBlock];
        int block = num_rows - r < kRowBlock ? num_rows - r : kRowBlock;
        for (int i = 0; i < block; ++i) outs[i] = out + static_cast<size_t>(r + i) * out_features;
        const PreparedRow* rows = prepared + r;
        if (table == nullptr) {
          rows_block<false>(block, rows, num_pairs, weight, s, lookup, o, o_end, outs);
        } else {
          rows_block<true>(block, rows, num_pairs, weight, s, lookup, o, o_end, outs);
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

template <typename S>
KERNEL_TARGET void gemm(const uint16_t* x, int num_rows, int in_features, const uint8_t* weight,
                        const S* scales, const S* mins, const uint16_t* table, int out_features, uint16_t* out) {
  const int num_pairs = in_features / 64;
  const int num_groups = in_features / kGroup;
  thread_local std::vector<uint16_t> words;
  thread_local std::vector<float> starts, sums, terms;
  thread_local std::vector<PreparedRow> prepared;
  words.resize(static_cast<size_t>(num_rows) * num_pairs * 64);
  starts.resize(static_cast<size_t>(num_rows) * num_pairs * 16);
  sums.resize(static_cast<size_t>(num_rows) * num_groups);
  terms.resize(static_cast<size_t>(num_rows) * out_features);
  prepared.resize(num_rows);
  {  // the first rows of the weight while the rows are prepared
    const char* w = reinterpret_cast<const char*>(weight);
    const size_t row_bytes = static_cast<size_t>(num_pairs) * 32;
    const size_t bytes = static_cast<size_t>(kStartRows) * row_bytes;
    const size_t all = row_bytes * out_features;
    for (size_t i = 0; i < bytes && i < all; i += 64) _mm_prefetch(w + i, _MM_HINT_T0);
  }
  for (int r = 0; r < num_rows; ++r) {
    uint16_t* w = words.data() + static_cast<size_t>(r) * num_pairs * 64;
    float* st = starts.data() + static_cast<size_t>(r) * num_pairs * 16;
    float* su = sums.data() + static_cast<size_t>(r) * num_groups;
    float* te = terms.data() + static_cast<size_t>(r) * out_features;
    prepare_row(x + static_cast<size_t>(r) * in_features, num_pairs, w, st, su);
    prepared[r] = PreparedRow{w, st, su, te};
  }
  Outputs<S> call{prepared.data(), sums.data(), terms.data(), num_rows, num_pairs, out_features,
                  weight, scales, mins, table, out};
  team_run(&Outputs<S>::run, &call, num_rows);
}

// The weight as bf16 ``s * q + m`` (or ``s * table[q] + m``; no m where mins is null; rounded
// once, to nearest even), [out][in] in the columns' own order. A GEMM of many rows runs faster
// as one bf16 GEMM over this than through `gemm`.
template <typename S>
KERNEL_TARGET void dequantize(const uint8_t* weight, const S* scales, const S* mins, const uint16_t* table,
                              int out_features, int in_features, uint16_t* out) {
  const int num_pairs = in_features / 64;
  // Word k (0..15) of a widened half-part holds group g = (k >> 1) & 1, column 2 (k >> 2) +
  // (k & 1) of the part's eight: `spread` gives a lane its group's scale and min, `gather`
  // puts group 0's eight words first and group 1's after, each in column order.
  const __m512i spread = _mm512_set_epi32(1, 1, 0, 0, 1, 1, 0, 0, 1, 1, 0, 0, 1, 1, 0, 0);
  const __m512i gather = _mm512_set_epi32(15, 14, 11, 10, 7, 6, 3, 2, 13, 12, 9, 8, 5, 4, 1, 0);
  const __m512i nibble = _mm512_set1_epi16(0x000F);
  const __m512i lookup = table_words(table);
  for (int o = 0; o < out_features; ++o) {
    const uint8_t* w = weight + static_cast<size_t>(o) * num_pairs * 32;
    const S* s = scales + static_cast<size_t>(o) * 2 * num_pairs;
    uint16_t* row = out + static_cast<size_t>(o) * in_features;
    for (int p = 0; p < num_pairs; ++p) {
      __m512i wide = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + p * 32)));
      __m512i halves[2] = {_mm512_and_si512(wide, nibble), _mm512_srli_epi16(wide, 4)};
      __m512 scale = _mm512_permutexvar_ps(spread, load_pair<S>(s + 2 * p));
      __m512 min = _mm512_setzero_ps();
      if (mins != nullptr) {
        const S* m = mins + static_cast<size_t>(2 * p) * out_features + o;
        min = _mm512_permutexvar_ps(
            spread, _mm512_broadcast_f32x2(_mm_setr_ps(load1<S>(m), load1<S>(m + out_features), 0, 0)));
      }
      if (table != nullptr) {  // each code's bf16 value in place of the code
        for (int h = 0; h < 2; ++h) halves[h] = _mm512_permutexvar_epi16(halves[h], lookup);
      }
      for (int h = 0; h < 2; ++h) {
        for (int part = 0; part < 2; ++part) {
          __m256i words = part == 0 ? _mm512_castsi512_si256(halves[h])
                                    : _mm512_extracti64x4_epi64(halves[h], 1);
          __m512i wide_words = _mm512_cvtepu16_epi32(words);
          __m512 q = table != nullptr ? _mm512_castsi512_ps(_mm512_slli_epi32(wide_words, 16))
                                      : _mm512_cvtepi32_ps(wide_words);
          __m512 value = _mm512_permutexvar_ps(gather, _mm512_fmadd_ps(q, scale, min));
          __m256i bf16 = (__m256i)_mm512_cvtneps_pbh(value);
          uint16_t* column = row + p * 64 + h * 16 + part * 8;
          _mm_storeu_si128(reinterpret_cast<__m128i*>(column), _mm256_castsi256_si128(bf16));
          _mm_storeu_si128(reinterpret_cast<__m128i*>(column + 32), _mm256_extracti128_si256(bf16, 1));
        }
      }
    }
  }
}

}  // namespace

void int4_gemm_bf16(const uint16_t* x, int num_rows, int in_features, const uint8_t* weight, const void* scales,
                    const void* mins, int out_features, uint16_t* out, bool half_scales, const uint16_t* table) {
  if (half_scales) {
    gemm<uint16_t>(x, num_rows, in_features, weight, static_cast<const uint16_t*>(scales),
                   static_cast<const uint16_t*>(mins), table, out_features, out);
  } else {
    gemm<float>(x, num_rows, in_features, weight, static_cast<const float*>(scales), static_cast<const float*>(mins),
                table, out_features, out);
  }
}

PyObject* py_int4_gemm(PyObject*, PyObject* args) {
  unsigned long long x, weight, scales, mins, out, table = 0;
  int num_rows, in_features, out_features, half_scales;
  if (!PyArg_ParseTuple(args, "KiiKKKiKp|K", &x, &num_rows, &in_features, &weight, &scales, &mins,
                        &out_features, &out, &half_scales, &table)) {
    return nullptr;
  }
  if (!cpu_supported()) {
    PyErr_SetString(PyExc_RuntimeError, "this CPU lacks AVX512-BF16");
    return nullptr;
  }
  if (num_rows < 0 || in_features <= 0 || in_features % 64 != 0 || out_features <= 0) {
    PyErr_SetString(PyExc_ValueError, "in_features must be a positive multiple of 64");
    return nullptr;
  }
  Py_BEGIN_ALLOW_THREADS
  int4_gemm_bf16(reinterpret_cast<const uint16_t*>(x), num_rows, in_features, reinterpret_cast<const uint8_t*>(weight),
                 reinterpret_cast<const void*>(scales), reinterpret_cast<const void*>(mins), out_features,
                 reinterpret_cast<uint16_t*>(out), half_scales != 0, reinterpret_cast<const uint16_t*>(table));
  Py_END_ALLOW_THREADS
  Py_RETURN_NONE;
}

PyObject* py_int4_dequantize(PyObject*, PyObject* args) {
  unsigned long long weight, scales, mins, out, table = 0;
  int out_features, in_features, half_scales;
  if (!PyArg_ParseTuple(args, "KKKiiKp|K", &weight, &scales, &mins, &out_features, &in_features,
                        &out, &half_scales, &table)) {
    return nullptr;
  }
  if (!cpu_supported()) {
    PyErr_SetString(PyExc_RuntimeError, "this CPU lacks AVX512-BF16");
    return nullptr;
  }
  if (in_features <= 0 || in_features % 64 != 0 || out_features <= 0) {
    PyErr_SetString(PyExc_ValueError, "in_features must be a positive multiple of 64");
    return nullptr;
  }
  Py_BEGIN_ALLOW_THREADS
  if (half_scales) {
    dequantize<uint16_t>(reinterpret_cast<const uint8_t*>(weight), reinterpret_cast<const uint16_t*>(scales),
                         reinterpret_cast<const uint16_t*>(mins), reinterpret_cast<const uint16_t*>(table),
                         out_features, in_features,
                         reinterpret_cast<uint16_t*>(out));
  } else {
    dequantize<float>(reinterpret_cast<const uint8_t*>(weight), reinterpret_cast<const float*>(scales),
                      reinterpret_cast<const float*>(mins), reinterpret_cast<const uint16_t*>(table),
                      out_features, in_features,
                      reinterpret_cast<uint16_t*>(out));
  }
  Py_END_ALLOW_THREADS
  Py_RETURN_NONE;
}

}  // namespace pdserve
