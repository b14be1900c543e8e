"""fedplug's runs in MLflow's UI, seen in a real browser: headless Chromium (Debian's
``chromium`` and ``chromium-driver``, installed here when missing) driven by Selenium.

A temporary project gets three ``fedplug run`` runs (fedavg, fedprox, fedavgm on the
synthetic task, 3 rounds each); ``make ui`` serves its store. In a fresh browser profile
(MLflow starts in its "GenAI" mode), the link ``fedplug run`` prints
(:func:`fedplug.tracking.ui.experiment_url`) opens on the runs table; then, the stored
choice cleared, the browser follows docs/pipeline.md's steps ("The MLflow UI") click by click:

1. open the URL ``make ui`` prints, click "Model training", "Experiments", then the
   experiment ``<study>-fedplug-run``: its runs table lists the three runs;
2. the chart view (second button above the table): an ``accuracy`` chart with each run;
3. back in the table, select all runs and click "Compare": "Comparing 3 Runs", with the
   accuracy of each.

``FEDPLUG_WRITE_SCREENSHOTS=1`` saves the pages to docs/img/mlflow-runs.png,
mlflow-charts.png and mlflow-compare.png (the screenshots docs/pipeline.md shows).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

pytest.importorskip("mlflow", reason="the MLflow UI needs mlflow (pip install -e '.[pipeline]')")
webdriver = pytest.importorskip(
    "selenium.webdriver", reason="the browser test needs selenium (pip install -e '.[test]')"
)
from mlflow_server import REPOSITORY, running_make_ui  # noqa: E402
from selenium.webdriver.common.by import By  # noqa: E402
from selenium.webdriver.remote.webdriver import WebDriver  # noqa: E402
from selenium.webdriver.support import expected_conditions  # noqa: E402
from selenium.webdriver.support.ui import WebDriverWait  # noqa: E402

from fedplug.tracking.ui import experiment_url  # noqa: E402

pytestmark = pytest.mark.slow

ALGORITHMS = ("fedavg", "fedprox", "fedavgm")
QUICK = [
    "--set", "data.dataset=synthetic", "--set", "train.model=logreg", "--set", "train.optimizer.lr=2",
    "--set", "train.local_epochs=3", "--set", "train.rounds=3",
]
"""The README's first run, cut to 3 rounds."""
WAIT_SECONDS = 60
SCREENSHOTS = REPOSITORY / "docs" / "img"
WINDOW = (1400, 900)


# ------------------------------------------------------------------------ the browser


def chromium_paths() -> tuple[str, str] | None:
    """``(browser, driver)`` of Debian's chromium and chromium-driver, None when missing."""
    browser, driver = shutil.which("chromium"), shutil.which("chromedriver")
    return (browser, driver) if browser and driver else None


def install_chromium() -> str | None:
    """``apt-get install chromium chromium-driver`` (as root): None when it worked, else why not."""
    if os.geteuid() != 0 or shutil.which("apt-get") is None:
        return "not root, or no apt-get"
    environment = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    install = ["apt-get", "install", "-y", "-qq", "chromium", "chromium-driver"]
    done = subprocess.run(install, env=environment, capture_output=True, text=True, timeout=900)
    if done.returncode != 0:  # stale or missing package lists
        subprocess.run(["apt-get", "update", "-qq"], env=environment, capture_output=True, timeout=900)
        done = subprocess.run(install, env=environment, capture_output=True, text=True, timeout=900)
    if done.returncode == 0:
        return None
    lines = (done.stderr or done.stdout or "apt-get failed").strip().splitlines()
    return lines[-1] if lines else "apt-get failed"


@pytest.fixture(scope="session")
def chromium() -> tuple[str, str]:
    """Debian's chromium and its driver, installed when missing (skip: not installable)."""
    found = chromium_paths()
    if found is None:
        reason = install_chromium()
        found = chromium_paths()
        if found is None:
            pytest.skip(
                f"the browser test needs chromium and chromedriver, which could not be installed ({reason}); "
                "install them: sudo apt-get install chromium chromium-driver"
            )
    return found


@pytest.fixture()
def browser(chromium: tuple[str, str]) -> Iterator[WebDriver]:
    """A fresh headless Chromium profile (MLflow's UI starts in its default mode)."""
    from selenium.webdriver.chrome.options import Options
    from selenium.webdriver.chrome.service import Service

    options = Options()
    options.binary_location = chromium[0]
    for argument in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                     f"--window-size={WINDOW[0]},{WINDOW[1]}", "--force-device-scale-factor=1"):
        options.add_argument(argument)
    driver = webdriver.Chrome(options=options, service=Service(chromium[1]))
    try:
        yield driver
    finally:
        driver.quit()


# ------------------------------------------------------------------------ the project


