"""What omnirl's HTTP servers and clients share: bodies that are not JSON (`Payload`, `RawReply`),
the refusal a route raises (`HttpError`), error replies read on the client side, secrets and URLs
kept out of messages, HTML forms, and the msgpack variant of a JSON reply, stdlib only, no pickle.

A request whose ``Accept`` names ``application/x-msgpack`` (`MSGPACK`) gets its reply as msgpack, every
``{"encoding": "base64", "data": str}`` object in it carried as ``{"encoding": "raw", "data": bytes}``
(`pack_binary`): a third smaller and no base64 work for large tensors and video.

Clients parse both omnirl's error shape ``{"error": {"code": STATUS, "message": ...}}`` (also OpenAI's)
and FastAPI's ``{"detail": ...}`` (a string, or pydantic's list of ``{"loc", "msg"}``): `error_message`.
"""

from __future__ import annotations

import json
import os
import re
import urllib.parse
from collections.abc import Mapping
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import Any

from stages.errors import UserInputError

MSGPACK = "application/x-msgpack"
MAX_FORM_BYTES = 64 * 1024  # an HTML form's body (text fields only)
MAX_FORM_FIELDS = 64


@dataclass(frozen=True)
class RawReply:
    """A reply that is a file (an MP4), sent as it is with its content type and extra headers."""

    data: bytes
    content_type: str
    headers: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Payload:
    """A request body that is not JSON (a pushed file, an encoded form) and its content type."""

    data: bytes
    content_type: str = "application/octet-stream"


class HttpError(Exception):
    """A refused request: its status and a one-line message for the client."""

    def __init__(self, status: HTTPStatus, message: str):
        super().__init__(" ".join(message.split()))  # one line, whatever a request's fields held
        self.status = status


def env_token(var: str | None, where: str) -> str | None:
    """The secret in environment variable `var` (None without one): a bearer token or API key, never
    written on a command line. An unset or empty `var` is a one-line usage error starting with `where`
    (the option or reward argument that named it)."""
    if not var:
        return None
    token = os.environ.get(var)
    if not token:
        raise UserInputError(f"{where}: ${var} is not set; export it")
    return token


def redact_url(url: str) -> str:
    """`url` with the secret of its userinfo hidden, for messages and records:
    ``http://user:***@host/`` (``***@host`` when it has no user part)."""

    def hide(match: re.Match[str]) -> str:
        user, colon, _ = match[2].partition(":")
        return f"{match[1]}{user}:***@" if colon else f"{match[1]}***@"

    return re.sub(r"^([A-Za-z][A-Za-z0-9+.-]*://)([^/?#]*)@", hide, url)


def http_url(url: str) -> urllib.parse.SplitResult | None:
    """`url` split when it is an http(s) URL with a host and no query or fragment, else None (callers
    name what they expected in their own one-line error)."""
    try:
        parts = urllib.parse.urlsplit(url)
    except ValueError:  # a bracketed host that is not closed
        return None
    if parts.scheme not in ("http", "https") or not parts.hostname or parts.query or parts.fragment:
        return None
    return parts


def one_line(text: Any, limit: int = 300) -> str:
    """`text` on one line, at most `limit` characters."""
    return " ".join(str(text).split())[:limit]


def error_message(raw: bytes) -> str:
    """The message of an error reply: omnirl's / OpenAI's ``{"error": {"message"}}``, FastAPI's
    ``{"detail"}``, else the text."""
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError):
        return one_line(raw.decode("utf-8", "replace"))
    inner = body.get("error") if isinstance(body, dict) else None
    for source in (inner, body):
        if isinstance(source, dict):
            for key in ("message", "detail"):
                if isinstance(source.get(key), list):  # pydantic's validation errors (FastAPI 422)
                    return one_line("; ".join(_validation_error(e) for e in source[key]))
                if source.get(key):
                    return one_line(source[key])
        if isinstance(source, str) and source:
            return one_line(source)
    return one_line(str(body))


def _validation_error(error: Any) -> str:
    """``body.n: Input should be less than or equal to 10`` of one pydantic error object."""
    if not isinstance(error, dict):
        return str(error)
    loc = ".".join(str(part) for part in error.get("loc") or [])
    return f"{loc}: {error.get('msg', '')}" if loc else str(error.get("msg", error))


