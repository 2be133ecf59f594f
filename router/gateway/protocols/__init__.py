"""Protocol adapters: each endpoint's protocol knowledge behind one contract
(`router.gateway.protocols.base.ProtocolAdapter`), so the request path
(`router.gateway.proxy`) is one path for chat, completions, responses and messages (README,
"Where things live").

`ADAPTERS` maps each generation path the router serves to its adapter.
"""

from __future__ import annotations

from router.gateway.protocols.base import ProtocolAdapter
from router.gateway.protocols.messages import MessagesAdapter
from router.gateway.protocols.openai_chat import ChatAdapter, CompletionsAdapter
from router.gateway.protocols.responses import ResponsesAdapter

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
