"""Tiny random transformers models with telling weights, their logits, and greedy decoding through a backend: what
tools/check_arch and the architecture tests share."""

from __future__ import annotations

import numpy as np
import torch
from transformers import AutoModelForCausalLM, PretrainedConfig

from ir.reference import ReferenceRunner


def random_causal_lm(config: PretrainedConfig, seed: int = 0) -> torch.nn.Module:
    """A random fp32 model whose weights are large enough that attention is far from uniform and the
    logits spread over several units (the default init of std 0.02 gives near-zero logits, where a
    wrong rope or mask would hardly show)."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager", dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            elif name.endswith("bias"):
                p.copy_(0.3 * torch.randn_like(p))
            else:  # a matrix: unit-variance outputs, a bit more for q/k to sharpen attention
                gain = 2.0 if ("q_proj" in name or "k_proj" in name) else 1.0
                p.copy_(gain * torch.randn_like(p) / p.shape[-1] ** 0.5)
    model.generation_config.eos_token_id = None
    model.generation_config.bos_token_id = None
    return model.eval()


def hf_logits(model: torch.nn.Module, ids: list[int]) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float().numpy()


def hf_greedy(model: torch.nn.Module, ids: list[int], n: int) -> list[int]:
    """n greedy tokens from transformers' generate(), EOS ignored (exactly n)."""
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                             max_new_tokens=n, min_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0)
    new = out[0, len(ids):].tolist()
    assert len(new) == n, "transformers stopped early"
    return new


def random_prompt(seed: int, n: int, vocab: int) -> list[int]:
    return np.random.default_rng(seed).integers(0, vocab, n).tolist()


def host(logits) -> np.ndarray:
    """fp32 numpy logits from a backend (numpy for MLX, a device tensor for CUDA)."""
    return logits.float().cpu().numpy() if hasattr(logits, "cpu") else np.array(logits, dtype=np.float32)


def backend_greedy(backend, ref: ReferenceRunner, prompts, n: int, block_size: int, steps: list | None = None):
    """(tokens per prompt, first step's logits [len(prompts), vocab]) of n greedy steps of all prompts together;
    `steps`, when given, gets every step's logits."""
    assert block_size == ref.block_size, "the reference runner's tables are of its own block size"
    pools = len(prompts) * ref.blocks_per_seq
    backend.allocate_kv(pools if ref.num_groups == 1 else [pools] * ref.num_groups, block_size)
    chunks, cached, outs, first = [list(p) for p in prompts], [0] * len(prompts), [[] for _ in prompts], None
    for _ in range(n):
        logits = host(backend.forward(ref.batch(chunks, cached)))
        first = logits.copy() if first is None else first
        if steps is not None:
            steps.append(logits.copy())
        for i, t in enumerate(logits.argmax(-1)):
            outs[i].append(int(t))
            cached[i] += len(chunks[i])
            chunks[i] = [int(t)]
    return outs, first
