"""The allocator model, checked against PyTorch's CUDACachingAllocator rules by hand."""
from memlens.core.ledger import (CachingAllocatorModel, EventLog, analyze, round_size, segment_size)

MiB = 1024 * 1024


def test_round_size():
    assert round_size(1) == 512
    assert round_size(512) == 512
    assert round_size(513) == 1024
    assert round_size(4_000_000) == 4_000_256


def test_segment_sizes():
    assert segment_size(512) == 2 * MiB            # small pool
    assert segment_size(1 * MiB) == 2 * MiB
    assert segment_size(1 * MiB + 512) == 20 * MiB  # large, < 10 MiB
    assert segment_size(10 * MiB) == 10 * MiB      # rounded to 2 MiB
    assert segment_size(11 * MiB) == 12 * MiB


def test_small_blocks_share_a_segment_and_merge_on_free():
    a = CachingAllocatorModel()
    a.malloc("a", 1000)
    a.malloc("b", 1000)
    assert (a.allocated, a.reserved, a.num_segments) == (2048, 2 * MiB, 1)
    a.free("a")
    a.free("b")
    assert a.allocated == 0
    a.malloc("c", 2 * MiB - 512 - 512)  # fits the merged free space of the same segment? no: > 1 MiB -> large pool
    assert a.num_segments == 2


def test_large_block_remainder_under_1mib_is_not_split():
    a = CachingAllocatorModel()
    a.malloc("x", 12 * MiB)            # segment of 12 MiB
    a.free("x")
    a.malloc("y", 11 * MiB + 512)      # remainder 512 KiB <= 1 MiB: whole 12 MiB block handed out
    assert a.allocated == 12 * MiB
    assert a.requested == 11 * MiB + 512
    assert a.reserved == 12 * MiB


def test_large_block_split_and_best_fit():
    a = CachingAllocatorModel()
    a.malloc("x", 4 * MiB)             # 20 MiB segment, split: 4 + 16 free
    assert (a.allocated, a.reserved) == (4 * MiB, 20 * MiB)
    a.malloc("y", 8 * MiB)             # from the 16 MiB remainder
    assert a.reserved == 20 * MiB and a.allocated == 12 * MiB
    assert a.inactive_split_bytes == 8 * MiB
    a.free("x")
    a.free("y")
    assert a.allocated == 0 and a.peak_allocated == 12 * MiB


def test_analyze_breakdown_sums_to_peak_and_stops_at_done():
    log = EventLog()
    m = log.module_id("layer")
    log.alloc(1, 4 * MiB, "parameters", m, "setup")
    log.phase("forward", 1)
    log.alloc(2, 2 * MiB, "temporaries", m, "forward")
    log.tag(2, "activations")
    log.phase("backward", 1)
    log.alloc(3, 4 * MiB, "temporaries", m, "backward")
    log.tag(3, "gradients")
    log.free(2)
    log.phase("end", 1)
    log.phase("done", 1)
    log.free(1)  # teardown: ignored
    a = analyze(log)
    assert a.peak_allocated_bytes == 10 * MiB
    assert a.by_category["parameters"] == 4 * MiB
    assert a.by_category["activations"] == 2 * MiB
    assert a.by_category["gradients"] == 4 * MiB
    assert sum(a.by_category.values()) == a.peak_allocated_bytes
    assert a.peak_phase == "backward"
    assert a.steps[0]["end_allocated_bytes"] == 8 * MiB
    assert a.by_module[0]["module"] == "layer"


def test_blocks_are_reused_only_on_their_own_stream():
    """CUDACachingAllocator keeps a pool per stream: a block freed on one stream serves only that stream."""
    a = CachingAllocatorModel()
    a.malloc("x", 4 * MiB, stream=1)          # a 20 MiB segment of stream 1
    a.free("x")
    a.malloc("y", 4 * MiB)                    # the default stream cannot take it: a new segment
    assert (a.reserved, a.num_segments) == (40 * MiB, 2)
    a.malloc("z", 4 * MiB, stream=1)          # stream 1 reuses its own cached block
    assert (a.reserved, a.num_segments, a.allocated) == (40 * MiB, 2, 8 * MiB)


def test_streams_in_the_log_replay():
    log = EventLog()
    m = log.module_id("m")
    log.alloc(1, 4 * MiB, "communication", m, "forward", stream=1)
    log.free(1)
    log.alloc(2, 4 * MiB, "parameters", m, "forward")
    assert analyze(log).peak_reserved_bytes == 40 * MiB
    same = EventLog()
    same.alloc(1, 4 * MiB, "communication", m, "forward")
    same.free(1)
    same.alloc(2, 4 * MiB, "parameters", m, "forward")
    assert analyze(same).peak_reserved_bytes == 20 * MiB
