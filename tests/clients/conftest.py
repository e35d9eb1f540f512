"""Shared fixtures: the server under test is started by scripts/test-clients.sh, which passes
its URL (MUSER_URL) and process id (MUSER_PID)."""

import os

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
