#!/usr/bin/env bash
# Client tests: starts the real `muser up` on SmolLM2 at a free port and drives it with the
# official `openai`, `anthropic` and `ollama` Python clients, raw HTTP for the llama.cpp routes, a
# concurrency test, a bounded load test, /metrics through prometheus_client's parser, sessions
# moved to a second `muser up` process, and the dashboard in headless Chromium (Debian's
# chromium and chromium-driver, installed here when missing) driven by Selenium
# (tests/clients; screenshots under target/test-artifacts). Prints pytest's summary line and
# exits non-zero on failure.
set -euo pipefail
cd "$(dirname "$0")/.."
cache="${MUSER_CACHE:-$HOME/.cache/muser}"
models="${MUSER_MODELS:-$(scripts/fetch-models.sh)}"
model="$models/SmolLM2-135M-Instruct.Q4_1.gguf"
[ -f "$model" ] || { echo "test-clients: missing $model (run scripts/fetch-models.sh)" >&2; exit 1; }

venv="$cache/venv-clients"
pins="openai==3.51.0 anthropic==2.15.0 ollama==0.6.3 requests==2.34.2 pytest==9.2.0 selenium==4.51.0 prometheus_client==0.26.0"
if [ "$(cat "$venv/.pins" 2>/dev/null)" != "$pins" ]; then
  rm -rf "$venv"
  python3 -m venv "$venv"
  # shellcheck disable=SC2086
  "$venv/bin/pip" install -q --disable-pip-version-check $pins >&2
  echo "$pins" > "$venv/.pins"
fi

if ! command -v chromium >/dev/null || ! command -v chromedriver >/dev/null; then
  sudo=""; [ "$(id -u)" -eq 0 ] || sudo="sudo"
  $sudo apt-get update -q >&2
  $sudo apt-get install -y -q chromium chromium-driver >&2
fi

cargo build --release --locked -q -p muser-cli >&2
bin="${CARGO_TARGET_DIR:-target}/release/muser"

work=$(mktemp -d)
head -c 32 /dev/urandom | od -An -tx1 | tr -d ' \n' > "$work/kv.key"
# its own configuration directory: an empty node registry, whatever this machine enrolled
MUSER_CONFIG_DIR="$work/config" \
"$bin" up --model "$model" --port 0 --slots 4 -c 8192 --metrics --slot-save-path "$work/slots" \
  --kv-key-file "$work/kv.key" --session-dir "$work/sessions" \
  > "$work/stdout" 2> "$work/stderr" &
pid=$!
cleanup() { kill "$pid" 2>/dev/null || true; wait "$pid" 2>/dev/null || true; rm -rf "$work"; }
trap cleanup EXIT

url=""
for _ in $(seq 1 600); do
  url=$(grep -o 'http://[^ ]*' "$work/stdout" 2>/dev/null | head -n 1 || true)
  [ -n "$url" ] && break
  if ! kill -0 "$pid" 2>/dev/null; then
    echo "test-clients: muser up exited before it was ready:" >&2; cat "$work/stderr" >&2; exit 1
  fi
  sleep 0.2
done
[ -n "$url" ] || { echo "test-clients: no ready line after 120 s" >&2; cat "$work/stderr" >&2; exit 1; }
echo "test-clients: server at $url (pid $pid)" >&2

status=0
MUSER_URL="$url" MUSER_PID="$pid" MUSER_BIN="$bin" MUSER_MODEL="$model" MUSER_KV_KEY="$work/kv.key" \
  MUSER_ARTIFACTS="${MUSER_ARTIFACTS:-target/test-artifacts}" "$venv/bin/python" -m pytest -q -p no:cacheprovider tests/clients || status=$?
if [ "$status" -ne 0 ]; then
  echo "test-clients: last server log lines:" >&2; tail -n 20 "$work/stderr" >&2
fi
exit "$status"
