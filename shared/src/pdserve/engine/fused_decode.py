"""A decode step's decoder layers in one compiled call (``shared/csrc/fused_decode.cpp``), in
bfloat16 (AVX512-BF16) or float32 (AVX2).

``--dtype auto`` serves a GGUF's own int4 and int8 weights (`pdserve.engine.int4_kernel`,
`pdserve.engine.int8_kernel`) with bf16 activations on a CPU with native bf16, float32 ones
elsewhere. A one-row step of the default model runs 120 int4 GEMMs, 30 attentions and 61 norms;
layer by layer, Python and small tensor ops between them (module calls, RoPE's six ops, two
cache writes, SwiGLU, residual adds, each kernel's wrapper) took about 20 ms beside 24 ms of
float32 kernels, and about 4 ms beside 5 ms of bf16 ones. Here one call runs every
layer: the same kernels in the same order on the same rows, RoPE, the cache writes, SwiGLU and
the residual adds in C++, so a step's hidden states are the layer-by-layer path's bit for bit
(in bf16, RoPE's products and sums and the residual adds each rounded to bf16 as torch's bf16
ops round them; the layer-by-layer path's SwiGLU runs on `silu_mul`, the same arithmetic). A
step of more than
`CHUNK_ROWS` decodes runs as calls of that many (its rows do not depend on each other): the
bits of the layer-by-layer path given that many rows at a time, where it would otherwise take
a GEMM over every weight dequantized for the step.

It takes a model whose every layer is Llama's shape (`FusedDecode.why_not` says what it needs:
int4 or int8-group projections on pdserve's kernels without bias (a GGUF's Q4_0 / Q4_1 / Q4_K
and Q8_0 / Q6_K / Q5_K, mixed as a Q4_K_M file mixes them), RMSNorm, SiLU, RoPE over whole
heads, no windows, sinks, q/k norms or experts, one rank) and a step of decodes with nothing
else (no prefill, no per-layer callback, no graph padding), in the model's dtype (bfloat16 or
float32, where the CPU runs that set of kernels), one torch thread. Any other model or step
runs layer by layer as before.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import structlog
import torch

import pdserve.engine.cpu_kernels as cpu_kernels
from pdserve.engine.attention import SdpaAttention
from pdserve.engine.decoder import LlamaAttention, LlamaDecoderLayer, LlamaMLP
from pdserve.engine.layers import RMSNorm
from pdserve.engine.quant import OWN_KERNEL_MAX_ROWS, Int4Linear, Int8GroupLinear

if TYPE_CHECKING:
    from pdserve.engine.attention_metadata import AttentionMetadata
    from pdserve.engine.kv_cache import KVCache

log = structlog.get_logger(__name__)

PROJECTION_FIELDS = 6
"""int64 fields a projection takes in the plan (`projection_fields`)."""
LAYER_FIELDS = 2 + 4 * PROJECTION_FIELDS
"""int64 fields a layer takes in the plan: the two norms' weights, then each projection's (qkv,
o, gate_up, down)."""

CHUNK_ROWS = OWN_KERNEL_MAX_ROWS
"""Decodes one compiled call takes: the most rows the int4 and int8 kernels multiply directly
(each row alone, so a row's bits do not depend on the others). A step of more decodes runs as
calls of this many: its rows are independent of each other, and the layer-by-layer path would
take a GEMM over every weight dequantized for the step instead."""


INSTRUCTIONS = {torch.bfloat16: "AVX512-BF16", torch.float32: "AVX2, FMA, F16C"}
"""What each dtype's fused step runs on."""


class FusedDecode:
    """A model's decoder layers as one plan for ``decode_layers`` (bfloat16) or
    ``decode_layers_f32`` (build with `for_model`).

    Attributes:
        plan: ``[num_layers, LAYER_FIELDS]`` int64 addresses and flags; the tensors they point
            into are the model's own (the plan holds no copy, and the model must outlive it).
        dtype: The activations' (and norms', and cache's) dtype.
    """

    def __init__(self, model: Any) -> None:
        config = model.config
        layers = list(model.model.layers)
        first = layers[0]
        self.num_layers = len(layers)
        self.hidden_size = config.hidden_size
        self.num_heads = first.self_attn.num_heads
        self.num_kv_heads = first.self_attn.num_kv_heads
        self.head_dim = first.self_attn.head_dim
        self.intermediate_size = first.mlp.intermediate_size
        self.eps = float(first.input_layernorm.eps)
        self.scale = float(first.self_attn.attn.scale)
        self.dtype = first.input_layernorm.weight.dtype
        self.norm_scaled_in_float32 = bool(first.input_layernorm.is_scaled_in_float32)
        rows = []
        for layer in layers:
            row = [
                layer.input_layernorm.weight.data_ptr(),
                layer.post_attention_layernorm.weight.data_ptr(),
            ]
            for linear in (
                layer.self_attn.qkv_proj,
                layer.self_attn.o_proj,
                layer.mlp.gate_up_proj,
                layer.mlp.down_proj,
            ):
                row += projection_fields(linear)
            rows.append(row)
        self.plan = torch.tensor(rows, dtype=torch.int64)

    @classmethod
    def for_model(cls, model: Any) -> FusedDecode | None:
        """The model's plan, or None (logged once with the reason) where its layers do not
        fuse."""
        reason = cls.why_not(model)
        if reason is not None:
            log.info("fused_decode", enabled=False, reason=reason)
            return None
        fused = cls(model)
        log.info(
            "fused_decode",
            enabled=True,
            num_layers=fused.num_layers,
            chunk_rows=CHUNK_ROWS,
            dtype=str(fused.dtype).removeprefix("torch."),
            instructions=INSTRUCTIONS[fused.dtype],
        )
        return fused

    @staticmethod
    def why_not(model: Any) -> str | None:
        """Why `model`'s layers do not fuse (None where they do)."""
        config = model.config
        dtype = _norm_dtype(model)
        if dtype is None:
            return "not Llama's layer (no RMSNorm before attention)"
        if dtype not in INSTRUCTIONS:
            return f"norms in {dtype} (needs bfloat16 or float32)"
        unavailable = cpu_kernels.why_unavailable(dtype)
        if unavailable is not None:
            return unavailable
        if model.group.world_size > 1:
            return "tensor parallelism"
        family = _family_reason(config, model)
        if family is not None:
            return family
        shapes = set()
        for index, layer in enumerate(model.model.layers):
            reason = _layer_reason(layer, dtype)
            if reason is not None:
                return f"layer {index}: {reason}"
            attn, mlp = layer.self_attn, layer.mlp
            shapes.add(
                (
                    attn.num_heads,
                    attn.num_kv_heads,
                    attn.head_dim,
                    mlp.intermediate_size,
                    float(layer.input_layernorm.eps),
                    float(layer.post_attention_layernorm.eps),
                    float(attn.attn.scale),
                    bool(layer.input_layernorm.is_scaled_in_float32),
                    bool(layer.post_attention_layernorm.is_scaled_in_float32),
                )
            )
        if len(shapes) != 1:
            return "layers of different shapes"
        num_heads, num_kv_heads, head_dim, intermediate, eps, post_eps, _, scaled, post_scaled = (
            shapes.pop()
        )
        if eps != post_eps or scaled != post_scaled:
            return "norms with different eps or order"
        group = num_heads // num_kv_heads if num_kv_heads else 0
        if not 1 <= group <= 8 or group * num_kv_heads != num_heads:
            return "needs 1-8 query heads per KV head"
        if head_dim % 32 or head_dim > 256:
            return f"head_dim {head_dim} (needs a multiple of 32 up to 256)"
        if config.hidden_size % 64 or intermediate % 64:
            return "hidden and intermediate sizes must be multiples of 64"
        return None

    def takes(self, hidden: torch.Tensor, kv_cache: KVCache, metadata: AttentionMetadata) -> bool:
        """Whether this step fuses: decodes and nothing else in the model's dtype, over a cache
        of that dtype holding every layer in one contiguous tensor, on one torch thread."""
        rows = hidden.shape[0]
        kv = kv_cache.kv
        return (
            rows >= 1
            and hidden.dtype == self.dtype
            and metadata.num_decodes == rows
            and not metadata.prefills
            and not metadata.is_static
            and metadata.write_rows is None
            and kv_cache.window_slots is None
            and kv.dtype == self.dtype
            and kv.device.type == "cpu"
            and kv.is_contiguous()
            and kv.shape[0] == self.num_layers
            and kv.shape[-2:] == (self.num_kv_heads, self.head_dim)
            and torch.get_num_threads() == 1
        )

    def run(
        self,
        hidden: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        kv_cache: KVCache,
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        """Every layer for the step (`takes`), `CHUNK_ROWS` decodes a call: the hidden states
        after the last layer (``[rows, hidden_size]``), each layer's K/V written into the
        cache."""
        rows = hidden.shape[0]
        hidden = hidden.contiguous().clone()
        cos, sin = (table.reshape(rows, self.head_dim).contiguous() for table in rope)
        slots = metadata.slot_mapping.to(torch.int64).contiguous()
        tables, lens = metadata.decode_tables()
        kv = kv_cache.kv
        decode_layers = cpu_kernels.kernel("decode_layers", self.dtype)
        for start in range(0, rows, CHUNK_ROWS):
            stop = min(start + CHUNK_ROWS, rows)
            decode_layers(
                self.plan.data_ptr(),
                self.num_layers,
                hidden[start:stop].data_ptr(),
                stop - start,
                self.hidden_size,
                self.num_heads,
                self.num_kv_heads,
                self.head_dim,
                self.intermediate_size,
                kv.shape[3],
                tables.shape[1],
                self.eps,
                self.scale,
                cos[start:stop].data_ptr(),
                sin[start:stop].data_ptr(),
                kv.data_ptr(),
                kv[0, 0].numel(),
                slots[start:stop].data_ptr(),
                tables[start:stop].data_ptr(),
                lens[start:stop].data_ptr(),
                self.norm_scaled_in_float32,
            )
        return hidden


def projection_fields(linear: Int4Linear | Int8GroupLinear) -> list[int]:
    """A projection's `PROJECTION_FIELDS` in the plan: kind (0 int4, 1 int8 groups), weight,
    scales and mins addresses (int8: 0 without mins), a flag (int4: float16 scales; int8:
    float32 scales) and the int8 group size (its kernel's arguments, `int4_kernel.matmul` and
    `int8_kernel.matmul`)."""
    if isinstance(linear, Int4Linear):
        assert linear.scales is not None and linear.mins is not None
        half = int(linear.scales.dtype == torch.float16)
        return [
            0,
            linear.packed.data_ptr(),
            linear.scales.data_ptr(),
            linear.mins.data_ptr(),
            half,
            0,
        ]
    mins = 0 if linear.mins is None else linear.mins.data_ptr()
    is_f32 = int(linear.scales.dtype == torch.float32)
    return [1, linear.values.data_ptr(), linear.scales.data_ptr(), mins, is_f32, linear.group_size]


def _family_reason(config: Any, model: Any) -> str | None:
    checks = (
        (config.mla is not None, "latent attention (MLA)"),
        (config.moe is not None, "mixture of experts"),
        (config.gemma_norms, "Gemma's norms"),
        (config.qk_norm, "q/k norms"),
        (config.is_rope_interleaved, "interleaved RoPE"),
        (config.has_attention_sinks, "attention sinks"),
        (config.hidden_act != "silu", f"activation {config.hidden_act}"),
        (model.local_rotary is not None, "a second RoPE for local layers"),
        (
            (config.rotary_dim or config.head_dim) != config.head_dim,
            "RoPE over part of each head",
        ),
        (
            any(
                config.sliding_window(i) is not None or not config.is_rope_layer(i)
                for i in range(config.num_hidden_layers)
            ),
            "sliding-window or RoPE-less layers",
        ),
    )
    return next((reason for failed, reason in checks if failed), None)


def _norm_dtype(model: Any) -> torch.dtype | None:
    norm = getattr(model.model.layers[0], "input_layernorm", None)
    return norm.weight.dtype if isinstance(norm, RMSNorm) else None


def _layer_reason(layer: Any, dtype: torch.dtype) -> str | None:
    attn, mlp = layer.self_attn, layer.mlp
    if (
        type(layer) is not LlamaDecoderLayer
        or type(attn) is not LlamaAttention
        or type(mlp) is not LlamaMLP
    ):
        return "not Llama's layer, attention and MLP"
    if type(attn.attn) is not SdpaAttention or not attn.attn.cpu_kernel:
        return f"attention {type(attn.attn).__name__} (needs the CPU kernel's SDPA path)"
    if attn.q_norm is not None or attn.sinks is not None or attn.attn.sliding_window is not None:
        return "q/k norms, sinks or a window"
    for norm in (layer.input_layernorm, layer.post_attention_layernorm):
        if type(norm) is not RMSNorm or norm.weight.dtype != dtype:
            return f"a norm other than RMSNorm in {dtype}"
    for name, linear in (
        ("qkv_proj", attn.qkv_proj),
        ("o_proj", attn.o_proj),
        ("gate_up_proj", mlp.gate_up_proj),
        ("down_proj", mlp.down_proj),
    ):
        if not isinstance(linear, (Int4Linear, Int8GroupLinear)) or linear.kernel != "pdserve":
            return f"{name} is {type(linear).__name__}, not int4 or int8 on pdserve's kernels"
        if linear.bias is not None or linear.min_rows != 1:
            return f"{name} has a bias or runs batch-invariant (--deterministic)"
    return None
