"""IR fuzzing of ``mm-opt``: mutated golden inputs never crash, hang or leave partial output.

Every chunk of every golden input (``tests/filecheck/*.mlir``) is mutated (delete,
duplicate or swap op lines, corrupt numbers, strings, types and attribute entries,
drop attribute entries, swap or misuse SSA names, truncate, splice lines from other
goldens, inject Shardy constructs) and run through the pipeline of its file's RUN
line, ``mm-verify`` and, for front-end inputs, the full ``mjit`` pipeline. For each
run, with ``-o FILE``:

* exit 1 with at least one ``error:`` diagnostic and no ``-o`` file, or
* exit 0 with no ``error:`` and an ``-o`` file that parses again;
* never a Python traceback, an ``internal error``, a signal/abort, or a run longer
  than the timeout.

Pipelines that reach native Shardy passes (``mm-propagate-shardings`` runs
``sdy-propagation-pipeline``; some Shardy passes abort the process on bad input,
/work/shared/reference/jaxlib-mlir.md section e) run in a crash-isolated worker
process that is restarted after a death; everything else runs in-process through
``multimesh.tools.mm_opt.main``. A handful also run through the real CLI in a
subprocess. ``python tools/fuzz.py --ir 5000`` runs the long profile.
"""

from __future__ import annotations

import contextlib
import dataclasses
import faulthandler
import functools
import io
import json
import os
import random
import re
import select
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GOLDEN_DIR = ROOT / "tests" / "filecheck"
TIMEOUT_S = 600.0
"""A case (or a worker's start) that runs this long is a hang. No case comes near it on a
loaded 2-core machine; a hang is a bug, whatever it costs to wait for it."""
N_IN_PROCESS = int(os.environ.get("MULTIMESH_FUZZ_IR_IN_PROCESS", "1500"))
N_ISOLATED = int(os.environ.get("MULTIMESH_FUZZ_IR_ISOLATED", "300"))

# ----------------------------------------------------------------------------- seeds


@dataclasses.dataclass(frozen=True)
class Seed:
    source: str  # golden file and chunk index, e.g. "inline_tasks.mlir#2"
    text: str
    pipelines: tuple[str, ...]


_RUN_P = re.compile(r"-p\s+'([^']*)'")


def full_pipeline() -> str:
    try:
        from multimesh.passes import PipelineOptions, build_pipeline

        return str(build_pipeline(PipelineOptions(8)))
    except Exception:  # pragma: no cover - front end mid-edit
        return ("builtin.module(mm-import-gspmd,mm-inline-tasks,mm-assign-tasks{num-devices=8},"
                "mm-resolve-logical-shardings,mm-outline-fragments,mm-propagate-shardings)")


def load_seeds() -> list[Seed]:
    """Every chunk of every golden, with the pipelines of its RUN lines plus mm-verify."""
    seeds = []
    files = sorted(GOLDEN_DIR.glob("*.mlir")) + sorted(GOLDEN_DIR.glob("*/*.mlir"))
    for path in files:
        text = path.read_text()
        pipes = []
        for line in text.splitlines():
            if line.startswith("// RUN:"):
                pipes += _RUN_P.findall(line)
        pipes.append("builtin.module(mm-verify)")
        if path.name in ("inline_tasks.mlir", "import_gspmd.mlir", "match_tasks.mlir"):
            pipes.append(full_pipeline())
        chunks = re.split(r"(?m)^// -----.*$", text)
        for i, chunk in enumerate(chunks):
            body = "\n".join(ln for ln in chunk.splitlines()
                             if not ln.lstrip().startswith("// CHECK")
                             and not ln.lstrip().startswith("// RUN"))
            if "{" not in body:
                continue
            rel = path.relative_to(GOLDEN_DIR)
            seeds.append(Seed(f"{rel}#{i}", body.strip() + "\n", tuple(dict.fromkeys(pipes))))
    return seeds


# ----------------------------------------------------------------------------- mutators

_SSA = re.compile(r"%[A-Za-z_0-9]+(?:#\d+)?")
_INT = re.compile(r"(?<![A-Za-z_%@#x0-9.])-?\d+(?![0-9.]*x?[0-9]*[A-Za-z_])")
_STR = re.compile(r'"(?:[^"\\]|\\.)*"')
_TENSOR = re.compile(r"tensor<([0-9x?]*)x?(f32|f64|i32|i64|i1|bf16|f16)>")
_DICT_ENTRY = re.compile(r"([A-Za-z_][\w.]*)\s*=\s*(\"[^\"]*\"|\[[^\[\]]*\]|[^,{}\[\]]+?)(?=[,}])")
_SDY_SNIPPETS = (
    '#sdy.sharding<@mesh_a, [{"x":(1)2}, {}]>', '#sdy.sharding<@mesh_a, [{"x"}p0, {?}]>',
    '#sdy.sharding<@mesh_a, [{}, {}], replicated={"x"}>', '#sdy.sharding<@mesh_b, [{"y", "x"}, {}]>',
    '#sdy.sharding<@mesh_a, [{"x"}, {"x"}]>', '#sdy.sharding<@mesh_a, [{"nope"}, {}]>',
    '#sdy.sharding<@mesh_a, []>', '#sdy.sharding<@mesh_a, [{"x", ?}, {}]>',
    '#sdy.sharding<@mesh_a, [{"x"}, {}, {}]>', '#sdy.sharding<@nomesh, [{}, {}]>',
)
_SDY_MESHES = ('<["x"=2]>', '<["x"=2], device_ids=[1, 0]>', '<[], device_ids=[0]>', "<[]>",
               '<["x"=1]>', '<["x"=2, "y"=2]>', '<["x"=4]>', '<["y"=2]>', '<["x"=3]>')
_NUMS = ("0", "-1", "1", "2", "3", "7", "8", "9", "16", "4294967296", "99999999999999999999")
_STRS = ('""', '"x"', '"y"', '"z"', '"a"', '"b"', '"main"', '"mesh_a"', '"mm.default"',
         '"x y"', '"\\22"', '"mm.logical_sharding"', '"Sharding"', '"{devices=[2]<=[2]}"')
_ATTR_NAMES = ("mm.task", "mm.tasks", "mm.fragment", "mm.devices", "mm.mesh", "mm.axes",
               "sdy.sharding", "mm.sharding", "mhlo.sharding", "transpose_count", "devices",
               "axis_names", "axis_sizes", "logical_axes", "name", "callee", "mm.num_devices")


_TOKEN = re.compile(r"\S+")


def _code_lines(lines):
    return [i for i, ln in enumerate(lines) if ln.strip() and not ln.lstrip().startswith("//")]


