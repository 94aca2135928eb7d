"""Where a tensor-parallel group meets, and the check that its nodes agree before any weight loads.

On one host rank 0 holds a TCP store on 127.0.0.1 (an OS-chosen port) and starts its workers itself. Across
hosts (`--nnodes N --node-rank n --master-addr A --master-port P`, vLLM's and torchrun's flags, or torchrun's
environment: `MASTER_ADDR`, `MASTER_PORT`, `RANK`, `WORLD_SIZE`), each host is started on its own: node 0
holds the store at A:P (under torchrun its agent does) and serves HTTP, node n runs ranks n*k .. n*k + k - 1 (k = tensor_parallel_size / N)
headless. Processes that do not share a parent share nothing but these flags, so each node publishes a
fingerprint of its configuration (the model's config, dtypes, sizes) in the store; node 0 compares them and
publishes its verdict, and every node stops with the same message naming what differs, before loading weights.
A rank that fails after that publishes its error under `dspark/error/<rank>`; node 0 waits for every remote
rank's `dspark/ready/<rank>` (its shard loaded) the same way.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import time
from datetime import timedelta

import torch.distributed as dist

from dspark.config import EngineConfig, ParallelConfig

STORE_TIMEOUT_S = 600.0  # a node that does not show up in this long is an error
POLL_S = 0.1
ACK_TIMEOUT_S = 30.0  # how long node 0 keeps its store up for the others to read a refusal
VERDICT = "dspark/config/verdict"


class ConfigMismatch(RuntimeError):
    """The nodes of one tensor-parallel group were started with different models or settings."""


def from_environment(parallel: ParallelConfig, environ) -> ParallelConfig:
    """torchrun's variables (one process a node) where the flags leave the group on one host."""
    world = int(environ.get("WORLD_SIZE", "1") or 1)
    if parallel.nnodes > 1 or world <= 1:
        return parallel
    return dataclasses.replace(parallel, nnodes=world, node_rank=int(environ.get("RANK", "0")),
                               master_addr=environ.get("MASTER_ADDR", parallel.master_addr),
                               master_port=int(environ.get("MASTER_PORT", parallel.master_port)))


def local_ranks(parallel: ParallelConfig) -> range:
    """The global ranks this node runs (rank 0 on node 0)."""
    k = parallel.local_size
    return range(parallel.node_rank * k, (parallel.node_rank + 1) * k)


def remote_ranks(parallel: ParallelConfig) -> list[int]:
    """The ranks on the other nodes (none on one host)."""
    return [r for r in range(parallel.tensor_parallel_size) if r not in local_ranks(parallel)]


def open_store(parallel: ParallelConfig, *, master: bool) -> dist.TCPStore:
    """Node 0's store (`master`), or a client of it; on one host 127.0.0.1 and a free port."""
    timeout = timedelta(seconds=STORE_TIMEOUT_S)
    if parallel.nnodes == 1:
        return dist.TCPStore("127.0.0.1", 0, parallel.tensor_parallel_size, is_master=True,
                             wait_for_workers=False, timeout=timeout)
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":  # torchrun's agent holds the store at A:P
        master = False
    return dist.TCPStore(parallel.master_addr, parallel.master_port, parallel.tensor_parallel_size,
                         is_master=master, wait_for_workers=False, timeout=timeout)


def store_address(parallel: ParallelConfig, store: dist.TCPStore) -> tuple[str, int]:
    """Where this node's own workers reach the store."""
    return ("127.0.0.1", store.port) if parallel.nnodes == 1 else (parallel.master_addr, parallel.master_port)


def fingerprint(config: EngineConfig, matmul_dtype: str) -> dict:
    """What every node must agree on: the target's configuration (from its checkpoint header; the paths
    may differ between hosts), the dtypes, the group's shape."""
    from dspark.models.loader import read_model_config
    model = read_model_config(config.model)
    digest = hashlib.sha256(json.dumps(dataclasses.asdict(model), sort_keys=True, default=str).encode())
    p = config.parallel
    return {"model": f"{model.architecture} {digest.hexdigest()[:16]}", "dtype": config.dtype,
            "matmul_dtype": matmul_dtype, "kv_cache_dtype": config.cache.kv_cache_dtype,
            "device": "cuda" if str(config.device).startswith("cuda") else "cpu",
            "tensor_parallel_size": p.tensor_parallel_size, "nnodes": p.nnodes,
            "distributed_timeout_s": p.distributed_timeout_s}


def differences(node: int, theirs: dict, ours: dict) -> list[str]:
    return [f"{key}: node {node} has {theirs.get(key)!r}, node 0 has {ours.get(key)!r}"
            for key in sorted(set(ours) | set(theirs)) if theirs.get(key) != ours.get(key)]


def agree(store: dist.TCPStore, parallel: ParallelConfig, mine: dict) -> None:
    """Every node's fingerprint against node 0's; raises `ConfigMismatch` naming what differs, on every node.
    One host: nothing to compare (its workers are started with rank 0's own configuration)."""
    if parallel.nnodes == 1:
        return
    store.set(f"dspark/config/{parallel.node_rank}", json.dumps(mine))
    if parallel.node_rank == 0:
        problems = []
        for node in range(1, parallel.nnodes):
            theirs = json.loads(wait_get(store, f"dspark/config/{node}", f"node {node}'s configuration"))
            problems += differences(node, theirs, mine)
        verdict = ("tensor-parallel nodes disagree on their configuration (start every node with the same model "
                   "and flags): " + "; ".join(problems)) if problems else "ok"
        store.set(VERDICT, verdict)
        if problems:  # the store lives in this process: keep it until every node has read the verdict
            for node in range(1, parallel.nnodes):
                try:
                    wait_get(store, f"dspark/config/read/{node}", f"node {node}'s receipt", ACK_TIMEOUT_S)
                except TimeoutError:
                    pass
    else:
        verdict = wait_get(store, VERDICT, "node 0's verdict on the configurations")
        store.set(f"dspark/config/read/{parallel.node_rank}", "1")
    if verdict != "ok":
        raise ConfigMismatch(verdict)


def wait_get(store: dist.TCPStore, key: str, what: str, timeout_s: float = STORE_TIMEOUT_S) -> str:
    deadline = time.monotonic() + timeout_s
    try:
        while not store.check([key]):
            if time.monotonic() > deadline:
                raise TimeoutError(f"tensor-parallel rendezvous: no {what} after {timeout_s:.0f} s")
            time.sleep(POLL_S)
        return store.get(key).decode()
    except dist.DistError as e:  # the store's node went away
        raise RuntimeError(f"tensor-parallel rendezvous: node 0's store closed while waiting for {what}: "
                           f"{e}") from None


def wait_remote_ready(store: dist.TCPStore, ranks: list[int], timeout_s: float, failure: type[Exception]) -> None:
    """Until every remote rank has loaded its shard; one that failed raises `failure` with its error."""
    pending, deadline = set(ranks), time.monotonic() + timeout_s
    while pending:
        for rank in sorted(pending):
            if store.check([f"dspark/error/{rank}"]):
                raise failure(f"tensor-parallel rank {rank} failed:\n{store.get(f'dspark/error/{rank}').decode()}")
            if store.check([f"dspark/ready/{rank}"]):
                pending.discard(rank)
        if pending and time.monotonic() > deadline:
            raise failure(f"tensor-parallel ranks {sorted(pending)} not ready after {timeout_s:.0f} s")
        time.sleep(POLL_S if pending else 0)
