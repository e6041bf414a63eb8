"""JSON over HTTP for omnirl's servers (`omnirl serve-reward`, `omnirl serve`) and their clients, stdlib
only, no pickle (docs/serving.md):

- `stages.web.server`: `JsonServer` does the HTTP for a `JsonService`, which decides what a request
  means, within `ServerLimits` (connections, threads, deadlines, body limits, tokens);
- `stages.web.handler`: `JsonService` and `JsonHandler`, one connection's requests and replies;
- `stages.web.client`: `JsonClient`, health polling and retries with backoff;
- `stages.web.wire`: what both sides share (`HttpError`, `Payload`, `RawReply`, error replies, forms,
  the msgpack variant of a reply, secrets and URLs kept out of messages).

The names callers use are importable from `stages.web` itself.
"""

from stages.web.client import JsonClient, Retryable, backoff
from stages.web.handler import DRAIN_FACTOR, ClientGone, JsonService, client_gone
from stages.web.server import JsonServer, ServerLimits, is_loopback
from stages.web.wire import (
    MSGPACK,
    HttpError,
    Payload,
    RawReply,
    encode_form,
    env_token,
    error_message,
    http_url,
    one_line,
    pack_binary,
    parse_form,
    parse_json_object,
    redact_url,
    unpack_binary,
)

__all__ = [
    "DRAIN_FACTOR",
    "MSGPACK",
    "ClientGone",
    "HttpError",
    "JsonClient",
    "JsonServer",
    "JsonService",
    "Payload",
    "RawReply",
    "Retryable",
    "ServerLimits",
    "backoff",
    "client_gone",
    "encode_form",
    "env_token",
    "error_message",
    "http_url",
    "is_loopback",
    "one_line",
    "pack_binary",
    "parse_form",
    "parse_json_object",
    "redact_url",
    "unpack_binary",
]
