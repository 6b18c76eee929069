"""corecap/logs.py: a Python caller's capture logs through `logging` (the `corecap` logger, shown
on stderr while logging is not configured), with vLLM's logger at errors only, here and in its workers
(VLLM_LOGGING_LEVEL), and both put back afterwards; the CLI's `log=` leaves vLLM's logging alone."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import textwrap

from corecap.logs import api_logging


def test_corecap_lines_go_to_the_corecap_logger_and_vllm_is_quiet_for_the_run():
    """In a fresh interpreter, as a script's user has it: logging not configured."""
    script = textwrap.dedent("""
        import logging, os
        from corecap.logs import api_logging
        os.environ.pop("VLLM_LOGGING_LEVEL", None)
        with api_logging() as say:
            say("capturing 3 samples")
            print(os.environ["VLLM_LOGGING_LEVEL"], logging.getLogger("vllm").getEffectiveLevel())
        logger = logging.getLogger("corecap")
        print("VLLM_LOGGING_LEVEL" in os.environ, logger.handlers, logger.level)
    """)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert result.stderr == "capturing 3 samples\n"
    assert result.stdout.splitlines() == [f"ERROR {logging.ERROR}", "False [] 0"]


def test_a_configured_logger_gets_the_lines_and_a_users_vllm_level_stands(monkeypatch, caplog, capsys):
    monkeypatch.setenv("VLLM_LOGGING_LEVEL", "DEBUG")
    with caplog.at_level(logging.INFO, logger="corecap"), api_logging() as say:
        say("states to the store: shared-memory ring on")
        assert os.environ["VLLM_LOGGING_LEVEL"] == "DEBUG"
    seen = [(r.name, r.getMessage()) for r in caplog.records]
    assert seen == [("corecap", "states to the store: shared-memory ring on")]
    assert capsys.readouterr().err == ""  # the user's handler has them, not a second one of corecap's


def test_a_log_function_takes_the_lines_and_leaves_vllms_logging_as_it_is(monkeypatch):
    monkeypatch.delenv("VLLM_LOGGING_LEVEL", raising=False)
    lines = []
    with api_logging(lines.append) as say:
        say("one")
        assert "VLLM_LOGGING_LEVEL" not in os.environ
    assert lines == ["one"]
