"""Tensor-parallel execution: rank 0 (the engine's own process) schedules, verifies and drafts; the workers
(ranks 1 .. size - 1, started here with torch.multiprocessing, spawn) only run target forwards.

One step: rank 0 broadcasts the step's `HostBatch` on the control group (pickled Python lists: block
tables, positions, ids), every rank builds the same tensors and attention metadata from it, runs its shard
of the target (all-reduces inside the row-parallel products and the embedding), and the ranks' vocabulary
slices of the logits are gathered to rank 0, which trims the padding and verifies as on one process (a step
whose every request is greedy without logprobs or processors gathers each rank's slice winner per row
instead, dspark.distributed.vocab_argmax). The drafter runs on rank 0 only, replicated rather than split:
it is a few layers, reads the whole residual stream that every rank holds after each all-reduce, and its
KV lives in rank 0's pool; splitting it would add two collectives per drafter layer per draft step for a
model a tenth of the target's size.

Liveness: rank 0 checks every worker's process before each step; gloo raises at once when a peer's socket
closes (a rank that dies mid-step), the group timeout (`distributed_timeout_s`) covers a rank that is alive
but stuck; a worker whose rank 0 goes away fails the same way and exits. Errors are raised on rank 0 as
`WorkerFailure`, so `Engine.step()` fails loudly (the server reports its engine dead) instead of hanging.
"""

from __future__ import annotations

import atexit
import logging
import os
import queue
import sys
import threading
import time
import traceback
import weakref

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from dspark.config import EngineConfig
from dspark.distributed.group import STARTUP_TIMEOUT_S, TPGroup
from dspark.distributed.vocab_argmax import gather_argmax
from dspark.worker.model_runner import DTYPES, ModelRunner, StepBatch, allocate_kv_pool, kv_dtype
from dspark.sampling import RowArgmax

log = logging.getLogger(__name__)


class WorkerFailure(RuntimeError):
    """A tensor-parallel rank died, failed or stopped answering."""


def backend_for(device: str) -> str:
    return "nccl" if str(device).startswith("cuda") else "gloo"


def rank_device(device: str, rank: int, local_size: int | None = None) -> str:
    """Rank r of a CUDA engine runs on its node's cuda:(r mod ranks a node); CPU ranks share the CPU."""
    return f"cuda:{rank % (local_size or rank + 1)}" if str(device).startswith("cuda") else "cpu"


