"""The public Python API: what `import corecap` offers, typed; the combinations a RunConfig
refuses itself (for `corecap.capture` as for the CLI); one capture at a time per process."""

from __future__ import annotations

import pathlib
import threading

import pytest

import corecap
from corecap.config import build


def test_the_public_names_are_in_all_and_load():
    assert sorted(corecap.__all__) == ["CorecapError", "StoreDataset", "__version__", "capture", "open_store"]
    for name in corecap.__all__:
        assert getattr(corecap, name) is not None
    assert (pathlib.Path(corecap.__file__).parent / "py.typed").exists()
    with pytest.raises(AttributeError):
        corecap.no_such_thing  # noqa: B018


def test_open_store_reads_a_store_by_key(tmp_path, captured, verifier):
    from support.verifier import write_captured_store

    path = write_captured_store(str(tmp_path / "s"), captured, verifier)
    with corecap.open_store(path) as store:
        assert sorted(store.keys()) == sorted(captured)
        key = sorted(captured)[0]
        assert store.get(key).input_ids.tolist() == captured[key][0].tolist()
    with pytest.raises(corecap.CorecapError, match="not a corecap store"):
        corecap.open_store(str(tmp_path))


def test_a_config_refuses_what_cannot_work_before_any_run():
    with pytest.raises(corecap.CorecapError, match="--nonfinite store and --store-dtype fp8 exclude each other"):
        build(codec="fp8-e4m3-rowscale", nonfinite="store")
    with pytest.raises(corecap.CorecapError, match="--nonfinite store and --store-dtype fp8 exclude each other"):
        corecap.capture(codec="fp8-e4m3-rowscale", nonfinite="store")


def test_a_second_capture_in_the_process_is_refused_while_one_runs():
    from corecap._vllm import environment

    inside, release, seen = threading.Event(), threading.Event(), []

    def first():
        with environment():
            inside.set()
            release.wait(30)

    t = threading.Thread(target=first)
    t.start()
    assert inside.wait(30)
    try:
        with pytest.raises(corecap.CorecapError, match="another capture is running in this process"):
            with environment():
                seen.append("entered")
    finally:
        release.set()
        t.join(30)
    assert not seen
    with environment():  # once the first is done, the next one runs
        seen.append("after")
    assert seen == ["after"]
