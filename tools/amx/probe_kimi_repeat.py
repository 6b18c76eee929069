"""Probe: where, in tokens and layers, does a float32 capture of the tiny Kimi-K2.5 checkpoint
(tests/test_kimi.py's) leave HF's states, over repeated runs? Builds the checkpoint and HF's
references once, then captures the same data RUNS times (eager unless --compiled) and prints, per
run, each sample whose worst per-token error passes 1e-5, with the tokens and layers concerned.

    PYTHONPATH=tests python tools/amx/probe_kimi_repeat.py [RUNS] [--compiled] [--shuffle]

--shuffle: run r captures the samples in a random order of seed r (the schedule then differs).
Filter its output with `grep --line-buffered -E "^run |engine-watch"`: a plain grep into a
pipe holds its lines until it ends, and a device call cut short returns none of them.
tools/amx/engine_watch.py, installed first, says where in the engine the states part from HF's.
"""

import random
import sys
import tempfile
from pathlib import Path

from corecap.config import PRENORM, build
from corecap.run import run
from corecap.store import Store
from support import kimi_k25, tiny_models
from support.reference import write_jsonl

LAYERS = (*range(tiny_models.NUM_LAYERS + 1), PRENORM)
OFF = 1e-5  # a per-token relative error above this is printed (a correct capture measures ~1e-6)


def main(runs: int, compiled: bool, shuffle: bool) -> None:
    work = Path(tempfile.mkdtemp(prefix="kimi-probe-"))
    checkpoint = kimi_k25.build(str(work / "model"))
    rows = tiny_models.rows()
    data = write_jsonl(work / "data.jsonl", rows)
    refs = tiny_models.reference_in_a_process(checkpoint, data, str(work / "refs.pt"))
    for attempt in range(runs):
        if shuffle:
            order = random.Random(attempt).sample(rows, len(rows))
            data = write_jsonl(work / f"data-{attempt}.jsonl", order)
            print(f"run {attempt}: order {[row['id'] for row in order]}", flush=True)
        cfg = build(model=checkpoint, data=data, store=str(work / f"store-{attempt}"), layers=LAYERS, batch=4,
                    max_batched_tokens=64, dtype="float32", enforce_eager=not compiled)
        run(cfg, log=lambda line: print(f"run {attempt}: {line}", flush=True) if "rotary" in line else None)
        worst_of_run = 0.0
        with Store.open(cfg.store) as store:
            for row in rows:
                got = store.get(row["id"]).hidden_states.float()
                ref = tiny_models.stacked(refs[row["id"]], LAYERS).float()
                err = (got - ref).norm(dim=-1) / ref.norm(dim=-1).clamp_min(1e-30)  # [L, T]
                worst_of_run = max(worst_of_run, float(err.max()))
                off = (err > OFF).nonzero()  # (layer index, token) pairs
                if len(off):
                    tokens = sorted({int(t) for t in off[:, 1]})
                    layers = sorted({str(LAYERS[int(i)]) for i in off[:, 0]})
                    print(f"run {attempt}: {row['id']} ({len(row['input_ids'])} tokens) worst {float(err.max()):.2e}"
                          f" tokens {tokens[:12]}{'...' if len(tokens) > 12 else ''} ({len(tokens)}) layers {layers}",
                          flush=True)
        print(f"run {attempt}: worst per-token error {worst_of_run:.2e}", flush=True)


if __name__ == "__main__":
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    main(int(args[0]) if args else 4, "--compiled" in sys.argv, "--shuffle" in sys.argv)