def _m_delete_line(text, rng):
    lines = text.splitlines()
    idx = _code_lines(lines)
    if idx:
        del lines[rng.choice(idx)]
    return "\n".join(lines)


def _m_duplicate_line(text, rng):
    lines = text.splitlines()
    idx = _code_lines(lines)
    if idx:
        i = rng.choice(idx)
        lines.insert(i + rng.choice((0, 1, 2)), lines[i])
    return "\n".join(lines)


def _m_swap_lines(text, rng):
    lines = text.splitlines()
    idx = _code_lines(lines)
    if len(idx) >= 2:
        i = rng.choice(idx)
        j = rng.choice([k for k in idx if abs(k - i) <= 4 and k != i] or idx)
        lines[i], lines[j] = lines[j], lines[i]
    return "\n".join(lines)


def _m_truncate(text, rng):
    return text[: rng.randint(0, max(0, len(text) - 1))]


def _m_swap_ssa(text, rng):
    names = sorted(set(_SSA.findall(text)))
    if len(names) < 2:
        return text
    a, b = rng.sample(names, 2)
    return _SSA.sub(lambda m: b if m.group(0) == a else a if m.group(0) == b else m.group(0),
                    text)


def _m_replace_one_ssa_use(text, rng):
    ms = list(_SSA.finditer(text))
    names = sorted({m.group(0) for m in ms})
    if len(names) < 2:
        return text
    m = rng.choice(ms)
    new = rng.choice([n for n in names if n != m.group(0)] + ["%undefined", "%arg9", "%0#7"])
    return text[: m.start()] + new + text[m.end():]


def _replace_one(text, rng, pattern, new):
    """Replace one match of ``pattern`` (picked by ``rng``) by ``new(match, matches)``."""
    ms = list(pattern.finditer(text))
    if not ms:
        return text
    m = rng.choice(ms)
    return text[: m.start()] + new(m, ms) + text[m.end():]


def _m_corrupt_number(text, rng):
    return _replace_one(text, rng, _INT, lambda m, ms: rng.choice(_NUMS))


def _m_corrupt_string(text, rng):
    return _replace_one(text, rng, _STR,
                        lambda m, ms: rng.choice(list(_STRS) + [x.group(0) for x in ms]))


def _other_type(m, rng):
    dims = [d for d in m.group(1).split("x") if d]
    r = rng.randint(0, 3)
    if r == 0:
        return f"tensor<{'x'.join(dims + [''])}{rng.choice(('i32', 'f64', 'i1', 'bf16'))}>"
    if r == 1 and dims:
        return f"tensor<{'x'.join(dims[::-1] + [''])}{m.group(2)}>"
    if r == 2 and dims:
        dims[rng.randrange(len(dims))] = rng.choice(("1", "3", "16", "0", "?"))
        return f"tensor<{'x'.join(dims + [''])}{m.group(2)}>"
    return f"tensor<{m.group(2)}>"


def _m_corrupt_type(text, rng):
    return _replace_one(text, rng, _TENSOR, lambda m, ms: _other_type(m, rng))


def _m_delete_dict_entry(text, rng):
    ms = list(_DICT_ENTRY.finditer(text))
    if not ms:
        return text
    m = rng.choice(ms)
    start, end = m.start(), m.end()
    if text[end:end + 1] == ",":
        end += 1
    elif text[max(0, start - 2):start] == ", ":
        start -= 2
    return text[:start] + text[end:]


def _m_rename_attr(text, rng):
    present = [a for a in _ATTR_NAMES if a in text]
    if not present:
        return text
    a = rng.choice(present)
    b = rng.choice([x for x in _ATTR_NAMES if x != a] + [a + "x", a.replace(".", "_")])
    occ = [m.start() for m in re.finditer(re.escape(a), text)]
    i = rng.choice(occ)
    return text[:i] + b + text[i + len(a):]


def _m_delete_token(text, rng):
    return _replace_one(text, rng, _TOKEN, lambda m, ms: "")


def _m_insert_junk(text, rng):
    i = rng.randint(0, len(text))
    junk = rng.choice(("}", "{", ")", "(", ",", "%", "@", ":", "\"", "<", ">", "[", "]",
                       "\x00", "é", "#sdy", "// -----\n", "\n}\n", "module {"))
    return text[:i] + junk + text[i:]


def _m_inject_sdy(text, rng):
    r = rng.randint(0, 2)
    if r == 0:
        ms = list(re.finditer(r"#sdy\.sharding<[^>]*>", text))
        if ms:
            m = rng.choice(ms)
            return text[: m.start()] + rng.choice(_SDY_SNIPPETS) + text[m.end():]
    if r == 1:
        ms = list(re.finditer(r"sdy\.mesh @(\w+) = <[^>]*>", text))
        if ms:
            m = rng.choice(ms)
            return (text[: m.start()] + f"sdy.mesh @{m.group(1)} = {rng.choice(_SDY_MESHES)}"
                    + text[m.end():])
    # a sharding on a fragment argument or result
    ms = list(re.finditer(r"(%arg\d+: tensor<[^>]*>)(?! \{)", text))
    if ms:
        m = rng.choice(ms)
        return (text[: m.end()] + f" {{sdy.sharding = {rng.choice(_SDY_SNIPPETS)}}}"
                + text[m.end():])
    return text


MUTATORS = {
    "delete_line": _m_delete_line, "duplicate_line": _m_duplicate_line,
    "swap_lines": _m_swap_lines, "truncate": _m_truncate, "swap_ssa": _m_swap_ssa,
    "replace_ssa_use": _m_replace_one_ssa_use, "corrupt_number": _m_corrupt_number,
    "corrupt_string": _m_corrupt_string, "corrupt_type": _m_corrupt_type,
    "delete_dict_entry": _m_delete_dict_entry, "rename_attr": _m_rename_attr,
    "delete_token": _m_delete_token, "insert_junk": _m_insert_junk, "inject_sdy": _m_inject_sdy,
}


def _splice(text, rng, seeds):
    other = rng.choice(seeds).text.splitlines()
    idx = _code_lines(other)
    if not idx:
        return text, "splice"
    lines = text.splitlines()
    lines.insert(rng.randint(0, len(lines)), other[rng.choice(idx)])
    return "\n".join(lines), "splice"


@dataclasses.dataclass(frozen=True)
class Case:
    id: int
    seed: str
    mutations: tuple[str, ...]
    pipeline: str
    text: str

    @property
    def isolated(self) -> bool:
        return needs_isolation(self.pipeline)


