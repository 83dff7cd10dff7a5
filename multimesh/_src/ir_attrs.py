"""The typed attribute reader: every attribute multimesh reads from IR goes through here.

IR comes from outside a Python program (``mm-opt`` files, ``compile_mpmd`` programs), so
an attribute may hold any type and any value. A reader states what it expects as a
:class:`Spec` (an integer in a range, a non-empty string, a list of them, a dictionary of
such fields, ...) and :func:`read` checks the value against it *before* anything uses
it: a mismatch is a :class:`DiagnosticError` at the op's location naming the attribute,
the value and the expected type (``mm-opt`` prints it as ``file:line:col: error:``).

Sizes that drive allocation have upper bounds (docs/ir.md, "Limits"):
:data:`MAX_DEVICES` device positions, :data:`MAX_MICROBATCHES` microbatches. Values
are printed by :func:`show`, which shortens long lists to their first few entries
and a count, so a typo cannot print megabytes.

:func:`check_source` is the guard every reader of IR *text* runs before MLIR's parser
(nesting depth, and the attributes that crash jaxlib's verifiers while it parses).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

from multimesh._src.brackets import deepest_nesting, skip_element
from multimesh._src.bytecode import BytecodeFormatError, bad_escape, bad_string
from multimesh._src.errors import DiagnosticError, SourceError
from multimesh._src.mlir import (
    attr_to_py,
    ir,
    make_context,
    probe_bytecode,
    sub_axis_at,
    zero_sub_axis,
)

__all__ = ["MAX_DEVICES", "MAX_MICROBATCHES", "MAX_NESTING", "MAX_SHOWN", "Spec", "INT", "BOOL",
           "STR", "NAME", "POSITION", "MICROBATCHES", "MICROBATCH_INDEX", "TOPOLOGY", "int_in",
           "list_of", "one_of", "dict_of", "map_of", "read", "read_attr", "show", "listing",
           "BYTECODE_MAGIC", "SourceError", "is_bytecode", "decode_source", "check_source"]

MAX_DEVICES = 1 << 20
"""Device positions are below this (1,048,576), and no mesh has more devices."""
MAX_MICROBATCHES = 1 << 16
"""The most microbatches a loop may have (65,536): the schedule and the runtime plan
hold one entry per (fragment call, microbatch)."""
MAX_NESTING = 10_000
"""Deepest bracket nesting MLIR's recursive parser is given (on a big stack)."""
MAX_SHOWN = 8
"""Messages list at most this many entries of a list, then the count."""


@dataclass(frozen=True)
class Spec:
    """What a reader expects: ``check(value)`` says whether a Python value (as
    ``attr_to_py`` gives it) fits; ``expected`` says it in words for messages."""

    expected: str
    check: Callable[[object], bool]
    plural: str = ""
    """``expected`` for many values (``integers >= 1`` for ``an integer >= 1``)."""


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def int_in(lo: int | None = None, hi: int | None = None,
           what: tuple[str, str] = ("an integer", "integers")) -> Spec:
    """An integer in ``lo..hi`` (either bound optional); ``what``: singular and plural."""
    if lo is not None and hi is not None:
        bound = f" in {lo}..{hi}"
    elif lo is not None:
        bound = f" >= {lo}"
    elif hi is not None:
        bound = f" <= {hi}"
    else:
        bound = ""
    def check(v) -> bool:
        return _is_int(v) and (lo is None or v >= lo) and (hi is None or v <= hi)

    return Spec(what[0] + bound, check, what[1] + bound)


INT = int_in()
BOOL = Spec("a boolean", lambda v: isinstance(v, bool), "booleans")
STR = Spec("a string", lambda v: isinstance(v, str), "strings")
NAME = Spec("a non-empty string", lambda v: isinstance(v, str) and bool(v),
            "non-empty strings")
POSITION = int_in(0, MAX_DEVICES - 1, ("a device position", "device positions"))
MICROBATCHES = int_in(1, MAX_MICROBATCHES, ("a microbatch count", "microbatch counts"))
MICROBATCH_INDEX = int_in(0, MAX_MICROBATCHES - 1, ("a microbatch index", "microbatch indices"))


def list_of(item: Spec, *, max_len: int | None = None, non_empty: bool = False) -> Spec:
    """A list whose every entry fits ``item``."""
    kind = "non-empty list" if non_empty else "list"
    bound = f" (at most {max_len})" if max_len is not None else ""
    return Spec(f"a {kind} of {item.plural}{bound}",
                lambda v: isinstance(v, list) and (not non_empty or bool(v))
                and (max_len is None or len(v) <= max_len) and all(item.check(x) for x in v),
                f"{kind}s of {item.plural}{bound}")


def one_of(*values: str) -> Spec:
    words = ", ".join(f'"{v}"' for v in values)
    return Spec("one of " + words, lambda v: v in values, "ones of " + words)


def dict_of(**fields: Spec) -> Spec:
    """A dictionary whose keys are among ``fields`` (each value fitting its spec); a
    mismatch names the field (see :func:`read`)."""
    keys = ", ".join(fields)
    return _DictSpec(f"a dictionary with keys among {keys}", lambda v: isinstance(v, dict),
                     f"dictionaries with keys among {keys}", fields)


