"""OpenAI's Responses API (``/v1/responses``) on convo's sessions.

A response is a turn of a conversation the server keeps: ``input`` (a string or items:
messages, ``function_call`` and ``function_call_output``) is reconciled into the session,
the prompt is planned inside the budget (pinned instructions, rolling summary, recent
window, retrieval), and the reply comes back as a ``response`` object whose id continues
the conversation (``previous_response_id``). ``store: false`` keeps nothing.

Layout: :mod:`~convo.server.responses.request` (the body and its input items),
:mod:`~convo.server.responses.objects` (the response object, its ids),
:mod:`~convo.server.responses.events` (the streamed events),
:mod:`~convo.server.responses.records` (what is kept, and the turn that keeps it),
:mod:`~convo.server.responses.routes` (the endpoints).
"""

from convo.server.responses.routes import router

__all__ = ["router"]
