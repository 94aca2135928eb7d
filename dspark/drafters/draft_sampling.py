"""Per-step sampling of draft tokens for the autoregressive drafters (EAGLE-3, draft model).

Each draft step turns one row of drafter logits per request into one token:

* `draft_sample_method="greedy"`, or a greedy request (temperature < GREEDY_EPS): the argmax. The
  proposal then carries no distribution (a point mass for the verifier).
* `"probabilistic"` and a non-greedy request: a sample from `logits_to_probs` under the request's own
  temperature / top-k / top-p, drawn with the request's generator. That exact distribution is what the
  verifier needs as `draft_probs`; greedy rows in the same batch get their one-hot row.

`DraftAccumulator` collects the γ steps into a `DraftProposal`.
"""

from __future__ import annotations

import torch

from dspark.drafters.base import DraftProposal, ProposeRequest
from dspark.sampling import greedy_ids, logits_to_probs


class DraftAccumulator:
    """Samples one draft per request per step and stacks the steps into a `DraftProposal`."""

    def __init__(self, requests: list[ProposeRequest], *, method: str):
        self.requests = requests
        self.sampled = [method == "probabilistic" and not r.params.is_greedy for r in requests]
        self.keep_probs = any(self.sampled)
        params = [r.params for r in requests]
        self.temperature = torch.tensor([p.temperature for p in params], dtype=torch.float32)
        self.top_k = torch.tensor([p.top_k for p in params], dtype=torch.long)
        self.top_p = torch.tensor([p.top_p for p in params], dtype=torch.float32)
        self.ids: list[torch.Tensor] = []  # per step [num_reqs] long (cpu)
        self.probs: list[torch.Tensor] = []  # per step [num_reqs, vocab_size] float32

    def sample(self, logits: torch.Tensor) -> torch.Tensor:
        """logits [num_reqs, vocab_size] → drafts [num_reqs] long on the logits' device."""
        ids = greedy_ids(logits).cpu()  # [num_reqs]
        if self.keep_probs:
            dev = logits.device
            probs = logits_to_probs(logits, temperature=self.temperature.to(dev),
                                    top_k=self.top_k.to(dev), top_p=self.top_p.to(dev))  # [num_reqs, V]
            cpu_probs = probs.cpu()
            for i, r in enumerate(self.requests):
                if self.sampled[i]:
                    ids[i] = torch.multinomial(cpu_probs[i], 1, generator=r.generator)[0]
            self.probs.append(probs)
        self.ids.append(ids)
        return ids.to(logits.device)

    def proposal(self) -> DraftProposal:
        draft_ids = torch.stack(self.ids, dim=1)  # [num_reqs, num_draft_tokens]
        draft_probs = torch.stack(self.probs, dim=1) if self.keep_probs else None  # [num_reqs, γ, V]
        return DraftProposal(draft_ids=draft_ids, draft_probs=draft_probs, confidence=None)
