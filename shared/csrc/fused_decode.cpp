// pdserve.engine._cpu_kernels, a float32 decode step's decoder layers in one call (AVX2, FMA,
// F16C; pdserve.engine.fused_decode).
//
// A Llama-style layer over int4 or int8-group projections (a GGUF's own Q4_0 / Q4_1 / Q4_K, and
// Q8_0 / Q6_K / Q5_K, weights; f32_gemm.cpp):
//   h = rms_norm(x); qkv = h @ Wqkv; q, k rotated (RoPE, the half-split convention); k, v
//   written into the paged cache at the rows' slots; a = attention(q); x += a @ Wo;
//   h = rms_norm(x); x += (silu(gate) * up) @ Wdown for [gate | up] = h @ Wgate_up
// for every layer, with no return to Python between kernels. Each step is the kernel (or the
// tensor arithmetic) the layer-by-layer path runs for the same rows, in the same order, so the
// two give the same bits: RoPE's products and sums are each rounded once as torch's are (no
// contraction into FMAs in this file), the residual adds are single adds, and the layer-by-layer
// path's SwiGLU runs on `silu_mul` below.
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
};

constexpr int kPlanFields = 2 + 4 * 6;  // see pdserve.engine.fused_decode.LAYER_FIELDS

struct Layer {
  const float* input_norm;
  const float* post_attention_norm;
  Projection qkv, o, gate_up, down;

  explicit Layer(const int64_t* f)
      : input_norm(reinterpret_cast<const float*>(f[0])),
        post_attention_norm(reinterpret_cast<const float*>(f[1])),
        qkv{f[2], f[3], f[4], f[5], f[6], f[7]},
        o{f[8], f[9], f[10], f[11], f[12], f[13]},
        gate_up{f[14], f[15], f[16], f[17], f[18], f[19]},
        down{f[20], f[21], f[22], f[23], f[24], f[25]} {}
};

struct Shape {
  int hidden, num_heads, num_kv_heads, head_dim, intermediate, block_size, table_stride;
  float eps, scale;
  long long cache_floats;  // a layer's K (or V) cache: blocks * block_size * kv_heads * head_dim
};

// Every layer for `rows` decodes: hidden [rows, hidden] in place; cos/sin [rows, head_dim];
// the cache [layers, 2, blocks, block_size, kv_heads, head_dim] (`Shape::cache_floats` a K or
// V); slots int64 [rows]; block tables int32 [rows, table_stride]; lens int32 [rows] (each
// row's keys, its own included).
F32_TARGET void decode_layers(const int64_t* plan, int num_layers, const Shape& s, float* hidden, int rows,
                              const float* cos, const float* sin, float* kv, const int64_t* slots,
                              const int32_t* tables, const int32_t* lens) {
  const int q_size = s.num_heads * s.head_dim;
  const int kv_size = s.num_kv_heads * s.head_dim;
  const int qkv_size = q_size + 2 * kv_size;
  thread_local std::vector<float> normed, qkv, q, attended, projected, gate_up, act;
  normed.resize(static_cast<size_t>(rows) * s.hidden);
  qkv.resize(static_cast<size_t>(rows) * qkv_size);
  q.resize(static_cast<size_t>(rows) * q_size);
  attended.resize(static_cast<size_t>(rows) * q_size);
  projected.resize(static_cast<size_t>(rows) * s.hidden);
  gate_up.resize(static_cast<size_t>(rows) * 2 * s.intermediate);
  act.resize(static_cast<size_t>(rows) * s.intermediate);
  for (int l = 0; l < num_layers; ++l) {
    const Layer layer(plan + static_cast<size_t>(l) * kPlanFields);
    float* k_cache = kv + static_cast<size_t>(l) * 2 * s.cache_floats;
    float* v_cache = k_cache + s.cache_floats;
    rms_norm_f32(hidden, rows, s.hidden, layer.input_norm, s.eps, normed.data());
    layer.qkv.apply(normed.data(), rows, s.hidden, qkv_size, qkv.data());
    for (int r = 0; r < rows; ++r) {
      const float* row = qkv.data() + static_cast<size_t>(r) * qkv_size;
      const float* c = cos + static_cast<size_t>(r) * s.head_dim;
      const float* n = sin + static_cast<size_t>(r) * s.head_dim;
      for (int h = 0; h < s.num_heads; ++h) {
        rotate(row + h * s.head_dim, c, n, s.head_dim, q.data() + static_cast<size_t>(r) * q_size + h * s.head_dim);
      }
      float* k_row = k_cache + static_cast<size_t>(slots[r]) * kv_size;
      float* v_row = v_cache + static_cast<size_t>(slots[r]) * kv_size;
      for (int h = 0; h < s.num_kv_heads; ++h) {
        rotate(row + q_size + h * s.head_dim, c, n, s.head_dim, k_row + h * s.head_dim);
      }
      memcpy(v_row, row + q_size + kv_size, sizeof(float) * kv_size);
    }
    decode_attention_f32(q.data(), k_cache, v_cache, tables, s.table_stride, lens, rows, s.num_heads,
                         s.num_kv_heads, s.head_dim, s.block_size, s.scale, attended.data());
    layer.o.apply(attended.data(), rows, q_size, s.hidden, projected.data());
    add_into(hidden, projected.data(), static_cast<size_t>(rows) * s.hidden);
    rms_norm_f32(hidden, rows, s.hidden, layer.post_attention_norm, s.eps, normed.data());
    layer.gate_up.apply(normed.data(), rows, s.hidden, 2 * s.intermediate, gate_up.data());
    silu_mul(gate_up.data(), rows, s.intermediate, act.data());
    layer.down.apply(act.data(), rows, s.intermediate, s.hidden, projected.data());
    add_into(hidden, projected.data(), static_cast<size_t>(rows) * s.hidden);
  }
}

}  // namespace

