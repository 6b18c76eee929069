"""vLLM's installed source, read with `ast` and never imported: what `corecap doctor` checks
corecap's contract against without the cost of importing vLLM (torch, Inductor, transformers,
...; measured: docs/versions.md, "How long doctor takes").

`Source` finds the installed `vllm` package by `importlib.util.find_spec("vllm")`, which runs
none of its code, and parses a module's file the first time a check asks for it. A class is
named by its qualified name (`vllm.v1.request.Request`); its bases are followed through the
`from X import Y` and relative imports of the module that names them, into other vLLM modules,
so that a method or field is found where Python would find it. A base outside vLLM
(`msgspec.Struct`, `NamedTuple`, `nn.Module`) ends the walk and is kept by name only.

What this cannot see: anything vLLM computes at import time (a class made by a function, a
method added by a decorator, an attribute set by `setattr`). corecap's contract names none of
those; what needs vLLM's objects (the aux-state semantics, the engine configuration vLLM
builds) is checked live (corecap/_vllm/live.py).
"""

from __future__ import annotations

import ast
import importlib.util
import os
from dataclasses import dataclass

from corecap.errors import CorecapError


# CPython 3.11.7 (CI's and the kit's Python) keeps one recursion counter per interpreter while
# it builds an AST's objects: where another thread's parse runs in between, the counter is off at
# the end and ast.parse raises this SystemError although the source is fine (python/cpython
# gh-106905; its fix, GH-113035, keeps a counter per call). Seen 2026-12-06 with four pytests side
# by side on the AMX CPU: a run's contract check said "the installed vLLM does not fit corecap:
# ... SystemError: AST constructor recursion depth mismatch (before=156, after=176)". Parsing
# again gives the tree.
_AST_RACE = "AST constructor recursion depth mismatch"
AST_RACE_ATTEMPTS = 5


def parse(text: str, filename: str = "<unknown>") -> ast.Module:
    """ast.parse, again where CPython's AST-depth race (above) failed it."""
    for _ in range(AST_RACE_ATTEMPTS - 1):
        try:
            return ast.parse(text, filename)
        except SystemError as e:
            if not str(e).startswith(_AST_RACE):
                raise
    return ast.parse(text, filename)


class SourceMissing(Exception):
    """A module or class corecap's contract names is not in the installed vLLM's source."""


def package_dir() -> str:
    """The directory of the `vllm` package Python would import (its code is not run)."""
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        raise CorecapError("vLLM is not installed (pip install corecap[cpu] or corecap[cuda])")
    return list(spec.submodule_search_locations)[0]


