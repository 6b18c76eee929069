"""The tensors an architecture needs, against those a checkpoint holds: HF transformers' model of
the checkpoint's `architectures[0]`, built on the meta device from its config.json (no memory, no
weights), and transformers' own rules for reading checkpoint names into that model's (its
conversion mapping: renamed modules, per-expert tensors fused into one, the multimodal wrappers'
prefixes), as its loader applies them.

Why transformers and not vLLM: vLLM's loaders know what they need only while they load (the
names are built inside `load_weights`); transformers states it before any weight is read. The
two agree on what a checkpoint of an architecture contains, which is all this compares.

No false refusals: a checkpoint is judged only where transformers understands every name it
holds. If any tensor maps to nothing in the model (a naming this transformers does not know, a
checkpoint for another class, a quantization's own tensors it cannot place), or the architecture
is not in transformers, or needs remote code, or the model cannot be built, `missing` returns None:
nothing is said, and vLLM's own loader is the only check. Tolerated on purpose:

- tensors of decoder layers past `num_hidden_layers` and `mtp.` modules (DeepSeek-V3's and
  Qwen3-Next's multi-token-prediction layers, which transformers' model does not build);
- `rotary_emb.inv_freq` (old checkpoints saved the buffer);
- tied parameters (the output embedding with `tie_word_embeddings`): either name will do;
- only parameters are required, not buffers (transformers computes those itself);
- a quantized checkpoint (`quantization_config`) is compared module by module: a module whose
  weight is stored as the quantization's own tensors (`weight_packed`, `weight_scale`, `blocks`)
  counts as present.

What this does not see: tensors whose shapes are wrong; in a quantized checkpoint, one of a
module's tensors (its scale without its weight, one expert of a stacked set).
"""

from __future__ import annotations

import re
from collections import defaultdict

from corecap.checkpoint import experts

_EXTRA = re.compile(r"(?:^|\.)(?:mtp\.|rotary_emb\.inv_freq$)")
_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def missing(model_dir: str, names: set[str]) -> tuple[list[str], str] | None:
    """(the tensors the checkpoint lacks, the model's class), or None where that cannot be known
    for sure (see the module's docstring). A missing tensor is named as the model names it, or as
    the checkpoint would for one expert of a stacked set (experts.py)."""
    model = _meta_model(model_dir)
    if model is None:
        return None
    try:
        renamed = _renamer(model)
    except Exception:  # transformers' loading rules moved: say nothing
        return None
    state = model.state_dict()
    config = model.config
    num_layers = getattr(config.get_text_config(), "num_hidden_layers", None)
    quantized = getattr(config, "quantization_config", None) is not None
    modules = {name.rpartition(".")[0] for name in state}
    covered: set[str] = set()
    covered_modules: set[str] = set()
    stacked: dict[tuple[str, str], list[str]] = defaultdict(list)  # experts.py
    for name in sorted(names, key=_loading_order):  # as transformers' loader: some renamings look back
        targets, pattern, converter = renamed(name, state)
        for target in targets:
            if target in state:
                covered.add(target)
                if converter is not None and experts.is_stacking(converter):
                    stacked[(target, pattern)].append(name)
            elif quantized and target.rpartition(".")[0] in modules:
                covered_modules.add(target.rpartition(".")[0])
            elif not _extra(name, num_layers) and not _ignored(model, "_keys_to_ignore_on_load_unexpected", name):
                return None  # a name transformers does not place: not a checkpoint it understands
    lacking = []
    groups = _parameter_groups(model)
    for group in groups:
        if any(n in covered or n.rpartition(".")[0] in covered_modules for n in group):
            continue
        if any(_ignored(model, "_keys_to_ignore_on_load_missing", n) for n in group):
            continue
        lacking.append(group[0])
    lacking += experts.missing_experts(stacked, state)
    return sorted(lacking, key=_natural), type(model).__name__


