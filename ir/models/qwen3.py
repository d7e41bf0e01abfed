"""qwen3: the llama decoder with per-head RMS norms on q and k before rope."""

from ir.models import Architecture, llama, register

ARCH = register(Architecture(
    name="qwen3",
    hf_model_types=("qwen3",),
    gguf_archs=("qwen3",),
    build=llama.build,
    hf_names=llama.hf_names,
    gguf_names=llama.gguf_names,
    defaults={"qk_norm": True},
))