PyObject* py_silu_mul_f32(PyObject*, PyObject* args) {
  unsigned long long gate_up, out;
  int rows, size;
  if (!PyArg_ParseTuple(args, "KiiK", &gate_up, &rows, &size, &out)) return nullptr;
  if (!f32_supported_or_error() || !rows_or_error(rows, size)) return nullptr;
  Py_BEGIN_ALLOW_THREADS
  silu_mul(reinterpret_cast<const float*>(gate_up), rows, size, reinterpret_cast<float*>(out));
  Py_END_ALLOW_THREADS
  Py_RETURN_NONE;
}

PyObject* py_decode_layers_f32(PyObject*, PyObject* args) {
  unsigned long long plan, hidden, cos, sin, kv, slots, tables, lens;
  int num_layers, rows;
  Shape s;
  if (!PyArg_ParseTuple(args, "KiKiiiiiiiiffKKKLKKK", &plan, &num_layers, &hidden, &rows, &s.hidden, &s.num_heads,
                        &s.num_kv_heads, &s.head_dim, &s.intermediate, &s.block_size, &s.table_stride, &s.eps,
                        &s.scale, &cos, &sin, &kv, &s.cache_floats, &slots, &tables, &lens)) {
    return nullptr;
  }
  if (!f32_supported_or_error()) return nullptr;
  const int group = s.num_kv_heads > 0 ? s.num_heads / s.num_kv_heads : 0;
  if (rows < 1 || num_layers < 1 || group < 1 || group > 8 || group * s.num_kv_heads != s.num_heads ||
      s.head_dim % 32 != 0 || s.head_dim > 256 || s.hidden % 64 != 0 || s.intermediate % 64 != 0) {
    PyErr_SetString(PyExc_ValueError,
                    "needs rows, 1-8 query heads per KV head, head_dim a multiple of 32 up to 256, and the "
                    "hidden and intermediate sizes multiples of 64");
    return nullptr;
  }
  Py_BEGIN_ALLOW_THREADS
  decode_layers(reinterpret_cast<const int64_t*>(plan), num_layers, s, reinterpret_cast<float*>(hidden), rows,
                reinterpret_cast<const float*>(cos), reinterpret_cast<const float*>(sin),
                reinterpret_cast<float*>(kv), reinterpret_cast<const int64_t*>(slots),
                reinterpret_cast<const int32_t*>(tables), reinterpret_cast<const int32_t*>(lens));
  Py_END_ALLOW_THREADS
  Py_RETURN_NONE;
}

}  // namespace pdserve
