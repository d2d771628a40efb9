"""Rendering an untrusted chat template (Jinja) with bounded time, recursion, size and output.

A chat template comes from a model file (GGUF ``tokenizer.chat_template``, a Hugging Face
``tokenizer_config.json`` or ``chat_template.jinja``), so it is treated as hostile code. It is
rendered in Jinja's immutable sandbox (no Python internals, no files: there is no loader, so
``include``/``import``/``extends`` fail) with these bounds, each ending the render with one
:class:`~lmlab.errors.LmlabError`:

- the template source: a string of at most :data:`MAX_TEMPLATE_CHARS` characters;
- wall-clock time: :data:`MAX_SECONDS` for parsing and rendering together (a watchdog raises
  inside the rendering thread, so ``{% for i in range(10**5) %}{% for j in range(10**5) %}``
  stops too);
- nested calls (macros, functions): :data:`MAX_CALL_DEPTH`;
- every value a template builds and its whole output: at most ``max(MAX_OUTPUT_CHARS, 4 x the
  characters of the messages)`` characters (or items). Operations that could allocate more in
  one step are checked before they run: ``*`` and ``+`` on strings and lists, ``**`` on
  integers, ``%`` formatting and ``format`` widths, ``~`` concatenation, the ``replace``,
  ``join``, ``center``, ``indent``, ``wordwrap`` and ``tojson`` filters and the string methods;
  any other filter or function is refused a numeric argument above the bound. String methods
  outside :data:`STR_METHODS` (``translate``, ``expandtabs`` ...) are not offered.
"""

from __future__ import annotations

import ctypes
import functools
import inspect
import re
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from lmlab.errors import LmlabError

MAX_TEMPLATE_CHARS = 1 << 20  # characters of template source
MAX_OUTPUT_CHARS = 1 << 20  # characters (or items) of the output and of any value built
MAX_SECONDS = 2.0  # wall clock for parsing + rendering
MAX_CALL_DEPTH = 64  # nested macro / function calls
MAX_POW_BITS = 1 << 16  # bits of an integer a ** b may produce
MAX_JSON_INDENT = 64

# the str methods a template may call (what chat templates use); others are not offered
STR_METHODS = frozenset(
    {
        *("strip", "lstrip", "rstrip", "split", "rsplit", "splitlines", "partition"),
        *("rpartition", "startswith", "endswith", "removeprefix", "removesuffix"),
        *("lower", "upper", "title", "capitalize", "casefold", "swapcase"),
        *("find", "rfind", "index", "rindex", "count", "replace", "join", "format"),
        *("isdigit", "isspace", "isalpha", "isalnum", "isnumeric", "isdecimal", "isupper"),
        *("islower", "istitle", "isascii", "ljust", "rjust", "center", "zfill"),
    }
)
_ALL_STR_METHODS = frozenset(n for n in dir(str) if not n.startswith("_"))
_PERCENT_WIDTH = re.compile(r"%[#0\- +]*(\*|\d+)?(?:\.(\*|\d+))?")
_BRACE_WIDTH = re.compile(r"\{[^{}]*?:[^{}]*?(\d+)(?:\.(\d+))?[^{}]*\}")


class TemplateLimit(Exception):
    """A bound of this module was reached (the message says which)."""


class _Timeout(Exception):
    """Raised asynchronously in the rendering thread by the watchdog."""


@contextmanager
def _deadline(seconds: float) -> Iterator[None]:
    """Raise :class:`_Timeout` in this thread if the block runs longer than ``seconds``.

    A watchdog thread sets an asynchronous exception (``PyThreadState_SetAsyncExc``), which the
    interpreter raises at the next bytecode of this thread, and sets it again every 50 ms (one
    raised inside a weakref callback or ``__del__`` is swallowed there) until the block ends; a
    pending one is cleared on exit."""
    tid = threading.get_ident()
    lock = threading.Lock()
    stop = threading.Event()
    state = {"done": False, "fired": False}
    set_async = ctypes.pythonapi.PyThreadState_SetAsyncExc

    def watch() -> None:
        if stop.wait(seconds):
            return
        while True:
            with lock:
                if state["done"]:
                    return
                state["fired"] = True
                set_async(ctypes.c_ulong(tid), ctypes.py_object(_Timeout))
            if stop.wait(0.05):
                return

    watchdog = threading.Thread(target=watch, name="chat-template-deadline", daemon=True)
    watchdog.start()
    try:
        yield
    finally:
        with lock:
            state["done"] = True
        stop.set()
        if state["fired"]:  # not yet delivered: drop it
            set_async(ctypes.c_ulong(tid), ctypes.c_void_p(0))


def _length(value: Any) -> int | None:
    if isinstance(value, (str, bytes, list, tuple, dict, set, frozenset)):
        return len(value)
    return None


