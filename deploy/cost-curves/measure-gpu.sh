#!/usr/bin/env bash
# Measure the torch verifier's cost curves on a GPU machine (random-weight models of the public Qwen2.5 1.5B and
# 7B architectures, bf16; forward time does not depend on weight values). Writes JSON + Markdown under ${OUT:-.}.
# Needs only torch, transformers and numpy (no model download): python3 -m bench.costcurve does the work.
set -euo pipefail
out=${OUT:-.}
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv | tee "$out/gpu.txt"
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)" \
    | tee -a "$out/gpu.txt"
for model in qwen2.5-1.5b qwen2.5-7b; do
    python3 -m bench.costcurve --engine torch --config "$model" --device cuda --reps 9 \
        --name "$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1), torch bf16, $model architecture" \
        --json "$out/gpu-$model.json" --report "$out/gpu-$model.md"
done
