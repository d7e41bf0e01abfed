"""The start of a new architecture: reads an HF config (a model_type, a config.json or its folder, or a cached hub
id), builds a tiny random model of it with transformers to see its tensors, recognizes what it can (norm kind, rope
kind and scaling, partial rotary, attention extras, MLP kind, fused tensors, biases, tied head), prints that as a
table, and writes a starting IR file and its tiny-config test:

    python -m tools.new_arch phi3                          (the report only)
    python -m tools.new_arch my/config.json --name mymodel --write [--models-dir ir/models --tests-dir tests]

What llama's decoder already covers becomes flags on it (ARCH reuses llama.build and llama.load_weights); whatever it
does not is listed in the generated file as a TODO beside the tensors no name map claims. Then:
`python -m tools.check_arch MODEL_TYPE --engines interp,mlx,cuda` says how close it is (docs/ADDING_AN_ARCHITECTURE.md).
"""

from __future__ import annotations

import argparse
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

from ir.models.llama import LAYER_NAMES, TOP_NAMES

# HF tensor names llama's decoder reads (layer 0's, with the index as {i}).
_LLAMA_HF = {hf for hf, _ in LAYER_NAMES.values()} | {hf for hf, _ in TOP_NAMES.values()}
# Feature -> what llama's decoder needs to serve it ("flag" = a ModelConfig flag it reads; None = not supported).
_FUSED = {"qkv_proj": "fused q/k/v projection (split its rows in load_weights)",
          "gate_up_proj": "fused gate/up projection (split its rows in load_weights)",
          "query_key_value": "fused q/k/v projection (split its rows in load_weights)"}


_EXTRAS = {"attn_logit_softcapping": "the attention op's softcap attr",
           "final_logit_softcapping": "g.softcap on the logits",
           "query_pre_attn_scalar": "the attention scale is query_pre_attn_scalar ** -0.5, not head_dim's"}


def _offset_norm(model) -> bool:
    """Whether the model's RMSNorm scales by (1 + w): with w = 0 its output is then not zero."""
    import torch

    norm = next((m for m in model.modules() if "RMSNorm" in type(m).__name__ and hasattr(m, "weight")), None)
    if norm is None:
        return False
    with torch.no_grad():
        saved = norm.weight.clone()
        norm.weight.zero_()
        out = norm(torch.randn(2, norm.weight.shape[0]))
        norm.weight.copy_(saved)
    return bool(out.abs().max() > 0)


@dataclass
class Report:
    model_type: str
    features: dict[str, str] = field(default_factory=dict)  # what it is -> the value read
    todo: list[str] = field(default_factory=list)  # what llama's decoder does not do
    flags: dict[str, object] = field(default_factory=dict)  # ModelConfig flags the arch implies
    unmapped: list[str] = field(default_factory=list)  # layer-0 tensors no llama name claims
    unread: list[str] = field(default_factory=list)  # config keys llama's decoder does not read

    @property
    def llama_compatible(self) -> bool:
        return not self.todo and not self.unmapped and not self.unread


def _layer0(names: list[str]) -> list[str]:
    out = []
    for n in names:
        m = re.match(r"model\.layers\.0\.(.+)", n)
        if m:
            out.append("model.layers.{i}." + m.group(1))
        elif not re.match(r"model\.layers\.\d+\.", n):
            out.append(n)
    return out


def inspect(spec: str) -> Report:
    """What a config and its tiny random model show."""
    from tools.check_arch import hf_config
    from tools.tiny_hf import random_causal_lm

    cfg = hf_config(spec, 2)
    model = random_causal_lm(cfg)
    r = Report(str(getattr(cfg, "model_type", spec)))
    names = _layer0([n for n, _ in model.named_parameters()])
    norms = {type(m).__name__ for m in model.modules() if "norm" in type(m).__name__.lower()}
    r.features["norm"] = ", ".join(sorted(norms)) or "none found"
    if any("LayerNorm" == n or n.endswith("LayerNorm") and "RMS" not in n for n in norms):
        r.todo.append("LayerNorm (llama's decoder has RMSNorm): build with g.layer_norm")
    rope = dict(getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None) or {})
    kind = rope.get("rope_type") or rope.get("type") or "default"
    r.features["rope"] = f"{kind}, theta {rope.get('rope_theta', getattr(cfg, 'rope_theta', None))}"
    if kind not in ("default", "linear", "llama3", "yarn"):
        r.todo.append(f"rope scaling {kind!r} (ir/rope.py has default, linear, llama3, yarn)")
    partial = rope.get("partial_rotary_factor") or getattr(cfg, "partial_rotary_factor", None)
    if partial and float(partial) != 1.0:
        r.features["partial rotary"] = str(partial)  # ir/config.py reads it into RopeSpec.rotary_dim
    act = getattr(cfg, "hidden_activation", None) or getattr(cfg, "hidden_act", None)
    r.features["activation"] = str(act)
    if getattr(cfg, "sliding_window", None):
        types = getattr(cfg, "layer_types", None)
        pattern = f", layer_types {sorted(set(types))}" if types else ""
        r.features["sliding window"] = f"{cfg.sliding_window}{pattern}"
    for key, todo in _EXTRAS.items():
        if getattr(cfg, key, None):
            r.features[key] = str(getattr(cfg, key))
            r.todo.append(f"{key}: {todo}")
    if _offset_norm(model):
        r.features["norm"] += " (scales by 1 + w)"
        r.todo.append("(1 + w) norms: rms_norm's offset attr 1.0 for HF weights (llama.cpp's GGUF stores w + 1)")
    r.features["tied head"] = str(bool(getattr(cfg, "tie_word_embeddings", False)))
    for n in names:
        short = n.split(".")[-2] if n.count(".") >= 1 else n
        if short in _FUSED:
            r.todo.append(f"{_FUSED[short]}: {n}")
    biases = sorted({n.split(".")[-2] for n in names if n.endswith(".bias") and "norm" not in n})
    if biases:
        r.features["biases"] = ", ".join(biases)
        if {"q_proj", "k_proj", "v_proj"} & set(biases):
            r.flags["qkv_bias"] = True
        if "o_proj" in biases:
            r.flags["o_bias"] = True
        if {"gate_proj", "up_proj", "down_proj"} & set(biases):
            r.flags["mlp_bias"] = True
    if any(n.endswith("q_norm.weight") for n in names):
        r.flags["qk_norm"] = True
    r.unmapped = [n for n in names if n not in _LLAMA_HF]
    r.unread = unread_keys(cfg)
    return r


