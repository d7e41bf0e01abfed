"""qwen3: the llama decoder with per-head RMS norms on q and k before rope."""

from ir.models import Architecture, llama

ARCH = Architecture(
    name="qwen3",
    hf_model_types=("qwen3",),
    gguf_archs=("qwen3",),
    build=llama.build,
    load_weights=llama.load_weights_unpermuted,
    defaults={"qk_norm": True},
)
