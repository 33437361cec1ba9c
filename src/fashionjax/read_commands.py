"""The commands that read a run without training it: eval, predict, export and report. Like cli,
it imports nothing heavy at the top; each command imports what it needs when it runs, after the
checks that need none of it (a path that is not a run is refused at once)."""

from __future__ import annotations

from pathlib import Path

from fashionjax.config import ConfigError
from fashionjax.exits import EXIT_FAILURE, EXIT_OK
from fashionjax.figures import percent, tta_name


def load_data(args, out):
    """The dataset that --data-dir and --offline name (every command that reads it)."""
    from fashionjax import data

    return data.load(args.data_dir, offline=args.offline, log=out.note)


def cmd_predict(args, out) -> int:
    from fashionjax import rundir

    run_dir = rundir.require_run(args.run_dir)
    from fashionjax import artifacts, console, evaluate, predict
    from fashionjax import run as run_lib
    from fashionjax.data import CLASS_NAMES
    from fashionjax.report import plots

    if not 1 <= args.top_k <= len(CLASS_NAMES):
        raise ConfigError(f"--top-k must be between 1 and {len(CLASS_NAMES)}, got {args.top_k}")
    paths = predict.image_paths(args.paths)
    if args.save_preprocessed:
        artifacts.ensure_file_target(args.save_preprocessed)
    trained = run_lib.load_trained(run_dir, out.note, args.member)
    config = trained.config
    classify = evaluate.run_classifier(config, trained.params)
    predictions, failures = predict.predict(classify, paths)
    rows = [item.to_dict(CLASS_NAMES, args.top_k) for item in predictions]
    for failure in failures:
        out.error(f"fashionjax predict: {failure['message']}")
    for row in rows:
        if row["blank"]:
            out.note(f"{row['path']}: blank (nothing stands out from its background); its class says nothing "
                     "about it")
    if rows:  # when every image failed, their error lines say all there is
        out.show(console.table(f"predictions of {run_dir}{_model_name(trained.member)} (checkpoint step {trained.step})",
                               ["image", "class", "probability", "next"],
                               [(row["path"], row["class"], f"{100 * row['probability']:.1f}%",
                                 ", ".join(f"{t['class']} {100 * t['probability']:.1f}%" for t in row["top_k"][1:]))
                                for row in rows]))
    document = {"run_dir": str(run_dir), "model": config.model, "member": trained.member,
                "checkpoint_step": trained.step, "predictions": rows, "failures": failures}
    if args.save_preprocessed and predictions:
        titles = [f"{Path(row['path']).name[:18]}\n{row['class']} {100 * row['probability']:.0f}%" for row in rows]
        document["preprocessed"] = str(plots.titled_grid(
            [item.image_u8 for item in predictions], titles, [plots.NEUTRAL] * len(rows), args.save_preprocessed,
            f"What {config.model} saw"))
        out.show(f"preprocessed images: {document['preprocessed']}")
    out.document(document)
    return EXIT_FAILURE if failures else EXIT_OK


def cmd_export(args, out) -> int:
    from fashionjax import rundir

    run_dir = rundir.require_run(args.run_dir)
    from fashionjax import export
    from fashionjax import run as run_lib

    wanted = export.formats(args.format)
    export.require(wanted)  # before the data and the model load
    dataset = load_data(args, out)
    trained = run_lib.load_trained(run_dir, out.note, args.member)
    with rundir.writing_into(args.out, "export") as out_dir:
        document = export.export(trained, wanted, out_dir, dataset.test.images_u8, dataset.class_names, out.note)
    for fmt, item in document["artifacts"].items():
        check = (f"params equal: {item['params_equal']}" if fmt == "safetensors" else
                 f"{item['examples']:,} test images, max |logit difference| {item['max_abs_logit_difference']:.2e}, "
                 f"{item['differing_labels']} labels differ")
        out.show(f"{fmt}: {item['path']} ({item['bytes']:,} bytes; {check})")
    out.document(document)
    return EXIT_OK


def cmd_report(args, out) -> int:
    from fashionjax import artifacts, rundir
    from fashionjax.report import render

    run_dir = rundir.require_run(args.run_dir)
    if args.bench and not Path(args.bench).is_file():
        raise ConfigError(f"{args.bench}: no such bench.json")
    if args.out:
        path = render.render(run_dir, args.bench, target=artifacts.ensure_file_target(args.out))
    else:
        live = rundir.is_live(run_dir)
        if live and live[1] == "training":
            raise rundir.RunDirBusy(f"{run_dir}: still training (pid {live[0]}); the report is written only into a "
                                    "finished run: pass --out FILE to write it elsewhere now")
        # held while it is written: no training starts meanwhile, and a second report is refused
        owned = rundir.RunDir.claim(run_dir, "--out", "report")
        try:
            path = render.render(run_dir, args.bench, target=owned.file("report.html"))
        finally:
            owned.release()
    out.show(f"report: {path}")
    out.document({"report": str(path)})
    return EXIT_OK


def cmd_eval(args, out) -> int:
    from fashionjax import rundir

    run_dir = rundir.require_run(args.run_dir)
    from fashionjax import console, distributed, environment
    from fashionjax import run as run_lib

    environment.enable_compile_cache()
    dataset = load_data(args, out)
    scored = run_lib.rescore(run_dir, dataset, distributed.make_mesh("all"), out.note, args.member)
    report = scored["report"]
    members = [(f"  seed {m['seed']}", percent(m["test_accuracy"]) if m["finite"] else "diverged")
               for m in report.get("members", [])]
    accuracy = "ensemble test accuracy" if members else "test accuracy"
    out.show(console.table(f"evaluation of {run_dir}{_model_name(report['member'])}", ["", ""], [
        (accuracy, f"{percent(report['accuracy'])} ({report['correct']:,} of {report['examples']:,})"), *members,
        *([(f"without {tta_name(report)}", percent(report["accuracy_no_tta"]))] if report["tta"] else []),
        ("test loss", f"{report['loss']:.4f}"), ("checkpoint step", report["step"]),
        ("params digest", report["params_digest"][:16])]))
    out.document(report)
    return EXIT_OK


def _model_name(member: int | None) -> str:
    """", model K" after a run's name when a command used only model K of it (--member)."""
    return "" if member is None else f", model {member}"
