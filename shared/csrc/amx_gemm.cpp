// pdserve.engine._cpu_kernels, amx: an int4 GEMM on AMX tiles whose every output element sums
// its inputs in one order, whatever the number of rows of the call and whatever the other rows
// are (batch-invariant by construction; oneDNN's GEMM picks its kernel and blocking by shape).
//
// out[m][n] = sum_k x[m][k] * w[n][k] for bf16 x [rows, in], a packed int4 weight as
// int4_gemm.cpp takes it (no table) and bf16 out [rows, out]. 32 output rows of the weight at a
// time are dequantized to bf16 (s * q + m rounded once) in the packed bytes' own order and are
// the tiles' A operand as they are; x is the B operand, laid out once per call in pairs of
// inputs in the same order ([in / 32] blocks of [16 pairs][16 rows][2], its rows padded with
// zeros to a multiple of 32).
// Each 16 x 16 float32 tile of out.T accumulates TDPBF16PS over the inputs 32 at a time, in
// order; an element depends only on its own row of x and column of w, so a row's result does
// not depend on the call. The sums are the instruction's (float32), rounded to bf16 (nearest
// even) at the end. A call reads the int4 weight once, as int4_gemm does.
//
// It runs where the CPU has AMX-TILE and AMX-BF16 and Linux grants the process the tile data
// (`arch_prctl(ARCH_REQ_XCOMP_PERM)`), for in a multiple of 64 and out of 32.
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "common.h"

#define AMX_TARGET __attribute__((target("amx-tile,amx-bf16,avx512f,avx512bw,avx512dq,avx512vl,avx512bf16,fma,f16c")))

namespace pdserve {
namespace {

constexpr int kArchReqXcompPerm = 0x1023;
constexpr int kXfeatureXtiledata = 18;

struct TileConfig {
  uint8_t palette_id;
  uint8_t start_row;
  uint8_t reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

bool cpu_has_amx() {
  unsigned int eax, ebx, ecx, edx;
  if (!__get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx)) return false;
  const bool tile = (edx >> 24) & 1u;
  const bool bf16 = (edx >> 22) & 1u;
  return tile && bf16 && cpu_supported();
}

bool amx_ready() {
  static const bool ready = cpu_has_amx() &&
                            syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
  return ready;
}

// Rounds 16 float32 lanes to bf16, nearest even (VCVTNEPS2BF16).
AMX_TARGET inline void store_bf16(uint16_t* dst, __m512 v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), (__m256i)_mm512_cvtneps_pbh(v));
}

// x [rows, in] -> [in / 32][padded / 16][16 pairs][16 rows][2], rows from `rows` on zero, its
// inputs in the order the weight is dequantized in (`dequantize_rows`): K tile 2p + h holds
// pair of groups p's low (h 0) or high (h 1) nibbles, and its pair pp is the two inputs of
// group 2p + (pp & 1) at columns 2 (pp >> 1) + {0, 1}, + 16 for the high nibbles.
AMX_TARGET void lay_out_rows(const uint16_t* x, int rows, int padded, int in, uint16_t* laid) {
  const int row_tiles = padded / 16;
  const int pairs_per_row = in / 2;
  const __m512i index = _mm512_mullo_epi32(
      _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15), _mm512_set1_epi32(pairs_per_row));
  for (int mt = 0; mt < row_tiles; ++mt) {
    const int valid = rows - mt * 16;
    for (int kb = 0; kb < in / 32; ++kb) {
      int32_t* block = reinterpret_cast<int32_t*>(laid + (static_cast<size_t>(kb) * row_tiles + mt) * 512);
      if (valid <= 0) {
        memset(block, 0, 1024);
        continue;
      }
      const int32_t* base = reinterpret_cast<const int32_t*>(x + static_cast<size_t>(mt) * 16 * in);
      const __mmask16 mask = first_lanes(valid);
      const int group_pair = kb / 2, high = kb % 2;
      for (int pp = 0; pp < 16; ++pp) {
        const int offset = (2 * group_pair + (pp & 1)) * 16 + (pp >> 1) + 8 * high;
        __m512i pairs = _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), mask, index, base + offset, 4);
        _mm512_storeu_si512(block + pp * 16, pairs);
      }
    }
  }
}

