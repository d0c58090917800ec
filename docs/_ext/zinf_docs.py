"""Sphinx extension: the reference pages of zinf_jax, generated from the code when the docs are built.

A page asks for a generated part with a marker line of its own (an HTML comment, so the Markdown file
reads fine anywhere)::

    <!-- zinf:generate NAME -->

and the ``source-read`` hook puts the part there. The parts (:data:`GENERATORS`):

* ``api``: every name in ``zinf_jax.__all__``, through autodoc;
* ``config``: every field of every config class (the dataclasses under ``zinf_jax/config/`` whose
  fields carry a check): key, type, default, accepted values, DeepSpeed key, docstring;
* ``deepspeed-keys``: the DeepSpeed keys the importer reads, from the importer's own table
  (``zinf_jax.config.deepspeed.KEY_TABLE`` when it has one, else the fields' ``ds`` metadata);
* ``cli``: ``zinf-jax --help`` and each command's help, from the argparse parsers;
* ``errors``: the error table of :mod:`zinf_jax.errors`;
* ``package-map``: each package's ``__init__`` docstring and every module's first docstring line;
* ``notes``: the ``[Note: ...]`` index: where each note is written and where it is cited;
* ``optax-table``: how each kind of optax transform splits and runs, from the engine's own proofs
  (:func:`zinf_jax.optim.optax_table.table_md`);
* ``bytes-per-param``: host RAM, disk at rest and disk traffic a step per parameter of each placement, from
  the estimator (:func:`zinf_jax.estimate.estimate_from_sizes`).

Checks that fail the build (``-W``) and that the tests in ``tests/docs/`` run too: :func:`api_problems`
(a public name without a documented entry), :func:`config_problems` (a config field without a
docstring), :func:`package_map_problems` (a module without a docstring to map it by) and
:func:`notes_problems` (a note cited but written nowhere). References to zinf_jax objects that no page documents are resolved to the documented
public name of the same object when there is one, else shown as code; a reference to a zinf_jax name
that does not exist stays a nitpicky warning.
"""
from __future__ import annotations

import argparse
import ast
import dataclasses
import importlib
import inspect
import io
import os
import pathlib
import pkgutil
import re
import textwrap
import types
from contextlib import redirect_stdout
from typing import Any, Callable

PACKAGE = "zinf_jax"
ROOT = pathlib.Path(__file__).resolve().parents[2]
SOURCE = ROOT / PACKAGE
MARKER = re.compile(r"^<!-- zinf:generate ([a-z][a-z-]*) -->[ \t]*$", re.M)


def _eval_rst(text: str) -> str:
    return "```{eval-rst}\n" + text.rstrip() + "\n```\n"


def _md(text: str, context: str | None = None) -> str:
    """A docstring's reST inline markup as MyST Markdown (one paragraph, for a definition or a cell).

    ``context``: the module the docstring is written in; relative targets of its roles are made absolute.
    """
    text = " ".join(line.strip() for line in text.strip().splitlines())

    def role(m: re.Match) -> str:
        target = m.group(2)
        if context and "<" not in target:
            found = _lookup(target, context)
            if found is not None:
                target = "~" + found[0]
        return f"{{py:{m.group(1)}}}`{target}`"

    text = re.sub(r":([a-z]+):`([^`]+)`", role, text)  # :class:`X` -> {py:class}`X`
    text = re.sub(r"(?<![`\w])``([^`]+)``(?![`\w])", r"`\1`", text)
    return text.replace("|", "\\|")


# --- API ------------------------------------------------------------------------------------------------

def public_names(module: Any = None) -> list[str]:
    """The public API: ``zinf_jax.__all__``."""
    module = module or importlib.import_module(PACKAGE)
    return list(module.__all__)


