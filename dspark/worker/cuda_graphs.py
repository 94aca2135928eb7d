"""CUDA graphs for decode and verification steps: captured per (batch-size bucket, window width, key bucket,
taps), replayed; steps with a prompt chunk run eager, as vLLM and MAX do.

A graphed step is laid out dense: `bucket` rows of `width` queries each, request i in row i, its window
(1 token in decode, 1 + drafts in verification) left-aligned and the rest of the row padding. Padding
queries, and the rows past the step's requests, store their K/V in the pool's scratch block (the one
block past the block manager's, `Engine`) and read one key, so they cost a little arithmetic and never
touch a request's cache. Keys are read through `kv_slots` of `key_bucket` columns (a power of two of KV
blocks at least the longest context), so one graph serves every context length up to its bucket. The
step's host data are copied into the graph's static buffers, the graph replays, and the rows of the
step's real tokens are read back out of its static outputs.

The capture itself is a backend: `CudaGraphBackend` (torch.cuda.graph, one memory pool for every graph)
on CUDA, `EagerBackend` anywhere (it records the function and replays it on the same static buffers,
copying into the same output tensors: a CUDA graph's contract), so the layout, padding and read-back are
tested on the CPU against the eager runner (tests/test_cuda_graphs.py); `gpu`-marked tests and
benchmarks/device_check.sh check the real capture.
"""

from __future__ import annotations

import gc
import weakref
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from dspark.worker.model_runner import ModelRunner, StepBatch
from dspark.models.attention import SHORT_QUERY_MAX, AttnGroup, AttnMetadata, slots_for


