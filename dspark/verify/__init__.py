"""The verifier: `sampler.py` samples every emitting row of a step and verifies its drafts (greedy lane and
lossless rejection sampling, `rejection.py`), with penalties, logits processors, grammars and logprobs."""
