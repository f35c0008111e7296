"""Hand-built memory snapshots with the documented structure of torch.cuda.memory._snapshot().

`python tests/doctor/doctor_synthetic.py` rewrites tests/fixtures/doctor/synthetic_snapshot_{before,after}.pickle;
test_doctor_snapshot checks the committed files still equal what this builds.

The story: a training step's live memory (weights 64 MiB, AdamW state 128 MiB, a 2 MiB small segment),
and a leak in train.py:42 (`history.append(logits)`) that keeps one 8 MiB block per step: 2 blocks in
"before", 5 in "after". The large segment of "before" holds the weights and two 8 MiB leaked blocks with
free pieces of 10 and 4 MiB between them (fragmented); the trace allocates and frees like a step.
"""
from __future__ import annotations

import pickle
from pathlib import Path

MIB = 1024**2
FIXTURES = Path(__file__).resolve().parent.parent / "fixtures" / "doctor"

TORCH_FRAME = {"filename": "/usr/lib/python3.11/site-packages/torch/nn/modules/linear.py", "line": 125, "name": "forward"}
MODEL_FRAME = {"filename": "/home/me/proj/model.py", "line": 17, "name": "__init__"}
OPT_FRAME = {"filename": "/home/me/proj/train.py", "line": 30, "name": "make_optimizer"}
LEAK_FRAME = {"filename": "/home/me/proj/train.py", "line": 42, "name": "train_step"}
MAIN_FRAME = {"filename": "/home/me/proj/train.py", "line": 90, "name": "<module>"}


def _block(address: int, size: int, state: str, frames: list[dict]) -> dict:
    return {"address": address, "size": size, "requested_size": size if state != "inactive" else 0,
            "state": state, "frames": frames}


def _segment(address: int, blocks: list[dict], segment_type: str = "large") -> dict:
    total = sum(b["size"] for b in blocks)
    return {
        "device": 0, "address": address, "total_size": total, "stream": 0, "segment_type": segment_type,
        "segment_pool_id": (0, 0),
        "allocated_size": sum(b["size"] for b in blocks if b["state"] == "active_allocated"),
        "active_size": sum(b["size"] for b in blocks if b["state"].startswith("active")),
        "blocks": blocks,
    }


def build(leaked_blocks: int) -> dict:
    """A snapshot after ``leaked_blocks`` steps of the leak."""
    base = 0x7F0000000000
    leak_frames = [TORCH_FRAME, LEAK_FRAME, MAIN_FRAME]
    # segment A: weights 64 MiB, leak 8, free 10, leak 8, free 4 (96 MiB, partly in use: fragmented)
    a_blocks, addr = [], base
    for size, state, frames in ((64 * MIB, "active_allocated", [TORCH_FRAME, MODEL_FRAME, MAIN_FRAME]),
                                (8 * MIB, "active_allocated", leak_frames), (10 * MIB, "inactive", []),
                                (8 * MIB, "active_allocated", leak_frames), (4 * MIB, "inactive", [])):
        a_blocks.append(_block(addr, size, state, frames))
        addr += size
    segments = [_segment(base, a_blocks)]
    # segment B: AdamW state, 128 MiB, one block
    segments.append(_segment(base + 0x10000000, [_block(base + 0x10000000, 128 * MIB, "active_allocated", [OPT_FRAME, MAIN_FRAME])]))
    # segment C: small pool, 2 MiB: 512 KiB live, rest free
    c = base + 0x20000000
    segments.append(_segment(c, [_block(c, 512 * 1024, "active_allocated", [TORCH_FRAME, LEAK_FRAME, MAIN_FRAME]),
                                 _block(c + 512 * 1024, 1536 * 1024, "inactive", [])], "small"))
    # more leaked blocks, each in its own 8 MiB segment
    for i in range(leaked_blocks - 2):
        s = base + 0x30000000 + i * 8 * MIB
        segments.append(_segment(s, [_block(s, 8 * MIB, "active_allocated", leak_frames)]))
    trace = [
        {"action": "segment_alloc", "addr": base, "size": 96 * MIB, "stream": 0, "frames": leak_frames, "time_us": 1000},
        {"action": "alloc", "addr": base + 96 * MIB, "size": 16 * MIB, "stream": 0, "frames": leak_frames, "time_us": 1100},
        {"action": "alloc", "addr": base + 112 * MIB, "size": 32 * MIB, "stream": 0, "frames": leak_frames, "time_us": 1200},
        {"action": "free_requested", "addr": base + 112 * MIB, "size": 32 * MIB, "stream": 0, "frames": [], "time_us": 1300},
        {"action": "free_completed", "addr": base + 112 * MIB, "size": 32 * MIB, "stream": 0, "frames": [], "time_us": 1300},
        {"action": "free_completed", "addr": base + 96 * MIB, "size": 16 * MIB, "stream": 0, "frames": [], "time_us": 1400},
        {"action": "alloc", "addr": base + 0x30000000, "size": 8 * MIB, "stream": 0, "frames": leak_frames, "time_us": 1500},
        {"action": "oom", "size": 1024 * MIB, "device_free": 0, "stream": 0, "frames": leak_frames, "time_us": 1600},
    ]
    return {"segments": segments, "device_traces": [trace], "allocator_settings": {"expandable_segments": False}}


def write() -> None:
    for name, n in (("before", 2), ("after", 5)):
        (FIXTURES / f"synthetic_snapshot_{name}.pickle").write_bytes(pickle.dumps(build(n), protocol=4))


if __name__ == "__main__":
    write()
