"""The primitives corecap's contract checks (corecap/_vllm/contract.py, live.py) are written in:
a signature against the keywords corecap passes, a method that must be there, the names missing
from a set, the first problem of several. Each returns None or one sentence saying what moved."""

from __future__ import annotations

import ast

from corecap._vllm.vllm_source import ClassView, Method


class Note(str):
    """A check's return value when the contract holds but there is something to say."""


class Gone(Exception):
    """A method corecap calls is no longer there."""


def signature_problem(label: str, fn: Method, passed: set[str]) -> str | None:
    """What a call of `fn` with keywords `passed` would trip on: a name it no longer accepts, or a
    parameter it now requires that corecap does not pass."""
    params = {p.name: p for p in fn.params()}
    if any(p.kind == "**kwargs" for p in params.values()):
        return None
    gone = sorted(passed - set(params))
    if gone:
        return f"{label}() no longer accepts {', '.join(gone)}"
    new = [n for n, p in params.items() if n not in passed and p.required]
    return f"{label}() now requires {', '.join(new)}" if new else None


def method_of(cls: ClassView, name: str, label: str | None = None) -> Method:
    fn = cls.method(name)
    if fn is None:
        raise Gone(f"{label or cls.name}.{name} is gone")
    return fn


def lacks(label: str, wanted: set[str], have: set[str]) -> str | None:
    """'LABEL X, Y' for the names in `wanted` missing from `have`, else None."""
    gone = sorted(wanted - have)
    return f"{label} {', '.join(gone)}" if gone else None


def first(*problems) -> str | None:
    return next((p for p in problems if p), None)


def using(cls: ClassView, name: str) -> list[Method]:
    """The methods of `cls`'s vLLM worker classes whose code names `name`."""
    return [
        m for c in cls.mro() if c.module.startswith("vllm.v1.worker")
        for m in c.methods() if name in m.names()
    ]


def slice_writes(fn: Method, attr: str, unless: str) -> list[set[str]]:
    """The names each `self.attr[...] = value` in `fn` reads in its value, leaving out the writes
    under an `if` whose test names `unless` (a write some models skip)."""
    found: list[set[str]] = []

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and unless in {n.attr if isinstance(n, ast.Attribute) else getattr(n, "id", "")
                                                   for n in ast.walk(node.test)}:
            return
        if isinstance(node, ast.Assign) and any(
                isinstance(t, ast.Subscript) and isinstance(t.value, ast.Attribute) and t.value.attr == attr
                and isinstance(t.value.value, ast.Name) and t.value.value.id == "self" for t in node.targets):
            found.append({n.attr if isinstance(n, ast.Attribute) else n.id for n in ast.walk(node.value)
                          if isinstance(n, (ast.Attribute, ast.Name))})
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(fn.node)
    return found
