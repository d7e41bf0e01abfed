"""qwen2 / qwen2.5 (and DeepSeek-R1-Distill-Qwen, QwQ): the llama decoder with q/k/v biases."""

from ir.models import Architecture, llama

ARCH = Architecture(
    name="qwen2",
    hf_model_types=("qwen2",),
    gguf_archs=("qwen2",),
    build=llama.build,
    load_weights=llama.load_weights_unpermuted,
    # HF's qwen2 config has no attention_bias key: the biases are part of the architecture.
    defaults={"qkv_bias": True},
)
