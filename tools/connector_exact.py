"""vLLM's own capture server for speculators' online mode against HF transformers, on the CPU:
`vllm serve` with its `extract_hidden_states` method and `ExampleHiddenStatesConnector`
(speculators' file backend, as its launcher starts it), and `corecap serve` beside it, each read
by speculators' own reader (`ArrowDataset` with `--vllm-endpoint`, hs_connectors' `FileTransfer`)
while 6 clients ask at once. Every token of every sample it loads is compared with HF's
`output_hidden_states` at the aux layers and with the last decoder layer's output before the
final norm (what speculators takes as the verifier's last state), float32.

    python3 -m tools.connector_exact [--archs llama,deepseek_v3] [--servers vllm,corecap] [--out DIR]

Models: tests/support/tiny_models.py's (4 decoder layers, weights of a fixed seed, final-norm
weights not all ones; deepseek_v3 is MLA attention with routed and shared experts), aux layers
1, 2, 3 (vLLM's ids: HF's hidden_states[1..3]). Prompts: tests/support/tiny_models.py's rows (1
to 300 tokens, duplicates, a shared prefix). Both servers take the same engine settings: float32,
eager, 512 positions, 4 sequences at once, 0.2 of the memory for the KV cache (corecap's default
on a CPU; vLLM's default, 0.92 of the RAM, is more than a 24 GiB machine has free); on the MLA
model, vLLM's reference CPU MLA backend (the AMX one takes no float32 weights).

Writes DIR/connector_exact.jsonl: per server and model, the worst per-token relative error
(|diff| / |HF|) at each layer over every token and the sample it is worst for, the samples the
reader gave up on (speculators' `SampleUnavailable`, with its reason), or the server's errors
and last lines where it did not start.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from tools.common.child import ROOT, append_jsonl, child_env, command_line, free_port, wait_healthy


def _support(name: str):
    """tests/support/NAME.py, loaded from its file as the tests' scripts load it."""
    spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, "tests", "support", f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


tiny_models = _support("tiny_models")
speculators_reader = _support("speculators_reader")  # speculators' own online path

AUX = (1, 2, 3)
CLIENTS = 6
ENGINE = ["--dtype", "float32", "--enforce-eager", "--max-model-len", "512", "--max-num-seqs", "4"]


def server_command(server: str, model: str, port: int, hidden: str, arch: str) -> list[str]:
    engine = ENGINE + (["--attention-backend", "CPU_MLA"] if arch == "deepseek_v3" else [])
    if server == "corecap":
        return [sys.executable, "-m", "corecap.cli", "serve", "--model", model, "--port", str(port), *engine,
                "--layers", ",".join(map(str, (*AUX, "prenorm"))), "--served-model-name", "tiny",
                "--hidden-states-backend", "file", "--hidden-states-path", hidden]
    speculative = {"method": "extract_hidden_states", "num_speculative_tokens": 1,
                   "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": list(AUX)}}}
    transfer = {"kv_connector": "ExampleHiddenStatesConnector", "kv_role": "kv_producer",
                "kv_connector_extra_config": {"shared_storage_path": hidden}}
    # vLLM's share of memory for its KV cache (on a CPU, of the RAM) as corecap's default on a CPU
    return [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model, "--port", str(port),
            *engine, "--gpu-memory-utilization", "0.2", "--skip-tokenizer-init", "--served-model-name", "tiny",
            "--speculative-config", json.dumps(speculative), "--kv-transfer-config", json.dumps(transfer)]


def read_all(url: str, hidden: str, rows: list[dict], work: str) -> list[dict]:
    """Every row through speculators' own online path, CLIENTS at a time."""
    from hs_connectors import FileTransfer

    datapath = speculators_reader.prepared_data(os.path.join(work, "prepared"), rows)
    return speculators_reader.read_online(url, FileTransfer(Path(hidden)), datapath, len(rows), CLIENTS)


def compare(got: list[dict], rows: list[dict], reference: dict) -> dict:
    """Per layer, the worst per-token relative error over every token, and where it is."""

    worst: dict = {}
    unavailable = {row["id"]: getattr(sample, "reason", "") for sample, row in zip(got, rows)
                   if not isinstance(sample, dict)}  # speculators' SampleUnavailable: the reader gave up on it
    for sample, row in zip(got, rows):
        if row["id"] in unavailable:
            continue
        if sample["input_ids"].tolist() != row["input_ids"]:
            raise SystemExit(f"{row['id']}: the reader loaded other token ids than the row's")
        loaded = speculators_reader.loaded_layers(sample, len(AUX))
        ref = tiny_models.stacked(reference[row["id"]], (*AUX, "prenorm"))
        per_token = (loaded - ref).norm(dim=-1) / ref.norm(dim=-1).clamp_min(1e-30)  # [L, T]
        for j, layer in enumerate((*AUX, "prenorm")):
            value = float(per_token[j].max())
            if value >= worst.get(str(layer), (-1.0, ""))[0]:
                worst[str(layer)] = (value, row["id"])
    return {**{layer: {"max_rel": v, "sample": key} for layer, (v, key) in worst.items()},
            **({"unavailable": unavailable} if unavailable else {})}


def one(server: str, arch: str, work: str, rows: list[dict], reference: dict, model: str) -> dict:
    hidden = os.path.join(work, f"{server}-{arch}-hidden")
    os.makedirs(hidden, exist_ok=True)
    port = free_port()
    cmd = server_command(server, model, port, hidden, arch)
    log_path = os.path.join(work, f"{server}-{arch}.log")
    record = {"server": server, "arch": arch, "command": " ".join(cmd[1:])}
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=child_env(), start_new_session=True)
    try:
        url = f"http://127.0.0.1:{port}"
        if not wait_healthy(url, proc, 900):
            return {**record, "started": False, "tail": _tail(log_path)}
        try:
            got = read_all(url, hidden, rows, os.path.join(work, f"{server}-{arch}"))
        except Exception as e:  # the reader's own error: what speculators would see
            return {**record, "started": True, "read": False, "error": f"{type(e).__name__}: {e}"[:2000],
                    "tail": _tail(log_path)}
        errors = compare(got, rows, reference)
        return {**record, "started": True, "read": True, "errors": errors,
                **({"tail": _tail(log_path)} if "unavailable" in errors else {})}
    finally:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _tail(path: str) -> list[str]:
    """The log's errors (the root cause of a failed start is above the engine's traceback), then its last lines."""
    with open(path, errors="replace") as f:
        lines = [line.rstrip() for line in f]
    return [x for x in lines if re.search(r"\w(Error|Exception): ", x)][:10] + lines[-8:]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--archs", default="llama,deepseek_v3")
    ap.add_argument("--servers", default="vllm,corecap")
    ap.add_argument("--out", default=".")
    args = ap.parse_args()
    work = tempfile.mkdtemp(prefix="connector-exact-")
    rows = tiny_models.rows()
    data = os.path.join(work, "rows.jsonl")
    with open(data, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    out = os.path.join(args.out, "connector_exact.jsonl")
    try:
        for arch in args.archs.split(","):
            model = tiny_models.build(arch, os.path.join(work, arch), seed=3)
            reference = tiny_models.reference_in_a_process(model, data, os.path.join(work, f"{arch}-ref.pt"))
            for server in args.servers.split(","):
                record = {**one(server, arch, work, rows, reference, model), "cmd": command_line()}
                append_jsonl(out, record)
                errors = record.get("errors")
                print(f"{server:8s} {arch:12s} " + (json.dumps(errors) if errors else json.dumps(record)[:3000]),
                      flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
