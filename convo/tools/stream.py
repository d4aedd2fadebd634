"""Tool calls read out of a reply while it is decoded.

:class:`ToolCallStream` is fed the reply text piece by piece (``feed``), as the engine
decodes it, and answers with the deltas to send: :class:`~convo.tools.reply.ContentDelta`
for text, :class:`~convo.tools.reply.ToolCallDelta` for calls. ``close()`` at the end of
the reply returns what was held back, and ``finish()`` the
:class:`~convo.tools.reply.ParsedReply` — the same one the family's non-streaming
``parse`` returns for the whole text, whatever the pieces were.

What is held back, and until when::

    text: "Let me check.  <tool_c"  ->  sends "Let me check."  holds "  <tool_c"
                                        (could be the start of the marker; whitespace
                                         touching a call is not part of the content)
    call: {"name": "get_weather", "arguments": {"city": "Pa
          -> sends ToolCallDelta(0, "call_...", "get_weather", "") once the name is
             complete and the arguments have started, then '{"city":"Pa' as a fragment
             (canonical JSON; a number or a key only when complete)

Grammar of a reply, per family (:class:`CallSyntax`; ``ws`` is whitespace)::

    hermes       text (<tool_call> ws CALL ws </tool_call> text)*
    mistral      text ([TOOL_CALLS] ws ([ ws CALL (ws , ws CALL)* ws ] | CALL) text)*
    llama3_json  ws [<|python_tag|>] ws CALL (ws ; ws CALL)* ws     (the whole reply)
                 or any text that does not open that way
    CALL         {"name": "...", "arguments": {...}} in any key order, other keys ignored
                 (llama3_json: "parameters" or "arguments", and one of them is required;
                  the others default a missing "arguments" to {})

A call whose closing ``</tool_call>`` or ``]`` is cut off by the end of the reply is still
read when its object is complete. A Llama reply that opens with ``{`` without the marker
is a call only once its object shows a string ``"name"`` and object ``"parameters"`` (other
keys, such as the ``"type": "function"`` small Llamas add, are ignored); JSON of another
shape is plain text (a model asked for JSON output), and so is JSON that does not parse.

Invalid replies (the policy): when the text after a marker is not a well-formed call
(JSON that ``json.loads`` refuses, a name that is not a string or not an offered tool,
arguments that are not an object, duplicate keys, the reply ending inside a call, text
where only ``;`` or a closing marker may come), *no* call of the reply is passed on: the
result is the whole reply as plain text, ``finish_reason`` ``"stop"``, and
``ParsedReply.invalid`` says why. A stream cannot take back deltas it sent: by default
(``hold_calls=False``) the calls stream live, and when the reply turns invalid the text not
yet sent follows as content, and :attr:`ToolCallStream.sent_tool_calls` tells the server
that tool-call deltas already went out (it should then end the stream with an error). With
``hold_calls=True`` everything from the first marker on is held until ``close()``, so the
deltas always agree with the result (the calls then arrive at the end, not live).
"""

from __future__ import annotations

import json
import logging
import random
from collections.abc import Collection
from dataclasses import dataclass

from convo.messages import ToolCall
from convo.tools.canonical_json import JsonScanner
from convo.tools.reply import ContentDelta, ParsedReply, StreamDelta, ToolCallDelta, new_call_id

