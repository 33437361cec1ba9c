"""The HTML report: self-contained, escaped, built from files only, and checked in a real browser."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import synthetic_run

from fashionjax import artifacts, cli
from fashionjax.report import render

CHROMIUM_CANDIDATES = ("/usr/lib/chromium/chromium", "/usr/bin/chromium", "/usr/bin/chromium-browser")


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """A real (small, synthetic-data) training run with every artifact and its report."""
    return synthetic_run(tmp_path_factory, "report", "--steps", "20", "--log-every", "5", num_test=400)


def test_train_writes_a_self_contained_report(run_dir):
    html = (run_dir / "report.html").read_text()
    for section in ("environment", "dataset", "model", "training", "evaluation"):
        assert f'<section id="{section}">' in html
    assert html.count("data:image/png;base64,") == 5
    assert "http://" not in html and "https://" not in html and "<script" not in html
    assert "Human performance (published)" in html and "89.7%" in html


def test_values_are_escaped(run_dir, tmp_path):
    copy = tmp_path / "run"
    shutil.copytree(run_dir, copy)
    config = artifacts.read_json(copy / "config.json")
    config["dataset"]["class_names"][0] = "<script>alert(1)</script>"
    artifacts.atomic_write_json(copy / "config.json", config)
    html = render.render(copy).read_text()
    assert "<script>" not in html and "&lt;script&gt;alert(1)&lt;/script&gt;" in html


def test_report_code_imports_no_jax(run_dir):
    code = ("import sys\nfrom fashionjax.report import render\n"
            f"render.render({str(run_dir)!r})\n"
            "bad = [m for m in sys.modules if m == 'jax' or m.startswith(('jax.', 'fashionjax.train', 'optax'))]\n"
            "assert not bad, bad\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr


def test_report_command_includes_a_bench_file(run_dir, tmp_path, capsys):
    copy = tmp_path / "run"
    shutil.copytree(run_dir, copy)
    bench = {"model": "mlp", "environment": {"device_kind": "cpu", "backend": "cpu", "matmul_precision": "default"},
             "peak": {"source": "measured"}, "tokens_assumption": "one image = 49 tokens", "notes": ["a note"],
             "charts": [], "cases": [{"mode": "fused", "dtype": "float32", "batch_size": 512, "compile_seconds": 1.0,
                                      "examples_per_sec": {"median": 1000.0, "min": 900.0, "max": 1100.0},
                                      "final_loss": 0.5, "final_accuracy": 0.8, "mfu": 0.5, "tokens_per_sec": 49000.0}]}
    (tmp_path / "bench.json").write_text(json.dumps(bench))
    assert cli.main(["report", str(copy), "--bench", str(tmp_path / "bench.json")]) == 0
    html = (copy / "report.html").read_text()
    assert '<section id="benchmark">' in html and "49,000" in html
    assert cli.main(["report", str(tmp_path / "nowhere")]) == 2
    assert "not a run directory" in capsys.readouterr().err


def chromium_path() -> str | None:
    return next((p for p in CHROMIUM_CANDIDATES if Path(p).is_file()), None)


@pytest.mark.browser
def test_report_in_a_real_browser(run_dir, tmp_path):
    sync_api = pytest.importorskip("playwright.sync_api")
    executable = chromium_path()
    if executable is None:
        pytest.skip("no chromium here: apt-get install chromium (CI does)")
    console_errors, failed_requests, requests = [], [], []
    with sync_api.sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=executable, args=["--no-sandbox"], timeout=60_000)
        try:
            page = browser.new_page(java_script_enabled=True)
            page.on("console", lambda m: console_errors.append(m.text) if m.type == "error" else None)
            page.on("pageerror", lambda e: console_errors.append(str(e)))
            page.on("requestfailed", lambda r: failed_requests.append(r.url))
            page.on("request", lambda r: requests.append(r.url))
            page.goto((run_dir / "report.html").as_uri(), wait_until="load", timeout=60_000)
            images = page.eval_on_selector_all("img", "els => els.map(e => [e.complete, e.naturalWidth])")
            sections = page.eval_on_selector_all("section", "els => els.map(e => e.id)")
            accuracy_text = page.inner_text("p.headline")
            page.screenshot(path=str(tmp_path / "report.png"), full_page=True)
        finally:
            browser.close()
    assert console_errors == [] and failed_requests == []
    assert all(url.startswith(("file://", "data:")) for url in requests)
    assert len(images) == 5 and all(complete and width > 0 for complete, width in images)
    assert sections == ["environment", "dataset", "model", "training", "evaluation"]
    assert "test accuracy" in accuracy_text
    assert (tmp_path / "report.png").stat().st_size > 50_000


@pytest.mark.browser
def test_speedrun_page_in_a_real_browser(tmp_path, synthetic_cli, small_speedrun, capsys):
    sync_api = pytest.importorskip("playwright.sync_api")
    executable = chromium_path()
    if executable is None:
        pytest.skip("no chromium here: apt-get install chromium (CI does)")
    out_dir = tmp_path / "record"
    assert cli.main(["speedrun", "--seeds", "2", "--steps", "4", "--batch-size", "64", "--quiet",
                     "--out", str(out_dir)]) == 0
    failures = []
    with sync_api.sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=executable, args=["--no-sandbox"], timeout=60_000)
        try:
            page = browser.new_page()
            page.on("pageerror", lambda e: failures.append(str(e)))
            page.on("requestfailed", lambda r: failures.append(r.url))
            page.goto((out_dir / "speedrun.html").as_uri(), wait_until="load", timeout=60_000)
            images = page.eval_on_selector_all("img", "els => els.map(e => [e.complete, e.naturalWidth])")
            seed_rows = page.eval_on_selector_all("table:first-of-type tr", "els => els.length") - 1
            headline = page.inner_text("p.headline")
        finally:
            browser.close()
    assert failures == []
    assert len(images) == 1 and images[0][0] and images[0][1] > 0
    assert seed_rows == 2 and "mean test accuracy" in headline and "over 2 seeds (0, 1)" in headline


def test_percentages_are_cut_never_rounded_up():
    from fashionjax.figures import percent

    assert percent(0.94256) == "94.25%"  # a mean over seeds: cut, not 94.26
    assert percent(0.9437) == "94.37%"  # an exact count (9,437 of 10,000) keeps its last digit
    assert percent(0.3100) == "31.00%" and percent(0.31049, 1) == "31.0%" and percent(1.0) == "100.00%"
    assert percent(0.0) == "0.00%" and percent(0.99999) == "99.99%"


def test_spreads_are_cut_in_points_like_the_means():
    import statistics

    from fashionjax.figures import points

    assert points(0.000573) == "0.05"  # was printed 0.06: a spread rounded up
    assert points(statistics.stdev([0.9401, 0.9394, 0.9404, 0.9414, 0.9403])) == "0.07"  # 0.0719 points
    assert points(0.0014) == "0.14" and points(0.0) == "0.00"


def test_speeds_are_cut_to_whole_numbers_never_rounded_up():
    from fashionjax.figures import rate

    assert rate(959.99) == "959" and rate(1008.064) == "1,008" and rate(170402.0) == "170,402" and rate(0.4) == "0"


def test_seconds_and_flops_are_cut_never_rounded_up():
    from fashionjax.figures import number

    assert number(137.2628, 1) == "137.2" and number(6.36902784, 2) == "6.36"  # were printed 137.3 and 6.37
    assert number(1106.35, 1) == "1,106.3" and number(0.04, 1) == "0.0" and number(2.5, 0) == "2"
    assert number(-0.27, 1) == "-0.2"  # toward zero, as a cut digit is


@pytest.mark.parametrize("percents", [[95.0, 95.02, 95.02, 95.0], [94.12], [12.0, 31.0, 85.0]])
def test_the_accuracy_axis_ticks_no_finer_than_a_test_image_resolves(percents):
    import matplotlib.pyplot as plt

    from fashionjax.report import plots

    fig, ax = plt.subplots()
    plots.percent_axis(ax, percents)
    fig.canvas.draw()
    low, high = ax.get_xlim()
    labels = [tick.get_text() for tick in ax.get_xticklabels() if low <= tick.get_position()[0] <= high]
    plt.close(fig)
    assert low < min(percents) and max(percents) < high and high - low > 0.0999  # no value on the frame's edge
    assert len(labels) >= 3 and all(len(label.partition(".")[2]) <= 2 for label in labels), labels  # was 95.0025
