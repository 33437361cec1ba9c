"""report.html: one self-contained file (inline CSS, PNGs as data URIs, no scripts, no requests)."""

from __future__ import annotations

import base64
from pathlib import Path

import jinja2

from fashionjax import artifacts, figures, rundir
from fashionjax.figures import percent, points, tta_name

# Published reference points (Fashion-MNIST benchmark, zalandoresearch/fashion-mnist README and
# its benchmark page), and the codelab's own short run.
REFERENCES = (
    ("Human performance (published)", "83.5%"),
    ("scikit-learn MLPClassifier (published benchmark)", "87.0%"),
    ("scikit-learn SVC (published benchmark)", "89.7%"),
    ("The codelab's 400-step MLP (scored on its 9,728 trimmed test images)", "about 87-88%"),
)
SECTIONS = ("environment", "dataset", "model", "training", "evaluation", "benchmark")
FIGURES = ("samples", "curve", "confusion", "predictions", "mistakes", "members", "sweep")


def _data_uri(path: Path) -> str | None:
    if not path.is_file():
        return None
    return "data:image/png;base64," + base64.b64encode(path.read_bytes()).decode("ascii")


def _optional_json(path: Path):
    return artifacts.read_json(path) if path.is_file() else None


class ReportError(RuntimeError):
    """An input of the report is not acceptable; the message names the file."""


def _chart_path(bench_path: Path, name) -> Path:
    """A chart named by bench.json: a PNG inside bench.json's own folder, nothing else on the machine."""
    folder = bench_path.parent.resolve()
    if not isinstance(name, str) or not name.endswith(".png"):
        raise ReportError(f"{bench_path}: chart {name!r} is not a .png file name")
    chart = (folder / name).resolve()
    if chart.parent != folder:
        raise ReportError(f"{bench_path}: chart {name!r} is outside the folder of bench.json; refusing to include it")
    return chart


def load_bench(run_dir: Path, bench: str | Path | None) -> tuple[dict | None, dict]:
    """bench.json (given, or in the run directory) and its charts as data URIs."""
    path = Path(bench) if bench else run_dir / "bench.json"
    document = _optional_json(path)
    charts = {}
    if document is None:
        return None, charts
    names = document.get("charts", []) if isinstance(document, dict) else None
    if not isinstance(document, dict) or not isinstance(names, list):
        raise ReportError(f"{path}: not a bench.json written by `fashionjax bench`")
    for name in names:
        uri = _data_uri(_chart_path(path, name))
        if uri:
            charts[name] = uri
    return document, charts


# What an unset setting means, instead of a bare "None".
UNSET_MEANS = {"epochs": "(set by steps)", "steps": "(set by epochs)", "clip_norm": "off",
               "checkpoint_every": "once an epoch"}


def settings(config: dict) -> list[tuple[str, str]]:
    """The run's settings as (name, shown value) rows."""
    return [(name, UNSET_MEANS.get(name, "unset") if value is None else str(value)) for name, value in config.items()]


def context(run_dir: str | Path, bench: str | Path | None = None) -> dict:
    """Everything the template shows, read from the run directory."""
    run_dir = Path(run_dir)
    config, _ = rundir.read_config(run_dir)
    summary = _optional_json(run_dir / "summary.json")
    evaluation = _optional_json(run_dir / "eval.json")
    bench_document, bench_charts = load_bench(run_dir, bench)
    class_names = config["dataset"]["class_names"]
    per_class = []
    if evaluation:
        for i, name in enumerate(class_names):
            row = evaluation["confusion"][i]
            per_class.append({"name": name, "precision": evaluation["precision"][i],
                              "recall": evaluation["recall"][i], "support": sum(row)})
    return {
        "run_dir": run_dir.name,
        "config": config,
        "settings": settings(config["config"]),
        "summary": summary,
        "evaluation": evaluation,
        "per_class": per_class,
        "class_names": class_names,
        "metrics": artifacts.read_jsonl(run_dir / "metrics.jsonl"),
        "figures": {name: _data_uri(run_dir / f"{name}.png") for name in FIGURES},
        "references": REFERENCES,
        "bench": bench_document,
        "bench_charts": bench_charts,
        "sections": SECTIONS,
    }


def _environment():
    return jinja2.Environment(
        loader=jinja2.PackageLoader("fashionjax.report", "templates"),
        autoescape=True, undefined=jinja2.StrictUndefined, trim_blocks=True, lstrip_blocks=True,
    )


def _pct(value) -> str:
    return "n/a" if value is None else percent(value)


def _num(value, digits: int = 0) -> str:
    return "n/a" if value is None else figures.number(value, digits)


def _template(name: str):
    environment = _environment()
    environment.filters["pct"] = _pct
    environment.filters["num"] = _num
    environment.filters["points"] = points
    return environment.get_template(name)


def render(run_dir: str | Path, bench: str | Path | None = None, target: Path | None = None) -> Path:
    """Write the report (default RUN_DIR/report.html) atomically and return its path.

    Reads the run's files only: it may run beside a training that is still writing them.
    """
    html = _template("report.html.j2").render(**context(run_dir, bench))
    target = Path(target) if target else Path(run_dir) / "report.html"
    artifacts.atomic_write_text(target, html)
    return target


def render_speedrun(out_dir: str | Path) -> Path:
    """Write OUT_DIR/speedrun.html from speedrun.json and its chart; returns its path."""
    out_dir = Path(out_dir)
    document = artifacts.read_json(out_dir / "speedrun.json")
    html = _template("speedrun.html.j2").render(**{"blend": None, **document},  # records before --blend lack it
                                                 settings=settings(document["config"]),
                                                 tta_name=tta_name(document),
                                                 chart=_data_uri(out_dir / "speedrun.png"))
    target = out_dir / "speedrun.html"
    artifacts.atomic_write_text(target, html)
    return target