class Source:
    """The installed vLLM's modules, parsed on first use. `replaced`: module name → the file to
    read instead (a test's modified copy of a vLLM module, as a new release would change it)."""

    def __init__(self, root: str | None = None, replaced: dict[str, str] | None = None):
        self.root = root or package_dir()
        self.replaced = dict(replaced or {})
        self._modules: dict[str, tuple[str, ast.Module]] = {}

    def path(self, module: str) -> str | None:
        if module in self.replaced:
            return self.replaced[module]
        if module != "vllm" and not module.startswith("vllm."):
            return None
        parts = module.split(".")[1:]
        base = os.path.join(self.root, *parts)
        for candidate in (base + ".py", os.path.join(base, "__init__.py")):
            if os.path.isfile(candidate):
                return candidate
        return None

    def is_package(self, module: str) -> bool:
        return os.path.isfile(os.path.join(self.root, *module.split(".")[1:], "__init__.py"))

    def module(self, module: str) -> tuple[str, ast.Module]:
        """(text, tree) of a vLLM module."""
        if module not in self._modules:
            path = self.path(module)
            if path is None:
                raise SourceMissing(f"{module} is gone")
            with open(path, encoding="utf-8") as f:
                text = f.read()
            self._modules[module] = (text, parse(text, path))
        return self._modules[module]

    def files_read(self) -> list[str]:
        """The files of the modules parsed so far (what a check's verdict depends on)."""
        return [self.path(module) for module in self._modules]

    def cls(self, qualname: str) -> ClassView:
        module, _, name = qualname.rpartition(".")
        found = self._resolve(module, name)
        if not isinstance(found, ClassView):
            raise SourceMissing(f"{qualname} is not a class in vLLM's source")
        return found

    def dict_entries(self, module: str, name: str) -> list:
        """A module-level dict literal `NAME = {...}` (a registry): (key, value node) for each
        `"key": value`, and the name of each `**OTHER` spread into it, in order."""
        for node in _top_level(self.module(module)[1].body):
            targets = (node.targets if isinstance(node, ast.Assign)
                       else [node.target] if isinstance(node, ast.AnnAssign) else [])
            if any(isinstance(t, ast.Name) and t.id == name for t in targets) and isinstance(node.value, ast.Dict):
                return [
                    v.id if k is None else (k.value, v) for k, v in zip(node.value.keys, node.value.values)
                    if (k is None and isinstance(v, ast.Name)) or isinstance(k, ast.Constant)
                ]
        raise SourceMissing(f"{module}.{name} is gone")

    def imported_modules(self, module: str) -> set[str]:
        """Every module an `import` or `from X import` of `module` names, its functions' included
        (a runner the worker imports where it builds it), as absolute names."""
        out = set()
        for node in ast.walk(self.module(module)[1]):
            if isinstance(node, ast.ImportFrom):
                out.add(_absolute(module, node, self.is_package(module)))
            elif isinstance(node, ast.Import):
                out |= {alias.name for alias in node.names}
        return out

    def assignments(self, module: str, attr: str) -> list[str]:
        """The strings a module assigns to `X.attr` (`parallel_config.worker_cls = "..."`)."""
        return [
            n.value.value for n in ast.walk(self.module(module)[1])
            if isinstance(n, ast.Assign) and isinstance(n.value, ast.Constant) and isinstance(n.value.value, str)
            and any(isinstance(t, ast.Attribute) and t.attr == attr for t in n.targets)
        ]

    def _resolve(self, module: str, name: str, depth: int = 0) -> ClassView | str:
        """The class `name` means in `module`, or the dotted name of something outside vLLM."""
        if self.path(module) is None:
            return f"{module}.{name}"
        if depth > 20:
            raise SourceMissing(f"{module}.{name}: an import cycle")
        tree = self.module(module)[1]
        for node in _top_level(tree.body):
            if isinstance(node, ast.ClassDef) and node.name == name:
                return ClassView(self, module, node)
        for node in _top_level(tree.body):
            if isinstance(node, ast.ImportFrom):
                for alias in node.names:
                    if (alias.asname or alias.name) == name:
                        return self._resolve(_absolute(module, node, self.is_package(module)), alias.name, depth + 1)
            elif isinstance(node, ast.Assign) and isinstance(node.value, ast.Name):  # Alias = Original
                if any(isinstance(t, ast.Name) and t.id == name for t in node.targets):
                    return self._resolve(module, node.value.id, depth + 1)
        raise SourceMissing(f"{module}.{name} is gone")

    def resolve_expr(self, module: str, expr: ast.expr) -> ClassView | str:
        """What a base-class expression in `module` names (`Base`, `mod.Base`, `Generic[T]`)."""
        if isinstance(expr, ast.Subscript):
            expr = expr.value
        if isinstance(expr, ast.Name):
            try:
                return self._resolve(module, expr.id)
            except SourceMissing:
                return expr.id  # a builtin (object, str), or a name this reader cannot follow: kept by name
        dotted = ast.unparse(expr)
        head, _, attr = dotted.rpartition(".")
        for node in _top_level(self.module(module)[1].body):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    if (alias.asname or alias.name) == head:
                        return self._resolve(alias.name, attr)
            if isinstance(node, ast.ImportFrom) and any((a.asname or a.name) == head for a in node.names):
                pkg = _absolute(module, node, self.is_package(module))
                real = next(a.name for a in node.names if (a.asname or a.name) == head)
                return self._resolve(f"{pkg}.{real}", attr)
        return dotted


def _absolute(module: str, node: ast.ImportFrom, is_package: bool) -> str:
    if not node.level:
        return node.module or ""
    package = module if is_package else module.rpartition(".")[0]
    for _ in range(node.level - 1):
        package = package.rpartition(".")[0]
    return f"{package}.{node.module}" if node.module else package


def _top_level(body: list) -> list:
    """Statements of a module or class body, with those under `if`/`try` (TYPE_CHECKING, fallbacks)."""
    out = []
    for node in body:
        out.append(node)
        if isinstance(node, ast.If):
            out += _top_level(node.body) + _top_level(node.orelse)
        elif isinstance(node, ast.Try):
            out += (_top_level(node.body) + _top_level(node.orelse)
                    + [n for h in node.handlers for n in _top_level(h.body)])
    return out


@dataclass(frozen=True)
class Param:
    name: str
    kind: str  # "positional", "keyword", "*args", "**kwargs"
    required: bool


