// pdserve.engine._cpu_kernels, float32: the int4 and int8 GEMMs for float32 activations on a
// CPU with AVX2, FMA and F16C (and no AVX512-BF16, where `pdserve up` runs float32: bf16 would
// be emulated). The weights are the same tensors the bf16 kernels read (int4_gemm.cpp's packed
// pairs of groups, int8_gemm.cpp's groups of 16 or 32), so a GGUF's Q4_0, Q4_1, Q4_K, Q8_0,
// Q6_K and Q5_K tensors are served as the file stores them here too, instead of as a float32
// copy four to eight times their size.
//
// Per output row o of one input row x:
//
//     y[o] = sum_g s[o, g] * dot(q[o, g], x[g]) + sum_g m[o, g] * sum(x[g])
//
// Each 4- or 8-bit value is widened to a float32 integer (exact) and multiplied with FMA, eight
// lanes a vector; a group's eight lanes are scaled by its scale into the row's running sum,
// whose lanes are added in one fixed order at the end; the mins' share is added last. Every
// input row is computed alone, in the same order whatever the other rows of the call, so a
// row's result does not depend on them (batch-invariant by construction). A one-hot row gives
// ``s * q + m``, the product and the sum each rounded once in float32: the `gguf` package's
// dequantized value.
//
// int4 layout (int4_gemm.cpp): a row is P = in / 64 pairs of groups, 32 bytes each; byte
// k = 4t + 2g + e holds, for group 2p + g, column j = 2t + e in its low nibble and 16 + j in its
// high one. Read as eight 32-bit lanes (lane L = t), nibble n = 4g + 2e + h of every lane belongs
// to group g: the input row is laid out once per call so that nibble n's eight lanes meet their
// columns, g * 32 + h * 16 + 2L + e.
//
// With a table (int4_gemm.cpp's: 16 bf16 values, MXFP4's e2m1 ones for gpt-oss's experts) a
// 4-bit value is a code, widened to table[q] in float32 (two VPERMPS over the table's halves and
// a blend on the code's bit 3), and a null mins pointer adds no mins' share.
#include <algorithm>

#include "common.h"

namespace pdserve {

bool f32_supported() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
         __builtin_cpu_supports("f16c");
}

bool f32_supported_or_error() {
  if (f32_supported()) return true;
  PyErr_SetString(PyExc_RuntimeError, "this CPU lacks AVX2, FMA or F16C");
  return false;
}

namespace {

constexpr int kOutStep = 4;  // output rows a step of the inner loop (their weight stays in L1)
constexpr int kPrefetchBytes = 2048;
constexpr int kPartRows = 8;  // a kernel-team part's output rows are a multiple of this

template <typename S>
F32_TARGET inline float scalar(const S* value);

template <>
F32_TARGET inline float scalar<float>(const float* value) {
  return *value;
}

template <>
F32_TARGET inline float scalar<uint16_t>(const uint16_t* value) {
  return _cvtsh_ss(*value);
}

template <typename S>
F32_TARGET inline __m256 load8(const S* values);

template <>
F32_TARGET inline __m256 load8<float>(const float* values) {
  return _mm256_loadu_ps(values);
}

template <>
F32_TARGET inline __m256 load8<uint16_t>(const uint16_t* values) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(values)));
}

// ---------------------------------------------------------------------------------------------
// int4

// x (one row, float32 [in]) as the kernel reads it: [P][8 nibbles][8 lanes], and each group's
// sum of x (j ascending).
void prepare_int4_row(const float* x, int num_pairs, float* laid, float* sums) {
  for (int p = 0; p < num_pairs; ++p) {
    const float* pair = x + p * 64;
    float* out = laid + p * 64;
    for (int n = 0; n < 8; ++n) {
      const int g = n >> 2, e = (n >> 1) & 1, h = n & 1;
      for (int lane = 0; lane < 8; ++lane) out[n * 8 + lane] = pair[g * 32 + h * 16 + 2 * lane + e];
    }
    for (int g = 0; g < 2; ++g) {
      float sum = 0.0f;
      for (int j = 0; j < 32; ++j) sum += pair[g * 32 + j];
      sums[2 * p + g] = sum;
    }
  }
}

