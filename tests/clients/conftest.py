"""Shared fixtures: the server under test is started by scripts/test-clients.sh, which passes
its URL (MUSER_URL) and process id (MUSER_PID)."""

import contextlib
import os
import re
import subprocess
import tempfile

import pytest
import requests


@pytest.fixture(scope="session")
def base_url():
    url = os.environ.get("MUSER_URL")
    if not url:
        pytest.fail("MUSER_URL is not set: run these tests through scripts/test-clients.sh")
    return url.rstrip("/")


@pytest.fixture(scope="session")
def model_id(base_url):
    data = requests.get(f"{base_url}/v1/models", timeout=10).json()["data"]
    assert len(data) == 1
    return data[0]["id"]


@pytest.fixture(scope="session")
def server_pid():
    pid = os.environ.get("MUSER_PID")
    if not pid:
        pytest.fail("MUSER_PID is not set: run these tests through scripts/test-clients.sh")
    return int(pid)


@contextlib.contextmanager
def spawn_muser(*args, env_extra=None):
    """A second `muser up` (SmolLM2, one slot, a free port, `/metrics` on) with extra arguments
    (and extra environment variables); yields its URL and stops it on exit."""
    env = {**os.environ, **(env_extra or {})}
    for var in ["MUSER_BIN", "MUSER_MODEL"]:
        if not env.get(var):
            pytest.fail(f"{var} is not set: run these tests through scripts/test-clients.sh")
    log = tempfile.TemporaryFile(mode="w+")  # a file, not a pipe: the server never blocks on it
    proc = subprocess.Popen(
        [env["MUSER_BIN"], "up", "--model", env["MUSER_MODEL"], "--port", "0", "--slots", "1",
         "-c", "2048", "--threads", "1", "--metrics", *args],
        stdout=subprocess.PIPE, stderr=log, text=True, env=env,
    )
    try:
        line = proc.stdout.readline()
        m = re.search(r"http://\S+", line)
        if not m:
            proc.terminate()
            proc.wait(timeout=30)
            log.seek(0)
            pytest.fail(f"no ready line from the second server: {line!r}; stderr: {log.read()[-2000:]}")
        yield m.group(0)
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        log.close()
