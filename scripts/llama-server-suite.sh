#!/usr/bin/env bash
# llama.cpp b11434's own server test-suite (tools/server/tests in the comparator's sdist, pytest)
# run against `muser up`, or against llama-server for the comparison. The upstream harness starts
# the server binary named by LLAMA_SERVER_BIN_PATH with llama-server's flags; for Muser that
# binary is `muser up` itself (it accepts llama-server's spellings), and every model preset is
# replaced by SmolLM2-135M (scripts/llama_suite_plugin.py). Files that need what this workplace
# does not have are left out, each with its reason (EXCLUDED below).
#   scripts/llama-server-suite.sh                    # against muser
#   SUITE_SERVER=llama scripts/llama-server-suite.sh # against llama-server (scripts/comparator.sh)
#   scripts/llama-server-suite.sh unit/test_basic.py # a subset (pytest arguments)
#   SUITE_MUSER_BIN=path/to/muser scripts/llama-server-suite.sh # another muser build
# Writes docs/receipts/llama-server-suite-$SUITE_SERVER.json (pass/fail/skip per test file and
# the failing tests, seconds per file; a selection writes ...-$SUITE_SERVER-SELECTION.json
# instead, SUITE_RECEIPT=PATH writes PATH) and prints `N passed, M failed, K skipped`; pytest's log goes to
# target/llama-server-suite-$SUITE_SERVER.log. The whole run takes 25-40 minutes; CI runs its
# comparable part through scripts/test-llama-suite.sh. SUITE_DESELECT=FILE leaves out the tests
# named in FILE, one exact node id a line (scripts/llama_suite_plugin.py).
set -euo pipefail
cd "$(dirname "$0")/.."
root=$(pwd)
cache="${MUSER_CACHE:-$HOME/.cache/muser}"
target="${SUITE_SERVER:-muser}"
models="${MUSER_MODELS:-$(scripts/fetch-models.sh)}"
model="$models/SmolLM2-135M-Instruct.Q4_1.gguf"
[ -f "$model" ] || { echo "llama-server-suite: missing $model (scripts/fetch-models.sh)" >&2; exit 1; }
src=$(LLAMA_FETCH_ONLY=1 scripts/comparator.sh | tail -n 1)
tests="$src/tools/server/tests"

# The suite's requirements, plus pytest-timeout so that a hung server fails one test only.
venv="$cache/venv-llama-suite"
pins="$(sort "$tests/requirements.txt" | tr '\n' ' ')pytest-timeout~=2.3"
if [ "$(cat "$venv/.pins" 2>/dev/null)" != "$pins" ]; then
  rm -rf "$venv"
  python3 -m venv "$venv"
  "$venv/bin/pip" install -q --disable-pip-version-check -r "$tests/requirements.txt" "pytest-timeout~=2.3" >&2
  echo "$pins" > "$venv/.pins"
fi

case "$target" in
  muser)
    bin="${SUITE_MUSER_BIN:-}"
    if [ -z "$bin" ]; then
      cargo build --release --locked -q -p muser-cli >&2
      bin="$root/${CARGO_TARGET_DIR:-target}/release/muser"
    fi ;;
  llama)
    bin="$(LLAMA_TARGETS=llama-server scripts/comparator.sh | tail -n 1)/llama-server" ;;
  *) echo "llama-server-suite: SUITE_SERVER must be muser or llama" >&2; exit 2 ;;
esac

# Left out, with the reason (the same for both servers, so the comparison is like for like).
EXCLUDED=(
  "unit/test_lora.py: LoRA adapters (out of scope for Muser)"
  "unit/test_mcp_servers.py: MCP servers (out of scope)"
  "unit/test_tools_builtin.py: built-in shell/file tools (out of scope)"
  "unit/test_router.py: the multi-model router (out of scope)"
  "unit/test_proxy.py: the router's proxy (out of scope)"
  "unit/test_stream.py: stream resumption (/v1/stream) through the router (every test starts ServerPreset.router(); out of scope)"
  "unit/test_speculative.py: needs a draft model pair (issue #26)"
  "unit/test_vision_api.py: needs a vision model and projector (issue #31)"
)
ignore=()
for e in "${EXCLUDED[@]}"; do ignore+=(--ignore "${e%%:*}"); done

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cp -r "$tests/." "$work/"
# muser is started as `muser up FLAGS...`: the harness runs one path, so a two-line launcher
if [ "$target" = muser ]; then
  printf '#!/bin/sh\nexec "%s" up "$@"\n' "$bin" > "$work/server"
else
  printf '#!/bin/sh\nexec "%s" "$@"\n' "$bin" > "$work/server"
fi
chmod +x "$work/server"
port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')

args=("$@"); [ ${#args[@]} -gt 0 ] || args=(unit)
log="$root/${CARGO_TARGET_DIR:-target}/llama-server-suite-$target.log"
(cd "$work" && SUITE_MODEL="$model" LLAMA_SERVER_BIN_PATH="$work/server" PORT="$port" \
  PYTHONPATH="$work:$root/scripts" "$venv/bin/python" -m pytest -q -p no:cacheprovider \
  -p llama_suite_plugin --timeout "${SUITE_TIMEOUT_S:-120}" --junitxml="$work/junit.xml" \
  "${ignore[@]}" "${args[@]}" > "$log" 2>&1) || true
tail -n 3 "$log" >&2

commit=$(git rev-parse HEAD)
# a selection gets its own receipt, named after it, beside the whole run's
slug=$(printf '%s' "$*" | tr -cs 'A-Za-z0-9_' '-' | sed 's/-*$//' | cut -c1-120)
receipt="${SUITE_RECEIPT:-docs/receipts/llama-server-suite-$target${slug:+-$slug}.json}"
"$venv/bin/python" - "$work/junit.xml" "$receipt" "$target" "$commit" "$*" "${EXCLUDED[@]}" <<'PY'
import json, platform, os, sys, xml.etree.ElementTree as ET
junit, receipt, target, commit, selection, *excluded = sys.argv[1:]
files, failing = {}, []
for case in ET.parse(junit).getroot().iter("testcase"):
    name = case.get("classname", "").replace(".", "/") + ".py"
    outcome = "passed"
    for tag, o in (("failure", "failed"), ("error", "failed"), ("skipped", "skipped")):
        if case.find(tag) is not None:
            outcome = o
    f = files.setdefault(name, {"passed": 0, "failed": 0, "skipped": 0, "seconds": 0.0})
    f[outcome] += 1
    f["seconds"] = round(f["seconds"] + float(case.get("time") or 0), 1)
    if outcome == "failed":
        failing.append(f"{name}::{case.get('name')}")
total = {k: sum(f[k] for f in files.values()) for k in ("passed", "failed", "skipped")}
total["seconds"] = round(sum(f["seconds"] for f in files.values()), 1)
out = {
    "command": "scripts/llama-server-suite.sh" + (f" {selection}" if selection else ""),
    "server": target,
    "commit": commit,
    "machine": {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count()},
    "model": "SmolLM2-135M-Instruct.Q4_1.gguf",
    "totals": total,
    "files": dict(sorted(files.items())),
    "failing": sorted(failing),
    "excluded": excluded,
}
with open(receipt, "w") as fh:
    json.dump(out, fh, indent=1)
    fh.write("\n")
print(f"{total['passed']} passed, {total['failed']} failed, {total['skipped']} skipped ({receipt})")
PY
