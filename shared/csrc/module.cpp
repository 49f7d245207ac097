// pdserve.engine._cpu_kernels: the module (int4_gemm.cpp, int8_gemm.cpp, decode_attention.cpp,
// rms_norm.cpp for AVX512-BF16; f32_gemm.cpp for AVX2; fused_decode.cpp for both).
#include "common.h"

namespace pdserve {

bool cpu_supported() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl") &&
         __builtin_cpu_supports("avx512bf16") && __builtin_cpu_supports("fma") &&
         __builtin_cpu_supports("f16c");
}

namespace {

PyObject* py_supported(PyObject*, PyObject*) { return PyBool_FromLong(cpu_supported()); }

PyMethodDef methods[] = {
    {"supported", py_supported, METH_NOARGS, "Whether this CPU runs the kernels (AVX512-BF16)."},
    {"int4_gemm", py_int4_gemm, METH_VARARGS,
     "int4_gemm(x, rows, in, weight, scales, mins, out_features, out, half_scales[, table]): out = "
     "x @ w.T, addresses of contiguous bf16 x [rows, in], packed weight, scales [out, in / 32], mins "
     "[in / 32, out] or 0 (float16 when half_scales, else float32), bf16 out [rows, out_features]; "
     "with a table (16 bf16 values), w = scale * table[q] + min."},
    {"int4_dequantize", py_int4_dequantize, METH_VARARGS,
     "int4_dequantize(weight, scales, mins, out_features, in, out, half_scales[, table]): the "
     "weight as bf16 [out_features, in]."},
    {"int8_gemm", py_int8_gemm, METH_VARARGS,
     "int8_gemm(x, rows, in, weight, scales, scales_f32, group, mins, out_features, out): out = "
     "x @ w.T for w = scale * q + min in groups of 16 or 32, addresses of contiguous bf16 x "
     "[rows, in], int8 weight [out_features, in], float16 (or float32) scales and float32 mins "
     "(0: none) [out_features, in / group], bf16 out [rows, out_features]."},
    {"int8_dequantize", py_int8_dequantize, METH_VARARGS,
     "int8_dequantize(weight, scales, scales_f32, group, mins, in, ids, num_ids, out): rows ids "
     "(int64; 0: the first num_ids rows) of the weight as bf16 [num_ids, in]."},
    {"decode_attention", py_decode_attention, METH_VARARGS,
     "decode_attention(q, k_cache, v_cache, tables, table_stride, lens, num_seqs, num_heads, "
     "num_kv_heads, head_dim, block_size, scale, window, sinks, out): one query token per "
     "sequence over its paged bf16 K/V (int32 block tables and lengths; window 0: none; sinks "
     "float32 [num_heads] or 0), bf16 out [num_seqs, num_heads, head_dim]."},
    {"f32_supported", py_f32_supported, METH_NOARGS,
     "Whether this CPU runs the float32 kernels (AVX2, FMA and F16C)."},
    {"int4_gemm_f32", py_int4_gemm_f32, METH_VARARGS,
     "int4_gemm_f32(x, rows, in, weight, scales, mins, out_features, out, half_scales[, table]): as "
     "int4_gemm with float32 x [rows, in] and out [rows, out_features] (AVX2)."},
    {"int4_dequantize_f32", py_int4_dequantize_f32, METH_VARARGS,
     "int4_dequantize_f32(weight, scales, mins, out_features, in, out, half_scales[, table]): the weight "
     "as float32 [out_features, in] (AVX2)."},
    {"int8_gemm_f32", py_int8_gemm_f32, METH_VARARGS,
     "int8_gemm_f32(x, rows, in, weight, scales, scales_f32, group, mins, out_features, out): as "
     "int8_gemm with float32 x [rows, in] and out [rows, out_features] (AVX2)."},
    {"decode_attention_f32", py_decode_attention_f32, METH_VARARGS,
     "decode_attention_f32(...): decode_attention's arguments over float32 q, K/V and out (AVX2)."},
    {"rms_norm_f32", py_rms_norm_f32, METH_VARARGS,
     "rms_norm_f32(x, rows, size, weight, eps, out): RMSNorm of contiguous float32 rows with a "
     "float32 weight (AVX2)."},
    {"silu_mul_f32", py_silu_mul_f32, METH_VARARGS,
     "silu_mul_f32(gate_up, rows, size, out): silu(gate) * up of each float32 row [gate | up] "
     "(2 * size) into out [rows, size] (AVX2)."},
    {"decode_layers_f32", py_decode_layers_f32, METH_VARARGS,
     "decode_layers_f32(plan, layers, hidden, rows, hidden_size, heads, kv_heads, head_dim, "
     "intermediate, block_size, table_stride, eps, scale, cos, sin, kv, cache_floats, slots, "
     "tables, lens, norm_scaled_in_float32): every decoder layer of a float32 decode step over int4 or int8 projections "
     "(pdserve.engine.fused_decode), hidden updated in place (AVX2)."},
    {"set_team_threads", py_set_team_threads, METH_VARARGS,
     "set_team_threads(threads, max_rows): how many threads (this one included) share the output "
     "rows of each float32 int4/int8 GEMM of at most max_rows input rows; 1 (the default) runs "
     "every call on its caller's thread."},
    {"team_threads", py_team_threads, METH_NOARGS,
     "The kernel team's (threads, max_rows, parts its threads computed) (set_team_threads)."},
    {"silu_mul", py_silu_mul, METH_VARARGS,
     "silu_mul(gate_up, rows, size, out): silu(gate) * up of each bf16 row [gate | up] (2 * size, "
     "size a multiple of 16) into out [rows, size], torch's two bf16 roundings."},
    {"decode_layers", py_decode_layers, METH_VARARGS,
     "decode_layers(...): decode_layers_f32's arguments over bf16 hidden, cos, sin and K/V, with "
     "the norms' order (scaled in float32, gpt-oss's, or not) last."},
    {"rms_norm", py_rms_norm, METH_VARARGS,
     "rms_norm(x, rows, size, weight, eps, scaled_in_float32, out): RMSNorm of contiguous bf16 "
     "rows with a bf16 weight, in float32, into bf16 out."},
    {"amx_supported", py_amx_supported, METH_NOARGS,
     "Whether this CPU and process run amx_gemm (AMX-TILE, AMX-BF16, the tile data granted)."},
    {"amx_int4_gemm", py_amx_int4_gemm, METH_VARARGS,
     "amx_int4_gemm(x, rows, in, weight, scales, mins, out_features, out, half_scales): out = "
     "x @ w.T as int4_gemm's arguments (no table; out_features a multiple of 32), w dequantized "
     "to bf16 and multiplied on AMX tiles, each element summed in one order whatever the rows "
     "of the call."},
    {nullptr, nullptr, 0, nullptr},
};

PyModuleDef module = {PyModuleDef_HEAD_INIT, "_cpu_kernels",
                      "pdserve's CPU kernels for AVX512-BF16 (pdserve.engine.int4_kernel, "
                      "pdserve.engine.int8_kernel, "
                      "pdserve.engine.cpu_attention)",
                      -1, methods};

}  // namespace
}  // namespace pdserve

PyMODINIT_FUNC PyInit__cpu_kernels(void) { return PyModule_Create(&pdserve::module); }
