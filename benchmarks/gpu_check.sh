#!/usr/bin/env bash
# The one-shot GPU check (benchmarks/gpu_check.py), from the repo root, stopped after 8 minutes whatever happens
# (its own --budget-s, 420 s by default, skips parts that would start later; the JSON is written after each part).
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
exec timeout --kill-after=10 480 "${PYTHON:-python}" benchmarks/gpu_check.py "$@"
