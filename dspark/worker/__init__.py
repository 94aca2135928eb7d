"""The worker layer below the engine: the model runner (step tensors, the target forward, the KV pool) and its
CUDA-graph replay; `dspark.distributed` drives tensor-parallel ranks through the same runner."""