def _own_doc(obj: Any) -> str:
    """``obj``'s own docstring; empty when it has none (a dataclass's generated signature is none)."""
    doc = obj.__dict__.get("__doc__") if isinstance(obj, (type, types.ModuleType)) else getattr(obj, "__doc__", None)
    if isinstance(obj, type) and dataclasses.is_dataclass(obj) and isinstance(doc, str):
        try:
            generated = obj.__name__ + str(inspect.signature(obj)).replace(" -> None", "")
        except (TypeError, ValueError):
            generated = None
        if doc == generated:
            return ""
    return inspect.cleandoc(doc) if isinstance(doc, str) else ""


def _data_doc(module: Any, name: str) -> str:
    """The docstring written under a module-level constant (``X = ...`` then a string literal)."""
    where = [getattr(module, "_WHERE", {}).get(name, module.__name__)]
    if hasattr(module, "__path__"):  # a package re-exporting a submodule's constant: read it where it is written
        where += [m.__name__ for m in _submodules(module) if m.__dict__.get(name, where) is getattr(module, name, None)]
    for w in where:
        try:
            doc = _attr_docs(importlib.import_module(w)).get(name)
        except ImportError:
            continue
        if doc:
            return doc
    return ""


def _attr_docs(module: Any) -> dict[str, str]:
    """``name -> docstring`` of a module's constants, read from its source (no Sphinx needed)."""
    try:
        body = ast.parse(inspect.getsource(module)).body
    except (OSError, TypeError):
        return {}
    docs = {}
    for stmt, nxt in zip(body, body[1:]):
        targets = [stmt.target] if isinstance(stmt, ast.AnnAssign) else getattr(stmt, "targets", [])
        if (isinstance(stmt, (ast.Assign, ast.AnnAssign)) and isinstance(nxt, ast.Expr)
                and isinstance(nxt.value, ast.Constant) and isinstance(nxt.value.value, str)):
            docs.update({t.id: inspect.cleandoc(nxt.value.value) for t in targets if isinstance(t, ast.Name)})
    return docs


def _submodules(package: Any) -> list[Any]:
    """The modules of a package, imported (a package's docstring may name any of them relatively)."""
    out = []
    for info in pkgutil.iter_modules(getattr(package, "__path__", [])):
        try:
            out.append(importlib.import_module(f"{package.__name__}.{info.name}"))
        except ImportError:
            continue
    return out


def _api_kind(obj: Any) -> str:
    if isinstance(obj, types.ModuleType):
        return "module"
    if isinstance(obj, type):
        return "exception" if issubclass(obj, BaseException) else "class"
    return "function" if callable(obj) else "data"


def _class_problems(label: str, cls: type) -> list[str]:
    problems = []
    for attr, value in vars(cls).items():
        if attr.startswith("_") or not (callable(value) or isinstance(value, (property, classmethod, staticmethod))):
            continue
        target = value.__func__ if isinstance(value, (classmethod, staticmethod)) else value
        if not (target.__doc__ or "").strip():
            problems.append(f"{label}.{attr}: no docstring")
    return problems


def api_problems(module: Any = None) -> list[str]:
    """Every public name without a documented entry (empty when the API reference is complete).

    A name exported lazily but missing from ``__all__``, a name in ``__all__`` that does not import,
    one without a docstring of its own, a public method or property of a public class without one,
    and (for a public submodule) the same for each name in its ``__all__``.
    """
    module = module or importlib.import_module(PACKAGE)
    names = public_names(module)
    problems = [f"zinf_jax.{n}: exported but not in zinf_jax.__all__"
                for n in getattr(module, "_WHERE", {}) if n not in names]
    for name in names:
        label = f"{module.__name__}.{name}"
        try:
            obj = getattr(module, name)
        except AttributeError as e:
            problems.append(f"{label}: in __all__ but does not import ({e})")
            continue
        kind = _api_kind(obj)
        if not (_data_doc(module, name) if kind == "data" else _own_doc(obj)):
            problems.append(f"{label}: no docstring")
        if kind == "class":
            problems += _class_problems(label, obj)
        elif kind == "module" and obj is not module:
            problems += api_problems(obj)
    return problems


