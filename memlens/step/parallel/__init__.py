"""Several GPUs: what each ``--sharding`` runs for one rank (DDP, ZeRO-1, FSDP2, Opacus' DPDDP), its refusals,
which ranks can differ, and the fake process group under which a rank is simulated on this CPU.

:mod:`.base` holds the wrapper interface and the registry :func:`memlens.step.prepare` asks; :mod:`.ddp`,
:mod:`.dpddp`, :mod:`.fsdp` the wrappers; :mod:`.fakepg` one rank of an N-GPU job in this process.
Importing this package imports neither torch nor torch.distributed.
"""
