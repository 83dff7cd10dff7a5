"""The schedule library's registry (multimesh/schedules): every schedule is one registered
class, the docs list exactly the registry, the theory each class states matches the
simulator, and a new schedule is one module (shown here with a toy one)."""

from __future__ import annotations

import importlib
import pathlib
import pkgutil
import re
import subprocess
import sys

import pytest

from multimesh.schedules import (
    PLACEMENTS,
    SCHEDULES,
    SPLIT_SCHEDULES,
    CustomSchedule,
    ScheduleAlgorithm,
    ScheduleError,
    algorithms,
    aliases,
    all_schedules,
    build_schedule,
    get_schedule,
    live_activations,
    pipeline_units,
    register_schedule,
    registry,
    theoretical_bubble,
    theoretical_peak_live,
)
from multimesh.schedules.plans import Slot, add_backward
from tests.tools import load_tool

ROOT = pathlib.Path(__file__).resolve().parents[1]
NAMES = [s.name for s in all_schedules()]


def test_every_algorithm_module_is_loaded_and_registers():
    """Each public module of algorithms/ is in MODULES (the listing order) and registers
    at least one schedule; every registered schedule comes from one of them."""
    found = {m.name for m in pkgutil.iter_modules(algorithms.__path__)
             if not m.name.startswith("_")}
    assert found == set(algorithms.MODULES)
    owners = {type(s).__module__.rsplit(".", 1)[-1] for s in all_schedules()}
    assert owners == found
    assert SCHEDULES == tuple(NAMES)
    assert SPLIT_SCHEDULES == tuple(s.name for s in all_schedules() if s.splits_backward)
    assert PLACEMENTS == {s.name: s.placement for s in all_schedules() if s.placement}


def _docs_table() -> dict[str, list[str]]:
    """The rows of docs/schedules.md's "Registered schedules" table, by schedule name."""
    text = (ROOT / "docs" / "schedules.md").read_text()
    section = text.split("## Registered schedules", 1)[1].split("\n## ", 1)[0]
    rows = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("| `") and cells:
            rows[cells[0].strip("`")] = cells[1:]
    return rows


def test_docs_list_exactly_the_registry():
    """docs/schedules.md's table: one row per registered schedule, with its module,
    aliases, split backward and placement as the class states them."""
    rows = _docs_table()
    assert list(rows) == NAMES
    for s in all_schedules():
        module, alias_cell, split, placement, *_ = rows[s.name]
        assert module == f"`{type(s).__module__.rsplit('.', 1)[-1]}.py`", s.name
        assert re.findall(r"`([^`]+)`", alias_cell) == list(s.aliases), s.name
        assert split == ("yes" if s.splits_backward else "no"), s.name
        assert placement == (s.placement or "any"), s.name


def test_the_registry_table_is_generated_and_current():
    """docs/schedules.md's table is ``tools/gen_schedules_doc.py``'s, from the registry."""
    gen = load_tool("gen_schedules_doc")
    current = (ROOT / "docs" / "schedules.md").read_text()
    assert current == gen.render(current), \
        "docs/schedules.md is stale: run `python tools/gen_schedules_doc.py`"
    for s in all_schedules():
        assert f"| {gen._cell(s.summary())} |" in current, s.name


def test_every_listing_of_the_schedules_comes_from_the_registry(capsys):
    """Issue 32: a schedule's docstring and options appear in ``mm-opt --list-passes``
    (the pass's ``schedule`` option), ``microbatch``'s docstring and docs/passes.md, all
    made from the registry, not written in each place."""
    import multimesh.jax as mm
    from multimesh.tools.mm_opt import main

    assert main(["--list-passes"]) == 0
    listed = capsys.readouterr().out
    passes_md = (ROOT / "docs" / "passes.md").read_text()
    for s in all_schedules():
        assert s.summary() and s.describe() in listed and s.describe() in mm.microbatch.__doc__
        assert s.describe() in passes_md, s.name
    assert "takes unrolling" in get_schedule("gpipe").describe()
    assert "v-shape placement; splits backward" in get_schedule("dualpipe-v").describe()


@pytest.mark.parametrize("name", NAMES)
def test_every_spelling_finds_its_schedule(name):
    algo = get_schedule(name)
    assert algo.name == name
    for spelling in (name.upper(), f" {name} ", *algo.aliases, *(a.lower() for a in algo.aliases)):
        assert get_schedule(spelling) is algo


def test_unknown_schedule_names_the_valid_ones():
    with pytest.raises(ScheduleError, match=r"unknown schedule 'bogus'; valid schedules: "
                                            r"1f1b, circular-reversed-backward, .*aliases: "):
        get_schedule("bogus")


SHAPES = [(2, 4), (2, 8), (3, 6), (3, 12), (4, 8)]  # M >= 2P, P dividing M


@pytest.mark.parametrize("name", [s.name for s in all_schedules() if s.has_textbook])
@pytest.mark.parametrize("P,M", SHAPES)
def test_stated_theory_matches_the_simulator(name, P, M):
    """Each class's ``bubble`` and ``peak_live`` on its textbook pipeline are what the
    simulator measures (the same numbers the by-name functions give)."""
    algo = get_schedule(name)
    units, V = algo.textbook_units(P, M), algo.interleave
    assert len({u.stage for u in units}) == V * P
    sched = build_schedule(units, name)
    bubble, peak = algo.bubble(P, M, V), algo.peak_live(P, M, V)
    assert bubble is not None and peak is not None
    assert sched.bubble_fraction() == pytest.approx(bubble)
    assert max(live_activations(sched)) == peak
    assert theoretical_bubble(name, P, M, V) == bubble
    assert theoretical_peak_live(name, P, M, V) == peak


