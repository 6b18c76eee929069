"""An incomplete checkpoint is refused before vLLM starts, in one line naming what is missing
(corecap/checkpoint/); every complete one the suite builds passes, in whatever layout it has
(per-expert or fused experts, tied embeddings, extra MTP layers, multimodal wrappers with the
Hub's names, quantized tensors). No engine: the check alone, and one `corecap run` refused."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

from corecap.checkpoint import check_checkpoint, expected, files
from corecap.demo import build_tiny_llama
from corecap.errors import CorecapError
from support import tiny_models

LLAMA_LAYERS = 4


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("llama"))
    build_tiny_llama(path, seed=0, num_layers=LLAMA_LAYERS)
    return path


def _copy(model: str, to) -> str:
    shutil.copytree(model, to)
    return str(to)


def _rewrite(model: str, change) -> None:
    """The single-file checkpoint's tensors, changed by `change(dict)` in place."""
    path = os.path.join(model, "model.safetensors")
    weights = load_file(path)
    change(weights)
    save_file(weights, path, metadata={"format": "pt"})


def _config(model: str, **fields) -> None:
    path = os.path.join(model, "config.json")
    with open(path) as f:
        config = json.load(f)
    config.update(fields)
    with open(path, "w") as f:
        json.dump(config, f)


def _judged(model: str) -> list[str]:
    """What the check found missing, asserting it could judge the checkpoint at all."""
    found = expected.missing(model, files.tensor_names(model))
    assert found is not None, f"{model}: the check said nothing (it does not understand this checkpoint)"
    return found[0]


# --- refused ------------------------------------------------------------------------------------


def test_a_llama_without_one_weight_is_refused_naming_it(llama, tmp_path):
    model = _copy(llama, tmp_path / "m")
    _rewrite(model, lambda w: w.pop("model.layers.3.mlp.down_proj.weight"))
    with pytest.raises(CorecapError) as e:
        check_checkpoint(model)
    assert str(e.value) == (
        f"--model {model}: the checkpoint lacks 1 tensor LlamaForCausalLM needs "
        "(model.layers.3.mlp.down_proj.weight): an interrupted download? Download it again"
    )


def test_many_missing_are_counted_and_the_first_few_named(llama, tmp_path):
    model = _copy(llama, tmp_path / "m")
    _rewrite(model, lambda w: [w.pop(k) for k in list(w) if k.startswith(("model.layers.2.", "model.layers.3."))])
    with pytest.raises(CorecapError, match=r"lacks 18 tensors LlamaForCausalLM needs \(model\.layers\.2\."
                                           r"input_layernorm\.weight, model\.layers\.2\.mlp\.down_proj\.weight, "
                                           r"model\.layers\.2\.mlp\.gate_proj\.weight, and 15 more\)"):
        check_checkpoint(model)


