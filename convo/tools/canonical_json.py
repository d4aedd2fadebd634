"""JSON read one character at a time and rewritten in its canonical compact form.

A tool call's arguments reach the client as a JSON string. convo passes on the *canonical*
string of the value the model wrote: exactly what
``json.dumps(value, ensure_ascii=False, separators=(",", ":"))`` gives for the parsed
value, so the streamed fragments and the final string agree character for character::

    model:      { "city" : "Z\\u00fcrich", "days": 3.0e0 }
    canonical:  {"city":"Zürich","days":3.0}

:class:`JsonScanner` produces that text incrementally, so the arguments can be streamed
while the model writes them. It holds back only what it cannot yet rewrite: a number or a
literal until its last character, an object key until its closing quote (to refuse
duplicates), the second half of a surrogate pair.

Strictness (each is an error, :attr:`JsonScanner.error` says which): anything
``json.loads`` refuses; ``NaN``/``Infinity`` and numbers out of float range (they have no
JSON form); duplicate keys in one object (``json.loads`` would keep the last and reorder);
lone surrogates (the text could not be encoded as UTF-8).
"""

from __future__ import annotations

import math
import re

__all__ = ["JsonScanner", "canonical_char"]

_WS = " \t\n\r"
_NUMBER = re.compile(r"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?")
_NUMBER_CHARS = frozenset("0123456789+-.eE")
_LITERALS = ("true", "false", "null")
_SIMPLE_ESCAPES = {'"': '"', "\\": "\\", "/": "/", "b": "\b", "f": "\f", "n": "\n", "r": "\r", "t": "\t"}
_ENCODE = {'"': '\\"', "\\": "\\\\", "\n": "\\n", "\r": "\\r", "\t": "\\t", "\b": "\\b", "\f": "\\f"}
_HEX = frozenset("0123456789abcdefABCDEF")

# scanner states
_VALUE = 0  # a value must start here
_AFTER_VALUE = 1  # inside a container, after a value: ',' or the closing bracket
_FIRST_KEY = 2  # just after '{': a key or '}'
_KEY = 3  # after ',' in an object: a key
_COLON = 4
_STRING = 5
_ESCAPE = 6
_UNICODE = 7  # reading the 4 hex digits of \\u
_LOW_BACKSLASH = 8  # after a high surrogate: '\\' of its low half
_LOW_U = 9  # after a high surrogate and '\\': 'u'
_NUMBER_TOKEN = 10
_LITERAL = 11
_FIRST_VALUE = 12  # just after '[': a value or ']'


def canonical_char(c: str) -> str:
    """How ``json.dumps(..., ensure_ascii=False)`` writes the character ``c`` in a string."""
    escaped = _ENCODE.get(c)
    if escaped is not None:
        return escaped
    if c < " ":
        return f"\\u{ord(c):04x}"
    return c