def _binary(obj: Any) -> Any:
    if isinstance(obj, dict):
        if obj.get("encoding") == "base64" and isinstance(obj.get("data"), str):
            import base64

            return {**obj, "encoding": "raw", "data": base64.b64decode(obj["data"])}
        return {k: _binary(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_binary(v) for v in obj]
    return obj


def pack_binary(payload: Any) -> bytes:
    """`payload` as msgpack, its base64 objects as raw bytes (module docstring)."""
    import msgpack

    return msgpack.packb(_binary(payload), use_bin_type=True)


def unpack_binary(raw: bytes) -> Any:
    """A `pack_binary` body (raw objects stay raw: the decoders take both); `ValueError` when it is not
    msgpack. Maps, arrays, strings, bytes and numbers only: msgpack extension types are refused."""
    import msgpack

    try:
        return msgpack.unpackb(raw, raw=False, strict_map_key=True)
    except (msgpack.UnpackException, ValueError, TypeError) as exc:
        raise ValueError(f"not a msgpack body ({type(exc).__name__})") from None


def wants_binary(accept: str | None) -> bool:
    """Whether an ``Accept`` header names msgpack."""
    return MSGPACK in (accept or "").lower()


def parse_form(raw: bytes, content_type: str) -> dict[str, str]:
    """The text fields of an HTML form body: ``multipart/form-data`` (file parts are refused) or
    ``application/x-www-form-urlencoded``; a repeated field keeps its last value. 400 for anything else;
    413 past `MAX_FORM_BYTES` or `MAX_FORM_FIELDS` fields, checked before parsing (the MIME parser's time
    grows faster than its input on crafted bodies)."""
    import email.parser
    import email.policy

    if len(raw) > MAX_FORM_BYTES:
        raise HttpError(
            HTTPStatus.REQUEST_ENTITY_TOO_LARGE,
            f"the form is {len(raw)} bytes, more than {MAX_FORM_BYTES}: a form carries short text fields",
        )
    kind = content_type.split(";", 1)[0].strip().lower()
    boundary = re.search(r'boundary="?([^";]+)', content_type)
    separator = (
        b"&"
        if kind == "application/x-www-form-urlencoded"
        else b"--" + (boundary[1] if boundary else "").encode("latin-1", "replace")
    )
    if raw.count(separator) > MAX_FORM_FIELDS + 1:
        raise HttpError(HTTPStatus.REQUEST_ENTITY_TOO_LARGE, f"more than {MAX_FORM_FIELDS} form fields")
    if kind == "application/x-www-form-urlencoded":
        try:
            pairs = urllib.parse.parse_qsl(raw.decode("utf-8"), keep_blank_values=True, strict_parsing=True)
        except (UnicodeDecodeError, ValueError):
            raise HttpError(HTTPStatus.BAD_REQUEST, "the body is not a urlencoded form") from None
        return dict(pairs)
    if kind != "multipart/form-data":
        raise HttpError(
            HTTPStatus.BAD_REQUEST,
            f"Content-Type {kind or '(none)'}: send the fields as multipart/form-data (curl -F NAME=VALUE)",
        )
    head = f"Content-Type: {content_type}\r\nMIME-Version: 1.0\r\n\r\n".encode("latin-1", "replace")
    message = email.parser.BytesParser(policy=email.policy.HTTP).parsebytes(head + raw)
    if not message.is_multipart() or message.defects:
        raise HttpError(HTTPStatus.BAD_REQUEST, "the body is not a well-formed multipart/form-data form")
    fields: dict[str, str] = {}
    for part in message.iter_parts():
        name = part.get_param("name", header="content-disposition")
        if not name:
            raise HttpError(HTTPStatus.BAD_REQUEST, "a form part has no name")
        if part.get_filename() is not None:
            raise HttpError(HTTPStatus.BAD_REQUEST, f"form field {str(name)!r}: files are not taken here")
        payload = part.get_payload(decode=True) or b""
        try:
            fields[str(name)] = payload.decode(part.get_content_charset() or "utf-8")
        except (UnicodeDecodeError, LookupError):
            raise HttpError(HTTPStatus.BAD_REQUEST, f"form field {str(name)!r} is not UTF-8 text") from None
    return fields


def encode_form(fields: Mapping[str, Any]) -> Payload:
    """`fields` (each value as its `str`) as a ``multipart/form-data`` body, what ``curl -F`` sends."""
    import secrets

    boundary = f"omnirl-{secrets.token_hex(12)}"
    parts = []
    for name, value in fields.items():
        parts.append(
            f'--{boundary}\r\nContent-Disposition: form-data; name="{name}"\r\n\r\n'.encode()
            + str(value).encode("utf-8")
            + b"\r\n"
        )
    body = b"".join(parts) + f"--{boundary}--\r\n".encode()
    return Payload(body, f"multipart/form-data; boundary={boundary}")


def parse_json_object(raw: bytes) -> dict[str, Any]:
    """A request body that must be a JSON object (400 otherwise, also for one nested deeper than the
    parser's recursion limit, about 1000 levels)."""
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        raise HttpError(HTTPStatus.BAD_REQUEST, "the body is not JSON") from None
    except RecursionError:
        raise HttpError(HTTPStatus.BAD_REQUEST, "JSON nested too deep: send a flatter body") from None
    if not isinstance(body, dict):
        raise HttpError(HTTPStatus.BAD_REQUEST, "the body is not a JSON object")
    return body
