"""``mm-match-tasks``: tag ops whose JAX name stack matches a registered task.

Implicit tasks (``register_task``) are not calls in the IR: the only trace of a
``jax.named_scope("layer0")`` or a Flax module path is the op's *name stack*,
which jax writes into each op's location (``loc("jit(f)/layer0/dot_general"(...))``;
backward ops read ``.../transpose(jvp(layer0))/...``). This pass reads those
locations and turns matches into the same tags explicit tasks get.

The rules are a JSON document, given inline (``rules=...``, compact JSON without
spaces) or as a file (``rules-file=path.json``); inline rules come first::

    {"rules": [
      {"matcher": "(layer\\\\d+)",
       "task": {"devices": [0, 1], "axis_names": ["x"], "axis_sizes": [2],
                "logical_axes": [["batch", "x"]]},
       "matches": [{"match": "layer0", "backprop": true,
                    "task": {"name": "layer0_bwd", "devices": [2, 3]}}]}]}

Rules are tried in order; the first whose regex is found anywhere in an op's name
stack (``re.search``) claims the op, and its first capture group is the *matched
name*. The task comes from the ``matches`` entry for ``(matched name, backprop)``,
else from the rule's default ``task``. A task's ``name`` defaults to the matched
name, ``axis_names``/``axis_sizes`` to one axis ``x`` over all its ``devices``, and
``logical_axes`` to the identity over its axis names. ``mjit`` writes a fully
resolved document (one ``matches`` entry per pair it saw, after calling the
registered callbacks) and runs this pass before ``mm-inline-tasks``.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from mlir_passes import _contract as c
from mlir_passes.base import ModulePass
from multimesh._src.errors import DiagnosticError, MultimeshValueError, PipelineError
from multimesh._src.mlir import ir

__all__ = ["MatchTasksPass", "Match", "find_matches", "compile_matcher", "name_stack",
           "BACKPROP_MARKER"]

BACKPROP_MARKER = "transpose(jvp"
"""An op whose name stack contains this is part of the backward pass."""


# --------------------------------------------------------------------------- matchers


def compile_matcher(matcher: str) -> re.Pattern:
    """Compile a task matcher; wrap it in a group if it has none.

    The first capture group is the matched name, so ``layer\\d+`` becomes
    ``(layer\\d+)``. A matcher that matches the empty string would claim every op
    and is rejected.
    """
    if not isinstance(matcher, str):
        raise MultimeshValueError(
            f"A task matcher must be a string (a name or a regular expression), got "
            f"{type(matcher).__name__} {matcher!r}.")
    try:
        rx = re.compile(matcher)
        if rx.groups == 0:
            rx = re.compile(f"({matcher})")
    except re.error as e:
        raise MultimeshValueError(
            f"Task matcher {matcher!r} is not a valid regular expression: {e}.") from None
    m = rx.search("")
    if m is not None:
        raise MultimeshValueError(
            f"Task matcher {matcher!r} matches the empty string, so it would claim every op "
            f"of the program. Give a name or a regular expression that needs at least one "
            f"character, e.g. 'layer_0' or r'(layer_\\d+)'.")
    return rx


# --------------------------------------------------------------------------- locations


def name_stack(loc: ir.Location) -> str | None:
    """The JAX name stack recorded in ``loc`` (its outermost name), or None.

    jax writes ``NameLoc("<name stack>/<primitive>", <traceback>)``, sometimes
    wrapped in ``NameLoc("<primitive>:", ...)``; fused locations are searched in
    order. File locations, call sites and unknown locations carry no name stack.
    """
    s = str(loc)
    if not s.startswith("loc("):
        return None
    return _outer_name(s, 4)


def _outer_name(s: str, i: int) -> str | None:
    while True:
        i = _skip_ws(s, i)
        if i >= len(s):
            return None
        if s[i] == '"':
            name, j = _read_string(s, i)
            if j < len(s) and s[j] == ":":
                return None  # "file":line:col
            if name.endswith(":") and j < len(s) and s[j] == "(":
                i = j + 1  # "dot_general:"(<the real name>)
                continue
            return name
        if s.startswith("fused", i):
            j = i + len("fused")
            if j < len(s) and s[j] == "<":
                j = _skip_balanced(s, j)
            if j >= len(s) or s[j] != "[":
                return None
            j += 1
            while j < len(s) and s[j] != "]":
                found = _outer_name(s, j)
                if found is not None:
                    return found
                j = _skip_element(s, j)
                if j < len(s) and s[j] == ",":
                    j += 1
            return None
        return None


def _skip_ws(s: str, i: int) -> int:
    while i < len(s) and s[i] in " \t\n":
        i += 1
    return i


def _read_string(s: str, i: int) -> tuple[str, int]:
    """Decode the MLIR string literal starting at ``s[i] == '"'``; returns (text, end)."""
    out, j = [], i + 1
    while j < len(s) and s[j] != '"':
        ch = s[j]
        if ch == "\\" and j + 1 < len(s):
            nxt = s[j + 1]
            if nxt in '"\\':
                out.append(nxt)
                j += 2
                continue
            if nxt == "n":
                out.append("\n")
                j += 2
                continue
            if re.fullmatch(r"[0-9a-fA-F]{2}", s[j + 1:j + 3]):
                out.append(chr(int(s[j + 1:j + 3], 16)))
                j += 3
                continue
        out.append(ch)
        j += 1
    return "".join(out), j + 1


def _skip_balanced(s: str, i: int) -> int:
    """Skip the bracketed group opening at ``s[i]`` (strings respected)."""
    depth = 0
    while i < len(s):
        ch = s[i]
        if ch == '"':
            _, i = _read_string(s, i)
            continue
        if ch in "([{<":
            depth += 1
        elif ch in ")]}>":
            depth -= 1
            if depth == 0:
                return i + 1
        i += 1
    return i


def _skip_element(s: str, i: int) -> int:
    """Skip one element of a fused location list: up to the next top-level ',' or ']'."""
    depth = 0
    while i < len(s):
        ch = s[i]
        if ch == '"':
            _, i = _read_string(s, i)
            continue
        if ch in "([{<":
            depth += 1
        elif ch in ")]}>":
            if depth == 0:
                return i
            depth -= 1
        elif ch == "," and depth == 0:
            return i
        i += 1
    return i


def _join(prefix: str, own: str) -> str:
    return f"{prefix}/{own}" if prefix and own else (prefix or own)


# --------------------------------------------------------------------------- scanning


@dataclass(frozen=True)
class Match:
    """One distinct match: which matcher claimed ops, with what name, in which pass."""

    matcher_index: int
    name: str
    backprop: bool


_Path = tuple[tuple[int, int, int], ...]


class _Scanner:
    """Walks ``@main`` and, through calls, every callee with its call site's name stack.

    Callees are lowered by jax with name stacks relative to the call, so an op in a
    callee is matched against ``<call site's stack>/<its own name>``. The result is
    a *plan* per (function, call-site stack): the ops to tag and the plans of the
    calls inside. Nothing is edited here.
    """

    def __init__(self, module: ir.Module, matchers: Sequence[re.Pattern]):
        self.module = module
        self.funcs = c.func_by_name(module)
        self.matchers = list(matchers)
        self.memo: dict[tuple[str, str], object] = {}
        self.hits: dict[Match, ir.Location] = {}  # first op of each match, in order
        self.stacks: set[str] = set()  # every name stack an op was matched against
        self.trivial: set[str] = set()  # callees whose original body must stay untagged
        self.active: set[str] = set()

    def run(self):
        main = c.main_func(self.module)
        tags: list = []
        calls: list = []
        self._region_ops(main, (), "", "", tags, calls)
        return _plan(tags, calls)

    def _match(self, stack: str, loc: ir.Location) -> Match | None:
        self.stacks.add(stack)
        for idx, rx in enumerate(self.matchers):
            m = rx.search(stack)
            if m is None:
                continue
            name = m.group(1)
            if not name:
                raise DiagnosticError(
                    f"matcher '{rx.pattern}' produced an empty match on the op name stack "
                    f"'{stack}'; its first capture group is the task name and must match at "
                    f"least one character", loc)
            hit = Match(idx, name, BACKPROP_MARKER in stack)
            self.hits.setdefault(hit, loc)
            return hit
        return None

    def _region_ops(self, parent: ir.Operation, path: _Path, prefix: str, enclosing: str,
                    tags: list, calls: list) -> None:
        for ri, region in enumerate(parent.regions):
            for bi, block in enumerate(region.blocks):
                for oi, op in enumerate(block.operations):
                    op = op.operation
                    p = path + ((ri, bi, oi),)
                    own = name_stack(op.location)
                    stack = _join(prefix, own) if own is not None else enclosing
                    if c.TASK_ATTR in op.attributes:
                        # An explicit task call (or an op tagged already): it and
                        # everything inside it belong to it.
                        self._keep(op)
                        continue
                    if op.name == "func.call":
                        callee = c.callee_of(op)
                        sub = self._func(callee, stack, op.location)
                        if sub is None:
                            self.trivial.add(callee)
                        calls.append((p, None if sub is None else (callee, sub)))
                        continue
                    if _is_terminator(op):
                        continue
                    hit = self._match(stack, op.location) if stack else None
                    if hit is not None:
                        tags.append((p, hit))
                        self._keep(op)  # ops in its regions belong to it
                    elif len(op.regions):
                        self._region_ops(op, p, prefix, stack, tags, calls)

    def _func(self, name: str, stack: str, loc: ir.Location):
        key = (name, stack)
        if key in self.memo:
            return self.memo[key]
        func = self.funcs.get(name)
        if func is None:
            raise DiagnosticError(f"call to unknown function '@{name}'", loc)
        if name in self.active:
            raise DiagnosticError(f"recursive call to '@{name}' cannot be matched", loc)
        self.active.add(name)
        tags: list = []
        calls: list = []
        self._region_ops(func, (), stack, stack, tags, calls)
        self.active.discard(name)
        plan = _plan(tags, calls)
        self.memo[key] = plan
        return plan

    def _keep(self, op: ir.Operation) -> None:
        """Every function called from inside ``op`` keeps its original, untagged body."""
        stack = [op]
        while stack:
            o = stack.pop()
            if o.name == "func.call":
                self.trivial.add(c.callee_of(o))
            for region in o.regions:
                for block in region.blocks:
                    stack.extend(x.operation for x in block.operations)


def _is_terminator(op: ir.Operation) -> bool:
    """Block terminators (``func.return``, ``stablehlo.return``, ...) are never tagged."""
    return op.name.endswith((".return", ".yield")) and len(op.results) == 0


def _plan(tags: list, calls: list):
    """Hashable plan, or None when nothing below needs a tag."""
    if not tags and all(v is None for _, v in calls):
        return None
    return (tuple(tags), tuple((p, v) for p, v in calls if v is not None))


def find_matches(module: ir.Module, matchers: Iterable[str | re.Pattern],
                 stacks: set[str] | None = None) -> list[Match]:
    """Distinct ``(matcher, matched name, backprop)`` triples that would claim ops.

    Uses exactly the rules of the pass: the first matcher found in an op's name
    stack wins; ops of explicit task calls (and of ops already tagged) are never
    claimed. ``mjit`` calls this to learn which callbacks to evaluate. ``stacks``,
    if given, receives every name stack that was matched against (to explain a
    matcher that claimed nothing).
    """
    rxs = [m if isinstance(m, re.Pattern) else compile_matcher(m) for m in matchers]
    with module.context:
        scan = _Scanner(module, rxs)
        scan.run()
    if stacks is not None:
        stacks.update(scan.stacks)
    return list(scan.hits)


# --------------------------------------------------------------------------- rules


@dataclass(frozen=True)
class _RuleTask:
    name: str | None
    mesh: c.TaskMeshInfo


@dataclass(frozen=True)
class _Rule:
    matcher: str
    regex: re.Pattern
    default: _RuleTask | None
    matches: dict

    def task_for(self, hit: Match) -> _RuleTask | None:
        return self.matches.get((hit.name, hit.backprop), self.default)


def _fail(where: str, msg: str):
    raise PipelineError(f"Pass 'mm-match-tasks': {where}: {msg}")


def _parse_task(d, where: str) -> _RuleTask:
    if not isinstance(d, dict):
        _fail(where, f"a task must be a JSON object, got {d!r}")
    keys = ("name", "devices", "axis_names", "axis_sizes", "logical_axes", "split_backprop",
            "loop_devices")
    unknown = sorted(set(d) - set(keys))
    if unknown:
        _fail(where, f"unknown task key(s) {unknown}; valid keys are {', '.join(keys)}")
    name = d.get("name")
    if name is not None and (not isinstance(name, str) or not name):
        _fail(where, f"task name must be a non-empty string, got {name!r}")
    devices = d.get("devices")
    if (not isinstance(devices, list) or not devices
            or not all(isinstance(x, int) and not isinstance(x, bool) and x >= 0
                       for x in devices) or len(set(devices)) != len(devices)):
        _fail(where, f"task 'devices' must be a non-empty list of distinct device positions "
                     f"(non-negative integers), got {devices!r}")
    names = d.get("axis_names", ["x"])
    sizes = d.get("axis_sizes", [len(devices)] if "axis_names" not in d else None)
    if (not isinstance(names, list) or not all(isinstance(n, str) for n in names)
            or len(set(names)) != len(names)):
        _fail(where, f"task 'axis_names' must be a list of distinct strings, got {names!r}")
    if (not isinstance(sizes, list) or len(sizes) != len(names)
            or not all(isinstance(s, int) and s > 0 for s in sizes)):
        _fail(where, f"task 'axis_sizes' must give one positive size per axis name {names}, "
                     f"got {sizes!r}")
    if math.prod(sizes) != len(devices):
        _fail(where, f"task axis_sizes {sizes} describe {math.prod(sizes)} devices but "
                     f"'devices' lists {len(devices)}")
    pairs = d.get("logical_axes", [[n, n] for n in names])
    if (not isinstance(pairs, list) or not all(
            isinstance(p, list) and len(p) == 2 and all(isinstance(x, str) for x in p)
            for p in pairs)):
        _fail(where, f"task 'logical_axes' must be a list of [logical, device_axis] string "
                     f"pairs, got {pairs!r}")
    # A pair naming a device axis the task lacks is reported where a constraint uses
    # its logical name (mm-resolve-logical-shardings), as for explicit tasks.
    split = d.get("split_backprop")
    if split is not None and (not isinstance(split, list) or len(split) != 2 or not all(
            isinstance(x, str) and x for x in split) or split[0] == split[1]):
        _fail(where, f"task 'split_backprop' must be two distinct, non-empty name suffixes, "
                     f"got {split!r}")
    moving = d.get("loop_devices")
    if moving is not None and (not isinstance(moving, list) or not all(
            isinstance(row, list) and len(row) == len(devices) and len(set(row)) == len(row)
            and all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in row)
            for row in moving)):
        _fail(where, f"task 'loop_devices' must list, per microbatch, {len(devices)} distinct "
                     f"device positions, got {moving!r}")
    return _RuleTask(name, c.TaskMeshInfo(
        tuple(devices), tuple(names), tuple(sizes), tuple(tuple(p) for p in pairs),
        tuple(split) if split else None,
        tuple(tuple(row) for row in moving) if moving else None))


def parse_rules(doc, source: str) -> list[_Rule]:
    """Validate a rules document (already JSON-decoded) into rules, in priority order."""
    if not isinstance(doc, dict) or not isinstance(doc.get("rules"), list):
        _fail(source, 'the rules must be a JSON object {"rules": [...]}')
    extra = sorted(set(doc) - {"rules", "version"})
    if extra:
        _fail(source, f"unknown top-level key(s) {extra}; expected 'rules'")
    out = []
    for i, r in enumerate(doc["rules"]):
        where = f"{source}, rule {i}"
        if not isinstance(r, dict) or "matcher" not in r:
            _fail(where, 'each rule must be an object with a "matcher"')
        unknown = sorted(set(r) - {"matcher", "task", "matches"})
        if unknown:
            _fail(where, f"unknown rule key(s) {unknown}; valid keys are matcher, task, "
                         f"matches")
        try:
            rx = compile_matcher(r["matcher"])
        except MultimeshValueError as e:
            _fail(where, str(e))
        default = _parse_task(r["task"], f"{where} task") if "task" in r else None
        matches = {}
        for j, m in enumerate(r.get("matches", [])):
            w = f"{where}, match {j}"
            if not isinstance(m, dict) or not isinstance(m.get("match"), str) or not m["match"]:
                _fail(w, 'each match must be an object with a non-empty "match" name')
            bp = m.get("backprop", False)
            if not isinstance(bp, bool):
                _fail(w, f"'backprop' must be true or false, got {bp!r}")
            if "task" not in m:
                _fail(w, 'a match needs a "task"')
            key = (m["match"], bp)
            if key in matches:
                _fail(w, f"match '{key[0]}' ({'backward' if bp else 'forward'}) is listed twice")
            matches[key] = _parse_task(m["task"], f"{w} task")
        if default is None and not matches:
            _fail(where, 'a rule needs a default "task", "matches", or both')
        out.append(_Rule(r["matcher"], rx, default, matches))
    return out


def _load(rules: str, rules_file: str) -> list[_Rule]:
    out = []
    if rules:
        try:
            doc = json.loads(rules)
        except json.JSONDecodeError as e:
            _fail("option 'rules'", f"not valid JSON ({e}); inline rules must be compact JSON "
                                    f"without spaces, or use rules-file=")
        out += parse_rules(doc, "option 'rules'")
    if rules_file:
        try:
            with open(rules_file, encoding="utf-8") as f:
                text = f.read()
        except OSError as e:
            _fail(f"rules-file '{rules_file}'", f"cannot be read: {e.strerror or e}")
        try:
            doc = json.loads(text)
        except json.JSONDecodeError as e:
            _fail(f"rules-file '{rules_file}'", f"not valid JSON ({e})")
        out += parse_rules(doc, f"rules-file '{rules_file}'")
    return out


# --------------------------------------------------------------------------- the pass


@dataclass(frozen=True)
class MatchTasksPass(ModulePass):
    """Tag every op outside a task whose JAX name stack matches a task rule.

    Runs before ``mm-inline-tasks``, on ops still inside their callees. Each op of
    ``@main`` (and of the functions it calls, read with the call site's name stack
    in front of the callee's relative one) that is not part of an explicit task
    call and not tagged already is matched against the rules in order; the first
    rule found in the name stack claims it and the op gets ``mm.task = {name,
    transpose_count}`` (``transpose_count = 1`` when the name stack shows the
    backward pass, ``transpose(jvp(...))``). An op that holds regions (a
    ``stablehlo.while``) and is claimed keeps its regions' ops as they are: they
    belong to it. Callees whose ops are tagged differently at different call sites,
    or that an explicit task also calls, are cloned so each call site gets its own
    copy. Every task used is added to the module's ``mm.tasks`` table; a task name
    given two different submeshes (by two matches, or by a match and an explicit
    task) is an error, as is a matcher whose first capture group comes out empty and
    a match the rules give no task for. See the module docstring for the rules
    format.
    """

    argument = "mm-match-tasks"
    summary = "Tag ops whose JAX name stack matches a registered task rule (implicit tasks)."
    consumes = ("front-end", "flat")

    rules: str = ""
    """Inline rules: compact JSON `{"rules":[...]}` (no spaces)."""
    rules_file: str = ""
    """Path of a JSON rules file; its rules come after the inline ones."""

    _parsed: tuple = field(init=False, repr=False, compare=False, default=())

    def __post_init__(self):
        object.__setattr__(self, "_parsed", tuple(_load(self.rules, self.rules_file)))

    def apply(self, module: ir.Module) -> None:
        rules = list(self._parsed)
        if not rules:
            return
        with module.context:
            scan = _Scanner(module, [r.regex for r in rules])
            main_plan = scan.run()
            if not scan.hits:
                return
            # 1. Resolve every match to a task and check the task table (no edits yet).
            tasks = c.read_tasks(module)
            known = dict(tasks)
            owners: dict[str, str] = {n: "the module's task table" for n in tasks}
            for name, (info, what) in _explicit_tasks(module).items():
                known.setdefault(name, info)
                owners.setdefault(name, what)
            names: dict[Match, str] = {}
            for hit, loc in scan.hits.items():
                rule = rules[hit.matcher_index]
                rt = rule.task_for(hit)
                direction = "backward" if hit.backprop else "forward"
                if rt is None:
                    raise DiagnosticError(
                        f"matcher '{rule.regex.pattern}' matched '{hit.name}' ({direction}) "
                        f"but the rules give no task for it; add a \"matches\" entry or a "
                        f"default \"task\" to the rule", loc)
                name = rt.name or hit.name
                what = f"match '{hit.name}' ({direction}) of matcher '{rule.regex.pattern}'"
                old = known.get(name)
                if old is not None and (old.mesh_key() != rt.mesh.mesh_key()
                                        or old.logical_axes != rt.mesh.logical_axes):
                    raise DiagnosticError(
                        f"task '{name}' was given two different submeshes: {owners[name]} "
                        f"puts it on {_describe(old)}, {what} on {_describe(rt.mesh)}; one "
                        f"task name has one submesh, so give the other one its own name", loc)
                known[name] = tasks[name] = rt.mesh
                owners.setdefault(name, what)
                names[hit] = name
            _pair_backwards(tasks, names)
            # 2. Decide which callee bodies are cloned.
            symbols = _assign_symbols(module, scan, main_plan)
            funcs = c.func_by_name(module)
            body = ir.InsertionPoint(module.body)
            for (callee, _), sym in symbols.items():
                if sym != callee:
                    clone = funcs[callee].clone(ip=body)
                    clone.attributes["sym_name"] = ir.StringAttr.get(sym)
            # 3. Edit: tags and redirected calls, addressed by path (never by op hash).
            funcs = c.func_by_name(module)
            if main_plan is not None:
                _apply(c.main_func(module), main_plan, names, symbols)
            for (_callee, plan), sym in symbols.items():
                _apply(funcs[sym], plan, names, symbols)
            c.write_tasks(module, tasks)


def _pair_backwards(tasks: dict, names: dict) -> None:
    """Record on each backward task named apart from its forward (same match, other
    direction) the forward's name, so schedules give both one pipeline stage."""
    forward = {(h.matcher_index, h.name): n for h, n in names.items() if not h.backprop}
    for h, n in names.items():
        f = forward.get((h.matcher_index, h.name))
        if h.backprop and f is not None and f != n and tasks[n].forward != f:
            tasks[n] = dataclasses.replace(tasks[n], forward=f)


def _describe(info: c.TaskMeshInfo) -> str:
    axes = ", ".join(f"{n}={s}" for n, s in zip(info.axis_names, info.axis_sizes, strict=True))
    return (f"devices {list(info.devices)} ({axes}) with logical axes "
            f"{[list(p) for p in info.logical_axes]}")


def _explicit_tasks(module: ir.Module) -> dict[str, tuple[c.TaskMeshInfo, str]]:
    """Tasks named by explicit task calls (``func.call {mm.task = {..., devices}}``)."""
    out: dict[str, tuple[c.TaskMeshInfo, str]] = {}
    stack = [o.operation for o in module.body.operations]
    while stack:
        op = stack.pop()
        if op.name == "func.call" and c.TASK_ATTR in op.attributes:
            (name, _, _), mesh = c.task_call(op)
            if mesh is not None:
                out.setdefault(name, (mesh, "an explicit task call"))
        for region in op.regions:
            for block in region.blocks:
                stack.extend(x.operation for x in block.operations)
    return out


def _assign_symbols(module: ir.Module, scan: _Scanner, main_plan) -> dict:
    """``{(callee, plan): symbol}`` for every non-trivial callee variant.

    A callee keeps its own symbol for its first variant unless some call site needs
    its original, untagged body (an explicit task, a claimed region, a call with
    nothing to tag); every other variant gets a clone ``<callee>_match<N>``.
    """
    variants: dict[str, list] = {}

    def collect(plan):
        if plan is None:
            return
        for _, (callee, sub) in plan[1]:
            if sub not in variants.setdefault(callee, []):
                variants[callee].append(sub)
                collect(sub)

    collect(main_plan)
    # Bodies kept as they are keep calling the original callees.
    funcs = c.func_by_name(module)
    trivial, work = set(), list(scan.trivial)
    while work:
        name = work.pop()
        if name in trivial or name not in funcs:
            continue
        trivial.add(name)
        stack = [funcs[name]]
        while stack:
            o = stack.pop()
            if o.name == "func.call":
                work.append(c.callee_of(o))
            for region in o.regions:
                for block in region.blocks:
                    stack.extend(x.operation for x in block.operations)
    taken = set(funcs)
    out = {}
    for callee, plans in variants.items():
        for k, plan in enumerate(plans):
            if k == 0 and callee not in trivial:
                out[(callee, plan)] = callee
                continue
            n = 1
            while f"{callee}_match{n}" in taken:
                n += 1
            sym = f"{callee}_match{n}"
            taken.add(sym)
            out[(callee, plan)] = sym
    return out


def _at(root: ir.Operation, path: _Path) -> ir.Operation:
    op = root
    for ri, bi, oi in path:
        op = op.regions[ri].blocks[bi].operations[oi].operation
    return op


def _apply(func: ir.Operation, plan, names: dict, symbols: dict) -> None:
    tags, calls = plan
    for path, hit in tags:
        _at(func, path).attributes[c.TASK_ATTR] = c.tag_attr(names[hit], int(hit.backprop))
    for path, variant in calls:
        sym = symbols[variant]
        if sym != variant[0]:
            _at(func, path).attributes["callee"] = ir.FlatSymbolRefAttr.get(sym)
