"""The sink's peak RSS in `corecap run --max-tokens N --buffer-gb B` as the number of prompts doubles
(issue 33): the sink holds each sample whole in a buffer from its first chunk until its commit, and
`--buffer-gb` bounds those buffers, the free ones and the encoded copies together (the driver
admits a sample only while they fit: corecap/sink/budget.py), so with a B small enough to bind,
the peak should stay flat in the number of prompts, under the sink's idle RSS + B + the ring.

    flock /tmp/corecap-engine.lock python -m tools.bench.generate_memory [--prompts 8,64,128,256]
        [--buffer-gb 0.05|default] [--max-tokens 256] [--control] [--repeat 2] [--out DIR] [--dir DIR]

The demo model (corecap/demo.py) with every layer captured (1-8 and prenorm: 9 rows of 128 bf16,
2,304 bytes a token in the sink's buffers), prompts of 256-1,024 random tokens (the first P of one
fixed-seed list, so each set holds the smaller ones), the sampling of tools/common/generation.py.
Each run is the one-run arm of that module (a fresh `corecap run`, its processes' RSS sampled every
0.2 s); `--control` adds a run of the largest P with corecap's default --buffer-gb (40% of the
memory available), to show what the bound holds back. Every result is a JSON line in
OUT/bench_generate_memory_cpu.jsonl: the sink's, workers' and driver's peak RSS (the sink's
RssAnon too: its own allocations, without the shared libraries' pages; and RssShmem: the ring's
pages it touched), the sink's own figures from the run's trace ("sink_own": its RSS before its
first chunk, its VmHWM, the most its buffers held), the run's engine line (its "sink buffers"
figure) and its last lines ("samples in the sink: at most K at once").
"""

from __future__ import annotations

import argparse
import os
import shutil
import time

from tools.bench.generate import VOCAB_IDS, default_model, machine
from tools.common.child import append_jsonl, command_line
from tools.common.generation import ArmFailed, Setup, random_prompts, run_corecap, write_jsonl

LAYERS = "1,2,3,4,5,6,7,8,prenorm"
LENGTHS = (256, 1024)


def budget_line(rec: dict) -> str:
    """The run's line on what the bound held back (its wording before 2026-12-05 too)."""
    starts = ("samples in the sink", "responses in flight")
    return next((line for line in rec.get("lines", []) if line.startswith(starts)), "")


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--prompts", default="8,64,128,256", help="comma-separated numbers of prompts")
    ap.add_argument("--buffer-gb", type=lambda x: None if x == "default" else float(x), default=0.05,
                    help="corecap's --buffer-gb, or 'default' for corecap's own (default: %(default)s)")
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--control", action="store_true", help="also the largest P with the default --buffer-gb")
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--dir", default="/tmp/bench-generate-memory", help="prompts and stores (default: %(default)s)")
    args = ap.parse_args()
    counts = [int(x) for x in args.prompts.split(",")]
    os.makedirs(args.dir, exist_ok=True)
    os.makedirs(args.out, exist_ok=True)
    print(f"# {command_line()}", flush=True)
    host = machine()
    print(f"# {host}", flush=True)
    rows = random_prompts(max(counts), LENGTHS, VOCAB_IDS)
    runs = [(p, args.buffer_gb) for p in counts] + ([(max(counts), None)] if args.control else [])
    store = os.path.join(args.dir, "store")
    table = []
    for repeat in range(1, args.repeat + 1):
        for num_prompts, buffer_gb in runs:
            setup = Setup(model=default_model(), max_tokens=args.max_tokens, layers=LAYERS, seed=args.seed,
                          max_model_len=LENGTHS[1] + args.max_tokens, buffer_gb=buffer_gb)
            data = write_jsonl(os.path.join(args.dir, f"prompts-{num_prompts}.jsonl"), rows[:num_prompts])
            load_avg = os.getloadavg()
            t = time.time()
            try:
                rec = run_corecap(setup, data, store, generate=True)
                status = "ok"
            except ArmFailed as e:
                rec = {"failed": str(e), "stderr_tail": e.stderr[-12000:]}
                status = f"FAILED ({e})\n{e.stderr[-4000:]}"
            shutil.rmtree(store, ignore_errors=True)
            append_jsonl(os.path.join(args.out, "bench_generate_memory_cpu.jsonl"), {
                "repeat": repeat, "prompts": num_prompts, "buffer_gb": buffer_gb, "max_tokens": args.max_tokens,
                "layers": LAYERS, "date": time.strftime("%Y-%m-%d %H:%M:%S"), "load_avg_before": load_avg,
                **host, **rec,
            })
            print(f"repeat {repeat}, {num_prompts} prompts, --buffer-gb {buffer_gb}: {status} in "
                  f"{time.time() - t:.0f}s (load before {load_avg[0]:.2f})", flush=True)
            if "failed" not in rec:
                table.append(
                    f"{repeat}\t{num_prompts}\t{buffer_gb}\tsink {rec['sink_peak_rss_mib']} MiB "
                    f"(RssAnon {rec['sink_peak_anon_mib']} MiB, RssShmem {rec['sink_peak_shmem_mib']} MiB; "
                    f"its own: {rec['sink_own']})\t"
                    f"workers {rec['worker_peak_rss_gb']} GiB\tdriver {rec['driver_peak_rss_gb']} GiB\t"
                    f"{rec['generated_tok_s']:,.0f} generated tok/s\t{budget_line(rec) or '(no request held back)'}"
                )
    print("repeat\tprompts\t--buffer-gb\tpeak RSS\n" + "\n".join(table), flush=True)


if __name__ == "__main__":
    main()
