"""Protocol adapters: each endpoint's protocol knowledge behind one contract
(`router.protocols.base.ProtocolAdapter`), so the request path (`router.proxy`) is one path for
chat, completions, responses and messages (DESIGN.md, "Where things live").

`ADAPTERS` maps each generation path the router serves to its adapter.
"""

from __future__ import annotations

from router.protocols.base import ProtocolAdapter
from router.protocols.messages import MessagesAdapter
from router.protocols.openai_chat import ChatAdapter, CompletionsAdapter
from router.protocols.responses import ResponsesAdapter

__all__ = [
    "ADAPTERS",
    "ChatAdapter",
    "CompletionsAdapter",
    "MessagesAdapter",
    "ProtocolAdapter",
    "ResponsesAdapter",
]

ADAPTERS: dict[str, ProtocolAdapter] = {
    a.path: a for a in (ChatAdapter(), CompletionsAdapter(), ResponsesAdapter(), MessagesAdapter())
}
