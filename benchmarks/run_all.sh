#!/usr/bin/env bash
# Regenerate every figure in the README's performance section, on this machine.
# ~25 minutes on 2 cores. Results land in ${OUT:-bench-out}/ (text tables, JSON,
# the plot); paste the tables into README.md with the machine line they print.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-bench-out}
DATA=${DATA:-$OUT/data}
mkdir -p "$OUT" "$DATA"
python benchmarks/bench_speed.py --workdir "$DATA/speed" --epochs 5 --json "$OUT/speed.json" | tee "$OUT/speed.txt"
python benchmarks/bench_memory.py --n 100000 --epochs 10 --variants fastdata,naive --data "$DATA/memory" \
    --json "$OUT/memory.json" | tee "$OUT/memory.txt"
python benchmarks/bench_convert.py --data "$DATA/convert" --json "$OUT/convert.json" | tee "$OUT/convert.txt"
python benchmarks/bench_convert.py --backend hdf5 --data "$DATA/convert" --json "$OUT/convert-hdf5.json" \
    | tee "$OUT/convert-hdf5.txt"
python benchmarks/bench_sampler.py | tee "$OUT/sampler.txt"
python benchmarks/bench_native.py --workdir "$DATA/native" --json "$OUT/native.json" --md "$OUT/native.md" \
    | tee "$OUT/native.txt"
python benchmarks/bench_memory.py --variants fastdata-u16 --native-n 1000 --epochs 20 --data "$DATA/memory" \
    --json "$OUT/memory-u16.json" | tee "$OUT/memory-u16.txt"
fastdata bench "$DATA/speed/imagenet" "$DATA/speed/imagenet.lmdb" "$DATA/speed/imagenet.h5" \
    --workers 0,1,2 --transform rrc224 --epochs 3 --out "$OUT/harness" | tee "$OUT/harness.txt"
cp "$OUT/harness/throughput_vs_workers.png" docs/img/throughput_vs_workers.png
python benchmarks/bench_grow.py --json "$OUT/grow.json" | tee "$OUT/grow.txt"
python benchmarks/bench_subset.py --json "$OUT/subset.json" | tee "$OUT/subset.txt"
python benchmarks/bench_mix.py --epochs 5 | tee "$OUT/mix.txt"
python benchmarks/bench_tails.py --workdir "$DATA/tails" --epochs 9 | tee "$OUT/tails.txt"
