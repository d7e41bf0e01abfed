"""The batch contract moved to core.batch (it is the engine's and the backends', below both). This name stays only
while ir/models/llama.py, restructured elsewhere now, imports ATTENTION_INPUTS from here; then it goes."""

from core.batch import ATTENTION_INPUTS, Batch, make_batch

__all__ = ["ATTENTION_INPUTS", "Batch", "make_batch"]