__all__ = ["CallSyntax", "ToolCallStream"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class CallSyntax:
    """How one model family writes its tool calls (see the grammar in the module docstring).

    Args:
        marker: the text that opens the tool calls (``"<tool_call>"``).
        end_marker: the text that closes each call (Hermes' ``"</tool_call>"``), or ``None``.
        array: the calls after the marker are a JSON list (Mistral); a lone object is
            also read.
        separator: the character between calls that follow one marker (Llama's ``";"``).
        whole_reply: the calls are the whole reply, opened by the marker or by a bare
            ``{"name"`` (Llama); no text comes before or after them.
        argument_keys: the keys that may hold the arguments, only one per call.
        arguments_required: a call without arguments is invalid (else they are ``{}``).
    """

    marker: str
    end_marker: str | None = None
    array: bool = False
    separator: str | None = None
    whole_reply: bool = False
    argument_keys: tuple[str, ...] = ("arguments",)
    arguments_required: bool = False


# stream modes
_TEXT, _START, _SECTION, _PLAIN = range(4)
# section states
_OPEN, _ARRAY_FIRST, _CALL, _AFTER_CALL, _ARRAY_NEXT, _CLOSE = range(6)
# call-object states
_C_OPEN, _C_FIRST_KEY, _C_KEY, _C_IN_KEY, _C_COLON, _C_VALUE, _C_AFTER, _C_DONE = range(8)
_JSON_WS = " \t\n\r"


class _CallReader:
    """Reads one call object, ``{"name": ..., "arguments": {...}}``, a character at a time."""

    def __init__(self, syntax: CallSyntax) -> None:
        self._syntax = syntax
        self._state = _C_OPEN
        self._keys: set[str] = set()
        self._key = ""
        self._scanner = JsonScanner()
        self.first_key: str | None = None
        self.name: str | None = None
        self.arguments_key: str | None = None
        self.done = False
        self.error: str | None = None
        self._arguments: list[str] = []

    def take_arguments(self) -> str:
        """The canonical arguments text read since the last call."""
        text = "".join(self._arguments)
        self._arguments.clear()
        return text

    def feed(self, ch: str) -> None:
        while True:
            state = self._state
            if state == _C_OPEN:
                if ch != "{":
                    self.error = f"expected '{{' to open the call, got {ch!r}"
                else:
                    self._state = _C_FIRST_KEY
                return
            if state in (_C_FIRST_KEY, _C_KEY, _C_COLON, _C_AFTER):
                if ch in _JSON_WS:
                    return
                if state == _C_COLON:
                    if ch == ":":
                        self._state = _C_VALUE
                        self._scanner = JsonScanner()
                    else:
                        self.error = f"expected ':' after a key, got {ch!r}"
                    return
                if state == _C_AFTER:
                    if ch == ",":
                        self._state = _C_KEY
                    elif ch == "}":
                        self._end()
                    else:
                        self.error = f"expected ',' or '}}' in the call, got {ch!r}"
                    return
                if state == _C_FIRST_KEY and ch == "}":
                    self._end()
                    return
                if ch != '"':
                    self.error = f"expected a key in double quotes, got {ch!r}"
                    return
                self._scanner = JsonScanner()
                self._scanner.feed(ch)
                self._state = _C_IN_KEY
                return
            if state == _C_IN_KEY:
                self._scanner.feed(ch)
                if self._scanner.error:
                    self.error = self._scanner.error
                elif self._scanner.done:
                    self._key_done(json.loads(self._scanner.take()))
                return
            if state == _C_VALUE:
                consumed = self._scanner.feed(ch)
                if self._scanner.error:
                    self.error = self._scanner.error
                    return
                if self._key in self._syntax.argument_keys:
                    if self._scanner.first not in (None, "{"):
                        self.error = f"the call's {self._key!r} must be a JSON object"
                        return
                    self._arguments.append(self._scanner.take())
                if self._scanner.done:
                    self._value_done()
                    self._state = _C_AFTER
                    if not consumed and self.error is None:
                        continue
                return
            self.error = "text after the end of the call object"  # _C_DONE
            return

    def _key_done(self, key: str) -> None:
        if key in self._keys:
            self.error = f"duplicate key {key!r} in the call"
            return
        self._keys.add(key)
        if self.first_key is None:
            self.first_key = key
        if key in self._syntax.argument_keys:
            if self.arguments_key is not None:
                self.error = f"the call has both {self.arguments_key!r} and {key!r}"
                return
            self.arguments_key = key
        self._key = key
        self._state = _C_COLON

    def _value_done(self) -> None:
        if self._key == "name":
            if self._scanner.first != '"':
                self.error = "the call's 'name' must be a string"
                return
            name = json.loads(self._scanner.take())
            if not name:
                self.error = "the call's 'name' is empty"
                return
            self.name = name

    def _end(self) -> None:
        if self.name is None:
            self.error = "the call has no 'name'"
        elif self.arguments_key is None and self._syntax.arguments_required:
            keys = " or ".join(repr(k) for k in self._syntax.argument_keys)
            self.error = f"the call has no {keys}"
        else:
            self.done = True
            self._state = _C_DONE


class ToolCallStream:
    """Reads tool calls out of a reply that arrives in pieces (see the module docstring).

    Args:
        syntax: the model family's call syntax.
        rng: the randomness of call ids (``None``: the system's secure source).
        allowed_names: if given, a call to any other function makes the reply invalid.
        hold_calls: hold every delta from the first marker on until :meth:`close`.

    Example:
        >>> from convo.tools.parsers import HermesParser
        >>> stream = HermesParser().stream(rng=random.Random(0))
        >>> [type(d).__name__ for d in stream.feed('Hi <tool_call>{"name": "now", "arguments": {}}')]
        ['ContentDelta', 'ToolCallDelta', 'ToolCallDelta']
        >>> stream.close(), stream.finish().finish_reason
        ([], 'tool_calls')
    """

    def __init__(
        self,
        syntax: CallSyntax,
        *,
        rng: random.Random | None = None,
        allowed_names: Collection[str] | None = None,
        hold_calls: bool = False,
    ) -> None:
        self._syntax = syntax
        self._rng = rng
        self._allowed = frozenset(allowed_names) if allowed_names is not None else None
        self._hold_calls = hold_calls
        self._pieces: list[str] = []  # the reply as fed
        self._pos = 0  # characters read so far
        self._pending_from = 0  # offset of the first character not yet passed on
        self._mode = _START if syntax.whole_reply else _TEXT
        # text segment
        self._buf: list[str] = []
        self._tail = ""
        self._after_block = False
        self._segment_has_text = False
        # tool-call section
        self._section = _OPEN
        self._in_array = False
        self._tentative = False
        self._close_matched = 0
        self._call: _CallReader | None = None
        self._header_sent = False
        self._fragment: list[str] = []
        # results
        self._content: list[str] = []
        self._calls: list[tuple[str, str, list[str]]] = []  # id, name, argument fragments
        self._out: list[StreamDelta] = []
        self._held: list[StreamDelta] = []
        self._holding = False
        self._plain: list[str] = []
        self._invalid: str | None = None
        self._sent_tool_calls = False
        self._closed = False

    @property
    def sent_tool_calls(self) -> bool:
        """Whether a tool-call delta has been returned to the caller."""
        return self._sent_tool_calls

    def feed(self, piece: str) -> list[StreamDelta]:
        """Read the next piece of the reply; returns the deltas it completes.

        Raises:
            RuntimeError: the stream was closed.
        """
        if self._closed:
            raise RuntimeError("feed() after close(): the reply has ended")
        self._pieces.append(piece)
        for ch in piece:
            self._pos += 1
            self._char(ch)
        self._flush_pending()
        return self._drain()

    def close(self) -> list[StreamDelta]:
        """End of the reply: returns the deltas that were held back."""
        if self._closed:
            return []
        self._closed = True
        mode = self._mode
        if mode == _START:
            self._to_plain(None)
        elif mode == _TEXT:
            text = "".join(self._buf)
            if text and (not self._after_block or self._segment_has_text or not text.isspace()):
                self._send_content(text, self._pos)
            self._buf, self._tail = [], ""
        elif mode == _SECTION:
            self._end_section()
        self._flush_pending()
        if self._holding and self._invalid is None:
            self._out[:0] = self._held
            self._sent_tool_calls = any(isinstance(d, ToolCallDelta) for d in self._held)
            self._held = []
        return self._drain()

    def finish(self) -> ParsedReply:
        """The parsed reply; call after :meth:`close`.

        Raises:
            RuntimeError: :meth:`close` was not called (held deltas would be lost).
        """
        if not self._closed:
            raise RuntimeError("call close() before finish(): it returns the deltas still held back")
        if self._invalid is not None or not self._calls:
            return ParsedReply(content="".join(self._pieces), invalid=self._invalid)
        calls = tuple(ToolCall(id=cid, name=name, arguments="".join(args)) for cid, name, args in self._calls)
        return ParsedReply(content="".join(self._content), tool_calls=calls, finish_reason="tool_calls")

    # -- text ---------------------------------------------------------------------------

    def _char(self, ch: str) -> None:
        mode = self._mode
        if mode == _PLAIN:
            self._plain.append(ch)
            self._pending_from = self._pos
        elif mode == _TEXT:
            self._text_char(ch)
        elif mode == _START:
            self._start_char(ch)
        else:
            self._section_char(ch)

    def _text_char(self, ch: str) -> None:
        marker = self._syntax.marker
        self._buf.append(ch)
        self._tail = (self._tail + ch)[-len(marker) :]
        if self._tail != marker:
            return
        text = "".join(self._buf)
        before = text[: -len(marker)].rstrip()
        if before:
            self._send_content(before, self._pos - len(text) + len(before))
        self._buf, self._tail = [], ""
        self._open_section(tentative=False)

    def _start_char(self, ch: str) -> None:
        """A reply that must open with the calls (Llama): decide from its first characters."""
        self._buf.append(ch)
        head = "".join(self._buf).lstrip()
        marker = self._syntax.marker
        if not head or (marker.startswith(head) and head != marker):
            return
        self._buf = []
        if head == marker:
            self._open_section(tentative=False)
        elif head == "{":
            self._open_section(tentative=True)
            self._section_char("{")
        else:
            self._to_plain(None)

    def _flush_pending(self) -> None:
        """Send the text of the current segment that cannot be part of a marker or of the
        whitespace before one."""
        if self._mode != _TEXT or not self._buf:
            return
        text = "".join(self._buf)
        marker = self._syntax.marker
        keep = next(
            (k for k in range(min(len(marker) - 1, len(text)), 0, -1) if text.endswith(marker[:k])), 0
        )
        cut = len(text) - keep
        while cut > 0 and text[cut - 1].isspace():
            cut -= 1
        if cut:
            start = self._pos - len(text)
            self._send_content(text[:cut], start + cut)
            self._segment_has_text = True
            self._buf = [text[cut:]]

    def _send_content(self, text: str, passed_to: int) -> None:
        self._content.append(text)
        self._emit(ContentDelta(text))
        if not self._holding:
            self._pending_from = passed_to

    # -- tool-call section --------------------------------------------------------------

    def _open_section(self, *, tentative: bool) -> None:
        self._mode = _SECTION
        self._section = _OPEN
        self._in_array = False
        self._tentative = tentative
        if self._hold_calls:
            self._holding = True

    def _section_char(self, ch: str) -> None:
        syntax = self._syntax
        state = self._section
        if state == _CALL:
            self._call_char(ch)
            return
        if state == _CLOSE:
            assert syntax.end_marker is not None
            if ch != syntax.end_marker[self._close_matched]:
                self._invalidate(f"expected {syntax.end_marker!r} after the call")
                return
            self._close_matched += 1
            if self._close_matched == len(syntax.end_marker):
                self._to_text()
            return
        if ch.isspace():
            return
        if state in (_OPEN, _ARRAY_FIRST, _ARRAY_NEXT):
            if ch == "{":
                self._start_call(ch)
            elif ch == "[" and state == _OPEN and syntax.array:
                self._in_array = True
                self._section = _ARRAY_FIRST
            else:
                self._invalidate(f"expected a call object after {syntax.marker!r}, got {ch!r}")
            return
        # _AFTER_CALL
        if syntax.end_marker is not None and ch == syntax.end_marker[0]:
            self._section = _CLOSE
            self._close_matched = 1
        elif self._in_array and ch == ",":
            self._section = _ARRAY_NEXT
        elif self._in_array and ch == "]":
            self._to_text()
        elif syntax.separator is not None and ch == syntax.separator:
            self._section = _OPEN
        else:
            self._invalidate(f"unexpected {ch!r} after a tool call")

    def _start_call(self, ch: str) -> None:
        self._call = _CallReader(self._syntax)
        self._header_sent = False
        self._section = _CALL
        self._call_char(ch)

    def _call_char(self, ch: str) -> None:
        call = self._call
        assert call is not None
        call.feed(ch)
        if self._tentative:
            if call.error is not None:
                self._to_plain(None)  # JSON, but not a call
                return
            if call.name is not None and (call.arguments_key or call.done):
                self._tentative = False  # a name and arguments: a call
        if call.error is not None:
            self._invalidate(f"tool call {len(self._calls) + (not self._header_sent)}: {call.error}")
            return
        self._fragment.append(call.take_arguments())
        if not self._header_sent and call.name is not None and (call.arguments_key or call.done):
            if self._allowed is not None and call.name not in self._allowed:
                self._invalidate(f"the model called {call.name!r}, which is not among the offered tools")
                return
            cid = new_call_id(self._rng)
            self._calls.append((cid, call.name, []))
            self._emit(ToolCallDelta(len(self._calls) - 1, cid, call.name, ""))
            self._header_sent = True
        if call.done:
            if call.arguments_key is None:
                self._fragment.append("{}")
            self._flush_fragment()
            self._call = None
            if self._syntax.array and not self._in_array:
                self._to_text()  # a lone object after the marker (Mistral)
            else:
                self._section = _AFTER_CALL

    def _flush_fragment(self) -> None:
        if not self._header_sent:
            return
        fragment = "".join(self._fragment)
        self._fragment = []
        if fragment:
            self._calls[-1][2].append(fragment)
            self._emit(ToolCallDelta(len(self._calls) - 1, None, None, fragment))

    def _to_text(self) -> None:
        self._mode = _TEXT
        self._after_block = True
        self._segment_has_text = False
        if not self._holding:
            self._pending_from = self._pos

    def _end_section(self) -> None:
        state = self._section
        if state in (_AFTER_CALL, _CLOSE):
            self._mode = _TEXT  # the closing marker was cut off: the complete call stands
            return
        if self._tentative:
            self._to_plain(None)
        elif state == _CALL:
            self._invalidate(f"the reply ended inside tool call {len(self._calls) + (not self._header_sent)}")
        else:
            self._invalidate(f"the reply ended after {self._syntax.marker!r} before a complete call")

    # -- output -------------------------------------------------------------------------

    def _invalidate(self, reason: str) -> None:
        logger.info("tool call not passed on, the reply is returned as text: %s", reason)
        self._to_plain(reason)

    def _to_plain(self, reason: str | None) -> None:
        """Everything not yet passed on, and all that follows, is text."""
        self._invalid = reason
        self._mode = _PLAIN
        self._buf, self._tail, self._fragment = [], "", []
        self._held = []
        self._holding = False
        self._plain.append("".join(self._pieces)[self._pending_from : self._pos])
        self._pending_from = self._pos

    def _emit(self, delta: StreamDelta) -> None:
        if self._holding:
            self._held.append(delta)
        else:
            if isinstance(delta, ToolCallDelta):
                self._sent_tool_calls = True
                self._pending_from = self._pos
            self._out.append(delta)

    def _drain(self) -> list[StreamDelta]:
        if self._mode == _SECTION and self._call is not None:
            self._flush_fragment()
        if self._plain:
            text = "".join(self._plain)
            self._plain = []
            if text:
                self._out.append(ContentDelta(text))
        out, self._out = self._out, []
        return out
