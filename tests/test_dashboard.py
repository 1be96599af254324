"""``swarm dashboard`` against a live 1-stage swarm with one trainer: ``/api/state``, text sampled from the live
model, and the page in a real headless Chromium (skipped, with the reason, where no Chromium and chromedriver
are installed)."""

from __future__ import annotations

import json
import shutil
import time
import urllib.error
import urllib.request
import uuid
from typing import Any, Callable, Dict, Iterator, Tuple

import pytest

from tests.utils.processes import Launcher

HTTP_TIMEOUT_S = 5.0
SAMPLE_TOKENS = 12  # tokens the live dashboard samples every 2 s: a fraction of a second on the tiny model


def get(url: str) -> Tuple[int, bytes, str]:
    try:
        with urllib.request.urlopen(url, timeout=HTTP_TIMEOUT_S) as response:
            return response.status, response.read(), response.headers.get("Content-Type", "")
    except urllib.error.HTTPError as e:
        return e.code, e.read(), e.headers.get("Content-Type", "")


def state_of(url: str) -> Dict[str, Any]:
    status, body, content_type = get(url + "api/state")
    assert status == 200 and content_type == "application/json"
    return json.loads(body)


def wait_for_state(url: str, predicate: Callable[[Dict[str, Any]], bool], timeout: float, what: str) -> Dict[str, Any]:
    deadline = time.monotonic() + timeout
    state: Dict[str, Any] = {}
    while time.monotonic() < deadline:
        state = state_of(url)
        if predicate(state):
            return state
        time.sleep(0.5)
    raise TimeoutError(f"the dashboard did not show {what} within {timeout}s; last state: {json.dumps(state)[:2000]}")


@pytest.fixture(scope="module")
def live(tmp_path_factory) -> Iterator[Tuple[Launcher, str]]:
    """A 1-stage swarm (one peer, one trainer) and a dashboard of it; everything is stopped at the end."""
    launcher = Launcher(tmp_path_factory.mktemp("dashboard_swarm"), run_id=f"t{uuid.uuid4().hex[:8]}")
    try:
        launcher.bootstrap(num_stages=1)
        launcher.peer(0, num_stages=1, target_batch_size=32)
        launcher.trainer(num_stages=1, target_batch_size=32, extra=["--batch_size", "4"])
        dashboard = launcher.start("dashboard", ["--run_id", launcher.run_id, "--num_stages", "1", "--port", "0",
                                                 "--period_s", "0.5", "--initial_peers", ",".join(launcher.initial_peers),
                                                 "--sample_period_s", "2", "--sample_tokens", str(SAMPLE_TOKENS)],
                                   name="dashboard")
        url = dashboard.wait_event("dashboard_ready", timeout=60)["url"]
        yield launcher, url
    finally:
        launcher.close()


def test_api_state_shows_the_live_run(live):
    launcher, url = live
    state = wait_for_state(
        url, lambda s: s["stages"][0]["replicas"] == 1 and s["trainers"] and s["trainers"][0]["loss"] is not None
        and s["global_step"] is not None and s["global_step"] >= 1 and s["join"]["complete"]
        and any(loss is not None for loss in s["history"]["loss"]) and len(s["history"]["t"]) >= 2, timeout=120,
        what="a replica, a trainer with a loss, a global step and the run's settings")
    assert state["run_id"] == launcher.run_id and state["num_stages"] == 1 and state["poll"]["ok"]
    peer, trainer = state["peers"][0], state["trainers"][0]
    assert peer["stage"] == 0 and peer["state"] == "online" and peer["samples_processed"] > 0 and not peer["banned"]
    assert state["stages"][0]["throughput"] > 0 and trainer["samples_per_s"] > 0 and 0 < trainer["loss"] < 20
    assert state["swarm"]["num_trainers"] == 1 and state["steps"] and state["steps"][-1]["step"] >= 1
    assert len(state["history"]["t"]) == len(state["history"]["loss"]) >= 2
    # the join command repeats the run's own settings, as its peer serves them
    join = state["join"]
    assert join["via"] == "initial_peers" and join["peer"].startswith("swarm peer --initial_peers ")
    for flag in (f"--run_id {launcher.run_id}", "--num_stages 1", "--target_batch_size 32", "--hidden_size 32"):
        assert flag in join["peer"], join["peer"]
    status, body, content_type = get(url)
    assert status == 200 and b"stages-table" in body and content_type.startswith("text/html")
    assert get(url + "static/app.js")[0] == 200 and get(url + "static/style.css")[0] == 200
    assert get(url + "static/../../records.py")[0] == 404 and get(url + "nothing")[0] == 404


def test_the_live_model_is_sampled_every_period(live):
    launcher, url = live
    state = wait_for_state(url, lambda s: s["sample"] is not None and s["sample"]["text"] != ""
                           and s["sample"]["step"] is not None, timeout=60, what="a sample of the live model")
    first = state["sample"]
    assert first["error"] is None and first["prompt"] == "The" and first["num_tokens"] == SAMPLE_TOKENS
    assert first["tokens_per_s"] > 0 and abs(first["sampled_at"] - time.time()) < 60
    assert 0 <= first["step"] <= state["global_step"]
    # the next period brings a fresh sample (a fresh seed: its text may differ)
    later = wait_for_state(url, lambda s: s["sample"]["sampled_at"] > first["sampled_at"], timeout=30,
                           what="a second sample")["sample"]
    assert later["error"] is None and later["text"] and later["step"] >= first["step"]


