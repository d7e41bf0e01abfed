"""Readers and decoders for on-disk model weight formats."""