def batch_buckets(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, then multiples of 8 up to max_num_seqs (vLLM's capture sizes, shortened)."""
    sizes = [b for b in (1, 2, 4) if b < max_num_seqs]
    sizes += list(range(8, max_num_seqs, 8))
    return sorted(set(sizes + [max_num_seqs]))


def bucket_for(n: int, buckets: list[int]) -> int | None:
    return next((b for b in buckets if b >= n), None)


class CapturedGraph:
    """What a backend keeps of one capture for as long as it can replay: the graph (anything with
    `replay()`), its static outputs, which every replay writes, and the captured function, so that every
    tensor its closure refers to stays alive (a graph reads the addresses its capture read)."""

    def __init__(self, fn: Callable[[], tuple[torch.Tensor, ...]], graph, outputs: tuple[torch.Tensor, ...]) -> None:
        self.fn, self.graph, self.outputs = fn, graph, outputs

    def replay(self) -> tuple[torch.Tensor, ...]:
        self.graph.replay()
        return self.outputs


class EagerBackend:
    """Capture = run the function once; replay = run it again into the same output tensors."""

    def capture(self, fn: Callable[[], tuple[torch.Tensor, ...]]) -> CapturedGraph:
        outputs = fn()
        return CapturedGraph(fn, _EagerGraph(fn, outputs), outputs)


class _EagerGraph:
    def __init__(self, fn, outputs) -> None:
        self.fn, self.outputs = fn, outputs

    def replay(self) -> None:
        for out, new in zip(self.outputs, self.fn()):
            out.copy_(new)


class CudaGraphBackend:
    """torch.cuda.graph over one shared memory pool; two warm-up runs on a side stream first."""

    def __init__(self) -> None:
        self.pool = None

    def capture(self, fn: Callable[[], tuple[torch.Tensor, ...]]) -> CapturedGraph:
        self._warm_up(fn)
        graph, outputs = self._record(fn)
        return CapturedGraph(fn, graph, outputs)

    def _warm_up(self, fn: Callable[[], tuple[torch.Tensor, ...]]) -> None:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                fn()
        torch.cuda.current_stream().wait_stream(stream)

    def _record(self, fn: Callable[[], tuple[torch.Tensor, ...]]):
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            outputs = fn()
        self.pool = graph.pool()
        return graph, outputs


class PoisonedCudaGraphBackend(CudaGraphBackend):
    """CudaGraphBackend for checks on a device: right after each capture it takes the caching allocator's
    free blocks with live tensors of an index past any pool or vocabulary (2**40), so a graph that reads a
    tensor freed after its capture gathers through poison at its first replay (a device-side assert, or
    output unlike eager) rather than when an allocation happens to land there."""

    POISON = 2**40
    BLOCKS = ((64, 4096), (512, 512), (8192, 64))  # (longs, count): 512 B to 64 KiB blocks, ~7 MiB a capture

    def __init__(self) -> None:
        super().__init__()
        self.poison: list[torch.Tensor] = []

    def capture(self, fn: Callable[[], tuple[torch.Tensor, ...]]) -> CapturedGraph:
        captured = super().capture(fn)
        gc.collect()
        self.poison += [torch.full((n,), self.POISON, dtype=torch.long, device="cuda")
                        for n, count in self.BLOCKS for _ in range(count)]
        return captured


class LifetimeCheckBackend(CudaGraphBackend):
    """The CPU stand-in with CUDA graphs' lifetimes, for tests. A CUDA graph replays the raw addresses its
    capture read, so every tensor the captured function read but did not create must stay alive as long as
    the graph can replay; a freed one hands its memory to the next allocation, which the graph then reads.
    This backend keeps exactly what `CudaGraphBackend` keeps (its `capture`, inherited), records under a
    `TorchDispatchMode` every tensor an aten op of the captured run reads that the run did not create, holds
    the function itself only weakly, and before every replay checks, after `gc.collect()`, that each
    recorded tensor is still alive (AssertionError naming the dead ones). A captured run that reads a
    tensor's values on the host (`.item()`, `int(t)`, boolean-mask indexing), which a capturing stream
    refuses, fails at capture. Run with the CPU kernels off, so attention runs as aten ops the mode sees."""

    def _warm_up(self, fn) -> None:
        fn()  # lazily built state (caches, tables) exists before the recorded run, as on CUDA

    def _record(self, fn):
        recorder = _ReadRecorder()
        with recorder:
            outputs = fn()
        return _WeakGraph(fn, outputs, recorder.outside_reads(_closure_names(fn))), outputs


# ops that read a tensor's values on the host: a CUDA stream refuses them while it captures (and indexing
# by a boolean mask, `_reads_on_host`)
HOST_SYNC_OPS = frozenset(("aten::item", "aten::_local_scalar_dense", "aten::is_nonzero", "aten::equal",
                           "aten::nonzero", "aten::masked_select"))


class _ReadRecorder(TorchDispatchMode):
    """Every tensor an op reads that no op of this run produced, in the order first read; an op that reads
    values on the host raises."""

    def __init__(self) -> None:
        super().__init__()
        self.created: dict[int, weakref.ref] = {}  # by id, checked to be the same object (ids are reused)
        self.reads: dict[int, tuple[weakref.ref, str]] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if _reads_on_host(func, args):
            raise AssertionError(f"a captured step reads tensor values on the host ({func})")
        out = func(*args, **(kwargs or {}))
        if func is not torch.ops.aten.lift_fresh.default:  # its input: a tensor the run just made (torch.tensor)
            for t in tree_leaves((args, kwargs)):
                if isinstance(t, torch.Tensor) and not self._created(t) and id(t) not in self.reads:
                    self.reads[id(t)] = (weakref.ref(t), f"{list(t.shape)} {t.dtype} read by {func}")
        self.created.update((id(t), weakref.ref(t)) for t in tree_leaves(out) if isinstance(t, torch.Tensor))
        return out

    def _created(self, t: torch.Tensor) -> bool:
        ref = self.created.get(id(t))
        return ref is not None and ref() is t

    def outside_reads(self, names: dict[int, str]) -> list[tuple[weakref.ref, str]]:
        return [(ref, f"{names.get(key, 'a tensor')} ({what})") for key, (ref, what) in self.reads.items()]


def _reads_on_host(func, args) -> bool:
    if func._schema.name in HOST_SYNC_OPS:
        return True
    return func._schema.name == "aten::index" and any(  # x[mask]: the mask's True count sizes the result
        isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in args[1])


def _closure_names(fn) -> dict[int, str]:
    """id -> name of the tensors `fn`'s closure refers to, directly or as an attribute of a captured object."""
    names: dict[int, str] = {}
    for var, cell in zip(fn.__code__.co_freevars, fn.__closure__ or ()):
        value = cell.cell_contents
        if isinstance(value, torch.Tensor):
            names[id(value)] = var
        for attr, item in getattr(value, "__dict__", {}).items():
            if isinstance(item, torch.Tensor):
                names.setdefault(id(item), f"{var}.{attr}")
    return names


class _WeakGraph:
    """A recorded capture replayed on the CPU: the function held weakly, the recorded reads checked first."""

    def __init__(self, fn, outputs, reads: list[tuple[weakref.ref, str]]) -> None:
        self.fn, self.outputs, self.reads = weakref.ref(fn), outputs, reads

    def replay(self) -> None:
        gc.collect()
        dead = [name for ref, name in self.reads if ref() is None]
        if dead:
            raise AssertionError("a captured graph reads tensors nothing keeps alive: " + "; ".join(dead))
        fn = self.fn()
        if fn is None:  # every read is alive yet the function is gone: nothing left to replay on the CPU
            raise AssertionError("the captured function was freed while its graph can replay")
        for out, new in zip(self.outputs, fn()):
            out.copy_(new)


@dataclass
class _Graph:
    input_ids: torch.Tensor  # [B * W] long
    positions: torch.Tensor  # [B * W] long
    slot_mapping: torch.Tensor  # [B * W] long
    key_limit: torch.Tensor  # [B, W] long
    kv_slots: torch.Tensor  # [B, K] long
    token_index: torch.Tensor  # [B, W] long: arange, the dense row of each query
    query_valid: torch.Tensor  # [B, W] bool: all True (padding queries read the scratch block)
    captured: CapturedGraph | None = None  # owns the step function: every tensor the graph reads lives here


class GraphedRunner(ModelRunner):
    """A ModelRunner whose decode and verification steps replay captured graphs (others run eager)."""

    def __init__(self, runner: ModelRunner, *, backend, max_num_seqs: int, max_graphs: int = 96,
                 max_width: int = SHORT_QUERY_MAX) -> None:
        super().__init__(runner.model, kv_caches=runner.kv_caches, kv_block_size=runner.kv_block_size,
                         device=runner.device, tap_layer_ids=runner.tap_layer_ids)
        self.backend, self.max_graphs, self.max_width = backend, max_graphs, max_width
        self.buckets = batch_buckets(max_num_seqs)
        self.scratch_slot = (runner.kv_caches[0][0].shape[0] - 1) * runner.kv_block_size  # the spare block
        self.graphs: dict[tuple[int, int, int, bool], _Graph] = {}
        self.num_replays = 0
        self.num_eager = 0

    def graph_key(self, batch: StepBatch, with_taps: bool) -> tuple[int, int, int, bool] | None:
        """(batch bucket, width, key bucket, taps) of a step a graph can run, else None (eager)."""
        host = batch.host
        if host is None or not host.seqs:
            return None
        width = max(s.num_query for s in host.seqs)
        # every row of every window emits, in row order (no prompt-scoring rows)
        emitting = len(host.logits_indices) == len(host.input_ids) and not host.num_prompt_logits
        if width > self.max_width or not emitting or not all(s.causal and s.store for s in host.seqs):
            return None
        bucket = bucket_for(len(host.seqs), self.buckets)
        if bucket is None:
            return None
        max_kv = max(s.num_cached + s.num_query for s in host.seqs)
        key_blocks = 1 << max(0, int(np.ceil(np.log2(-(-max_kv // self.kv_block_size)))))
        return bucket, width, key_blocks * self.kv_block_size, bool(with_taps and self.tap_layer_ids)

    @torch.inference_mode()
    def forward(self, batch: StepBatch, *, with_taps: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
        key = self.graph_key(batch, with_taps)
        if key is None or (key not in self.graphs and len(self.graphs) >= self.max_graphs):
            self.num_eager += 1
            return super().forward(batch, with_taps=with_taps)
        graph = self.graphs.get(key) or self._capture(key)
        rows = self._fill(graph, batch, key)
        logits, taps = graph.captured.replay()
        self.num_replays += 1
        return logits[rows], (taps[rows] if key[3] else None)

    def _fill(self, graph: _Graph, batch: StepBatch, key) -> torch.Tensor:
        """Copy the step into the graph's static buffers; -> [num_tokens] long: the dense row of each of the
        step's flat tokens (its logits and taps rows in the graph's outputs)."""
        bucket, width, num_keys, _ = key
        host = batch.host
        ids = np.zeros((bucket, width), dtype=np.int64)
        pos = np.zeros((bucket, width), dtype=np.int64)
        slots = np.full((bucket, width), self.scratch_slot, dtype=np.int64)
        limit = np.ones((bucket, width), dtype=np.int64)
        kv_slots = np.full((bucket, num_keys), self.scratch_slot, dtype=np.int64)
        rows = np.empty(len(host.input_ids), dtype=np.int64)
        for i, s in enumerate(host.seqs):
            n, kv = s.num_query, s.num_cached + s.num_query
            flat = slice(s.token_offset, s.token_offset + n)
            ids[i, :n] = host.input_ids[flat]
            pos[i, :n] = host.positions[flat]
            kv_slots[i, :kv] = slots_for(s.block_table, 0, kv, self.kv_block_size)
            slots[i, :n] = kv_slots[i, s.num_cached:kv]
            limit[i, :n] = np.arange(s.num_cached + 1, kv + 1)
            rows[flat] = i * width + np.arange(n)
        for static, value in ((graph.input_ids, ids), (graph.positions, pos), (graph.slot_mapping, slots),
                              (graph.key_limit, limit), (graph.kv_slots, kv_slots)):
            static.copy_(torch.from_numpy(value).view(static.shape), non_blocking=True)
        return torch.from_numpy(rows).to(self.device, non_blocking=True)

    def _capture(self, key) -> _Graph:
        bucket, width, num_keys, taps = key
        dev, n = self.device, bucket * width
        g = _Graph(input_ids=torch.zeros(n, dtype=torch.long, device=dev),
                   positions=torch.zeros(n, dtype=torch.long, device=dev),
                   slot_mapping=torch.full((n,), self.scratch_slot, dtype=torch.long, device=dev),
                   key_limit=torch.ones(bucket, width, dtype=torch.long, device=dev),
                   kv_slots=torch.full((bucket, num_keys), self.scratch_slot, dtype=torch.long, device=dev),
                   token_index=torch.arange(n, device=dev).view(bucket, width),
                   query_valid=torch.ones(bucket, width, dtype=torch.bool, device=dev))
        tap_ids = self.tap_layer_ids if taps else ()

        def step() -> tuple[torch.Tensor, ...]:
            # metadata built inside: the mask is computed from the static key limits at every replay
            meta = AttnMetadata(slot_mapping=g.slot_mapping, num_tokens=n, all_stored=True, captured=True, groups=[AttnGroup(
                token_index=g.token_index, query_valid=g.query_valid, kv_slots=g.kv_slots, all_valid=True,
                key_limit=g.key_limit, needs_mask=True)])
            hidden, tap_out = self.model(g.input_ids, g.positions, meta, self.kv_caches, tap_layer_ids=tap_ids)
            logits = self.model.compute_logits(hidden).float()  # [n, vocab]
            return (logits, tap_out) if taps else (logits, logits[:0])

        g.captured = self.backend.capture(step)
        self.graphs[key] = g
        return g
