"""Step time, priced per operator of the simulated step (issue 36).

- :mod:`.tables`: a GPU's measured (or data-sheet) rates: matmul TFLOP/s by shape and dtype, attention by
  sequence length, bandwidth by size, kernel floor and host dispatch per op, PCIe, NCCL by message size;
- :mod:`.ops`: what one aten op costs in those units (FLOPs and GEMM shape, bytes moved, nothing for views);
- :mod:`.record`: the hook the simulation calls on every op, pricing step 1's first micro-batch;
- :mod:`.step`: step seconds and their parts (forward, backward, recompute, optimizer, collectives, host,
  offload), tokens/s and MFU, from the priced ops and the step's facts.
"""