def needs_isolation(pipeline: str) -> bool:
    """Pipelines that reach native Shardy passes, which may abort the process."""
    return "mm-propagate-shardings" in pipeline or "sdy-" in pipeline


def make_cases(n: int, seed: int, *, isolated: bool | None = None) -> list[Case]:
    """``n`` mutated inputs, deterministic in ``seed``; ``isolated`` filters by pipeline kind."""
    rng = random.Random(seed)
    seeds = load_seeds()
    pool = [(s, p) for s in seeds for p in s.pipelines
            if isolated is None or needs_isolation(p) == isolated]
    names = sorted(MUTATORS)
    cases = []
    while len(cases) < n:
        s, pipe = rng.choice(pool)
        text, muts = s.text, []
        for _ in range(rng.choice((1, 1, 1, 2, 3))):
            if rng.random() < 0.05:
                text, name = _splice(text, rng, seeds)
            else:
                name = rng.choice(names)
                if isolated and rng.random() < 0.3:
                    name = "inject_sdy"
                text = MUTATORS[name](text, rng)
            muts.append(name)
        if text == s.text:
            continue
        cases.append(Case(len(cases), s.source, tuple(muts), pipe, text))
    return cases


COMPILE_MPMD = "compile_mpmd"
"""A case "pipeline" that runs ``multimesh.jax.compile_mpmd(text, meshes)`` instead of
``mm-opt`` (exit 1: a ``MultimeshError``; anything else is an internal error)."""
_MPMD_MESHES = {"m1": range(4), "m2": range(4, 8), "m3": range(8)}


def _mpmd_seeds(seeds: list[Seed]) -> list[Seed]:
    """The Shardy:MPMD-partitioned seeds (``compile_mpmd``'s input)."""
    return [s for s in seeds if "mpmd.fragment_call" in s.text or "mpmd.transfer" in s.text]


def make_attr_cases(n: int, seed: int, *, compile_share: float = 0.03) -> list[Case]:
    """``n`` inputs whose attributes have other types and values
    (:func:`tests.fuzz.ir_attrs.mutate_attributes`, one or two per input), on the seeds'
    pipelines; ``compile_share`` of them go to ``compile_mpmd`` (partitioned seeds).
    Every one runs in the crash-isolated worker: parsing such input is what crashed."""
    from tests.fuzz.ir_attrs import mutate_attributes

    rng = random.Random(seed)
    seeds = load_seeds()
    pool = [(s, p) for s in seeds for p in s.pipelines]
    mpmd = _mpmd_seeds(seeds)
    cases: list[Case] = []
    while len(cases) < n:
        if mpmd and rng.random() < compile_share:
            s, pipe = rng.choice(mpmd), COMPILE_MPMD
        else:
            s, pipe = rng.choice(pool)
        count = rng.choice((1, 1, 1, 2))
        text, muts = mutate_attributes(s.text, rng, count), ("attr_type",) * count
        if text == s.text:
            continue
        cases.append(Case(len(cases), s.source, muts, pipe, text))
    return cases


def run_compile_mpmd(case: Case) -> Result:
    """``compile_mpmd`` on the case's text, as a :class:`Result` ``problems`` reads."""
    import traceback

    import multimesh.jax as mm
    from multimesh._src.errors import MultimeshError

    t0 = time.perf_counter()
    try:
        mm.compile_mpmd(case.text, _MPMD_MESHES if "m3" in case.text else
                        {k: v for k, v in _MPMD_MESHES.items() if k != "m3"})
        rc, err = 0, ""
    except MultimeshError as e:
        rc, err = 1, f"error: {e}"
    except Exception as e:  # noqa: BLE001 - what the fuzzer looks for
        rc, err = 1, "internal error: " + "".join(traceback.format_exception(e))
    return Result(rc, "", err, rc == 0, True if rc == 0 else None, time.perf_counter() - t0)


# ----------------------------------------------------------------------------- running


@dataclasses.dataclass
class Result:
    rc: int | None  # None: killed by a signal or timed out
    stdout: str
    stderr: str
    wrote_output: bool
    output_reparses: bool | None
    seconds: float
    how: str = "in-process"  # in-process | worker | cli


def run_in_process(case: Case, workdir: str) -> Result:
    from multimesh.tools.mm_opt import main

    if case.pipeline == COMPILE_MPMD:
        return run_compile_mpmd(case)

    inp = os.path.join(workdir, f"case{case.id}.mlir")
    out = os.path.join(workdir, f"case{case.id}.out.mlir")
    with open(inp, "w", encoding="utf-8", errors="surrogatepass") as f:
        f.write(case.text)
    o, e = io.StringIO(), io.StringIO()
    t0 = time.perf_counter()
    with contextlib.redirect_stdout(o), contextlib.redirect_stderr(e):
        try:
            rc = main([inp, "-p", case.pipeline, "-o", out])
        except BaseException as ex:  # noqa: BLE001 - a crash is what we look for
            import traceback

            e.write("Traceback (escaped main):\n" + "".join(
                traceback.format_exception(type(ex), ex, ex.__traceback__)))
            rc = -999
    dt = time.perf_counter() - t0
    wrote = os.path.exists(out)
    reparses = None
    if wrote:
        reparses = _reparses(out)
        os.unlink(out)
    os.unlink(inp)
    return Result(rc, o.getvalue(), e.getvalue(), wrote, reparses, dt)


@functools.cache
def _probe_context():
    """One single-threaded context per process for this file's own parse checks (does a
    case parse, does an output reparse): a fresh context costs about 9 ms, as much as a
    case, and a parse leaves nothing in it that changes whether the next one parses
    (the same answers as a fresh context for all N_IN_PROCESS cases; mm-opt itself
    still gets a fresh context per run)."""
    from multimesh._src.mlir import make_context

    return make_context()  # multithreading off


def _reparses(path: str) -> bool:
    from multimesh._src.mlir import ir

    try:
        with _probe_context():
            ir.Module.parse(Path(path).read_text())
        return True
    except Exception:  # noqa: BLE001
        return False


def problems(case: Case, r: Result, timeout: float = TIMEOUT_S) -> list[str]:
    """Everything wrong with one run (empty: a clean diagnostic or a clean success)."""
    out = []
    err = r.stderr
    if r.rc is None:
        out.append(f"killed or hung ({r.how}): {err[-300:]}")
        return out
    if r.seconds > timeout:
        out.append(f"slow: {r.seconds:.1f}s")
    if "Traceback" in err:
        out.append("python traceback")
    if "internal error" in err:
        out.append("internal error: " + next(ln for ln in err.splitlines()
                                             if "internal error" in ln))
    if r.rc not in (0, 1):
        out.append(f"exit code {r.rc}")
    if r.rc == 1:
        if "error:" not in err:
            out.append("exit 1 without an error diagnostic")
        if r.wrote_output:
            out.append("partial output: -o written on failure")
    if r.rc == 0:
        if re.search(r"(^|\s)error:", err):
            out.append("exit 0 with an error diagnostic")
        if not r.wrote_output:
            out.append("exit 0 without writing -o")
        elif r.output_reparses is False:
            out.append("output does not parse again")
    if r.stdout.strip():
        out.append("stdout written although -o was given")
    return out


