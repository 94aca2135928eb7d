"""The tensor-parallel group of one process: its rank, the size, and the two torch.distributed groups it
talks through.

- `group`: the step's tensor collectives (all-reduce after the row-parallel products and the vocabulary-
  parallel embedding, the gather of the logits slices, or of their slice winners, to rank 0). gloo on the
  CPU, NCCL on CUDA, with the configured `distributed_timeout_s`: a rank that stops answering turns into
  an error, not a hang (gloo raises at once when a peer's socket closes; the timeout covers a rank that
  is alive but stuck).
- `ctrl`: gloo, rank 0 -> workers: the step batch as a pickled object (`HostBatch`), a heartbeat or a
  stop message, with the same timeout: rank 0 sends a heartbeat whenever it has sent nothing for a third
  of it (dspark.distributed.runner), so an idle server keeps its workers and a stuck one is an error.

Size 1 (`TPGroup.single()`) needs no process group: every collective is the identity.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist


STARTUP_TIMEOUT_S = 600.0


@dataclass
class TPGroup:
    rank: int
    size: int
    group: Any = None  # ProcessGroup of the step's tensor collectives (None: size 1)
    ctrl: Any = None  # gloo ProcessGroup, rank 0 -> workers control messages
    # bytes of the step's tensor collectives so far (benchmarks and tests read rank 0's): received by
    # gather_cat from the other ranks, and the tensors all_reduce summed
    gathered_bytes: int = 0
    reduced_bytes: int = 0

    @classmethod
    def single(cls) -> "TPGroup":
        return cls(rank=0, size=1)

    @classmethod
    def join(cls, *, rank: int, size: int, store: dist.Store, backend: str, timeout_s: float) -> "TPGroup":
        """Join the group whose rendezvous is `store` (a TCPStore on 127.0.0.1 held by rank 0)."""
        # the rendezvous waits for processes still importing torch (a loaded machine: tens of seconds); the
        # step's groups get the configured timeout
        dist.init_process_group(backend, store=store, rank=rank, world_size=size,
                                timeout=timedelta(seconds=max(timeout_s, STARTUP_TIMEOUT_S)))
        ranks = list(range(size))
        group = dist.new_group(ranks, backend=backend, timeout=timedelta(seconds=timeout_s))
        ctrl = dist.new_group(ranks, backend="gloo", timeout=timedelta(seconds=timeout_s))
        return cls(rank=rank, size=size, group=group, ctrl=ctrl)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum of `x` over the ranks, in place (the identity at size 1)."""
        if self.size > 1:
            dist.all_reduce(x, group=self.group)
            self.reduced_bytes += x.numel() * x.element_size()
        return x

    def gather_cat(self, x: torch.Tensor) -> torch.Tensor | None:
        """Rank 0: the ranks' `x` [rows, n] concatenated along the last dim, [rows, size * n]; other ranks:
        None. Every rank's `x` has the same shape."""
        if self.size == 1:
            return x
        x = x.contiguous()
        if self.rank == 0:
            parts = [torch.empty_like(x) for _ in range(self.size)]
            dist.gather(x, parts, dst=0, group=self.group)
            self.gathered_bytes += (self.size - 1) * x.numel() * x.element_size()
            return torch.cat(parts, dim=-1)
        dist.gather(x, None, dst=0, group=self.group)
        return None

    def send(self, message: Any) -> None:
        """Rank 0: broadcast a picklable message to the workers."""
        dist.broadcast_object_list([message], src=0, group=self.ctrl)

    def receive(self) -> Any:
        """A worker: the next message rank 0 sends."""
        box = [None]
        dist.broadcast_object_list(box, src=0, group=self.ctrl)
        return box[0]

    def close(self) -> None:
        if self.size > 1 and dist.is_initialized():
            dist.destroy_process_group()


def even_split(total: int, parts: int) -> list[tuple[int, int]]:
    """(start, count) of each of `parts` contiguous ranges covering [0, total), the first `total % parts`
    one longer: 9 heads over 2 ranks -> (0, 5), (5, 4)."""
    base, extra = divmod(total, parts)
    out, start = [], 0
    for r in range(parts):
        n = base + (r < extra)
        out.append((start, n))
        start += n
    return out
