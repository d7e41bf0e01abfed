"""The shared engine: sequences, block manager, scheduler, sampler, detokenizer, and the step loop."""