def _check_format(fmt: str, limit: int) -> None:
    """Refuse a ``%`` or ``{}`` format string whose width or precision exceeds ``limit``."""
    for m in _PERCENT_WIDTH.finditer(fmt):
        for g in m.groups():
            if g == "*":
                raise TemplateLimit("a '*' width in % formatting is not allowed")
            if g and int(g) > limit:
                raise TemplateLimit(f"a format width of {g} exceeds the bound of {limit:,}")
    for m in _BRACE_WIDTH.finditer(fmt):
        for g in m.groups():
            if g and int(g) > limit:
                raise TemplateLimit(f"a format width of {g} exceeds the bound of {limit:,}")


def _make_environment(limit: int) -> Any:
    """A fresh bounded sandbox whose values and output may hold ``limit`` characters."""
    from jinja2.compiler import CodeGenerator
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class BoundedCodeGenerator(CodeGenerator):
        def visit_Concat(self, node: Any, frame: Any) -> None:  # ``a ~ b``: size-checked join
            self.write("environment.bounded_concat((")
            for arg in node.nodes:
                self.visit(arg, frame)
                self.write(", ")
            self.write("))")

    def check_size(value: Any, what: str) -> Any:
        n = _length(value)
        if n is not None and n > limit:
            raise TemplateLimit(f"{what} would hold {n:,} characters or items (bound {limit:,})")
        return value

    def check_estimate(n: int, what: str) -> None:
        if n > limit:
            raise TemplateLimit(f"{what} would make {n:,} characters (bound {limit:,})")

    def check_numbers(values: Any, what: str) -> None:
        for v in values:
            if isinstance(v, int) and not isinstance(v, bool) and abs(v) > limit:
                raise TemplateLimit(f"{what} was given {v}, above the bound of {limit:,}")

    def str_method(s: str, name: str, method: Callable[..., Any]) -> Callable[..., Any]:
        if name not in STR_METHODS:
            raise TemplateLimit(f"str.{name} is not offered to chat templates")

        def bounded(*args: Any, **kwargs: Any) -> Any:
            what = f"str.{name}"
            if name == "replace" and len(args) >= 2 and all(isinstance(a, str) for a in args[:2]):
                old, new = args[0], args[1]
                n = s.count(old) if old else len(s) + 1
                if len(args) > 2 and isinstance(args[2], int) and args[2] >= 0:
                    n = min(n, args[2])
                check_estimate(len(s) + n * max(0, len(new) - len(old)), what)
            elif name == "join" and args:
                items = list(args[0])
                check_size(items, what)
                total = sum(len(x) for x in items if isinstance(x, str))
                check_estimate(total + len(s) * max(0, len(items) - 1), what)
                args = (items, *args[1:])
            elif name == "format":
                _check_format(s, limit)
            check_numbers([*args, *kwargs.values()], what)
            return check_size(method(*args, **kwargs), what)

        bounded.__name__ = f"str.{name}"
        return bounded

    def bounded_filter(name: str, f: Callable[..., Any]) -> Callable[..., Any]:
        skip = 1 if hasattr(f, "jinja_pass_arg") else 0  # context / environment first
        sig = inspect.signature(f)

        @functools.wraps(f)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            what = f"the {name} filter"
            rest = list(args[skip + 1 :]) + list(kwargs.values())
            if name in ("replace", "join", "center", "indent", "wordwrap", "tojson", "format"):
                try:
                    a = sig.bind(*args, **kwargs).arguments
                except TypeError:
                    a = {}
                value = args[skip] if len(args) > skip else ""
                text = value if isinstance(value, str) else ""
                if name == "replace" and isinstance(a.get("old"), str):
                    old, new = a["old"], str(a.get("new", ""))
                    n = text.count(old) if old else len(text) + 1
                    check_estimate(len(text) + n * max(0, len(new) - len(old)), what)
                elif name == "join":
                    items = list(value)
                    check_size(items, what)
                    sep = str(a.get("d", ""))
                    total = sum(len(x) for x in items if isinstance(x, str))
                    check_estimate(total + len(sep) * max(0, len(items) - 1), what)
                    args = (*args[:skip], items, *args[skip + 1 :])
                elif name == "indent":
                    width = a.get("width", 4)
                    per_line = len(width) if isinstance(width, str) else int(width or 0)
                    check_estimate(len(text) + (text.count("\n") + 1) * per_line, what)
                elif name == "wordwrap":
                    width = int(a.get("width", 79) or 1)
                    wrap = a.get("wrapstring") or "\n"
                    check_estimate(len(text) + (len(text) // max(width, 1) + 1) * len(wrap), what)
                elif name == "tojson":
                    indent = a.get("indent")
                    if isinstance(indent, str) or (isinstance(indent, int) and indent > 64):
                        raise TemplateLimit(f"{what} indent must be an integer <= 64")
                elif name == "format":
                    _check_format(text, limit)
            check_numbers(rest, what)
            return check_size(f(*args, **kwargs), what)

        return wrapper

    class BoundedSandbox(ImmutableSandboxedEnvironment):
        code_generator_class = BoundedCodeGenerator
        intercepted_binops = frozenset({"*", "**", "%", "+"})

        def __init__(self) -> None:
            super().__init__(
                trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
            )
            self.depth = 0
            self.globals.pop("lipsum", None)
            self.filters = {k: bounded_filter(k, f) for k, f in self.filters.items()}

        def bounded_concat(self, parts: tuple[Any, ...]) -> str:
            texts = [str(p) for p in parts]
            check_estimate(sum(len(t) for t in texts), "'~'")
            return "".join(texts)

        def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
            what = f"'{operator}'"
            if operator == "*":
                for seq, n in ((left, right), (right, left)):
                    size = _length(seq)
                    if size is not None and isinstance(n, int):
                        check_estimate(size * max(n, 0), what)
            elif operator == "+":
                a, b = _length(left), _length(right)
                if a is not None and b is not None:
                    check_estimate(a + b, what)
            elif operator == "**":
                ints = isinstance(left, int) and isinstance(right, int) and abs(left) > 1
                if ints and right > 0 and abs(left).bit_length() * right > MAX_POW_BITS:
                    raise TemplateLimit(f"{left} ** {right} is too large an integer")
            elif operator == "%" and isinstance(left, str):
                _check_format(left, limit)
            return check_size(super().call_binop(context, operator, left, right), what)

        def getattr(self, obj: Any, attribute: str) -> Any:
            if isinstance(obj, str) and attribute in _ALL_STR_METHODS:
                return str_method(obj, attribute, super().getattr(obj, attribute))
            return super().getattr(obj, attribute)

        def getitem(self, obj: Any, argument: Any) -> Any:
            if isinstance(obj, str) and isinstance(argument, str) and argument in _ALL_STR_METHODS:
                return str_method(obj, argument, super().getattr(obj, argument))
            return super().getitem(obj, argument)

        def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N805
            if __self.depth >= MAX_CALL_DEPTH:
                raise TemplateLimit(f"calls are nested deeper than {MAX_CALL_DEPTH}")
            check_numbers(
                [*args, *kwargs.values()], f"the call of {getattr(__obj, '__name__', 'a function')}"
            )
            __self.depth += 1
            try:
                result = super().call(__context, __obj, *args, **kwargs)
            finally:
                __self.depth -= 1
            return check_size(result, "a call's result")

    return BoundedSandbox()


def render_template(
    template: object,
    variables: dict[str, Any],
    raise_exception: Callable[[str], None],
    input_chars: int = 0,
) -> str:
    """Render the chat template ``template`` with ``variables`` (``raise_exception`` added as a
    global) inside the bounds of this module. ``input_chars``: characters of the messages, which
    widen the size bound (4 x). Raises LmlabError for a template that is not a string, is too
    long, fails, or reaches a bound; the template's own ``raise_exception`` error passes through.
    """
    from jinja2 import TemplateError

    if not isinstance(template, str):
        raise LmlabError(
            f"the chat template must be a string (Jinja source), not {type(template).__name__}"
        )
    if len(template) > MAX_TEMPLATE_CHARS:
        raise LmlabError(
            f"the chat template is {len(template):,} characters, more than the "
            f"{MAX_TEMPLATE_CHARS:,} lmlab renders"
        )
    limit = max(MAX_OUTPUT_CHARS, 4 * input_chars)
    pieces: list[str] = []
    total = 0
    try:
        with _deadline(MAX_SECONDS):
            env = _make_environment(limit)
            env.globals["raise_exception"] = raise_exception
            for piece in env.from_string(template).generate(**variables):
                total += len(piece)
                if total > limit:
                    raise TemplateLimit(f"its output exceeds {limit:,} characters")
                pieces.append(piece)
    except LmlabError:
        raise
    except _Timeout:
        raise LmlabError(
            f"the chat template took longer than {MAX_SECONDS:g} s to render; lmlab stopped it"
        ) from None
    except TemplateLimit as e:
        raise LmlabError(f"the chat template was stopped: {e}") from None
    except TemplateError as e:
        raise LmlabError(f"the chat template failed: {e}") from None
    except RecursionError:
        raise LmlabError("the chat template failed: it nests too deeply") from None
    except MemoryError:
        raise LmlabError("the chat template failed: it ran out of memory") from None
    except Exception as e:  # a Python error inside the template: ValueError, TypeError ...
        raise LmlabError(f"the chat template failed: {type(e).__name__}: {e}") from None
    return "".join(pieces)