def api_md() -> str:
    module = importlib.import_module(PACKAGE)
    kinds = ("function", "class", "data", "exception", "module")
    groups: dict[str, list[str]] = {k: [] for k in kinds}
    for name in public_names(module):
        groups[_api_kind(getattr(module, name))].append(name)
    titles = {"function": "Functions", "class": "Classes", "data": "Constants", "exception": "Exceptions",
              "module": "Modules"}
    options = {"class": "\n   :members:", "exception": "\n   :show-inheritance:", "module": "\n   :members:"}
    out = []
    for kind in kinds:
        if not groups[kind]:
            continue
        out.append(f"## {titles[kind]}\n")
        for name in groups[kind]:
            if kind == "module":
                out.append(f"### `{PACKAGE}.{name}`\n")
                # autodoc leaves out a constant a package imports from its modules: each one named here
                sub = getattr(module, name)
                data = [n for n in public_names(sub) if _api_kind(getattr(sub, n, None)) == "data"]
                exclude = f"\n   :exclude-members: {', '.join(data)}" if data else ""
                out.append(_eval_rst(f".. automodule:: {PACKAGE}.{name}{options[kind]}{exclude}\n\n"
                                     + "".join(f".. autodata:: {PACKAGE}.{name}.{n}\n" for n in data)))
                continue
            out.append(_eval_rst(f".. auto{kind}:: {PACKAGE}.{name}{options.get(kind, '')}"))
    return "\n".join(out)


# --- configuration ----------------------------------------------------------------------------------------

def config_classes() -> list[type]:
    """Every config class: the dataclasses defined under ``zinf_jax/config/`` whose fields carry a check.

    ``ZeroConfig`` first, then its sections in field order, then any other.
    """
    pkg = importlib.import_module(f"{PACKAGE}.config")
    found: list[type] = []
    for info in pkgutil.iter_modules(pkg.__path__):
        mod = importlib.import_module(f"{pkg.__name__}.{info.name}")
        for obj in vars(mod).values():
            if (isinstance(obj, type) and dataclasses.is_dataclass(obj) and obj.__module__ == mod.__name__
                    and obj not in found and any("check" in f.metadata for f in dataclasses.fields(obj))):
                found.append(obj)
    order: list[type] = []

    def visit(cls: type) -> None:
        if cls in order:
            return
        order.append(cls)
        for f in dataclasses.fields(cls):
            if isinstance(f.metadata.get("nested"), type):
                visit(f.metadata["nested"])

    for cls in sorted(found, key=lambda c: (c.__name__ != "ZeroConfig", c.__name__)):
        visit(cls)
    return order


def field_docs(cls: type) -> dict[str, str]:
    """``field -> docstring`` from the string literal right below each field in the class body.

    A field a dataclass inherits keeps the docstring its base class gives it.
    """
    docs: dict[str, str] = {}
    for base in reversed(cls.__mro__[1:]):
        if dataclasses.is_dataclass(base):
            docs.update(_own_field_docs(base))
    docs.update(_own_field_docs(cls))
    return docs


def _own_field_docs(cls: type) -> dict[str, str]:
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    except (OSError, TypeError):
        return {}
    body = tree.body[0].body if tree.body and isinstance(tree.body[0], ast.ClassDef) else []
    docs = {}
    for stmt, nxt in zip(body, body[1:]):
        if (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name) and isinstance(nxt, ast.Expr)
                and isinstance(nxt.value, ast.Constant) and isinstance(nxt.value.value, str)):
            docs[stmt.target.id] = inspect.cleandoc(nxt.value.value)
    return docs


def _fields(cls: type) -> list[dataclasses.Field]:
    return [f for f in dataclasses.fields(cls) if not f.name.startswith("_")]


