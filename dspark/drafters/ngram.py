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
        """(draft continuation, length n of the matched suffix); ([], 0) when nothing matches.

        One pass finds the earlier positions holding the last token; each longer n keeps those whose
        preceding tokens still match the suffix (~8 µs at 250 tokens, against ~85 µs for a sliding-
        window compare per n). Same result as that compare: the longest n, its most recent occurrence."""
        arr = np.asarray(ids, dtype=np.int64)
        total = len(arr)
        # hits: end positions i <= total - 2 of earlier occurrences of the last n tokens
        hits = np.flatnonzero(arr[:total - 1] == arr[-1]) if total > 1 else arr[:0]
        best_n, best_end = 0, -1
        for n in range(1, min(self.max_n, total - 1) + 1):
            if n > 1:
                hits = hits[hits >= n - 1]
                hits = hits[arr[hits - (n - 1)] == arr[total - n]]
            if not hits.size:
                break
            if n >= self.min_n:
                best_n, best_end = n, int(hits[-1])  # most recent occurrence
        if not best_n:
            return [], 0
        return arr[best_end + 1:best_end + 1 + self.num_draft_tokens].tolist(), best_n

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
