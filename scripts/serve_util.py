"""What scripts/serve-check.py and scripts/serve-compare.py share: the prompts, a JSON POST (whole
or streamed with each event's arrival time), a free port, and a server process started, waited
for (/health answering 200) and stopped.
Python standard library only."""
import contextlib, json, socket, subprocess, time, urllib.request

PROMPTS = [
    "The quick brown fox",
    "Once upon a time, in a small village by the sea, there lived an old fisherman who",
    "List three colors:",
    "In the beginning " * 40 + "and then",
]


def post(port, path, body, stream=False):
    """POSTs `body` as JSON to the local server; the parsed answer, or its non-empty lines."""
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as r:
        if stream:
            return [line.decode().strip() for line in r if line.strip()]
        return json.load(r)


def post_timed_stream(port, path, body, origin=None, on_event=None):
    """POSTs `body` (with "stream": true) and reads the server-sent events as they arrive:
    [(seconds since `origin` (a `time.perf_counter()` value; default: the request's sending),
    parsed event)] for each `data:` line but `[DONE]`; `on_event(t, event)` sees each one as it
    comes."""
    t0 = time.perf_counter() if origin is None else origin
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    events = []
    with urllib.request.urlopen(req, timeout=600) as r:
        for line in r:
            line = line.strip()
            if line.startswith(b"data: ") and line != b"data: [DONE]":
                events.append((time.perf_counter() - t0, json.loads(line[6:])))
                if on_event:
                    on_event(*events[-1])
    return events


def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    p = s.getsockname()[1]
    s.close()
    return p


@contextlib.contextmanager
def server(name, cmd, port, log, wait_s=600):
    """Runs `cmd` (output to `log`) until the block ends; enters once GET /health answers 200
    on `port`, raises if the process exits or `wait_s` pass first."""
    srv = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.time() + wait_s
        while True:
            if srv.poll() is not None:
                raise RuntimeError(f"{name} exited with {srv.returncode}")
            if time.time() > deadline:
                raise RuntimeError(f"{name} did not come up")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except Exception:
                pass
            time.sleep(0.5)
        yield srv
    finally:
        srv.terminate()
        try:
            srv.wait(timeout=30)
        except subprocess.TimeoutExpired:
            srv.kill()
