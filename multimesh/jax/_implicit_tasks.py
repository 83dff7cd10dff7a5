"""Registered tasks at compile time: ``implicit_task_rules``.

When :func:`multimesh.jax.mjit` compiles a program it asks this module for the
active rules: the lowered module is scanned for matches, callbacks are called once
per distinct ``(matched name, backprop)``, each task is resolved to concrete device
positions, and the resolved rules are handed to the ``mm-match-tasks`` pass in
memory. A matcher that claims nothing warns, naming what it might have meant.
"""

from __future__ import annotations

import difflib
import re
import warnings

import jax

from multimesh._src.errors import MultimeshValueError, MultimeshWarning
from multimesh._src.mlir import make_context, parse_module
from multimesh.jax import _contexts
from multimesh.jax._registered_meshes import registered_task
from multimesh.jax._registrations import (
    Registration,
    active_registrations,
    entered_frames,
    user_level,
)
from multimesh.jax._task import loop_placement, resolve_task_info
from multimesh.passes.api import Rule, RuleTask, find_matches

__all__ = ["implicit_task_rules"]


def _warn_unmatched(regs: list[Registration], hits, stacks: set[str]) -> None:
    """A registered matcher that claims no op of a compiled program is almost always a
    typo (or a rule for another program): say so, with the names it might have meant.

    A rule that an inner context overrides (the ops it matches go to the inner
    context's rule) is meant to be quiet there and is not reported.
    """
    claimed = {h.matcher_index for h in hits}
    owner = [id(frame) for frame in reversed(entered_frames()) for _ in frame.live]
    for i, reg in enumerate(regs):
        if i in claimed:
            continue
        matching = [st for st in stacks if reg.regex.search(st)]
        if matching:
            winners = {next(j for j, r in enumerate(regs) if r.regex.search(st))
                       for st in matching}
            if all(owner[j] != owner[i] for j in winners):
                continue  # overridden by an inner context, on purpose
            why = ("every op it matches is claimed by a rule registered before it in the "
                   "same context")
            hint = ""
        else:
            why = "no op's name stack contains a match"
            hint = _near_names(reg, stacks)
        warnings.warn(
            f"Task matcher {reg.matcher!r} claimed no op of this program: {why}, so it "
            f"places nothing.{hint}", MultimeshWarning, stacklevel=user_level())


def _scope_names(stacks: set[str], paths: bool) -> list[str]:
    """The scopes of the name stacks; with ``paths`` also each two consecutive scopes
    (``blocks/3``), the names a matcher with a ``/`` (an NNX graph path) means."""
    out: set[str] = set()
    for st in stacks:
        parts = [p for p in st.split("/")[:-1]
                 if p and not p.startswith(("jit(", "pjit(", "transpose(", "jvp("))]
        out.update(parts)
        if paths:
            out.update(f"{a}/{b}" for a, b in zip(parts, parts[1:]))
    return sorted(out)


def _near_names(reg: Registration, stacks: set[str]) -> str:
    scopes = _scope_names(stacks, "/" in reg.matcher)
    if not scopes:
        return ""
    folded = [m for m in scopes if re.search(reg.regex.pattern, m, re.IGNORECASE)]
    if folded:
        return f" Ignoring case it would match {', '.join(map(repr, folded[:3]))}."
    text = re.sub(r"\\[dDwWsS][+*?]?|[()\[\]^$+*?|{}]", "", reg.matcher).lower()
    near = difflib.get_close_matches(text, [m.lower() for m in scopes], n=3, cutoff=0.6)
    by_lower = {m.lower(): m for m in scopes}
    if near:
        return f" Did you mean {', '.join(repr(by_lower[n]) for n in near)}?"
    return ""


def _direction(backprop: bool) -> str:
    return "backward" if backprop else "forward"