def config_problems(classes: list[type] | None = None) -> list[str]:
    """Every config field without a docstring (empty when the configuration reference is complete)."""
    problems = []
    for cls in classes if classes is not None else config_classes():
        docs = field_docs(cls)
        if not _own_doc(cls):
            problems.append(f"{cls.__module__}.{cls.__qualname__}: no docstring")
        problems += [f"{cls.__module__}.{cls.__qualname__}.{f.name}: no docstring"
                     for f in _fields(cls) if not docs.get(f.name)]
    return problems


class _Probe:
    """A value no converter accepts: the ``Invalid`` it raises names what is accepted."""

    def __repr__(self) -> str:
        return "<probe>"


def accepted_values(f: dataclasses.Field) -> str:
    """What a checked field accepts, as its own converter says it in an error message."""
    check = f.metadata.get("check")
    if not check:
        return ""
    convert, args, optional = check
    try:
        convert(_Probe(), *args)
    except Exception as e:  # the converter's Invalid: its text names the accepted values
        text = str(e)
    else:
        return ""
    return text + (", or None" if optional else "")


def _default(f: dataclasses.Field) -> str:
    if f.default is not dataclasses.MISSING:
        return repr(f.default)
    if f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
        return repr(f.default_factory())  # type: ignore[misc]
    return "(required)"


def _ds_names(f: dataclasses.Field) -> tuple[str, ...]:
    ds = f.metadata.get("ds") or ()
    return (ds,) if isinstance(ds, str) else tuple(ds)


def _section_paths(classes: list[type]) -> dict[type, list[str]]:
    """The dotted key prefixes each class is reached under from ``ZeroConfig`` (``offload_param.``...)."""
    paths: dict[type, list[str]] = {}
    if not classes:
        return paths
    todo = [(classes[0], "")]
    while todo:
        cls, prefix = todo.pop(0)
        paths.setdefault(cls, []).append(prefix)
        todo += [(f.metadata["nested"], f"{prefix}{f.name}.") for f in _fields(cls)
                 if isinstance(f.metadata.get("nested"), type)]
    return paths


def config_md() -> str:
    classes = config_classes()
    paths = _section_paths(classes)
    out = []
    for cls in classes:
        docs = field_docs(cls)
        under = paths.get(cls, [])
        where = ", ".join(f"`{p}*`" for p in under if p) if any(under) else ""
        out.append(f"## {cls.__name__}\n")
        out.append(f"`{cls.__module__}.{cls.__qualname__}`" + (f", read as {where}" if where else "") + "\n")
        out.append(_md(_own_doc(cls).split("\n\n")[0], cls.__module__) + "\n")
        for f in _fields(cls):
            anchor = f"config-{cls.__name__.lower()}-{f.name.replace('_', '-')}"
            typ = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", str(f.type))
            facts = [f"type `{typ}`", f"default `{_default(f)}`"]
            if acc := accepted_values(f):
                facts.append("accepts " + _md(acc).replace("`", "'"))
            if ds := _ds_names(f):
                facts.append("DeepSpeed " + " or ".join(f"`{n}`" for n in ds))
            out.append(f"({anchor})=\n`{f.name}`\n: {_md(docs.get(f.name, ''), cls.__module__)}\n\n  {'; '.join(facts)}.\n")
    return "\n".join(out)


# --- DeepSpeed keys -------------------------------------------------------------------------------------------

_DS_SECTIONS = {"": "zero_optimization.", "offload_param.": "zero_optimization.offload_param.",
                "offload_optimizer.": "zero_optimization.offload_optimizer.", "aio.": "aio.",
                "loss_scale.": "fp16.", "optimizer.": "optimizer.params."}
"""Where the importer reads each section's ``ds`` keys (used only while it has no ``KEY_TABLE``)."""