def test_corecap_run_refuses_it_before_vllm_starts(llama, tmp_path):
    """The same refusal from `corecap run`: its last line, and no engine line before it."""
    model = _copy(llama, tmp_path / "m")
    _rewrite(model, lambda w: w.pop("model.layers.3.mlp.down_proj.weight"))
    (tmp_path / "d.jsonl").write_text('{"id": "a", "input_ids": [1, 2, 3]}\n')
    r = subprocess.run([sys.executable, "-m", "corecap.cli", "run", "--model", model, "--data", "d.jsonl",
                        "--store", "s.lmdb"], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert r.returncode == 2, r.stderr
    last = r.stderr.splitlines()[-1]
    assert last.startswith(f"corecap: error: --model {model}: the checkpoint lacks 1 tensor "), r.stderr
    assert "(model.layers.3.mlp.down_proj.weight)" in r.stderr and "engine:" not in r.stderr, r.stderr


@pytest.fixture(scope="module")
def sharded(llama, tmp_path_factory) -> str:
    """The tiny Llama in shards with an index, as large checkpoints ship."""
    import transformers

    path = str(tmp_path_factory.mktemp("sharded"))
    model = transformers.LlamaForCausalLM.from_pretrained(llama, dtype=torch.float32)
    model.save_pretrained(path, max_shard_size="200KB")
    assert os.path.exists(os.path.join(path, files.INDEX))
    return path


def _shards(model: str) -> list[str]:
    return sorted(f for f in os.listdir(model) if f.endswith(".safetensors"))


def test_a_missing_shard_is_refused_naming_it(sharded, tmp_path):
    model = _copy(sharded, tmp_path / "m")
    shards = _shards(model)
    os.unlink(os.path.join(model, shards[1]))
    with pytest.raises(CorecapError) as e:
        check_checkpoint(model)
    assert str(e.value) == (
        f"{model}: 1 of the {len(shards)} weight files that model.safetensors.index.json names are missing "
        f"({shards[1]}): an interrupted download? Download them again"
    )


def test_a_shard_cut_short_is_refused(sharded, tmp_path):
    model = _copy(sharded, tmp_path / "m")
    path = os.path.join(model, _shards(model)[0])
    size = os.path.getsize(path)
    os.truncate(path, size - 100)
    with pytest.raises(CorecapError, match=rf"^{path}: {size - 100} bytes, but its tensors end at byte {size}: "
                                           r"the file is cut short"):
        check_checkpoint(model)


def test_a_tensor_the_index_places_in_a_shard_without_it(sharded, tmp_path):
    model = _copy(sharded, tmp_path / "m")
    first = _shards(model)[0]
    held = sorted(files.header(os.path.join(model, first)))
    weights = load_file(os.path.join(model, first))
    weights.pop(held[0])
    save_file(weights, os.path.join(model, first), metadata={"format": "pt"})
    with pytest.raises(CorecapError, match=rf"^{os.path.join(model, first)}: lacks 1 tensors that "
                                           rf"model\.safetensors\.index\.json places there \({held[0]}\)"):
        check_checkpoint(model)


def test_a_kimi_k25_without_a_layers_experts_is_refused(kimi_k25, tmp_path):
    """Through the Hub's names: transformers' own renaming finds the layer's stacked experts gone
    (the index rewritten with them, as a bad conversion would leave it: files.py sees nothing)."""
    model = _copy(kimi_k25, tmp_path / "m")
    with open(os.path.join(model, files.INDEX)) as f:
        index = json.load(f)
    gone = [k for k in index["weight_map"] if k.startswith("language_model.model.layers.2.mlp.experts.")
            and ".down_proj." in k]
    assert gone
    for shard in sorted({index["weight_map"][k] for k in gone}):
        weights = load_file(os.path.join(model, shard))
        for k in gone:
            weights.pop(k, None)
        save_file(weights, os.path.join(model, shard), metadata={"format": "pt"})
    for k in gone:
        del index["weight_map"][k]
    with open(os.path.join(model, files.INDEX), "w") as f:
        json.dump(index, f)
    assert _judged(model) == ["model.language_model.layers.2.mlp.experts.down_proj"]


def test_one_expert_missing_from_a_stacked_set_is_named_as_the_checkpoint_names_it(tmp_path):
    """transformers stacks a layer's experts into one tensor; each expert is still counted."""
    model = tiny_models.build("mixtral", str(tmp_path / "m"))
    names = files.tensor_names(model)
    gone = next(n for n in sorted(names) if ".layers.2." in n and ".experts.3." in n and n.endswith("w2.weight"))
    _rewrite(model, lambda w: w.pop(gone))
    assert _judged(model) == [gone]
    with pytest.raises(CorecapError, match=rf"lacks 1 tensor MixtralForCausalLM needs \({re.escape(gone)}\)"):
        check_checkpoint(model)


# --- accepted -----------------------------------------------------------------------------------


@pytest.mark.parametrize("name", tiny_models.ARCHITECTURES)
def test_every_tiny_architecture_passes(name, tmp_path):
    model = tiny_models.build(name, str(tmp_path / name))
    assert _judged(model) == []
    check_checkpoint(model)


def test_llama_sharded_and_single_file_pass(llama, sharded):
    for model in (llama, sharded):
        assert _judged(model) == []


def test_tied_embeddings_without_an_lm_head_tensor(tmp_path):
    import transformers

    config = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=True)
    transformers.LlamaForCausalLM(config).save_pretrained(tmp_path)
    assert "lm_head.weight" not in files.tensor_names(str(tmp_path))
    assert _judged(str(tmp_path)) == []


def test_deepseek_v3_with_its_mtp_layer(tmp_path):
    """DeepSeek-V3 checkpoints carry a multi-token-prediction layer past num_hidden_layers, which
    transformers' model does not build (nor does vLLM's for capture)."""
    model = tiny_models.build("deepseek_v3", str(tmp_path / "m"))
    n = tiny_models.NUM_LAYERS

    def add_mtp(w):
        for k in [k for k in w if k.startswith(f"model.layers.{n - 1}.")]:
            w[k.replace(f"layers.{n - 1}.", f"layers.{n}.")] = w[k].clone()
        for extra in ("enorm.weight", "hnorm.weight", "shared_head.norm.weight"):
            w[f"model.layers.{n}.{extra}"] = torch.ones(64)
        w[f"model.layers.{n}.eh_proj.weight"] = torch.zeros(64, 128)

    _rewrite(model, add_mtp)
    _config(model, num_nextn_predict_layers=1)
    assert _judged(model) == []


