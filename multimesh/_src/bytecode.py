"""Read the strings of MLIR bytecode before MLIR does (issue 31).

jaxlib's bindings turn every name MLIR hands to Python (a mesh name, a symbol, a
diagnostic's text) into a ``str``; a name that is not valid UTF-8 makes nanobind abort
the process. MLIR text is checked for UTF-8 as a whole before it is parsed
(:func:`multimesh._src.ir_attrs.decode_source`); bytecode holds its names in two
places, which :func:`bad_string` reads without MLIR:

* the string section (section 0): every name, string attribute, symbol, operation
  and dialect name, as null-terminated strings whose lengths are stored in reverse;
* the attribute and type section (section 2): attributes and types of dialects with no
  bytecode encoding of their own (``#mpmd.*``, ``#sdy.*``) are stored as their text.

The layout is MLIR's (``mlir/lib/Bytecode/Reader/BytecodeReader.cpp``): the magic
bytes, a version, a producer string, then sections of ``id | aligned << 7``, a length,
an alignment and ``0xCB`` padding when aligned, and the data.
"""

from __future__ import annotations

import re

__all__ = ["BytecodeFormatError", "bad_escape", "bad_string"]

_STRINGS, _ATTR_TYPE, _ATTR_TYPE_OFFSETS = 0, 2, 3
_PADDING = 0xCB


class BytecodeFormatError(ValueError):
    """The bytecode's layout cannot be read (truncated, or a length out of range)."""


class _Reader:
    def __init__(self, data: bytes, pos: int = 0, what: str = "the bytecode"):
        self.data, self.pos, self.what = data, pos, what

    def done(self) -> bool:
        return self.pos >= len(self.data)

    def byte(self) -> int:
        if self.pos >= len(self.data):
            raise BytecodeFormatError(f"{self.what} ends early")
        self.pos += 1
        return self.data[self.pos - 1]

    def varint(self) -> int:
        """MLIR's prefix varint: the first byte's trailing zeros count the extra bytes."""
        first = self.byte()
        n = 9 if first == 0 else (first & -first).bit_length()
        raw = self.take(n - 1)
        if first == 0:
            return int.from_bytes(raw, "little")
        return int.from_bytes(bytes([first]) + raw, "little") >> n

    def take(self, n: int) -> bytes:
        if n < 0 or self.pos + n > len(self.data):
            raise BytecodeFormatError(f"{self.what} ends early (a length of {n} bytes at "
                                      f"byte {self.pos} runs past its end)")
        self.pos += n
        return self.data[self.pos - n:self.pos]

    def cstring(self) -> bytes:
        end = self.data.find(b"\0", self.pos)
        if end < 0:
            raise BytecodeFormatError(f"{self.what} ends inside a string")
        out, self.pos = self.data[self.pos:end], end + 1
        return out


def _sections(data: bytes) -> tuple[bytes, dict[int, bytes]]:
    """The producer string and the sections' data by section id."""
    r = _Reader(data, 4)
    r.varint()  # version
    producer = r.cstring()
    out: dict[int, bytes] = {}
    while not r.done():
        head = r.byte()
        length = r.varint()
        if head & 0x80:
            align = r.varint()
            if align == 0 or align & (align - 1) or align > 1 << 16:
                raise BytecodeFormatError(f"a section's alignment is {align}")
            while r.pos % align:
                if r.byte() != _PADDING:
                    raise BytecodeFormatError("a section's padding is not 0xCB")
        out[head & 0x7F] = r.take(length)
    return producer, out


def _strings(section: bytes) -> list[bytes]:
    r = _Reader(section, 0, "the string section")
    count = r.varint()
    if count > len(section):
        raise BytecodeFormatError(f"the string section claims {count} strings")
    sizes = [r.varint() for _ in range(count)]
    return [r.take(n) for n in reversed(sizes)]


def _textual_entries(data: bytes, offsets: bytes) -> list[bytes]:
    """The attributes and types stored as text (no custom encoding), null-terminated."""
    r = _Reader(offsets, 0, "the attribute and type offset section")
    total = r.varint() + r.varint()
    if total > len(offsets):
        raise BytecodeFormatError(f"the bytecode claims {total} attributes and types")
    out, seen, at = [], 0, 0
    while seen < total:
        r.varint()  # the dialect
        n = r.varint()
        if n > total - seen:
            raise BytecodeFormatError("an attribute group runs past the attribute count")
        for _ in range(n):
            flagged = r.varint()
            size, custom = flagged >> 1, flagged & 1
            if at + size > len(data):
                raise BytecodeFormatError("an attribute or type runs past its section")
            if not custom:
                out.append(data[at:at + size])
            at += size
        seen += n
    return out


def bad_string(data: bytes) -> bytes | None:
    """The first string of the bytecode ``data`` (a name, a string attribute, the text
    of an attribute or type, the producer) that is not valid UTF-8, or None.

    Raises :class:`BytecodeFormatError` when the sections holding them cannot be read.
    """
    producer, sections = _sections(data)
    pieces = [producer] + _strings(sections.get(_STRINGS, b"\0"))
    if _ATTR_TYPE_OFFSETS in sections:
        pieces += _textual_entries(sections.get(_ATTR_TYPE, b""), sections[_ATTR_TYPE_OFFSETS])
    for piece in pieces:
        try:
            text = piece.decode("utf-8")
        except UnicodeDecodeError:
            return piece
        if bad_escape(text) is not None:  # the text of an attribute: "\FF" escapes
            return piece
    return None


_HIGH_ESCAPE = re.compile(r"\\[89a-fA-F][0-9a-fA-F]")
_LITERAL_OR_COMMENT = re.compile(r'"(?:[^"\\\n]|\\.)*"|//[^\n]*')
_ESCAPE = re.compile(r"\\([0-9a-fA-F]{2}|.)", re.DOTALL)
_NAMED = {"n": b"\n", "t": b"\t", '"': b'"', "\\": b"\\"}


def bad_escape(text: str) -> tuple[int, bytes] | None:
    """The offset and bytes of the first string literal in MLIR text whose ``\\HH``
    escapes spell bytes that are not UTF-8 (``"\\FF1"``), or None: MLIR's parser
    accepts them, and the name then aborts the process when it reaches Python."""
    if _HIGH_ESCAPE.search(text) is None:
        return None
    for m in _LITERAL_OR_COMMENT.finditer(text):
        literal = m.group(0)
        if literal.startswith("/") or _HIGH_ESCAPE.search(literal) is None:
            continue
        raw = _ESCAPE.sub(lambda e: _unescape(e.group(1)), literal[1:-1].encode("utf-8")
                          .decode("latin-1")).encode("latin-1")
        try:
            raw.decode("utf-8")
        except UnicodeDecodeError:
            return m.start(), raw
    return None


def _unescape(code: str) -> str:
    if len(code) == 2:
        return chr(int(code, 16))
    return _NAMED.get(code, b"\\" + code.encode("latin-1")).decode("latin-1")