// mins_term[o] = sum_g mins[g][o] * sums[g] (mins transposed: [G][out]), g ascending, for the
// outputs [begin, end).
template <typename S>
F32_TARGET void int4_mins_terms(const S* mins, const float* sums, int num_groups, int out_features, int begin,
                                int end, float* terms) {
  int o = begin;
  for (; o + 8 <= end; o += 8) {
    __m256 acc = _mm256_setzero_ps();
    const S* m = mins + o;
    for (int g = 0; g < num_groups; ++g, m += out_features) {
      acc = _mm256_fmadd_ps(load8<S>(m), _mm256_set1_ps(sums[g]), acc);
    }
    _mm256_storeu_ps(terms + o, acc);
  }
  for (; o < end; ++o) {
    float acc = 0.0f;
    for (int g = 0; g < num_groups; ++g) {
      acc = __builtin_fmaf(scalar<S>(mins + static_cast<size_t>(g) * out_features + o), sums[g], acc);
    }
    terms[o] = acc;
  }
}

// A table of 16 bf16 values as two vectors of float32 (entries 0-7, 8-15); zeros for none.
struct Table {
  __m256 low, high;
};

// Eight bf16 values as float32 (exact).
F32_TARGET inline __m256 bf16x8(const uint16_t* values) {
  const __m128i words = _mm_loadu_si128(reinterpret_cast<const __m128i*>(values));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(words), 16));
}

F32_TARGET inline Table table_of(const uint16_t* table) {
  if (table == nullptr) return Table{_mm256_setzero_ps(), _mm256_setzero_ps()};
  return Table{bf16x8(table), bf16x8(table + 8)};
}

// Eight codes (0..15 in 32-bit lanes) as their table values.
F32_TARGET inline __m256 looked_up(__m256i q, const Table& table) {
  const __m256 low = _mm256_permutevar8x32_ps(table.low, q);  // NOTE: a lane's low 3 bits
  const __m256 high = _mm256_permutevar8x32_ps(table.high, q);
  return _mm256_blendv_ps(low, high, _mm256_castsi256_ps(_mm256_slli_epi32(q, 28)));
}

// Eight 4-bit values (0..15 in 32-bit lanes) as float32: themselves, or their table values.
template <bool kTable>
F32_TARGET inline __m256 int4_value(__m256i q, const Table& table) {
  if constexpr (kTable) return looked_up(q, table);
  return _mm256_cvtepi32_ps(q);
}

// A pair's 64 values as float32, in eight vectors: nibble n of every 32-bit lane.
template <bool kTable>
F32_TARGET inline void int4_values(__m256i v, const Table& table, __m256* q) {
  const __m256i nibble = _mm256_set1_epi32(0xF);
  for (int n = 0; n < 7; ++n) {
    q[n] = int4_value<kTable>(_mm256_and_si256(_mm256_srli_epi32(v, 4 * n), nibble), table);
  }
  q[7] = int4_value<kTable>(_mm256_srli_epi32(v, 28), table);
}

