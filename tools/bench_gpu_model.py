"""tools/bench_gpu's synthetic models: the shapes (Llama-3-8B and -70B, or a checkpoint's config.json read by its
architecture's config class), the graph, random weights made on the GPU (bf16: the backend's own, backends/cuda/
synthetic, each tensor-parallel rank its slice; GGUF Q4_K/Q6_K blocks laid out as Q4_K_M, int4, fp8 here), and the
bytes a decode step must read (a MoE's routed experts only)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch

from ir.config import ModelConfig
from ir.rope import RopeSpec

LLAMA3 = dict(vocab_size=128256, head_dim=128, num_kv_heads=8, rms_norm_eps=1e-5, max_position_embeddings=8192)
LLAMA3_SHAPES = {  # Meta's config.json: Llama-3-8B (16 GB in bf16), Llama-3-70B (141 GB: no single H200 holds it)
    "llama3-8b": dict(hidden_size=4096, intermediate_size=14336, num_heads=32, num_layers=32),
    "llama3-70b": dict(hidden_size=8192, intermediate_size=28672, num_heads=64, num_layers=80),
}

# Other shapes, from their checkpoints' config.json (tests/data/hf_configs), read by their architecture's config
# class: the check that a new architecture decodes at the same fraction of the roofline as llama's.
SHAPES = {"llama3-8b": None, "llama3-70b": None, "gemma2-9b": "gemma-2-9b-it.json",
          "phi3-mini": "phi-3-mini-4k-instruct.json", "qwen3-30b-a3b": "qwen3-30b-a3b.json"}
CONFIGS = Path(__file__).resolve().parents[1] / "tests" / "data" / "hf_configs"


def model_config(layers: int | None, shape: str = "llama3-8b") -> ModelConfig:
    if shape in LLAMA3_SHAPES:
        dims = {**LLAMA3, **LLAMA3_SHAPES[shape]}
        dims["num_layers"] = layers or dims["num_layers"]
        return ModelConfig(arch="llama", rope=RopeSpec(theta=500000.0, rotary_dim=128), **dims)
    from ir.models import for_hf

    hf = json.loads((CONFIGS / SHAPES[shape]).read_text())
    cfg = for_hf(hf["model_type"]).config_from_hf(hf)
    return cfg.with_(num_layers=layers) if layers else cfg


def loaded_model(cfg: ModelConfig):
    from ir.loader import synthetic_model

    return synthetic_model(cfg)


def meta_params(graph) -> dict:
    """The graph's parameters as bf16 tensors with no storage (device "meta"): their bytes, for active_bytes."""
    return {name: torch.empty(p.shape, dtype=torch.bfloat16, device="meta") for name, p in graph.params.items()}


def active_bytes(graph, params, tokens: int = 1) -> int:
    """The bytes a decode step of `tokens` tokens reads at least: every parameter, but of an expert stack only the
    experts a random routing picks (expected distinct ones: top_k of E for one token)."""
    from backends.cuda.weights import nbytes
    from tools.moe_bytes import expert_share

    top_k = {v.name: n.inputs[2].shape[1] for n in graph.nodes if n.op == "moe_experts" for v in n.inputs[3:]}
    total = 0
    for name, p in params.items():
        share = 1.0
        if name in top_k:
            share = expert_share(top_k[name], graph.params[name].shape[0], tokens)
        total += int(nbytes(p) * share)
    return total


def dense_params(graph) -> dict:
    gen = torch.Generator(device="cuda").manual_seed(0)
    out = {}
    for name, p in graph.params.items():
        if len(p.shape) == 1:
            out[name] = torch.ones(p.shape, dtype=torch.bfloat16, device="cuda")
        else:
            out[name] = torch.randn(p.shape, dtype=torch.bfloat16, device="cuda", generator=gen) * 0.02
    return out


