"""Hostile clients against a running `muser up` (started by scripts/test-hostile.sh): every
bounded class of request, slow and idle connections, huge headers, malformed bytes, and 2,000
mixed requests from 16 clients; afterwards the server must answer exactly as before and its
resident memory must be back within 64 MiB of the start. Loopback only, standard library
only, bounded in count and time. Exits non-zero on the first failure."""

import http.client
import json
import os
import random
import socket
import ssl
import sys
import threading
import time
import urllib.parse

URL = urllib.parse.urlparse(os.environ["MUSER_URL"])
PID = int(os.environ["MUSER_PID"])
HOST, PORT = URL.hostname, URL.port
HEADER_TIMEOUT_S = 10  # limits::HEADER_READ_TIMEOUT
T0 = time.monotonic()


def log(msg):
    print(f"[{time.monotonic() - T0:6.1f}s] {msg}", flush=True)


def rss_mib():
    with open(f"/proc/{PID}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS")


def request(method, path, body=None, headers=None, timeout=60, raw=None):
    """One request on a fresh connection: (status, parsed JSON or text, headers)."""
    conn = http.client.HTTPConnection(HOST, PORT, timeout=timeout)
    h = {"Content-Type": "application/json"}
    h.update(headers or {})
    data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
    try:
        conn.request(method, path, body=data, headers=h)
        r = conn.getresponse()
        text = r.read().decode("utf-8", "replace")
        try:
            parsed = json.loads(text)
        except ValueError:
            parsed = text
        return r.status, parsed, dict(r.getheaders())
    finally:
        conn.close()


def expect(status, method, path, body=None, needle=None, **kw):
    got, v, _ = request(method, path, body, **kw)
    msg = v["error"]["message"] if isinstance(v, dict) and "error" in v else str(v)[:200]
    assert got == status, f"{method} {path}: {got}, expected {status}: {msg}"
    if needle:
        assert needle in msg, f"{method} {path}: `{msg}` lacks `{needle}`"
    return v


def greedy_answer():
    v = expect(200, "POST", "/completion", {"prompt": "The capital of France is", "n_predict": 8,
                                            "temperature": 0, "cache_prompt": False})
    return v["content"]


def raw_exchange(payload, timeout=15):
    """Sends raw bytes and returns whatever comes back until the server closes or a timeout."""
    s = socket.create_connection((HOST, PORT), timeout=timeout)
    try:
        s.sendall(payload)
        out = b""
        while True:
            try:
                chunk = s.recv(65536)
            except (socket.timeout, ConnectionResetError):
                break
            if not chunk:
                break
            out += chunk
        return out
    finally:
        s.close()


def status_of(reply):
    line = reply.split(b"\r\n", 1)[0].split()
    return int(line[1]) if len(line) > 1 else None


# -- the engine-stopping classes ----------------------------------------------------------


def engine_classes():
    c = "/completion"
    ok = {"prompt": "Hi", "n_predict": 2, "temperature": 0}
    expect(400, "POST", c, dict(ok, logit_bias=[[17, 1e39], [17, False]]), "17")
    expect(400, "POST", c, dict(ok, logit_bias=[[17, 5], [17, False]]), "more than once")
    expect(400, "POST", c, dict(ok, logit_bias=[[2**40, 1]]), "vocabulary")
    expect(400, "POST", "/v1/completions", {"prompt": "x", "logit_bias": {"5": 1, "005": 2}}, "more than once")
    for field, value in [("temperature", 1e39), ("top_p", -1e39), ("min_p", 1e39),
                         ("repeat_penalty", 0), ("presence_penalty", 1e39), ("typical_p", -1)]:
        expect(400, "POST", c, dict(ok, **{field: value}), field)
    expect(400, "POST", c, dict(ok, n_probs=10_000), "20")
    expect(400, "POST", c, dict(ok, stop=["a"] * 1000), "stop")
    expect(400, "POST", c, dict(ok, stop=["a" * 100_000]), "256")
    expect(400, "POST", c, dict(ok, logit_bias=[[t, 1] for t in range(5000)]), "1024")
    # ignore_eos with a bias of its own on the same token is not a duplicate
    expect(200, "POST", c, dict(ok, ignore_eos=True, logit_bias=[[2, 100]]))
    # JSON grammars: too large, too deep
    big = {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(5000)}}
    expect(400, "POST", c, dict(ok, json_schema=big), "65536")
    deep = {"type": "array"}
    for _ in range(40):
        deep = {"type": "array", "items": deep}
    expect(400, "POST", c, dict(ok, json_schema=deep), "deeper")
    expect(200, "GET", "/health")


