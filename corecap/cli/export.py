"""`corecap export`: the command and its options (the layouts themselves are corecap/export/;
the text export corecap/export/jsonl.py)."""

from __future__ import annotations

import os

import click

from corecap.cli.options import _Min1, _one_line_errors
from corecap.errors import CorecapError


def _log(message: str) -> None:
    click.echo(message, err=True)


@click.command()
@click.option("--store", type=str, default="corecap.lmdb", show_default=True, help="Store directory.")
@click.option("--format", "fmt", required=True,
              type=click.Choice(
                  ["speculators", "specforge", "specforge-dflash", "specforge-dspark", "modelopt", "deepspec",
                   "jsonl"]),
              help="speculators 0.9.0 (needs the 'prenorm' layer), SpecForge 0.2.0 (needs layer N and three aux "
              "layers), "
              "SpecForge's DFlash/Domino (target layers) and DSpark (target layers and layer N) files, "
              "ModelOpt 0.47.0 (needs layer N, or prenorm, and aux layers), "
              "DeepSpec's target cache (target layers and layer N, bfloat16), "
              "or jsonl: the samples as text, one JSON object per line (text decoded with the model's tokenizer, "
              "token ids, loss masks; a generated sample's prompt and response apart, finish reason, sampling "
              "settings), no hidden states.")
@click.option("--out", type=str, required=True,
              help="Output directory, a file for jsonl (must not exist; written as OUT.partial, then renamed).")
@click.option("--aux-layers", type=str, default=None,
              help="Stored layers to export as aux layers (default: every stored layer but N and prenorm).")
@click.option("--dtype", type=click.Choice(["auto", "bfloat16", "float16", "float32", "fp8"]), default="auto",
              show_default=True,
              help="Hidden states' dtype (auto: bfloat16 for SpecForge's formats, which train on it, and DeepSpec's, "
              "which holds nothing else; "
              "the stored dtype for speculators and ModelOpt). fp8: speculators only, its fp8 files "
              "(float8_e4m3fn, one scale per token; train with --hidden-states-backend fp8).")
@click.option("--keys", "keys_file", type=str, default=None,
              help="Export only these keys (a file, one per line), in its order.")
@click.option("--workers", type=_Min1, default=None,
              help="Threads that decode and write samples (default: the cores, at most 8).")
@click.option("--tokenizer", type=str, default=None,
              help="jsonl: the tokenizer's directory to decode with "
              "(default: the store's model directory, from `corecap info`).")
@click.option("--data", type=str, default=None,
              help="speculators: the data file the store was captured from, whose conversations with images "
              "fill the `messages` column of those samples (speculators' own layout for them).")
@click.option("--image-dir", type=str, default=None,
              help="With --data: where its images are (default: the data file's directory, as for corecap run).")
@click.option("--progress/--no-progress", default=None, help="A progress line (default: when stderr is a terminal).")
@_one_line_errors
def export(store, fmt, out, aux_layers, dtype, keys_file, workers, tokenizer, data, image_dir, progress) -> None:
    """Write a store's samples in a trainer's offline layout, or as text (jsonl) (docs/export.md);
    an interrupted export resumes (jsonl: starts over)."""
    from corecap.export.driver import export_store, read_keys

    if fmt == "jsonl":
        states_only = [name for name, given in (("--aux-layers", aux_layers is not None), ("--dtype", dtype != "auto"),
                                                ("--workers", workers is not None)) if given]
        if states_only:
            raise CorecapError(f"{states_only[0]} applies to the hidden states, "
                               "and --format jsonl writes none (it is the text)")
    elif tokenizer is not None:
        raise CorecapError(f"--tokenizer applies to --format jsonl only (--format {fmt} writes token ids, no text)")
    if image_dir is not None and data is None:
        raise CorecapError("--image-dir applies with --data (where the data file's images are)")
    if data is not None and fmt != "speculators":
        raise CorecapError(f"--data applies to --format speculators only (its rows of samples with images carry the "
                           f"conversation); --format {fmt} writes token ids and loss masks")
    keys = read_keys(keys_file) if keys_file else None
    conversations = None
    if data is not None:
        from corecap.data.conversations import Conversations

        conversations = Conversations(data, image_dir)
    if fmt == "jsonl":
        from corecap.export.jsonl import export_jsonl

        summary = export_jsonl(store, out, _jsonl_tokenizer(store, tokenizer), keys=keys, progress=progress, log=_log)
    else:
        summary = export_store(store, out, fmt, aux_layers=aux_layers, dtype=dtype, keys=keys, workers=workers,
                               progress=progress, log=_log, conversations=conversations)
    click.echo(summary.line())
    for note in summary.notes(warnings=False):  # the export's first lines said its warnings (export/driver.py)
        click.echo(note)


def _jsonl_tokenizer(store: str, given: str | None):
    """The tokenizer `export --format jsonl` decodes with: --tokenizer's, else the store's model's."""
    from corecap.model import load_tokenizer
    from corecap.store import Store

    with Store.open(store) as s:
        path = given or s.meta.model.path
    where = f"--tokenizer {path}" if given else f"the store's model directory {path}"
    if not os.path.isdir(path):
        raise CorecapError(f"--format jsonl decodes with the model's tokenizer, and {where} is not a directory here: "
                           "pass --tokenizer DIR (the model's directory, or one with its tokenizer files)")
    try:
        found = load_tokenizer(path)
    except CorecapError as e:
        raise CorecapError(f"--format jsonl: {where}: {str(e).split(': ', 1)[-1]}") from None
    if found is None:
        raise CorecapError(f"--format jsonl decodes with the model's tokenizer, and {where} has no tokenizer files: "
                           "pass --tokenizer DIR (the model's directory, or one with its tokenizer files)")
    return found
