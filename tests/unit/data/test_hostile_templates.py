"""Hostile chat templates, round 4 (issue 57, class 1): templates that build huge strings inside the
sandbox, each with an operation that makes far more than it is given (a string method, a filter, ``%``,
``~``, ``+``, a block's text). Every one is refused in one line naming the template, before the value is
built (peak memory far below it), for chat data and for ``infer-tp --chat`` alike. In-process."""

from __future__ import annotations

import json
import re
import shutil
import time
import tracemalloc

import pytest

from tests.unit.inference.test_infer_chat import checkpoint, no_model_load, refused  # noqa: F401 (fixtures)
from titanctl.data.chat_template import MAX_TEMPLATE_BYTES, ChatTemplate, ChatTemplateError, find_chat_template
from titanctl.data.template_budget import MAX_RENDER_CHARS, MAX_VALUE_CHARS
from titanctl.data.tokenizer import DEFAULT_TOKENIZER_PATH
from titanctl.errors import DataError

PEAK_MIB = 200  # what a refused template may allocate: the values it built are at most a few times 4 MB
BIG = "{% set big = 'x' * 4000000 %}"
LOOP = "{% for i in range(100000) %}{{ big }}{% endfor %}"
BUILT = f"would build a value of [0-9,]+ characters or items, more than {MAX_VALUE_CHARS:,}"
SPENT = f"the template built more than {MAX_RENDER_CHARS:,} characters and items for one conversation"

CASES = {  # the cases first, then variations of each class of operation
    "ljust_replace": ("{{ 'a'.ljust(10**6).replace(' ', 'x'*5000) }}", f"str.replace {BUILT}"),
    "join": ("{{ ('y'*4000000).join(range(1300)|map('string')) }}", f"str.join {BUILT}"),
    "printf_star_width": ("{{ '%*s' % (5000000000,'a') }}", "a % format's \\* width was given 5000000000"),
    "expandtabs": ("{{ ('\\t'*5000).expandtabs(10**6) }}", f"str.expandtabs {BUILT}"),
    "tojson_indent": ("{{ ([1]*5000)|tojson(indent=1000000) }}", f"filter tojson {BUILT}"),
    "map_center": ("{{ range(100000)|map('string')|map('center',1000000)|list }}", f"filter center: {SPENT}"),
    "set_block": (BIG + "{% set s %}" + LOOP + "{% endset %}{{ s|length }}", f"a printed value: {SPENT}"),
    "macro": (BIG + "{% macro m() %}" + LOOP + "{% endmacro %}{{ m()|length }}", f"a printed value: {SPENT}"),
    "filter_block": (BIG + "{% filter length %}" + LOOP + "{% endfilter %}", f"a printed value: {SPENT}"),
    "doubling_tilde": ("{% set ns = namespace(s='ab') %}{% for i in range(40) %}{% set ns.s = ns.s ~ ns.s %}"
                       "{% endfor %}", f"operator ~ {BUILT}"),
    "doubling_plus": ("{% set ns = namespace(s=[1]) %}{% for i in range(40) %}{% set ns.s = ns.s + ns.s %}"
                      "{% endfor %}", f"operator \\+ {BUILT}"),
    "printed_list": ("{{ [('x'*4000000)]*1000 }}", f"a printed value {BUILT}"),
    "string_filter": ("{{ ([('x'*4000000)]*1000)|string|length }}", f"filter string {BUILT}"),
    "join_filter": ("{{ ([('x'*4000000)]*1000)|join|length }}", f"filter join {BUILT}"),
    "wordwrap": ("{{ ('a'*4000000)|wordwrap(1, wrapstring='y'*1000)|length }}", f"filter wordwrap {BUILT}"),
    "indent": ("{{ ('\\n'*1000000)|indent('y'*1000)|length }}", f"filter indent {BUILT}"),
    "format_fields": ("{{ '{0}{0}{0}{0}{0}{0}{0}{0}{0}{0}'.format('x'*4000000)|length }}", f"a format string {BUILT}"),
    "printf_fields": ("{{ ('%s'*1000) % (('x'*4000000,)*1000) }}", f"a % format {BUILT}"),
    "format_filter": ("{{ '%s%s%s%s%s' | format(*(['x'*4000000]*5)) }}", f"filter format {BUILT}"),
    "strftime": ("{{ strftime_now('%c'*2000000)|length }}", f"strftime_now {BUILT}"),
    "sum_lists": ("{{ ([[1]*4000000]*1000) | sum(start=[]) | length }}", f"filter sum {BUILT}"),
    "escape": ("{{ ('<'*4000000)|e|length }}", f"filter e {BUILT}"),
    "tojson_separators": ("{{ ([1]*5000)|tojson(separators=('x'*1000000, ':')) }}", f"filter tojson {BUILT}"),
    "upper_in_a_loop": ("{% for i in range(100000) %}{% set x = ('z'*4000000).upper() %}{% endfor %}",
                        f"operator \\*: {SPENT}"),
}