class JsonScanner:
    """Reads one JSON value a character at a time and writes its canonical text.

    Feed characters with :meth:`feed`; collect the canonical text produced so far with
    :meth:`take`. The value is complete when :attr:`done` is true; a number or literal at
    the top level completes on the first character after it, which :meth:`feed` then
    refuses (returns ``False``) so that the caller can read it.

    Example:
        >>> s = JsonScanner()
        >>> [s.feed(c) for c in '{ "a" : [1 , 2.50] } '][-2:]
        [True, False]
        >>> s.done, s.take()
        (True, '{"a":[1,2.5]}')
    """

    def __init__(self) -> None:
        self.done = False
        self.error: str | None = None
        #: the first character of the value (``{``, ``[``, ``"``, a digit...), once seen
        self.first: str | None = None
        self._state = _VALUE
        self._stack: list[tuple[str, set[str]]] = []  # open containers: ("{" or "[", keys seen)
        self._out: list[str] = []
        self._token = ""  # a number, a literal or the hex digits of \\u being read
        self._key: list[str] | None = None  # the canonical key being read
        self._high: int | None = None  # a high surrogate waiting for its low half

    def take(self) -> str:
        """The canonical text produced since the last call."""
        text = "".join(self._out)
        self._out.clear()
        return text

    def feed(self, ch: str) -> bool:
        """Read one character. Returns ``False`` when the character is not part of the
        value (the value was already complete, or it completes a top-level number), and
        ``True`` otherwise. After an error every character is refused."""
        if self.done or self.error is not None:
            return False
        state = self._state
        if state == _STRING:
            if ch == '"':
                self._end_string()
            elif ch == "\\":
                self._state = _ESCAPE
            elif ch < " ":
                self._fail(f"control character U+{ord(ch):04X} inside a string (it must be escaped)")
            elif "\ud800" <= ch <= "\udfff":
                self._fail(f"lone surrogate U+{ord(ch):04X} inside a string")
            else:
                self._emit(ch)
            return True
        if state in (_VALUE, _FIRST_VALUE):
            if ch in _WS:
                return True
            if state == _FIRST_VALUE and ch == "]":
                return self._close("[")
            return self._start_value(ch)
        if state == _AFTER_VALUE:
            if ch in _WS:
                return True
            kind = self._stack[-1][0]
            if ch == ",":
                self._emit(",")
                self._state = _KEY if kind == "{" else _VALUE
                return True
            if ch == ("}" if kind == "{" else "]"):
                return self._close(kind)
            return self._fail(f"expected ',' or {'}' if kind == '{' else ']'!r}, got {ch!r}")
        if state in (_FIRST_KEY, _KEY):
            if ch in _WS:
                return True
            if state == _FIRST_KEY and ch == "}":
                return self._close("{")
            if ch != '"':
                return self._fail(f"expected a key in double quotes, got {ch!r}")
            self._key = []
            self._state = _STRING
            return True
        if state == _COLON:
            if ch in _WS:
                return True
            if ch != ":":
                return self._fail(f"expected ':' after a key, got {ch!r}")
            self._emit(":")
            self._state = _VALUE
            return True
        if state == _ESCAPE:
            if ch == "u":
                self._token = ""
                self._state = _UNICODE
                return True
            decoded = _SIMPLE_ESCAPES.get(ch)
            if decoded is None:
                return self._fail(f"invalid escape '\\{ch}' in a string")
            self._emit(canonical_char(decoded))
            self._state = _STRING
            return True
        if state == _UNICODE:
            if ch not in _HEX:
                return self._fail(f"invalid \\u escape: {ch!r} is not a hex digit")
            self._token += ch
            if len(self._token) == 4:
                self._code_point(int(self._token, 16))
            return True
        if state == _LOW_BACKSLASH:
            if ch != "\\":
                return self._fail(f"lone surrogate \\u{self._high:04x} (no low surrogate follows)")
            self._state = _LOW_U
            return True
        if state == _LOW_U:
            if ch != "u":
                return self._fail(f"lone surrogate \\u{self._high:04x} (no low surrogate follows)")
            self._token = ""
            self._state = _UNICODE
            return True
        if state == _NUMBER_TOKEN:
            if ch in _NUMBER_CHARS:
                self._token += ch
                return True
            if not self._end_number():
                return False
            return self._after_token(ch)
        # _LITERAL
        token = self._token + ch
        if not any(lit.startswith(token) for lit in _LITERALS):
            return self._fail(f"invalid literal {token!r}")
        self._token = token
        if token in _LITERALS:
            self._emit(token)
            self._value_done()
        return True

    def finish(self) -> None:
        """End of input: a pending top-level number completes; anything else unfinished
        is an error."""
        if self.done or self.error is not None:
            return
        if self._state == _NUMBER_TOKEN and not self._stack:
            self._end_number()
            return
        self._fail("the JSON value is incomplete")

    # -- internals ---------------------------------------------------------------------

    def _fail(self, reason: str) -> bool:
        self.error = reason
        return False

    def _emit(self, text: str) -> None:
        if self._key is not None:
            self._key.append(text)
        else:
            self._out.append(text)

    def _start_value(self, ch: str) -> bool:
        if self.first is None:
            self.first = ch
        if ch == "{":
            self._emit("{")
            self._stack.append(("{", set()))
            self._state = _FIRST_KEY
        elif ch == "[":
            self._emit("[")
            self._stack.append(("[", set()))
            self._state = _FIRST_VALUE
        elif ch == '"':
            self._emit('"')
            self._state = _STRING
        elif ch == "-" or (ch.isdigit() and ch.isascii()):
            self._token = ch
            self._state = _NUMBER_TOKEN
        elif ch in "tfn":
            self._token = ch
            self._state = _LITERAL
        else:
            return self._fail(f"expected a JSON value, got {ch!r}")
        return True

    def _close(self, kind: str) -> bool:
        self._stack.pop()
        self._emit("}" if kind == "{" else "]")
        self._value_done()
        return True

    def _value_done(self) -> None:
        if self._stack:
            self._state = _AFTER_VALUE
        else:
            self.done = True

    def _end_string(self) -> None:
        if self._key is None:
            self._emit('"')
            self._value_done()
            return
        key = "".join(self._key)
        self._key = None
        seen = self._stack[-1][1]
        if key in seen:
            self._fail(f'duplicate key "{key}" in one object')
            return
        seen.add(key)
        self._emit(f'"{key}"')
        self._state = _COLON

    def _code_point(self, cp: int) -> None:
        high, self._high = self._high, None
        if high is not None:
            if not 0xDC00 <= cp <= 0xDFFF:
                self._fail(f"lone surrogate \\u{high:04x} (no low surrogate follows)")
                return
            cp = 0x10000 + ((high - 0xD800) << 10) + (cp - 0xDC00)
        elif 0xD800 <= cp <= 0xDBFF:
            self._high = cp
            self._state = _LOW_BACKSLASH
            return
        elif 0xDC00 <= cp <= 0xDFFF:
            self._fail(f"lone surrogate \\u{cp:04x}")
            return
        self._emit(canonical_char(chr(cp)))
        self._state = _STRING

    def _end_number(self) -> bool:
        token = self._token
        if not _NUMBER.fullmatch(token):
            return self._fail(f"invalid number {token!r}")
        try:
            if any(c in token for c in ".eE"):
                value = float(token)
                if not math.isfinite(value):
                    return self._fail(f"number {token!r} is out of range")
                text = float.__repr__(value)
            else:
                text = str(int(token))
        except ValueError:  # an integer longer than Python converts
            return self._fail(f"number {token[:20]!r}... is too long")
        self._emit(text)
        self._value_done()
        return True

    def _after_token(self, ch: str) -> bool:
        """Read the character that ended a number."""
        if self.done:
            return False
        return self.feed(ch)
