"""A conversation with tool calls, as the open models' chat templates want to read it.

Two things differ from the OpenAI shape that :meth:`convo.messages.Message.to_dict` gives:

- **Arguments as an object.** OpenAI carries ``arguments`` as a JSON *string*; the Hugging
  Face templates render ``tool_call.arguments | tojson``, which would quote that string a
  second time (Qwen2.5, Llama 3.1 and Mistral v0.3 all do). :func:`template_messages`
  hands them the parsed object, so the history reads exactly as the model wrote it::

      string: {"name": "f", "arguments": "{\\"city\\": \\"Paris\\"}"}   (what the model never wrote)
      object: {"name": "f", "arguments": {"city": "Paris"}}

  Arguments that are not a JSON object (a client's own history may hold anything) stay a
  string.
- **Call ids the template accepts.** Mistral's v0.3 template refuses ids that are not 9
  letters or digits; :func:`mistral_call_id` maps any id to one, the same every time, so
  a call and the result answering it keep matching and the rendered history is stable
  from turn to turn (the prefix cache keeps working).
"""

from __future__ import annotations

import hashlib
import json
import string
from collections.abc import Callable, Sequence
from typing import Any

from convo.messages import Message

__all__ = ["MISTRAL_CALL_ID_LENGTH", "mistral_call_id", "template_messages"]

#: Mistral's templates (v3 tokenizer) want call ids of exactly this many letters or digits.
MISTRAL_CALL_ID_LENGTH = 9
_ALNUM = string.ascii_letters + string.digits


def mistral_call_id(call_id: str) -> str:
    """A 9-letter-or-digit id derived from ``call_id`` (the same input gives the same id).

    An id that already has that shape is kept.

    Example:
        >>> mistral_call_id("a1b2c3d4e"), len(mistral_call_id("call_8fKd0sl2mQpXz0aB4cRtYu1v"))
        ('a1b2c3d4e', 9)
    """
    if len(call_id) == MISTRAL_CALL_ID_LENGTH and call_id.isascii() and call_id.isalnum():
        return call_id
    number = int.from_bytes(hashlib.sha256(call_id.encode("utf-8")).digest()[:8], "big")
    chars = []
    for _ in range(MISTRAL_CALL_ID_LENGTH):
        number, digit = divmod(number, len(_ALNUM))
        chars.append(_ALNUM[digit])
    return "".join(chars)


def template_messages(
    messages: Sequence[Message], *, call_id: Callable[[str], str] | None = None
) -> list[dict[str, Any]]:
    """The messages as dicts for ``apply_chat_template(conversation=...)``.

    Args:
        messages: the conversation.
        call_id: maps each call id (in ``tool_calls`` and in a tool result's
            ``tool_call_id``) to the one the template accepts, e.g. :func:`mistral_call_id`;
            ``None`` keeps them.

    Returns:
        :meth:`Message.to_dict` of each message, with tool-call arguments as objects.
    """
    out = []
    for message in messages:
        item = message.to_dict()
        if message.tool_calls:
            calls = []
            for call in message.tool_calls:
                rendered = call.to_dict()
                rendered["function"]["arguments"] = _arguments_object(call.arguments)
                if call_id is not None:
                    rendered["id"] = call_id(call.id)
                calls.append(rendered)
            item["tool_calls"] = calls
        if message.tool_call_id is not None and call_id is not None:
            item["tool_call_id"] = call_id(message.tool_call_id)
        out.append(item)
    return out


def _arguments_object(arguments: str) -> Any:
    try:
        value = json.loads(arguments)
    except ValueError:
        return arguments
    return value if isinstance(value, dict) else arguments
