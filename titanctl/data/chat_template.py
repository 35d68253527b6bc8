"""A tokenizer's chat template, rendered as transformers renders it, in a sandbox with bounds.

Where the template comes from (``find_chat_template``): ``sft.chat_template_path`` when set, else the
tokenizer's folder: ``chat_template.jinja`` (what transformers writes since 4.43), else the
``chat_template`` of its ``tokenizer_config.json`` (a string, or a list of named templates: "default").
The bundled tokenizer's folder ships one of titanctl's own (Llama 3's turn headers, with generation
marks).

Rendering follows ``transformers.utils.chat_template_utils`` (5.23) so that the text, and so the
token ids, equal ``tokenizer.apply_chat_template``'s: Jinja2's ImmutableSandboxedEnvironment with
``trim_blocks`` and ``lstrip_blocks``, loop controls, a ``{% generation %}`` tag that records where
assistant text was rendered, and the globals ``raise_exception``, ``strftime_now`` (fixed when the
template is loaded, so that every rank renders the same date), ``dict`` and ``namespace`` (names
with a leading underscore refused), the ``tojson`` filter without HTML escaping, and the special
tokens (``bos_token``, ``eos_token``, ...) as variables. Messages lose keys whose value is null, and
a message's reasoning is also offered as ``reasoning_content`` and ``thinking``, as transformers does.

Templates come from the Hub and are untrusted code, so beyond Jinja's sandbox (which refuses
attributes that reach Python internals, such as ``__class__``):
- any integer argument of a call or filter is at most ``MAX_ARGUMENT``, powers (``**``) are bounded,
  and every operation that can build more than it is given (string methods, filters, ``+``, ``*``,
  ``%``, ``~``, ``str.format``, a block's text, a printed value) is refused before it runs when its
  result would pass ``MAX_VALUE_CHARS``; what one rendering builds in all is at most
  ``MAX_RENDER_CHARS`` (titanctl.data.template_budget); ``urlize`` and ``pprint``, which no chat
  template uses, are left out;
- the whole output is at most ``MAX_OUTPUT_CHARS`` plus 16 characters per character of input;
- one rendering takes at most ``MAX_SECONDS`` (a timer, when rendering runs in the main thread);
- recursion ends at Python's recursion limit.
Breaking a bound, or reaching for internals, is a ``ChatTemplateError``: the template is refused,
in one line. A template that refuses a conversation (``raise_exception``, an undefined value, a
type error on the conversation's values) raises ``ConversationRefused``: the conversation is
skipped and counted.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import re
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

from titanctl.data import template_budget as budget
from titanctl.data.template_budget import Bound
from titanctl.data.tokenizer import TOKENIZER_CONFIG
from titanctl.deadline import Expired, time_limit
from titanctl.errors import DataError
from titanctl.safe_io import load_json, read_text, visible

TEMPLATE_FILE = "chat_template.jinja"
MAX_TEMPLATE_BYTES = 1 << 20  # Qwen3's template is 4 kB, Llama 3.1's 5 kB

MAX_OUTPUT_CHARS = 1 << 20  # output allowed on top of 16 characters per character of input
MAX_SECONDS = 10.0
_GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")
# Where a conversation's reasoning may be: transformers offers it under the first two names too.
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


class ChatTemplateError(DataError):
    """The chat template cannot be used at all (syntax, sandbox, bounds): one line."""


class ConversationRefused(Exception):
    """The template refused this conversation; the conversation is skipped and counted."""


class ChatTemplate:
    """A compiled chat template and the special tokens it may name."""

    def __init__(self, text: str, origin: str, special_tokens: dict[str, str] | None = None) -> None:
        import jinja2  # only chat data needs it

        self.text = text
        self.origin = origin  # for messages: a path
        self.special_tokens = dict(special_tokens or {})  # bos_token etc. -> their text
        self.marks_generation = bool(_GENERATION_TAG.search(text))
        self.sha256 = hashlib.sha256(
            (text + "\0" + json.dumps(self.special_tokens, sort_keys=True)).encode()
        ).hexdigest()
        self._now = datetime.now()
        self._env = _environment(self._now)
        try:
            self._template = self._env.from_string(text)
        except jinja2.TemplateSyntaxError as e:
            raise ChatTemplateError(
                f"chat template {origin}: syntax error on line {e.lineno}: {visible(str(e.message or e))}"
            ) from None
        except RecursionError:
            raise ChatTemplateError(f"chat template {origin} nests too deep to compile") from None

    def render(
        self, messages: list[dict], *, add_generation_prompt: bool = False, tools: list | None = None,
    ) -> tuple[str, list[tuple[int, int]]]:
        """(the rendered text, the character spans its ``{% generation %}`` blocks wrote).

        ``messages`` and ``tools`` must be plain JSON data (dicts, lists, strings, numbers, bools)."""
        import jinja2

        messages = [_with_reasoning_aliases({k: v for k, v in m.items() if v is not None}) for m in messages]
        budget = MAX_OUTPUT_CHARS + 16 * _chars_in(messages) + 16 * _chars_in(tools)
        tracker = self._env.generation_tracker
        pieces: list[str] = []
        produced = 0
        try:
            with _time_limit(MAX_SECONDS, self.origin), tracker.tracking(pieces), self._env.budget.rendering():
                for piece in self._template.generate(
                    messages=messages, tools=tools, add_generation_prompt=add_generation_prompt,
                    **self.special_tokens,
                ):
                    pieces.append(piece)
                    produced += len(piece)
                    if produced > budget:
                        raise ChatTemplateError(
                            f"chat template {self.origin} wrote more than {budget:,} characters for one "
                            "conversation: refused"
                        )
                spans = list(tracker.spans)
        except Bound as e:  # raised inside the template's code, which knows no origin
            raise ChatTemplateError(f"chat template {self.origin}: {e}: refused") from None
        except ChatTemplateError:
            raise
        except jinja2.exceptions.SecurityError as e:
            raise ChatTemplateError(f"chat template {self.origin} was refused by the sandbox: {_one_line(e)}") from None
        except RecursionError:
            raise ChatTemplateError(f"chat template {self.origin} recursed too deep: refused") from None
        except MemoryError:
            raise ChatTemplateError(f"chat template {self.origin} ran out of memory: refused") from None
        except jinja2.exceptions.TemplateError as e:  # raise_exception, undefined values
            raise ConversationRefused(_one_line(e)) from None
        except (TypeError, ValueError, LookupError, AttributeError, ArithmeticError) as e:
            raise ConversationRefused(f"{type(e).__name__}: {_one_line(e)}") from None
        return "".join(pieces), spans


def find_chat_template(tokenizer_path: Path, override: str = "") -> tuple[str, str]:
    """(the template text, where it came from) for a tokenizer file or folder."""
    if override:
        path = Path(override).expanduser()
        return read_text(path, what="chat template", max_bytes=MAX_TEMPLATE_BYTES, error=DataError), str(path)
    folder = tokenizer_path if tokenizer_path.is_dir() else tokenizer_path.parent
    jinja_file = folder / TEMPLATE_FILE
    if jinja_file.exists():
        text = read_text(jinja_file, what="chat template", max_bytes=MAX_TEMPLATE_BYTES, error=DataError)
        return text, str(jinja_file)
    config_file = folder / TOKENIZER_CONFIG
    if config_file.exists():
        config = load_json(config_file, what="tokenizer config", error=DataError)
        text = _template_of_config(config.get("chat_template") if isinstance(config, dict) else None)
        if text is not None:
            size = len(text.encode("utf-8", "surrogatepass"))
            if size > MAX_TEMPLATE_BYTES:  # as a template file of that size is
                raise DataError(f"chat template {visible(str(config_file))} (chat_template) has {size:,} bytes; at "
                                f"most {MAX_TEMPLATE_BYTES:,} are read")
            return text, f"{config_file} (chat_template)"
    raise DataError(
        f"tokenizer {visible(str(tokenizer_path))} has no chat template (no {TEMPLATE_FILE}, no chat_template in "
        f"{TOKENIZER_CONFIG} beside it); give one with sft.chat_template_path"
    )


def special_token_texts(tokenizer_path: Path, ids: dict[str, int | None], names: dict[int, str]) -> dict[str, str]:
    """``bos_token``, ``eos_token``, ``pad_token``, ``unk_token`` as the template sees them: those that
    the tokenizer's ``tokenizer_config.json`` names (what transformers passes), else, for a tokenizer
    without one, the tokenizer's own (``ids``: field -> id or None)."""
    folder = tokenizer_path if tokenizer_path.is_dir() else tokenizer_path.parent
    if not (folder / TOKENIZER_CONFIG).exists():
        return {field: names[i] for field, i in ids.items() if i is not None}
    config = load_json(folder / TOKENIZER_CONFIG, what="tokenizer config", error=DataError)
    out = {}
    for field in ("bos_token", "eos_token", "pad_token", "unk_token"):
        value = config.get(field) if isinstance(config, dict) else None
        if isinstance(value, dict):  # an AddedToken object
            value = value.get("content")
        if isinstance(value, str):
            out[field] = value
    return out


