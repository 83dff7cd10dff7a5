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
``logical_axes`` to the identity over its axis names.

``mjit`` resolves the registered tasks itself (one ``matches`` entry per pair it
saw, after calling the registered callbacks) and builds this pass with those
:class:`Rule` values in memory (``rule_table``), before ``mm-inline-tasks``; no file
is written unless a pass fails, when the repro's ``mm-opt`` line names a rules file
that :meth:`MatchTasksPass.replay_element` wrote next to it.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from multimesh._src.brackets import read_string, skip_balanced, skip_element
from multimesh._src.errors import DiagnosticError, MultimeshValueError, PipelineError
from multimesh._src.mlir import ir

from . import _contract as c
from .base import NOT_AN_OPTION, ModulePass

__all__ = ["MatchTasksPass", "Match", "Rule", "RuleTask", "find_matches", "compile_matcher",
           "name_stack", "parse_rules", "rules_to_json", "BACKPROP_MARKER"]

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
    """The name of the location printed at ``s[i]`` (see :func:`name_stack`)."""
    while True:
        i = _skip_ws(s, i)
        if s.startswith("fused", i):
            return _fused_name(s, i + len("fused"))
        if i >= len(s) or s[i] != '"':
            return None
        name, j = read_string(s, i)
        if j < len(s) and s[j] == ":":
            return None  # "file":line:col
        if not (name.endswith(":") and j < len(s) and s[j] == "("):
            return name
        i = j + 1  # "dot_general:"(<the real name>)


def _fused_name(s: str, j: int) -> str | None:
    """The first name among the parts of ``fused<metadata>[...]`` (``s[j]`` after ``fused``)."""
    if j < len(s) and s[j] == "<":
        j = skip_balanced(s, j)
    if j >= len(s) or s[j] != "[":
        return None
    j += 1
    while j < len(s) and s[j] != "]":
        found = _outer_name(s, j)
        if found is not None:
            return found
        j = skip_element(s, j)
        if j < len(s) and s[j] == ",":
            j += 1
    return None


def _skip_ws(s: str, i: int) -> int:
    while i < len(s) and s[i] in " \t\n":
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
                for oi, view in enumerate(block.operations):
                    op = view.operation
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
class RuleTask:
    """The task a rule gives its matches: a name (None: the matched name) and a mesh."""

    name: str | None
    mesh: c.MeshRecord

    def to_json(self) -> dict:
        """The rules-file form of this task (what :func:`parse_rules` reads back)."""
        d = self.mesh.to_dict()
        d.pop("forward", None)  # recorded by the pass, never given by a rule
        return {"name": self.name, **d} if self.name else d


@dataclass(frozen=True)
class Rule:
    """One task rule: a matcher and the tasks of its matches, in priority order.

    ``matches`` gives the task of each ``(matched name, backprop)`` pair; ``default``
    is the task of any other match (None: such a match is an error). ``mjit`` builds
    these from the registered tasks and hands them to :class:`MatchTasksPass` in memory.
    """

    matcher: str
    regex: re.Pattern
    default: RuleTask | None = None
    matches: tuple[tuple[tuple[str, bool], RuleTask], ...] = ()

    def __post_init__(self):
        object.__setattr__(self, "_by_key", dict(self.matches))

    def task_for(self, hit: Match) -> RuleTask | None:
        return self._by_key.get((hit.name, hit.backprop), self.default)  # type: ignore[attr-defined]

    def to_json(self) -> dict:
        d: dict = {"matcher": self.regex.pattern}
        if self.default is not None:
            d["task"] = self.default.to_json()
        if self.matches:
            d["matches"] = [{"match": name, "backprop": bp, "task": task.to_json()}
                            for (name, bp), task in self.matches]
        return d


def rules_to_json(rules: Sequence[Rule]) -> dict:
    """The rules-file document of ``rules`` (``{"rules": [...]}``)."""
    return {"rules": [r.to_json() for r in rules]}


