"""The Opacus (DP-SGD) accuracy cases of issue 11: real Opacus on one H100 vs `memlens estimate`.

Hooks and ghost clipping; bf16, fp32 and AMP bf16; LoRA ranks 8 to 64 on q,v and on every linear
layer; Opacus' BatchMemoryManager with physical batches of 1/4 and 1/2 of the logical batch; a long
sequence where ghost clipping's T x T Gram matrices dominate (a small Llama-shaped config, 32k
tokens); a 1B-shaped (Llama 3.2 1B) and an 8B-shaped (Llama 3.1 8B) Llama. Random weights, built
by memlens' builder on the device; the same spec is estimated on the CPU.
"""

QV = ("q_proj", "v_proj")
ALL = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
LONG = "bench/opacus_configs/llama-small-long"     # hidden 512, 4 layers, vocab 8192, 32k positions


def _c(model, **kw):
    return dict(model=model, dp=True, **{"optimizer": "sgd", **kw})


CASES = [
    # name, spec fields
    ("llama1b-bf16-lora8-qv-hooks-b8-L512", _c("llama-3.2-1b", precision="bf16", lora_rank=8, lora_targets=QV, batch_size=8, seq_len=512)),
    ("llama1b-fp32-lora16-qv-hooks-adamw-b4-L512", _c("llama-3.2-1b", lora_rank=16, lora_targets=QV, batch_size=4, seq_len=512, optimizer="adamw")),
    ("llama1b-bf16-lora16-all-hooks-b8-L512", _c("llama-3.2-1b", precision="bf16", lora_rank=16, lora_targets=ALL, batch_size=8, seq_len=512)),
    ("llama1b-bf16-lora64-qv-hooks-b8-L512", _c("llama-3.2-1b", precision="bf16", lora_rank=64, lora_targets=QV, batch_size=8, seq_len=512)),
    ("llama1b-bf16-lora64-all-ghost-b8-L512", _c("llama-3.2-1b", precision="bf16", lora_rank=64, lora_targets=ALL, batch_size=8, seq_len=512, grad_sample_mode="ghost")),
    ("llama1b-bf16-lora32-qv-ghost-adamw-b8-L256", _c("llama-3.2-1b", precision="bf16", lora_rank=32, lora_targets=QV, batch_size=8, seq_len=256, grad_sample_mode="ghost", optimizer="adamw")),
    ("llama1b-fp32-lora8-all-ghost-b4-L256", _c("llama-3.2-1b", lora_rank=8, lora_targets=ALL, batch_size=4, seq_len=256, grad_sample_mode="ghost")),
    ("llama1b-bf16-lora16-qv-hooks-b16-pb4-L512", _c("llama-3.2-1b", precision="bf16", lora_rank=16, lora_targets=QV, batch_size=16, physical_batch_size=4, seq_len=512)),
    ("llama1b-bf16-lora16-qv-ghost-b16-pb8-L512", _c("llama-3.2-1b", precision="bf16", lora_rank=16, lora_targets=QV, batch_size=16, physical_batch_size=8, seq_len=512, grad_sample_mode="ghost")),
    ("llama1b-ampbf16-lora8-all-hooks-b8-pb2-L512", _c("llama-3.2-1b", precision="amp-bf16", lora_rank=8, lora_targets=ALL, batch_size=8, physical_batch_size=2, seq_len=512)),
    ("small-long-bf16-lora8-qv-ghost-b2-L32768", _c(LONG, precision="bf16", lora_rank=8, lora_targets=QV, batch_size=2, seq_len=32768, grad_sample_mode="ghost")),
    ("small-long-bf16-lora8-qv-hooks-b2-L32768", _c(LONG, precision="bf16", lora_rank=8, lora_targets=QV, batch_size=2, seq_len=32768)),
    ("llama8b-bf16-lora16-qv-hooks-b4-pb2-L512", _c("llama-3.1-8b", precision="bf16", lora_rank=16, lora_targets=QV, batch_size=4, physical_batch_size=2, seq_len=512)),
    ("llama8b-bf16-lora8-all-ghost-b2-L1024", _c("llama-3.1-8b", precision="bf16", lora_rank=8, lora_targets=ALL, batch_size=2, seq_len=1024, grad_sample_mode="ghost")),
]