def deepspeed_rows() -> list[tuple[str, str, str]]:
    """``(DeepSpeed key, zinf_jax setting, note)`` for every key the importer reads.

    From ``zinf_jax.config.deepspeed.KEY_TABLE`` (rows of at least a key and a setting, as tuples or
    objects with ``key``/``setting``/``note`` attributes) when the importer has one; else from the
    ``ds`` metadata of the config fields.
    """
    ds_mod = importlib.import_module(f"{PACKAGE}.config.deepspeed")
    table = getattr(ds_mod, "KEY_TABLE", None)
    if table is not None:
        rows = []
        for row in table:
            if isinstance(row, (tuple, list)):
                key, setting, *rest = row
                note = rest[0] if rest else ""
            else:
                key, setting, note = row.key, row.setting, getattr(row, "note", "")
            rows.append((str(key), str(setting), str(note or "")))
        return rows
    classes = config_classes()
    rows = []
    for cls, prefixes in _section_paths(classes).items():
        for prefix in prefixes:
            section = _DS_SECTIONS.get(prefix)
            if section is None:
                continue
            for f in _fields(cls):
                for i, name in enumerate(_ds_names(f)):
                    rows.append((section + name, f"{prefix}{f.name}", "an older name" if i else ""))
    return rows


def deepspeed_md() -> str:
    lines = ["| DeepSpeed key | zinf_jax setting | note |", "|---|---|---|"]
    for key, setting, note in deepspeed_rows():
        lines.append(f"| `{key}` | `{setting}` | {_md(note)} |")
    return "\n".join(lines) + "\n"


# --- CLI ------------------------------------------------------------------------------------------------

def cli_md() -> str:
    from zinf_jax.app.cli import make_parser

    old = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = "100"  # argparse wraps to the terminal; the page is the same everywhere
    try:
        parser = make_parser()
        subs = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        out = ["## zinf-jax\n", "```text\n" + parser.format_help().rstrip() + "\n```\n"]
        for name, sub in subs.choices.items():
            out += [f"## zinf-jax {name}\n", "```text\n" + sub.format_help().rstrip() + "\n```\n"]
    finally:
        if old is None:
            os.environ.pop("COLUMNS", None)
        else:
            os.environ["COLUMNS"] = old
    return "\n".join(out)


# --- errors, package map, notes ----------------------------------------------------------------------------------

def errors_md() -> str:
    errors = importlib.import_module(f"{PACKAGE}.errors")
    out = [_eval_rst(".. automodule:: zinf_jax.errors\n   :no-index:")]
    for name in errors.__all__:
        cls = getattr(errors, name)
        bases = ", ".join(b.__name__ for b in cls.__bases__)
        out.append(f"### `{name}` ({bases})\n\n{_md(_own_doc(cls).split(chr(10) * 2)[0], errors.__name__)}\n")
    return "\n".join(out)


def modules() -> list[tuple[str, pathlib.Path]]:
    """Every module of the package, by dotted name, in file order."""
    out = []
    for p in sorted(SOURCE.rglob("*.py")):
        if "__pycache__" in p.parts:
            continue
        parts = p.relative_to(ROOT).with_suffix("").parts
        out.append((".".join(parts[:-1] if parts[-1] == "__init__" else parts), p))
    return out


def _first_line(path: pathlib.Path) -> str:
    doc = ast.get_docstring(ast.parse(path.read_text()))
    return (doc or "").strip().split("\n\n")[0].replace("\n", " ")


def package_map_problems() -> list[str]:
    """Every module the package map cannot describe: one without a docstring (its first line is its entry)."""
    return [f"{name}: no module docstring (the package map shows its first line)"
            for name, path in modules() if not _first_line(path)]


def package_map_md() -> str:
    out = []
    mods = modules()
    for name, path in mods:
        if path.name != "__init__.py":
            continue
        out.append(f"## `{name}`\n")
        public = name.count(".") == 1 and name.split(".")[1] in public_names()  # documented in the API page
        out.append(_eval_rst(f".. automodule:: {name}" + ("\n   :no-index:" if public else "")))
        members = [(m, p) for m, p in mods if p.name != "__init__.py" and m.rsplit(".", 1)[0] == name]
        if members:
            rst = []
            for m, p in members:
                public_module = m.count(".") == 1 and m.split(".")[1] in public_names()  # the API page has it
                rst.append(f".. py:module:: {m}\n   :synopsis: {_first_line(p) or m}\n"
                           + ("   :no-index:\n" if public_module else ""))
            out.append(_eval_rst("\n".join(rst)))
            out.append("| module | what it is |\n|---|---|\n" + "\n".join(
                f"| {{py:mod}}`{m}` | {_md(_first_line(p), m)} |" for m, p in members) + "\n")
    return "\n".join(out)