def _fail(where: str, msg: str):
    raise PipelineError(f"Pass 'mm-match-tasks': {where}: {msg}")


_TASK_KEYS = ("name", "devices", "axis_names", "axis_sizes", "logical_axes", "split_backprop",
              "loop_devices")


def _parse_task(d, where: str) -> RuleTask:
    """A rule's task: the keys of an ``mm.tasks`` entry plus ``name``, with defaults
    (one axis ``x`` over all devices, the identity logical mapping), checked by the
    IR contract's own reader so a rule and the table it writes obey the same rules."""
    if not isinstance(d, dict):
        _fail(where, f"a task must be a JSON object, got {d!r}")
    unknown = sorted(set(d) - set(_TASK_KEYS))
    if unknown:
        _fail(where, f"unknown task key(s) {unknown}; valid keys are {', '.join(_TASK_KEYS)}")
    name = d.get("name")
    if name is not None and (not isinstance(name, str) or not name):
        _fail(where, f"task name must be a non-empty string, got {name!r}")
    entry = {k: v for k, v in d.items() if k != "name"}
    if "devices" not in entry:
        _fail(where, "a task needs 'devices', a list of device positions")
    if "axis_names" not in entry:
        entry["axis_names"] = ["x"]
        entry.setdefault("axis_sizes", [len(d["devices"])] if isinstance(
            d["devices"], list) else None)
    if isinstance(entry["axis_names"], list):
        entry.setdefault("logical_axes", [[n, n] for n in entry["axis_names"]])
    try:
        mesh = c.MeshRecord.from_dict(entry, None, "task")
    except DiagnosticError as e:
        _fail(where, e.message)
    return RuleTask(name, mesh)


def parse_rules(doc, source: str) -> list[Rule]:
    """Validate a rules document (already JSON-decoded) into rules, in priority order."""
    if not isinstance(doc, dict) or not isinstance(doc.get("rules"), list):
        _fail(source, 'the rules must be a JSON object {"rules": [...]}')
    extra = sorted(set(doc) - {"rules", "version"})
    if extra:
        _fail(source, f"unknown top-level key(s) {extra}; expected 'rules'")
    return [_parse_rule(r, f"{source}, rule {i}") for i, r in enumerate(doc["rules"])]


def _parse_rule(r, where: str) -> Rule:
    if not isinstance(r, dict) or "matcher" not in r:
        _fail(where, 'each rule must be an object with a "matcher"')
    unknown = sorted(set(r) - {"matcher", "task", "matches"})
    if unknown:
        _fail(where, f"unknown rule key(s) {unknown}; valid keys are matcher, task, matches")
    try:
        rx = compile_matcher(r["matcher"])
    except MultimeshValueError as e:
        _fail(where, str(e))
    default = _parse_task(r["task"], f"{where} task") if "task" in r else None
    matches: dict[tuple[str, bool], RuleTask] = {}
    for j, m in enumerate(r.get("matches", [])):
        key, task = _parse_match(m, f"{where}, match {j}", matches)
        matches[key] = task
    if default is None and not matches:
        _fail(where, 'a rule needs a default "task", "matches", or both')
    return Rule(r["matcher"], rx, default, tuple(matches.items()))


def _parse_match(m, where: str, seen: dict) -> tuple[tuple[str, bool], RuleTask]:
    if not isinstance(m, dict) or not isinstance(m.get("match"), str) or not m["match"]:
        _fail(where, 'each match must be an object with a non-empty "match" name')
    bp = m.get("backprop", False)
    if not isinstance(bp, bool):
        _fail(where, f"'backprop' must be true or false, got {bp!r}")
    if "task" not in m:
        _fail(where, 'a match needs a "task"')
    key = (m["match"], bp)
    if key in seen:
        _fail(where, f"match '{key[0]}' ({'backward' if bp else 'forward'}) is listed twice")
    return key, _parse_task(m["task"], f"{where} task")