# -- Shardy probes: MPMD-form modules whose one fragment holds a construct that reaches
# deep into sdy-propagation-pipeline (manual computations, sharding groups, explicit
# collectives, data-flow edges, sharding rules, sub-axes, unreduced axes, loops).

_PROBE_HEAD = """module attributes {mm.tasks = {a = {devices = [0, 1, 2, 3], axis_names = ["x", "y"], \
axis_sizes = [2, 2], logical_axes = []}}} {
  sdy.mesh @mesh_a = <["x"=2, "y"=2]>
  func.func @main(%arg0: tensor<8x8xf32>) -> tensor<8x8xf32> {
    %0 = call @a_fwd(%arg0) {mm.fragment} : (tensor<8x8xf32>) -> tensor<8x8xf32>
    return %0 : tensor<8x8xf32>
  }
  func.func private @a_fwd(%arg0: tensor<8x8xf32>) -> tensor<8x8xf32> attributes \
{mm.devices = [0, 1, 2, 3], mm.mesh = @mesh_a, mm.task = {name = "a", transpose_count = 0 : i64}} {
"""
_T = "tensor<8x8xf32>"
_PROBE_BODIES = {
    "manual": f"""%0 = sdy.manual_computation(%arg0) in_shardings=[<@mesh_a, [{{"x"}}, {{}}]>] \
out_shardings=[<@mesh_a, [{{"x"}}, {{}}]>] manual_axes={{"x"}} (%a: tensor<4x8xf32>) {{
      %1 = stablehlo.negate %a : tensor<4x8xf32>
      sdy.return %1 : tensor<4x8xf32>
    }} : ({_T}) -> {_T}
    return %0 : {_T}""",
    "manual-shape-mismatch": f"""%0 = sdy.manual_computation(%arg0) in_shardings=[<@mesh_a, \
[{{"y"}}, {{}}]>] out_shardings=[<@mesh_a, [{{"x"}}, {{}}]>] manual_axes={{"x"}} (%a: {_T}) {{
      sdy.return %a : {_T}
    }} : ({_T}) -> {_T}
    return %0 : {_T}""",
    "nested-manual": f"""%0 = sdy.manual_computation(%arg0) in_shardings=[<@mesh_a, [{{"x"}}, {{}}]>] \
out_shardings=[<@mesh_a, [{{"x"}}, {{}}]>] manual_axes={{"x"}} (%a: tensor<4x8xf32>) {{
      %1 = sdy.manual_computation(%a) in_shardings=[<@mesh_a, [{{}}, {{"y"}}]>] \
out_shardings=[<@mesh_a, [{{}}, {{"y"}}]>] manual_axes={{"y"}} (%b: tensor<4x4xf32>) {{
        sdy.return %b : tensor<4x4xf32>
      }} : (tensor<4x8xf32>) -> tensor<4x8xf32>
      sdy.return %1 : tensor<4x8xf32>
    }} : ({_T}) -> {_T}
    return %0 : {_T}""",
    "sharding-groups": f"""%0 = sdy.sharding_constraint %arg0 <@mesh_a, [{{"x"}}, {{}}]> : {_T}
    %1 = stablehlo.negate %0 : {_T}
    sdy.sharding_group %0 group_id=0 : {_T}
    sdy.sharding_group %1 group_id=0 : {_T}
    %2 = sdy.sharding_constraint %1 <@mesh_a, [{{}}, {{"x"}}]> : {_T}
    sdy.sharding_group %2 group_id=0 : {_T}
    return %2 : {_T}""",
    "reshard-chain": f"""%0 = sdy.reshard %arg0 <@mesh_a, [{{"x"}}, {{"y"}}]> : {_T}
    %1 = sdy.reshard %0 <@mesh_a, [{{"y"}}, {{"x"}}]> : {_T}
    return %1 : {_T}""",
    "barriers": f"""%0 = sdy.propagation_barrier %arg0 allowed_direction=FORWARD : {_T}
    %1 = sdy.propagation_barrier %0 allowed_direction=NONE : {_T}
    %2 = sdy.sharding_constraint %1 <@mesh_a, [{{"x"}}, {{"y"}}]> : {_T}
    return %2 : {_T}""",
    "data-flow-edge": f"""%0 = stablehlo.negate %arg0 : {_T}
    %1 = sdy.data_flow_edge %0 : {_T}
    return %1 : {_T}""",
    "func-data-flow-edge": f"""%0 = sdy.func_data_flow_edge %arg0 : {_T}
    return %0 : {_T}""",
    "sharding-rule": f"""%0 = stablehlo.custom_call @foo(%arg0) {{sdy.sharding_rule = \
#sdy.op_sharding_rule<([i, j])->([j, i]) {{i=8, j=8}}>}} : ({_T}) -> {_T}
    %1 = sdy.sharding_constraint %0 <@mesh_a, [{{"x"}}, {{"y"}}]> : {_T}
    return %1 : {_T}""",
    "sharding-rule-reduction": f"""%0 = stablehlo.custom_call @foo(%arg0) {{sdy.sharding_rule = \
#sdy.op_sharding_rule<([i, j])->([i, k]) {{i=8, j=8, k=8}} reduction={{j}}>}} : ({_T}) -> {_T}
    %1 = sdy.sharding_constraint %0 <@mesh_a, [{{"x"}}, {{"y"}}]> : {_T}
    return %1 : {_T}""",
    "reshape-merged-axes": f"""%0 = sdy.sharding_constraint %arg0 <@mesh_a, [{{"x"}}, {{"y"}}]> : {_T}
    %1 = stablehlo.reshape %0 : ({_T}) -> tensor<64xf32>
    %2 = sdy.sharding_constraint %1 <@mesh_a, [{{"y", "x"}}]> : tensor<64xf32>
    %3 = stablehlo.reshape %2 : (tensor<64xf32>) -> {_T}
    return %3 : {_T}""",
    "full-sub-axis": f"""%0 = sdy.sharding_constraint %arg0 <@mesh_a, [{{"x":(1)2}}, {{}}]> : {_T}
    return %0 : {_T}""",
    "unreduced": f"""%0 = sdy.sharding_constraint %arg0 <@mesh_a, [{{}}, {{}}], unreduced={{"x"}}> : {_T}
    return %0 : {_T}""",
    "explicit-collectives": f"""%0 = sdy.sharding_constraint %arg0 <@mesh_a, [{{"x"}}, {{}}]> : {_T}
    %1 = sdy.all_gather [{{"x"}}, {{}}] %0 out_sharding=<@mesh_a, [{{}}, {{}}]> : {_T}
    %2 = sdy.collective_permute %1 out_sharding=<@mesh_a, [{{"y"}}, {{}}]> : {_T}
    %3 = sdy.all_reduce {{"x"}} %2 out_sharding=<@mesh_a, [{{"y"}}, {{}}]> : {_T}
    return %3 : {_T}""",
    "sdy-constant": f"""%0 = sdy.constant dense<1.0> : {_T}
    %1 = stablehlo.add %0, %arg0 : {_T}
    return %1 : {_T}""",
    "named-computation": f"""%0 = sdy.named_computation<"foo">(%arg0) in_shardings=[<@mesh_a, \
[{{"x"}}, {{}}]>] out_shardings=[<@mesh_a, [{{}}, {{"y"}}]>] (%a: {_T}) {{
      sdy.return %a : {_T}
    }} : ({_T}) -> {_T}
    return %0 : {_T}""",
    "zero-size": f"""%0 = stablehlo.slice %arg0 [0:0, 0:8] : ({_T}) -> tensor<0x8xf32>
    %1 = sdy.sharding_constraint %0 <@mesh_a, [{{"x"}}, {{"y"}}]> : tensor<0x8xf32>
    %2 = stablehlo.concatenate %1, %arg0, dim = 0 : (tensor<0x8xf32>, {_T}) -> {_T}
    return %2 : {_T}""",
    "while-loop": f"""%c = stablehlo.constant dense<0> : tensor<i32>
    %c1 = stablehlo.constant dense<1> : tensor<i32>
    %c4 = stablehlo.constant dense<4> : tensor<i32>
    %0:2 = stablehlo.while(%i = %c, %x = %arg0) : tensor<i32>, {_T}
     cond {{
      %p = stablehlo.compare LT, %i, %c4 : (tensor<i32>, tensor<i32>) -> tensor<i1>
      stablehlo.return %p : tensor<i1>
    }} do {{
      %n = stablehlo.add %i, %c1 : tensor<i32>
      %y = sdy.sharding_constraint %x <@mesh_a, [{{"x"}}, {{"y"}}]> : {_T}
      %z = stablehlo.transpose %y, dims = [1, 0] : ({_T}) -> {_T}
      stablehlo.return %n, %z : tensor<i32>, {_T}
    }}
    return %0#1 : {_T}""",
    "conflicting-dots": f"""%0 = stablehlo.dot_general %arg0, %arg0, contracting_dims = [1] x [0] \
{{sdy.sharding = #sdy.sharding_per_value<[<@mesh_a, [{{"x"}}, {{"y"}}]>]>}} : ({_T}, {_T}) -> {_T}
    %1 = sdy.sharding_constraint %0 <@mesh_a, [{{"y"}}, {{"x"}}]> : {_T}
    %2 = stablehlo.dot_general %1, %0, contracting_dims = [0] x [1] : ({_T}, {_T}) -> {_T}
    return %2 : {_T}""",
}


