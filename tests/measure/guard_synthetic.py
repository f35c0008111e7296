"""A memory snapshot at an OOM, built by hand with the structure of torch.cuda.memory._snapshot(),
and the Capture the guard would have taken with it.

The story (step 3 of a loop, an OOM in backward): one 64 MiB large segment holds the weights
(8 MiB), their gradients (8 MiB), AdamW's two states (16 MiB), the batch (2 MiB), two activations
saved by forward of step 3 in "blocks.0" and "blocks.1" (6 + 4 MiB), a backward temporary of
"blocks.1" (4 MiB), a tensor kept from step 1's forward (2 MiB, a leak: workspace), a block older
than the recorded history (2 MiB: a cuBLAS workspace) and 12 MiB free; a small 2 MiB segment holds a 512 B
loss scalar of step 3's forward; a segment on device 1 is someone else's. Allocated on device 0:
8+8+16+2+6+4+4+2+2 MiB + 512 B = 52 MiB + 512 B.
"""
from __future__ import annotations

from memlens.measure.guard import Capture

MiB = 2**20
BASE = 0x7F0000000000
FRAME = {"filename": "/home/me/train.py", "line": 42, "name": "train_step"}

# (offset, size, state, what) in the large segment; "what" is the test's truth
LARGE = [
    (0, 8 * MiB, "active_allocated", "parameters"),
    (8 * MiB, 8 * MiB, "active_allocated", "gradients"),
    (16 * MiB, 16 * MiB, "active_allocated", "optimizer_state"),
    (32 * MiB, 2 * MiB, "active_allocated", "inputs"),
    (34 * MiB, 6 * MiB, "active_allocated", "act0"),
    (40 * MiB, 4 * MiB, "active_allocated", "act1"),
    (44 * MiB, 4 * MiB, "active_allocated", "tmp1"),
    (48 * MiB, 2 * MiB, "active_allocated", "leak"),
    (50 * MiB, 2 * MiB, "active_allocated", "old"),
    (52 * MiB, 12 * MiB, "inactive", "free"),
]
ALLOCATED = 52 * MiB + 512
MOMENTS = {  # moment number -> (phase, step, module label)
    10: ("forward", 1, "blocks.0"),
    30: ("forward", 3, "blocks.0"),
    31: ("forward", 3, "blocks.1"),
    32: ("forward", 3, "(model: loss and glue)"),
    33: ("backward", 3, "blocks.1"),
}


def addr(offset: int) -> int:
    return BASE + offset


def _entry(action: str, address: int, size: int, moment: int | None, t: int) -> dict:
    e = {"action": action, "addr": address, "size": size, "stream": 0, "time_us": t, "frames": [FRAME]}
    if moment is not None:
        e["user_metadata"] = f"memlens:{moment}"
    return e


def snapshot() -> dict:
    blocks = [{"address": addr(o), "size": s, "requested_size": s if st != "inactive" else 0, "state": st,
               "frames": [FRAME] if st != "inactive" else []} for o, s, st, _ in LARGE]
    large = {"device": 0, "address": BASE, "total_size": 64 * MiB, "stream": 0, "segment_type": "large",
             "segment_pool_id": (0, 0), "allocated_size": 52 * MiB, "active_size": 52 * MiB,
             "requested_size": 52 * MiB, "blocks": blocks}
    small_addr = BASE + 64 * MiB
    small = {"device": 0, "address": small_addr, "total_size": 2 * MiB, "stream": 0, "segment_type": "small",
             "segment_pool_id": (0, 0), "allocated_size": 512, "active_size": 512, "requested_size": 4,
             "blocks": [{"address": small_addr, "size": 512, "requested_size": 4, "state": "active_allocated", "frames": []},
                        {"address": small_addr + 512, "size": 2 * MiB - 512, "requested_size": 0, "state": "inactive",
                         "frames": []}]}
    other = {"device": 1, "address": BASE + 2**30, "total_size": 20 * MiB, "stream": 0, "segment_type": "large",
             "segment_pool_id": (0, 0), "allocated_size": 20 * MiB, "active_size": 20 * MiB, "requested_size": 20 * MiB,
             "blocks": [{"address": BASE + 2**30, "size": 20 * MiB, "requested_size": 20 * MiB, "state": "active_allocated",
                         "frames": []}]}
    t = iter(range(1000, 10**6, 7))
    trace = [
        _entry("alloc", addr(48 * MiB), 2 * MiB, 10, next(t)),                # step 1 forward: kept (the leak)
        _entry("alloc", addr(52 * MiB), 6 * MiB, 10, next(t)),                # step 1 activation, freed
        _entry("free_requested", addr(52 * MiB), 6 * MiB, 12, next(t)),
        _entry("free_completed", addr(52 * MiB), 6 * MiB, 12, next(t)),
        _entry("alloc", addr(34 * MiB), 6 * MiB, 30, next(t)),                # step 3 forward
        _entry("alloc", addr(40 * MiB), 4 * MiB, 31, next(t)),
        _entry("alloc", small_addr, 4, 32, next(t)),                           # the loss
        _entry("alloc", addr(52 * MiB), 8 * MiB, 31, next(t)),                # freed in forward
        _entry("free_requested", addr(52 * MiB), 8 * MiB, 31, next(t)),
        _entry("free_completed", addr(52 * MiB), 8 * MiB, 31, next(t)),
        _entry("alloc", addr(8 * MiB), 8 * MiB, 33, next(t)),                 # a gradient: known at the failure
        _entry("alloc", addr(44 * MiB), 4 * MiB, 33, next(t)),                # backward temporary
        _entry("alloc", addr(32 * MiB), 2 * MiB, 99, next(t)),                # the batch, a moment not kept
        {"action": "oom", "addr": 0, "size": 24 * MiB, "stream": 0, "time_us": next(t), "frames": [], "device_free": 0},
    ]
    return {"segments": [large, small, other], "device_traces": [trace, []]}


KNOWN = {addr(0): ("parameters", "blocks.0"), addr(8 * MiB): ("gradients", "blocks.0"),
         addr(16 * MiB): ("optimizer_state", "(optimizer)"), addr(32 * MiB): ("inputs", "(inputs)")}


def capture(**over) -> Capture:
    kw = dict(time_s=0.0, device=0, requested_bytes=24 * MiB, total_bytes=80 * MiB, allowed_bytes=None,
              free_bytes=8 * MiB, allocated_bytes=ALLOCATED, reserved_bytes=66 * MiB, stats={"num_ooms": 1},
              snapshot=snapshot(), known=dict(KNOWN), moments=dict(MOMENTS), step=3, pid=4242,
              processes=[(4242, 66 * MiB + 6 * MiB)], history=True)
    kw.update(over)
    return Capture(**kw)