@dataclass(frozen=True)
class _DictSpec(Spec):
    fields: dict[str, Spec] | None = None


def map_of(value: Spec, what: str = "names") -> Spec:
    """A dictionary from ``what`` to values that fit ``value``."""
    return Spec(f"a dictionary from {what} to {value.plural}",
                lambda v: isinstance(v, dict) and all(value.check(x) for x in v.values()),
                f"dictionaries from {what} to {value.plural}")


def read(value, spec: Spec, what: str, loc=None):
    """``value`` (an ``ir.Attribute`` or an ``attr_to_py`` value), checked against
    ``spec``: the Python value, or a :class:`DiagnosticError` at ``loc`` naming
    ``what``, the value and the expected type. Dictionaries are checked per field,
    so the message names the field (``'mm.schedule_config' num_stages ...``)."""
    v = attr_to_py(value) if isinstance(value, ir.Attribute) else value
    if not spec.check(v):
        raise DiagnosticError(f"{what} must be {spec.expected}, got {show(v)}", loc)
    if isinstance(spec, _DictSpec) and spec.fields is not None:
        for key, x in v.items():
            if key not in spec.fields:
                raise DiagnosticError(
                    f"{what} has unknown key '{key}' (expected {', '.join(spec.fields)})", loc)
            read(x, spec.fields[key], f"{what} {key}", loc)
    return v


_MISSING = object()


def read_attr(op: ir.Operation, name: str, spec: Spec, what: str | None = None, *,
              default=_MISSING):
    """The attribute ``name`` of ``op`` read by :func:`read` (``what`` defaults to
    ``'name' on 'op'``); ``default`` when absent, else a missing attribute is an error."""
    what = what or f"'{name}' on '{op.name}'"
    if name not in op.attributes:
        if default is not _MISSING:
            return default
        raise DiagnosticError(f"{what} is missing (expected {spec.expected})", op.location)
    return read(op.attributes[name], spec, what, op.location)


def show(v, limit: int = MAX_SHOWN) -> str:
    """A value as messages print it (MLIR-like): strings quoted, and a list longer than
    ``limit`` as its first ``limit`` entries and the count."""
    if isinstance(v, str):
        return '"' + (v if len(v) <= 200 else v[:200] + "...") + '"'
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (list, tuple)):
        head = ", ".join(show(x, limit) for x in v[:limit])
        more = f", ... ({len(v)} entries)" if len(v) > limit else ""
        return f"[{head}{more}]"
    if isinstance(v, dict):
        items = list(v.items())
        head = ", ".join(f"{k} = {show(x, limit)}" for k, x in items[:limit])
        more = f", ... ({len(items)} entries)" if len(items) > limit else ""
        return "{" + head + more + "}"
    if isinstance(v, ir.Attribute):
        text = str(v)
        return text if len(text) <= 200 else text[:200] + "..."
    if v is None:
        return "unit"
    return str(v)


def listing(items, limit: int = MAX_SHOWN) -> str:
    """``a, b, c`` for a message; past ``limit`` items, the first ones and the count."""
    items = list(items)
    head = ", ".join(str(x) for x in items[:limit])
    return head + (f", ... ({len(items)} in all)" if len(items) > limit else "")


# ----------------------------------------------------------------------------- source text

BYTECODE_MAGIC = b"ML\xefR"
"""The first bytes of MLIR bytecode (``mlir-opt`` tells bytecode from text by them)."""


def is_bytecode(data: str | bytes | bytearray) -> bool:
    return isinstance(data, (bytes, bytearray)) and bytes(data[:4]) == BYTECODE_MAGIC


def decode_source(data: str | bytes | bytearray) -> str | bytes:
    """A program as MLIR's parser takes it: bytecode as ``bytes``, text as a ``str``
    that is valid Unicode (UTF-8 bytes are decoded); else a :class:`SourceError` at
    the first bad character. Then :func:`check_source`."""
    if isinstance(data, (bytes, bytearray)):
        raw = bytes(data)
        if is_bytecode(raw):
            check_source(raw)
            return raw
        try:
            data = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            line, col = _line_col(raw, e.start)
            raise SourceError(f"input is not valid UTF-8: byte 0x{raw[e.start]:02x} "
                              f"({e.reason}); MLIR files are UTF-8 text or MLIR bytecode",
                              line, col) from None
    else:
        try:
            data.encode("utf-8")
        except UnicodeEncodeError as e:
            line, col = _line_col(data, e.start)
            raise SourceError(f"input is not valid Unicode: it holds the lone surrogate "
                              f"U+{ord(data[e.start]):04X}, which UTF-8 cannot encode",
                              line, col) from None
    check_source(data)
    return data


def _line_col(data, offset: int) -> tuple[int, int]:
    nl = b"\n" if isinstance(data, bytes) else "\n"
    return data.count(nl, 0, offset) + 1, offset - (data.rfind(nl, 0, offset) + 1) + 1


