"""What a pass over the input found (`corecap.data.validate`'s result): the samples kept and
their tokens and images, the rows truncated, skipped (by reason) or in other shards."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True, kw_only=True)
class DatasetSummary:
    num_samples: int  # samples this run captures (whole or truncated)
    num_tokens: int  # their tokens, after truncation
    num_lines: int  # the last line/element/row number read
    num_truncated: int = 0  # samples cut to --max-len
    num_skipped: int = 0  # rows left out (too long under skip, or invalid under skip)
    skip_reasons: dict[str, int] = field(default_factory=dict)  # reason → count
    skip_examples: tuple[str, ...] = ()  # the first few skip messages, each naming its row
    num_other_shards: int = 0  # rows that belong to other shards
    num_images: int = 0  # images in the samples kept

    def outcomes(self) -> str:
        """One line with the count of each outcome, e.g. for the end of a run."""
        parts = [f"{self.num_samples} samples ({self.num_truncated} truncated to --max-len)"]
        reasons = ", ".join(f"{n} {reason}" for reason, n in sorted(self.skip_reasons.items()))
        parts.append(f"{self.num_skipped} skipped" + (f" ({reasons})" if reasons else ""))
        if self.num_other_shards:
            parts.append(f"{self.num_other_shards} in other shards")
        return ", ".join(parts)