template <typename S>
AMX_TARGET inline __m512 pair_of(const S* values);

template <>
AMX_TARGET inline __m512 pair_of<float>(const float* values) {
  return _mm512_castpd_ps(_mm512_set1_pd(*reinterpret_cast<const double*>(values)));
}

template <>
AMX_TARGET inline __m512 pair_of<uint16_t>(const uint16_t* values) {
  int32_t bits;
  memcpy(&bits, values, sizeof bits);
  return _mm512_broadcast_f32x2(_mm_cvtph_ps(_mm_cvtsi32_si128(bits)));
}

AMX_TARGET inline float one_of(const float* value) { return *value; }
AMX_TARGET inline float one_of(const uint16_t* value) { return _cvtsh_ss(*value); }

// The output rows [n0, n0 + 32) of a packed int4 weight (int4_gemm.cpp's layout: a row is in /
// 64 pairs of groups, 32 bytes each; scales [out][G], mins [G][out] or null) as bf16 s * q + m
// (rounded once, to nearest even: int4_dequantize's values), [32][in] in the bytes' own order:
// pair p's low nibbles at columns 64 p .. 64 p + 31, its high ones after; x is laid out to
// match (`lay_out_rows`). A word b of a half belongs to group 2p + ((b >> 1) & 1).
template <typename S>
AMX_TARGET void dequantize_rows(const uint8_t* weight, const S* scales, const S* mins, int out_features, int in,
                                int n0, uint16_t* w) {
  const int num_pairs = in / 64;
  const __m512i nibble = _mm512_set1_epi16(0x000F);
  const __m512i spread = _mm512_set_epi32(1, 1, 0, 0, 1, 1, 0, 0, 1, 1, 0, 0, 1, 1, 0, 0);
  for (int r = 0; r < 32; ++r) {
    const int o = n0 + r;
    const uint8_t* packed = weight + static_cast<size_t>(o) * num_pairs * 32;
    const S* s = scales + static_cast<size_t>(o) * 2 * num_pairs;
    uint16_t* row = w + static_cast<size_t>(r) * in;
    for (int p = 0; p < num_pairs; ++p) {
      const __m512i wide = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(packed + p * 32)));
      const __m512i halves[2] = {_mm512_and_si512(wide, nibble), _mm512_srli_epi16(wide, 4)};
      const __m512 scale = _mm512_permutexvar_ps(spread, pair_of<S>(s + 2 * p));
      __m512 min = _mm512_setzero_ps();
      if (mins != nullptr) {
        const S* m = mins + static_cast<size_t>(2 * p) * out_features + o;
        min = _mm512_permutexvar_ps(
            spread, _mm512_broadcast_f32x2(_mm_setr_ps(one_of(m), one_of(m + out_features), 0, 0)));
      }
      for (int h = 0; h < 2; ++h) {
        const __m512 q0 = _mm512_cvtepi32_ps(_mm512_cvtepu16_epi32(_mm512_castsi512_si256(halves[h])));
        const __m512 q1 = _mm512_cvtepi32_ps(_mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64(halves[h], 1)));
        const __m512 v0 = _mm512_fmadd_ps(q0, scale, min);
        const __m512 v1 = _mm512_fmadd_ps(q1, scale, min);
        _mm512_storeu_si512(row + (2 * p + h) * 32, (__m512i)_mm512_cvtne2ps_pbh(v1, v0));
      }
    }
  }
}

