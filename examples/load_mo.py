"""Read a `corecap export --format modelopt` directory with NVIDIA ModelOpt 0.47.0's own offline
reader, as its `examples/speculative_decoding/main.py` builds it for `data.offline_data_path`
(`OfflineSupervisedDataset` over the `*.pt` files, `EagleOfflineDataCollator`).

    python examples/load_mo.py train-mo

README ("Export to a trainer") shows its output on the quick start's store; tests/test_examples.py
runs it.
"""

import pathlib
import sys
import warnings

import torch

# ModelOpt's own install line: without its dependencies, whose torch pin would replace vLLM's (README).
INSTALL = 'pip install --no-deps nvidia-modelopt==0.47.0 && pip install "omegaconf>=2.3.0" "pulp<4.0" scipy'
try:
    with warnings.catch_warnings(record=True) as caught:  # the filters in force stay: only what would show is caught
        from modelopt.torch.speculative.eagle.utils import EagleOfflineDataCollator, OfflineSupervisedDataset
except ImportError as e:
    sys.exit(f"{e}: install ModelOpt beside vLLM with: {INSTALL}")
for w in caught:
    if "nvidia-modelopt[hf]" in str(w.message):
        # ModelOpt warns of a transformers release it was not tested with, and suggests `pip install -U
        # nvidia-modelopt[hf]`, which would replace vLLM's torch and transformers: its offline reader
        # reads this export with vLLM's (tests/test_export_modelopt.py).
        first = str(w.message).split(" Please install")[0]
        print(f"note: {first} Its offline reader works with it; do not run `pip install -U nvidia-modelopt[hf]` "
              f"(it would replace the torch vLLM needs); to reinstall ModelOpt: {INSTALL}", file=sys.stderr)
    else:
        warnings.showwarning(w.message, w.category, w.filename, w.lineno)


def shapes(item: dict) -> dict:
    return {k: (tuple(v.shape), v.dtype) if torch.is_tensor(v) else v for k, v in item.items()}


def main(directory: str) -> None:
    files = sorted(str(p) for p in pathlib.Path(directory).rglob("*.pt"))
    dataset = OfflineSupervisedDataset(files, answer_only_loss=True)
    print(len(dataset), shapes(dataset[0]))
    batch = EagleOfflineDataCollator(train_len=2048)([dataset[i] for i in range(len(dataset))])
    print({k: shapes(v) if isinstance(v, dict) else tuple(v.shape) for k, v in batch.items()})


if __name__ == "__main__":
    main(sys.argv[1])