@dataclass(eq=False)
class ClassView:
    source: Source
    module: str
    node: ast.ClassDef

    @property
    def name(self) -> str:
        return self.node.name

    @property
    def qualname(self) -> str:
        return f"{self.module}.{self.name}"

    def bases(self) -> list:
        """Each base: a ClassView (in vLLM's source) or a dotted name (outside it)."""
        return [self.source.resolve_expr(self.module, b) for b in self.node.bases]

    def mro(self) -> list[ClassView]:
        """This class and its vLLM bases, depth first, each once (Python's order for the single
        and mixin inheritance vLLM uses)."""
        out: list[ClassView] = []

        def visit(c: ClassView) -> None:
            if all(c.qualname != o.qualname for o in out):
                out.append(c)
                for b in c.bases():
                    if isinstance(b, ClassView):
                        visit(b)

        visit(self)
        return out

    def outside_bases(self) -> set[str]:
        """The names of every base outside vLLM, over the whole hierarchy."""
        return {b.rpartition(".")[2] for c in self.mro() for b in c.bases() if isinstance(b, str)}

    def own(self, name: str) -> Method | None:
        """Its own method `name`: the last definition, as Python binds it (after `@overload`s)."""
        found = [n for n in _top_level(self.node.body)
                 if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name == name]
        return Method(self, found[-1]) if found else None

    def method(self, name: str) -> Method | None:
        """`name` as an instance would find it: this class's, or the first base's that has it."""
        return next((m for c in self.mro() if (m := c.own(name)) is not None), None)

    def methods(self) -> list[Method]:
        """Its own methods (nested ones included in each's code)."""
        return [Method(self, n) for n in _top_level(self.node.body)
                if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]

    def self_attributes(self) -> set[str]:
        """Names X of every `self.X = ...` in its own methods."""
        return set().union(*(m.self_attributes() for m in self.methods()))

    def fields(self) -> set[str]:
        """Field names of a dataclass, msgspec.Struct or NamedTuple: the annotated names of its
        body and its bases' (ClassVar excluded)."""
        return {
            n.target.id for c in self.mro() for n in _top_level(c.node.body)
            if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)
            and "ClassVar" not in ast.unparse(n.annotation)
        }

    def has(self, name: str) -> bool:
        """Whether the class (or a base) defines `name`: a method, property, field or class attribute."""
        for c in self.mro():
            for n in _top_level(c.node.body):
                if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and n.name == name:
                    return True
                targets = n.targets if isinstance(n, ast.Assign) else [n.target] if isinstance(n, ast.AnnAssign) else []
                if any(isinstance(t, ast.Name) and t.id == name for t in targets):
                    return True
        return False

    def text(self) -> str:
        return _segment(self.source.module(self.module)[0], self.node)


@dataclass(eq=False)
class Method:
    owner: ClassView  # the class that defines it
    node: ast.FunctionDef | ast.AsyncFunctionDef

    @property
    def label(self) -> str:
        return f"{self.owner.name}.{self.node.name}"

    def params(self) -> list[Param]:
        a = self.node.args
        positional = a.posonlyargs + a.args
        num_required = len(positional) - len(a.defaults)
        out = [Param(p.arg, "positional", i < num_required) for i, p in enumerate(positional)]
        if a.vararg:
            out.append(Param(a.vararg.arg, "*args", False))
        out += [Param(p.arg, "keyword", d is None) for p, d in zip(a.kwonlyargs, a.kw_defaults)]
        if a.kwarg:
            out.append(Param(a.kwarg.arg, "**kwargs", False))
        return out

    def self_attributes(self) -> set[str]:
        """Names X of every `self.X = ...` in the method."""
        return {
            n.attr for n in ast.walk(self.node)
            if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id == "self"
            and isinstance(n.ctx, ast.Store)
        }

    def names(self) -> set[str]:
        """The names its code uses: globals, locals and attributes alike (a code object's co_names)."""
        return {n.id for n in ast.walk(self.node) if isinstance(n, ast.Name)} | {
            n.attr for n in ast.walk(self.node) if isinstance(n, ast.Attribute)
        }

    def calls(self, attr: str) -> list[ast.Call]:
        """Its calls of `X.attr(...)`."""
        return [n for n in ast.walk(self.node)
                if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr == attr]

    def text(self) -> str:
        return _segment(self.owner.source.module(self.owner.module)[0], self.node)


def _segment(text: str, node: ast.AST) -> str:
    lines = text.splitlines()
    first = min([node.lineno] + [d.lineno for d in getattr(node, "decorator_list", [])])
    return "\n".join(lines[first - 1 : node.end_lineno])


def vllm_engine_arg_names() -> set[str]:
    """vLLM's EngineArgs fields, read from its source without importing it (an empty set where
    no vLLM is installed: its names are then checked when the engine is configured)."""
    try:
        return set(Source().cls("vllm.engine.arg_utils.EngineArgs").fields())
    except Exception:  # no vLLM, or a layout this reader does not know: the adapter's check stands
        return set()