// COUNT output rows from `o` for ROWS input rows: each pair of groups widened once, then
// multiplied with every input row's laid-out x, in one order for every row (nibbles 0-3 into
// group 0's lanes, 4-7 into group 1's, then each group's lanes times its scale into the row's
// running sum). `scales` are the block's own, [COUNT][G].
template <int COUNT, int ROWS, bool kTable>
F32_TARGET inline void int4_outputs(const float* const* laid, const float* const* terms,
                                    int num_pairs, const uint8_t* weight, const float* scales,
                                    const Table& table, int o, float* const* out) {
  const size_t row_bytes = static_cast<size_t>(num_pairs) * 32;
  const size_t num_groups = static_cast<size_t>(num_pairs) * 2;
  __m256 total[COUNT][ROWS];
  for (int i = 0; i < COUNT; ++i)
    for (int r = 0; r < ROWS; ++r) total[i][r] = _mm256_setzero_ps();
  for (int p = 0; p < num_pairs; ++p) {
    for (int i = 0; i < COUNT; ++i) {
      const uint8_t* w = weight + (o + i) * row_bytes + p * 32;
      const float* s = scales + i * num_groups + 2 * p;
      __m256 q[8];
      int4_values<kTable>(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w)), table, q);
      for (int r = 0; r < ROWS; ++r) {
        const float* xs = laid[r] + p * 64;
        __m256 a = _mm256_mul_ps(q[0], _mm256_loadu_ps(xs));
        __m256 b = _mm256_mul_ps(q[4], _mm256_loadu_ps(xs + 32));
        a = _mm256_fmadd_ps(q[1], _mm256_loadu_ps(xs + 8), a);
        b = _mm256_fmadd_ps(q[5], _mm256_loadu_ps(xs + 40), b);
        a = _mm256_fmadd_ps(q[2], _mm256_loadu_ps(xs + 16), a);
        b = _mm256_fmadd_ps(q[6], _mm256_loadu_ps(xs + 48), b);
        a = _mm256_fmadd_ps(q[3], _mm256_loadu_ps(xs + 24), a);
        b = _mm256_fmadd_ps(q[7], _mm256_loadu_ps(xs + 56), b);
        total[i][r] = _mm256_fmadd_ps(a, _mm256_broadcast_ss(s), total[i][r]);
        total[i][r] = _mm256_fmadd_ps(b, _mm256_broadcast_ss(s + 1), total[i][r]);
      }
    }
  }
  for (int i = 0; i < COUNT; ++i)
    for (int r = 0; r < ROWS; ++r) out[r][o + i] = sum8(total[i][r]) + terms[r][o + i];
}

// Walks the output rows kOutStep at a time (the weight prefetched a few steps ahead: the
// hardware's prefetcher alone reads at about half speed), and within a step the input rows four
// at a time (one output row a call), what is left with the outputs two or four at a time
// (chains enough to hide the FMAs' latency): `step.start(o, count)` per step, then
// `step.run<COUNT, ROWS>(r, o, i)` for output rows [o, o + COUNT) (the i-th of the step on) and
// input rows [r, r + ROWS). Over the output rows [begin, end) of the call's `out_features`, begin
// a whole number of steps in (a row's result is then the same whatever the range).
template <typename Step>
F32_TARGET void over_blocks(Step& step, int num_rows, int begin, int out_features, const void* weight,
                            size_t row_bytes) {
  const char* base = static_cast<const char*>(weight);
  const char* end = base + row_bytes * out_features;
  for (int o = begin; o < out_features; o += kOutStep) {
    const char* ahead = base + (o + kOutStep) * row_bytes + kPrefetchBytes;
    for (size_t i = 0; i < kOutStep * row_bytes && ahead + i < end; i += 64) _mm_prefetch(ahead + i, _MM_HINT_T0);
    const int count = out_features - o < kOutStep ? out_features - o : kOutStep;
    step.start(o, count);
    for (int r = 0; r < num_rows; r += 4) {
      const int rows = num_rows - r < 4 ? num_rows - r : 4;
      if (rows >= 3) {
        for (int i = 0; i < count; ++i) {
          if (rows == 4) step.template run<1, 4>(r, o + i, i);
          else step.template run<1, 3>(r, o + i, i);
        }
      } else if (rows == 2) {
        int i = 0;
        for (; i + 2 <= count; i += 2) step.template run<2, 2>(r, o + i, i);
        if (i < count) step.template run<1, 2>(r, o + i, i);
      } else {
        switch (count) {
          case 4: step.template run<4, 1>(r, o, 0); break;
          case 3: step.template run<3, 1>(r, o, 0); break;
          case 2: step.template run<2, 1>(r, o, 0); break;
          default: step.template run<1, 1>(r, o, 0); break;
        }
      }
    }
  }
}

// A call's output rows shared by the kernel team (team.cpp): part i of n takes the rows of
// units [i * units / n, (i + 1) * units / n) of kPartRows rows (whole steps of over_blocks and
// of int4_mins_terms' vectors), prepares them (`step.prepare(begin, end)`) and walks them, with
// its own scratch for `Step::buffer`.
template <typename Step>
struct Parts {
  Step step;
  int num_rows, out_features;
  const void* weight;
  size_t row_bytes, buffer_floats;