def _load(rules: str, rules_file: str) -> list[Rule]:
    out = []
    if rules:
        try:
            doc = json.loads(rules)
        except json.JSONDecodeError as e:
            _fail("option 'rules'", f"not valid JSON ({e}); inline rules must be compact JSON "
                                    f"without spaces, or use rules-file=")
        out += parse_rules(doc, "option 'rules'")
    if rules_file:
        out += parse_rules(_read_json(rules_file), f"rules-file '{rules_file}'")
    return out


def _read_json(path: str):
    where = f"rules-file '{path}'"
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except OSError as e:
        _fail(where, f"cannot be read: {e.strerror or e}")
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        _fail(where, f"not valid JSON ({e})")


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
    rule_table: tuple[Rule, ...] = field(default=(), metadata=NOT_AN_OPTION)
    """Rules given in Python (``mjit``'s registered tasks); they come first. Not an
    option: :meth:`replay_element` writes them to a file for ``mm-opt``."""

    _parsed: tuple = field(init=False, repr=False, compare=False, default=())

    def __post_init__(self):
        table = tuple(self.rule_table)
        bad = [r for r in table if not isinstance(r, Rule)]
        if bad:
            raise PipelineError(
                f"Pass 'mm-match-tasks': rule_table must hold multimesh.passes.match_tasks.Rule "
                f"values, got {type(bad[0]).__name__} {bad[0]!r}")
        object.__setattr__(self, "rule_table", table)
        object.__setattr__(self, "_parsed", table + tuple(_load(self.rules, self.rules_file)))

    def pipeline_element(self) -> str:
        if not self.rule_table:
            return super().pipeline_element()
        return f"{self.argument}{{<{len(self.rule_table)} rules in memory>}}"

    def replay_element(self, stem: str) -> str:
        """Every rule (in memory, inline and from a file) written to ``<stem>.rules.json``,
        the element naming that file, when some rules live only in memory."""
        if not self.rule_table:
            return super().replay_element(stem)
        path = f"{stem}.rules.json"
        if re.search(r"[\s,{}()\"]", path):
            raise PipelineError(
                f"Cannot name the rules file {path!r} in an mm-opt pipeline: its path "
                f"contains spaces, commas, braces or quotes. Set TMPDIR (or "
                f"MULTIMESH_DUMP_IR_TO) to a plain directory.")
        with open(path, "w", encoding="utf-8") as f:
            f.write(json.dumps(rules_to_json(self._parsed), indent=1) + "\n")
        return f"{self.argument}{{rules-file={path}}}"

    def apply(self, module: ir.Module) -> None:
        rules = list(self._parsed)
        if not rules:
            return
        with module.context:
            scan = _Scanner(module, [r.regex for r in rules])
            main_plan = scan.run()
            if not scan.hits:
                return
            tasks = c.read_tasks(module)
            names = _resolve_hits(module, scan, rules, tasks)  # no edits before this
            _pair_backwards(tasks, names)
            symbols = _assign_symbols(module, scan, main_plan)
            _clone_variants(module, symbols)
            funcs = c.func_by_name(module)  # edits addressed by path, never by op hash
            if main_plan is not None:
                _apply(c.main_func(module), main_plan, names, symbols)
            for (_callee, plan), sym in symbols.items():
                _apply(funcs[sym], plan, names, symbols)
            c.write_tasks(module, tasks)


def _resolve_hits(module: ir.Module, scan: _Scanner, rules: list[Rule],
                  tasks: dict[str, c.MeshRecord]) -> dict[Match, str]:
    """The task name of every match, with the tasks added to ``tasks``; a name given
    two meshes (by two matches, or by a match and the table or an explicit task call)
    is an error at the first op of the match."""
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
    return names


def _clone_variants(module: ir.Module, symbols: dict) -> None:
    """A copy of the callee for every variant that gets a symbol of its own."""
    funcs = c.func_by_name(module)
    body = ir.InsertionPoint(module.body)
    for (callee, _), sym in symbols.items():
        if sym != callee:
            clone = funcs[callee].clone(ip=body)
            clone.attributes["sym_name"] = ir.StringAttr.get(sym)


