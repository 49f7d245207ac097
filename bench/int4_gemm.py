"""Time of pdserve's int4 GEMM alone (``shared/csrc/int4_gemm.cpp``) on the default model's
projections, a few rows, with an optional A/B against another build of the extension.

    python bench/int4_gemm.py                                  # the installed kernel
    python bench/int4_gemm.py --baseline /tmp/old/_cpu_kernels.cpython-311-x86_64-linux-gnu.so

SmolLM2-135M's projections as the engine fuses them (q/k/v 576 -> 960, o 576 -> 576, gate/up
576 -> 3072, down 1536 -> 576), random int4 weights with float16 scales and mins (Q4_1's), one
distinct weight per layer and projection (30 layers: 53 MB, past the caches, so each call reads
its weight from memory as a decode step does). A pass calls them in a step's order, layer after
layer; each round runs a pass per kernel, the kernels' order alternating. Each call is timed
alone (wall clock, the extension's function called directly with a preallocated output);
medians over layers and rounds. With `--baseline` the outputs of both builds are compared bit
for bit first.
"""

from __future__ import annotations

import argparse
import importlib.machinery
import importlib.util
import statistics
import time
from types import ModuleType
from typing import Any

import torch
from common import cpu_description, write_results

from pdserve.engine import cpu_kernels, int4_kernel

SHAPES = {"qkv": (576, 960), "o": (576, 576), "gate_up": (576, 3072), "down": (1536, 576)}
"""Projection: (in_features, out_features), the default model's, fused as the engine runs them."""


def load_build(path: str, index: int) -> ModuleType:
    """Another build of ``pdserve.engine._cpu_kernels`` from `path`, as its own module."""
    name = f"build{index}._cpu_kernels"
    loader = importlib.machinery.ExtensionFileLoader(name, path)
    spec = importlib.util.spec_from_file_location(name, path, loader=loader)
    assert spec is not None
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


def weights(layers: int) -> list[dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]]:
    """Per layer, each projection's (packed, scales [out, G], mins [G, out]) float16."""
    generator = torch.Generator().manual_seed(0)
    result = []
    for _ in range(layers):
        layer = {}
        for name, (num_in, num_out) in SHAPES.items():
            q = torch.randint(0, 16, (num_out, num_in), generator=generator, dtype=torch.uint8)
            groups = (num_out, num_in // 32)
            scales = (torch.rand(groups, generator=generator) * 0.02 + 1e-3).half()
            mins = (-8 * scales.float() + torch.randn(groups, generator=generator) * 1e-3).half()
            layer[name] = (int4_kernel.pack(q), scales.contiguous(), mins.t().contiguous())
        result.append(layer)
    return result


def call(
    module: ModuleType, x: torch.Tensor, weight: tuple[torch.Tensor, ...], out: torch.Tensor
) -> None:
    packed, scales, mins = weight
    module.int4_gemm(
        x.data_ptr(),
        x.shape[0],
        x.shape[1],
        packed.data_ptr(),
        scales.data_ptr(),
        mins.data_ptr(),
        out.shape[1],
        out.data_ptr(),
        True,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--baseline",
        action="append",
        default=[],
        help="another build of the extension (.so) to compare, as NAME=PATH or PATH (repeatable)",
    )
    parser.add_argument("--rows", default="1", help="comma-separated row counts")
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--rounds", type=int, default=15)
    args = parser.parse_args()
    torch.set_num_threads(1)
    cpu = cpu_description()
    print(f"CPU: {cpu['cpu']}; flags: {' '.join(cpu['flags'])}")
    builds: dict[str, ModuleType] = {}
    for index, value in enumerate(args.baseline):
        name, _, path = value.rpartition("=")
        builds[name or f"baseline{index or ''}"] = load_build(path, index)
    builds["current"] = cpu_kernels.compiled()
    layers = weights(args.layers)
    generator = torch.Generator().manual_seed(1)
    results: dict[str, Any] = {}
    for rows in [int(value) for value in args.rows.split(",")]:
        xs = {
            name: torch.randn(rows, num_in, generator=generator).to(torch.bfloat16)
            for name, (num_in, _) in SHAPES.items()
        }
        outs = {
            build: {
                name: torch.empty(rows, num_out, dtype=torch.bfloat16)
                for name, (_, num_out) in SHAPES.items()
            }
            for build in builds
        }
        if len(builds) > 1:
            for layer in layers[:2]:
                for name in SHAPES:
                    for build, module in builds.items():
                        call(module, xs[name], layer[name], outs[build][name])
                    first = outs["current"][name].view(torch.int16)
                    for build in builds:
                        assert torch.equal(outs[build][name].view(torch.int16), first), build
            print(f"rows {rows}: every build gives the same bits")
        calls: dict[str, dict[str, list[float]]] = {
            build: {name: [] for name in SHAPES} for build in builds
        }
        passes: dict[str, list[float]] = {build: [] for build in builds}
        order = list(builds)
        for round_index in range(args.rounds + 1):
            # each round starts from another build
            shift = round_index % len(order)
            for build in order[shift:] + order[:shift]:
                module, total = builds[build], 0
                for layer in layers:
                    for name in SHAPES:
                        start = time.perf_counter_ns()
                        call(module, xs[name], layer[name], outs[build][name])
                        elapsed = time.perf_counter_ns() - start
                        total += elapsed
                        if round_index:  # the first round warms up
                            calls[build][name].append(elapsed / 1e3)
                if round_index:
                    passes[build].append(total / 1e6)
        print(f"\n{rows} row(s), median us a call ({args.rounds} rounds x {args.layers} layers)\n")
        print("| build | " + " | ".join(SHAPES) + " | pass of all layers (ms) |")
        print("|---|" + "---:|" * (len(SHAPES) + 1))
        medians: dict[str, dict[str, float]] = {}
        for build in builds:
            medians[build] = {name: statistics.median(v) for name, v in calls[build].items()}
            medians[build]["pass_ms"] = statistics.median(passes[build])
            cells = " | ".join(f"{medians[build][name]:.1f}" for name in SHAPES)
            print(f"| {build} | {cells} | {medians[build]['pass_ms']:.3f} |")
        results[str(rows)] = medians
    path = write_results("int4_gemm", {"config": {**vars(args), **cpu}, "medians": results})
    print(f"\nresults: {path}")


if __name__ == "__main__":
    main()