  F32_TARGET static void run(void* self, int part, int parts) {
    const auto& p = *static_cast<const Parts*>(self);
    int begin, end;
    part_rows(p.out_features, kPartRows, part, parts, &begin, &end);
    if (begin >= end) return;
    thread_local std::vector<float> buffer;
    buffer.resize(p.buffer_floats);
    Step step = p.step;
    step.buffer = buffer.data();
    step.prepare(begin, end);
    over_blocks(step, p.num_rows, begin, end, p.weight, p.row_bytes);
  }

  void operator()() { team_run(&Parts::run, this, num_rows); }
};

// `count` scales as float32 (float16 ones widened, exactly).
template <typename S>
F32_TARGET const float* widened(const S* scales, size_t count, float* buffer);

template <>
F32_TARGET const float* widened<float>(const float* scales, size_t, float*) {
  return scales;
}

template <>
F32_TARGET const float* widened<uint16_t>(const uint16_t* scales, size_t count, float* buffer) {
  size_t i = 0;
  for (; i + 8 <= count; i += 8) _mm256_storeu_ps(buffer + i, load8<uint16_t>(scales + i));
  for (; i < count; ++i) buffer[i] = _cvtsh_ss(scales[i]);
  return buffer;
}

// int4_outputs over a call's laid-out rows: the mins' terms of a part's outputs first
// (`prepare`), a block's scales widened once (`start`).
template <typename S>
struct Int4Step {
  const float* laid;
  const float* sums;
  float* terms;
  float* out;
  const uint8_t* weight;
  const S* scales;
  const S* mins;          // null: none
  const uint16_t* table;  // null: the values themselves
  float* buffer;
  int num_rows, in_features, out_features, num_pairs;
  const float* block_scales;
  Table values;

  F32_TARGET void prepare(int begin, int end) {
    const int num_groups = num_pairs * 2;
    values = table_of(table);
    for (int r = 0; r < num_rows; ++r) {
      float* row_terms = terms + static_cast<size_t>(r) * out_features;
      if (mins == nullptr) {
        std::fill(row_terms + begin, row_terms + end, 0.0f);
      } else {
        int4_mins_terms<S>(mins, sums + static_cast<size_t>(r) * num_groups, num_groups, out_features, begin, end,
                           row_terms);
      }
    }
  }

  F32_TARGET void start(int o, int count) {
    const size_t num_groups = static_cast<size_t>(num_pairs) * 2;
    block_scales = widened<S>(scales + o * num_groups, count * num_groups, buffer);
  }

  template <int COUNT, int ROWS>
  F32_TARGET void run(int r, int o, int i) {
    const float* l[ROWS];
    const float* t[ROWS];
    float* y[ROWS];
    for (int k = 0; k < ROWS; ++k) {
      l[k] = laid + static_cast<size_t>(r + k) * in_features;
      t[k] = terms + static_cast<size_t>(r + k) * out_features;
      y[k] = out + static_cast<size_t>(r + k) * out_features;
    }
    const float* s = block_scales + i * 2 * num_pairs;
    if (table == nullptr) int4_outputs<COUNT, ROWS, false>(l, t, num_pairs, weight, s, values, o, y);
    else int4_outputs<COUNT, ROWS, true>(l, t, num_pairs, weight, s, values, o, y);
  }
};

template <typename S>
F32_TARGET void int4_gemm(const float* x, int num_rows, int in_features, const uint8_t* weight,
                          const S* scales, const S* mins, const uint16_t* table, int out_features, float* out) {
  const int num_pairs = in_features / 64;
  const int num_groups = in_features / 32;
  thread_local std::vector<float> laid, sums, terms;
  laid.resize(static_cast<size_t>(num_rows) * in_features);
  sums.resize(static_cast<size_t>(num_rows) * num_groups);
  terms.resize(static_cast<size_t>(num_rows) * out_features);
  for (int r = 0; r < num_rows; ++r) {
    float* su = sums.data() + static_cast<size_t>(r) * num_groups;
    prepare_int4_row(x + static_cast<size_t>(r) * in_features, num_pairs,
                     laid.data() + static_cast<size_t>(r) * in_features, su);
  }
  Int4Step<S> step{laid.data(), sums.data(), terms.data(), out,         weight,       scales,    mins,
                   table,       nullptr,     num_rows,     in_features, out_features, num_pairs, nullptr};
  Parts<Int4Step<S>>{step, num_rows, out_features, weight, static_cast<size_t>(num_pairs) * 32,
                     static_cast<size_t>(kOutStep) * num_groups}();
}