def sdy_probes() -> dict[str, str]:
    return {name: _PROBE_HEAD + "    " + body + "\n  }\n}\n"
            for name, body in _PROBE_BODIES.items()}


# -- crash-isolated worker: one process runs many cases, restarted after a death


def _worker_main() -> int:  # pragma: no cover - runs in the subprocess
    sys.path.insert(0, str(ROOT))
    os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    workdir = tempfile.mkdtemp(prefix="mm-fuzz-ir-")
    chan = sys.__stdout__
    for line in sys.stdin:
        d = json.loads(line)
        case = Case(d["id"], d["seed"], tuple(d["mutations"]), d["pipeline"], d["text"])
        r = run_in_process(case, workdir)
        chan.write(json.dumps(dataclasses.asdict(r)) + "\n")
        chan.flush()
    return 0


class IsolatedRunner:
    """Runs cases in a worker process; a death or hang costs one case and a restart."""

    def __init__(self, timeout: float = TIMEOUT_S):
        self.timeout = timeout
        self.proc = None
        self.restarts = 0
        self._err = None

    def _start(self):
        self._err = tempfile.TemporaryFile()
        env = dict(os.environ, PYTHONPATH=str(ROOT))
        self.proc = subprocess.Popen(
            [sys.executable, "-u", str(Path(__file__).resolve()), "--worker"], cwd=str(ROOT),
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._err, text=True,
            env=env)

    def _stderr_tail(self) -> str:
        self._err.seek(0)
        return self._err.read().decode(errors="replace")[-2000:]

    def run(self, case: Case) -> Result:
        if self.proc is None or self.proc.poll() is not None:
            self._start()
        t0 = time.perf_counter()
        self.proc.stdin.write(json.dumps(dataclasses.asdict(case) | {}) + "\n")
        self.proc.stdin.flush()
        ready, _, _ = select.select([self.proc.stdout], [], [], self.timeout)
        line = self.proc.stdout.readline() if ready else ""
        if line:
            d = json.loads(line)
            return Result(**(d | {"how": "worker"}))
        # died or hung
        if not ready:
            self.proc.kill()
        self.proc.wait()
        rc = self.proc.returncode
        tail = self._stderr_tail()
        self.proc = None
        self.restarts += 1
        what = "timeout" if not ready else f"worker died with exit status {rc}"
        return Result(None, "", f"{what}\n{tail}", False, None, time.perf_counter() - t0,
                      "worker")

    def close(self):
        if self.proc is not None:
            self.proc.stdin.close()
            self.proc.wait(timeout=300)
            self.proc = None


