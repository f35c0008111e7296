"""bench/gpu_gemm_probe.py's CPU side: the GEMMs it reads from a profiled record, the input sets it rotates."""
import json

from bench.gpu_gemm_probe import L2_SPAN, profiled_gemms, sets_for


def test_the_probe_reads_each_2d_mm_and_addmm_of_a_profile_with_its_precision(tmp_path):
    rec = {"name": "gpt2-amp-bf16", "spec": {"precision": "amp-bf16"},
           "profile": {"matmul_shapes": [
               ["forward", "aten::addmm", "[[768], [8192, 768], [768, 3072], [], []]", 0.0007, 12],
               ["backward", "aten::mm", "[[3072, 8192], [8192, 768]]", 0.00066, 12],
               ["backward", "aten::bmm", "[[12, 512, 64], [12, 64, 512]]", 0.001, 12]]}}     # 3-D: not a grid GEMM
    fp32 = {"name": "gpt2-fp32", "spec": {"precision": "fp32"},
            "profile": {"matmul_shapes": [["forward", "aten::mm", "[[2048, 768], [768, 50257]]", 0.0031, 1]]}}
    p = tmp_path / "rec.jsonl"
    p.write_text(json.dumps(rec) + "\n" + json.dumps(fp32) + "\n")
    rows = profiled_gemms(str(p))
    assert [(r["dtype"], r["m"], r["k"], r["n"], r["calls"]) for r in rows] == [
        ("bfloat16", 8192, 768, 3072, 12), ("bfloat16", 3072, 8192, 768, 12), ("float32", 2048, 768, 50257, 1)]
    assert abs(rows[0]["us"] - 0.0007 / 12 * 1e6) < 1e-9


def test_cold_input_sets_span_four_l2s_and_one_set_does_where_it_is_larger():
    assert L2_SPAN == 200 * 2**20
    assert sets_for(50 * 2**20) == 4 and sets_for(60 * 2**20) == 4 and sets_for(2**30) == 1
    assert sets_for(1000) == 64            # at most 64 sets of a tiny GEMM