def _template_of_config(value: Any) -> str | None:
    if isinstance(value, str):
        return value
    if isinstance(value, list):  # [{"name": "default", "template": "..."}, {"name": "tool_use", ...}]
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
        if isinstance(named.get("default"), str):
            return named["default"]
    return None


def _with_reasoning_aliases(message: dict) -> dict:
    reasoning = next((message[k] for k in _REASONING_FIELDS if message.get(k) is not None), None)
    if reasoning is None:
        return message
    return {"thinking": reasoning, **message, "reasoning_content": reasoning}


def _chars_in(value: Any) -> int:
    if isinstance(value, str):
        return len(value)
    if isinstance(value, dict):
        return sum(_chars_in(k) + _chars_in(v) for k, v in value.items())
    if isinstance(value, list):
        return sum(_chars_in(v) for v in value)
    return 0


def _one_line(e: BaseException) -> str:
    text = str(e).strip()
    return visible(text.splitlines()[0] if text else type(e).__name__)


# ----------------------------------------------------------------------------- the environment


@contextlib.contextmanager
def _time_limit(seconds: float, origin: str) -> Iterator[None]:
    """Raise ChatTemplateError when the body runs longer than ``seconds`` (titanctl.deadline)."""
    try:
        with time_limit(seconds):
            yield
    except Expired:
        raise ChatTemplateError(
            f"chat template {origin} took more than {seconds:g} s for one conversation: refused"
        ) from None