def run_cli(case: Case, workdir: str, timeout: float = TIMEOUT_S) -> Result:
    """The real CLI in its own process (hard aborts and hangs show up as such)."""
    inp = os.path.join(workdir, f"cli{case.id}.mlir")
    out = os.path.join(workdir, f"cli{case.id}.out.mlir")
    Path(inp).write_text(case.text, errors="surrogatepass")
    if os.path.exists(out):  # an earlier case with the same id wrote it
        os.remove(out)
    t0 = time.perf_counter()
    try:
        p = subprocess.run([sys.executable, "-m", "multimesh.tools.mm_opt", inp, "-p",
                            case.pipeline, "-o", out], capture_output=True, text=True,
                           timeout=timeout, cwd=str(ROOT), env=dict(os.environ,
                                                                   PYTHONPATH=str(ROOT)))
        rc, so, se = p.returncode, p.stdout, p.stderr
        if rc < 0:
            se = f"killed by signal {-rc}\n{se}"
            rc = None
    except subprocess.TimeoutExpired:
        rc, so, se = None, "", "timeout"
    wrote = os.path.exists(out)
    reparses = _reparses(out) if wrote else None
    return Result(rc, so, se, wrote, reparses, time.perf_counter() - t0, "cli")


# Known library bugs, each pinned by a strict xfail test below (docs/testing.md, "Bugs
# found"). A run whose problems are all explained by one of these is counted, not failed.
# Remove an entry when its bug is fixed (its xfail then XPASSes and fails).
KNOWN_IR_BUGS: dict[str, str] = {}
# symptoms that follow from an internal error (its message may quote a callback's traceback)
_SECONDARY = ("exit 1 without an error diagnostic", "python traceback")


def parses_single_threaded(text: str) -> bool:
    """Whether ``text`` parses in a context with MLIR multithreading off (never hangs)."""
    from multimesh._src.mlir import ir

    try:
        with _probe_context():
            ir.Module.parse(text)
        return True
    except Exception:  # noqa: BLE001
        return False


def known_bug(case: Case, found: list[str]) -> str | None:
    """The KNOWN_IR_BUGS entry that explains every problem of a run, if any."""
    for name, pattern in KNOWN_IR_BUGS.items():
        hit = [f for f in found if re.search(pattern, f)]
        if hit and all(f in hit or f in _SECONDARY for f in found):
            return name
    return None


def describe(case: Case, r: Result, found: list[str]) -> str:
    return (f"case {case.id} from {case.seed} after {list(case.mutations)}\n"
            f"  pipeline: {case.pipeline}\n  problems: {found}\n"
            f"  stderr: {r.stderr.strip()[-600:]}\n--- input ---\n{case.text[:3000]}")


# ----------------------------------------------------------------------------- tests


def test_seeds_cover_every_golden():
    seeds = load_seeds()
    files = {s.source.split("#")[0] for s in seeds}
    assert len(files) >= 8, files
    assert any(needs_isolation(p) for s in seeds for p in s.pipelines)


def test_mutations_are_deterministic():
    a = make_cases(50, 7)
    b = make_cases(50, 7)
    assert a == b and len({c.text for c in a}) > 40


def _tally(cases, run) -> tuple[list[str], dict]:
    bad, outcome = [], {"diagnosed": 0, "clean": 0}
    for case in cases:
        r = run(case)
        found = problems(case, r)
        if not found:
            outcome["clean" if r.rc == 0 else "diagnosed"] += 1
            continue
        known = known_bug(case, found)
        if known:
            outcome[known] = outcome.get(known, 0) + 1
        else:
            bad.append(describe(case, r, found))
    return bad, outcome


def _watched(case: Case, workdir: str) -> Result:
    """In-process run; a hang (which Python cannot interrupt) ends the process loudly
    with every thread's traceback instead of stalling CI."""
    faulthandler.dump_traceback_later(TIMEOUT_S, exit=True)
    try:
        return run_in_process(case, workdir)
    finally:
        faulthandler.cancel_dump_traceback_later()


def _assert_none_bad(bad: list[str], cases: list[Case]) -> None:
    assert not bad, f"{len(bad)} of {len(cases)} mutated inputs misbehaved:\n\n" + \
        "\n\n".join(bad[:5])


def _run_isolated(cases: list[Case], label: str) -> dict:
    """Run ``cases`` in the crash-isolated worker, print the tally and assert that none
    misbehaved; returns the outcome counts."""
    runner = IsolatedRunner()
    try:
        bad, outcome = _tally(cases, runner.run)
    finally:
        runner.close()
    print(f"{label}: {len(cases)} inputs, {outcome}, worker restarts {runner.restarts}")
    _assert_none_bad(bad, cases)
    return outcome


def test_mutated_inputs_in_process(tmp_path):
    """N_IN_PROCESS mutated inputs on pipelines without native Shardy passes.

    Inputs that parse run in this process. Inputs that do not parse go to the worker:
    parsing some of them hangs in jaxlib (ir-parallel-verifier-hang), and a hang there
    costs one case, not the test run.
    """
    cases = make_cases(N_IN_PROCESS, 1, isolated=False)
    runner = IsolatedRunner()
    counts = {"in-process": 0, "worker": 0}

    def run(c):
        if parses_single_threaded(c.text):
            counts["in-process"] += 1
            return _watched(c, str(tmp_path))
        counts["worker"] += 1
        return runner.run(c)

    try:
        bad, outcome = _tally(cases, run)
    finally:
        runner.close()
    print(f"IR fuzzing without Shardy: {len(cases)} inputs ({counts}), {outcome}, "
          f"worker restarts {runner.restarts}")
    _assert_none_bad(bad, cases)
    assert outcome["diagnosed"] > len(cases) // 3, outcome


def test_mutated_inputs_isolated():
    """N_ISOLATED mutated inputs on pipelines that reach sdy-propagation-pipeline, plus
    the Shardy probes, in a crash-isolated worker."""
    cases = make_cases(N_ISOLATED, 2, isolated=True)
    cases += [Case(len(cases) + i, f"probe:{name}", ("probe",),
                   "builtin.module(mm-propagate-shardings)", text)
              for i, (name, text) in enumerate(sdy_probes().items())]
    _run_isolated(cases, "isolated IR fuzzing")


N_ATTRS = int(os.environ.get("MULTIMESH_FUZZ_IR_ATTRS", "200"))


def test_attribute_types_and_values_isolated():
    """N_ATTRS inputs whose attributes have other types and values (fixed seed), in the
    crash-isolated worker, a few through ``compile_mpmd``; ``tools/fuzz.py --ir-attrs``
    runs the long profile (docs/testing.md)."""
    cases = make_attr_cases(N_ATTRS, 5, compile_share=0.05)
    assert any(c.pipeline == COMPILE_MPMD for c in cases)
    outcome = _run_isolated(cases, "attribute fuzzing")
    assert outcome["diagnosed"] > len(cases) // 4, outcome


