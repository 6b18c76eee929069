"""The trainers' formats `corecap export --format` knows, by name. A new trainer is one module
beside these (its layout and what it needs from a store, as corecap/export/speculators.py has
them) and one line here.
"""

from __future__ import annotations

from corecap.export.deepspec import DeepSpec
from corecap.export.dflash import SpecForgeDFlash, SpecForgeDSpark
from corecap.export.modelopt import ModelOpt
from corecap.export.specforge import SpecForge
from corecap.export.speculators import Speculators

LAYOUTS = {
    "speculators": Speculators, "specforge": SpecForge, "modelopt": ModelOpt,
    "specforge-dflash": SpecForgeDFlash, "specforge-dspark": SpecForgeDSpark, "deepspec": DeepSpec,
}
FORMATS = tuple(LAYOUTS)
