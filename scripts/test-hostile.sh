#!/usr/bin/env bash
# The hostile-client suite (tests/hostile/hostile.py, Python standard library only): starts
# `muser up` on SmolLM2 at a free loopback port and attacks it with every bounded request
# class, huge headers, malformed bytes, slowloris, 1,000 idle connections, a client that
# leaves mid-stream, and 2,000 mixed requests from 16 clients; then checks that the server
# answers as before and that its RSS is within 64 MiB of the start. Then, with openssl on
# the PATH, the same binary over HTTPS with a key file, and the bind policy. About a minute.
set -euo pipefail
cd "$(dirname "$0")/.."
models="${MUSER_MODELS:-$(scripts/fetch-models.sh)}"
model="$models/SmolLM2-135M-Instruct.Q4_1.gguf"
[ -f "$model" ] || { echo "test-hostile: missing $model (run scripts/fetch-models.sh)" >&2; exit 1; }
cargo build --release --locked -q -p muser-cli >&2
bin="${CARGO_TARGET_DIR:-target}/release/muser"
ulimit -n 8192 2>/dev/null || true

work=$(mktemp -d)
pids=()
cleanup() {
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; wait "$p" 2>/dev/null || true; done
  rm -rf "$work"
}
trap cleanup EXIT

# start NAME ARGS...: runs `muser up ARGS` and sets $url and $pid once it is ready
start() {
  local name=$1; shift
  "$bin" up --model "$model" --port 0 "$@" > "$work/$name.out" 2> "$work/$name.err" &
  pid=$!
  pids+=("$pid")
  url=""
  for _ in $(seq 1 600); do
    url=$(grep -o 'https\?://[^ ]*' "$work/$name.out" 2>/dev/null | head -n 1 || true)
    [ -n "$url" ] && return 0
    kill -0 "$pid" 2>/dev/null || { echo "test-hostile: $name exited:" >&2; cat "$work/$name.err" >&2; exit 1; }
    sleep 0.2
  done
  echo "test-hostile: $name not ready after 120 s" >&2; exit 1
}

start plain --slots 4 -c 8192 --slot-save-path "$work/slots"
MUSER_URL="$url" MUSER_PID="$pid" timeout 240 python3 tests/hostile/hostile.py || {
  echo "test-hostile: last server log lines:" >&2; tail -n 20 "$work/plain.err" >&2; exit 1; }

# the bind policy: a public address without a key and TLS is refused before anything loads
if "$bin" up --model "$model" --host 0.0.0.0 --port 0 > /dev/null 2> "$work/bind.err"; then
  echo "test-hostile: a public bind without a key and TLS was accepted" >&2; exit 1
fi
grep -q -- "--insecure-public" "$work/bind.err" || { cat "$work/bind.err" >&2; exit 1; }
echo "hostile bind: 0.0.0.0 without a key and TLS is refused"

if command -v openssl > /dev/null; then
  openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes -days 2 \
    -subj /CN=localhost -addext "subjectAltName=DNS:localhost,IP:127.0.0.1" \
    -keyout "$work/tls.key" -out "$work/tls.crt" 2> /dev/null
  head -c 24 /dev/urandom | od -An -tx1 | tr -d ' \n' > "$work/api.key"
  chmod 600 "$work/api.key" "$work/tls.key"
  start tls --slots 1 -c 256 --api-key-file "$work/api.key" \
    --tls-cert "$work/tls.crt" --tls-key "$work/tls.key"
  MUSER_TLS_URL="$url" MUSER_TLS_CA="$work/tls.crt" MUSER_TLS_KEY="$(cat "$work/api.key")" \
    MUSER_URL="$url" MUSER_PID="$pid" timeout 60 python3 tests/hostile/hostile.py
else
  echo "hostile tls: skipped (no openssl)"
fi
