"""Bounded load: 2000 short requests from 32 connections, only 200 or 429, and memory stays
flat (RSS after ≤ RSS before + 64 MiB)."""

import threading
import time
from collections import Counter

import requests

N_REQUESTS = 2000
N_CONNECTIONS = 32
RSS_MARGIN_KB = 64 * 1024


def rss_kb(pid):
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise RuntimeError("no VmRSS")


def test_bounded_load(base_url, server_pid):
    # Warm up every slot first so the baseline includes steady-state allocations.
    for i in range(8):
        requests.post(f"{base_url}/v1/completions", json={"prompt": f"warm {i}", "max_tokens": 2}, timeout=60)
    before = rss_kb(server_pid)
    statuses = Counter()
    lock = threading.Lock()
    next_index = iter(range(N_REQUESTS))
    deadline = time.monotonic() + 420

    def worker():
        session = requests.Session()
        while time.monotonic() < deadline:
            with lock:
                i = next(next_index, None)
            if i is None:
                return
            r = session.post(
                f"{base_url}/v1/completions",
                json={"prompt": f"Count: {i}", "max_tokens": 1 + i % 2, "temperature": 0},
                timeout=120,
            )
            with lock:
                statuses[r.status_code] += 1

    threads = [threading.Thread(target=worker) for _ in range(N_CONNECTIONS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sum(statuses.values()) == N_REQUESTS, f"only {sum(statuses.values())} requests done in time"
    assert set(statuses) <= {200, 429}, statuses
    assert statuses[200] > 0
    after = rss_kb(server_pid)
    assert after <= before + RSS_MARGIN_KB, f"RSS grew from {before} kB to {after} kB"
    assert requests.get(f"{base_url}/health", timeout=10).status_code == 200