NOTE = re.compile(r"\[Note: ([^\]]+)\]")


def notes() -> dict[str, dict[str, Any]]:
    """``note -> {"defined": [(module, line)], "cited": {module, ...}}`` over the package's source.

    A note is defined where a line is the note's name alone (``[Note: x]`` in a docstring, or
    ``# [Note: x]``), and cited anywhere else it is named.
    """
    found: dict[str, dict[str, Any]] = {}
    for name, path in modules():
        for i, line in enumerate(path.read_text().splitlines(), 1):
            for m in NOTE.finditer(line):
                entry = found.setdefault(m.group(1), {"defined": [], "cited": set()})
                if line.strip().lstrip("#").strip() == m.group(0):
                    entry["defined"].append((name, i))
                else:
                    entry["cited"].add(name)
    return found


def notes_md() -> str:
    lines = ["| note | written in | cited in |", "|---|---|---|"]
    for note, entry in sorted(notes().items()):
        defined = ", ".join(f"{{py:mod}}`{m}` (line {i})" for m, i in entry["defined"]) or "**nowhere**"
        cited = ", ".join(f"{{py:mod}}`{m}`" for m in sorted(entry["cited"] - {m for m, _ in entry["defined"]}))
        lines.append(f"| `[Note: {note}]` | {defined} | {cited or '—'} |")
    return "\n".join(lines) + "\n"


def note_texts() -> list[tuple[str, str, list[str]]]:
    """``(note, module, paragraphs)`` of every note written in the source, by name: the lines after the note's
    name, to the end of its comment block (a ``#`` note) or of its docstring, or to the next note's name."""
    files = dict(modules())
    out = []
    for note, entry in sorted(notes().items()):
        for module, at in entry["defined"]:
            lines = files[module].read_text().splitlines()
            comment = lines[at - 1].strip().startswith("#")
            body: list[str] = []
            for line in lines[at:]:
                text = line.strip()
                if comment:
                    if not text.startswith("#") or NOTE.fullmatch(text.lstrip("#").strip()):
                        break
                    body.append(text[1:].strip())
                    continue
                if NOTE.fullmatch(text):
                    break
                if '"""' in text:
                    body.append(text.split('"""')[0])
                    break
                body.append(text)
            paragraphs = [" ".join(p.split()) for p in "\n".join(body).split("\n\n") if p.strip()]
            if paragraphs:  # (a name alone on a line that writes nothing after it is a citation)
                out.append((note, module, paragraphs))
    return out


def note_texts_md() -> str:
    """Every note's text, rendered, under a heading of its name."""
    out = []
    for note, module, paragraphs in note_texts():
        out.append(f"## [Note: {note}]\n\nWritten in {{py:mod}}`{module}`.\n")
        for p in paragraphs:  # a role the lookup could not place (a bare method name) is plain code
            out.append(re.sub(r"\{py:[a-z]+\}`([^`.~]+)`", r"`\1`", _md(p, module)) + "\n")
    return "\n".join(out)


def notes_problems() -> list[str]:
    return [f"[Note: {n}] is cited but written nowhere (a line holding only the note's name)"
            for n, e in sorted(notes().items()) if not e["defined"]]


GENERATORS: dict[str, Callable[[], str]] = {
    "api": api_md, "config": config_md, "deepspeed-keys": deepspeed_md, "cli": cli_md, "errors": errors_md,
    "package-map": package_map_md, "notes": notes_md, "note-texts": note_texts_md,
    "optax-table": lambda: _optax_table(),
    "bytes-per-param": lambda: bytes_per_param_md(),
}


