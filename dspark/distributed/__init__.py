"""Tensor parallelism of the target over torch.distributed: `group` (ranks and collectives), `shard` (the
parallel layers, applied to a loaded model by structure), `runner` (worker processes and rank 0's runner).
Started by `build_engine` when `ParallelConfig.tensor_parallel_size` > 1."""
