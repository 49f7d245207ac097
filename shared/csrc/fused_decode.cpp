// pdserve.engine._cpu_kernels, a decode step's decoder layers in one call
// (pdserve.engine.fused_decode): float32 activations (AVX2, FMA, F16C) or bf16 ones
// (AVX512-BF16), over the same packed weights.
//
// A Llama-style layer over int4 or int8-group projections (a GGUF's own Q4_0 / Q4_1 / Q4_K, and
// Q8_0 / Q6_K / Q5_K, weights; f32_gemm.cpp, int4_gemm.cpp, int8_gemm.cpp):
//   h = rms_norm(x); qkv = h @ Wqkv; q, k rotated (RoPE, the half-split convention); k, v
//   written into the paged cache at the rows' slots; a = attention(q); x += a @ Wo;
//   h = rms_norm(x); x += (silu(gate) * up) @ Wdown for [gate | up] = h @ Wgate_up
// for every layer, with no return to Python between kernels. Each step is the kernel (or the
// tensor arithmetic) the layer-by-layer path runs for the same rows, in the same order, so the
// two give the same bits: RoPE's products and sums are each rounded once as torch's are (no
// contraction into FMAs in this file; in bf16 each product and the sum rounded to bf16, to
// nearest even, as torch's bf16 ops round), the residual adds are single adds (rounded to bf16
// in bf16), and the layer-by-layer path's SwiGLU runs on `silu_mul` below.
#include "common.h"

#pragma GCC optimize("fp-contract=off")

namespace pdserve {
namespace {

F32_TARGET inline float exp1(float x) {
  alignas(32) float lanes[8] = {x};
  _mm256_store_ps(lanes, exp8(_mm256_load_ps(lanes)));
  return lanes[0];
}

// out[r] = silu(gate) * up for each row's [gate (size) | up (size)] of gate_up; silu(g) =
// g / (1 + exp(-g)).
F32_TARGET void silu_mul(const float* gate_up, int rows, int size, float* out) {
  for (int r = 0; r < rows; ++r) {
    const float* gate = gate_up + static_cast<size_t>(r) * 2 * size;
    const float* up = gate + size;
    float* dest = out + static_cast<size_t>(r) * size;
    int i = 0;
    for (; i + 8 <= size; i += 8) {
      const __m256 g = _mm256_loadu_ps(gate + i);
      const __m256 e = exp8(_mm256_sub_ps(_mm256_setzero_ps(), g));
      const __m256 s = _mm256_div_ps(g, _mm256_add_ps(_mm256_set1_ps(1.0f), e));
      _mm256_storeu_ps(dest + i, _mm256_mul_ps(s, _mm256_loadu_ps(up + i)));
    }
    for (; i < size; ++i) dest[i] = gate[i] / (1.0f + exp1(-gate[i])) * up[i];
  }
}

// One head rotated from `x` into `out` (they may be one): x * cos + rotate_half(x) * sin, each
// product and the sum rounded once (torch's order).
F32_TARGET inline void rotate(const float* x, const float* cos, const float* sin, int head_dim, float* out) {
  const int half = head_dim / 2;
  for (int i = 0; i < half; i += 8) {
    const __m256 a = _mm256_loadu_ps(x + i);
    const __m256 b = _mm256_loadu_ps(x + half + i);
    const __m256 low = _mm256_sub_ps(_mm256_mul_ps(a, _mm256_loadu_ps(cos + i)),
                                     _mm256_mul_ps(b, _mm256_loadu_ps(sin + i)));
    const __m256 high = _mm256_add_ps(_mm256_mul_ps(b, _mm256_loadu_ps(cos + half + i)),
                                      _mm256_mul_ps(a, _mm256_loadu_ps(sin + half + i)));
    _mm256_storeu_ps(out + i, low);
    _mm256_storeu_ps(out + half + i, high);
  }
}

F32_TARGET inline void add_into(float* x, const float* y, size_t count) {
  size_t i = 0;
  for (; i + 8 <= count; i += 8) _mm256_storeu_ps(x + i, _mm256_add_ps(_mm256_loadu_ps(x + i), _mm256_loadu_ps(y + i)));
  for (; i < count; ++i) x[i] += y[i];
}

// bf16 (uint16_t) forms of the three element-wise steps, 16 lanes at a time in float32, each
// result rounded to bf16 as torch rounds (`rounded`).
KERNEL_TARGET inline __m512 widen(const uint16_t* p) {
  return _mm512_castsi512_ps(
      _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
}

// The float32 lanes rounded to bf16 values (still float32): to nearest even, a NaN kept a NaN,
// denormals kept (float_to_bf16's arithmetic; VCVTNEPS2BF16 flushes denormals).
KERNEL_TARGET inline __m512 rounded(__m512 v) {
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_add_epi32(bits, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), odd));
  r = _mm512_mask_or_epi32(r, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), bits, _mm512_set1_epi32(0x400000));
  return _mm512_castsi512_ps(_mm512_and_si512(r, _mm512_set1_epi32(static_cast<int>(0xffff0000u))));
}

