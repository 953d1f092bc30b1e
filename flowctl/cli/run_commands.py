"""`flowctl evaluate`, `predict` and `export`: a trained run assessed and used (the result on stdout:
a person's lines, or JSON with --json, the lines then on stderr; consoles.py)."""
from __future__ import annotations

import json
from pathlib import Path

import click

from flowctl.cli import consoles
from flowctl.training.rundir import write_atomic

RUN_DIR = click.Path(file_okay=False, path_type=Path)
CHECKPOINT = click.option("--checkpoint", help="A checkpoint step, or 'best' (default: the newest valid one).")


@click.command()
@click.argument("run_dir", type=RUN_DIR)
@click.option("--data", help="Evaluate on all of this file (arrays, a table like the run's, a text corpus, or a folder of images) instead of the run's "
                             "held-out data.")
@CHECKPOINT
@click.option("--json", "as_json", is_flag=True, help="Print the metrics as JSON on stdout.")
def evaluate(run_dir: Path, data: str | None, checkpoint: str | None, as_json: bool) -> None:
    """The spec's metrics (training.metrics) of RUN_DIR's model on held-out data."""
    from flowctl.training.inference import evaluate_run

    r = evaluate_run(run_dir, data, checkpoint)
    shown = ", ".join(f"{k} {v:.4f}" for k, v in r.items() if k.startswith("val/"))
    consoles.result(as_json).print(f"{r['checkpoint']} (step {r['step']}) on {r['examples']:,} examples of "
                                   f"{r['data']}: {shown}")
    if as_json:
        click.echo(json.dumps(r))


@click.command()
@click.argument("run_dir", type=RUN_DIR)
@click.argument("input_path", metavar="INPUT")
@CHECKPOINT
@click.option("--top", default=5, show_default=True, help="Classes (or next words) to list per prediction.")
@click.option("--out", type=click.Path(dir_okay=False, path_type=Path), help="Also write the JSON here.")
@click.option("--json", "as_json", is_flag=True, help="Print the predictions as JSON on stdout.")
def predict(run_dir: Path, input_path: str, checkpoint: str | None, top: int, out: Path | None,
            as_json: bool) -> None:
    """Run RUN_DIR's model on INPUT: an .npz of the model's inputs or, for a run on a table, a
    CSV/Parquet file with its columns (top classes per example, and the accuracy when the labels
    are there too), or a text file: for a language model the likely next
    words, for a model trained on sentence pairs each line's translation (greedy)."""
    from flowctl.training.inference import predict_run

    r = predict_run(run_dir, input_path, checkpoint, top)
    con = consoles.result(as_json)
    if "next" in r:
        words = ", ".join(f"{w['word']!r} {w['probability']:.3f}" if "token" in w else
                          f"{w['word']} {w['probability']:.3f}" for w in r["next"])
        context = r["context"][-40:] if isinstance(r["context"], str) else " ".join(r["context"][-8:])  # BPE: text
        con.print(f"after '{context}': {words}", markup=False, highlight=False)
    elif "translations" in r:
        for t in r["translations"]:
            con.print(f"{t['source']}  ->  {t['translation']}", markup=False, highlight=False)
    else:
        acc = f"; accuracy {r['accuracy']:.4f}" if "accuracy" in r else ""
        con.print(f"{r['examples']:,} examples predicted{acc}; first: classes {r.get('names', r['classes'])[0]}")
    if out is not None:
        write_atomic(out, json.dumps(r) + "\n")
    if as_json:
        click.echo(json.dumps(r))


@click.command()
@click.argument("run_dir", type=RUN_DIR)
@click.option("--out", required=True, type=click.Path(file_okay=False, path_type=Path),
              help="Directory to write model.json, weights.safetensors and signature.json to.")
@CHECKPOINT
@click.option("--format", "fmt", type=click.Choice(["flowctl", "onnx"]), default="flowctl", show_default=True,
              help="flowctl: model.json + weights.safetensors; onnx: model.onnx (inputs to logits).")
@click.option("--json", "as_json", is_flag=True, help="Print what was written as JSON on stdout.")
def export(run_dir: Path, out: Path, checkpoint: str | None, fmt: str, as_json: bool) -> None:
    """Write RUN_DIR's inference graph and weights; `flowctl.load_model(OUT)` runs them without the spec."""
    from flowctl.training.inference import export_run

    r = export_run(run_dir, out, checkpoint, fmt)
    consoles.result(as_json).print(f"exported step {r['step']} ({r['nodes']:,} nodes, {r['weights']} weights, "
                                   f"{r['bytes'] / 2**20:,.1f} MiB) to {r['out']}")
    if as_json:
        click.echo(json.dumps(r))


COMMANDS = [evaluate, predict, export]
