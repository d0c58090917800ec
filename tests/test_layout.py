"""The package layout: imports only look down the data flow (read from the source, nothing imported).

Layers, bottom first (a module may import its own layer and the ones below):

    _internal, errors -> xla -> config -> plan -> tiers -> optim -> engine -> checkpoint
        -> api, estimate, distributed (the library's front) -> app (the zinf-jax command)

Every import statement counts, at the top of a module or inside a function or an
``if TYPE_CHECKING`` block: a lazy import is still a dependency.
"""
from __future__ import annotations

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1] / "zinf_jax"
LAYERS = (
    ("zinf_jax._internal", "zinf_jax.errors"),
    ("zinf_jax.xla",),
    ("zinf_jax.config",),
    ("zinf_jax.plan",),
    ("zinf_jax.tiers",),
    ("zinf_jax.optim",),
    ("zinf_jax.engine",),
    ("zinf_jax.checkpoint",),
    ("zinf_jax.api", "zinf_jax.estimate", "zinf_jax.distributed", "zinf_jax"),
    ("zinf_jax.app", "zinf_jax.models"),
)
JAX_PRIVATE = "zinf_jax._internal.jax_private"  # the one module that may import jax._src
MODELS_REEXPORT = "zinf_jax.models"  # the old import path of the demo GPT: may import app/
SIZE_ALARM = 900
"""Lines past which a module is an outlier worth a look: a size alarm, not the reason to split a file (a file is
split when it does two jobs). A module over it is listed in LONG_MODULES with why it stays whole."""
LONG_MODULES: dict[str, str] = {}


def _modules() -> dict[str, pathlib.Path]:
    out = {}
    for p in sorted(ROOT.rglob("*.py")):
        parts = p.relative_to(ROOT.parent).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = p
    return out


MODULES = _modules()


def _imports(name: str, path: pathlib.Path) -> set[str]:
    """Every module of the package (and every ``jax._src`` module) that ``name`` imports."""
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = ".".join(package[: len(package) - node.level + 1] + [node.module or ""]).strip(".") \
                if node.level else node.module or ""
            for a in node.names:  # ``from pkg import mod`` depends on the submodule if there is one
                found.add(f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base)
    return {m for m in found if m in MODULES or m == "jax._src" or m.startswith("jax._src.")}


GRAPH = {name: _imports(name, path) for name, path in MODULES.items()}


def _layer(module: str) -> int:
    best = max((prefix for layer in LAYERS for prefix in layer
                if module == prefix or (prefix != "zinf_jax" and module.startswith(prefix + "."))),
               key=len, default="zinf_jax")
    return next(i for i, layer in enumerate(LAYERS) if best in layer)


def test_every_module_has_a_layer():
    assert "zinf_jax.engine.build" in MODULES and _layer("zinf_jax.engine.build") == 6
    for name in MODULES:
        if name != "zinf_jax" and name.count(".") == 1 and not name.endswith("__main__"):
            assert any(name == p or name.startswith(p + ".") for layer in LAYERS for p in layer), \
                f"{name} is in no layer: add it to LAYERS in the data-flow order"


def test_no_import_cycles():
    done: set[str] = set()

    def visit(node: str, stack: list[str]) -> None:
        if node in stack:
            raise AssertionError("import cycle: " + " -> ".join(stack[stack.index(node):] + [node]))
        if node in done:
            return
        for dep in sorted(GRAPH.get(node, ())):
            if dep in MODULES:
                visit(dep, stack + [node])
        done.add(node)

    for name in sorted(MODULES):
        visit(name, [])


def test_imports_only_look_down():
    up = [f"{m} (layer {_layer(m)}) imports {d} (layer {_layer(d)})"
          for m, deps in GRAPH.items() for d in deps if d in MODULES and _layer(d) > _layer(m)]
    assert not up, "imports against the data flow:\n" + "\n".join(up)


def test_nothing_outside_app_imports_app():
    bad = [f"{m} imports {d}" for m, deps in GRAPH.items() for d in deps
           if (d == "zinf_jax.app" or d.startswith("zinf_jax.app.")) and not m.startswith("zinf_jax.app")
           and m != MODELS_REEXPORT]
    assert not bad, "\n".join(bad)


def test_jax_private_only_in_its_fence():
    bad = [f"{m} imports {d}" for m, deps in GRAPH.items() for d in deps if d.startswith("jax._src")
           and m != JAX_PRIVATE]
    assert not bad, "jax._src outside " + JAX_PRIVATE + ":\n" + "\n".join(bad)
    assert any(d.startswith("jax._src") for d in GRAPH[JAX_PRIVATE])  # the fence is where the test looks


@pytest.mark.parametrize("package", sorted(n for n, p in MODULES.items() if p.name == "__init__.py"))
def test_every_package_maps_itself(package):
    doc = ast.get_docstring(ast.parse(MODULES[package].read_text()))
    assert doc and len(doc.splitlines()) >= 3, f"{package}/__init__.py needs a docstring that maps the package"


def test_every_folder_is_a_package():
    folders = {p.parent for p in ROOT.rglob("*.py") if "__pycache__" not in p.parts}
    assert not [str(f) for f in folders if not (f / "__init__.py").exists()]


def test_no_module_over_the_size_alarm_without_a_reason():
    long = {n: len(p.read_text().splitlines()) for n, p in MODULES.items()}
    assert not {n: k for n, k in long.items() if k > SIZE_ALARM and n not in LONG_MODULES}
    assert all(why.strip() for why in LONG_MODULES.values())


def test_no_top_level_checkpoint_modules_remain():
    top = {p.name for p in ROOT.glob("*.py")}
    assert not top & {"checkpoint.py", "ckpt_integrity.py", "ckpt_failures.py", "retention.py", "training_state.py",
                      "cli.py", "train.py", "rundir.py", "sharding.py", "units.py", "config.py", "deepspeed.py"}
    assert (ROOT / "checkpoint" / "__init__.py").exists() and (ROOT / "app" / "__init__.py").exists()


def test_nothing_below_the_api_reaches_into_the_engine():
    hits = [f"{p.relative_to(ROOT)}:{i}: {line.strip()}" for sub in ("engine", "checkpoint")
            for p in (ROOT / sub).rglob("*.py") for i, line in enumerate(p.read_text().splitlines(), 1)
            if "engine._" in line]
    assert not hits, "\n".join(hits)


def test_step_directory_names_are_spelled_once():
    """``step_<N>``, the metadata file and the hidden prefixes appear in code only in checkpoint/format.py."""
    spelled = ['f"step_', '"zinf_meta.json"', '".tmp_', '".del_', '".bad_', '"checksums.json"', 'glob("step_']
    hits = []
    for name, p in MODULES.items():
        if name == "zinf_jax.checkpoint.format":
            continue
        for i, line in enumerate(p.read_text().splitlines(), 1):
            code = line.split("#")[0]
            hits += [f"{name}:{i}: {line.strip()}" for s in spelled if s in code]
    assert not hits, "\n".join(hits)