def test_attribute_mutations_change_types():
    """The mutator reaches values of other types inside the attributes multimesh reads."""
    from tests.fuzz.ir_attrs import mutate_attributes

    seed = next(s for s in load_seeds() if s.source == "schedule_fragments.mlir#0")
    rng = random.Random(0)
    texts = {mutate_attributes(seed.text, rng) for _ in range(60)}
    assert len(texts) > 40
    assert any("mm.schedule_config" in t and "schedule = \"gpipe\"" not in t for t in texts)
    devices = {m for t in texts for m in re.findall(r"mm\.devices = (\[[^\]]*\]|[^ ,}]+)", t)}
    assert devices - {"[0, 1]", "[2, 3]"}, devices  # other values, other types


def test_handful_through_the_cli(tmp_path):
    """A few mutated inputs through ``python -m multimesh.tools.mm_opt`` with a timeout."""
    cases = make_cases(4, 3, isolated=False) + make_cases(4, 4, isolated=True)
    bad = []
    for case in cases:
        r = run_cli(case, str(tmp_path))
        found = problems(case, r)
        if found:
            bad.append(describe(case, r, found))
    assert not bad, "\n\n".join(bad)


# ----------------------------------------------------------------------------- regressions
# Minimal repros of the bugs IR fuzzing found, all fixed (docs/testing.md, "Bugs found").
# A new bug found by fuzzing goes here as a strict xfail plus a KNOWN_IR_BUGS entry, and
# both are removed together when it is fixed.

_TASK_CALL = """func.func @main(%arg0: tensor<8xf32>) -> tensor<8xf32> {{
  %0 = func.call @body(%arg0) {{mm.task = {{{task}}}}} : (tensor<8xf32>) -> tensor<8xf32>
  return %0 : tensor<8xf32>
}}
func.func private @body(%arg0: tensor<8xf32>) -> tensor<8xf32> {{
  %0 = stablehlo.negate %arg0 : tensor<8xf32>
  return %0 : tensor<8xf32>
}}
"""


def _task_call(name: str | None = '"t"', sizes: str = "[2]", logical_axes: bool = True) -> str:
    """``_TASK_CALL`` with a task named ``name`` (none: no name) on devices [0, 1], axis
    ``x`` of sizes ``sizes``, and ``logical_axes = []`` unless told not to."""
    attrs = ([f"name = {name}"] if name is not None else []) + [
        "transpose_count = 0 : i64", "devices = [0, 1]", 'axis_names = ["x"]',
        f"axis_sizes = {sizes}"] + (["logical_axes = []"] if logical_axes else [])
    return _TASK_CALL.format(task=", ".join(attrs))


def _mm_opt(tmp_path, text: str, pipeline: str) -> Result:
    case = Case(0, "regression", (), pipeline, text)
    return run_in_process(case, str(tmp_path))


def _assert_clean(case_text: str, r: Result):
    found = problems(Case(0, "regression", (), "", case_text), r)
    assert not found, (found, r.stderr)


def _assert_rejected(case_text: str, r: Result, message: str):
    """A clean diagnostic (exit 1, no internal error) that says ``message``."""
    _assert_clean(case_text, r)
    assert r.rc == 1 and f"error: {message}" in r.stderr, r.stderr


def test_verify_accepts_task_call_without_logical_axes(tmp_path):
    """mm-verify treats logical_axes as optional on a task call (docs/ir.md section 1)."""
    text = _task_call(logical_axes=False)
    r = _mm_opt(tmp_path, text, "builtin.module(mm-verify)")
    assert r.rc == 0, r.stderr


def test_regression_inline_tasks_missing_logical_axes(tmp_path):
    """Found by IR fuzzing (KeyError 'logical_axes'), fixed: logical_axes is optional."""
    text = _task_call(logical_axes=False)
    _assert_clean(text, _mm_opt(tmp_path, text, "builtin.module(mm-inline-tasks)"))


def test_regression_inline_tasks_missing_name(tmp_path):
    text = _task_call(name=None, logical_axes=False)
    _assert_rejected(text, _mm_opt(tmp_path, text, "builtin.module(mm-inline-tasks)"),
                     "'mm.task' is missing 'name'")


def test_regression_outline_task_not_in_table(tmp_path):
    text = """module attributes {mm.tasks = {}} {
  func.func @main(%arg0: tensor<8xf32>) -> tensor<8xf32> {
    %0 = stablehlo.negate %arg0 {mm.task = {name = "a", transpose_count = 0 : i64}} : tensor<8xf32>
    return %0 : tensor<8xf32>
  }
}
"""
    _assert_rejected(text, _mm_opt(tmp_path, text, "builtin.module(mm-outline-fragments)"),
                     "'mm.task' on 'stablehlo.negate' names task \"a\" which is not in 'mm.tasks'")


def test_regression_assign_tag_without_transpose_count(tmp_path):
    text = """module attributes {mm.tasks = {a = {devices = [0, 1], axis_names = ["x"], axis_sizes = [2], logical_axes = []}}} {
  func.func @main(%arg0: tensor<8xf32>) -> tensor<8xf32> {
    %0 = stablehlo.negate %arg0 {mm.task = {name = "a"}} : tensor<8xf32>
    %1 = stablehlo.sine %0 : tensor<8xf32>
    return %1 : tensor<8xf32>
  }
}
"""
    _assert_rejected(text, _mm_opt(tmp_path, text,
                                "builtin.module(mm-assign-tasks{num-devices=8})"),
                     "'mm.task' on 'stablehlo.negate' is missing 'transpose_count'")


def test_regression_negative_axis_size_gives_unparseable_output(tmp_path):
    text = _task_call(sizes="[-1]")
    r = _mm_opt(tmp_path, text, "builtin.module(mm-inline-tasks,mm-outline-fragments)")
    _assert_clean(text, r)
    assert r.rc == 1 and "axis_sizes" in r.stderr


def test_regression_empty_task_name(tmp_path):
    text = _task_call(name='""')
    _assert_rejected(text, _mm_opt(tmp_path, text,
                                "builtin.module(mm-inline-tasks,mm-assign-tasks{num-devices=8})"),
                     "'mm.task' name must not be empty")


def test_regression_empty_task_name_output_reparses(tmp_path):
    text = _task_call(name='""')
    _assert_rejected(text, _mm_opt(tmp_path, text, "builtin.module(mm-inline-tasks)"),
                     "'mm.task' name must not be empty")


def test_regression_gspmd_device_id_overflow(tmp_path):
    text = """func.func @main(%arg0: tensor<8xf32>) -> tensor<8xf32> {
  %0 = stablehlo.custom_call @Sharding(%arg0) {mhlo.sharding = "{maximal device=99999999999999999999}"} : (tensor<8xf32>) -> tensor<8xf32>
  return %0 : tensor<8xf32>
}
"""
    _assert_rejected(text, _mm_opt(tmp_path, text, "builtin.module(mm-import-gspmd)"),
                     "GSPMD sharding '{maximal device=99999999999999999999}' names device "
                     "99999999999999999999, which is not a valid device id")


