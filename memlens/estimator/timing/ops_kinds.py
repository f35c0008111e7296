"""The pricing classes of an op (memlens.estimator.timing.ops), importable without torch."""
VIEW, ALLOC, MEMORY, MATMUL, CONV, ATTN_FWD, ATTN_BWD, SYNC = "view", "alloc", "memory", "matmul", "conv", "attn_fwd", "attn_bwd", "sync"
