// pdserve.engine._cpu_kernels, decode attention over the paged KV cache.
//
// One query token per sequence (a decode step) attends its sequence's keys through its block
// table, straight from the cache (no gather into a padded copy): per KV head, the scores of its
// group of query heads against every key (VDPBF16PS over bf16 q and k, float32 sums, four keys'
// sums at a time), a softmax in float32 (with a sink logit per head where the model has them),
// then the values weighted in float32, rounded once to bf16. A float32 K/V cache (AVX2, where
// `--dtype auto` is float32) takes the same steps in eight-lane FMAs.
#include "common.h"

namespace pdserve {
namespace {

// Where each key of `first`..`last` starts in the cache (one head's `offset` into its row of
// `row` elements), found once per head: a division by the block size per key, not per key and
// chunk of the keys and the values. The vector is the calling thread's, valid until its next
// call.
const std::vector<size_t>& key_rows(const int32_t* table, int first, int last, int block_size, size_t row,
                                    int offset) {
  thread_local std::vector<size_t> at;
  at.resize(last - first);
  int block = first / block_size, slot = first % block_size;  // NOTE: no division per key
  for (int t = first; t < last; ++t) {
    at[t - first] = (static_cast<size_t>(table[block]) * block_size + slot) * row + offset;
    if (++slot == block_size) {
      slot = 0;
      ++block;
    }
  }
  return at;
}

// NOTE: a head's keys and values are rows of `bytes` scattered over the cache's blocks (one
// head's slice of each row of every head), which the hardware prefetcher does not follow: the
// scores' pass prefetches the key and the value of the key kAhead keys on (the values then
// wait in cache for the weighted sum), and the first kAhead before it. Default model, 300 keys,
// a layer's cache from memory: 34.6 -> 14.4 us (8 ahead 19.7, 16 16.8, 64 14.6).
constexpr int kAhead = 32;

template <typename T>
inline void prefetch_key(const T* k_cache, const T* v_cache, size_t at, int bytes) {
  const char* key = reinterpret_cast<const char*>(k_cache + at);
  const char* value = reinterpret_cast<const char*>(v_cache + at);
  for (int line = 0; line < bytes; line += 64) {
    _mm_prefetch(key + line, _MM_HINT_T0);
    _mm_prefetch(value + line, _MM_HINT_T0);
  }
}

template <typename T>
inline void prefetch_first_keys(const T* k_cache, const T* v_cache, const size_t* at, int num_keys,
                                int bytes) {
  for (int t = 0; t < kAhead && t < num_keys; ++t) prefetch_key(k_cache, v_cache, at[t], bytes);
}

// A softmax's first half over float32 scores (both kernels'; eight lanes a step, the
// exponentials as exp8): each of G rows (num_keys each) as exp(score - high), in place, and
// each row's sum with its sink's share where the model has sinks.
template <int G>
F32_TARGET void softmax_f32(float* scores, int num_keys, const float* high, const float* sinks, float* total) {
  for (int g = 0; g < G; ++g) {
    float* s = scores + g * num_keys;
    const __m256 top = _mm256_set1_ps(high[g]);
    __m256 lanes = _mm256_setzero_ps();
    int i = 0;
    for (; i + 8 <= num_keys; i += 8) {
      const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(s + i), top));
      _mm256_storeu_ps(s + i, e);
      lanes = _mm256_add_ps(lanes, e);
    }
    float sum = sum8(lanes);
    for (; i < num_keys; ++i) {
      s[i] = expf(s[i] - high[g]);
      sum += s[i];
    }
    total[g] = sinks ? sum + expf(sinks[g] - high[g]) : sum;
  }
}

