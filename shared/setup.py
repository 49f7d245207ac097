"""The one compiled part of pdserve-shared: the int4 CPU kernel (`pdserve.engine.int4_kernel`).

Optional: where no C++ compiler is found, the package installs without it and the engine runs
torch's int4 kernel instead.
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "pdserve.engine._int4_cpu",
            sources=["csrc/int4_cpu.cpp"],
            extra_compile_args=["-O3", "-std=c++17"],
            language="c++",
            optional=True,
        )
    ]
)
