"""The per-rank accuracy cases (issue 10), for any world size: DDP (fp32, bf16, bucket views),
ZeRO-1, FSDP2 (bf16; fp32 params + bf16 compute + checkpointing; reshard_after_forward=False;
LoRA on an 8B-shaped Llama; an 8B Llama with checkpointing), a GPT-2 and a Llama family."""


def cases(world_size: int) -> list[tuple[str, dict]]:
    n = world_size
    d = {"world_size": n}
    return [
        ("ddp-gpt2-fp32-b4-L512", dict(model="gpt2", batch_size=4, seq_len=512, sharding="ddp", **d)),
        ("ddp-gpt2-ampbf16-b8-L512", dict(model="gpt2", batch_size=8, seq_len=512, precision="amp-bf16", sharding="ddp", **d)),
        ("ddp-gpt2-bucketview-fp32-b4-L512", dict(model="gpt2", batch_size=4, seq_len=512, sharding="ddp",
                                                   gradient_as_bucket_view=True, **d)),
        ("ddp-llama1b-bf16-b2-L1024", dict(model="llama-3.2-1b", batch_size=2, seq_len=1024, precision="bf16", sharding="ddp", **d)),
        ("zero1-gpt2m-fp32-b2-L512", dict(model="gpt2-medium", batch_size=2, seq_len=512, sharding="zero1", **d)),
        # issue 37: GPT-2 medium amp-bf16 (bench/gpu_ddp_gpt2_probe.py's shape) and Llama under ZeRO-1
        ("ddp-gpt2m-ampbf16-b4-L512", dict(model="gpt2-medium", batch_size=4, seq_len=512, precision="amp-bf16", sharding="ddp", **d)),
        ("zero1-gpt2m-ampbf16-b4-L512", dict(model="gpt2-medium", batch_size=4, seq_len=512, precision="amp-bf16", sharding="zero1",
                                              **d)),
        ("zero1-llama1b-bf16-b2-L1024", dict(model="llama-3.2-1b", batch_size=2, seq_len=1024, precision="bf16", sharding="zero1",
                                              **d)),
        ("fsdp-llama1b-bf16-b4-L1024", dict(model="llama-3.2-1b", batch_size=4, seq_len=1024, precision="bf16", sharding="fsdp", **d)),
        ("fsdp-llama1b-ampbf16-ckpt-b4-L2048", dict(model="llama-3.2-1b", batch_size=4, seq_len=2048, precision="amp-bf16",
                                                     grad_checkpointing=True, sharding="fsdp", **d)),
        ("zero2-llama1b-bf16-b4-L1024", dict(model="llama-3.2-1b", batch_size=4, seq_len=1024, precision="bf16", sharding="zero2", **d)),
        ("fsdp-gpt2m-ampbf16-b4-L1024", dict(model="gpt2-medium", batch_size=4, seq_len=1024, precision="amp-bf16", sharding="fsdp", **d)),
        ("fsdp-llama3b-bf16-ckpt-b2-L2048", dict(model="llama-3.2-3b", batch_size=2, seq_len=2048, precision="bf16",
                                                  grad_checkpointing=True, sharding="fsdp", **d)),
        ("fsdp-llama8b-lora16-bf16-b2-L1024", dict(model="llama-3.1-8b", batch_size=2, seq_len=1024, precision="bf16", lora_rank=16,
                                                    sharding="fsdp", **d)),
        ("fsdp-llama8b-bf16-ckpt-b1-L2048", dict(model="llama-3.1-8b", batch_size=1, seq_len=2048, precision="bf16",
                                                  grad_checkpointing=True, sharding="fsdp", **d)),
    ]


UNTIED_1B = "bench/opacus_configs/llama-1b-untied"   # Llama-3.2-1B's shape with an untied lm_head (as the 8B)


def dp_cases(world_size: int) -> list[tuple[str, dict]]:
    """DP-SGD per rank (issue 27; needs opacus on the GPU machine): Opacus ghost clipping under FSDP2 (FSDP2Wrapper,
    grad_sample_mode ghost_fsdp) with LoRA r16 on q,v of a 1B-shaped and the 8B untied Llama, bf16, with one
    physical batch (physical = logical) and with BatchMemoryManager (physical < logical); DPDDP hooks and ghost."""
    d = {"world_size": world_size, "dp": True, "precision": "bf16", "lora_rank": 16}
    fsdp = dict(sharding="fsdp", grad_sample_mode="ghost", **d)
    return [
        ("ghostfsdp-llama1bu-lora16-b4-pb4-L256", dict(model=UNTIED_1B, batch_size=4, physical_batch_size=4, seq_len=256, **fsdp)),
        ("ghostfsdp-llama1bu-lora16-b8-pb8-L512", dict(model=UNTIED_1B, batch_size=8, physical_batch_size=8, seq_len=512, **fsdp)),
        ("ghostfsdp-llama1bu-lora16-b8-pb2-L512-bmm", dict(model=UNTIED_1B, batch_size=8, physical_batch_size=2, seq_len=512, **fsdp)),
        ("ghostfsdp-llama8b-lora16-b4-pb4-L256", dict(model="llama-3.1-8b", batch_size=4, physical_batch_size=4, seq_len=256, **fsdp)),
        ("ghostfsdp-llama8b-lora16-b4-pb1-L512-bmm", dict(model="llama-3.1-8b", batch_size=4, physical_batch_size=1, seq_len=512, **fsdp)),
        ("ghostfsdp-llama8b-lora16-b8-pb2-L256-bmm", dict(model="llama-3.1-8b", batch_size=8, physical_batch_size=2, seq_len=256, **fsdp)),
        ("dpddp-llama1b-lora16-bf16-b8-pb4-L256", dict(model="llama-3.2-1b", batch_size=8, physical_batch_size=4, seq_len=256,
                                                        sharding="ddp", **d)),
        ("dpddp-ghost-llama1b-lora16-b8-pb4-L256", dict(model="llama-3.2-1b", batch_size=8, physical_batch_size=4, seq_len=256,
                                                         sharding="ddp", grad_sample_mode="ghost", **d)),
    ]
