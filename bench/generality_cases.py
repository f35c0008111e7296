"""The generality accuracy set of issue 12: steps none of the estimator's rules were tuned on.

Each case: (name, kind, spec fields). kind "spec": memlens' prepared step (bench/gpu_truth.py's
run_case); kind "trainer": a real transformers.Trainer.train() of 3 steps with the model memlens
builds, its TrainingArguments written next to the results (the CPU side estimates it three ways:
hand-typed flags, --trainer-args of that file, estimate_trainer on a Trainer rebuilt on the CPU).
Part 1 runs eager steps, part 2 the Trainer and --compile cases (each part ~4 minutes on an H100).
"""

# Trainer cases: spec fields = what the hand-typed flags say; "args" = the TrainingArguments given
TRAINER = [
    ("trainer-defaults-qwen0.5b-bf16-b4-L1024", "trainer",
     dict(model="qwen2.5-0.5b", batch_size=4, seq_len=1024, precision="amp-bf16", optimizer="adamw-fused", max_grad_norm=1.0,
          hf_trainer=True),
     dict(per_device_train_batch_size=4, bf16=True)),
    ("trainer-fp32-accum4-gpt2m-b4-L512", "trainer",
     dict(model="gpt2-medium", batch_size=4, seq_len=512, grad_accum=4, optimizer="adamw-fused", max_grad_norm=1.0, hf_trainer=True),
     dict(per_device_train_batch_size=4, gradient_accumulation_steps=4)),
]

CASES = [
    # part 1: eager steps of memlens' own loop
    ("llama1b-bf16-adamw-fused-b4-L1024", "spec", dict(model="llama-3.2-1b", batch_size=4, seq_len=1024, precision="bf16", optimizer="adamw-fused")),
    ("gpt2l-ampbf16-adamw-foreach-clip-b4-L1024", "spec", dict(model="gpt2-large", batch_size=4, seq_len=1024, precision="amp-bf16", optimizer="adamw", max_grad_norm=1.0)),
    ("t5base-ampbf16-b16-L512-T128", "spec", dict(model="t5-base", batch_size=16, seq_len=512, target_len=128, precision="amp-bf16")),
    ("bartbase-fp32-b16-L512-T256", "spec", dict(model="bart-base", batch_size=16, seq_len=512, target_len=256)),
    ("bertlarge-ampfp16-eager-b16-L512", "spec", dict(model="bert-large-uncased", batch_size=16, seq_len=512, precision="amp-fp16", attn="eager")),
    ("bertlarge-ampfp16-sdpa-b32-L512", "spec", dict(model="bert-large-uncased", batch_size=32, seq_len=512, precision="amp-fp16")),
    ("convnext-tiny-ampbf16-b64", "spec", dict(model="convnext-tiny-224", batch_size=64, precision="amp-bf16")),
    ("resnet50-fp32-b64", "spec", dict(model="resnet-50", batch_size=64)),
    ("timm-vit-small-ampbf16-b128", "spec", dict(model="timm:vit_small_patch16_224", batch_size=128, precision="amp-bf16")),
    ("torchvision-resnet50-ampfp16-b64", "spec", dict(model="torchvision:resnet50", batch_size=64, precision="amp-fp16")),
    ("custom-cnn-labels-fp32-b64", "spec", dict(model="bench.generality_models:cnn", batch_size=64, max_grad_norm=1.0)),
    ("gemma2b-bf16-b2-L1024", "spec", dict(model="gemma-2b", batch_size=2, seq_len=1024, precision="bf16")),
    ("phi1.5-bf16-adamw-fused-b4-L1024", "spec", dict(model="phi-1.5", batch_size=4, seq_len=1024, precision="bf16", optimizer="adamw-fused")),
    ("olmoe-1b-7b-bf16-sgd-b2-L1024", "spec", dict(model="olmoe-1b-7b", batch_size=2, seq_len=1024, precision="bf16", optimizer="sgd")),
    ("llama1b-bf16-b1-L8192", "spec", dict(model="llama-3.2-1b", batch_size=1, seq_len=8192, precision="bf16")),
    ("whisper-small-ampbf16-b16", "spec", dict(model="whisper-small", batch_size=16, precision="amp-bf16")),
    # part 2: the Trainer and torch.compile
    *[(n, k, f) for n, k, f, _ in TRAINER],
    ("gpt2-ampbf16-compile-b8-L1024", "spec", dict(model="gpt2", batch_size=8, seq_len=1024, precision="amp-bf16", compile=True)),
    ("llama1b-bf16-compile-b2-L2048", "spec", dict(model="llama-3.2-1b", batch_size=2, seq_len=2048, precision="bf16", compile=True)),
]
PART2 = {n for n, _, _, _ in TRAINER} | {"gpt2-ampbf16-compile-b8-L1024", "llama1b-bf16-compile-b2-L2048"}
TRAINER_ARGS = {n: a for n, _, _, a in TRAINER}