KERNEL_TARGET inline void store(uint16_t* p, __m512 rounded_values) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p),
                      _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(rounded_values), 16)));
}

// exp of 16 lanes: exp8 on each half (the same bits as the float32 kernels' exponentials).
KERNEL_TARGET inline __m512 exp16(__m512 x) {
  return _mm512_insertf32x8(_mm512_castps256_ps512(exp8(_mm512_castps512_ps256(x))),
                            exp8(_mm512_extractf32x8_ps(x, 1)), 1);
}

// out[r] = silu(gate) * up, torch's two bf16 ops: silu(g) = g / (1 + exp(-g)) in float32,
// rounded to bf16, then the product rounded to bf16. size: a multiple of 16.
KERNEL_TARGET void silu_mul(const uint16_t* gate_up, int rows, int size, uint16_t* out) {
  for (int r = 0; r < rows; ++r) {
    const uint16_t* gate = gate_up + static_cast<size_t>(r) * 2 * size;
    const uint16_t* up = gate + size;
    uint16_t* dest = out + static_cast<size_t>(r) * size;
    for (int i = 0; i < size; i += 16) {
      const __m512 g = widen(gate + i);
      const __m512 e = exp16(_mm512_sub_ps(_mm512_setzero_ps(), g));
      const __m512 s = rounded(_mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.0f), e)));
      store(dest + i, rounded(_mm512_mul_ps(s, widen(up + i))));
    }
  }
}

// One bf16 head rotated as torch rotates it in bf16: x * cos and rotate_half(x) * sin each
// rounded to bf16, then their sum. head_dim / 2: a multiple of 16.
KERNEL_TARGET inline void rotate(const uint16_t* x, const uint16_t* cos, const uint16_t* sin, int head_dim,
                                 uint16_t* out) {
  const int half = head_dim / 2;
  for (int i = 0; i < half; i += 16) {
    const __m512 a = widen(x + i);
    const __m512 b = widen(x + half + i);
    const __m512 low = _mm512_sub_ps(rounded(_mm512_mul_ps(a, widen(cos + i))),
                                     rounded(_mm512_mul_ps(b, widen(sin + i))));
    const __m512 high = _mm512_add_ps(rounded(_mm512_mul_ps(b, widen(cos + half + i))),
                                      rounded(_mm512_mul_ps(a, widen(sin + half + i))));
    store(out + i, rounded(low));
    store(out + half + i, rounded(high));
  }
}

// x += y in bf16: each sum rounded once. count: a multiple of 16.
KERNEL_TARGET inline void add_into(uint16_t* x, const uint16_t* y, size_t count) {
  for (size_t i = 0; i < count; i += 16) store(x + i, rounded(_mm512_add_ps(widen(x + i), widen(y + i))));
}

inline void rms_norm(const float* x, int rows, int size, const float* weight, float eps, bool, float* out) {
  rms_norm_f32(x, rows, size, weight, eps, out);
}

inline void rms_norm(const uint16_t* x, int rows, int size, const uint16_t* weight, float eps,
                     bool scaled_in_float32, uint16_t* out) {
  rms_norm_bf16(x, rows, size, weight, eps, scaled_in_float32, out);
}

// A projection as the plan holds it (pdserve.engine.fused_decode.PROJECTION_FIELDS): int4
// (packed pairs, scales, mins [in / 32][out], float16 scales or not) or int8 groups (values,
// scales, float32 scales or not, group 16 or 32, float32 mins or none).
struct Projection {
  int64_t kind, weight, scales, mins, flag, group;

  void apply(const float* x, int rows, int in_features, int out_features, float* out) const {
    if (kind == 0) {
      int4_gemm_f32(x, rows, in_features, reinterpret_cast<const uint8_t*>(weight),
                    reinterpret_cast<const void*>(scales), reinterpret_cast<const void*>(mins), out_features, out,
                    flag != 0);
    } else {
      int8_gemm_f32(x, rows, in_features, reinterpret_cast<const int8_t*>(weight),
                    reinterpret_cast<const void*>(scales), flag != 0, static_cast<int>(group),
                    reinterpret_cast<const float*>(mins), out_features, out);
    }
  }

