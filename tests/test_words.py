"""README, docs, code, tests, tools, examples and CI speak to a user on their own machine: no
measurement diary (which run, which lab host, which engineer) anywhere in the project. A number a
comment needs points to a benchmark by its topic (docs/benchmarks.md, "Capture"), never to the
run that measured it. Each hit is reported as FILE:LINE with the words found."""

from __future__ import annotations

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parent.parent
SCANNED = ["README.md", "CHANGELOG.md", "docs", "corecap", "tests", "tools", "examples", ".ci"]
SUFFIXES = {".md", ".py", ".sh", ".toml", ".yml", ".yaml", ".txt", ".cfg", ".c", ""}

_ORDINALS = "first|second|third|fourth|fifth|sixth|seventh|eighth|ninth|tenth|eleventh|twelfth"
_S = "sess" + "ion"  # spelled in two parts so that this file's own patterns do not match themselves
DIARY = [
    re.compile(rf"\b({_ORDINALS}) {_S}\b", re.I),
    re.compile(r"\bcalls? \d+", re.I),
    re.compile(r"\bleases?\b", re.I),
    re.compile(r"\blent\b", re.I),
    re.compile(r"\bthis " + "machine" + r"\b", re.I),
    re.compile(r"\banother " + "engineer", re.I),
    re.compile(r"\bdevice " + "time" + r"\b", re.I),
    re.compile(rf"\b{_S}s?\b", re.I),
]
# The word's legitimate uses: pytest's and an HTTP client's.
ALLOWED = re.compile("|".join([
    # pytest's session, an HTTP client's, and a POSIX process's (setsid)
    rf"scope=['\"]{_S}['\"]", rf"(pytest|test) {_S}", rf"pytest_{_S}\w*", rf"\({_S}\)", rf"{_S}(start|finish)",
    rf"(requests|aiohttp|http|client)\W*{_S}", rf"\b{_S}(_\w+|\.\w+)", rf"own {_S}s?\b", rf"new {_S}\b",
    # the sink's buffer pool and the dataset's slot holds: code names
    r"\.lent\b", r"buffer lent by this pool", r"for lease in", r"\blease\.",
    # a user's own machine, in the messages corecap prints there
    r"this machine gives", r"on this machine \(vLLM", r"this machine does not allow", r"else \"this machine\"",
]), re.I)


def _files():
    for name in SCANNED:
        path = ROOT / name
        if path.is_file():
            yield path
        elif path.is_dir():
            for file in sorted(path.rglob("*")):
                if file.is_file() and file.suffix in SUFFIXES and "__pycache__" not in file.parts:
                    yield file


def diary_hits() -> list[str]:
    hits = []
    for file in _files():
        if file == pathlib.Path(__file__).resolve():
            continue
        try:
            lines = file.read_text().splitlines()
        except UnicodeDecodeError:
            continue
        for number, line in enumerate(lines, 1):
            cleaned = ALLOWED.sub("", line)
            found = [m.group(0) for pattern in DIARY for m in pattern.finditer(cleaned)]
            if found:
                hits.append(f"{file.relative_to(ROOT)}:{number}: {', '.join(found)}")
    return hits


def test_no_measurement_diary_in_the_project():
    hits = diary_hits()
    assert not hits, (f"{len(hits)} lines read as a measurement diary; say what holds for a user, and point "
                      "to a benchmark by its topic:\n" + "\n".join(hits))


def test_the_word_check_finds_diary_words():
    fifth = "fifth " + _S
    samples = [f"measured in the {fifth}", "see calls 8-11", "in the same lease", "the lent GPU",
               "on " + "this machine", "another " + "engineer ran", "no device " + "time left", f"the {_S}'s figures"]
    for sample in samples:
        assert any(p.search(ALLOWED.sub("", sample)) for p in DIARY), sample
    for fine in [f'@pytest.fixture(scope="{_S}")', f"requests.{_S.capitalize()}()", f"def pytest_{_S}finish(",
                 "one HTTP request"]:
        assert not any(p.search(ALLOWED.sub("", fine)) for p in DIARY), fine