// The weight as float32 ``s * q + m`` (``s * table[q] + m`` with a table, no m without mins; the
// product and the sum each rounded once), [out][in] in the columns' own order: a GEMM of many
// rows runs as one float32 GEMM over it.
template <typename S>
F32_TARGET void int4_dequantize(const uint8_t* weight, const S* scales, const S* mins, const uint16_t* table,
                                int out_features, int in_features, float* out) {
  const int num_pairs = in_features / 64;
  const __m256i nibble = _mm256_set1_epi32(0xF);
  const Table values_of = table_of(table);
  for (int o = 0; o < out_features; ++o) {
    const uint8_t* w = weight + static_cast<size_t>(o) * num_pairs * 32;
    const S* s = scales + static_cast<size_t>(o) * 2 * num_pairs;
    float* row = out + static_cast<size_t>(o) * in_features;
    for (int p = 0; p < num_pairs; ++p) {
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + p * 32));
      for (int g = 0; g < 2; ++g) {
        const __m256 scale = _mm256_set1_ps(scalar<S>(s + 2 * p + g));
        const __m256 min = mins == nullptr
                               ? _mm256_setzero_ps()
                               : _mm256_set1_ps(scalar<S>(mins + static_cast<size_t>(2 * p + g) * out_features + o));
        for (int h = 0; h < 2; ++h) {
          __m256 values[2];
          for (int e = 0; e < 2; ++e) {
            const int n = 4 * g + 2 * e + h;
            __m256i q = _mm256_and_si256(_mm256_srlv_epi32(v, _mm256_set1_epi32(4 * n)), nibble);
            const __m256 value = table == nullptr ? _mm256_cvtepi32_ps(q) : looked_up(q, values_of);
            values[e] = _mm256_add_ps(_mm256_mul_ps(value, scale), min);
          }
          // lanes L of e = 0 are columns 2L, of e = 1 columns 2L + 1: interleave them
          const __m256 lo = _mm256_unpacklo_ps(values[0], values[1]);
          const __m256 hi = _mm256_unpackhi_ps(values[0], values[1]);
          float* column = row + p * 64 + g * 32 + h * 16;
          _mm256_storeu_ps(column, _mm256_permute2f128_ps(lo, hi, 0x20));
          _mm256_storeu_ps(column + 8, _mm256_permute2f128_ps(lo, hi, 0x31));
        }
      }
    }
  }
}

// ---------------------------------------------------------------------------------------------
// int8

// Eight int8 values as float32.
F32_TARGET inline __m256 widen(const int8_t* v) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(v))));
}

// COUNT output rows from `o` for ROWS input rows: each group's values widened once, then
// multiplied with every input row, in one order for every row.
template <int COUNT, int ROWS, int GROUP, typename S, bool MINS>
F32_TARGET inline void int8_outputs(const float* const* x, const float* const* sums, int in_features,
                                    const int8_t* weight, const S* scales, const float* mins, int o,
                                    float* const* out) {
  const int num_groups = in_features / GROUP;
  __m256 total[COUNT][ROWS];
  float min_terms[COUNT][ROWS];
  for (int i = 0; i < COUNT; ++i) {
    for (int r = 0; r < ROWS; ++r) {
      total[i][r] = _mm256_setzero_ps();
      min_terms[i][r] = 0.0f;
    }
  }
  for (int g = 0; g < num_groups; ++g) {
    for (int i = 0; i < COUNT; ++i) {
      const size_t row = static_cast<size_t>(o + i);
      const int8_t* w = weight + row * in_features + g * GROUP;
      __m256 values[GROUP / 8];
      for (int k = 0; k < GROUP / 8; ++k) values[k] = widen(w + 8 * k);
      const __m256 scale = _mm256_set1_ps(scalar<S>(scales + row * num_groups + g));
      for (int r = 0; r < ROWS; ++r) {
        const float* xs = x[r] + g * GROUP;
        __m256 dot = _mm256_mul_ps(values[0], _mm256_loadu_ps(xs));
        for (int k = 1; k < GROUP / 8; ++k) dot = _mm256_fmadd_ps(values[k], _mm256_loadu_ps(xs + 8 * k), dot);
        total[i][r] = _mm256_fmadd_ps(dot, scale, total[i][r]);
        if (MINS) min_terms[i][r] = __builtin_fmaf(mins[row * num_groups + g], sums[r][g], min_terms[i][r]);
      }
    }
  }
  for (int i = 0; i < COUNT; ++i)
    for (int r = 0; r < ROWS; ++r) out[r][o + i] = sum8(total[i][r]) + min_terms[i][r];
}

