"""Tiny random GPTQ, AWQ and compressed-tensors llama checkpoints, packed by the formats' own packers from PyPI
(AutoAWQ's GEMM packer, and its exllama packer, which writes GPTQ's layout; compressed-tensors' pack-quantized
compressor), with the dense fp32 transformers model of exactly the dequantized weights as their reference.

Weights are drawn as integers first (q, zero points and fp16 scales per group), so each checkpoint dequantizes
exactly to its reference model: a wrong group, zero point or nibble order moves a weight by whole quantization steps.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import save_file
from transformers import LlamaConfig

from tools.tiny_hf import random_causal_lm

LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
           "mlp.up_proj", "mlp.down_proj")


@dataclass(frozen=True)
class Case:
    method: str  # "gptq" | "awq" | "compressed-tensors"
    bits: int = 4
    group: int = 32  # -1: a whole row
    sym: bool = True
    desc_act: bool = False
    hidden: int = 64  # 128 for groups of 128
    bf16_scales: bool = False  # compressed-tensors keeps scales in the model's dtype
    gptq_v2: bool = False  # GPTQ's checkpoint_format "gptq_v2": zero points as they are, not minus one


def tiny_config(hidden: int = 64) -> LlamaConfig:
    return LlamaConfig(vocab_size=128, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                       tie_word_embeddings=False, rms_norm_eps=1e-5)


def _draw(w: np.ndarray, case: Case, rng: np.random.Generator):
    """(q [N, K], zeros and fp16-exact scales [groups, N], g_idx [K]) near the dense w [N, K]."""
    n, k = w.shape
    group = k if case.group == -1 else case.group
    groups = k // group
    g_idx = np.arange(k) // group
    if case.desc_act:  # act order: each group a scattered set of inputs
        g_idx = np.empty(k, np.int64)
        g_idx[rng.permutation(k)] = np.arange(k) // group
    top = (1 << case.bits) - 1
    if case.sym:
        zeros = np.full((groups, n), 1 << (case.bits - 1), np.int64)
    else:  # GPTQ v1 stores zero - 1, where a zero point of 0 would wrap its packing: 1..top-1 unless v2
        zeros = rng.integers(0 if case.gptq_v2 else 1, top, (groups, n))
    amax = np.stack([np.abs(w[:, g_idx == g]).max(axis=1) for g in range(groups)])  # [groups, N]
    scales = torch.from_numpy(amax / (1 << (case.bits - 1))).to(torch.bfloat16 if case.bf16_scales else torch.float16)
    scales = scales.float().numpy()
    z_col, s_col = zeros[g_idx].T, scales[g_idx].T  # [N, K]
    q = np.clip(np.rint(w / s_col) + z_col, 0, top).astype(np.int64)
    return q, zeros, scales, g_idx


def dequantized(q, zeros, scales, g_idx) -> np.ndarray:
    return ((q - zeros[g_idx].T) * scales[g_idx].T).astype(np.float32)


def _gptq(q, zeros, scales, g_idx, case):
    from awq.utils.packing_utils import pack_exllama  # GPTQ's (exllama's) layout: weights along K, zeros along N

    stored = zeros if case.gptq_v2 else (zeros - 1) & ((1 << case.bits) - 1)
    qweight, qzeros = pack_exllama(torch.from_numpy(q.T.copy()).int(), torch.from_numpy(stored).int(), case.bits)
    return {"qweight": qweight, "qzeros": qzeros, "scales": torch.from_numpy(scales).half(),
            "g_idx": torch.from_numpy(g_idx).int()}


def _awq(q, zeros, scales, w, case):
    from awq.modules.linear.gemm import WQLinear_GEMM

    lin = torch.nn.Linear(w.shape[1], w.shape[0], bias=False)
    with torch.no_grad():
        lin.weight.copy_(torch.from_numpy(w))
    packed = WQLinear_GEMM.from_linear(lin, case.bits, case.group, scales=torch.from_numpy(scales),
                                       zeros=torch.from_numpy(zeros).float())
    return {"qweight": packed.qweight, "qzeros": packed.qzeros, "scales": packed.scales}


def _ct_scheme(case: Case):
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    strategy = "channel" if case.group == -1 else "group"
    args = QuantizationArgs(num_bits=case.bits, type="int", symmetric=case.sym, strategy=strategy,
                            group_size=None if case.group == -1 else case.group)
    return QuantizationScheme(targets=["Linear"], weights=args)


def _ct(q, zeros, scales, w, case):
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor

    offset = 1 << (case.bits - 1)  # compressed-tensors' integers are signed: q - offset, zero point - offset
    state = {"weight": torch.from_numpy(w), "weight_scale": torch.from_numpy(scales.T.copy())}
    if not case.sym:
        state["weight_zero_point"] = torch.from_numpy((zeros.T - offset).astype(np.int8))
    out = PackedQuantizationCompressor.compress(state, _ct_scheme(case))
    out["weight_scale"] = out["weight_scale"].to(torch.bfloat16 if case.bf16_scales else torch.float16)  # exact
    return out


def _quant_config(case: Case) -> dict:
    if case.method == "gptq":
        return {"quant_method": "gptq", "bits": case.bits, "group_size": case.group, "sym": case.sym,
                "desc_act": case.desc_act, "checkpoint_format": "gptq_v2" if case.gptq_v2 else "gptq"}
    if case.method == "awq":
        return {"quant_method": "awq", "bits": case.bits, "group_size": case.group, "zero_point": True,
                "version": "gemm"}
    from compressed_tensors.quantization import QuantizationConfig

    cfg = QuantizationConfig(config_groups={"group_0": _ct_scheme(case)}, format="pack-quantized",
                             quantization_status="compressed", ignore=["lm_head"])
    return json.loads(cfg.model_dump_json())


def write_quantized(folder: Path, hidden: int, seed: int, quantize, quant_config: dict, targets=LINEARS):
    """A tiny llama in `folder` with each weight w of `targets` (by name suffix; the linears) replaced by the tensors
    of quantize(name prefix, w) -> (tensors by suffix, dequantized w), and `quant_config` in its config.json; returns
    the dense transformers model of the dequantized weights."""
    model = random_causal_lm(tiny_config(hidden), seed)
    tensors = {}
    for name, p in model.state_dict().items():
        prefix = name.removesuffix(".weight")
        if not any(prefix.endswith(lin) for lin in targets):
            tensors[name] = p.contiguous()
            continue
        parts, wd = quantize(prefix, p.detach().clone())
        with torch.no_grad():
            p.copy_(wd)
        tensors.update({f"{prefix}.{k}": v.contiguous() for k, v in parts.items()})
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "model.safetensors"))
    cfg = model.config.to_dict()
    cfg["quantization_config"] = quant_config
    (folder / "config.json").write_text(json.dumps(cfg))
    return model


def check_interpreter(folder: Path, dense, prompt: list[int]) -> None:
    """The interpreter on the checkpoint in `folder` against `dense` (transformers) on `prompt`, logits to 1e-4."""
    from tiny_hf import assert_close, hf_logits

    from ir.loader import load_model
    from ir.reference import ReferenceRunner

    runner = ReferenceRunner(load_model(folder, progress=False), max_tokens=64)
    assert_close(runner.prompt_logits(prompt), hf_logits(dense, prompt))


def with_quant_config(folder: Path, out: Path, quant_config: dict) -> Path:
    """`out` as `folder`'s checkpoint (its weights linked) under another quantization_config."""
    cfg = json.loads((folder / "config.json").read_text())
    cfg["quantization_config"] = quant_config
    (out / "config.json").write_text(json.dumps(cfg))
    (out / "model.safetensors").symlink_to(folder / "model.safetensors")
    return out