# -- bounded work, decided before the work ------------------------------------------------


def bounded_work():
    rss0 = rss_mib()
    t = time.monotonic()
    # 413: declared, then actual
    reply = raw_exchange(b"POST /completion HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                         b"Content-Length: 600000000\r\n\r\n{", timeout=10)
    assert status_of(reply) == 413, reply[:200]
    # a body that is larger than it says: refused once the limit is crossed (413, or the
    # connection closed under the sender)
    try:
        got, _, _ = request("POST", "/completion", raw=b'{"prompt":"' + b"a" * (5 << 20) + b'"}')
        assert got == 413, got
    except (BrokenPipeError, ConnectionResetError):
        pass
    # nested single-element prompt arrays and huge element counts
    for depth in (10, 200, 100_000):
        body = b'{"prompt":' + b"[" * depth + b"1" + b"]" * depth + b"}"
        got, _, _ = request("POST", "/completion", raw=body)
        assert got in (400, 415), (depth, got)
    body = b'{"prompt":[[' + b"1," * 1_500_000 + b'1]]}'
    expect(400, "POST", "/completion", raw=body, needle="at most")
    # prompts past the context are refused without tokenizing them all
    t1 = time.monotonic()
    expect(400, "POST", "/completion", {"prompt": "ab " * 1_300_000}, "context")
    expect(400, "POST", "/v1/chat/completions",
           {"messages": [{"role": "user", "content": "ab " * 1_300_000}]}, "context")
    expect(400, "POST", "/api/generate", {"model": "", "prompt": "ab " * 1_300_000, "stream": False})
    expect(400, "POST", "/tokenize", {"content": "ab " * 1_300_000}, "131072")
    assert time.monotonic() - t1 < 5, f"refusals took {time.monotonic() - t1:.1f} s"
    expect(400, "POST", "/detokenize", {"tokens": [1] * 200_000}, "131072")
    expect(400, "POST", "/v1/chat/completions",
           {"messages": [{"role": "user", "content": "x"}] * 5000}, "4096")
    log(f"bounded work: {time.monotonic() - t:.1f} s, RSS {rss0:.0f} -> {rss_mib():.0f} MiB")


# -- access ------------------------------------------------------------------------------


def access():
    expect(403, "GET", "/v1/models", headers={"Host": "attacker.example"}, needle="--allow-host")
    expect(403, "POST", "/completion", {"prompt": "x"}, headers={"Host": "127.0.0.1.nip.io:80"})
    expect(200, "GET", "/v1/models", headers={"Host": f"localhost:{PORT}"})
    expect(415, "POST", "/slots/0?action=erase", raw=b"", headers={"Content-Type": "text/plain"})
    expect(415, "POST", "/completion", raw=b"prompt=x",
           headers={"Content-Type": "application/x-www-form-urlencoded"})


# -- malformed bytes ---------------------------------------------------------------------


def malformed():
    for raw in [b'{"prompt":"\xff\xfe\xfd"}', b'{"prompt":"a\xc3"}', b"\x00\x01\x02",
                b'{"prompt":"x"' + b" " * 1000, b'{"prompt":"\\ud800"}']:
        got, _, _ = request("POST", "/completion", raw=raw)
        assert 400 <= got < 500, (raw[:30], got)
    for line in [b"GET /\xff\xfe HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n",
                 b"GET / HTTP/1.1\r\nHost: \xff\r\nX: \x80\x81\r\n\r\n",
                 b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03" + os.urandom(64),
                 b"BREW /coffee HTCPCP/1.0\r\n\r\n"]:
        reply = raw_exchange(line, timeout=HEADER_TIMEOUT_S + 5)
        code = status_of(reply)
        assert code is None or 400 <= code < 500, (line[:30], reply[:100])


# -- huge headers, slowloris, idle connections -------------------------------------------


def connections():
    reply = raw_exchange(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Big: " + b"a" * (200 << 10) + b"\r\n\r\n")
    assert status_of(reply) in (None, 431), reply[:100]
    reply = raw_exchange(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n" + b"X-H: v\r\n" * 2000 + b"\r\n")
    assert status_of(reply) in (None, 431), reply[:100]

    idle, slow = [], []
    for _ in range(1000):
        idle.append(socket.create_connection((HOST, PORT), timeout=5))
    for _ in range(32):
        s = socket.create_connection((HOST, PORT), timeout=5)
        s.sendall(b"GET /health HTTP/1.1\r\n")
        slow.append(s)
    opened = time.monotonic()
    log(f"1000 idle and 32 slowloris connections open; RSS {rss_mib():.0f} MiB")
    # the server answers while they are open
    expect(200, "GET", "/health")
    greedy_answer()
    # slowloris: a header line every second; the server closes them at the header deadline
    closed = 0
    while time.monotonic() - opened < HEADER_TIMEOUT_S + 8 and closed < len(slow):
        closed = 0
        for s in slow:
            try:
                s.sendall(b"X-a: b\r\n")
            except OSError:
                closed += 1
        time.sleep(1)
    assert closed == len(slow), f"{len(slow) - closed} slowloris connections still open"
    # idle connections were closed by the same deadline: each reads EOF
    for s in idle:
        s.settimeout(5)
        try:
            assert s.recv(1) == b""
        except (ConnectionResetError, socket.timeout) as e:
            assert not isinstance(e, socket.timeout), "an idle connection is still open"
        s.close()
    for s in slow:
        s.close()
    log("slowloris and idle connections were closed by the server")


# -- a disconnecting client frees its slot -----------------------------------------------


def disconnect_frees_slot():
    s = socket.create_connection((HOST, PORT), timeout=30)
    body = json.dumps({"prompt": "Count to a thousand:", "n_predict": 1500, "stream": True,
                       "ignore_eos": True, "id_slot": 1}).encode()
    s.sendall(b"POST /completion HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
              + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
    seen = b""
    while b"data:" not in seen:
        chunk = s.recv(4096)
        assert chunk, "the stream ended before its first token"
        seen += chunk
    def busy():
        return request("GET", "/slots")[1][1]["is_processing"]

    assert busy(), "slot 1 is not generating"
    s.close()
    t = time.monotonic()
    while busy():
        assert time.monotonic() - t < 10, "the slot stayed busy after the client left"
        time.sleep(0.05)
    log(f"a client that left freed its slot in {time.monotonic() - t:.2f} s")


# -- 2,000 mixed requests from 16 clients ------------------------------------------------

VALID = [
    ("POST", "/completion", {"prompt": "Hello", "n_predict": 2, "temperature": 0}, 200),
    ("POST", "/tokenize", {"content": "hello world"}, 200),
    ("POST", "/detokenize", {"tokens": [1, 2, 3]}, 200),
    ("GET", "/health", None, 200),
    ("GET", "/v1/models", None, 200),
    ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}, 200),
    ("POST", "/api/generate", {"model": "", "prompt": "Hi", "stream": False, "options": {"num_predict": 2}}, 200),
]
INVALID = [
    ("POST", "/completion", {"prompt": "x", "logit_bias": [[17, 1e39], [17, False]]}, 400),
    ("POST", "/completion", {"prompt": "x", "nonsense": 1}, 400),
    ("POST", "/completion", {"prompt": [[[1]]]}, 400),
    ("POST", "/v1/completions", {"prompt": "x", "temperature": "hot"}, 400),
    ("POST", "/tokenize", b"{not json", 400),  # malformed JSON: 400, as llama-server answers
    ("POST", "/completion", b'{"prompt":"\xff"}', None),
    ("GET", "/no/such/route", None, 404),
    ("POST", "/slots/99?action=erase", {}, 400),
    ("POST", "/completion", {"prompt": "x", "stop": ["s"] * 100}, 400),
]


def mixed(n_total=2000, n_clients=16):
    errors, counts = [], {"ok": 0}
    lock = threading.Lock()
    per = n_total // n_clients

    def client(seed):
        rng = random.Random(seed)
        conn = http.client.HTTPConnection(HOST, PORT, timeout=60)
        for _ in range(per):
            method, path, body, want = rng.choice(VALID if rng.random() < 0.5 else INVALID)
            raw = body if isinstance(body, bytes) else (None if body is None else json.dumps(body).encode())
            try:
                conn.request(method, path, body=raw, headers={"Content-Type": "application/json"})
                r = conn.getresponse()
                r.read()
                got = r.status
                if r.getheader("Connection", "").lower() == "close":
                    conn.close()
                    conn = http.client.HTTPConnection(HOST, PORT, timeout=60)
            except (OSError, http.client.HTTPException) as e:
                conn.close()
                conn = http.client.HTTPConnection(HOST, PORT, timeout=60)
                got = f"{type(e).__name__}"
            fine = (got == want) if want else (isinstance(got, int) and got < 500) or got == 429
            if got == 429 and want == 200:
                fine = True  # the queue was full: an honest answer
            with lock:
                counts["ok"] += fine
                if not fine and len(errors) < 10:
                    errors.append((method, path, got, want))
        conn.close()

    t = time.monotonic()
    threads = [threading.Thread(target=client, args=(i,)) for i in range(n_clients)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout=150)
    assert not any(th.is_alive() for th in threads), "mixed clients did not finish in 150 s"
    assert not errors, errors
    log(f"{per * n_clients} mixed requests from {n_clients} clients in {time.monotonic() - t:.1f} s")


def main():
    greedy_answer()
    before = greedy_answer()
    rss_start = rss_mib()
    log(f"start: RSS {rss_start:.0f} MiB, answer {before!r}")
    for phase in [engine_classes, bounded_work, access, malformed, connections,
                  disconnect_frees_slot, mixed]:
        phase()
        assert greedy_answer() == before, f"the answer changed after {phase.__name__}"
        log(f"{phase.__name__}: passed")
    time.sleep(1)
    rss_end = rss_mib()
    log(f"end: RSS {rss_end:.0f} MiB (start {rss_start:.0f} MiB)")
    assert rss_end - rss_start < 64, f"RSS grew by {rss_end - rss_start:.0f} MiB"
    print(f"hostile: all phases passed in {time.monotonic() - T0:.0f} s")



def tls_main():
    """Against a server started with --tls-cert/--tls-key and an API key file."""
    url = urllib.parse.urlparse(os.environ["MUSER_TLS_URL"])
    ctx = ssl.create_default_context(cafile=os.environ["MUSER_TLS_CA"])
    key = os.environ["MUSER_TLS_KEY"]

    def get(path, headers):
        conn = http.client.HTTPSConnection(url.hostname, url.port, context=ctx, timeout=30)
        try:
            conn.request("GET", path, headers=headers)
            r = conn.getresponse()
            r.read()
            return r.status
        finally:
            conn.close()

    assert get("/v1/models", {"Authorization": f"Bearer {key}"}) == 200
    assert get("/v1/models", {}) == 401
    assert get("/health", {}) == 200
    # plain HTTP to the TLS port gets no answer
    s = socket.create_connection((url.hostname, url.port), timeout=12)
    s.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
    try:
        reply = s.recv(4096)
    except (ConnectionResetError, socket.timeout):
        reply = b""
    s.close()
    assert b"HTTP/1.1 200" not in reply, reply[:100]
    print("hostile tls: HTTPS with a key answers, without the key 401, plain HTTP refused")


if __name__ == "__main__" and os.environ.get("MUSER_TLS_URL"):
    tls_main()
elif __name__ == "__main__":
    main()