def test_custom_schedule_is_parsed_once_into_a_typed_value():
    rows = [["stage0", "stage0", "stage0_bwd", "stage0_bwd"],
            ["stage1", "stage1_bwd", (1, "stage1"), (1, "stage1_bwd")]]
    parsed = CustomSchedule.parse(rows, 2)
    assert parsed.rows[0] == ((0, "stage0"), (1, "stage0"), (0, "stage0_bwd"), (1, "stage0_bwd"))
    assert CustomSchedule.parse(parsed, 2) is parsed
    units = pipeline_units(2, 2)
    assert (build_schedule(units, None, custom=parsed).orders
            == build_schedule(units, None, custom=rows).orders)
    with pytest.raises(ScheduleError, match="microbatch 1 of task 'stage0' is out of range"):
        CustomSchedule.parse(parsed, 1)


# ------------------------------------------------------------------ adding a schedule


@pytest.fixture
def scratch_registry(monkeypatch):
    """Registrations made in a test are undone after it."""
    monkeypatch.setattr(registry, "_REGISTRY", dict(registry._REGISTRY))
    monkeypatch.setattr(registry, "_ALIASES", dict(registry._ALIASES))


def test_a_new_schedule_is_one_class(scratch_registry):
    """What a new module under algorithms/ holds: one registered class with its plan."""

    @register_schedule
    class BackwardFirstGPipe(ScheduleAlgorithm):
        """GPipe whose drain runs the microbatches newest first."""

        name = "gpipe-lifo"
        aliases = ("LifoGPipe",)

        def slot_plans(self, prog, num_stages, unrolling) -> list[list[Slot]]:
            plans = []
            for chunks in prog.stages_of:
                seq: list[Slot] = [("fwd", s, b) for s in chunks for b in range(prog.M)]
                for s in reversed(chunks):
                    for b in reversed(range(prog.M)):
                        add_backward(seq, s, b, True)
                plans.append(seq if chunks else [])
            return plans

    assert get_schedule("lifogpipe").name == "gpipe-lifo" and aliases()["LifoGPipe"]
    sched = build_schedule(pipeline_units(2, 3), "LifoGPipe")
    assert sched.name == "gpipe-lifo"
    assert sched.labels() == [["F0", "F1", "F2", "B2", "B1", "B0"],
                              ["F0", "F1", "F2", "B2", "B1", "B0"]]
    assert sched.bubble_fraction() == pytest.approx(
        build_schedule(pipeline_units(2, 3), "gpipe").bubble_fraction())
    assert theoretical_bubble("gpipe-lifo", 2, 3) is None  # no closed form stated
    # its docstring is its entry in every listing (the pass's option, microbatch's doc)
    assert ("gpipe-lifo (alias LifoGPipe): GPipe whose drain runs the microbatches newest "
            "first.") in registry.describe_schedules()
    from multimesh.passes.base import option_doc, option_fields
    from multimesh.passes.schedule_fragments import ScheduleFragmentsPass

    [schedule] = [f for f in option_fields(ScheduleFragmentsPass) if f.name == "schedule"]
    assert "gpipe-lifo (alias LifoGPipe)" in option_doc(schedule)


@pytest.mark.parametrize("attrs,msg", [
    ({"name": "GPipe2"}, "needs a lower-case name"),
    ({"name": "x", "placement": "diagonal"}, "valid placements: contiguous, round-robin"),
    ({"name": "x", "aliases": ("wavefront",)}, "'wavefront' already means schedule '1f1b'"),
    ({"name": "1f1b"}, None),  # re-registering a name replaces it (a plugin may override)
])
def test_registration_is_checked(scratch_registry, attrs, msg):
    cls = type("Toy", (ScheduleAlgorithm,), attrs)
    if msg is None:
        register_schedule(cls)
        assert isinstance(get_schedule("1f1b"), cls)
    else:
        with pytest.raises(ValueError, match=msg):
            register_schedule(cls)


def test_the_library_imports_no_mlir_and_no_jax():
    """The schedules load alone: no jax, no MLIR bindings, no pass or front-end module."""
    code = ("import sys, multimesh.schedules as s; assert len(s.SCHEDULES) > 10; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('jax', 'jaxlib') "
            "or m.startswith(('multimesh.passes', 'multimesh.jax', 'multimesh.runtime'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=600, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_the_old_import_path_re_exports_the_library():
    old = importlib.import_module("multimesh.passes.schedules")
    new = importlib.import_module("multimesh.schedules")
    for name in new.__all__:
        assert getattr(old, name) is getattr(new, name), name


def test_the_library_is_installed():
    """pyproject.toml finds the library's packages (every package folder under multimesh/),
    so an installed multimesh has them, not only a source checkout."""
    import tomllib
    from setuptools import find_packages

    find = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"][
        "packages"]["find"]
    found = set(find_packages(str(ROOT), include=find["include"]))
    folders = {".".join(p.parent.relative_to(ROOT).parts)
               for p in (ROOT / "multimesh").rglob("__init__.py")}
    assert {"multimesh.schedules", "multimesh.schedules.algorithms"} <= folders
    assert folders <= found