def bytes_per_param() -> list[tuple[str, str, str, float, float, float, float]]:
    """Per placement and compute dtype, the estimator's bytes per parameter of one step's state:
    ``(params, optimizer, dtype, host RAM, disk at rest, disk read a step, disk written a step)`` (a 10B-class
    GPT on 32 GPUs in 4 processes; the per-process figures times the processes, over the parameters)."""
    import zinf_jax as zinf
    from zinf_jax.estimate import estimate_from_sizes

    rows = []
    for dtype in ("float32", "bfloat16"):
        for e in estimate_from_sizes(None, layers=48, hidden=4096, vocab=50257, seq=2048, batch=32, n_devices=32,
                                     n_processes=4, platform="gpu", config=zinf.ZeroConfig(compute_dtype=dtype)):
            per = 4 / e.params
            rows.append((e.param_tier, e.optimizer_tier, dtype, e.host_bytes * per, e.nvme_bytes * per,
                         e.step_read_bytes * per, e.step_write_bytes * per))
    return rows


def bytes_per_param_md() -> str:
    out = ["| params | optimizer | compute dtype | host RAM | disk at rest | disk read a step | disk written a step |",
           "| --- | --- | --- | --- | --- | --- | --- |"]
    for pt, ot, dt, host, disk, read, write in bytes_per_param():
        out.append(f"| {pt} | {ot} | {dt} | {host:.1f} B/param | {disk:.1f} B/param | {read:.1f} B/param | "
                   f"{write:.1f} B/param |")
    return "\n".join(out) + "\n"


def _optax_table() -> str:
    from zinf_jax.optim.optax_table import table_md

    return table_md()


def expand(text: str) -> str:
    """``text`` with every marker line replaced by its generated part."""
    def one(m: re.Match) -> str:
        if m.group(1) not in GENERATORS:
            raise ValueError(f"unknown generated part {m.group(1)!r}; known: {', '.join(GENERATORS)}")
        with redirect_stdout(io.StringIO()):
            return GENERATORS[m.group(1)]()
    return MARKER.sub(one, text)


# --- Sphinx wiring ----------------------------------------------------------------------------------------------

def _on_source_read(app: Any, docname: str, source: list[str]) -> None:
    source[0] = expand(source[0])


def _on_builder_inited(app: Any) -> None:
    from sphinx.util import logging

    log = logging.getLogger(__name__)
    for problem in api_problems() + config_problems() + package_map_problems() + notes_problems():
        log.warning("zinf_docs: %s", problem)


def _resolve(full: str) -> tuple[bool, Any]:
    """Imports the module part of ``full`` and follows the attributes (a dataclass field counts)."""
    parts = full.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj: Any = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for i, attr in enumerate(parts[cut:]):
            if hasattr(obj, attr):
                obj = getattr(obj, attr)
            elif isinstance(obj, type) and (attr in getattr(obj, "__dataclass_fields__", {})
                                            or attr in getattr(obj, "__annotations__", {})
                                            or _set_in_init(obj, attr)):
                obj = None  # a field or an instance attribute, without a class-level value
            elif i == 0 and isinstance(obj, types.ModuleType) and hasattr(obj, "__path__"):
                # a package's docstring names its modules' objects relatively: ParamLayout in zinf_jax.plan
                inner = [m for m in _submodules(obj) if m.__dict__.get(attr) is not None]
                if not inner:
                    return False, None
                obj = getattr(inner[0], attr)
            else:
                return False, None
        return True, obj
    return False, None


def _set_in_init(cls: type, attr: str) -> bool:
    """Whether ``cls.__init__`` assigns ``self.<attr>`` (an instance attribute a docstring may name)."""
    try:
        source = inspect.getsource(cls.__init__)
    except (OSError, TypeError):
        return False
    return re.search(rf"\bself\.{re.escape(attr)}\s*(:[^=\n]+)?=[^=]", source) is not None