def render(text: str, content: str = "hi") -> str:
    return ChatTemplate(text, "hostile.jinja").render([{"role": "user", "content": content}])[0]


@pytest.mark.parametrize("name", sorted(CASES))
def test_a_template_that_builds_a_huge_value_is_refused_before_building_it(name):
    text, says = CASES[name]
    start = time.monotonic()
    tracemalloc.start()
    try:
        with pytest.raises(ChatTemplateError) as e:
            render(text)
        peak = tracemalloc.get_traced_memory()[1] >> 20
    finally:
        tracemalloc.stop()
    message = str(e.value)
    assert message.startswith("chat template hostile.jinja: ") and message.endswith(": refused"), message
    assert re.search(says, message), message
    assert "\n" not in message and peak < PEAK_MIB, (message, peak)
    assert time.monotonic() - start < 30


def test_what_real_templates_build_stays_far_within_the_bounds():
    """Values a template may build (4 MB strings, a million-item range listed, a join of 1,000 lines) still
    render: the bounds refuse what makes more than it is given, not large conversations."""
    assert len(render("{{ ('x' * 4000000)|length }}{{ (range(100000)|list)|length }}")) == 13
    assert render("{{ messages[0].content.ljust(1000000)|length }}") == "1000000"
    lines = render("{{ ([messages[0].content] * 1000)|join('\\n')|length }}", "y" * 3000)
    assert lines == str(1000 * 3000 + 999)
    assert render("{{ {'a': [1, 2]}|tojson(indent=2) }}") == '{\n  "a": [\n    1,\n    2\n  ]\n}'
    assert render("{{ '%5s|%-3d' % ('ab', 7) }}{{ '{:>4}'.format(1) }}{{ 'a\\tb'.expandtabs(4) }}") == "   ab|7     1a   b"


@pytest.mark.parametrize("name", ["ljust_replace", "set_block", "tojson_indent"])
def test_infer_tp_chat_refuses_the_same_templates_before_loading(checkpoint, tmp_path, capsys, no_model_load,  # noqa: F811
                                                                 name):
    template = tmp_path / "hostile.jinja"
    template.write_text(CASES[name][0])
    err = refused(["infer-tp", "--checkpoint", str(checkpoint), "--chat", "--prompt", "hi",
                   "--sft.chat_template_path", str(template)], capsys)
    assert f"chat template {template}: " in err and err.endswith(": refused"), err


def test_a_template_in_tokenizer_config_is_bounded_as_a_template_file(tmp_path):
    """An 8 MB chat_template inside tokenizer_config.json was used (the 1 MiB bound covered files only)."""
    folder = tmp_path / "tok"
    folder.mkdir()
    shutil.copy(DEFAULT_TOKENIZER_PATH, folder / "tokenizer.model")
    huge = "{# " + "x" * (2 << 20) + " #}"  # the had 8 MB
    for value in (huge, [{"name": "default", "template": huge}]):
        (folder / "tokenizer_config.json").write_text(json.dumps({"chat_template": value}))
        with pytest.raises(DataError) as e:
            find_chat_template(folder / "tokenizer.model")
        assert str(e.value) == (f"chat template {folder / 'tokenizer_config.json'} (chat_template) has "
                                f"{len(huge):,} bytes; at most {MAX_TEMPLATE_BYTES:,} are read")
    (folder / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{{ messages }}"}))
    assert find_chat_template(folder / "tokenizer.model")[0] == "{{ messages }}"
