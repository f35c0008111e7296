"""The Trainer flavour of the step: accelerate's fp32 outputs, and the order of clip and step."""
import torch

from memlens.step.loop import outputs_to_fp32, train_step


def test_outputs_to_fp32_is_accelerates_conversion():
    from transformers.modeling_outputs import CausalLMOutput

    out = CausalLMOutput(loss=torch.ones((), dtype=torch.float32), logits=torch.ones(2, 3, dtype=torch.bfloat16))
    half_logits = out.logits
    conv = outputs_to_fp32(out)
    assert conv.logits.dtype == torch.float32 and conv["logits"].dtype == torch.float32
    assert conv.loss.dtype == torch.float32 and half_logits.dtype == torch.bfloat16
    t = outputs_to_fp32((torch.ones(2, dtype=torch.float16), [torch.ones(1, dtype=torch.int64)]))
    assert t[0].dtype == torch.float32 and t[1][0].dtype == torch.int64


def test_phases_and_clipping_order():
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    seen = []
    norms = []
    real_clip = torch.nn.utils.clip_grad_norm_

    def clip(params, max_norm, *a, **k):
        seen.append("clip")
        norms.append(max_norm)
        return real_clip(params, max_norm, *a, **k)

    torch.nn.utils.clip_grad_norm_ = clip
    try:
        train_step(model, opt, torch.randn(3, 4), grad_accum=2, max_grad_norm=0.5, hf_trainer=True,
                   on_phase=seen.append, loss_fn=lambda out, b: out.sum())
    finally:
        torch.nn.utils.clip_grad_norm_ = real_clip
    assert seen == ["forward", "backward", "forward", "backward", "optimizer", "clip", "end"]
    assert norms == [0.5] and all(p.grad is None for p in model.parameters())