def implicit_task_rules(program):
    """The rules of ``mm-match-tasks`` for the lowered program (in memory), or None.

    ``program`` is the parsed module (``mjit.lower`` parses once and shares it) or
    its text. Must run while the program's device list is set (``mjit.lower``): task
    meshes are resolved to positions in it.
    """
    regs = active_registrations()
    if not regs or _contexts.state.ignore_transforms:
        return None
    module = parse_module(program, make_context()) if isinstance(program, str) else program
    stacks: set[str] = set()
    hits = find_matches(module, [r.regex for r in regs], stacks)
    _warn_unmatched(regs, hits, stacks)
    if not hits:
        return None
    entries: dict[int, list] = {}
    seen: dict[str, tuple] = {}  # task name -> (TaskInfo, description)
    for hit in hits:
        reg = regs[hit.matcher_index]
        spec = registered_task(reg, hit.name, hit.backprop)
        name = spec.name or hit.name
        info = resolve_task_info(spec, name)
        _note_remat(spec, name, reg, hit)
        if spec.loop_dependent_mesh_slice is not None:
            info = loop_placement(spec, name, info, _num_microbatches())
        what = (f"match {hit.name!r} ({_direction(hit.backprop)}) of task matcher "
                f"{reg.matcher!r}")
        old = seen.get(name)
        if old is not None:
            prev, prev_what = old
            if (prev.devices, prev.axis_names, prev.axis_sizes) != (
                    info.devices, info.axis_names, info.axis_sizes):
                raise MultimeshValueError(
                    f"Task name {name!r} was given two different device sets: {prev_what} "
                    f"puts it on device positions {list(prev.devices)} "
                    f"({_axes(prev)}), {what} on {list(info.devices)} ({_axes(info)}). One "
                    f"task name has one submesh: return a different Task name for each "
                    f"submesh (e.g. f\"{{name}}_fwd\" / f\"{{name}}_bwd\").")
            if prev.logical_axes != info.logical_axes:
                raise MultimeshValueError(
                    f"Task name {name!r} was given two different logical mappings: {prev_what}"
                    f" maps {[list(p) for p in prev.logical_axes]}, {what} maps "
                    f"{[list(p) for p in info.logical_axes]}. Give each mapping its own "
                    f"task name.")
        else:
            seen[name] = (info, what)
        mesh = info.mesh()
        entries.setdefault(hit.matcher_index, []).append(
            ((hit.name, hit.backprop), RuleTask(name, mesh)))
    return tuple(Rule(regs[i].regex.pattern, regs[i].regex, None, tuple(entries[i]))
                 for i in sorted(entries))


def _note_remat(spec, name: str, reg: Registration, hit) -> None:
    """Record a registered task whose backward recomputes its forward (``Task.remat``,
    else ``microbatch(..., remat=)``) for ``mm-recompute-forward``."""
    notes = _contexts.state.trace_notes
    if notes is None:
        return
    remat = spec.remat if spec.remat is not None else notes.remat
    if remat is None or remat is False:
        return
    if remat is not True:
        raise MultimeshValueError(
            f"Task {name!r} (match {hit.name!r} of task matcher {reg.matcher!r}) is a "
            f"registered task, whose forward multimesh finds in the traced program, so it "
            f"can only be recomputed whole: `remat` must be True or False for it, got the "
            f"checkpoint policy {_policy_name(remat)}. Wrap the stage in `task(..., remat=policy)` to "
            f"recompute it under a jax checkpoint policy.")
    notes.remat_tasks.add(name)


def _policy_name(policy) -> str:
    """A checkpoint policy by its public name (``jax.checkpoint_policies.dots_saveable``):
    its repr differs by jax version (a function on 0.10, a class instance on 0.12)."""
    for attr in dir(jax.checkpoint_policies):
        try:
            same = getattr(jax.checkpoint_policies, attr) is policy
        except Exception:  # noqa: BLE001 - an attribute that cannot be read is not it
            same = False
        if same:
            return f"`jax.checkpoint_policies.{attr}`"
    return f"`{getattr(policy, '__name__', type(policy).__name__)}`"


def _num_microbatches() -> int | None:
    """The program's microbatch count, once its microbatch loop has been traced."""
    notes = _contexts.state.trace_notes
    cfg = notes.microbatch if notes is not None else None
    return cfg.num_microbatches if cfg else None


def _axes(info) -> str:
    return ", ".join(f"{n}={s}" for n, s in zip(info.axis_names, info.axis_sizes, strict=True))
