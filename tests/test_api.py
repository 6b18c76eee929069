"""The public Python API: what `import corecap` offers, typed; the combinations a RunConfig
refuses itself (for `corecap.capture` as for the CLI); one capture at a time per process."""

from __future__ import annotations

import pathlib
import threading

import pytest

import corecap
from corecap.config import build


def test_the_public_names_are_in_all_and_load():
    assert sorted(corecap.__all__) == [
        "Client", "CorecapError", "ServerDataset", "StoreDataset", "__version__", "capture", "open_store",
    ]
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


def _script(tmp_path, body: str):
    import subprocess
    import sys
    import textwrap

    path = tmp_path / "capture_script.py"
    path.write_text(textwrap.dedent(body))
    return subprocess.run([sys.executable, str(path)], cwd=tmp_path, capture_output=True, text=True, timeout=120)


def test_capture_at_a_scripts_top_level_is_refused_before_anything_starts(tmp_path):
    result = _script(tmp_path, """
        import corecap

        corecap.capture(store="out.lmdb", max_tokens=4)
    """)
    assert result.returncode != 0
    last = result.stderr.strip().splitlines()[-1]
    script = tmp_path / "capture_script.py"
    assert last == (f"corecap.errors.CorecapError: corecap.capture() at the top level of {script}: "
                    "vLLM's workers re-run the script when they start; put the call under "
                    '`if __name__ == "__main__":`'), result.stderr
    assert "vllm" not in result.stderr.lower().replace("vllm's workers", "")  # refused before vLLM's import
    assert not (tmp_path / "out.lmdb").exists()


def test_capture_in_a_function_called_unguarded_is_refused_and_a_guarded_call_is_not(tmp_path):
    unguarded = _script(tmp_path, """
        import corecap

        def main():
            corecap.capture(store="out.lmdb")

        main()
    """)
    assert 'put the call under `if __name__ == "__main__":`' in unguarded.stderr.splitlines()[-1]
    guarded = _script(tmp_path, """
        import corecap

        if __name__ == "__main__":
            corecap.capture(store="out.lmdb", tensor_paralel_size=2)
    """)
    assert guarded.returncode != 0
    assert guarded.stderr.strip().splitlines()[-1].endswith(
        "option 'tensor_paralel_size': neither one of corecap's options nor one of vLLM's engine arguments; "
        "did you mean tensor_parallel_size?"), guarded.stderr


def test_a_spawned_child_rerunning_an_unguarded_script_says_to_add_the_guard(tmp_path):
    """What vLLM's spawned workers and corecap's sink would meet: multiprocessing's spawn re-runs
    the script as __mp_main__; the capture() there refuses with the guard message."""
    result = _script(tmp_path, """
        import multiprocessing
        import corecap

        def nothing():
            pass

        if __name__ == "__main__":
            child = multiprocessing.get_context("spawn").Process(target=nothing)
            child.start()
            child.join()
            print("child exit", child.exitcode)
        else:
            corecap.capture(store="out.lmdb")
    """)
    assert "child exit 1" in result.stdout, result.stderr
    assert "CorecapError: corecap.capture() at the top level of" in result.stderr
    assert 'put the call under `if __name__ == "__main__":`' in result.stderr
    assert not (tmp_path / "out.lmdb").exists()


def test_a_misspelt_option_is_refused_with_the_closest_names():
    from corecap.config import UnknownOption

    for typo, meant in (("tensor_parallel", "tensor_parallel_size"), ("max_token", "max_tokens"),
                        ("layer", "layers"), ("enforce_eagr", "enforce_eager"), ("block_sise", "block_size")):
        with pytest.raises(UnknownOption, match=f"option {typo!r}: .*did you mean .*{meant}"):
            corecap.capture(store="never-made.lmdb", **{typo: 1})
    with pytest.raises(TypeError, match="option 'zzzqqq': neither one of corecap's options nor one of vLLM's engine "
                       "arguments$"):
        corecap.capture(zzzqqq=1)
    assert not pathlib.Path("never-made.lmdb").exists()


def test_capture_shows_every_option_with_its_type_and_default():
    import dataclasses
    import inspect

    from corecap.config import EngineOptions, RunConfig, SamplingOptions

    params = inspect.signature(corecap.capture).parameters
    for cls in (RunConfig, EngineOptions, SamplingOptions):
        for f in dataclasses.fields(cls):
            if f.name in ("engine", "sampling", "extra"):
                continue
            assert f.name in params, f.name
            assert params[f.name].kind is inspect.Parameter.KEYWORD_ONLY
    assert params["max_tokens"].default == 0 and params["store"].default == "corecap.lmdb"
    assert params["tensor_parallel_size"].annotation == "int"
    assert params["stop"].annotation == "Stop | None"  # capture's own; SamplingOptions.stop strings pass through it
    assert "tensor_parallel_size" in corecap.capture.__doc__ and "max_tokens" in corecap.capture.__doc__
