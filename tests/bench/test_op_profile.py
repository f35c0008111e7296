"""bench/op_profile.py's CPU side: memory-bound ops lined up by shape, measured beside predicted (how the upcast's and
softmax backward's own rates were found)."""
import torch

from bench.op_profile import _largest, compare_shapes


def test_the_largest_argument_names_an_op_and_lists_of_tensors_count():
    a, b = torch.empty(4, 8), torch.empty(2, 3, 16)
    assert _largest((a, 1.0)) == (4, 8)
    assert _largest(([a, b], -1)) == (2, 3, 16)      # cat's list of tensors
    assert _largest((3, None)) == ()


def test_measured_and_predicted_line_up_by_phase_op_and_shape_largest_difference_first():
    rec = {"spec": {"grad_accum": 2}, "profile": {"memory_shapes": [
        # profiler rows: (phase, op, input shapes as torch.profiler writes them, kernel s, calls)
        ["backward", "aten::mul", "[[4, 32, 1024, 1024], [4, 32, 1024, 1024]]", 0.006, 16],
        ["backward", "aten::mul", "[[4, 32, 1024, 1024], []]", 0.002, 16],
        ["forward", "aten::copy_", "[[4, 1024], [4, 1024], []]", 0.001, 2],
    ]}}
    pred = {"shapes": {("backward", "aten::mul", (4, 32, 1024, 1024)): (0.001, 8),     # one micro-batch: x 2
                       ("forward", "aten::copy_", (4, 1024)): (0.0005, 1)}}
    lines = compare_shapes(rec, pred).splitlines()
    assert lines[0].split()[:3] == ["phase", "op", "largest"]
    # the two measured muls of the scores sum to 8 ms over 32 calls; predicted 2 x 1 ms over 16
    assert lines[1].split() == ["backward", "aten::mul", "[4,", "32,", "1024,", "1024]", "8.000", "32", "2.000", "16"]
    assert lines[2].split() == ["forward", "aten::copy_", "[4,", "1024]", "1.000", "2", "1.000", "2"]