AMX_TARGET void amx_int4_gemm(const uint16_t* x, int rows, int in, const uint8_t* weight, const void* scales,
                              const void* mins, bool half_scales, int out_features, uint16_t* out) {
  const int padded = (rows + 31) / 32 * 32;
  const int row_tiles = padded / 16;
  std::vector<uint16_t> laid(static_cast<size_t>(padded) * in);
  lay_out_rows(x, rows, padded, in, laid.data());
  std::vector<uint16_t> w(static_cast<size_t>(32) * in);  // 32 output rows, dequantized
  TileConfig config = {};
  config.palette_id = 1;
  for (int t = 0; t < 8; ++t) {
    config.rows[t] = 16;
    config.colsb[t] = 64;
  }
  _tile_loadconfig(&config);
  alignas(64) float tile[4][16][16];
  const size_t w_stride = static_cast<size_t>(in) * 2;
  const __m512i column = _mm512_mullo_epi32(
      _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15), _mm512_set1_epi32(16));
  for (int n0 = 0; n0 < out_features; n0 += 32) {
    if (half_scales) {
      dequantize_rows(weight, static_cast<const uint16_t*>(scales), static_cast<const uint16_t*>(mins), out_features,
                      in, n0, w.data());
    } else {
      dequantize_rows(weight, static_cast<const float*>(scales), static_cast<const float*>(mins), out_features, in,
                      n0, w.data());
    }
    const uint16_t* w0 = w.data();
    const uint16_t* w1 = w0 + static_cast<size_t>(16) * in;
    for (int mt = 0; mt < row_tiles; mt += 2) {
      _tile_zero(0);
      _tile_zero(1);
      _tile_zero(2);
      _tile_zero(3);
      for (int kb = 0; kb < in / 32; ++kb) {
        const uint16_t* b = laid.data() + (static_cast<size_t>(kb) * row_tiles + mt) * 512;
        _tile_loadd(4, w0 + kb * 32, w_stride);
        _tile_loadd(5, w1 + kb * 32, w_stride);
        _tile_loadd(6, b, 64);
        _tile_loadd(7, b + 512, 64);
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 4, 7);
        _tile_dpbf16ps(2, 5, 6);
        _tile_dpbf16ps(3, 5, 7);
      }
      _tile_stored(0, tile[0], 64);
      _tile_stored(1, tile[1], 64);
      _tile_stored(2, tile[2], 64);
      _tile_stored(3, tile[3], 64);
      // tile[2 * (n half) + (m half)][n][m]: row m of out is column m of the tiles
      for (int mh = 0; mh < 2; ++mh) {
        for (int m = 0; m < 16; ++m) {
          const int row = (mt + mh) * 16 + m;
          if (row >= rows) break;
          uint16_t* dst = out + static_cast<size_t>(row) * out_features + n0;
          for (int nh = 0; nh < 2; ++nh) {
            store_bf16(dst + nh * 16, _mm512_i32gather_ps(column, &tile[2 * nh + mh][0][m], 4));
          }
        }
      }
    }
  }
  _tile_release();
}

}  // namespace

PyObject* py_amx_supported(PyObject*, PyObject*) { return PyBool_FromLong(amx_ready()); }

PyObject* py_amx_int4_gemm(PyObject*, PyObject* args) {
  unsigned long long x, weight, scales, mins, out;
  int rows, in, out_features, half_scales;
  if (!PyArg_ParseTuple(args, "KiiKKKiKp", &x, &rows, &in, &weight, &scales, &mins, &out_features, &out,
                        &half_scales)) {
    return nullptr;
  }
  if (!amx_ready()) {
    PyErr_SetString(PyExc_RuntimeError, "amx_int4_gemm: this CPU or process has no AMX tiles");
    return nullptr;
  }
  if (rows < 0 || in <= 0 || in % 64 != 0 || out_features <= 0 || out_features % 32 != 0) {
    PyErr_SetString(PyExc_ValueError,
                    "amx_int4_gemm: in must be a positive multiple of 64 and out_features of 32");
    return nullptr;
  }
  Py_BEGIN_ALLOW_THREADS
  if (rows > 0) {
    amx_int4_gemm(reinterpret_cast<const uint16_t*>(x), rows, in, reinterpret_cast<const uint8_t*>(weight),
                  reinterpret_cast<const void*>(scales), reinterpret_cast<const void*>(mins), half_scales != 0,
                  out_features, reinterpret_cast<uint16_t*>(out));
  }
  Py_END_ALLOW_THREADS
  Py_RETURN_NONE;
}

}  // namespace pdserve