def _bounded_filter(env, name: str, function):
    """``function`` (the filter ``name``) with its arguments checked and its result's size predicted
    (template_budget.FILTERS) before it runs, and counted once made."""
    import jinja2.utils

    passes = jinja2.utils._PassArg.from_obj(function) is not None  # a context or environment comes first

    @functools.wraps(function)  # keeps Jinja's pass_context / pass_environment marks
    def bounded(*args, **kwargs):
        budget.check_arguments(args, kwargs, f"filter {name}")
        lead, rest = (args[:1], args[1:]) if passes else ((), args)
        if name in budget.MATERIALIZED and rest:  # the iterable listed, so that its size is known first
            rest = (list(rest[0]), *rest[1:])
            env.made(rest[0], f"filter {name}")
        predicted = budget.predict(budget.FILTERS, name, rest, kwargs)
        if predicted is not None:
            budget.check(predicted, f"filter {name}")
        return env.made(function(*lead, *rest, **kwargs), f"filter {name}")

    return bounded


class _GenerationTracker:
    """Where each ``{% generation %}`` block's text starts and ends in the output."""

    def __init__(self) -> None:
        self.pieces: list[str] | None = None
        self.spans: list[tuple[int, int]] = []

    @contextlib.contextmanager
    def tracking(self, pieces: list[str]) -> Iterator[None]:
        self.pieces, self.spans = pieces, []
        try:
            yield
        finally:
            self.pieces = None

    def record(self, text: str) -> None:
        if self.pieces is not None:
            start = sum(len(p) for p in self.pieces)
            self.spans.append((start, start + len(text)))


