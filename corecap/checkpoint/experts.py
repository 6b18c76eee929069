"""Every expert's tensors, where transformers stacks them into one (its MoE models hold a layer's
experts as one `[num_experts, ...]` parameter, loaded from the checkpoint's per-expert tensors by a
`MergeModulelist` conversion): the stacked parameter is present once any one expert's tensor is,
so each expert is counted here against the parameter's first dimension."""

from __future__ import annotations

import re


def is_stacking(converter) -> bool:
    """Whether `converter` stacks per-expert tensors along a new first dimension."""
    from transformers.core_model_loading import MergeModulelist

    operations = getattr(converter, "operations", None) or []
    return bool(operations) and isinstance(operations[0], MergeModulelist) and operations[0].dim == 0


def missing_experts(stacked: dict[tuple[str, str], list[str]], state: dict) -> list[str]:
    """The per-expert tensors absent, from {(stacked parameter, source pattern): the checkpoint's
    names that fill it}; where the names do not show the expert's index, the parameter's own name."""
    lacking = []
    for (target, pattern), sources in stacked.items():
        num_experts = state[target].shape[0]
        if len(sources) < num_experts:
            lacking += _absent(sorted(sources), pattern, num_experts) or [target]
    return lacking


def _absent(sources: list[str], pattern: str, num_experts: int) -> list[str]:
    """The names of the experts absent, built from a present one (`*` in the pattern is the index)."""
    index = re.compile(re.escape(pattern).replace(r"\*", r"(\d+)"))
    present = {}
    for name in sources:
        m = index.search(name)
        if m is None:
            return []
        present[int(m.group(1))] = (name, m.span(1))
    name, (start, end) = next(iter(present.values()))
    return [name[:start] + str(k) + name[end:] for k in range(num_experts) if k not in present]
