"""The nouns every verb shares: the spec, the Result, events and the ledger, the fit rule, and the facts
registries (GPUs, shardings, precisions, optimizers, techniques). Imports nothing else of memlens."""
