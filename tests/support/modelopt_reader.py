"""ModelOpt 0.47.0's own streaming reader (`EagleVllmStreamingDataset`, what its trainer builds
from `data.streaming_server_url`), fetching samples from a live server in a process of its own:
NIXL's UCX transport may crash at interpreter exit, so the process leaves with `os._exit` once
the states are saved. Run as a script:

    python tests/support/modelopt_reader.py URL MODEL ROWS.jsonl OUT.pt MAX_SEQ_LEN
"""

from __future__ import annotations

import json
import os
import subprocess
import sys


def available() -> str | None:
    """None when ModelOpt's streaming dataset and NIXL import; else what to install."""
    try:
        import nixl._api  # noqa: F401
        from modelopt.torch.speculative.plugins.hf_streaming_dataset import EagleVllmStreamingDataset  # noqa: F401
    except ImportError as e:
        return (f"ModelOpt's streaming reader ({e}): pip install --no-deps nvidia-modelopt==0.47.0; "
                "pip install nixl-cu12==1.5.1 && pip install --no-deps nixl==1.5.1")
    return None


def read_in_a_process(url: str, model: str, rows: str, out: str, max_seq_len: int) -> dict:
    """Each row's sample as ModelOpt's `_fetch` returns it, then `_format`s (loaded from `out`)."""
    import torch

    done = subprocess.run([sys.executable, os.path.abspath(__file__), url, model, rows, out, str(max_seq_len)],
                          timeout=600, capture_output=True, text=True)
    assert done.returncode == 0 and os.path.exists(out), done.stdout[-3000:] + done.stderr[-3000:]
    return torch.load(out)


def _main(url: str, model: str, rows: str, out: str, max_seq_len: str) -> None:
    import torch
    from modelopt.torch.speculative.plugins.hf_streaming_dataset import (
        EagleVllmStreamingConfig, EagleVllmStreamingDataset,
    )

    entries = [json.loads(line) for line in open(rows)]
    config = EagleVllmStreamingConfig(server_urls=[url], model=model, max_seq_len=int(max_seq_len),
                                      request_timeout=120)
    dataset = EagleVllmStreamingDataset(entries=entries, tokenizer=None, config=config)
    got = {}
    for entry in entries:
        ids = entry["input_ids"]
        sample = {"cid": entry["id"], "token_ids": ids, "loss_mask": torch.ones(len(ids), dtype=torch.long)}
        fetched = dataset._fetch(sample)
        assert fetched is not None, entry["id"]
        got[entry["id"]] = {**fetched, "formatted": dataset._format(fetched)}
    torch.save(got, out)
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    _main(*sys.argv[1:])
