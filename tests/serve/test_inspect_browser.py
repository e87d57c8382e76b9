"""`asyncrl inspect` in a real browser: headless Chromium (Debian's `chromium`, `chromium-driver`;
.ci/run installs them) driven by selenium against the inspector started as users start it."""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import pytest

from benchmarks.inspect import start_inspector, stop_inspector, write_run

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
DRIVER = shutil.which("chromedriver")
pytestmark = pytest.mark.skipif(not (CHROMIUM and DRIVER), reason="needs Debian's chromium and chromium-driver "
                                "(apt-get install chromium chromium-driver; .ci/run installs them)")


@pytest.fixture(scope="module")
def inspector(tmp_path_factory):
    """A 40-step run, a multi-turn one and a directory that is not a run, behind one inspector."""
    root = tmp_path_factory.mktemp("runs")
    run, agent = write_run(root / "run", steps=40, rows=8), write_run(root / "agent", 10, 4, multi_turn=True)
    (root / "plain").mkdir()
    proc, url = start_inspector([run, agent, root / "plain"])
    yield url, run
    stop_inspector(proc)


@pytest.fixture(scope="module")
def browser():
    from selenium import webdriver
    from selenium.webdriver.chrome.options import Options
    from selenium.webdriver.chrome.service import Service

    options = Options()
    options.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--window-size=1400,900"):
        options.add_argument(arg)
    driver = webdriver.Chrome(service=Service(DRIVER), options=options)
    yield driver
    driver.quit()


def wait_for(check, timeout: float = 10.0):
    deadline = time.monotonic() + timeout
    while True:
        try:
            value = check()
        except Exception:  # noqa: BLE001 - the page may still be drawing
            value = None
        if value or time.monotonic() > deadline:
            return value
        time.sleep(0.1)


def shot(browser, tmp_path: Path, name: str) -> None:
    """Each view's screenshot (a broken page's is where to look first)."""
    assert browser.save_screenshot(str(tmp_path / f"{name}.png"))


def drawn(browser, key: str) -> int:
    """How many of the chart's canvas pixels are drawn."""
    return browser.execute_script("""
        const c = document.querySelector(`.chart[data-key="${arguments[0]}"] canvas`);
        if (!c) return 0;
        const d = c.getContext('2d').getImageData(0, 0, c.width, c.height).data;
        let n = 0; for (let i = 3; i < d.length; i += 4) if (d[i]) n++; return n;""", key)


def test_the_runs_page_draws_any_metric_for_every_run_and_smooths_it(inspector, browser, tmp_path):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys

    url, _ = inspector
    browser.get(url)
    assert "is not a run directory" in browser.find_element(By.CLASS_NAME, "runs").text
    assert wait_for(lambda: drawn(browser, "critic/score_mean") > 500)
    picker = browser.find_element(By.ID, "metric")
    picker.send_keys("perf/metric_3", Keys.ENTER)
    picker.send_keys(Keys.TAB)  # the change event
    assert wait_for(lambda: drawn(browser, "perf/metric_3") > 500)
    names = browser.execute_script("return inspector.charts.get('critic/score_mean').data.map(r => r.name)")
    assert names == ["run", "agent"]  # both runs overlaid; the directory that is not a run draws nothing
    before = browser.execute_script("return inspector.charts.get('critic/score_mean').data[0].smoothed.slice(-5)")
    browser.execute_script("const s = document.getElementById('smoothing'); s.value = 0.95;"
                           "s.dispatchEvent(new Event('input'))")
    after = browser.execute_script("return inspector.charts.get('critic/score_mean').data[0].smoothed.slice(-5)")
    assert after != before and browser.find_element(By.ID, "smoothing-value").text == "0.95"
    shot(browser, tmp_path, "runs")


