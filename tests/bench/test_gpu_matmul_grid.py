"""bench/gpu_matmul_grid.py's CPU side: which grid points a re-measure moved."""
from bench.gpu_matmul_grid import moved


def test_the_matmul_regrid_lists_the_grid_points_that_moved_most():
    old = {"bfloat16": {"m": [16, 64], "n": [64], "k": [64], "tflops": [[[100.0]], [[300.0]]]}}
    new = {"bfloat16": {"m": [16, 64], "n": [64], "k": [64], "tflops": [[[110.0]], [[600.0]]]},
           "float16": {"m": [16], "n": [64], "k": [64], "tflops": [[[50.0]]]}}       # not in the old table: skipped
    assert moved(old, new) == [("bfloat16", 64, 64, 64, 300.0, 600.0), ("bfloat16", 16, 64, 64, 100.0, 110.0)]


def test_a_regrid_with_more_axis_points_compares_the_points_both_grids_measured():
    old = {"bfloat16": {"m": [16], "n": [64], "k": [64, 256], "tflops": [[[100.0, 200.0]]]}}
    new = {"bfloat16": {"m": [16], "n": [8, 64], "k": [8, 64, 256],
                        "tflops": [[[1.0, 2.0, 3.0], [4.0, 150.0, 200.0]]]}}       # n=8 and k=8: new points
    assert moved(old, new) == [("bfloat16", 16, 64, 64, 100.0, 150.0), ("bfloat16", 16, 64, 256, 200.0, 200.0)]