// int8_outputs over a call's rows.
template <int GROUP, typename S, bool MINS>
struct Int8Step {
  const float* x;
  const float* sums;
  float* out;
  const int8_t* weight;
  const S* scales;
  const float* mins;
  int in_features, out_features;
  float* buffer;  // unused (Parts gives each part one)

  F32_TARGET void prepare(int, int) {}
  F32_TARGET void start(int, int) {}

  template <int COUNT, int ROWS>
  F32_TARGET void run(int r, int o, int) {
    const int num_groups = in_features / GROUP;
    const float* xs[ROWS];
    const float* su[ROWS];
    float* y[ROWS];
    for (int k = 0; k < ROWS; ++k) {
      xs[k] = x + static_cast<size_t>(r + k) * in_features;
      su[k] = sums + static_cast<size_t>(r + k) * num_groups;
      y[k] = out + static_cast<size_t>(r + k) * out_features;
    }
    int8_outputs<COUNT, ROWS, GROUP, S, MINS>(xs, su, in_features, weight, scales, mins, o, y);
  }
};

template <int GROUP, typename S, bool MINS>
F32_TARGET void int8_gemm(const float* x, int num_rows, int in_features, const int8_t* weight,
                          const S* scales, const float* mins, int out_features, float* out) {
  const int num_groups = in_features / GROUP;
  thread_local std::vector<float> sums;
  sums.resize(static_cast<size_t>(num_rows) * num_groups);
  for (int r = 0; r < num_rows; ++r) {
    for (int g = 0; g < num_groups; ++g) {
      const float* group = x + static_cast<size_t>(r) * in_features + g * GROUP;
      float sum = 0.0f;
      for (int j = 0; j < GROUP; ++j) sum += group[j];
      sums[static_cast<size_t>(r) * num_groups + g] = sum;
    }
  }
  Int8Step<GROUP, S, MINS> step{x, sums.data(), out, weight, scales, mins, in_features, out_features, nullptr};
  Parts<Int8Step<GROUP, S, MINS>>{step, num_rows, out_features, weight, static_cast<size_t>(in_features), 0}();
}

template <int GROUP, typename S>
void int8_dispatch_mins(const float* x, int rows, int in, const int8_t* w, const void* scales,
                        const float* mins, int out_features, float* out) {
  const S* s = static_cast<const S*>(scales);
  if (mins != nullptr) int8_gemm<GROUP, S, true>(x, rows, in, w, s, mins, out_features, out);
  else int8_gemm<GROUP, S, false>(x, rows, in, w, s, mins, out_features, out);
}


}  // namespace

void int4_gemm_f32(const float* x, int num_rows, int in_features, const uint8_t* weight, const void* scales,
                   const void* mins, int out_features, float* out, bool half_scales, const uint16_t* table) {
  if (half_scales) {
    int4_gemm<uint16_t>(x, num_rows, in_features, weight, static_cast<const uint16_t*>(scales),
                        static_cast<const uint16_t*>(mins), table, out_features, out);
  } else {
    int4_gemm<float>(x, num_rows, in_features, weight, static_cast<const float*>(scales),
                     static_cast<const float*>(mins), table, out_features, out);
  }
}

