"""Which replica takes a request (`dspark serve --data-parallel-size N`): the least loaded, unless another
replica was last sent a request with the same prompt prefix (its KV blocks are likely in that replica's
prefix cache) and is not much busier.

Load is what the API process has sent a replica and not yet seen finish (running + waiting + in flight),
counted where the requests are routed, so it is never stale. A prefix is remembered at block-aligned
lengths that double (1, 2, 4, ... blocks, and the prompt's whole blocks), each length keyed by a hash of
its token ids; a request goes to the replica of its longest remembered prefix while that replica's load is
within `affinity_slack` of the least loaded's, else to the least loaded (which then owns the prefix).
The table is bounded (least recently used prefixes are forgotten first).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass


@dataclass(frozen=True)
class BalanceConfig:
    block_size: int = 16  # tokens of a prefix-cache block (the replicas' kv_block_size)
    affinity_slack: int = 4  # a prefix keeps its replica while its load exceeds the least by at most this
    max_prefixes: int = 1 << 16  # prefix hashes remembered

    def __post_init__(self) -> None:
        for name in ("block_size", "max_prefixes"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.affinity_slack < 0:
            raise ValueError(f"affinity_slack must be >= 0, got {self.affinity_slack}")


class Balancer:
    def __init__(self, config: BalanceConfig = BalanceConfig()):
        self.config = config
        self._owner: OrderedDict[int, int] = OrderedDict()  # prefix hash -> replica last sent it

    def prefix_keys(self, prompt_ids: list[int]) -> list[int]:
        """Hashes of the prompt's block-aligned prefixes, longest first."""
        block = self.config.block_size
        whole = len(prompt_ids) // block
        lengths, n = {whole}, 1
        while n < whole:
            lengths.add(n)
            n *= 2
        return [hash(tuple(prompt_ids[:k * block])) for k in sorted(lengths, reverse=True) if k]

    def pick(self, prompt_ids: list[int], loads: list[int | None]) -> int:
        """The replica for a request; `loads[i]` None where replica i takes no requests. Remembers the
        choice for the prompt's prefixes."""
        live = [i for i, load in enumerate(loads) if load is not None]
        if not live:
            raise LookupError("no replica takes requests")
        least = min(live, key=lambda i: loads[i])
        keys = self.prefix_keys(prompt_ids)
        chosen = least
        for key in keys:
            owner = self._owner.get(key)
            if owner is not None and loads[owner] is not None:
                if loads[owner] <= loads[least] + self.config.affinity_slack:
                    chosen = owner
                break
        for key in keys:
            self._owner[key] = chosen
            self._owner.move_to_end(key)
        while len(self._owner) > self.config.max_prefixes:
            self._owner.popitem(last=False)
        return chosen
