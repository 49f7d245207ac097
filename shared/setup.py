"""The one compiled part of pdserve-shared: pdserve's CPU kernels for AVX512-BF16 (the int4
GEMM of `pdserve.engine.int4_kernel`, the int8 one of `pdserve.engine.int8_kernel`, the decode
attention of `pdserve.engine.cpu_attention`).

Optional: where no C++ compiler is found, the package installs without it and the engine runs
torch's kernels instead. ``PDSERVE_CPU_KERNELS=0`` leaves it out on purpose: a pure wheel that
installs on any Python and machine (the GPU kit's: `tools/gpu_kit.py`).
"""

import os

from setuptools import Extension, setup

WITH_KERNELS = os.environ.get("PDSERVE_CPU_KERNELS", "1") != "0"

setup(
    ext_modules=[
        Extension(
            "pdserve.engine._cpu_kernels",
            sources=[
                "csrc/module.cpp",
                "csrc/int4_gemm.cpp",
                "csrc/int8_gemm.cpp",
                "csrc/decode_attention.cpp",
                "csrc/rms_norm.cpp",
                "csrc/f32_gemm.cpp",
                "csrc/fused_decode.cpp",
                "csrc/team.cpp",
                "csrc/amx_gemm.cpp",
            ],
            depends=["csrc/common.h"],
            extra_compile_args=["-O3", "-std=c++17", "-pthread"],
            extra_link_args=["-pthread"],
            language="c++",
            optional=True,
        )
    ]
    if WITH_KERNELS
    else []
)
