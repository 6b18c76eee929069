"""Read a `corecap export --format modelopt` directory with NVIDIA ModelOpt 0.47.0's own offline
reader, as its `examples/speculative_decoding/main.py` builds it for `data.offline_data_path`
(`OfflineSupervisedDataset` over the `*.pt` files, `EagleOfflineDataCollator`).

    python examples/load_mo.py train-mo

README ("Export to a trainer") shows its output on the quick start's store; tests/test_examples.py
runs it.
"""

import pathlib
import sys

import torch
from modelopt.torch.speculative.eagle.utils import EagleOfflineDataCollator, OfflineSupervisedDataset


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