def _pair_backwards(tasks: dict, names: dict) -> None:
    """Record on each backward task named apart from its forward (same match, other
    direction) the forward's name, so schedules give both one pipeline stage."""
    forward = {(h.matcher_index, h.name): n for h, n in names.items() if not h.backprop}
    for h, n in names.items():
        f = forward.get((h.matcher_index, h.name))
        if h.backprop and f is not None and f != n and tasks[n].forward != f:
            tasks[n] = dataclasses.replace(tasks[n], forward=f)


def _describe(info: c.MeshRecord) -> str:
    axes = ", ".join(f"{n}={s}" for n, s in zip(info.axis_names, info.axis_sizes, strict=True))
    return (f"devices {list(info.devices)} ({axes}) with logical axes "
            f"{[list(p) for p in info.logical_axes]}")


def _explicit_tasks(module: ir.Module) -> dict[str, tuple[c.MeshRecord, str]]:
    """Tasks named by explicit task calls (``func.call {mm.task = {..., devices}}``)."""
    out: dict[str, tuple[c.MeshRecord, str]] = {}
    for op in _nested_ops(module.operation):
        if op.name == "func.call" and c.TASK_ATTR in op.attributes:
            (name, _, _), mesh = c.task_call(op)
            if mesh is not None:
                out.setdefault(name, (mesh, "an explicit task call"))
    return out


def _assign_symbols(module: ir.Module, scan: _Scanner, main_plan) -> dict:
    """``{(callee, plan): symbol}`` for every non-trivial callee variant.

    A callee keeps its own symbol for its first variant unless some call site needs
    its original, untagged body (an explicit task, a claimed region, a call with
    nothing to tag); every other variant gets a clone ``<callee>_match<N>``.
    """
    funcs = c.func_by_name(module)
    kept = _kept_callees(funcs, scan.trivial)
    taken = set(funcs)
    out = {}
    for callee, plans in _variants(main_plan).items():
        for k, plan in enumerate(plans):
            out[(callee, plan)] = (callee if k == 0 and callee not in kept
                                   else _fresh(f"{callee}_match", taken))
    return out


def _variants(plan, variants: dict[str, list] | None = None) -> dict[str, list]:
    """``{callee: [plan, ...]}``: the distinct plans of each callee under ``plan``, in
    depth-first order of first use (which variant keeps the callee's own symbol)."""
    variants = {} if variants is None else variants
    if plan is None:
        return variants
    for _, (callee, sub) in plan[1]:
        if sub not in variants.setdefault(callee, []):
            variants[callee].append(sub)
            _variants(sub, variants)
    return variants


def _kept_callees(funcs: dict[str, ir.Operation], trivial: Iterable[str]) -> set[str]:
    """The callees of bodies kept as they are (and theirs): they keep their symbols'
    original, untagged bodies."""
    kept: set[str] = set()
    work = list(trivial)
    while work:
        name = work.pop()
        if name in kept or name not in funcs:
            continue
        kept.add(name)
        work += [c.callee_of(o) for o in _nested_ops(funcs[name]) if o.name == "func.call"]
    return kept


def _nested_ops(root: ir.Operation) -> list[ir.Operation]:
    """``root`` and every op nested in it (no walk callback: errors stay Python's)."""
    out, stack = [], [root]
    while stack:
        o = stack.pop()
        out.append(o)
        for region in o.regions:
            for block in region.blocks:
                stack.extend(x.operation for x in block.operations)
    return out


def _fresh(prefix: str, taken: set[str]) -> str:
    """``<prefix><N>`` for the smallest N >= 1 not in ``taken`` (now taken)."""
    n = 1
    while f"{prefix}{n}" in taken:
        n += 1
    taken.add(f"{prefix}{n}")
    return f"{prefix}{n}"


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
