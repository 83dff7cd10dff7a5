"""multimesh._src.brackets: the one bracket/string scanner (pipelines, locations, modules)."""

from __future__ import annotations

import pytest

from multimesh._src.brackets import (
    UnbalancedError,
    deepest_nesting,
    read_string,
    skip_balanced,
    skip_element,
    split_top,
)


def test_read_string_decodes_mlir_escapes():
    s = r'x"a\"b\\c\n\22d"rest'
    text, end = read_string(s, 1)
    assert text == 'a"b\\c\n"d'
    assert s[end:] == "rest"


def test_skip_balanced_ignores_brackets_inside_literals():
    s = 'fused<"}>">[a, "]"]tail'
    assert s[skip_balanced(s, 5):] == '[a, "]"]tail'
    assert s[skip_balanced(s, 11):] == "tail"


def test_skip_element_stops_at_a_top_level_separator_or_closer():
    s = 'a(b, c), "d,e"]'
    assert skip_element(s, 0) == s.index(")") + 1
    assert s[skip_element(s, 9):] == "]"


@pytest.mark.parametrize("text, parts", [
    ("", []),
    ("a", ["a"]),
    ("a, b{x=1,y=2} ,c", ["a", "b{x=1,y=2}", "c"]),
    ('a{s="x,}y"},b', ['a{s="x,}y"}', "b"]),
    ("a,", ["a", ""]),
    (",a", ["", "a"]),
])
def test_split_top(text, parts):
    assert split_top(text, ",", ("({", ")}")) == parts


@pytest.mark.parametrize("text, closing", [
    ("a),b", True), ("a{b", False), ('a"b', False), ("a}", True)])
def test_split_top_rejects_unbalanced_text(text, closing):
    with pytest.raises(UnbalancedError) as e:
        split_top(text, ",", ("({", ")}"))
    assert e.value.closing is closing


def test_deepest_nesting_skips_strings_and_comments():
    text = "{" * 3 + '"((((("' + "// [[[[[\n" + "(" * 2 + ")" * 2 + "}" * 3
    assert deepest_nesting(text, 100) == (0, 0)  # cheap count says it cannot exceed
    assert deepest_nesting(text, 4) == (5, text.index("((", 10) + 1)  # the 5th opener
    assert deepest_nesting(text, 5)[0] == 5
