#!/usr/bin/env bash
# Issue 33's GPU measurements in one device call (about 9 minutes on an H100): TRL's SFT/DPO/GRPO trainers
# (3 cases at once on the one GPU: each its own process and peak counters), the lengths that vary, then one
# Qwen2.5-VL case and the AMP liger pair. Run from the repo root with the wheels of trl, datasets, dill,
# multiprocess, liger-kernel and diffusers in ./.whl/; results under $OUT/<bench>/ (JSONL + the printed table).
set -u
OUT=${OUT:-out}
python3 -m pip install -q --no-deps .whl/*.whl 2>&1 | tail -2
export PYTHONUNBUFFERED=1
mkdir -p "$OUT/trl" "$OUT/lengths" "$OUT/vlm" "$OUT/liger"
(timeout 400 python3 bench/gpu_trl.py --out "$OUT/trl" --jobs 3 > "$OUT/trl/table.txt" 2>&1) &
(OUT="$OUT/lengths" timeout 400 python3 bench/gpu_lengths.py > "$OUT/lengths/table.txt" 2>&1) &
wait
(OUT="$OUT/vlm" timeout 100 python3 bench/gpu_vlm.py q3b-lora-448 > "$OUT/vlm/table.txt" 2>&1) &
(OUT="$OUT/liger" timeout 100 python3 bench/gpu_liger.py --only amp > "$OUT/liger/table.txt" 2>&1) &
wait
rm -f "$OUT/liger/gpu_liger.jsonl"   # per-step records; gpu_liger_table.jsonl has the rows
find "$OUT" -type f ! -name '*.jsonl' ! -name 'table.txt' -delete
for f in "$OUT"/*/table.txt; do echo "== $f"; tail -22 "$f"; done
