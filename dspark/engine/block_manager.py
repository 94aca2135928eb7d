"""KV block pool: free list, reference counts and a hash-chain prefix cache over *committed* full blocks.

A request's `block_table` lists the kv_blocks that hold its positions (kv_block i covers positions
[i * kv_block_size, (i + 1) * kv_block_size)). Blocks are allocated ahead of use (the verify window and
the drafter's scratch slots sit past the committed length); rejected drafts leave stale K/V that no one
reads, because context lengths come from `num_computed_tokens`.

A hybrid target (linear-attention layers) also needs one recurrent state slot per request
(`dspark.models.recurrent`): with `num_state_slots` the manager hands one out with a request's first
blocks and takes it back with its last, so a finished, aborted or preempted request frees both at once.

Prefix caching: once a full block holds only committed tokens, its hash — of the previous block's
hash and its own token ids — is registered. A freed block keeps its hash and contents until the pool
hands it out again, so a later request with the same prefix takes it back (LRU reuse order). Each
cached block also records whether the drafter's context K/V were written into it: a speculative
request with a drafter context counts a hit only over blocks that have them (a target hit is not a draft
hit). When a request's block gets its drafter K/V and the block registered under the same hash has none
(another request without drafter context computed it first), the hash moves to the block that has both.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from dspark.request import Request


@dataclass
class KVBlock:
    block_id: int
    ref_count: int = 0
    block_hash: int | None = None
    has_draft_kv: bool = False


def block_hash(parent_hash: int | None, token_ids: tuple[int, ...]) -> int:
    return hash((parent_hash, token_ids))


class BlockManager:
    def __init__(self, *, num_kv_blocks: int, kv_block_size: int, enable_prefix_caching: bool = True,
                 num_state_slots: int = 0):
        self.kv_block_size = kv_block_size
        self.num_state_slots = num_state_slots
        self.free_state_slots = list(range(num_state_slots - 1, -1, -1))  # popped from the end: slot 0 first
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [KVBlock(i) for i in range(num_kv_blocks)]
        # Free blocks in reuse order (oldest first); an OrderedDict gives O(1) removal on a cache hit.
        self.free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_kv_blocks))
        self.hash_to_block: dict[int, int] = {}
        # request_id → (the hashes of its leading full committed blocks, how many of those hold the drafter's
        # K/V as far as commit has seen)
        self.hash_state: dict[str, tuple[list[int], int]] = {}

    # -- queries ---------------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self.free)

    @property
    def usage(self) -> float:
        return 1.0 - len(self.free) / len(self.blocks)

    def blocks_needed(self, req: Request, num_slots: int) -> int:
        return max(0, -(-num_slots // self.kv_block_size) - len(req.block_table))

    # -- admission with prefix hits --------------------------------------------------------------
    def match_prefix(self, req: Request, *, need_draft_kv: bool) -> int:
        """Take cached blocks for the longest committed prefix of `req` (at least one token is left to
        compute, so the step yields logits). Returns the number of cached tokens."""
        assert not req.block_table, "match_prefix is only for a request without blocks"
        if not self.enable_prefix_caching:
            return 0
        ids = req.all_ids
        parent: int | None = None
        matched: list[int] = []
        hashes: list[int] = []
        for start in range(0, len(ids) - 1 - self.kv_block_size + 1, self.kv_block_size):
            h = block_hash(parent, tuple(ids[start:start + self.kv_block_size]))
            block_id = self.hash_to_block.get(h)
            if block_id is None or (need_draft_kv and not self.blocks[block_id].has_draft_kv):
                break
            matched.append(block_id)
            hashes.append(h)
            parent = h
        for block_id in matched:
            self._take(block_id)
        req.block_table = matched
        self.hash_state[req.request_id] = (hashes, 0)
        return len(matched) * self.kv_block_size

    # -- allocation ------------------------------------------------------------------------------
    def allocate(self, req: Request, num_slots: int) -> bool:
        """Grow `req.block_table` to cover `num_slots` positions; False (and no change) if the pool is
        short."""
        need = self.blocks_needed(req, num_slots)
        if need > len(self.free):
            return False
        if self.num_state_slots and req.state_slot is None:
            if not self.free_state_slots:
                return False
            req.state_slot = self.free_state_slots.pop()
        for _ in range(need):
            block_id = next(iter(self.free))
            self._evict_hash(block_id)
            self._take(block_id)
            req.block_table.append(block_id)
        return True

    def free_request(self, req: Request) -> None:
        """Release every block of a finished, aborted or preempted request (last block first, so the
        prefix's head stays cached longest)."""
        for block_id in reversed(req.block_table):
            block = self.blocks[block_id]
            block.ref_count -= 1
            assert block.ref_count >= 0, f"kv_block {block_id} freed twice"
            if block.ref_count == 0:
                if block.block_hash is None:
                    self.free[block_id] = None
                    self.free.move_to_end(block_id, last=False)  # no content worth keeping: reuse first
                else:
                    self.free[block_id] = None
        req.block_table = []
        self.hash_state.pop(req.request_id, None)
        if req.state_slot is not None:
            assert req.state_slot not in self.free_state_slots, f"state slot {req.state_slot} freed twice"
            self.free_state_slots.append(req.state_slot)
            req.state_slot = None

    @property
    def num_used_state_slots(self) -> int:
        return self.num_state_slots - len(self.free_state_slots)

    # -- prefix-cache registration ---------------------------------------------------------------
    def commit(self, req: Request) -> None:
        """Register the hashes of full blocks whose tokens are all committed; mark those whose drafter
        context K/V are written too."""
        if not self.enable_prefix_caching:
            return
        ids = req.all_ids
        hashes, draft_done = self.hash_state.get(req.request_id, ([], 0))
        full = min(req.num_computed_tokens // self.kv_block_size, len(req.block_table))
        for i in range(len(hashes), full):
            block = self.blocks[req.block_table[i]]
            h = block_hash(hashes[-1] if hashes else None,
                           tuple(ids[i * self.kv_block_size:(i + 1) * self.kv_block_size]))
            if h not in self.hash_to_block:
                block.block_hash = h
                self.hash_to_block[h] = block.block_id
            hashes.append(h)
        draft_full = min(req.num_draft_computed // self.kv_block_size, full)
        self.hash_state[req.request_id] = (hashes, max(draft_done, draft_full))
        for i in range(draft_done, draft_full):
            block, h = self.blocks[req.block_table[i]], hashes[i]
            owner = self.hash_to_block.get(h)
            if owner is not None and owner != block.block_id and not self.blocks[owner].has_draft_kv:
                self.blocks[owner].block_hash = None  # the same tokens without drafter K/V: this block replaces it
                owner = None
            if owner is None:
                block.block_hash = h
                self.hash_to_block[h] = block.block_id
                owner = block.block_id
            if owner == block.block_id:
                block.has_draft_kv = True

    # -- internals -------------------------------------------------------------------------------
    def _take(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_count == 0:
            del self.free[block_id]
        block.ref_count += 1

    def _evict_hash(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.block_hash is not None and self.hash_to_block.get(block.block_hash) == block_id:
            del self.hash_to_block[block.block_hash]
        block.block_hash = None
        block.has_draft_kv = False

    def check_invariants(self) -> None:
        """For tests: no block is both free and referenced; hashes point at their blocks."""
        for block in self.blocks:
            assert (block.ref_count == 0) == (block.block_id in self.free), f"kv_block {block.block_id}"
        for h, block_id in self.hash_to_block.items():
            assert self.blocks[block_id].block_hash == h