def _environment(now: datetime):
    import jinja2
    from jinja2.compiler import CodeGenerator, optimizeconst
    from jinja2.ext import Extension
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(Extension):
        """``{% generation %}...{% endgeneration %}``: renders its body and records where it went."""

        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_generation", []), [], [], body).set_lineno(lineno)

        def _generation(self, caller):
            text = caller()
            self.environment.generation_tracker.record(text)
            return text

    class BoundedCode(CodeGenerator):
        """Jinja's compiler, with ``a ~ b`` joined by the environment (whose join is bounded)."""

        @optimizeconst
        def visit_Concat(self, node, frame):
            self.write("environment.joined((")
            for arg in node.nodes:
                self.visit(arg, frame)
                self.write(", ")
            self.write("))")

    class Bounded(ImmutableSandboxedEnvironment):
        intercepted_binops = frozenset({"+", "*", "**", "%"})
        code_generator_class = BoundedCode

        def made(self, value, what):
            """A value an operation made: within MAX_VALUE_CHARS, and counted against the rendering's budget."""
            size = budget.size_of(value)
            budget.check(size, what)
            self.budget.spend(size, what)
            return value

        def call_binop(self, context, operator, left, right):
            if operator == "**" and isinstance(right, (int, float)) and abs(right) > 64 and abs(left) > 1:
                raise Bound(f"{left!r:.20} ** {right!r:.20} is too large")
            if operator == "*":
                count, seq = (right, left) if isinstance(right, int) else (left, right)
                if isinstance(count, int) and isinstance(seq, (str, list, tuple)):
                    budget.check(len(seq) * count, f"repeating a value {count:,} times")
            if operator == "+" and isinstance(left, (str, list, tuple)) and isinstance(right, (str, list, tuple)):
                budget.check(len(left) + len(right), "operator +")
            if operator == "%" and isinstance(left, str):
                budget.check(budget.printf(left, right, "a % format"), "a % format")
            return self.made(super().call_binop(context, operator, left, right), f"operator {operator}")

        def unsafe_undefined(self, obj, attribute):
            # Jinja returns an undefined value that fails only when used (printing it writes nothing):
            # a template that reaches for an internal is refused at once instead.
            raise jinja2.exceptions.SecurityError(
                f"access to attribute {attribute!r} of a {type(obj).__name__} is unsafe"
            )

        def call(__self, __context, __obj, *args, **kwargs):  # Jinja's own signature
            budget.check_arguments(args, kwargs, "a call")
            owner, name = getattr(__obj, "__self__", None), getattr(__obj, "__name__", "")
            if isinstance(owner, str) and name == "join" and len(args) == 1 and not kwargs:
                args = (__self.made(list(args[0]), "str.join"),)  # listed, so that its size is known first
                budget.check(budget.join_size(owner, args[0]), "str.join")
            elif isinstance(owner, str):
                predicted = budget.predict(budget.STR_METHODS, name, (owner, *args), kwargs)
                if predicted is not None:
                    budget.check(predicted, f"str.{name}")
            return __self.made(super().call(__context, __obj, *args, **kwargs), "a call")

        def wrap_str_format(self, value):
            wrapped = super().wrap_str_format(value)  # str.format and format_map, looked up in the template
            if wrapped is None:
                return None
            text, mapping = value.__self__, value.__name__ == "format_map"

            def bounded(*args, **kwargs):
                values = (args[0] if args and isinstance(args[0], dict) else {}) if mapping else kwargs
                budget.check(budget.brace_format(text, () if mapping else args, values), "a format string")
                return wrapped(*args, **kwargs)

            return functools.update_wrapper(bounded, wrapped)

        def joined(self, values):
            """``a ~ b ~ ...`` (Jinja's ``str_join``), its size known before it is joined."""
            budget.check(sum(budget.rendered_size(v) for v in values), "operator ~")
            return self.made("".join(map(str, values)), "operator ~")

        def block_text(self, pieces):
            """The text of a ``{% set %}`` block, a macro, a ``{% filter %}`` or ``{% call %}`` block
            (Jinja's ``concat`` of its pieces), its size known before it is joined."""
            pieces = list(pieces)
            budget.check(sum(len(p) for p in pieces), "a block")
            return self.made("".join(pieces), "a block")

    def printed(value):
        """Each ``{{ value }}``, checked before Jinja turns it into text."""
        size = budget.check(budget.rendered_size(value), "a printed value")
        env.budget.spend(size, "a printed value")
        return value

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        # Jinja's own tojson escapes HTML characters; transformers' does not.
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(format):
        if isinstance(format, str):
            budget.check(16 * len(format), "strftime_now")  # %c writes 24 characters for 2
        return now.strftime(format)

    class Namespace(jinja2.utils.Namespace):
        """``namespace(...)`` without attributes that start with an underscore."""

        def __init__(*args, **kwargs):  # as Jinja's Namespace takes self
            self, args = args[0], args[1:]
            attrs = dict(*args, **kwargs)
            for name in attrs:
                _check_attribute_name(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name, value):
            _check_attribute_name(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

    def _check_attribute_name(name):
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"namespace attribute {name!r} starts with an underscore")

    class DictMaker:
        """``dict(...)`` and ``dict.fromkeys(...)``, without the type itself (its attributes)."""

        def __call__(self, *args, **kwargs):
            return dict(*args, **kwargs)

        def fromkeys(self, *args, **kwargs):
            return dict.fromkeys(*args, **kwargs)

    env = Bounded(trim_blocks=True, lstrip_blocks=True, extensions=[Generation, jinja2.ext.loopcontrols],
                  finalize=printed)
    env.concat = env.block_text
    env.generation_tracker = _GenerationTracker()
    env.budget = budget.Budget()
    env.filters["tojson"] = tojson
    for unused in ("urlize", "pprint"):  # their output has no bound we check, and no chat template uses them
        env.filters.pop(unused)
    env.filters = {name: _bounded_filter(env, name, f) for name, f in env.filters.items()}
    env.globals.pop("lipsum", None)  # text generator: no template needs it
    env.globals.update(raise_exception=raise_exception, strftime_now=strftime_now, dict=DictMaker(),
                       namespace=Namespace)
    return env