def checkpoint_cache(tmp_path_factory, cases: dict, write, packer):
    """For a module fixture: case name -> (dense reference, folder), each written once by write(folder, case);
    packer(case) names the module the case's packer needs (skipped without it), or None."""
    cache = {}

    def get(name: str):
        if name not in cache:
            if (module := packer(cases[name])) is not None:
                pytest.importorskip(module)
            folder = tmp_path_factory.mktemp(name)
            cache[name] = (write(folder, cases[name]), folder)
        return cache[name]

    return get


def write_checkpoint(folder: Path, case: Case, seed: int = 0):
    """The quantized checkpoint in `folder`; returns the dense transformers model of its dequantized weights."""
    if case.method == "awq" and (case.desc_act or case.bits != 4):
        raise ValueError("AWQ GEMM is 4-bit, without act order")
    rng = np.random.default_rng(seed)

    def quantize(prefix, p):
        w = p.numpy()
        q, zeros, scales, g_idx = _draw(w, case, rng)
        wd = dequantized(q, zeros, scales, g_idx)
        if case.method == "gptq":
            parts = _gptq(q, zeros, scales, g_idx, case)
        elif case.method == "awq":
            parts = _awq(q, zeros, scales, wd, case)
        else:
            parts = _ct(q, zeros, scales, wd, case)
        return parts, torch.from_numpy(wd)

    return write_quantized(folder, case.hidden, seed, quantize, _quant_config(case))
