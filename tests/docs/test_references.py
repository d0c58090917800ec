"""The generated references are complete, and their checks fail on a new undocumented name or field.

The Sphinx build (``.ci/run``) turns the same checks into warnings that fail it (``-W``); these tests run
them without Sphinx so that the default suite catches a gap too.
"""
from __future__ import annotations

import dataclasses
import pathlib
import re
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "docs" / "_ext"))

import zinf_docs  # noqa: E402

import zinf_jax  # noqa: E402
from zinf_jax.config import ZeroConfig  # noqa: E402
from zinf_jax.config.fields import as_int, checked  # noqa: E402


def test_every_public_name_is_documented():
    assert zinf_docs.api_problems() == []


def test_the_api_check_fails_on_a_new_undocumented_name(monkeypatch):
    def shiny(x):  # no docstring
        return x

    before = set(zinf_docs.api_problems())
    monkeypatch.setattr(zinf_jax, "shiny", shiny, raising=False)
    monkeypatch.setattr(zinf_jax, "__all__", [*zinf_jax.__all__, "shiny"])
    assert set(zinf_docs.api_problems()) - before == {"zinf_jax.shiny: no docstring"}

    shiny.__doc__ = "Returns ``x``."
    assert set(zinf_docs.api_problems()) - before == set()


def test_the_api_check_fails_on_a_lazy_export_left_out_of_all(monkeypatch):
    monkeypatch.setattr(zinf_jax, "_WHERE", {**zinf_jax._WHERE, "hidden": "zinf_jax.api"})
    assert "zinf_jax.hidden: exported but not in zinf_jax.__all__" in zinf_docs.api_problems()


def test_the_api_check_reads_public_methods(monkeypatch):
    class Thing:
        """A public class."""

        def method(self):  # no docstring
            return 1

    before = set(zinf_docs.api_problems())
    monkeypatch.setattr(zinf_jax, "Thing", Thing, raising=False)
    monkeypatch.setattr(zinf_jax, "__all__", [*zinf_jax.__all__, "Thing"])
    assert set(zinf_docs.api_problems()) - before == {"zinf_jax.Thing.method: no docstring"}


def test_every_config_field_is_documented_and_in_the_reference():
    classes = zinf_docs.config_classes()
    assert ZeroConfig in classes and len(classes) >= 5
    assert zinf_docs.config_problems() == []
    page = zinf_docs.config_md()
    missing = [f"{c.__name__}.{f.name}" for c in classes for f in dataclasses.fields(c)
               if not f.name.startswith("_")
               and f"(config-{c.__name__.lower()}-{f.name.replace('_', '-')})=" not in page]
    assert not missing, f"config fields missing from the configuration reference: {missing}"


@dataclasses.dataclass(frozen=True)
class _GrownUndocumented(ZeroConfig):
    new_knob: int = checked(1, as_int, 0)


@dataclasses.dataclass(frozen=True)
class _GrownDocumented(ZeroConfig):
    """ZeroConfig with one more field."""

    new_knob: int = checked(1, as_int, 0)
    """A new setting, documented."""


def test_the_config_check_fails_on_a_new_undocumented_field():
    name = f"{__name__}._GrownUndocumented"
    assert zinf_docs.config_problems([_GrownUndocumented]) == [f"{name}: no docstring",
                                                                f"{name}.new_knob: no docstring"]
    assert zinf_docs.config_problems([_GrownDocumented]) == []  # inherited fields keep their docstrings


def test_the_config_reference_finds_a_new_config_class(monkeypatch):
    import zinf_jax.config.zero as zero

    monkeypatch.setattr(_GrownUndocumented, "__module__", zero.__name__)
    monkeypatch.setattr(zero, "_GrownUndocumented", _GrownUndocumented, raising=False)
    assert _GrownUndocumented in zinf_docs.config_classes()


def test_every_module_is_in_the_package_map():
    assert zinf_docs.package_map_problems() == []
    page = zinf_docs.package_map_md()
    missing = [name for name, path in zinf_docs.modules()
               if path.name != "__init__.py" and f"{{py:mod}}`{name}`" not in page]
    assert not missing, f"modules missing from the package map: {missing}"


def test_the_package_map_check_fails_on_a_module_without_a_docstring(tmp_path, monkeypatch):
    pkg = tmp_path / "zinf_jax"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text('"""The package."""\n')
    (pkg / "sub" / "__init__.py").write_text('"""A sub-package.\n\nIts map.\n"""\n')
    (pkg / "sub" / "mapped.py").write_text('"""What this module is."""\n')
    (pkg / "sub" / "unmapped.py").write_text("x = 1\n")
    monkeypatch.setattr(zinf_docs, "ROOT", tmp_path)
    monkeypatch.setattr(zinf_docs, "SOURCE", pkg)
    assert zinf_docs.package_map_problems() == [
        "zinf_jax.sub.unmapped: no module docstring (the package map shows its first line)"]


