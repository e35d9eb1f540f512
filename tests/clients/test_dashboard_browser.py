"""The dashboard in a real browser: headless Chromium (Debian's package) driven by Selenium.
It loads, the Add-node form reports a refused enrollment, its numbers move while a client
generates, a chat message streams an answer, a session is saved and restored, and the
console stays free of errors. Screenshots go to
$MUSER_ARTIFACTS (default target/test-artifacts)."""

import os
import shutil
import tempfile
import threading

import pytest
import requests
from conftest import spawn_muser
from selenium import webdriver
from selenium.webdriver.chrome.options import Options
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.common.keys import Keys
from selenium.webdriver.support.ui import WebDriverWait

ARTIFACTS = os.environ.get("MUSER_ARTIFACTS", "target/test-artifacts")


@pytest.fixture(scope="module")
def browser():
    chromium = shutil.which("chromium")
    driver_path = shutil.which("chromedriver")
    if not (chromium and driver_path):
        pytest.fail("chromium and chromium-driver are missing: scripts/test-clients.sh installs them")
    opts = Options()
    opts.binary_location = chromium
    for arg in ["--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                "--window-size=1440,1500", "--no-first-run", "--disable-extensions"]:
        opts.add_argument(arg)
    opts.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(service=Service(executable_path=driver_path), options=opts)
    driver.set_page_load_timeout(30)
    os.makedirs(ARTIFACTS, exist_ok=True)
    yield driver
    driver.quit()


def text(driver, element_id):
    return driver.find_element(By.ID, element_id).text


def shot(driver, name):
    driver.save_screenshot(os.path.join(ARTIFACTS, f"dashboard-{name}.png"))


def test_dashboard_end_to_end(base_url, browser):
    d = browser
    wait = WebDriverWait(d, 60, poll_frequency=0.2)
    d.get(base_url + "/")
    assert d.title == "Muser"
    wait.until(lambda d: text(d, "live") == "live")
    assert "No nodes configured" in text(d, "nodes")

    # the Add-node form posts to /v1/nodes and shows why an enrollment was refused
    wait.until(lambda d: d.find_element(By.ID, "node-form").is_displayed())
    d.find_element(By.ID, "node-name").send_keys("prod")
    d.find_element(By.ID, "node-url").send_keys("https://127.0.0.1:9")
    d.find_element(By.ID, "node-code").send_keys("mu1-not-a-code")
    d.find_element(By.ID, "node-add").click()
    wait.until(lambda d: "failed: an enrollment code is" in text(d, "node-steps"))
    assert d.find_element(By.ID, "node-code").get_attribute("value") == ""
    # the browser logs the refused request itself (and nothing else)
    logged = [e["message"] for e in d.get_log("browser") if e["level"] == "SEVERE"]
    assert all("/v1/nodes" in m and "400" in m for m in logged), logged

    # a client generates: the throughput card and the chart's numbers move
    stop = threading.Event()

    def client():
        while not stop.is_set():
            requests.post(f"{base_url}/v1/completions",
                          json={"prompt": "Write a list of animals:", "max_tokens": 24, "temperature": 0},
                          timeout=120)

    workers = [threading.Thread(target=client) for _ in range(2)]
    for w in workers:
        w.start()
    try:
        wait.until(lambda d: float(text(d, "m-tps").replace(",", "").replace("–", "0")) >= 5)
        wait.until(lambda d: text(d, "m-ttft") != "–" and text(d, "m-itl") != "–")
        wait.until(lambda d: "generating" in text(d, "slots"))
        shot(d, "load")
    finally:
        stop.set()
        for w in workers:
            w.join()
    assert float(text(d, "m-tps").replace(",", "")) > 0

    # chat: the answer streams into the pane
    box = d.find_element(By.ID, "chat-input")
    box.send_keys("What is the capital of France?")
    d.find_element(By.ID, "chat-send").click()
    wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, ".bubble.assistant .text"))
    wait.until(lambda d: not d.find_elements(By.CSS_SELECTOR, ".bubble.streaming"))
    answer = d.find_elements(By.CSS_SELECTOR, ".bubble.assistant .text")[-1].text
    assert answer.strip() and not answer.startswith("Error"), answer
    assert "tok/s" in text(d, "chat-stats") or "first token" in text(d, "chat-stats")
    shot(d, "chat")

    # save the chat as a session, clear the pane, restore it
    d.find_element(By.ID, "session-save").click()
    wait.until(lambda d: text(d, "session-status").startswith("Saved"))
    wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, "#session-list .session"))
    saved_id = text(d, "session-status").split()[1]
    d.find_element(By.ID, "chat-clear").click()
    assert not d.find_elements(By.CSS_SELECTOR, ".bubble")
    d.find_element(By.CSS_SELECTOR, f"button[data-session='{saved_id}']").click()
    wait.until(lambda d: text(d, "session-status").startswith("Restored"))
    bubbles = d.find_elements(By.CSS_SELECTOR, ".bubble .text")
    assert [b.text for b in bubbles] == ["What is the capital of France?", answer]
    shot(d, "restored")

    # the conversation goes on from the restored cache
    box.send_keys("And of Italy?")
    d.find_element(By.ID, "chat-send").click()
    wait.until(lambda d: len(d.find_elements(By.CSS_SELECTOR, ".bubble.assistant .text")) == 2)
    wait.until(lambda d: not d.find_elements(By.CSS_SELECTOR, ".bubble.streaming"))
    assert "prompt tokens reused" in text(d, "chat-stats")
    shot(d, "continued")

    errors = [e for e in d.get_log("browser") if e["level"] == "SEVERE"]
    assert not errors, errors


def test_dashboard_asks_once_for_the_api_key(browser):
    with tempfile.TemporaryDirectory() as work:
        key_file = os.path.join(work, "kv.key")
        with open(key_file, "w") as f:
            f.write("ab" * 32)
        with spawn_muser("--api-key", "dash-key-0123456789abcdef", "--kv-key-file", key_file,
                         "--session-dir", os.path.join(work, "sessions")) as url:
            d = browser
            wait = WebDriverWait(d, 60, poll_frequency=0.2)
            d.get(url + "/")
            wait.until(lambda d: d.find_element(By.ID, "key-dialog").get_attribute("open") is not None)
            assert text(d, "live") != "live"
            shot(d, "login")
            d.find_element(By.ID, "key-input").send_keys("dash-key-0123456789abcdef" + Keys.ENTER)
            wait.until(lambda d: text(d, "live") == "live")
            wait.until(lambda d: "No sessions yet" in text(d, "session-list"))
            assert text(d, "m-slots") == "0 / 1"
            # the key lives in page memory only: nothing in storage or cookies
            assert d.execute_script("return localStorage.length + sessionStorage.length") == 0
            assert d.get_cookies() == []
            errors = [e for e in d.get_log("browser") if e["level"] == "SEVERE" and "401" not in e["message"]]
            d.get("about:blank")
            assert not errors, errors
