"""The codebase's shape, as docs/design.md draws it: imports run one way (no circle anywhere),
only the adapter imports vLLM, only the CLI knows click, nothing in the package reads a
CORECAP_* switch but the cache location, and files stay a few screens long."""

from __future__ import annotations

import ast
import pathlib

PACKAGE = pathlib.Path(__file__).parents[1] / "corecap"
MAX_LINES = 400


def _modules() -> dict[str, pathlib.Path]:
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


def _imports(path: pathlib.Path, modules: dict) -> set[str]:
    """corecap modules that `path` imports, at module level or inside functions alike."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("corecap"))
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("corecap"):
            for alias in node.names:
                full = f"{node.module}.{alias.name}"
                found.add(full if full in modules else node.module)
    return found


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    # The root package is a facade: its lazy attributes (corecap.capture) import on first use,
    # never while another module is being imported, so its own imports are no edges.
    return {
        name: {m for m in _imports(path, modules) if m in modules and m != name} if name != "corecap" else set()
        for name, path in modules.items()
    }


def test_no_import_circle():
    graph = _graph()
    state: dict[str, int] = {}
    path: list[str] = []
    circles = []

    def visit(node: str) -> None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                circles.append(" -> ".join(path[path.index(nxt):] + [nxt]))
            elif nxt not in state:
                visit(nxt)
        path.pop()
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node)
    assert not circles, "\n".join(circles)


def test_layers_import_downwards():
    """cli → api → run → the adapter, the sink, the data → transport → export, training → store → trace → progress
    → config."""
    order = ["corecap.__main__", "corecap.cli", "corecap.api", "corecap.logs", "corecap.serve", "corecap.client",
             "corecap.probe",
             "corecap.run",
             "corecap.plan", "corecap.resume",
             "corecap.summary", "corecap.generation", "corecap._vllm", "corecap.sink", "corecap.data", "corecap.model",
             "corecap.checkpoint", "corecap.quantization", "corecap.demo", "corecap.console", "corecap.transport",
             "corecap.export", "corecap.training", "corecap.store", "corecap.writer_lock", "corecap.trace",
             "corecap.progress", "corecap.process_end", "corecap.dtypes", "corecap.config", "corecap.errors"]

    def rank(module: str) -> int:
        return max(i for i, prefix in enumerate(order) if module == prefix or module.startswith(prefix + "."))

    upward = [
        f"{a} imports {b}" for a, targets in _graph().items() if a != "corecap"
        for b in targets if b != "corecap" and rank(b) < rank(a)
    ]
    assert not upward, "\n".join(upward)


def test_the_wire_knows_no_store_and_the_adapter_no_sink():
    """Beside the order above: the wire format (corecap/transport/) and the store share only
    corecap/dtypes.py, so neither can change the other's bytes by accident; the adapter
    (corecap/_vllm/) and the sink share what they both need through corecap/transport/."""
    apart = {"corecap.transport": "corecap.store", "corecap._vllm": "corecap.sink"}

    def within(module: str, package: str) -> bool:
        return module == package or module.startswith(package + ".")

    crossing = [
        f"{a} imports {b}" for a, targets in _graph().items() for b in targets
        for low, high in apart.items() if within(a, low) and within(b, high)
    ]
    assert not crossing, "\n".join(crossing)


def _text(path: pathlib.Path) -> str:
    return path.read_text()


def test_only_the_adapter_imports_vllm_and_only_the_cli_click():
    for name, path in _modules().items():
        tree = ast.parse(_text(path))
        imported = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        imported |= {n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
        if not name.startswith("corecap._vllm"):
            assert "vllm" not in imported, f"{path} imports vllm: only corecap/_vllm/ may"
        if name != "corecap.cli" and not name.startswith("corecap.cli."):
            assert "click" not in imported, f"{path} imports click: only corecap/cli/ may"


def test_no_environment_switches_in_the_package():
    """Test hooks and experiment switches go through the config (config.TestHooks), not CORECAP_*
    variables read deep inside; the cache location is the one user setting read from there. The
    one other name is no switch: the driver sets it around starting vLLM's workers, which inherit
    where to record their start-up errors before any corecap code runs in them (_vllm/worker_errors.py)."""
    allowed = {"CORECAP_CACHE", "CORECAP_WORKER_ERRORS"}
    for path in _modules().values():
        for node in ast.walk(ast.parse(_text(path))):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.startswith("CORECAP_"):
                assert node.value in allowed, f"{path}: reads {node.value}"


def test_files_fit_on_a_few_screens():
    long = {str(p.relative_to(PACKAGE.parent)): n for p in _modules().values()
            if (n := len(_text(p).splitlines())) > MAX_LINES}
    assert not long, f"longer than {MAX_LINES} lines: {long}"


TESTS = pathlib.Path(__file__).parent


def test_no_test_module_imports_another():
    """What tests share is in tests/support/ (README "Tests"): no test module, support module or
    conftest imports a test module or conftest, and support/ holds no tests."""
    found = []
    for path in sorted(TESTS.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            else:
                continue
            bad = [n for n in names if n.split(".")[0].startswith("test_") or n == "conftest"]
            found += [f"{path.relative_to(TESTS)} imports {n}" for n in bad]
    found += [f"{p.relative_to(TESTS)} is a test module inside support/" for p in (TESTS / "support").glob("test_*.py")]
    assert not found, "\n".join(found)


def test_design_md_maps_every_module():
    """docs/design.md's "Where things are" names every module file (a package's __init__ only
    where it holds code of its own), and nothing that is not there."""
    design = (PACKAGE.parent / "docs" / "design.md").read_text()
    table = design[design.index("## Where things are"):design.index("## The step loop")]
    named = set()
    for line in table.splitlines():
        cells = line.split("|")
        if len(cells) > 3:
            named.update(c.strip(" `") for c in cells[2].split(",") if c.strip(" `").endswith(".py"))
    files = {str(p.relative_to(PACKAGE)) for p in PACKAGE.rglob("*.py")}
    assert not named - files, f"docs/design.md names modules that do not exist: {sorted(named - files)}"
    unnamed = {f for f in files - named if not f.endswith("__init__.py") or f == "training/__init__.py"}
    assert not unnamed, f"docs/design.md's module table lacks {sorted(unnamed)}"


def test_no_module_shadows_the_standard_library():
    """A module file named like a stdlib module (profile.py was one) is imported instead of it by
    any script run from its directory."""
    import sys

    shadows = [str(p.relative_to(PACKAGE)) for p in PACKAGE.rglob("*.py") if p.stem in sys.stdlib_module_names]
    assert not shadows, f"named like stdlib modules: {shadows}"