def test_filter_the_rollouts_then_open_one_coloured_by_the_log_prob_difference(inspector, browser, tmp_path):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select

    url, _ = inspector
    browser.get(url + "runs/0/rollouts")
    assert len(browser.find_elements(By.CSS_SELECTOR, "tr.row")) == 50
    Select(browser.find_element(By.NAME, "source")).select_by_visible_text("synthetic/count")
    browser.find_element(By.NAME, "reward_min").send_keys("0.5")
    browser.find_element(By.NAME, "step_max").send_keys("20")
    browser.find_element(By.CSS_SELECTOR, "#filters button").click()
    rows = wait_for(lambda: browser.find_elements(By.CSS_SELECTOR, "tr.row") if "reward_min" in browser.current_url
                    else None)
    cells = [[td.text for td in r.find_elements(By.TAG_NAME, "td")] for r in rows]
    assert cells and all(c[2] == "synthetic/count" and float(c[3]) >= 0.5 and int(c[0]) <= 20 for c in cells)
    shot(browser, tmp_path, "table")
    step, rank = cells[0][0], cells[0][1]
    rows[0].find_elements(By.TAG_NAME, "td")[0].click()  # a click anywhere on the row opens it
    wait_for(lambda: "/rollouts/" + step in browser.current_url)
    assert f"step {step}, rank {rank}" in browser.find_element(By.TAG_NAME, "h1").text
    tokens = browser.find_elements(By.CSS_SELECTOR, "#tokens .tok")
    assert len(tokens) >= 4 and all("rgba" in t.get_attribute("style") for t in tokens)
    assert "rollout" in tokens[0].get_attribute("title") and "trainer" in tokens[0].get_attribute("title")
    shot(browser, tmp_path, "rollout")
    browser.find_element(By.LINK_TEXT, "advantage").click()
    assert wait_for(lambda: "color=advantage" in browser.current_url)


def test_a_multi_turn_trajectory_reads_as_a_conversation(inspector, browser, tmp_path):
    from selenium.webdriver.common.by import By

    url, _ = inspector
    browser.get(url + "runs/1/rollouts/10/0/1")
    turns = browser.find_elements(By.CSS_SELECTOR, "#conversation .turn")
    assert [t.get_attribute("class") for t in turns] == ["turn model", "turn env", "turn model"]
    assert browser.find_elements(By.CSS_SELECTOR, "#tokens .tok.env")
    shot(browser, tmp_path, "conversation")


def test_evaluations_show_pass_at_k_over_time_and_each_evaluations_completions(inspector, browser, tmp_path):
    from selenium.webdriver.common.by import By

    url, _ = inspector
    browser.get(url + "runs/0/evals")
    assert wait_for(lambda: drawn(browser, "eval/all/pass@4") > 300)
    assert "eval/all/pass@1" in browser.find_element(By.ID, "evals").text
    browser.find_element(By.LINK_TEXT, "25").click()
    assert wait_for(lambda: "step=25" in browser.current_url)
    assert "sort 3 1 2" in browser.find_element(By.ID, "samples").text
    shot(browser, tmp_path, "evaluations")


def test_pages_follow_a_run_that_is_still_writing(inspector, browser):
    from selenium.webdriver.common.by import By

    url, run = inspector
    browser.get(url)
    assert wait_for(lambda: drawn(browser, "critic/score_mean") > 500)
    last = "return inspector.charts.get('critic/score_mean').data[0].steps.slice(-1)[0]"
    assert browser.execute_script(last) == 40
    with open(run / "metrics.jsonl", "a") as f:
        f.write(json.dumps({"step": 41, "critic/score_mean": 3.0}) + "\n")
    assert wait_for(lambda: browser.execute_script(last) == 41, timeout=15)
    browser.get(url + "runs/0/rollouts")
    write_run(run, steps=50, rows=8, seed=1)  # ten more steps' files (and the earlier ones rewritten)
    assert wait_for(lambda: browser.find_element(By.ID, "newer"), timeout=15)
    browser.find_element(By.LINK_TEXT, "show them").click()
    assert wait_for(lambda: browser.find_element(By.CSS_SELECTOR, "tr.row td").text == "50")


def test_a_broken_request_is_a_page_that_says_so(inspector, browser):
    from selenium.webdriver.common.by import By

    url, _ = inspector
    browser.get(url + "runs/2/rollouts")
    assert "is not a run directory" in browser.find_element(By.ID, "problem").text
    browser.get(url + "runs/0/rollouts?sort=colour")
    assert "sort by one of" in browser.find_element(By.ID, "problem").text
    browser.get(url)
    assert browser.find_element(By.CLASS_NAME, "runs")  # still serving
