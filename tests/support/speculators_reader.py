"""speculators 0.9.0's own reading path, for the tests of `--format speculators` (bf16 and fp8):
its loader classes, the fp8 backend's reader its trainer builds for `--hidden-states-backend fp8`,
and its EAGLE-3 teacher, lm_head(norm(verifier_last_hidden_states)); and its online path, for
`corecap serve` (tests/test_serve.py, tools/connector_exact.py): the prepared data its trainer
reads, an ArrowDataset that asks a server for each row's states, and what it loads as layers."""

from __future__ import annotations

import argparse
import concurrent.futures
import functools

import torch


@functools.cache
def speculators():
    """speculators' loader modules, imported once (speculators imports every model it has: ~12 s)."""
    from speculators.models.eagle3.data import shift_batch
    from speculators.models.eagle3.model_definitions import model_classes
    from speculators.train.data import ArrowDataset, CollateFn
    from speculators.utils.loading import load_model_layers

    return ArrowDataset, CollateFn, shift_batch, model_classes, load_model_layers


def backend_transfer(backend: str, datapath: str):
    """What `speculators train --hidden-states-backend BACKEND --data-path DATAPATH` gives its
    ArrowDataset (speculators/train/cli.py: `HiddenStatesBackend.registry[...].from_train_args`)."""
    from hs_connectors import HiddenStatesBackend

    return HiddenStatesBackend.registry[backend].from_train_args(argparse.Namespace(hidden_states_path=None), datapath)


def speculators_teacher(verifier):
    """speculators' teacher as Eagle3DraftModel builds it: its norm class for the verifier's
    model type, with the verifier's final-norm and lm_head weights loaded by speculators' own
    loader; targets = verifier_lm_head(verifier_norm(verifier_last_hidden_states))."""
    import transformers

    _, _, _, model_classes, load_model_layers = speculators()
    config = transformers.AutoConfig.from_pretrained(verifier)
    weights = load_model_layers(["lm_head.weight", "model.norm.weight"], verifier)
    norm = model_classes[config.model_type].norm_class(config.hidden_size, eps=config.rms_norm_eps)
    norm.load_state_dict({"weight": weights["model.norm.weight"]})
    lm_head = torch.nn.Linear(config.hidden_size, config.vocab_size, bias=False)
    lm_head.load_state_dict({"weight": weights["lm_head.weight"]})
    assert not torch.allclose(norm.weight, torch.ones_like(norm.weight))  # the norm matters here
    return lambda last: lm_head(norm(last))


def prepared_data(path: str, rows: list[dict]) -> str:
    """speculators' prepared data (its `datasets` directory) for `rows` (each with `input_ids`):
    what its trainer reads, less the states."""
    import datasets

    ds = datasets.Dataset.from_dict({
        "input_ids": [r["input_ids"] for r in rows],
        "loss_mask": [[1] * len(r["input_ids"]) for r in rows],
        "seq_len": [len(r["input_ids"]) for r in rows],
    })
    ds.set_format("torch")
    ds.save_to_disk(path)
    return path


def read_online(url: str, transfer, datapath: str, count: int, clients: int) -> list:
    """Rows 0..count-1 of `datapath` through speculators' online path against the server at `url`
    (`--vllm-endpoint URL/v1 --on-missing generate`), `clients` at a time, each as the reader
    loaded it (a dict, or speculators' SampleUnavailable where it gave up)."""
    from speculators.train.data import ArrowDataset

    dataset = ArrowDataset(max_len=512, datapath=datapath, transfer=transfer, vllm_endpoint=f"{url}/v1",
                           on_missing="generate", hidden_states_dtype=torch.float32, max_retries=0)
    with concurrent.futures.ThreadPoolExecutor(clients) as pool:
        return list(pool.map(dataset.__getitem__, range(count)))


def loaded_layers(sample: dict, num_aux: int) -> torch.Tensor:
    """[num_aux + 1, T, H]: a loaded sample's aux layers, then its last state before the final norm."""
    num_tokens = len(sample["input_ids"])
    states = sample["hidden_states"].view(num_tokens, num_aux, -1)
    return torch.cat([states, sample["verifier_last_hidden_states"].unsqueeze(1)], dim=1).transpose(0, 1)
