"""Read a `corecap export --format specforge` directory with SpecForge 0.2.0's own offline data
path, as its `launch.build_offline_runtime` builds it: the EAGLE-3 reader, normalizer and collator
fed through its `FeatureDataLoader`, which yields `TrainBatch`es.

    python examples/load_sf.py train-sf

README ("Export to a trainer") shows its output on the quick start's store; tests/test_examples.py
runs it.
"""

import sys

import torch
from specforge.algorithms.eagle3.data import build_offline_collator, build_offline_normalizer, build_offline_reader
from specforge.runtime.data_plane.feature_dataloader import FeatureDataLoader
from specforge.runtime.data_plane.feature_store import LocalFeatureStore


def main(directory: str) -> None:
    max_len = 2048
    run_id = "demo"  # names the run's samples (RUN:ROW); SpecForge's feature store keeps them in memory
    refs = build_offline_reader(directory, run_id=run_id, ttt_length=7, max_len=max_len).read()
    loader = FeatureDataLoader(
        LocalFeatureStore(run_id), refs=refs, batch_size=4, collate_fn=build_offline_collator(),
        per_sample_transform=build_offline_normalizer(max_len, ttt_length=7), drop_last=False, strategy="eagle3",
    )
    batches = list(loader)
    first = batches[0]
    print(len(refs), "samples in", len(batches), "batches of", type(first).__name__)
    print(first.sample_ids,
          {k: (tuple(v.shape), v.dtype) for k, v in first.tensors.items() if torch.is_tensor(v)})


if __name__ == "__main__":
    main(sys.argv[1])
