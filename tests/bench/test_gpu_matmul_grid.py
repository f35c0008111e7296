"""bench/gpu_matmul_grid.py's CPU side: which grid points a re-measure moved."""
from bench.gpu_matmul_grid import moved


def test_the_matmul_regrid_lists_the_grid_points_that_moved_most():
    old = {"bfloat16": {"m": [16, 64], "n": [64], "k": [64], "tflops": [[[100.0]], [[300.0]]]}}
    new = {"bfloat16": {"m": [16, 64], "n": [64], "k": [64], "tflops": [[[110.0]], [[600.0]]]},
           "float16": {"m": [16], "n": [64], "k": [64], "tflops": [[[50.0]]]}}       # not in the old table: skipped
    assert moved(old, new) == [("bfloat16", 64, 64, 64, 300.0, 600.0), ("bfloat16", 16, 64, 64, 100.0, 110.0)]