def test_fused_experts_as_transformers_holds_them(tmp_path):
    """A checkpoint saved from transformers' own tensors (fused experts), not the Hub's per-expert ones."""
    config, cls = tiny_models.configs()["mixtral"]
    model = cls(config)
    model.save_pretrained(tmp_path)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(tmp_path / "model.safetensors"),
              metadata={"format": "pt"})
    assert any(k.endswith("experts.gate_up_proj") for k in files.tensor_names(str(tmp_path)))
    assert _judged(str(tmp_path)) == []


def test_quantized_tensors_stand_for_their_module(tmp_path):
    """FP8 block scales beside each weight (DeepSeek-V3's own), and compressed-tensors' packed
    weights (Kimi's INT4 experts) in place of the weight: each module counts as present."""
    fp8 = tiny_models.build("deepseek_v3", str(tmp_path / "fp8"))

    def scales(w):
        for k in [k for k in w if k.endswith("proj.weight")]:
            w[k.replace(".weight", ".weight_scale_inv")] = torch.ones(1, 1)

    _rewrite(fp8, scales)
    _config(fp8, quantization_config={"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                      "weight_block_size": [128, 128]})
    assert _judged(fp8) == []

    int4 = tiny_models.build("deepseek_v3", str(tmp_path / "int4"))

    def packed(w):
        for k in [k for k in w if ".experts." in k and k.endswith("proj.weight")]:
            weight = w.pop(k)
            base = k[: -len("weight")]
            w[base + "weight_packed"] = torch.zeros(weight.shape[0], weight.shape[1] // 8, dtype=torch.int32)
            w[base + "weight_scale"] = torch.ones(weight.shape[0], 1)
            w[base + "weight_shape"] = torch.tensor(list(weight.shape))

    _rewrite(int4, packed)
    _config(int4, quantization_config={"quant_method": "compressed-tensors", "format": "pack-quantized"})
    assert _judged(int4) == []


@pytest.fixture(scope="module")
def kimi_k25(tmp_path_factory) -> str:
    """The tiny Kimi-K2.5 in the release's layout (tests/support/kimi_k25.py: the Hub's names,
    one tensor per expert, two shards and an index)."""
    from support import kimi_k25

    return kimi_k25.build(str(tmp_path_factory.mktemp("kimi-k25")))


def test_kimi_k25_with_the_hubs_names(kimi_k25):
    assert _judged(kimi_k25) == []


def test_gemma3_multimodal_with_the_hubs_names(tmp_path):
    import transformers

    text = tiny_models.configs()["gemma3"][0]
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=28,
                  patch_size=14)
    config = transformers.Gemma3Config(text_config=text.to_dict(), vision_config=vision, mm_tokens_per_image=4)
    transformers.Gemma3ForConditionalGeneration(config).save_pretrained(tmp_path)
    assert any(k.startswith("language_model.model.layers.") for k in files.tensor_names(str(tmp_path)))
    assert _judged(str(tmp_path)) == []


def test_what_it_does_not_understand_it_does_not_judge(llama, tmp_path):
    """A name transformers places nowhere (a renamed tensor) or an architecture it lacks: no word."""
    renamed = _copy(llama, tmp_path / "renamed")
    _rewrite(renamed, lambda w: w.update({"model.layers.1.mlp.down_projection.weight":
                                          w.pop("model.layers.1.mlp.down_proj.weight")}))
    assert expected.missing(renamed, files.tensor_names(renamed)) is None
    check_checkpoint(renamed)  # vLLM's loader names it (tests/test_worker_errors.py)
    unknown = _copy(llama, tmp_path / "unknown")
    _rewrite(unknown, lambda w: w.pop("model.layers.3.mlp.down_proj.weight"))
    _config(unknown, architectures=["NoSuchForCausalLM"])
    assert expected.missing(unknown, files.tensor_names(unknown)) is None


def test_dummy_weights_are_not_checked(llama, tmp_path):
    """--load-format dummy reads no tensor: an incomplete checkpoint does not matter there."""
    model = _copy(llama, tmp_path / "m")
    _rewrite(model, lambda w: w.pop("model.layers.3.mlp.down_proj.weight"))
    with pytest.raises(CorecapError):
        check_checkpoint(model, "auto")
    check_checkpoint(model, "dummy")
