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

State snapshots (hybrid targets, `num_state_snapshots`): a cached block is only worth its K/V to a hybrid target
if the recurrent state at its end is kept too. A prompt chunk keeps that state, in a snapshot entry the manager
hands out (`plan_snapshots`), at the block boundaries it crosses that are multiples of `snapshot_interval` tokens,
at its prompt's last full block and at the depth its prefix hit reached past its snapshot (the branch point of
two requests); at commit the entry goes to the block's hash (`snapshots`), the one owner: it is freed when the
hash leaves the cache with its block, or reused, least recently used first, for a newer snapshot once no running
request holds that block. A hit on a hybrid target stops at the deepest matched block with a snapshot (its first
step starts from it, `snapshot_entry`); the blocks past it are computed again into blocks of its own.
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
                 num_state_slots: int = 0, num_state_snapshots: int = 0, snapshot_interval: int = 0):
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
        # state snapshots: block hash -> entry (least recently used first), free entries, and per request the entries
        # the step in flight writes ({block index: entry}) and the depth its prefix hit reached past its snapshot
        self.num_state_snapshots, self.snapshot_interval = num_state_snapshots, snapshot_interval
        self.snapshots: OrderedDict[int, int] = OrderedDict()
        self.free_snapshots = list(range(num_state_snapshots - 1, -1, -1))
        self.pending_snapshots: dict[str, dict[int, int]] = {}
        self.branch_points: dict[str, int] = {}
        self.num_snapshot_hits = self.num_snapshots_stored = self.num_snapshots_evicted = 0

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
        if self.num_state_slots:  # a hybrid target resumes from a state snapshot: the hit ends at the deepest one
            depth = next((i + 1 for i in reversed(range(len(hashes))) if hashes[i] in self.snapshots), 0)
            if depth < len(matched):
                self.branch_points[req.request_id] = len(matched) * self.kv_block_size
            matched, hashes = matched[:depth], hashes[:depth]
            if depth:
                self.snapshots.move_to_end(hashes[-1])
                self.num_snapshot_hits += 1
        for block_id in matched:
            self._take(block_id)
        req.block_table = matched
        self.hash_state[req.request_id] = (hashes, 0)
        return len(matched) * self.kv_block_size

    def snapshot_entry(self, req: Request) -> int:
        """Right after `match_prefix`: the snapshot entry a hybrid request's hit starts from (-1: none)."""
        hashes = self.hash_state.get(req.request_id, ([], 0))[0]
        return self.snapshots.get(hashes[-1], -1) if hashes and self.num_state_slots else -1

    def plan_snapshots(self, req: Request, start: int, end: int) -> tuple[tuple[int, int], ...]:
        """(position, entry) pairs: the states a step computing positions [start, end) of `req` keeps, at the
        snapshot boundaries it crosses (each the end of a block: the state after the position before it)."""
        if not (self.enable_prefix_caching and self.num_state_snapshots):
            return ()
        size, every = self.kv_block_size, self.snapshot_interval
        last = (req.num_tokens - 1) // size * size  # the last full block a later request for these tokens can hit
        branch = self.branch_points.get(req.request_id, 0)
        pending = self.pending_snapshots.setdefault(req.request_id, {})
        out = []
        for b in range(start // size * size + size, min(end, last) + 1, size):
            if not (b == last or b == branch or (every and b // every > (b - size) // every)):
                continue
            entry = self._snapshot_entry()
            if entry is None:
                break  # every entry is held: this boundary keeps none
            pending[b // size - 1] = entry
            out.append((b - 1, entry))
        return tuple(out)

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
        self.free_snapshots.extend(self.pending_snapshots.pop(req.request_id, {}).values())
        self.branch_points.pop(req.request_id, None)
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
        pending = self.pending_snapshots.get(req.request_id)
        for i in [i for i in pending or () if i < full]:  # the states this step kept at block boundaries
            entry = pending.pop(i)
            if hashes[i] in self.snapshots:  # another request kept the same one first
                self.free_snapshots.append(entry)
            else:
                self.snapshots[hashes[i]] = entry
                self.num_snapshots_stored += 1
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
            entry = self.snapshots.pop(block.block_hash, None)
            if entry is not None:  # the snapshot goes with its block
                self.free_snapshots.append(entry)
                self.num_snapshots_evicted += 1
        block.block_hash = None
        block.has_draft_kv = False

    def _snapshot_entry(self) -> int | None:
        """A free snapshot entry, or the least recently used one whose block no running request holds."""
        if self.free_snapshots:
            return self.free_snapshots.pop()
        for h, entry in self.snapshots.items():
            if self.blocks[self.hash_to_block[h]].ref_count == 0:
                del self.snapshots[h]
                self.num_snapshots_evicted += 1
                return entry
        return None

    @property
    def num_used_snapshots(self) -> int:
        """Snapshot entries kept for cached blocks or being written."""
        return self.num_state_snapshots - len(self.free_snapshots)

    def check_invariants(self) -> None:
        """For tests: no block is both free and referenced; hashes point at their blocks; every snapshot entry is
        free, kept for a cached hash, or being written, once."""
        for block in self.blocks:
            assert (block.ref_count == 0) == (block.block_id in self.free), f"kv_block {block.block_id}"
        for h, block_id in self.hash_to_block.items():
            assert self.blocks[block_id].block_hash == h
        assert all(h in self.hash_to_block for h in self.snapshots), "a snapshot outlived its block"
        pending = [e for p in self.pending_snapshots.values() for e in p.values()]
        entries = self.free_snapshots + list(self.snapshots.values()) + pending
        assert sorted(entries) == list(range(self.num_state_snapshots)), "snapshot entries leaked or doubled"