def test_every_cited_note_is_written():
    assert zinf_docs.notes_problems() == []
    assert len(zinf_docs.notes()) >= 5


@pytest.mark.parametrize("part", sorted(zinf_docs.GENERATORS))
def test_every_generated_part_renders(part):
    assert zinf_docs.GENERATORS[part]().strip()


def test_docs_cite_no_result_file_outside_the_repository():
    """A page may point at a measured record only where the repository holds it."""
    import re

    pages = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    cited = {(p, m.group(0)) for p in pages if "_build" not in p.parts
             for m in re.finditer(r"(?<![\w/])(results|benchmarks)/[\w./-]*\w", p.read_text())}
    missing = [f"{p.relative_to(ROOT)}: {path}" for p, path in sorted(cited) if not (ROOT / path).exists()]
    assert not missing, "\n".join(missing)


def test_no_work_log_words():
    """Docs and docstrings say what the code does, not who worked on it when."""
    import re

    work = "ses" + "sion"  # spelled apart, so that this file passes its own check
    word = re.compile(rf"\b{work}s?\b|last {work}|this {work}", re.I)
    files = [ROOT / "README.md", ROOT / "CHANGELOG.md", *sorted((ROOT / "docs").rglob("*.md")),
             *sorted((ROOT / "docs").rglob("*.py")), *sorted((ROOT / "zinf_jax").rglob("*.py"))]
    hits = [f"{f.relative_to(ROOT)}:{i}: {line.strip()}" for f in files if f.exists() and "_build" not in f.parts
            for i, line in enumerate(f.read_text().splitlines(), 1) if word.search(line)]
    assert not hits, "\n".join(hits)


def test_the_guides_byte_figures_are_the_estimators():
    """offload_memory.md's per-parameter figures in prose agree with the estimator's (the generated table beside
    them): disk at rest with both tiers on nvme, the optimizer's disk traffic a step, both tiers' traffic."""
    rows = {(pt, ot, dt): r for pt, ot, dt, *r in zinf_docs.bytes_per_param()}
    text = (ROOT / "docs" / "guides" / "offload_memory.md").read_text()
    host, disk, read, write = rows[("nvme", "nvme", "float32")]
    assert round(disk) == 16 and "the disk holds 16 B/param with float32 compute" in text
    assert round(rows[("nvme", "nvme", "bfloat16")][1]) == 18 and "18 B/param with bfloat16 compute" in text
    _, _, opt_read, opt_write = rows[("none", "nvme", "float32")]
    assert round(opt_read) == round(opt_write) == 16 and "(16 B/param\neach way)" in text
    assert round(read + write) == 40 and "about 40 B/param with both tiers on nvme" in text


def _example_names():
    """Every zinf_jax name the README's and the docs' Python examples use: ``zinf.X`` and ``from zinf_jax... import
    X``."""
    pages = [ROOT / "README.md", *sorted(p for p in (ROOT / "docs").rglob("*.md") if "_build" not in p.parts)]
    used = set()
    for page in pages:
        for block in re.findall(r"```python\n(.*?)```", page.read_text(), re.S):
            used |= {("zinf_jax", n) for n in re.findall(r"\bzinf\.([A-Za-z_]\w*)", block)}
            for mod, names in re.findall(r"from (zinf_jax(?:\.\w+)*) import ([\w, ()]+)", block):
                used |= {(mod, n) for n in re.split(r"[,\s()]+", names) if n}
    return used


def test_every_name_in_the_examples_is_in_the_api_reference():
    """A name a README or docs example uses is documented in the API reference: a public name of ``zinf_jax``, or a
    public name of one of its documented submodules (``zinf_jax.models``, ``zinf_jax.estimate``...)."""
    import zinf_jax

    documented = set(zinf_docs.public_names())
    missing = []
    for mod, name in sorted(_example_names()):
        if mod == "zinf_jax":
            ok = name in documented
        else:
            sub = mod.removeprefix("zinf_jax.").split(".")[0]
            ok = sub in documented and name in getattr(zinf_jax, sub).__all__
        if not ok:
            missing.append(f"{mod}.{name}")
    assert not missing, missing


def test_the_cli_help_has_no_docstring_markup():
    """``zinf-jax --help`` and each command's help (the CLI reference page) read as plain text."""
    text = zinf_docs.cli_md().replace("```", "")  # the page's own code fences
    markup = re.search(r".{0,40}(:[a-z]+:`|``).{0,40}", text)
    assert markup is None, markup.group(0)
