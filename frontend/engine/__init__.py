"""The shared engine: sequences, block manager, scheduler, detokenizer, and the step loop (the sampler is core's)."""