def test_gspmd_device_id_beyond_num_partitions(tmp_path):
    """Device ids must be below the module's device count (mhlo.num_partitions)."""
    text = """module attributes {mhlo.num_partitions = 8 : i32} {
  func.func @main(%arg0: tensor<8xf32>) -> tensor<8xf32> {
    %0 = stablehlo.custom_call @Sharding(%arg0) {mhlo.sharding = "{maximal device=8}"} : (tensor<8xf32>) -> tensor<8xf32>
    return %0 : tensor<8xf32>
  }
}
"""
    _assert_rejected(text, _mm_opt(tmp_path, text, "builtin.module(mm-import-gspmd)"),
                     "GSPMD sharding '{maximal device=8}' names device 8, but the module has "
                     "8 devices")
    ok = text.replace("device=8}", "device=7}")
    _assert_clean(ok, _mm_opt(tmp_path, ok, "builtin.module(mm-import-gspmd)"))


def test_regression_zero_axis_size(tmp_path):
    text = """func.func @main(%arg0: tensor<8xf32>) -> tensor<8xf32> {
  %0 = func.call @body(%arg0) {mm.task = {name = "t", transpose_count = 0 : i64, devices = [0, 1], axis_names = ["x"], axis_sizes = [0], logical_axes = [["b", "x"]]}} : (tensor<8xf32>) -> tensor<8xf32>
  return %0 : tensor<8xf32>
}
func.func private @body(%arg0: tensor<8xf32>) -> tensor<8xf32> {
  %0 = stablehlo.custom_call @mm.logical_sharding(%arg0) {mm.axes = [["b"]]} : (tensor<8xf32>) -> tensor<8xf32>
  return %0 : tensor<8xf32>
}
"""
    _assert_rejected(text, _mm_opt(tmp_path, text, "builtin.module(mm-inline-tasks,"
                                "mm-assign-tasks{num-devices=8},mm-resolve-logical-shardings)"),
                     "'mm.task' axis_sizes [0] must be positive")


def test_regression_constant_used_by_two_other_tasks(tmp_path):
    text = """module attributes {mm.tasks = {a = {devices = [0, 1], axis_names = ["x"], axis_sizes = [2], logical_axes = []}, b = {devices = [2, 3], axis_names = ["x"], axis_sizes = [2], logical_axes = []}, c = {devices = [4, 5], axis_names = ["x"], axis_sizes = [2], logical_axes = []}}} {
  func.func @main(%arg0: tensor<8xf32>) -> (tensor<8xf32>, tensor<8xf32>) {
    %c = stablehlo.constant {mm.task = {name = "a", transpose_count = 0 : i64}} dense<2.0> : tensor<8xf32>
    %0 = stablehlo.add %arg0, %c {mm.task = {name = "b", transpose_count = 0 : i64}} : tensor<8xf32>
    %1 = stablehlo.add %arg0, %c {mm.task = {name = "c", transpose_count = 0 : i64}} : tensor<8xf32>
    return %0, %1 : tensor<8xf32>, tensor<8xf32>
  }
}
"""
    _assert_clean(text, _mm_opt(tmp_path, text, "builtin.module(mm-outline-fragments)"))


def test_regression_insert_transfers_fragment_without_devices(tmp_path):
    seed = next(s for s in load_seeds() if s.source == "insert_transfers.mlir#0")
    text = seed.text.replace("attributes {mm.devices = [0, 1], mm.mesh", "attributes {mm.mesh", 1)
    assert text != seed.text
    _assert_rejected(text, _mm_opt(tmp_path, text, "builtin.module(mm-insert-transfers)"),
                     "fragment '@a_fwd' is missing 'mm.devices'")


def test_regression_propagate_fragment_without_devices(tmp_path):
    text = sdy_probes()["barriers"].replace("{mm.devices = [0, 1, 2, 3], mm.mesh", "{mm.mesh")
    assert "mm.devices" not in text
    _assert_rejected(text, _mm_opt(tmp_path, text, "builtin.module(mm-propagate-shardings)"),
                     "fragment '@a_fwd' is missing 'mm.devices'")


_HANG = """module {
  func.func @main(%arg0: tensor<8xf32>) {
  }
  func.func @f(%arg0: tensor<8xf32>) {
  }
  }
  func.func @g(%arg0: tensor<8xf32>) {
}"""


def test_hang_input_is_diagnosed_single_threaded():
    assert not parses_single_threaded(_HANG)


def test_regression_parse_hang(tmp_path):
    path = tmp_path / "hang.mlir"
    path.write_text(_HANG)
    # Only the parse is watched, with a limit no parse of 7 lines nears however loaded the
    # machine (the imports before it are not: they once took more than 6 s at load 12).
    code = ("import faulthandler, sys; from multimesh._src.mlir import ir, make_context\n"
            "text = open(sys.argv[1]).read()\n"
            "faulthandler.dump_traceback_later(120, exit=True)\n"
            "with make_context():\n"
            "    try: ir.Module.parse(text)\n"
            "    except Exception: pass\n"
            "faulthandler.cancel_dump_traceback_later()\n")
    for _ in range(3):  # nondeterministic: three clean parses in a row count as fixed
        p = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True,
                           text=True, cwd=str(ROOT), timeout=TIMEOUT_S,
                           env=dict(os.environ, PYTHONPATH=str(ROOT)))
        assert p.returncode == 0, f"ir.Module.parse hung:\n{p.stderr[-2000:]}"


def test_regression_data_flow_edge_segfault():
    """Fixed: mm-verify and mm-propagate-shardings (before Shardy runs) reject the op."""
    runner = IsolatedRunner()
    try:
        for pipeline in ("mm-verify,mm-propagate-shardings", "mm-propagate-shardings"):
            case = Case(0, "regression", (), f"builtin.module({pipeline})",
                        sdy_probes()["data-flow-edge"])
            r = runner.run(case)
            assert not problems(case, r), r.stderr
            assert r.rc == 1 and "error: 'sdy.data_flow_edge' is internal" in r.stderr, r.stderr
    finally:
        runner.close()


if __name__ == "__main__":  # pragma: no cover
    if sys.argv[1:] == ["--worker"]:
        sys.exit(_worker_main())
    print("usage: python tests/test_fuzz_ir.py --worker  (internal); use tools/fuzz.py --ir N")
    sys.exit(2)