// The scores of keys t .. t + N - 1 (N 1 to 4) for a KV head's G query heads (`qv`: each
// query's `chunks` 32-value parts), scaled, into scores[g * num_keys + t + j], and each query's
// highest score so far. Their 16-lane dot products are summed four keys together (`sum4`: one
// order for every key, a missing key's lanes zeros), not one horizontal sum per key.
template <int G, int N>
KERNEL_TARGET inline void score_keys(const __m512i (*qv)[8], int chunks, const uint16_t* k_cache,
                                     const uint16_t* v_cache, const size_t* at, int t, int num_keys, int bytes,
                                     float scale, float* scores, float* high) {
  const __m512 zero = _mm512_setzero_ps();
  __m512 dot[4][G];
  for (int j = 0; j < 4; ++j)
    for (int g = 0; g < G; ++g) dot[j][g] = zero;
  for (int j = 0; j < N; ++j) {
    if (t + j + kAhead < num_keys) prefetch_key(k_cache, v_cache, at[t + j + kAhead], bytes);
    const uint16_t* key = k_cache + at[t + j];
    for (int c = 0; c < chunks; ++c) {
      const __m512i kv = _mm512_loadu_si512(key + c * 32);
      for (int g = 0; g < G; ++g) dot[j][g] = _mm512_dpbf16_ps(dot[j][g], (__m512bh)qv[g][c], (__m512bh)kv);
    }
  }
  for (int g = 0; g < G; ++g) {
    alignas(16) float four[4];
    _mm_store_ps(four, _mm_mul_ps(sum4(dot[0][g], dot[1][g], dot[2][g], dot[3][g]), _mm_set1_ps(scale)));
    for (int j = 0; j < N; ++j) {
      scores[g * num_keys + t + j] = four[j];
      high[g] = four[j] > high[g] ? four[j] : high[g];
    }
  }
}

// Values c0 * 16 .. (c0 + NB) * 16 of the head's output for its G queries: every key's value
// weighted by its softmax numerator (G x NB independent accumulator chains, each lane summing
// the keys in their order; a key's weight broadcast once), divided by the denominator.
template <int G, int NB>
KERNEL_TARGET inline void weigh_values(const uint16_t* v_cache, const size_t* at, int num_keys, const float* scores,
                                       const float* total, int c0, int head_dim, uint16_t* out) {
  __m512 acc[G][NB];
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < NB; ++c) acc[g][c] = _mm512_setzero_ps();
  for (int t = 0; t < num_keys; ++t) {
    const uint16_t* value = v_cache + at[t] + c0 * 16;
    __m512 v[NB];
    for (int c = 0; c < NB; ++c) {
      v[c] = _mm512_castsi512_ps(_mm512_slli_epi32(
          _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(value + c * 16))), 16));
    }
    for (int g = 0; g < G; ++g) {
      const __m512 weight = _mm512_set1_ps(scores[g * num_keys + t]);
      for (int c = 0; c < NB; ++c) acc[g][c] = _mm512_fmadd_ps(weight, v[c], acc[g][c]);
    }
  }
  for (int g = 0; g < G; ++g) {
    const __m512 inverse = _mm512_set1_ps(1.0f / total[g]);
    for (int c = 0; c < NB; ++c) {
      const __m512 o = _mm512_mul_ps(acc[g][c], inverse);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + g * head_dim + (c0 + c) * 16),
                          (__m256i)_mm512_cvtneps_pbh(o));
    }
  }
}

template <int G>
KERNEL_TARGET void attend_head(const uint16_t* q, const uint16_t* k_cache, const uint16_t* v_cache,
                               const int32_t* table, int first, int last, int block_size,
                               int num_kv_heads, int head, int head_dim, float scale,
                               const float* sinks, float* scores, uint16_t* out) {
  const int chunks = head_dim / 32;  // bf16 pairs of a 512-bit register
  const size_t row = static_cast<size_t>(num_kv_heads) * head_dim;
  const int num_keys = last - first;
  const size_t* at = key_rows(table, first, last, block_size, row, head * head_dim).data();
  __m512i qv[G][8];
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < chunks; ++c) qv[g][c] = _mm512_loadu_si512(q + g * head_dim + c * 32);
  const int bytes = head_dim * static_cast<int>(sizeof(uint16_t));
  prefetch_first_keys(k_cache, v_cache, at, num_keys, bytes);
  float high[G];
  for (int g = 0; g < G; ++g) high[g] = sinks ? sinks[g] : -INFINITY;
  // NOTE: whole groups of four keys, then the last one to three (each loop's trip counts known
  // where it is compiled: with them read at run time the loops were branches, not registers).
  int t = 0;
  for (; t + 4 <= num_keys; t += 4) {
    score_keys<G, 4>(qv, chunks, k_cache, v_cache, at, t, num_keys, bytes, scale, scores, high);
  }
  switch (num_keys - t) {
    case 3: score_keys<G, 3>(qv, chunks, k_cache, v_cache, at, t, num_keys, bytes, scale, scores, high); break;
    case 2: score_keys<G, 2>(qv, chunks, k_cache, v_cache, at, t, num_keys, bytes, scale, scores, high); break;
    case 1: score_keys<G, 1>(qv, chunks, k_cache, v_cache, at, t, num_keys, bytes, scale, scores, high); break;
    default: break;
  }
  float total[G];
  softmax_f32<G>(scores, num_keys, high, sinks, total);
  // NOTE: 64 values of the head a pass over the keys (32 with more than 4 queries a KV head:
  // registers), then the rest.
  constexpr int CB = G <= 4 ? 4 : 2;
  const int value_chunks = head_dim / 16;
  int c0 = 0;
  for (; c0 + CB <= value_chunks; c0 += CB) {
    weigh_values<G, CB>(v_cache, at, num_keys, scores, total, c0, head_dim, out);
  }
  switch (value_chunks - c0) {
    case 3: weigh_values<G, 3>(v_cache, at, num_keys, scores, total, c0, head_dim, out); break;
    case 2: weigh_values<G, 2>(v_cache, at, num_keys, scores, total, c0, head_dim, out); break;
    case 1: weigh_values<G, 1>(v_cache, at, num_keys, scores, total, c0, head_dim, out); break;
    default: break;
  }
}