def _lookup(target: str, *contexts: str | None) -> tuple[str, Any] | None:
    """The zinf_jax object ``target`` names (tried as written, then relative to each context), if any.

    A context that names an object also lends the module that object is defined in.
    """
    target = target.lstrip("~.!")
    todo = [c for c in contexts if c]
    for c in list(todo):
        ok, obj = _resolve(c) if c.startswith(PACKAGE) else (False, None)
        module = getattr(obj, "__module__", None)
        if ok and isinstance(module, str) and module not in todo:
            todo.append(module)
    candidates = [target]
    for context in todo:
        parts = context.split(".")
        candidates += [".".join(parts[:i] + [target]) for i in range(len(parts), 0, -1)]
    for full in candidates:
        if full.startswith(PACKAGE):
            ok, obj = _resolve(full)
            if ok:
                return full, obj
    return None


def _public_alias(full: str, obj: Any) -> str | None:
    """``zinf_jax.X[.member]`` when ``obj`` (or its owner class) is public as ``zinf_jax.X``."""
    package = importlib.import_module(PACKAGE)
    for name in public_names(package):
        public = getattr(package, name, None)
        if public is obj:
            return f"{PACKAGE}.{name}"
        if isinstance(public, type):
            owner = full.rsplit(".", 1)[0]
            found = _lookup(owner, None)
            if found is not None and found[1] is public:
                return f"{PACKAGE}.{name}.{full.rsplit('.', 1)[1]}"
    return None


def _on_missing_reference(app: Any, env: Any, node: Any, contnode: Any) -> Any:
    if node.get("refdomain") != "py":
        return None
    # the object whose docstring holds the reference: relative names are read where it is defined
    source = str(node.source or "").partition("docstring of ")[2].strip()
    found = _lookup(node["reftarget"], node.get("py:class") and f"{node.get('py:module')}.{node['py:class']}",
                    node.get("py:module"), source)
    if found is None:
        return None  # not a zinf_jax object: nitpicky decides
    full, obj = found
    alias = _public_alias(full, obj)
    if alias and alias != node["reftarget"]:
        domain = env.get_domain("py")
        for typ in (node["reftype"], "obj"):
            ref = domain.resolve_xref(env, node["refdoc"], app.builder, typ, alias, node, contnode)
            if ref is not None:
                return ref
    return contnode  # a real object that no page documents (internal): shown as code


_ATTRIBUTE_DOCS: dict[str, list[str]] = {}


def _before_napoleon(app: Any, what: str, name: str, obj: Any, options: Any, lines: list[str]) -> None:
    if what == "data" and name.startswith(PACKAGE + "."):
        # a re-exported constant: autodoc reads the docstring under it only in the module that imports it
        # (else it shows the value's type's docstring); read it where the constant is written
        module, _, attr = name.rpartition(".")
        try:
            doc = _data_doc(importlib.import_module(module), attr)
        except ImportError:
            doc = ""
        if doc:
            lines[:] = doc.splitlines() + [""]
    if what in ("attribute", "property", "data"):
        _ATTRIBUTE_DOCS[name] = list(lines)


def _after_napoleon(app: Any, what: str, name: str, obj: Any, options: Any, lines: list[str]) -> None:
    """An attribute's docstring as written: napoleon would read its first sentence up to a colon as a type."""
    if what in ("attribute", "property", "data") and name in _ATTRIBUTE_DOCS:
        lines[:] = _ATTRIBUTE_DOCS.pop(name)


def setup(app: Any) -> dict[str, Any]:
    app.setup_extension("sphinx.ext.autodoc")
    app.connect("autodoc-process-docstring", _before_napoleon, priority=400)  # napoleon's is 500
    app.connect("autodoc-process-docstring", _after_napoleon, priority=600)
    app.connect("builder-inited", _on_builder_inited)
    app.connect("source-read", _on_source_read)
    app.connect("missing-reference", _on_missing_reference)
    return {"version": "1", "parallel_read_safe": True, "parallel_write_safe": True}
