"""Greedy decoding straight through a backend's forward (tools/tiny_hf's, shared with tools/check_arch)."""

from tools.tiny_hf import backend_greedy, host

__all__ = ["backend_greedy", "host"]
