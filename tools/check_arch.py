"""Our IR against transformers on a tiny random model of any architecture: builds the model with transformers from
a `model_type`, a config.json (or its folder) or a hub id in the local cache, shrunk to a few layers of width 64,
saves it with save_pretrained, loads it through ir.loader and compares, for each prompt, the prompt's logits and
greedy tokens on every engine asked for (the numpy interpreter on the plain graph and on ir.fusion's, the MLX
backend, the CUDA backend on CPU tensors or a GPU; tpN: ir.sharding's N ranks on the interpreter). Prints a table of
logit error and token agreement per prompt; exits 1 if any row fails.

    python -m tools.check_arch llama
    python -m tools.check_arch path/to/config.json --engines interp,mlx,cuda --new 16
    python -m tools.check_arch --all             (every model_type the registry knows, interpreters only)
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

# The shrunken shape: wide enough for 4 query and 2 KV heads of 16, a window shorter than the longest prompt.
TINY = dict(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=256, bos_token_id=None, eos_token_id=None,
            pad_token_id=None)
WINDOW = 8
# Experts at TINY's width: enough of them, top_k of them, that routing chooses; the expert counts keep their key.
TINY_MOE = dict(num_local_experts=8, num_experts=8, n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                shared_expert_intermediate_size=48, n_group=4, topk_group=2, first_k_dense_replace=1)
# Latent attention (DeepSeek's MLA) at that width: every head its own key (MLA has no KV groups), rope on 8 dims.
TINY_MLA = dict(q_lora_rank=48, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16)
PROMPT_LENS = (5, 19, 33)
RTOL = 1e-4  # of max |logit|: fp32 on both sides


@dataclass
class Row:
    engine: str
    prompt_len: int
    rel_err: float
    tokens_equal: int
    tokens: int
    error: str = ""

    @property
    def ok(self) -> bool:
        return not self.error and self.rel_err <= RTOL and self.tokens_equal == self.tokens


def hf_config(spec: str, layers: int):
    """A transformers config for `spec` (model_type, config.json or its folder, or a cached hub id), shrunk."""
    from transformers import AutoConfig

    path = Path(spec)
    if path.is_file():
        cfg = AutoConfig.for_model(**json.loads(path.read_text()))
    elif path.is_dir() or "/" in spec:
        cfg = AutoConfig.from_pretrained(spec, local_files_only=True)
    else:
        cfg = AutoConfig.for_model(spec)
    text = getattr(cfg, "text_config", None)
    return shrink(text if text is not None and not hasattr(cfg, "num_hidden_layers") else cfg, layers)


def shrink(cfg, layers: int):
    """The same architecture and features at TINY's sizes: every size key the config has is overwritten; layer
    patterns (layer_types) keep their order, cut or cycled to the new depth; a window becomes WINDOW."""
    for key, value in TINY.items():
        if hasattr(cfg, key) or key in ("num_key_value_heads", "head_dim"):
            setattr(cfg, key, value)
    for key, value in (TINY_MOE | TINY_MLA).items():
        if getattr(cfg, key, None):
            setattr(cfg, key, value)
    if any(getattr(cfg, k, None) for k in ("num_local_experts", "num_experts", "n_routed_experts")):
        cfg.num_experts_per_tok = TINY_MOE["num_experts_per_tok"]  # DeepSeek-V2's default is None
    if getattr(cfg, "kv_lora_rank", None):
        cfg.num_key_value_heads = cfg.num_attention_heads
        cfg.head_dim = cfg.qk_rope_head_dim  # what transformers sizes the rope by
        cfg.qk_head_dim = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
    cfg.num_hidden_layers = layers
    types = getattr(cfg, "layer_types", None)
    if types:
        cfg.layer_types = [types[i % len(types)] for i in range(layers)]
    if getattr(cfg, "sliding_window", None):
        cfg.sliding_window = WINDOW
    for key in ("rope_scaling", "rope_parameters"):  # scaled ropes keep their kind, at a context the prompts reach
        rs = getattr(cfg, key, None)
        if isinstance(rs, dict) and "original_max_position_embeddings" in rs:
            rs["original_max_position_embeddings"] = 16
    return cfg


def run_engine(engine: str, loaded, prompts: list[list[int]], new: int):
    """(first-step logits [n, vocab] for each prompt's last position, greedy tokens) on one engine."""
    from ir.reference import ReferenceRunner
    from tools.tiny_hf import backend_greedy

    ref = ReferenceRunner(loaded, max_tokens=max(map(len, prompts)) + new + 8, block_size=4)
    if engine in ("interp", "fused"):  # the plain graph, or ir.fusion's (the one the backends run)
        if engine == "fused":
            ref = ReferenceRunner(loaded, max_tokens=ref.blocks_per_seq * 4, block_size=4, fused=True)
        tokens, first = ref.greedy(prompts, new)
        return first, tokens
    if engine.startswith("tp") and engine[2:].isdigit():  # ir.sharding's ranks on the interpreter, fused graphs
        from ir.tp_reference import ShardedReference

        ref = ShardedReference(loaded, int(engine[2:]), max_tokens=ref.blocks_per_seq * 4, block_size=4, fused=True)
        tokens, first = ref.greedy(prompts, new)
        return first, tokens
    if engine == "mlx":
        from backends.mlx.backend import MLXBackend

        backend = MLXBackend(loaded, progress=False)
    elif engine == "cuda":
        import torch

        from backends.cuda.backend import CUDABackend

        backend = CUDABackend(loaded, device="cuda" if torch.cuda.is_available() else "cpu", dtype="f32",
                              progress=False)
    else:
        raise ValueError(f"unknown engine {engine!r} (interp, fused, tpN, mlx, cuda)")
    tokens, first = backend_greedy(backend, ref, prompts, new, 4)
    return first, tokens


def check(spec: str, engines: list[str], layers: int = 2, new: int = 8, seed: int = 0) -> list[Row]:
    import torch
    from transformers.utils import logging as hf_logging

    from ir.loader import load_model
    from tools.tiny_hf import hf_greedy, hf_logits, random_causal_lm, random_prompt

    torch.set_num_threads(1)
    hf_logging.disable_progress_bar()
    cfg = hf_config(spec, layers)
    model = random_causal_lm(cfg, seed)
    prompts = [random_prompt(seed + i, n, cfg.vocab_size) for i, n in enumerate(PROMPT_LENS)]
    refs = [hf_logits(model, p)[-1] for p in prompts]
    ref_tokens = [hf_greedy(model, p, new) for p in prompts]
    rows = []
    with tempfile.TemporaryDirectory(prefix="check_arch-") as folder:
        model.save_pretrained(folder)
        try:
            loaded = load_model(folder, progress=False)
        except Exception as e:  # noqa: BLE001 - the table says why this architecture does not load
            return [Row(engine, len(p), np.inf, 0, new, f"load: {e.__class__.__name__}: {e}")
                    for engine in engines for p in prompts]
        for engine in engines:
            try:
                first, tokens = run_engine(engine, loaded, prompts, new)
            except Exception as e:  # noqa: BLE001
                rows += [Row(engine, len(p), np.inf, 0, new, f"{e.__class__.__name__}: {e}") for p in prompts]
                continue
            for i, p in enumerate(prompts):
                scale = float(np.abs(refs[i]).max())
                err = float(np.abs(np.asarray(first[i], np.float32) - refs[i]).max()) / scale
                same = sum(a == b for a, b in zip(tokens[i], ref_tokens[i], strict=True))
                rows.append(Row(engine, len(p), err, same, new))
    return rows


def print_table(spec: str, rows: list[Row]) -> None:
    print(f"\n{spec}: ours against transformers (fp32), first step's logits and {rows[0].tokens} greedy tokens")
    print(f"{'engine':<8}{'prompt':>7}{'max|err| / max|ref|':>21}{'tokens equal':>14}  status")
    for r in rows:
        status = "ok" if r.ok else ("FAIL: " + r.error[:90] if r.error else "FAIL")
        print(f"{r.engine:<8}{r.prompt_len:>7}{r.rel_err:>21.2e}{r.tokens_equal:>9} / {r.tokens:<3} {status}")


def supported_model_types() -> tuple[list[str], list[str]]:
    """The registry's model_types that transformers builds, and those it does not know (e.g. "yi": Yi's files say
    "llama" today, early ones needed remote code)."""
    from transformers import CONFIG_MAPPING

    from ir.models import registry

    types = sorted({t for a in registry().values() for t in a.hf_model_types})
    return [t for t in types if t in CONFIG_MAPPING], [t for t in types if t not in CONFIG_MAPPING]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("spec", nargs="?", help="a model_type, a config.json (or its folder) or a cached hub id")
    ap.add_argument("--all", action="store_true", help="every model_type the registry knows")
    ap.add_argument("--engines", default="interp,fused",
                    help="of interp, fused (the interpreter on ir.fusion's graph), mlx, cuda (comma-separated)")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--new", type=int, default=8, help="greedy tokens compared per prompt")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    if not a.all and not a.spec:
        ap.error("give a model_type, a config.json or a hub id (or --all)")
    specs = [a.spec]
    if a.all:
        specs, unknown = supported_model_types()
        if unknown:
            print(f"not built by transformers, so not checked here: {', '.join(unknown)}")
    ok = True
    for spec in specs:
        try:
            rows = check(spec, a.engines.split(","), a.layers, a.new, a.seed)
        except (ValueError, OSError, KeyError) as e:  # an unknown model_type, an unreadable config
            print(f"check_arch: {spec}: {str(e).splitlines()[0][:200]}", file=sys.stderr)
            ok = False
            continue
        print_table(spec, rows)
        ok &= all(r.ok for r in rows)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
