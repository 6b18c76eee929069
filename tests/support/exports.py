"""What the export tests of each trainer share: `corecap export` through the CLI, a refusal that
must write nothing, the manifest of rows, the loss mask a sample without one is exported with,
and an export stopped (Ctrl-C) after some sample files."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch
from click.testing import CliRunner


def export(store, out, fmt, *args):
    from corecap.cli import main

    return CliRunner().invoke(main, ["export", "--store", str(store), "--format", fmt, "--out", str(out), *args])


def exported(store, out, fmt, *args):
    result = export(store, out, fmt, *args)
    assert result.exit_code == 0, result.output
    return result


def refused(tmp_path, store, fmt, *args) -> str:
    """The one-line refusal of an export, which left neither OUT nor OUT.partial behind."""
    out = tmp_path / "refused"
    result = export(store, out, fmt, *args)
    assert result.exit_code == 2, result.output
    assert not os.path.exists(out) and not os.path.exists(f"{out}.partial")
    line = result.output.strip()
    assert line.startswith("corecap: error: ") and "\n" not in line
    return line


def manifest(out) -> list[dict]:
    with open(os.path.join(out, "corecap_manifest.jsonl")) as f:
        return [json.loads(line) for line in f]


def exported_mask(mask, num_tokens) -> torch.Tensor:
    """The stored loss mask as int64, or all ones for a sample stored without one."""
    return torch.ones(num_tokens, dtype=torch.int64) if mask is None else torch.from_numpy(mask.astype(np.int64))


def relative(got: torch.Tensor, ref: torch.Tensor) -> float:
    return float((got.double() - ref.double()).norm() / ref.double().norm())


def interrupt(store, out, fmt, monkeypatch, after: int, **options) -> None:
    """An export stopped (Ctrl-C) after `after` sample files (DeepSpec: rows) were written."""
    import corecap.export.formats as layouts
    from corecap.export.driver import export_store

    layout = layouts.LAYOUTS[fmt]
    name = "write_row" if getattr(layout, "shares_files", False) else "write"  # DeepSpec writes rows into shards
    original = getattr(layout, name)
    calls = []

    def write(self, *args):
        calls.append(1)
        if len(calls) > after:
            raise KeyboardInterrupt
        return original(self, *args)

    monkeypatch.setattr(layout, name, write)
    with pytest.raises(KeyboardInterrupt):
        export_store(str(store), str(out), fmt, workers=1, **options)
    monkeypatch.setattr(layout, name, original)
