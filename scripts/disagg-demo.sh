#!/usr/bin/env bash
# The disaggregated prefill lane on loopback in three commands (CPU; SmolLM2 by default):
#   muser tls init && muser tls issue prod && muser tls issue cons
#   muser up --role producer --name prod --consumer cons --port 4950
#   muser up --name cons --prefill auto --producer prod=https://127.0.0.1:4950
# then one long prompt prefilled locally and on the producer: both TTFTs, the handoff's bytes
# and rate, and `tokens identical: yes|no`. Everything lives in a temporary directory.
# Usage: scripts/disagg-demo.sh [MODEL.gguf] [PROMPT_TOKENS]
set -euo pipefail
cd "$(dirname "$0")/.."
MODEL="${1:-$(scripts/fetch-models.sh)/SmolLM2-135M-Instruct.Q4_1.gguf}"
cargo build --release -p muser-cli >&2
python3 scripts/disagg_run.py --model "$MODEL" --tokens "${2:-2000}"
