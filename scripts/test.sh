#!/usr/bin/env bash
# The whole test suite: fetches the test models (cached), then runs every Rust test.
# Golden data under tests/golden comes from the comparator through scripts/goldens.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
export MUSER_MODELS="$(scripts/fetch-models.sh)"
cargo test --workspace --release --locked
scripts/test-clients.sh
