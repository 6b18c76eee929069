"""What `corecap export` wrote (corecap/export/driver.py), in the line and the notes it prints
and keeps in corecap_export.json: the samples, what was left out and why, and what each sample's
loss mask was made of where the store holds none."""

from __future__ import annotations

from dataclasses import dataclass

from corecap.export.formats import LAYOUTS
from corecap.export.plan import ExportPlan


@dataclass(frozen=True, kw_only=True)
class ExportSummary:
    out: str
    plan: ExportPlan
    num_samples: int
    num_tokens: int
    num_kept: int  # sample files an interrupted export had already written
    num_no_mask: int  # samples without a loss mask, exported with all ones (but on their image tokens)
    num_no_mask_with_images: int  # of them, those with images
    num_no_mask_image_tokens: int  # and their image tokens, exported with loss mask 0
    num_nonfinite: int  # samples flagged NaN/Inf at capture, left out
    num_ineligible: int  # samples the format's trainer would refuse (its layout's `keeps`), left out
    num_with_images: int  # samples with images: their image tokens exported with loss mask 0
    num_image_tokens: int
    images_note: str  # what the format's trainer does with them (the layout's `images_note`)
    nbytes: int  # bytes of the sample files written by this run
    seconds: float

    def line(self) -> str:
        rate = self.nbytes / self.seconds / 1e9 if self.seconds else 0.0
        per_s = (self.num_samples - self.num_kept) / self.seconds if self.seconds else 0.0
        kept = f", {self.num_kept} kept from an interrupted export" if self.num_kept else ""
        return (
            f"{self.out}: {self.num_samples} samples ({self.num_tokens} tokens) in the {self.plan.fmt} layout{kept}; "
            f"wrote {self.nbytes / 1e6:.1f} MB in {self.seconds:.1f}s ({rate:.2f} GB/s, {per_s:.1f} samples/s)"
        )

    def notes(self, warnings: bool = True) -> list[str]:
        """What the user should know; `warnings=False`: without the warnings `export_store` logged first."""
        out = [n for n in self.plan.notes if warnings or not n.startswith("warning: ")]
        if self.num_no_mask:
            out.append(f"{self.num_no_mask} of {self.num_samples} samples had no loss mask: "
                       f"exported with {self._no_mask_ones()}")
        if self.num_nonfinite:
            out.append(f"{self.num_nonfinite} sample{'s' * (self.num_nonfinite != 1)} flagged NaN/Inf at capture "
                       "(--nonfinite store) left out")
        if self.num_ineligible:
            why = LAYOUTS[self.plan.fmt].ineligible
            out.append(f"{self.num_ineligible} sample{'s' * (self.num_ineligible != 1)} left out: {why}")
        if self.num_with_images:
            out.append(f"{self.num_with_images} sample{'s' * (self.num_with_images != 1)} with images: loss mask 0 on "
                       f"their {self.num_image_tokens} image tokens{self.images_note}")
        out.append(LAYOUTS[self.plan.fmt].draft_note(self.plan.aux_layers))
        return out

    def _no_mask_ones(self) -> str:
        """What a sample without a mask was exported with: all ones, but 0 on its image tokens."""
        if not self.num_no_mask_with_images:
            return "all ones (every token trained on)"
        tokens = f"{self.num_no_mask_image_tokens} image token{'s' * (self.num_no_mask_image_tokens != 1)}"
        if self.num_no_mask_with_images == self.num_no_mask:
            return f"all ones except their {tokens}"
        return (f"all ones (every token trained on) except the {tokens} of the {self.num_no_mask_with_images} "
                "with images")