  void apply(const uint16_t* x, int rows, int in_features, int out_features, uint16_t* out) const {
    if (kind == 0) {
      int4_gemm_bf16(x, rows, in_features, reinterpret_cast<const uint8_t*>(weight),
                     reinterpret_cast<const void*>(scales), reinterpret_cast<const void*>(mins), out_features, out,
                     flag != 0);
    } else {
      int8_gemm_bf16(x, rows, in_features, reinterpret_cast<const int8_t*>(weight),
                     reinterpret_cast<const void*>(scales), flag != 0, static_cast<int>(group),
                     reinterpret_cast<const float*>(mins), out_features, out);
    }
  }
};

constexpr int kPlanFields = 2 + 4 * 6;  // see pdserve.engine.fused_decode.LAYER_FIELDS

template <typename T>
struct Layer {
  const T* input_norm;
  const T* post_attention_norm;
  Projection qkv, o, gate_up, down;

  explicit Layer(const int64_t* f)
      : input_norm(reinterpret_cast<const T*>(f[0])),
        post_attention_norm(reinterpret_cast<const T*>(f[1])),
        qkv{f[2], f[3], f[4], f[5], f[6], f[7]},
        o{f[8], f[9], f[10], f[11], f[12], f[13]},
        gate_up{f[14], f[15], f[16], f[17], f[18], f[19]},
        down{f[20], f[21], f[22], f[23], f[24], f[25]} {}
};

struct Shape {
  int hidden, num_heads, num_kv_heads, head_dim, intermediate, block_size, table_stride;
  float eps, scale;
  long long cache_elements;  // a layer's K (or V) cache: blocks * block_size * kv_heads * head_dim
  int norm_scaled_in_float32;  // bf16 norms: gpt-oss's order (cpu_norm)
};

// Every layer for `rows` decodes, T float (float32) or uint16_t (bf16): hidden [rows, hidden] in
// place; cos/sin [rows, head_dim]; the cache [layers, 2, blocks, block_size, kv_heads, head_dim]
// (`Shape::cache_elements` a K or V); slots int64 [rows]; block tables int32 [rows,
// table_stride]; lens int32 [rows] (each row's keys, its own included).
template <typename T>
void decode_layers(const int64_t* plan, int num_layers, const Shape& s, T* hidden, int rows, const T* cos,
                   const T* sin, T* kv, const int64_t* slots, const int32_t* tables, const int32_t* lens) {
  const int q_size = s.num_heads * s.head_dim;
  const int kv_size = s.num_kv_heads * s.head_dim;
  const int qkv_size = q_size + 2 * kv_size;
  const bool scaled = s.norm_scaled_in_float32 != 0;
  thread_local std::vector<T> normed, qkv, q, attended, projected, gate_up, act;
  normed.resize(static_cast<size_t>(rows) * s.hidden);
  qkv.resize(static_cast<size_t>(rows) * qkv_size);
  q.resize(static_cast<size_t>(rows) * q_size);
  attended.resize(static_cast<size_t>(rows) * q_size);
  projected.resize(static_cast<size_t>(rows) * s.hidden);
  gate_up.resize(static_cast<size_t>(rows) * 2 * s.intermediate);
  act.resize(static_cast<size_t>(rows) * s.intermediate);
  for (int l = 0; l < num_layers; ++l) {
    const Layer<T> layer(plan + static_cast<size_t>(l) * kPlanFields);
    T* k_cache = kv + static_cast<size_t>(l) * 2 * s.cache_elements;
    T* v_cache = k_cache + s.cache_elements;
    rms_norm(hidden, rows, s.hidden, layer.input_norm, s.eps, scaled, normed.data());
    layer.qkv.apply(normed.data(), rows, s.hidden, qkv_size, qkv.data());
    for (int r = 0; r < rows; ++r) {
      const T* row = qkv.data() + static_cast<size_t>(r) * qkv_size;
      const T* c = cos + static_cast<size_t>(r) * s.head_dim;
      const T* n = sin + static_cast<size_t>(r) * s.head_dim;
      for (int h = 0; h < s.num_heads; ++h) {
        rotate(row + h * s.head_dim, c, n, s.head_dim, q.data() + static_cast<size_t>(r) * q_size + h * s.head_dim);
      }
      T* k_row = k_cache + static_cast<size_t>(slots[r]) * kv_size;
      T* v_row = v_cache + static_cast<size_t>(slots[r]) * kv_size;
      for (int h = 0; h < s.num_kv_heads; ++h) {
        rotate(row + q_size + h * s.head_dim, c, n, s.head_dim, k_row + h * s.head_dim);
      }
      memcpy(v_row, row + q_size + kv_size, sizeof(T) * kv_size);
    }
    decode_attention_plain<T>(q.data(), k_cache, v_cache, tables, s.table_stride, lens, rows, s.num_heads,
                              s.num_kv_heads, s.head_dim, s.block_size, s.scale, attended.data());
    layer.o.apply(attended.data(), rows, q_size, s.hidden, projected.data());
    add_into(hidden, projected.data(), static_cast<size_t>(rows) * s.hidden);
    rms_norm(hidden, rows, s.hidden, layer.post_attention_norm, s.eps, scaled, normed.data());
    layer.gate_up.apply(normed.data(), rows, s.hidden, 2 * s.intermediate, gate_up.data());
    silu_mul(gate_up.data(), rows, s.intermediate, act.data());
    layer.down.apply(act.data(), rows, s.intermediate, s.hidden, projected.data());
    add_into(hidden, projected.data(), static_cast<size_t>(rows) * s.hidden);
  }
}

