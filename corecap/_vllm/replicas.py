"""Data parallelism: `-dp N` engine replicas in one run, all feeding one sink.

Each replica is an `Engine` of its own (EngineCore + multiproc executor + its TP x PP workers)
in this one driver process, its workers started on its own devices (corecap/_vllm/parallel.py,
`placement`). For a dense model vLLM's own data parallelism is exactly this: independent engines
with no collective between them (`reconfigure_for_independent_dp_rank`); its DP machinery adds
a coordinator process and, for MoE models only, a step-synchronised DP group, neither of which
corecap's hand-stepped loop needs. Owning the engines here keeps one step loop, one sink and one
store, and lets samples go to whichever replica has the least work (not a fixed split).

The loop steps one replica at a time, round robin: each keeps two batches at its workers
(`Engine._fill`), so while the driver waits on one replica's output the others compute the
batches already queued. Every worker's sender pushes to the same sink socket; each rank-0 ring
has its own slot-return socket (corecap/transport/ring.py, `free_socket`).
"""

from __future__ import annotations

import dataclasses

from corecap._vllm.engine import CaptureSpec, Engine, StepTiming
from corecap._vllm.options import build_vllm_config
from corecap._vllm.parallel import replica_environment
from corecap.errors import CorecapError


class Replicas:
    """The run's engines: `add` gives a sample to the replica with the fewest outstanding
    tokens, `step` steps the next replica that has work. With one replica, exactly `Engine`."""

    def __init__(self, options, model: str, capture: CaptureSpec, devices: list[dict[str, str]], first_config=None,
                 on_phase=None, first_media=None):
        """`on_phase(words)`: each phase of each engine's start, as it begins (progress.Heartbeat);
        `first_media`: vLLM's input processor for image requests, made on `first_config` (Engine's `media`)."""
        self.engines: list[Engine] = []
        self.num_replicas = len(devices)
        self._next = 0
        try:
            for k, env in enumerate(devices):
                with replica_environment(env):  # its workers spawn inside, and read it
                    # A config of its own: vLLM's engine writes into it (KV cache sizes, ...).
                    config = (first_config if k == 0 and first_config is not None
                              else build_vllm_config(options, model, capture.layers))
                    try:
                        phase = None if on_phase is None else self._phase(k, on_phase)
                        self.engines.append(Engine(config, model, dataclasses.replace(capture, replica=k), phase,
                                                   media=first_media if k == 0 else None))
                    except CorecapError as e:
                        raise CorecapError(self._label(k, str(e))) from None
        except BaseException:
            self.shutdown()
            raise

    def _phase(self, k: int, on_phase):
        return on_phase if self.num_replicas == 1 else (lambda words: on_phase(f"replica {k}: {words}"))

    @property
    def vllm_config(self):
        return self.engines[0].vllm_config

    @property
    def num_unfinished(self) -> int:
        return sum(e.num_unfinished for e in self.engines)

    @property
    def token_budget(self) -> int:
        """The most tokens one round of steps (each replica once) schedules."""
        return sum(e.token_budget for e in self.engines)

    @property
    def max_num_seqs(self) -> int:
        return sum(e.vllm_config.scheduler_config.max_num_seqs for e in self.engines)

    @property
    def steps_in_flight(self) -> int:
        return self.engines[0].steps_in_flight

    def add(self, req_id: str, token_ids: list[int], response=None, settings: dict | None = None,
            images: tuple | None = None) -> list[bytes] | None:
        """To the replica with the fewest prompt tokens still to capture (ties: the first)."""
        engine = min(self.engines, key=lambda e: e.num_outstanding_tokens)
        return engine.add(req_id, token_ids, response, settings, **({"images": images} if images else {}))

    def abort(self, req_id: str) -> int | None:
        """End an unfinished request on whichever replica runs it (None: none does; `Engine.abort`)."""
        for e in self.engines:
            until = e.abort(req_id)
            if until is not None:
                return until
        return None

    def take_prefix_actions(self) -> list[tuple]:
        return [a for e in self.engines for a in e.take_prefix_actions()]

    def take_responses(self) -> list[tuple]:
        return [r for e in self.engines for r in e.take_responses()]

    def prefix_bounds(self) -> list[int]:
        """Each engine's bound on the blocks it keeps in vLLM's prefix cache (none: caching off)."""
        return [e.prefix.max_blocks for e in self.engines if e.prefix is not None]

    def prefix_counts(self) -> tuple[int, int, int] | None:
        """Prompt tokens taken from vLLM's prefix cache, blocks evicted from it for the bound, and
        blocks tracked now, over every engine; None where caching is off."""
        trackers = [e.prefix for e in self.engines if e.prefix is not None]
        if not trackers:
            return None
        return (sum(t.num_hit_tokens for t in trackers), sum(t.num_evicted for t in trackers),
                sum(len(t.counts) for t in trackers))

    def prefix_line(self) -> str | None:
        """How much vLLM's prefix cache saved, or None where it is off."""
        trackers = [e.prefix for e in self.engines if e.prefix is not None]
        if not trackers:
            return None
        hits, evicted = sum(t.num_hit_tokens for t in trackers), sum(t.num_evicted for t in trackers)
        return (f"prefix cache: {hits} prompt tokens taken from it; {evicted} blocks evicted from vLLM "
                "beyond the blocks corecap tracks (--prefix-blocks)")

    def step(self) -> StepTiming:
        """One step of the next replica (round robin) that has unfinished samples."""
        n = len(self.engines)
        for i in range(n):
            k = (self._next + i) % n
            if self.engines[k].num_unfinished:
                self._next = (k + 1) % n
                try:
                    return self.engines[k].step()
                except CorecapError as e:
                    raise CorecapError(self._label(k, str(e))) from None
        raise AssertionError("step() with no unfinished sample")

    def _label(self, k: int, message: str) -> str:
        return message if self.num_replicas == 1 else f"replica {k}: {message}"

    def problem(self) -> str | None:
        """A sentence naming a dead worker and its replica, or None while all are alive."""
        for k, engine in enumerate(self.engines):
            problem = engine.problem()
            if problem:
                return self._label(k, problem)
        return None

    def interrupt(self, reason: str) -> None:
        for engine in self.engines:
            engine.interrupt(reason)

    def ring_status(self) -> str:
        return self._joined(Engine.ring_status)

    def network_status(self) -> str:
        return self._joined(Engine.network_status)

    def rotary_lines(self) -> list[str]:
        return [self._label(k, line) for k, e in enumerate(self.engines) for line in e.rotary_lines()]

    def _joined(self, status) -> str:
        if self.num_replicas == 1:
            return status(self.engines[0])
        return "; ".join(f"replica {k}: {status(e)}" for k, e in enumerate(self.engines))

    def worker_stats(self) -> list[dict]:
        return [{**s, "replica": k} if self.num_replicas > 1 else s
                for k, e in enumerate(self.engines) for s in e.worker_stats()]

    def shutdown(self) -> None:
        """Every engine, whatever the others do (a dead replica's shutdown may fail)."""
        errors = []
        for engine in self.engines:
            try:
                engine.shutdown()
            except Exception as e:
                errors.append(e)
        if errors:
            raise errors[0]