def _meta_model(model_dir: str):
    """transformers' model of the checkpoint's first architecture on the meta device, or None."""
    try:
        import torch
        import transformers

        config = transformers.AutoConfig.from_pretrained(model_dir, trust_remote_code=False)
        architectures = getattr(config, "architectures", None) or []
        cls = _transformers_class(transformers, architectures[0]) if architectures else None
        if cls is None:
            return None
        with torch.device("meta"):
            return cls(config)
    except Exception:  # not in transformers, remote code, a config this transformers cannot build
        return None


def _transformers_class(transformers, architecture: str):
    """transformers' class of `architecture`; vLLM's spelling may drop an underscore
    (KimiK25ForConditionalGeneration is transformers' Kimi_K25ForConditionalGeneration)."""
    cls = getattr(transformers, architecture, None)
    if cls is not None:
        return cls
    folded = architecture.replace("_", "").lower()
    for name in dir(transformers):
        if name.replace("_", "").lower() == folded:
            return getattr(transformers, name)
    return None


def _renamer(model):
    """checkpoint name → the model's name, as transformers' loader reads it
    (core_model_loading.convert_and_load_state_dict_in_model)."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightConverter, WeightRenaming, rename_source_key

    mapping = get_model_conversion_mapping(model)
    renamings = [m for m in mapping if isinstance(m, WeightRenaming)]
    converters = [m for m in mapping if isinstance(m, WeightConverter)]
    prefix = model.base_model_prefix

    by_source = {pattern: c for c in converters for pattern in c.source_patterns}

    def renamed(name: str, state: dict) -> tuple[list[str], str | None, object]:
        """(the model's names it fills, the converter's source pattern, the converter)"""
        target, source = rename_source_key(name, renamings, converters, prefix, state)
        if target not in state and name in state:
            return [rename_source_key(name, [], [], prefix, state)[0]], None, None
        if source is None:
            return [target], None, None
        return _siblings(target, by_source[source].target_patterns), source, by_source[source]

    return renamed


def _siblings(target: str, patterns: list[str]) -> list[str]:
    """Every tensor a converter makes from one source (a fused `wqkv` split into q, k and v):
    transformers names the first; the others differ only in the pattern."""
    first = patterns[0]
    if len(patterns) == 1:
        return [target]
    if not re.fullmatch(r"[\w.]+", first) or first not in target:
        return [target, ""]  # "": a name in no model, so the caller cannot judge this checkpoint
    head, _, tail = target.rpartition(first)
    return [head + pattern + tail for pattern in patterns]


def _parameter_groups(model) -> list[list[str]]:
    """Each parameter's names: more than one where tied (the same tensor, or tied by the config)."""
    by_tensor: dict[int, list[str]] = defaultdict(list)
    for name, param in model.named_parameters(remove_duplicate=False):
        by_tensor[id(param)].append(name)
    groups = list(by_tensor.values())
    tied = getattr(model, "all_tied_weights_keys", None) or {}
    if tied:
        where = {n: g for g in groups for n in g}
        for target, source in tied.items():
            if target in where and source in where and where[target] is not where[source]:
                merged = where[source] + where[target]
                groups = [g for g in groups if g is not where[target] and g is not where[source]] + [merged]
                where.update(dict.fromkeys(merged, merged))
    return groups


def _extra(name: str, num_layers: int | None) -> bool:
    """A tensor the model does not build and need not: MTP layers, an old rotary buffer."""
    if _EXTRA.search(name):
        return True
    m = _LAYER.search(name)
    return m is not None and num_layers is not None and int(m.group(1)) >= num_layers


def _ignored(model, attribute: str, name: str) -> bool:
    return any(re.search(pattern, name) for pattern in getattr(model, attribute, None) or [])


def _loading_order(name: str):
    from transformers.core_model_loading import dot_natural_key

    return dot_natural_key(name)


def _natural(name: str):
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name)]
