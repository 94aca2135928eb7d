"""N-gram prompt-lookup drafter (no weights): find the most recent earlier occurrence of the
context's last n tokens (longest n first, from prompt_lookup_max down to prompt_lookup_min) and
propose the tokens that followed it. Drafts are a point mass (`draft_probs=None`, no confidence).

When nothing matches, it proposes nothing (the request decodes one token that step).
"""

from __future__ import annotations

import numpy as np
import torch

from dspark.drafters.base import DraftProposal, Drafter, ProposeBatch


class NgramDrafter(Drafter):
    def __init__(self, *, num_draft_tokens: int, prompt_lookup_min: int = 2, prompt_lookup_max: int = 5):
        self.num_draft_tokens = num_draft_tokens
        self.min_n = prompt_lookup_min
        self.max_n = prompt_lookup_max

    def lookup(self, ids: list[int]) -> list[int]:
        """Draft continuation of `ids` (possibly shorter than num_draft_tokens, possibly empty)."""
        return self.lookup_with_length(ids)[0]

    def lookup_with_length(self, ids: list[int]) -> tuple[list[int], int]:
        """(draft continuation, length n of the matched suffix); ([], 0) when nothing matches."""
        arr = np.asarray(ids, dtype=np.int64)
        total = len(arr)
        for n in range(min(self.max_n, total - 1), self.min_n - 1, -1):
            suffix = arr[total - n:]
            # windows[i] = arr[i:i+n] for i in 0 .. total-n-1 (the suffix itself excluded)
            windows = np.lib.stride_tricks.sliding_window_view(arr[:total - 1], n)
            hits = np.flatnonzero((windows == suffix).all(axis=1))
            if hits.size:
                start = int(hits[-1]) + n  # most recent occurrence
                return arr[start:start + self.num_draft_tokens].tolist(), n
        return [], 0

    def propose(self, batch: ProposeBatch) -> DraftProposal:
        drafts = [self.lookup(r.all_ids) for r in batch.requests]
        width = self.num_draft_tokens
        draft_ids = torch.zeros(len(drafts), width, dtype=torch.long)
        for i, d in enumerate(drafts):
            if d:
                draft_ids[i, :len(d)] = torch.tensor(d)
        return DraftProposal(draft_ids=draft_ids, draft_probs=None, confidence=None,
                             num_valid=[len(d) for d in drafts])


def build(spec, *, target_config, target_model, dtype, device) -> NgramDrafter:
    return NgramDrafter(num_draft_tokens=spec.num_speculative_tokens,
                        prompt_lookup_min=spec.prompt_lookup_min, prompt_lookup_max=spec.prompt_lookup_max)
