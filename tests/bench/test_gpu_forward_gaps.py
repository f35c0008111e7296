"""bench/gpu_forward_gaps.py's CPU side: each mark's host and GPU times and the GPU's lag behind the host."""
from bench.gpu_forward_gaps import CASES, lags


def test_a_mark_lists_the_gpus_lag_behind_the_host():
    marks = [("embed", 0.5004, 0.4801), ("head", 8.4391, 16.4342)]
    assert lags(marks) == [("embed", 0.5, 0.48, -0.02), ("head", 8.439, 16.434, 7.995)]


def test_the_cases_are_the_bench_steps_they_explain():
    # the shapes of bench/gpu_step_time.py's gpt2-fp32, qwen0.5b-bf16 and llama1b-bf16 steps
    by = {c[0]: c for c in CASES}
    assert by["gpt2-fp32"][3:6] == (4, 512, "float32") and by["qwen0.5b-bf16"][3:6] == (8, 1024, "bfloat16")
    assert by["llama1b-bf16"][2]["num_hidden_layers"] == 16 and by["llama1b-bf16"][3:5] == (4, 1024)
