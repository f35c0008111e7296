"""Which SDPA kernel CUDA picks when the attention mask is a float bias that requires grad (T5's
relative position bias), with and without dropout, per dtype; and what its backward keeps.

    python bench/gpu_sdpa_probe.py OUT.json
Prints and writes one record per case: torch._fused_sdp_choice (SDPBackend: 0 math, 1 flash,
2 efficient, 3 cudnn) and the bytes live after the forward beyond its inputs (saved for backward).
"""
from __future__ import annotations

import json
import sys


def main() -> None:
    import torch

    rows = []
    B, H, L, D = 4, 12, 512, 64
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        for mask_grad in (False, True):
            for p in (0.0, 0.1):
                q, k, v = (torch.randn(B, H, L, D, device="cuda", dtype=dtype, requires_grad=True) for _ in range(3))
                bias = torch.randn(1, H, L, L, device="cuda", dtype=dtype, requires_grad=mask_grad)
                mask = bias.expand(B, H, L, L)
                choice = int(torch._fused_sdp_choice(q, k, v, mask, p, False))
                torch.cuda.synchronize()
                before = torch.cuda.memory_allocated()
                out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=p)
                torch.cuda.synchronize()
                kept = torch.cuda.memory_allocated() - before - out.untyped_storage().nbytes()
                out.sum().backward()
                rows.append({"dtype": str(dtype), "mask_requires_grad": mask_grad, "dropout": p, "choice": choice,
                             "kept_after_forward_bytes": kept, "per_LxL_element": round(kept / (B * H * L * L), 3)})
                print(rows[-1], flush=True)
                del q, k, v, bias, mask, out
                torch.cuda.empty_cache()
    json.dump({"torch": torch.__version__, "device": torch.cuda.get_device_name(0), "rows": rows}, open(sys.argv[1], "w"), indent=1)


if __name__ == "__main__":
    main()
