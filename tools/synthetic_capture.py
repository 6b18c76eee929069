"""What `corecap run --layers ...,prenorm` stores, made without an engine: HF transformers' own
states for each sample of --data (hidden_states[k] for integer layers; "prenorm", the last
decoder layer's output before the final norm, by a forward hook), read and masked by corecap's
own input reader and written with the store's own encoder: a store to try `corecap export`,
`corecap.StoreDataset` or the readers on without starting an engine (`corecap run` captures
prenorm itself).

    python -m tools.synthetic_capture --store demo.lmdb [--model DIR] [--data FILE] \
        [--layers 2,4,5,8,prenorm] [--dtype bfloat16]
"""

from __future__ import annotations

import argparse
import sys

import torch

from corecap import __version__, data, demo
from corecap.config import PRENORM, parse_layers, resolve_layers
from corecap.model import load_tokenizer, model_identity
from corecap.store import FORMAT_VERSION, LAYER_MEANING, Store, StoreMeta, encode_sample


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--store", required=True)
    ap.add_argument("--model", default=None, help="default: the built-in demo model")
    ap.add_argument("--data", default=None, help="default: the built-in demo dataset")
    ap.add_argument("--layers", default=None, help="default: 2,N//2,N-3,N,prenorm")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    args = ap.parse_args()
    import transformers

    model_dir = args.model or demo.demo_model_dir()
    identity = model_identity(model_dir, "auto")
    n = identity.num_layers
    layers = resolve_layers(parse_layers(args.layers) if args.layers else None, n)
    if args.layers is None:
        layers = resolve_layers(layers + (PRENORM,), n)
    dtype = getattr(torch, args.dtype)
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    captured = []
    model.model.layers[-1].register_forward_hook(
        lambda module, inputs, output: captured.append(output[0] if isinstance(output, tuple) else output)
    )
    meta = StoreMeta(
        format_version=FORMAT_VERSION, model=identity, layers=layers, layer_meaning=LAYER_MEANING, dtype=args.dtype,
        hidden_size=identity.hidden_size, corecap_version=__version__, vllm_version="none (HF transformers)",
        codec="zstd-planes",
    )
    samples = data.read_samples(
        args.data or demo.demo_data_path(), tokenizer=load_tokenizer(model_dir), vocab_size=identity.vocab_size,
        max_len=4096,
    )
    num = 0
    with Store.create_or_open(args.store, meta) as store:
        for sample in samples:
            captured.clear()
            with torch.no_grad():
                out = model(torch.tensor([sample.token_ids.tolist()]), output_hidden_states=True)
            per_layer = [captured[0][0] if k == PRENORM else out.hidden_states[k][0] for k in layers]
            states = torch.stack(per_layer).to(dtype)
            store.put_many([encode_sample(sample.key, sample.token_ids, states, layers, codec="zstd-planes",
                                          loss_mask=sample.loss_mask)])
            num += 1
    print(f"{args.store}: {num} samples, layers {list(layers)}, {args.dtype} (HF transformers' states, no engine)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