// The Python call for either element type, where the CPU runs it.
template <typename T>
PyObject* silu_mul_call(PyObject* args, bool supported, const char* unsupported) {
  unsigned long long gate_up, out;
  int rows, size;
  if (!PyArg_ParseTuple(args, "KiiK", &gate_up, &rows, &size, &out)) return nullptr;
  if (!supported_or_error(supported, unsupported) || !rows_or_error(rows, size)) return nullptr;
  if (sizeof(T) == 2 && size % 16 != 0) {
    PyErr_SetString(PyExc_ValueError, "bf16 rows need a size that is a multiple of 16");
    return nullptr;
  }
  Py_BEGIN_ALLOW_THREADS
  silu_mul(reinterpret_cast<const T*>(gate_up), rows, size, reinterpret_cast<T*>(out));
  Py_END_ALLOW_THREADS
  Py_RETURN_NONE;
}

template <typename T>
PyObject* decode_layers_call(PyObject* args, bool supported, const char* unsupported) {
  unsigned long long plan, hidden, cos, sin, kv, slots, tables, lens;
  int num_layers, rows;
  Shape s;
  if (!PyArg_ParseTuple(args, "KiKiiiiiiiiffKKKLKKKp", &plan, &num_layers, &hidden, &rows, &s.hidden, &s.num_heads,
                        &s.num_kv_heads, &s.head_dim, &s.intermediate, &s.block_size, &s.table_stride, &s.eps,
                        &s.scale, &cos, &sin, &kv, &s.cache_elements, &slots, &tables, &lens,
                        &s.norm_scaled_in_float32)) {
    return nullptr;
  }
  if (!supported_or_error(supported, unsupported)) return nullptr;
  const int group = s.num_kv_heads > 0 ? s.num_heads / s.num_kv_heads : 0;
  if (rows < 1 || num_layers < 1 || group < 1 || group > 8 || group * s.num_kv_heads != s.num_heads ||
      s.head_dim % 32 != 0 || s.head_dim > 256 || s.hidden % 64 != 0 || s.intermediate % 64 != 0) {
    PyErr_SetString(PyExc_ValueError,
                    "needs rows, 1-8 query heads per KV head, head_dim a multiple of 32 up to 256, and the "
                    "hidden and intermediate sizes multiples of 64");
    return nullptr;
  }
  Py_BEGIN_ALLOW_THREADS
  decode_layers<T>(reinterpret_cast<const int64_t*>(plan), num_layers, s, reinterpret_cast<T*>(hidden), rows,
                   reinterpret_cast<const T*>(cos), reinterpret_cast<const T*>(sin), reinterpret_cast<T*>(kv),
                   reinterpret_cast<const int64_t*>(slots), reinterpret_cast<const int32_t*>(tables),
                   reinterpret_cast<const int32_t*>(lens));
  Py_END_ALLOW_THREADS
  Py_RETURN_NONE;
}

constexpr const char* kNoF32 = "this CPU lacks AVX2, FMA or F16C";
constexpr const char* kNoBf16 = "this CPU lacks AVX512-BF16";

}  // namespace

PyObject* py_silu_mul_f32(PyObject*, PyObject* args) { return silu_mul_call<float>(args, f32_supported(), kNoF32); }

PyObject* py_silu_mul(PyObject*, PyObject* args) { return silu_mul_call<uint16_t>(args, cpu_supported(), kNoBf16); }

PyObject* py_decode_layers_f32(PyObject*, PyObject* args) {
  return decode_layers_call<float>(args, f32_supported(), kNoF32);
}

PyObject* py_decode_layers(PyObject*, PyObject* args) {
  return decode_layers_call<uint16_t>(args, cpu_supported(), kNoBf16);
}

}  // namespace pdserve
