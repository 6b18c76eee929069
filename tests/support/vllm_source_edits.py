"""Modified copies of the installed vLLM's source, as a new release would change it: what
tests/test_contract.py fakes a moved contract with for the checks made on vLLM's source
(corecap/_vllm/contract.py). Each edit is (module, text → text); `moved` writes the edited
modules to a directory and returns a Source that reads them instead of the installed ones."""

from __future__ import annotations

import ast
import textwrap

from corecap._vllm.vllm_source import Source


def _class(tree: ast.Module, name: str) -> ast.ClassDef:
    return next(n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == name)


def _first_line(node) -> int:
    return min([node.lineno] + [d.lineno for d in getattr(node, "decorator_list", [])])


def member(qualname: str, name: str, new: str | None = None):
    """An edit of class `qualname`'s member `name` (its methods of that name, or a field):
    removed (`new` None), replaced by `new`, or `new` added at the class's end."""
    module, _, cls_name = qualname.rpartition(".")

    def edit(text: str) -> str:
        cls, lines = _class(ast.parse(text), cls_name), text.splitlines(keepends=True)
        found = [n for n in cls.body
                 if getattr(n, "name", None) == name or getattr(getattr(n, "target", None), "id", None) == name]
        added = textwrap.indent(textwrap.dedent(new), " " * cls.body[-1].col_offset) + "\n" if new else ""
        if not found:
            return "".join(lines[: cls.end_lineno] + [added] + lines[cls.end_lineno :])
        for n in reversed(found):
            del lines[_first_line(n) - 1 : n.end_lineno]
        at = _first_line(found[0]) - 1
        return "".join(lines[:at] + [added] + lines[at:])

    return module, edit


def parameter(qualname: str, method: str, name: str, add: bool = False):
    """An edit of a method's parameter `name` (one a line, as vLLM's formatter writes them):
    removed, or added as a new required one after `self`."""
    module, _, cls_name = qualname.rpartition(".")

    def edit(text: str) -> str:
        lines = text.splitlines(keepends=True)
        fn = next(n for n in _class(ast.parse(text), cls_name).body if getattr(n, "name", None) == method)
        args = fn.args.posonlyargs + fn.args.args + fn.args.kwonlyargs
        if add:
            first = args[0]
            lines.insert(first.lineno, " " * first.col_offset + f"{name},\n")
        else:
            arg = next(a for a in args if a.arg == name)
            positional = fn.args.posonlyargs + fn.args.args
            defaults = list(zip(positional[len(positional) - len(fn.args.defaults):], fn.args.defaults))
            default = dict((a.arg, d)
                           for a, d in defaults + list(zip(fn.args.kwonlyargs, fn.args.kw_defaults))).get(name)
            end = max(arg.end_lineno, default.end_lineno if default is not None else 0)
            del lines[arg.lineno - 1 : end]
        return "".join(lines)

    return module, edit


def replace_text(module: str, old: str, new: str):
    def edit(text: str) -> str:
        assert old in text, f"{module}: {old!r}"
        return text.replace(old, new)

    return module, edit


def moved(tmp_path, *edits) -> Source:
    """The installed vLLM's source with `edits` made, each module a modified copy in tmp_path."""
    real = Source()
    texts: dict[str, str] = {}
    for module, edit in edits:
        texts[module] = edit(texts.get(module) or real.module(module)[0])
    replaced = {}
    for module, text in texts.items():
        replaced[module] = str(tmp_path / f"{module}.py")
        with open(replaced[module], "w") as f:
            f.write(text)
    return Source(real.root, replaced)