template <int G>
F32_TARGET void attend_head(const float* q, const float* k_cache, const float* v_cache,
                                const int32_t* table, int first, int last, int block_size,
                                int num_kv_heads, int head, int head_dim, float scale,
                                const float* sinks, float* scores, float* out) {
  const size_t row = static_cast<size_t>(num_kv_heads) * head_dim;
  const int num_keys = last - first;
  const std::vector<size_t>& at = key_rows(table, first, last, block_size, row, head * head_dim);
  const int bytes = head_dim * static_cast<int>(sizeof(float));
  prefetch_first_keys(k_cache, v_cache, at.data(), num_keys, bytes);
  float high[G];
  for (int g = 0; g < G; ++g) high[g] = sinks ? sinks[g] : -INFINITY;
  for (int t = 0; t < num_keys; ++t) {
    if (t + kAhead < num_keys) prefetch_key(k_cache, v_cache, at[t + kAhead], bytes);
    const float* key = k_cache + at[t];
    __m256 dot[G];
    for (int g = 0; g < G; ++g) dot[g] = _mm256_setzero_ps();
    for (int c = 0; c < head_dim; c += 8) {
      const __m256 k = _mm256_loadu_ps(key + c);
      for (int g = 0; g < G; ++g) dot[g] = _mm256_fmadd_ps(_mm256_loadu_ps(q + g * head_dim + c), k, dot[g]);
    }
    for (int g = 0; g < G; ++g) {
      const float s = sum8(dot[g]) * scale;
      scores[g * num_keys + t] = s;
      high[g] = s > high[g] ? s : high[g];
    }
  }
  float total[G];
  softmax_f32<G>(scores, num_keys, high, sinks, total);
  for (int c = 0; c < head_dim; c += 8) {
    __m256 acc[G];
    for (int g = 0; g < G; ++g) acc[g] = _mm256_setzero_ps();
    for (int t = 0; t < num_keys; ++t) {
      const __m256 v = _mm256_loadu_ps(v_cache + at[t] + c);
      for (int g = 0; g < G; ++g) acc[g] = _mm256_fmadd_ps(_mm256_set1_ps(scores[g * num_keys + t]), v, acc[g]);
    }
    for (int g = 0; g < G; ++g) {
      _mm256_storeu_ps(out + g * head_dim + c, _mm256_mul_ps(acc[g], _mm256_set1_ps(1.0f / total[g])));
    }
  }
}

