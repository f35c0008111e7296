"""The pricing classes of an op (memlens.estimator.timing.ops), importable without torch."""
VIEW, ALLOC, MEMORY, MATMUL, CONV, ATTN_FWD, ATTN_BWD, SYNC = "view", "alloc", "memory", "matmul", "conv", "attn_fwd", "attn_bwd", "sync"
# a metadata query (prim::device, prim::layout, ...): it reaches the dispatcher only for tensor subclasses such as the
# simulation's fake tensors; eager PyTorch answers it in C++ without dispatching: no row, no host cost
META = "meta"
# a functional collective (DTensor's tensor / context parallel: on the compute stream's critical path); FSDP2's and
# DDP's c10d collectives are priced per step instead (memlens.estimator.timing.step.collective_seconds)
COMM = "comm"
# FSDP2's all-gather of one parameter group (its NCCL kernel on the all-gather stream; the compute stream waits for it
# before the copy-out): a row of the launch queue on a side stream (memlens.estimator.timing.step.queue)
GATHER = "gather"
# a module's forward called (nn.Module.__call__: its hooks, its Python forward around the ops): host time, no kernel
MODULE = "module"
# a checkpointed call entered (torch.utils.checkpoint in forward, its recomputation in backward): the frame, RNG states and
# saved-tensor hooks it runs on the host, per call (memlens.measure.calibrate.ckpt_layer_costs), no kernel
CKPT = "ckpt"
# the softmax ops a table measures by row width (memlens.estimator.timing.ops._row_width): ``<op>/w<W>`` over fp32 rows,
# ``<op>/w<W>/16bit`` over bf16 / fp16 ones
SOFTMAX_OPS = frozenset({"_softmax", "_log_softmax", "_softmax_backward_data", "_log_softmax_backward_data"})
SOFTMAX_WIDTHS = (1024, 2048, 4096, 8192, 16384, 32768, 50257, 65536, 131072, 262144)
HALF_ROWS = "/16bit"
# layer norm's rows (the normalized width) a table measures it at: ``native_layer_norm/w<W>`` over 16-bit rows,
# ``.../w<W>/fp32`` over fp32 ones (Swin-T's 96 ... 768, GPT-2 XL's 1,600, the common hidden sizes)
LAYER_NORM_OPS = frozenset({"native_layer_norm", "native_layer_norm_backward"})
LAYER_NORM_WIDTHS = (96, 192, 384, 768, 1024, 1600, 2048, 4096, 8192)