def check_source(data: str | bytes) -> None:
    """A :class:`SourceError` for what MLIR's parser must not see in a program:
    nesting deeper than :data:`MAX_NESTING`, a size-0 sub-axis in an mpmd type
    (jaxlib divides by it) or a ``topology`` that is not an ``#mpmd.topology`` in a
    module with mpmd ops (jaxlib's verifier casts it blindly). In bytecode the mpmd
    dialect's attributes and types are stored as text, which is what is checked
    there (the nesting of bytecode is not known before it is parsed)."""
    if isinstance(data, bytes):
        _check_bytecode(data)
        return
    depth, offset = deepest_nesting(data, MAX_NESTING)
    if depth > MAX_NESTING:
        raise SourceError(f"the input nests brackets more than {MAX_NESTING} levels deep "
                          f"(regions, attributes or types), which multimesh does not accept",
                          *_line_col(data, offset))
    sub_axis = zero_sub_axis(data)
    if sub_axis is not None:
        raise SourceError(_zero_sub_axis_message(data, sub_axis), *_line_col(data, sub_axis))
    if "mpmd." in data:
        bad = _bad_topology(data)
        if bad is not None:
            raise SourceError(bad[1], *_line_col(data, bad[0]))
    escaped = bad_escape(data)
    if escaped is not None:
        raise SourceError(f"the string {_shown_bytes(escaped[1])} is not valid UTF-8 once "
                          f"its escapes are read; names and strings in MLIR are UTF-8",
                          *_line_col(data, escaped[0]))


def _zero_sub_axis_message(text: str, offset: int) -> str:
    return (f"sub-axis sizes must be greater than 1, got {sub_axis_at(text, offset)}; "
            f"jaxlib's mpmd parser would divide by zero")


def _check_bytecode(data: bytes) -> None:
    _check_bytecode_strings(data)
    text = data.decode("latin-1")  # one character per byte: the mpmd text is ASCII
    if "#mpmd." not in text and "!mpmd." not in text:
        return
    offset = zero_sub_axis(text)
    if offset is not None:
        raise SourceError(_zero_sub_axis_message(text, offset))
    if "topology\x00" in text and "#mpmd.topology<" not in text:
        raise SourceError("'topology' must be an #mpmd.topology; in this bytecode it is "
                          "some other attribute, which jaxlib's mpmd dialect would read "
                          "without a check")


def _check_bytecode_strings(data: bytes) -> None:
    """Every name in bytecode is UTF-8, as in text: jaxlib's bindings abort the process
    on a name that is not (multimesh/_src/bytecode.py)."""
    try:
        bad = bad_string(data)
    except BytecodeFormatError as e:
        raise SourceError(f"the input is not valid MLIR bytecode: {e}") from None
    if bad is not None:
        shown = _shown_bytes(bad.rstrip(b"\0"))
        raise SourceError(f"the bytecode holds a string that is not valid UTF-8: {shown}; "
                          f"names and strings in MLIR are UTF-8")
    harm = probe_bytecode(data)
    if harm is not None:
        raise SourceError(f"the input is not valid MLIR bytecode: {harm}")


def _shown_bytes(raw: bytes) -> str:
    """Bytes as a quoted string, bytes that are not UTF-8 as ``\\xFF``."""
    return show(raw.decode("utf-8", "backslashreplace"))


_TOPOLOGY = re.compile(r'[{,]\s*"?topology"?\s*(?:=\s*|(?=[,}]))')
"""``topology`` as a key of an attribute dictionary (``= value``, or alone: ``unit``)."""
_ALIAS = r"^[ \t]*{}[ \t]*=[ \t]*"
TOPOLOGY = Spec("an #mpmd.topology", lambda v: isinstance(v, ir.Attribute)
                and str(v).startswith("#mpmd.topology<"), "#mpmd.topologies")
"""``topology`` on a function that holds mpmd ops: jaxlib's mpmd verifiers cast it
without a check, so any other attribute kills the process while the module parses."""


def _bad_topology(text: str) -> tuple[int, str] | None:
    """``(offset, message)`` of the first ``topology = X`` whose X is not an
    ``#mpmd.topology`` (directly or through an attribute alias)."""
    for m in _TOPOLOGY.finditer(text):
        value = _attribute_text(text, m.end()) or "unit"
        if re.fullmatch(r"#[\w.$-]+", value):  # an attribute alias: its definition
            d = re.search(_ALIAS.format(re.escape(value)), text, re.M)
            value = _attribute_text(text, d.end()) if d else value
        if value.startswith("#mpmd.topology<"):
            continue
        shown = value if len(value) <= 200 else value[:200] + "..."
        try:
            with make_context():
                shown = show(ir.Attribute.parse(value))
        except ir.MLIRError:
            pass
        return text.index("topology", m.start()), (f"'topology' must be {TOPOLOGY.expected}, got {shown}; "
                           f"jaxlib's mpmd dialect reads it from the function that holds "
                           f"mpmd ops without a check")
    return None


def _attribute_text(text: str, start: int) -> str:
    """The attribute value starting at ``start``, up to the ``,`` or ``}`` that ends it."""
    return text[start:skip_element(text, start)].strip()
