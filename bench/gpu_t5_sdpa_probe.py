"""Why the real T5 step runs SDPA on the math path: record every scaled_dot_product_attention call
of one T5 training step on a GPU (dtypes, mask shape/strides/requires_grad, dropout, scale), the
kernel the dispatcher picks (torch._fused_sdp_choice: 0 math, 1 flash, 2 efficient, 3 cudnn) and
the dispatcher's own reasons for refusing each fused kernel (SDPAParams, debug=True warnings).

    python bench/gpu_t5_sdpa_probe.py OUT.json [model] [precision]
"""
from __future__ import annotations

import json
import os
import sys
import warnings

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main() -> None:
    import torch
    import torch.nn.functional as F

    from memlens.core.spec import TrainingSpec
    from memlens.step.prepare import prepare

    out_path = sys.argv[1]
    model = sys.argv[2] if len(sys.argv) > 2 else "t5-base"
    precision = sys.argv[3] if len(sys.argv) > 3 else "amp-bf16"
    spec = TrainingSpec(model=model, batch_size=4, seq_len=512, target_len=128, precision=precision)
    step = prepare(spec, device=os.environ.get("PROBE_DEVICE", "cuda"), seed=0)
    calls, seen = [], set()
    real = F.scaled_dot_product_attention

    def probe(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        m = attn_mask
        key = (str(q.dtype), None if m is None else (str(m.dtype), tuple(m.shape), tuple(m.stride()), m.requires_grad),
               dropout_p, is_causal, scale, torch.is_autocast_enabled())
        if key not in seen:
            seen.add(key)
            rec = {"q": [str(q.dtype), list(q.shape), list(q.stride())], "k_dtype": str(k.dtype),
                   "mask": None if m is None else {"dtype": str(m.dtype), "shape": list(m.shape), "stride": list(m.stride()),
                                                   "requires_grad": m.requires_grad, "contiguous": m.is_contiguous()},
                   "dropout_p": dropout_p, "is_causal": is_causal, "scale": scale, "autocast": torch.is_autocast_enabled(),
                   "q_requires_grad": q.requires_grad}
            variants = [("as_called", (q, k, v, m)), ("mask_in_query_dtype", (q, k, v, None if m is None else m.to(q.dtype)))]
            if m is not None and m.dim() == 4:
                full = (q.shape[0], q.shape[1], q.shape[2], k.shape[2])
                mq = m.to(q.dtype)
                variants += [("mask_expanded_to_batch", (q, k, v, mq.expand(full))),
                             ("mask_full_contiguous", (q, k, v, mq.expand(full).contiguous())),
                             ("mask_no_grad", (q, k, v, mq.detach()))]
            for name, args in variants:
                try:
                    rec[f"choice_{name}"] = int(torch._fused_sdp_choice(*args, dropout_p, is_causal, scale=scale))
                except Exception as e:  # noqa: BLE001
                    rec[f"choice_{name}"] = f"{type(e).__name__}: {e}"[:300]
            reasons = {}
            try:
                params = torch.backends.cuda.SDPAParams(q, k, v, m, dropout_p, is_causal, enable_gqa)
                for kern, fn in (("efficient", torch.backends.cuda.can_use_efficient_attention),
                                 ("flash", torch.backends.cuda.can_use_flash_attention),
                                 ("cudnn", getattr(torch.backends.cuda, "can_use_cudnn_attention", None))):
                    if fn is None:
                        continue
                    with warnings.catch_warnings(record=True) as w:
                        warnings.simplefilter("always")
                        ok = fn(params, True)
                    reasons[kern] = {"ok": bool(ok), "why": [str(x.message)[:400] for x in w]}
            except Exception as e:  # noqa: BLE001
                reasons["error"] = f"{type(e).__name__}: {e}"[:300]
            rec["reasons"] = reasons
            calls.append(rec)
            print(json.dumps(rec)[:1500], flush=True)
        return real(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale, enable_gqa=enable_gqa)

    F.scaled_dot_product_attention = probe
    torch.nn.functional.scaled_dot_product_attention = probe
    try:
        step.run()
    finally:
        F.scaled_dot_product_attention = real
    json.dump({"torch": torch.__version__, "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu", "model": model,
               "precision": precision, "calls": calls}, open(out_path, "w"), indent=1)


if __name__ == "__main__":
    main()