def _browser_paths() -> Tuple[str, str]:
    """Chromium and chromedriver, or a skip that says what is missing."""
    try:
        import selenium  # noqa: F401
    except ImportError:
        pytest.skip("selenium is not installed (pip install -e .[test])")
    browser = next(filter(None, map(shutil.which, ("chromium", "chromium-browser", "google-chrome"))), None)
    driver = shutil.which("chromedriver")
    if browser is None or driver is None:
        pytest.skip("no Chromium and chromedriver installed (Debian: apt-get install chromium chromium-driver)")
    return browser, driver


def test_page_in_headless_chromium_shows_the_live_run(live, tmp_path):
    browser, driver_path = _browser_paths()
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    launcher, url = live
    wait_for_state(url, lambda s: s["trainers"] and sum(x is not None for x in s["history"]["loss"]) >= 3, timeout=120,
                   what="three points of loss history")
    options = webdriver.ChromeOptions()
    options.binary_location = browser
    for flag in ("--headless", "--no-sandbox", "--disable-gpu", "--window-size=1400,1500", "--disable-dev-shm-usage"):
        options.add_argument(flag)
    driver = webdriver.Chrome(service=Service(executable_path=driver_path), options=options)
    try:
        driver.set_page_load_timeout(30)
        driver.get(url)
        wait = WebDriverWait(driver, 30, poll_frequency=0.3)
        wait.until(lambda d: int(d.find_element(By.ID, "loss-chart").get_attribute("data-points") or 0) >= 3)
        cells = [td.text for td in driver.find_elements(By.CSS_SELECTOR, "#stages-table tbody tr:first-child td")]
        state = state_of(url)
        assert cells[0] == "0" and cells[1] == "1", cells  # stage 0 with its one replica
        assert float(cells[3].replace(",", "")) > 0, cells  # its throughput
        chart = driver.find_element(By.ID, "loss-chart")
        assert chart.find_elements(By.CSS_SELECTOR, "path.line"), "the loss chart drew no line"
        last_loss = float(chart.get_attribute("data-last"))
        assert 0 < last_loss < 20 and any(abs(last_loss - x) < 1e-9 for x in state["history"]["loss"] if x is not None)
        assert float(driver.find_element(By.ID, "loss-value").text) > 0
        assert driver.find_element(By.ID, "run-id").text == launcher.run_id
        assert driver.find_element(By.ID, "join-peer").text.startswith("swarm peer --initial_peers ")
        assert "live" in driver.find_element(By.ID, "poll-status").text
        # the sample panel: the prompt in bold, then the continuation, then its step, speed and age
        wait.until(lambda d: d.find_element(By.ID, "sample-section").is_displayed())
        assert driver.find_element(By.CSS_SELECTOR, "#sample-section b#sample-prompt").text == "The"
        meta = driver.find_element(By.ID, "sample-meta").text
        assert meta.startswith("step ") and " tokens/s, " in meta and meta.endswith(" ago"), meta
        screenshot = tmp_path / "dashboard.png"
        assert driver.save_screenshot(str(screenshot)) and screenshot.stat().st_size > 10_000
    finally:
        driver.quit()


def test_bad_flags_and_a_busy_port_are_refused_with_the_reason(tmp_path):
    import socket

    from tests.utils.processes import RoleProcess, stop_all

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        roles = [RoleProcess("dashboard", ["--port", "70000"], tmp_path, "bad_port"),  # both at once: each imports torch
                 RoleProcess("dashboard", ["--port", str(port), "--run_id", "busy"], tmp_path, "busy_port")]
        try:
            bad, taken = roles
            assert bad.proc.wait(timeout=60) == 2 and "port must be in 0..65535" in bad.log_path.read_text()
            assert taken.proc.wait(timeout=60) == 1, taken.log_tail()
            assert f"cannot serve the dashboard on 127.0.0.1:{port}" in taken.log_path.read_text()
        finally:
            stop_all(roles, timeout=5)


@pytest.mark.long
def test_a_run_with_a_manifest_is_joined_with_its_address(launcher, tmp_path):
    manifest = tmp_path / "run.yaml"
    manifest.write_text(f"run_id: {launcher.run_id}\nnum_stages: 2\ntarget_batch_size: 64\n"
                        "model: {num_layers: 2, hidden_size: 32, num_heads: 2, seq_len: 16}\n")
    organiser = launcher.start("bootstrap", ["--manifest", str(manifest)], name="organiser")
    address = organiser.wait_event("bootstrap_ready", timeout=60)["join"]
    joined = launcher.start("dashboard", ["--join", address, "--port", "0", "--period_s", "0.5"], name="joined")
    # a dashboard given the organiser as a plain initial peer finds the manifest it publishes in the DHT
    found = launcher.start("dashboard", ["--initial_peers", address, "--run_id", launcher.run_id, "--num_stages", "2",
                                         "--port", "0", "--period_s", "0.5"], name="found")
    for dashboard in (joined, found):
        url = dashboard.wait_event("dashboard_ready", timeout=60)["url"]
        state = wait_for_state(url, lambda s: s["join"]["via"] == "manifest", timeout=30, what="the run's manifest")
        assert state["run_id"] == launcher.run_id and state["num_stages"] == 2 and len(state["stages"]) == 2
        assert state["join"]["peer"] == f"swarm peer --join {address}", state["join"]
        assert state["join"]["trainer"] == f"swarm train --join {address}"