@pytest.fixture()
def project(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A project (the repository's params.yaml, tracking on) whose store holds three
    finished ``fedplug run`` runs."""
    from fedplug.cli import main

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.delenv("DVC_ROOT", raising=False)
    monkeypatch.chdir(tmp_path)
    params = yaml.safe_load((REPOSITORY / "params.yaml").read_text())
    params["tracking"] = {"enabled": True}
    folder = tmp_path / "project"
    folder.mkdir()
    (folder / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    for algorithm in ALGORITHMS:
        argv = ["run", str(folder / "params.yaml"), *QUICK, "--algorithm", algorithm, "--quiet"]
        assert main(argv) == 0, algorithm
    return folder


def logged_runs(project: Path) -> tuple[Any, list[Any]]:
    """The experiment of the project's ``fedplug run`` runs, and its runs."""
    from mlflow.tracking import MlflowClient

    from fedplug.config import load_experiment
    from fedplug.tracking import local_tracking_uri
    from fedplug.tracking.naming import command_line_experiment

    client = MlflowClient(local_tracking_uri(project))
    name = command_line_experiment(load_experiment(project / "params.yaml", check_every_algorithm=False))
    experiment = client.get_experiment_by_name(name)
    return experiment, client.search_runs([experiment.experiment_id])


# ---------------------------------------------------------------------------- helpers


def click(driver: WebDriver, xpath: str) -> Any:
    """Click the element at ``xpath`` once it can be clicked. React may re-render it
    between finding and clicking (a stale element): then find it again and retry."""
    from selenium.common.exceptions import StaleElementReferenceException

    clickable = expected_conditions.element_to_be_clickable((By.XPATH, xpath))

    def found_and_clicked(browser: WebDriver) -> Any:
        element = clickable(browser)
        if element:
            element.click()
        return element

    waiting = WebDriverWait(driver, WAIT_SECONDS, ignored_exceptions=[StaleElementReferenceException])
    return waiting.until(found_and_clicked)


def wait_for(driver: WebDriver, xpath: str) -> Any:
    """The element at ``xpath`` once it is visible."""
    visible = expected_conditions.visibility_of_element_located((By.XPATH, xpath))
    return WebDriverWait(driver, WAIT_SECONDS).until(visible)


def text_is(text: str) -> str:
    return f"normalize-space(.)='{text}'"


def close_assistant(driver: WebDriver) -> None:
    """Close MLflow's assistant panel (open by default, it covers a third of the page)."""
    close = "//button[@aria-label='Close' and contains(@data-component-id, 'assistant')]"
    for button in driver.find_elements(By.XPATH, close):
        if button.is_displayed():
            button.click()


def screenshot(driver: WebDriver, name: str, tmp_path: Path) -> None:
    """Save the page: into docs/img/ with FEDPLUG_WRITE_SCREENSHOTS=1, else into tmp_path."""
    folder = SCREENSHOTS if os.environ.get("FEDPLUG_WRITE_SCREENSHOTS") == "1" else tmp_path
    folder.mkdir(parents=True, exist_ok=True)
    driver.execute_script("window.scrollTo(0, 0)")
    assert driver.save_screenshot(str(folder / name)), name


# ------------------------------------------------------------------------------- test


def test_the_runs_and_an_accuracy_chart_in_mlflows_ui(project: Path, browser: WebDriver, tmp_path: Path) -> None:
    # Prepare: three runs, one per algorithm, in the experiment of `fedplug run`, which is
    # tagged as model training.
    experiment, runs = logged_runs(project)
    assert experiment.tags.get("mlflow.experimentKind") == "custom_model_development"
    names = sorted(run.info.run_name for run in runs)
    assert len(names) == len(ALGORITHMS) and all(
        any(name.startswith(f"{algorithm}-seed0-") and name.endswith("-synthetic") for name in names) for algorithm in ALGORITHMS
    ), names
    log = tmp_path / "make-ui.log"
    with running_make_ui(project, log) as base:
        # 0. A link fedplug prints opens on the runs, not on the GenAI overview.
        browser.get(experiment_url(base, experiment.experiment_id))
        for name in names:
            wait_for(browser, f"//a[{text_is(name)}]")
        assert f"/experiments/{experiment.experiment_id}/runs" in browser.current_url
        browser.execute_script("window.localStorage.clear()")  # as a new browser

        # 1. The URL `make ui` prints; "Model training"; "Experiments"; the experiment.
        printed = re.search(r"open (http://127\.0\.0\.1:\d+)", log.read_text())
        assert printed is not None and printed.group(1) == base, log.read_text()
        browser.get(printed.group(1))
        registry = f"//a[{text_is('Model registry')}]"  # in the side bar of "Model training" only
        wait_for(browser, f"//a[{text_is('Experiments')}]")
        assert not browser.find_elements(By.XPATH, registry), "MLflow did not start in its GenAI mode"
        click(browser, f"//div[@role='button'][{text_is('Model training')}]")
        wait_for(browser, registry)
        click(browser, f"//a[{text_is('Experiments')}]")
        click(browser, f"//a[{text_is(experiment.name)}]")
        for name in names:
            wait_for(browser, f"//a[{text_is(name)}]")
        assert f"/experiments/{experiment.experiment_id}/runs" in browser.current_url
        close_assistant(browser)
        screenshot(browser, "mlflow-runs.png", tmp_path)

        # 2. The chart view: an accuracy chart with each run's curve in its legend.
        click(browser, "//input[@name='runs-view-mode' and @value='CHART']/ancestor::label")
        chart = wait_for(
            browser,
            "//*[@data-testid='draggable-chart-cards-grid']/*[.//*[normalize-space(text())='accuracy']]",
        )
        WebDriverWait(browser, WAIT_SECONDS).until(lambda _: all(f"{name} (accuracy)" in chart.text for name in names))
        assert chart.find_elements(By.CSS_SELECTOR, "svg.main-svg"), "the accuracy chart has no plot"
        screenshot(browser, "mlflow-charts.png", tmp_path)

        # 3. The table again; select every run; "Compare".
        click(browser, "//input[@name='runs-view-mode' and @value='TABLE']/ancestor::label")
        click(browser, "//input[@aria-label='Select all runs']/..")
        click(browser, "//button[@data-testid='runs-compare-button']")
        wait_for(browser, f"//*[{text_is(f'Comparing {len(names)} Runs from 1 Experiment')}]")
        assert "compare-runs" in browser.current_url
        page = wait_for(browser, "//body").text
        assert all(name in page for name in names), page[:2000]
        wait_for(browser, "//*[contains(@class, 'plot-container')]//*[normalize-space(text())='accuracy']")
        screenshot(browser, "mlflow-compare.png", tmp_path)
