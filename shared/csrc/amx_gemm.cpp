// pdserve.engine._cpu_kernels, amx: an int4 GEMM on AMX tiles whose every output element sums
// its inputs in one order, whatever the number of rows of the call and whatever the other rows
// are (batch-invariant by construction; oneDNN's GEMM picks its kernel and blocking by shape).
//
// out[m][n] = sum_k x[m][k] * w[n][k] for bf16 x [rows, in], a packed int4 weight as
// int4_gemm.cpp takes it (no table) and bf16 out [rows, out]. 32 output rows of the weight at a
// time are dequantized to bf16 (`int4_dequantize_rows`: s * q + m rounded once) and are the
// tiles' A operand as they are; x is the B operand, laid out once per call in pairs of inputs
// ([in / 32] blocks of [16 pairs][16 rows][2], its rows padded with zeros to a multiple of 32).
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

#define AMX_TARGET __attribute__((target("amx-tile,amx-bf16,avx512f,avx512bw,avx512dq,avx512vl,avx512bf16")))

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

// x [rows, in] -> [in / 32][padded / 16][16 pairs][16 rows][2], rows from `rows` on zero.
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
      const int32_t* base = reinterpret_cast<const int32_t*>(x + static_cast<size_t>(mt) * 16 * in) + kb * 16;
      const __mmask16 mask = first_lanes(valid);
      for (int p = 0; p < 16; ++p) {
        // pair p of the block's 32 inputs, of each of its 16 rows
        __m512i pairs = _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), mask, index, base + p, 4);
        _mm512_storeu_si512(block + p * 16, pairs);
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
    int4_dequantize_rows(weight, scales, mins, half_scales, out_features, in, n0, n0 + 32, w.data());
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