# Keys of any config that say nothing about the network's arithmetic.
_IGNORED = {"architectures", "auto_map", "transformers_version", "torch_dtype", "dtype", "model_type", "use_cache",
            "initializer_range", "attention_dropout", "hidden_dropout", "embedding_dropout", "resid_pdrop",
            "embd_pdrop", "attn_pdrop", "pad_token_id", "bos_token_id", "eos_token_id", "layer_types",
            "sliding_window", "partial_rotary_factor", "rope_parameters", "rope_scaling", "rope_theta",
            "max_window_layers", "use_sliding_window", "pretraining_tp", "hidden_activation",
            "attn_logit_softcapping", "final_logit_softcapping", "query_pre_attn_scalar"}


def unread_keys(cfg) -> list[str]:
    """Config keys llama's config does not have (and that are not bookkeeping): multipliers, scalings, switches a
    decoder of its own may have to read (granite's embedding_multiplier, for example)."""
    from transformers import LlamaConfig

    known = set(LlamaConfig().to_dict()) | _IGNORED
    return sorted(k for k, v in cfg.to_dict().items() if k not in known and not isinstance(v, dict | list)
                  and not k.startswith("_") and v is not None)


def print_report(r: Report) -> None:
    print(f"\n{r.model_type}: what its config and tensors show")
    for k, v in r.features.items():
        print(f"  {k:<24}{v}")
    if r.flags:
        print(f"  {'llama flags':<24}{r.flags}")
    for t in r.todo:
        print(f"  TODO  {t}")
    for n in r.unmapped:
        print(f"  unmapped tensor  {n}")
    for k in r.unread:
        print(f"  unread config key  {k}")
    print("  => " + ("llama's decoder with these flags" if r.llama_compatible else
                     "a decoder of its own: start from the written file's TODOs"))


def arch_source(r: Report, name: str) -> str:
    todo = ("".join(f"# TODO: {t}\n" for t in r.todo) + "".join(f"# TODO: map tensor {n}\n" for n in r.unmapped)
            + "".join(f"# TODO: read config key {k}\n" for k in r.unread))
    flags = f"    defaults={r.flags!r},\n" if r.flags else ""
    return f'''"""{name}: written by tools/new_arch from {r.model_type}'s config; {"llama's decoder with flags" if
    r.llama_compatible else "a start: llama's decoder until the TODOs below are done"}."""

from ir.models import Architecture, llama

{todo}ARCH = Architecture(
    name="{name}",
    hf_model_types=("{r.model_type}",),
    gguf_archs=(),  # llama.cpp's general.architecture for it, once its GGUF names are mapped
    build=llama.build,
    load_weights=llama.load_weights_unpermuted,
{flags})
'''


def test_source(r: Report, name: str) -> str:
    return f'''"""{name} against transformers on a tiny random {r.model_type} model (written by tools/new_arch)."""

from tools import check_arch


def test_{name}_matches_transformers():
    rows = check_arch.check("{r.model_type}", ["interp", "mlx", "cuda"], new=8)
    assert all(r.ok for r in rows), [r for r in rows if not r.ok]
'''


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("spec", help="a model_type, a config.json (or its folder) or a cached hub id")
    ap.add_argument("--name", help="the architecture's name (default: the model_type)")
    ap.add_argument("--write", action="store_true", help="write the IR file and its test")
    ap.add_argument("--models-dir", type=Path, default=Path("ir/models"))
    ap.add_argument("--tests-dir", type=Path, default=Path("tests"))
    ap.add_argument("--force", action="store_true", help="overwrite existing files")
    a = ap.parse_args(argv)
    try:
        r = inspect(a.spec)
    except (ValueError, OSError, KeyError) as e:
        print(f"new_arch: {a.spec}: {str(e).splitlines()[0][:200]}", file=sys.stderr)
        return 2
    print_report(r)
    if a.write:
        name = re.sub(r"\W", "_", a.name or r.model_type)
        files = {a.models_dir / f"{name}.py": arch_source(r, name), a.tests_dir / f"test_arch_{name}.py":
                 test_source(r, name)}
        for path in files:
            if path.exists() and not a.force:
                print(f"new_arch: {path} exists (--force to overwrite)", file=sys.stderr)
                return 2
        for path, text in files.items():
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
            print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
