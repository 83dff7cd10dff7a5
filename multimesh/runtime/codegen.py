"""One run of a dispatch program as one straight-line Python function.

The steps (:mod:`.steps`) stay the program: traces, timings and memory profiles walk
them and call each one's ``run`` on a value list. An ordinary call runs the same steps
compiled into one function: each step writes its own lines (``emit``), values live in
the function's locals (``v12``), executables, shardings and helpers are its globals,
a dropped value is a ``del``, and the run-ahead bound's waits sit at the points it
would wait at. What that saves per step is the interpreted loop's method call, its
argument list and value-list writes, about 1-2 µs, which is the order of a fragment
call's own dispatch (issue 40).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

__all__ = ["Emitter", "generate"]

FILENAME = "<multimesh dispatch program>"
"""The file name tracebacks through a generated function show."""


class Emitter:
    """The source of one generated function and the objects it refers to.

    A step writes lines with :meth:`line`, :meth:`assign` and :meth:`drop`, names the
    objects it calls with :meth:`const` (one global name per object), and keeps what
    must carry from one step to a later one in ``state`` (the run-ahead windows). A
    value can be held past its drop (:meth:`hold`, :meth:`release`), as a window holds
    the output it will wait on.
    """

    def __init__(self) -> None:
        self.lines: list[str] = []
        self.globals: dict[str, object] = {}
        self.state: dict = {}
        self._names: dict[int, str] = {}
        self._count = 0
        self._held: set[int] = set()
        self._dropped: set[int] = set()  # held values already dropped by the program

    @staticmethod
    def value(vid: int) -> str:
        """The local that holds value ``vid``."""
        return f"v{vid}"

    def values(self, vids: Iterable[int]) -> str:
        return ", ".join(map(self.value, vids))

    def fresh(self, prefix: str) -> str:
        """A local name used nowhere else."""
        self._count += 1
        return f"{prefix}{self._count}"

    def const(self, obj: object, prefix: str = "c") -> str:
        """The global name the function reads ``obj`` by (the same name for the same
        object)."""
        name = self._names.get(id(obj))
        if name is None:
            name = self._names[id(obj)] = self.fresh("_" + prefix)
            self.globals[name] = obj
        return name

    def line(self, text: str) -> None:
        self.lines.append(text)

    def assign(self, dsts: Sequence[int], expr: str) -> None:
        """``dsts`` (value ids) unpacked from ``expr``, a call returning that many
        values (none: the call alone)."""
        if not dsts:
            self.line(expr)
        else:
            self.line(f"{self.values(dsts)}{',' if len(dsts) == 1 else ''} = {expr}")

    def set(self, vid: int, expr: str) -> None:
        """Value ``vid`` is ``expr`` (one value, not unpacked)."""
        self.line(f"{self.value(vid)} = {expr}")

    def drop(self, vids: Iterable[int]) -> None:
        """Let go of values: their buffers are freed once the devices are done (a held
        value: when it is released)."""
        vids = list(vids)
        self._dropped.update(v for v in vids if v in self._held)
        names = self.values(v for v in vids if v not in self._held)
        if names:
            self.line(f"del {names}")

    def hold(self, vid: int) -> None:
        """Keep value ``vid`` until :meth:`release`, whatever drops it before."""
        self._held.add(vid)

    def release(self, vid: int) -> None:
        """Let go of a held value, if the program dropped it meanwhile."""
        self._held.discard(vid)
        if vid in self._dropped:
            self._dropped.discard(vid)
            self.drop([vid])


def generate(program: Sequence, *, inputs: Sequence[int], outputs: Sequence[int],
             placements: Mapping[int, object], place: Callable, check: Callable,
             constants: Mapping[int, object], zeros: tuple[Sequence[int], Callable] | None,
             name: str = "dispatch") -> Callable[[Sequence], list]:
    """``program`` (steps with ``emit``) as ``fn(args) -> outputs``.

    The function calls ``check(args)``, takes ``args`` as the values ``inputs``,
    moves input ``k`` onto ``placements[k]`` with ``place(x, sharding)`` unless it is
    there already (``x.sharding`` is it or equals it), starts from ``constants`` (value id ->
    array) and the zeros ``zeros[1]()`` makes for the ids ``zeros[0]``, runs the
    steps, and returns the values ``outputs``. ``fn.source`` is its source.
    """
    em = Emitter()
    em.line(f"{em.const(check, 'check')}(args)")
    if inputs:
        em.line(f"{em.values(inputs)}{',' if len(inputs) == 1 else ''} = args")
    else:
        em.line("() = args")
    for k, sharding in placements.items():
        v, sh = em.value(inputs[k]), em.const(sharding, "sharding")
        em.line(f"if (_s := getattr({v}, 'sharding', None)) is not {sh} and _s != {sh}: "
                f"{v} = {em.const(place, 'place')}({v}, {sh})")
    for vid, value in constants.items():
        em.line(f"{em.value(vid)} = {em.const(value, 'constant')}")
    if zeros is not None and zeros[0]:
        em.assign(zeros[0], f"{em.const(zeros[1], 'zeros')}()")
    for step in program:
        step.emit(em)
    em.line(f"return [{em.values(outputs)}]")
    source = f"def {name}(args):\n" + "".join(f"    {s}\n" for s in em.lines)
    namespace = dict(em.globals)
    exec(compile(source, FILENAME, "exec"), namespace)  # noqa: S102 - our own source
    fn: Any = namespace[name]
    fn.source = source
    return fn
