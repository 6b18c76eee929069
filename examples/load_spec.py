"""Read a `corecap export --format speculators` directory with speculators 0.9.0's own loader, as
its trainer does (`ArrowDataset`, then `CollateFn` with `shift_batch`), and check its teacher
(`lm_head(norm(verifier_last_hidden_states))`, the verifier's own norm and lm_head loaded by
speculators) against HF's logits for the store's model.

    python examples/load_spec.py train-spec

README ("Export to a trainer") shows its output on the quick start's store; tests/test_examples.py
runs it.
"""

import json
import sys

import torch
import transformers
from speculators.models.eagle3.data import shift_batch
from speculators.models.eagle3.model_definitions import model_classes
from speculators.train.data import ArrowDataset, CollateFn
from speculators.utils.loading import load_model_layers

from corecap.store import Store


def shapes(item: dict) -> dict:
    return {k: (tuple(v.shape), v.dtype) if torch.is_tensor(v) else v for k, v in item.items()}


def main(directory: str) -> None:
    with open(f"{directory}/corecap_export.json") as f:
        info = json.load(f)
    with Store.open(info["options"]["store"]) as store:
        model = store.meta.model.path  # the verifier whose states these are
    num_aux = sum(layer["role"] == "aux" for layer in info["layers"])

    dataset = ArrowDataset(max_len=2048, datapath=directory, on_missing="raise")
    print(len(dataset), shapes(dataset[0]))
    hidden = dataset[0]["verifier_last_hidden_states"].shape[-1]
    collate = CollateFn(max_len=2048, hidden_size=hidden, num_target_layers=num_aux, preprocess=shift_batch)
    batch = collate([dataset[i] for i in range(len(dataset))])
    print({k: tuple(v.shape) if torch.is_tensor(v) else v for k, v in batch.items()})

    # speculators' teacher, as its Eagle3DraftModel builds it, on the first sample (unshifted)
    config = transformers.AutoConfig.from_pretrained(model)
    weights = load_model_layers(["lm_head.weight", "model.norm.weight"], model)
    norm = model_classes[config.model_type].norm_class(config.hidden_size, eps=config.rms_norm_eps)
    norm.load_state_dict({"weight": weights["model.norm.weight"].float()})
    item = dataset[0]
    with torch.no_grad():
        teacher = norm(item["verifier_last_hidden_states"].float()) @ weights["lm_head.weight"].float().T
        hf = transformers.AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
        reference = hf(item["input_ids"][None]).logits[0]
    error = float((teacher - reference).norm() / reference.norm())
    bound = 2**-5  # the states were captured in bf16: about 2^-8 each, grown by the layers after them
    print(f"teacher vs HF logits (float32): relative error {'below' if error < bound else 'ABOVE'} 2^-5 "
          f"({dataset[0]['input_ids'].numel()} tokens, bf16 states)")
    if error >= bound:
        sys.exit(f"teacher vs HF logits: relative error {error:.2e}")


if __name__ == "__main__":
    main(sys.argv[1])