// Every sequence's query heads, one KV head (and its G query heads) at a time.
template <typename T, int G>
void decode_attention(const T* q, const T* k_cache, const T* v_cache, const int32_t* tables, int table_stride,
                      const int32_t* lens, int num_seqs, int num_heads, int num_kv_heads, int head_dim,
                      int block_size, float scale, int window, const float* sinks, T* out) {
  thread_local std::vector<float> scores;
  for (int i = 0; i < num_seqs; ++i) {
    const int last = lens[i];
    const int first = window > 0 && last > window ? last - window : 0;
    scores.resize(static_cast<size_t>(G) * (last - first));
    for (int h = 0; h < num_kv_heads; ++h) {
      const size_t at = (static_cast<size_t>(i) * num_heads + h * G) * head_dim;
      attend_head<G>(q + at, k_cache, v_cache, tables + static_cast<size_t>(i) * table_stride, first, last,
                     block_size, num_kv_heads, h, head_dim, scale, sinks ? sinks + h * G : nullptr,
                     scores.data(), out + at);
    }
  }
}

template <typename T>
using DecodeAttention = void (*)(const T*, const T*, const T*, const int32_t*, int, const int32_t*, int, int, int,
                                 int, int, float, int, const float*, T*);

template <typename T>
constexpr DecodeAttention<T> kDecodeAttention[] = {
    nullptr, decode_attention<T, 1>, decode_attention<T, 2>, decode_attention<T, 3>, decode_attention<T, 4>,
    decode_attention<T, 5>, decode_attention<T, 6>, decode_attention<T, 7>, decode_attention<T, 8>};

// The Python call for either element type (bf16 as uint16_t, or float32), where the CPU runs it.
template <typename T>
PyObject* decode_attention_call(PyObject* args, bool supported, const char* unsupported) {
  unsigned long long q, k_cache, v_cache, tables, lens, sinks, out;
  int table_stride, num_seqs, num_heads, num_kv_heads, head_dim, block_size, window;
  float scale;
  if (!PyArg_ParseTuple(args, "KKKKiKiiiiifiKK", &q, &k_cache, &v_cache, &tables, &table_stride, &lens,
                        &num_seqs, &num_heads, &num_kv_heads, &head_dim, &block_size, &scale, &window,
                        &sinks, &out)) {
    return nullptr;
  }
  const int group = num_kv_heads > 0 ? num_heads / num_kv_heads : 0;
  if (!supported_or_error(supported, unsupported)) return nullptr;
  if (group < 1 || group > 8 || group * num_kv_heads != num_heads || head_dim % 32 != 0 || head_dim > 256) {
    PyErr_SetString(PyExc_ValueError, "needs 1-8 query heads per KV head and head_dim a multiple of 32 up to 256");
    return nullptr;
  }
  Py_BEGIN_ALLOW_THREADS
  kDecodeAttention<T>[group](reinterpret_cast<const T*>(q), reinterpret_cast<const T*>(k_cache),
                             reinterpret_cast<const T*>(v_cache), reinterpret_cast<const int32_t*>(tables),
                             table_stride, reinterpret_cast<const int32_t*>(lens), num_seqs, num_heads,
                             num_kv_heads, head_dim, block_size, scale, window,
                             reinterpret_cast<const float*>(sinks), reinterpret_cast<T*>(out));
  Py_END_ALLOW_THREADS
  Py_RETURN_NONE;
}

}  // namespace

// The fused decode step's call (fused_decode.cpp): no window, no sinks.
template <typename T>
void decode_attention_plain(const T* q, const T* k_cache, const T* v_cache, const int32_t* tables, int table_stride,
                            const int32_t* lens, int num_seqs, int num_heads, int num_kv_heads, int head_dim,
                            int block_size, float scale, T* out) {
  kDecodeAttention<T>[num_heads / num_kv_heads](q, k_cache, v_cache, tables, table_stride, lens, num_seqs, num_heads,
                                                num_kv_heads, head_dim, block_size, scale, 0, nullptr, out);
}

template void decode_attention_plain<float>(const float*, const float*, const float*, const int32_t*, int,
                                            const int32_t*, int, int, int, int, int, float, float*);
template void decode_attention_plain<uint16_t>(const uint16_t*, const uint16_t*, const uint16_t*, const int32_t*,
                                               int, const int32_t*, int, int, int, int, int, float, uint16_t*);

PyObject* py_decode_attention(PyObject*, PyObject* args) {
  return decode_attention_call<uint16_t>(args, cpu_supported(), "this CPU lacks AVX512-BF16");
}

PyObject* py_decode_attention_f32(PyObject*, PyObject* args) {
  return decode_attention_call<float>(args, f32_supported(), "this CPU lacks AVX2, FMA or F16C");
}

}  // namespace pdserve