def more_bits_layer(i: int, n: int) -> bool:
    """llama.cpp's Q4_K_M gives attn_v and ffn_down Q6_K in these layers ("use_more_bits")."""
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def random_blocks(rows: int, cols: int, qtype: str, gen) -> torch.Tensor:
    """Random but valid GGUF blocks [rows, row_bytes]: random quants, small finite fp16 scales."""
    from ir.formats.gguf_quants import row_bytes

    per, size, scale_at = {"Q4_K": (256, 144, (0, 2)), "Q6_K": (256, 210, (208,))}[qtype]
    blocks = torch.randint(0, 256, (rows, cols // per, size), dtype=torch.uint8, device="cuda", generator=gen)
    for off in scale_at:
        d = (torch.rand((rows, cols // per), device="cuda", generator=gen) * 1e-3 + 1e-4).half()
        blocks[:, :, off:off + 2] = d.view(torch.uint8).reshape(rows, cols // per, 2)
    assert blocks.shape[1] * size == row_bytes(qtype, cols)
    return blocks.reshape(rows, -1)


def _quantized(graph, device: str, keep, quantize) -> dict:
    """Every parameter through quantize(name, shape, generator) -> QuantWeight, but those keep(name, shape) leaves
    16-bit (ones in bf16: norms and what a checkpoint of that format stores unquantized)."""
    gen = torch.Generator(device=device).manual_seed(0)
    return {name: torch.ones(p.shape, dtype=torch.bfloat16, device=device) if keep(name, p.shape)
            else quantize(name, p.shape, gen) for name, p in graph.params.items()}


def q4_k_m_params(graph, layers: int) -> dict:
    from backends.cuda.weights import QuantWeight

    def quantize(name, shape, gen):
        parts = name.split(".")
        more = parts[-1] in ("wv", "w_down", "exp_down") and more_bits_layer(int(parts[1]), layers)
        six = name == "lm_head" or more
        q = "Q6_K" if six else "Q4_K"
        rows = math.prod(shape[:-1])  # an expert stack [E, out, in] is E * out rows of blocks
        return QuantWeight(random_blocks(rows, shape[-1], q, gen), q, shape)

    return _quantized(graph, "cuda", lambda name, shape: len(shape) == 1, quantize)


def int4_params(graph, group: int = 128, device: str = "cuda") -> dict:
    """Every matrix as 4-bit integer groups (GPTQ/AWQ's layout once read: ir/formats/int_groups.py): random nibbles,
    a small f32 scale and bias a group, so that the logits stay finite; vectors bf16."""
    from backends.cuda.weights import QuantWeight
    from ir.formats import int_groups

    def quantize(name, shape, gen):
        rows, cols = math.prod(shape[:-1]), shape[-1]
        size = int_groups.block_bytes(4, group)
        blocks = torch.randint(0, 256, (rows, cols // group, size), dtype=torch.uint8, device=device, generator=gen)
        head = torch.rand((rows, cols // group, 2), device=device, generator=gen) * 1e-3
        blocks[:, :, :int_groups.HEADER_BYTES] = head.view(torch.uint8).reshape(rows, cols // group, -1)
        return QuantWeight(blocks.reshape(rows, -1), int_groups.kind_name(4, group), shape)

    # a GPTQ checkpoint's embedding stays 16-bit
    return _quantized(graph, device, lambda name, shape: len(shape) == 1 or name == "embed", quantize)


def fp8_params(graph, group: int = 128, device: str = "cuda") -> dict:
    """Every 2-D matrix as e4m3 bytes with an f32 scale a group of a row, the same over each 128 rows where they
    divide (what DeepSeek-V3 / Qwen3-FP8's 128 x 128 blocks load as, with their block scales); random finite codes
    (the exponent's top bit kept clear: never the NaN code); stacks and vectors bf16."""
    from backends.cuda.fp8_linear import BLOCK
    from backends.cuda.weights import QuantWeight
    from ir.formats import fp8_blocks

    def quantize(name, shape, gen):
        rows, cols = shape
        codes = torch.randint(0, 256, (rows, cols), dtype=torch.uint8, device=device, generator=gen) & 0xBF
        blocked = group == BLOCK and rows % BLOCK == 0
        blocks = torch.rand((-(-rows // BLOCK), cols // group), device=device, generator=gen) * 1e-3
        scales = blocks.repeat_interleave(BLOCK, dim=0)[:rows].contiguous()
        return QuantWeight(codes, fp8_blocks.kind_name(group), shape, scales=scales, blocks=blocks if blocked else None)

    # the FP8 checkpoints' embeddings stay 16-bit
    return _quantized(graph, device, lambda name, shape: len(shape) != 2 or name == "embed", quantize)


def quant_params(kind: str, graph, layers: int) -> dict:
    """bench_gpu --quant's variants: q4km, int4 or fp8."""
    makers = {"q4km": lambda: q4_k_m_params(graph, layers), "int4": lambda: int4_params(graph),
              "fp8": lambda: fp8_params(graph)}
    if kind not in makers:
        raise SystemExit(f"--quant {kind}: known variants are {', '.join(makers)}")
    return makers[kind]()