def threads_per_rank(config: EngineConfig) -> int | None:
    """CPU ranks split their host's cores (unless `num_threads` says): two ranks on a 2-core machine take one
    each."""
    if config.num_threads or not str(config.device).startswith("cpu"):
        return config.num_threads
    return max(1, (os.cpu_count() or 1) // config.parallel.local_size)


def load_full_target(config: EngineConfig):
    """The whole target on the CPU with fp32 products -> (model, model config, tokenizer); a model that
    `shard.check_shardable` refuses fails before any weight loads."""
    from dspark.distributed.shard import check_shardable
    from dspark.models.loader import load_model, read_model_config
    check_shardable(read_model_config(config.model))
    return load_model(config.model, dtype=DTYPES[config.dtype], device="cpu", decode_layout=False,
                      matmul_dtype="float32")


def shard_target(model, config: EngineConfig, tp: TPGroup, matmul_dtype: str, *, keep_full_vocab: bool = False):
    """Shard a `load_full_target` model for this rank, specialise its products (bf16 rounding) and move it to
    the rank's device, so no rank holds the whole model on a GPU. Returns the whole-vocabulary view the
    drafter shares (`keep_full_vocab`, rank 0), else None."""
    from dspark import kernels
    from dspark.distributed.shard import FullVocabView, shard_model
    from dspark.models.layers import add_decode_layout, use_bf16_products

    view = FullVocabView(model) if keep_full_vocab else None
    shard_model(model, tp)
    device = rank_device(config.device, tp.rank, config.parallel.local_size)
    if matmul_dtype == "bfloat16":
        use_bf16_products(model)
    elif device == "cpu" and not (model.lm_head.weight.dtype == torch.float32 and kernels.enabled()):
        add_decode_layout(model)
    model.to(device)
    if view is not None:
        view.to(device)
    return view


def _worker_main(rank: int, config: EngineConfig, matmul_dtype: str, address: tuple[str, int], events) -> None:
    """A worker's life: join the group, load its shard, allocate its KV pool, run forwards until stopped."""
    tp = store = None
    try:
        size = config.tensor_parallel_size
        threads = threads_per_rank(config)
        if threads:
            torch.set_num_threads(threads)
        if config.device.startswith("cuda"):
            torch.cuda.set_device(rank % config.parallel.local_size)
        events.put(("started", rank, ""))
        store = dist.TCPStore(address[0], address[1], size, is_master=False, timeout=_timedelta(STARTUP_TIMEOUT_S))
        tp = TPGroup.join(rank=rank, size=size, store=store, backend=backend_for(config.device),
                          timeout_s=config.parallel.distributed_timeout_s)
        model = load_full_target(config)[0]
        shard_target(model, config, tp, matmul_dtype)
        if not config.device.startswith("cuda"):
            from dspark import kernels
            kernels.ops()  # load (or build) the CPU kernels now, not inside the first step's collectives
        events.put(("ready", rank, ""))
        store.set(f"dspark/ready/{rank}", "1")  # what node 0 waits for from the ranks of other nodes
        message = tp.receive()
        while message[0] == "ping":  # heartbeats while rank 0 builds the drafter and the engine
            message = tp.receive()
        if message[0] == "stop":
            return
        kind, num_kv_blocks, kv_block_size = message
        if kind != "init":
            raise RuntimeError(f"expected the pool size from rank 0, got {message!r}")
        specs = model.kv_layer_specs() if hasattr(model, "kv_layer_specs") else [model.kv_spec] * model.num_kv_layers
        pool = allocate_kv_pool(specs, num_kv_blocks=num_kv_blocks,
                                kv_block_size=kv_block_size,
                                dtype=kv_dtype(config.cache.kv_cache_dtype, DTYPES[config.dtype]),
                                device=rank_device(config.device, rank, config.parallel.local_size))
        runner = ModelRunner(model, kv_caches=pool, kv_block_size=kv_block_size,
                             device=rank_device(config.device, rank, config.parallel.local_size))
        while True:
            message = tp.receive()
            if message[0] == "stop":
                break
            if message[0] == "forward":
                forward_shard(runner, runner.to_device(message[1]), with_taps=False)
    except BaseException:  # noqa: BLE001 - reported to rank 0 (and on stderr), then the process ends
        detail = traceback.format_exc()
        print(f"dspark tensor-parallel rank {rank} failed:\n{detail}", file=sys.stderr, flush=True)
        events.put(("error", rank, detail))
        _publish_error(store, rank, detail)
        time.sleep(0.5)  # let the queue's feeder thread hand the message over
        os._exit(1)
    finally:
        if tp is not None:
            tp.close()


@torch.inference_mode()
def forward_shard(runner: ModelRunner, batch: StepBatch, *,
                  with_taps: bool) -> tuple["torch.Tensor | RowArgmax | None", torch.Tensor | None]:
    """This rank's part of one step -> (on rank 0 the logits [num_logits, vocab_size] fp32, or their
    `RowArgmax` merged from the ranks' slice winners where the batch is `argmax_only`; None elsewhere;
    taps)."""
    model = runner.model
    hidden, taps = model(batch.input_ids, batch.positions, batch.attn_meta, runner.kv_caches,
                         tap_layer_ids=runner.tap_layer_ids if with_taps else ())
    local = model.compute_logits(hidden[batch.logits_indices]).float()  # [num_logits, V / size] fp32
    if batch.host is not None and batch.host.argmax_only:  # [num_logits, 2] per rank, not the slices
        return gather_argmax(model.tp, local, model.vocab_start, model.full_vocab_size), taps
    logits = model.tp.gather_cat(local)
    return (None if logits is None else logits[:, :model.full_vocab_size]), taps


def _publish_error(store, rank: int, detail: str) -> None:
    """A rank's failure where node 0 reads it (a rank of another node has no event queue to rank 0)."""
    if store is not None:
        try:
            store.set(f"dspark/error/{rank}", detail[-4000:])
        except Exception:  # noqa: BLE001 - the store is gone with node 0: nobody to tell
            pass


def run_node(config: EngineConfig, matmul_dtype: str) -> int:
    """A node of --node-rank > 0: agree with node 0 on the configuration (before loading anything), then run
    this node's ranks (the first in this process, the others started here) until node 0 stops them or goes
    away. Returns the exit code."""
    from dspark.distributed.rendezvous import agree, fingerprint, local_ranks, open_store, store_address
    parallel = config.parallel
    store = open_store(parallel, master=False)
    agree(store, parallel, fingerprint(config, matmul_dtype))  # ConfigMismatch names what differs
    first, *others = local_ranks(parallel)
    ctx = mp.get_context("spawn")
    events = ctx.Queue()
    address = store_address(parallel, store)
    procs = [ctx.Process(target=_worker_main, args=(rank, config, matmul_dtype, address, events),
                         name=f"dspark-tp{rank}", daemon=True) for rank in others]
    for p in procs:
        p.start()
    log.info("node %d of %d: tensor-parallel ranks %d..%d, rendezvous at %s:%d", parallel.node_rank,
             parallel.nnodes, first, first + len(others), *address)
    _worker_main(first, config, matmul_dtype, address, queue.Queue())  # exits the process if it fails
    for p in procs:
        p.join()
    return max([0] + [p.exitcode or 0 for p in procs])


def _timedelta(seconds: float):
    from datetime import timedelta
    return timedelta(seconds=seconds)


class Workers:
    """Rank 0's handle on the worker processes (ranks 1 .. size - 1)."""

    def __init__(self, config: EngineConfig, matmul_dtype: str, store: dist.TCPStore | None = None) -> None:
        """`store`: the rendezvous `rendezvous.open_store` opened (and checked the other nodes against);
        else one on 127.0.0.1 for ranks on this host alone."""
        from dspark.distributed.rendezvous import local_ranks, open_store, remote_ranks, store_address
        size = config.tensor_parallel_size
        if config.device.startswith("cuda"):
            if ":" in config.device:
                raise ValueError(f"tensor_parallel_size {size} runs on cuda:0 .. cuda:{size - 1}; "
                                 f"give device 'cuda', not {config.device!r}")
            if torch.cuda.device_count() < config.parallel.local_size:
                raise ValueError(f"tensor_parallel_size {size} needs {config.parallel.local_size} GPUs a node; torch sees "
                                 f"{torch.cuda.device_count()}")
            torch.cuda.set_device(0)
        self.config, self.size = config, size
        self.timeout_s = config.parallel.distributed_timeout_s
        store = store or open_store(config.parallel, master=True)
        self.remote = remote_ranks(config.parallel)  # ranks of the other nodes (started on their own hosts)
        ctx = mp.get_context("spawn")
        self.events = ctx.Queue()
        address = store_address(config.parallel, store)
        self.procs = [ctx.Process(target=_worker_main, args=(rank, config, matmul_dtype, address, self.events),
                                  name=f"dspark-tp{rank}", daemon=True) for rank in local_ranks(config.parallel)[1:]]
        for p in self.procs:
            p.start()
        self._store = store
        self.closed = False
        try:
            self._wait_for("started", deadline_s=STARTUP_TIMEOUT_S)  # a worker that dies importing fails here
            self.tp = TPGroup.join(rank=0, size=size, store=store, backend=backend_for(config.device),
                                   timeout_s=self.timeout_s)
        except BaseException:
            for p in self.procs:
                p.kill()
            raise
        self.failure: BaseException | None = None  # a heartbeat that could not be sent
        self._send_lock = threading.Lock()
        self._last_send = time.monotonic()
        atexit.register(_close_ref(weakref.ref(self)))

    def send(self, message) -> None:
        """Broadcast a control message to the workers (the engine thread and the heartbeat share it)."""
        with self._send_lock:
            if self.failure is not None:
                raise WorkerFailure(f"tensor-parallel group failed: {self.failure}") from self.failure
            try:
                self.tp.send(message)
            except RuntimeError as e:  # a peer gone (gloo) or the timeout
                self.failure = e
                time.sleep(0.2)  # let a dying worker's exit code and message arrive
                self.check_alive()
                raise WorkerFailure(f"tensor-parallel control message failed: {e}") from e
            self._last_send = time.monotonic()

    def _heartbeat(self) -> None:
        """A message at least every third of the timeout, so a worker waiting through an idle spell of the
        server is never timed out; stops at close or at the first failure."""
        period = self.timeout_s / 3
        while not self.closed and self.failure is None:
            time.sleep(min(period, 1.0))
            if self.closed or time.monotonic() - self._last_send < period:
                continue
            try:
                self.send(("ping",))
            except BaseException as e:  # noqa: BLE001 - raised by the next step instead
                if not self.closed:
                    self.failure = e
                    log.error("tensor-parallel heartbeat failed: %s", e)

    def wait_ready(self) -> None:
        """Block until every worker has loaded its shard; a worker that fails or dies first raises."""
        self._wait_for("ready", deadline_s=max(self.timeout_s, STARTUP_TIMEOUT_S))
        if self.remote:
            from dspark.distributed.rendezvous import wait_remote_ready
            wait_remote_ready(self._store, self.remote, max(self.timeout_s, STARTUP_TIMEOUT_S), WorkerFailure)
        threading.Thread(target=self._heartbeat, name="dspark-tp-heartbeat", daemon=True).start()

    def _wait_for(self, what: str, *, deadline_s: float) -> None:
        done: set[int] = set()
        deadline = time.monotonic() + deadline_s
        while len(done) < len(self.procs):
            self.check_alive()
            try:
                kind, rank, detail = self.events.get(timeout=0.5)
            except queue.Empty:
                if time.monotonic() > deadline:
                    raise WorkerFailure(f"tensor-parallel workers not {what} after {deadline_s:.0f} s") from None
                continue
            if kind == "error":
                raise WorkerFailure(f"tensor-parallel rank {rank} failed:\n{detail}")
            if kind == what:
                done.add(rank)

    def check_alive(self) -> None:
        for rank, p in enumerate(self.procs, start=1):
            if p.exitcode is not None:
                detail = self._error_detail(rank)
                raise WorkerFailure(f"tensor-parallel rank {rank} exited with code {p.exitcode}"
                                    + (f":\n{detail}" if detail else ""))

    def _error_detail(self, rank: int) -> str:
        try:
            while True:
                kind, r, detail = self.events.get_nowait()
                if kind == "error" and r == rank:
                    return detail
        except (queue.Empty, OSError, ValueError):
            return ""

    def init_pools(self, num_kv_blocks: int, kv_block_size: int) -> None:
        self.send(("init", num_kv_blocks, kv_block_size))

    def close(self) -> None:
        """Stop the workers (they leave their loop), then the group."""
        if self.closed:
            return
        self.closed = True
        try:
            if all(p.exitcode is None for p in self.procs) and self.failure is None:
                with self._send_lock:
                    self.tp.send(("stop",))
        except Exception:  # noqa: BLE001 - a dead peer: nothing left to tell
            pass
        for p in self.procs:
            p.join(5.0)
            if p.exitcode is None:
                p.kill()
                p.join(5.0)
        self.tp.close()


def _close_ref(ref):
    def close():
        workers = ref()
        if workers is not None:
            workers.close()
    return close


class TPModelRunner(ModelRunner):
    """Rank 0's runner: the same interface as `ModelRunner`; each forward is a step of every rank. A step
    that reads only the argmax of its logits rows gathers the ranks' slice winners, not the slices
    (`head_argmax`, unless `vocab_parallel_argmax` is off)."""

    def __init__(self, runner: ModelRunner, workers: Workers) -> None:
        super().__init__(runner.model, kv_caches=runner.kv_caches, kv_block_size=runner.kv_block_size,
                         device=runner.device, tap_layer_ids=runner.tap_layer_ids)
        self.workers = workers
        self.head_argmax = workers.config.parallel.vocab_parallel_argmax
        workers.init_pools(runner.kv_caches[0][0].shape[0], runner.kv_block_size)

    def forward(self, batch: StepBatch, *, with_taps: bool = True) -> tuple["torch.Tensor | RowArgmax",
                                                                             torch.Tensor | None]:
        workers = self.workers
        if workers.closed:
            raise WorkerFailure("the tensor-parallel workers were shut down")
        if workers.failure is not None:
            raise WorkerFailure(f"tensor-parallel group failed: {workers.failure}")
        try:
            workers.check_alive()
            workers.send(("forward", batch.host))
            return forward_shard(self, batch, with_taps=with_taps)
        except WorkerFailure as e:
            workers.failure = workers.failure or e
            raise
        except RuntimeError as e:  # gloo: a peer closed its socket; NCCL / gloo: the group timeout
            workers.failure = workers.failure or e
            time.sleep(0.2)  # let a dying worker's exit code and message arrive
            try:
                workers.check_alive()
            except WorkerFailure as dead:
                raise dead from e
            raise WorkerFailure(f"tensor-parallel step failed: {e}") from e