PyObject* py_int4_gemm_f32(PyObject*, PyObject* args) {
  unsigned long long x, weight, scales, mins, out, table = 0;
  int num_rows, in_features, out_features, half_scales;
  if (!PyArg_ParseTuple(args, "KiiKKKiKp|K", &x, &num_rows, &in_features, &weight, &scales, &mins,
                        &out_features, &out, &half_scales, &table)) {
    return nullptr;
  }
  if (!f32_supported_or_error()) return nullptr;
  if (num_rows < 0 || in_features <= 0 || in_features % 64 != 0 || out_features <= 0) {
    PyErr_SetString(PyExc_ValueError, "in_features must be a positive multiple of 64");
    return nullptr;
  }
  Py_BEGIN_ALLOW_THREADS
  int4_gemm_f32(reinterpret_cast<const float*>(x), num_rows, in_features, reinterpret_cast<const uint8_t*>(weight),
                reinterpret_cast<const void*>(scales), reinterpret_cast<const void*>(mins), out_features,
                reinterpret_cast<float*>(out), half_scales != 0, reinterpret_cast<const uint16_t*>(table));
  Py_END_ALLOW_THREADS
  Py_RETURN_NONE;
}

PyObject* py_int4_dequantize_f32(PyObject*, PyObject* args) {
  unsigned long long weight, scales, mins, out, table = 0;
  int out_features, in_features, half_scales;
  if (!PyArg_ParseTuple(args, "KKKiiKp|K", &weight, &scales, &mins, &out_features, &in_features,
                        &out, &half_scales, &table)) {
    return nullptr;
  }
  if (!f32_supported_or_error()) return nullptr;
  if (in_features <= 0 || in_features % 64 != 0 || out_features <= 0) {
    PyErr_SetString(PyExc_ValueError, "in_features must be a positive multiple of 64");
    return nullptr;
  }
  const auto* w = reinterpret_cast<const uint8_t*>(weight);
  const auto* codes = reinterpret_cast<const uint16_t*>(table);
  auto* y = reinterpret_cast<float*>(out);
  Py_BEGIN_ALLOW_THREADS
  if (half_scales) {
    int4_dequantize<uint16_t>(w, reinterpret_cast<const uint16_t*>(scales),
                              reinterpret_cast<const uint16_t*>(mins), codes, out_features, in_features, y);
  } else {
    int4_dequantize<float>(w, reinterpret_cast<const float*>(scales),
                           reinterpret_cast<const float*>(mins), codes, out_features, in_features, y);
  }
  Py_END_ALLOW_THREADS
  Py_RETURN_NONE;
}

void int8_gemm_f32(const float* x, int num_rows, int in_features, const int8_t* weight, const void* scales,
                   bool scales_f32, int group, const float* mins, int out_features, float* out) {
  if (group == 16) {
    if (scales_f32) int8_dispatch_mins<16, float>(x, num_rows, in_features, weight, scales, mins, out_features, out);
    else int8_dispatch_mins<16, uint16_t>(x, num_rows, in_features, weight, scales, mins, out_features, out);
  } else {
    if (scales_f32) int8_dispatch_mins<32, float>(x, num_rows, in_features, weight, scales, mins, out_features, out);
    else int8_dispatch_mins<32, uint16_t>(x, num_rows, in_features, weight, scales, mins, out_features, out);
  }
}

PyObject* py_int8_gemm_f32(PyObject*, PyObject* args) {
  unsigned long long x, weight, scales, mins, out;
  int num_rows, in_features, group, scales_f32, out_features;
  if (!PyArg_ParseTuple(args, "KiiKKiiKiK", &x, &num_rows, &in_features, &weight, &scales, &scales_f32,
                        &group, &mins, &out_features, &out)) {
    return nullptr;
  }
  if (!f32_supported_or_error()) return nullptr;
  if ((group != 16 && group != 32) || in_features <= 0 || in_features % 32 != 0 || num_rows < 0 ||
      out_features <= 0) {
    PyErr_SetString(PyExc_ValueError,
                    "group must be 16 or 32, in_features a positive multiple of 32, rows >= 0");
    return nullptr;
  }
  Py_BEGIN_ALLOW_THREADS
  int8_gemm_f32(reinterpret_cast<const float*>(x), num_rows, in_features, reinterpret_cast<const int8_t*>(weight),
                reinterpret_cast<const void*>(scales), scales_f32 != 0, group, reinterpret_cast<const float*>(mins),
                out_features, reinterpret_cast<float*>(out));
  Py_END_ALLOW_THREADS
  Py_RETURN_NONE;
}

PyObject* py_f32_supported(PyObject*, PyObject*) { return PyBool_FromLong(f32_supported()); }

}  // namespace pdserve
