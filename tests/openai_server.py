"""A local HTTP server speaking the slice of vLLM's OpenAI API the rollout engine uses, backed by a `VLMPolicy`.

`serve(policy, name)` answers GET /v1/models and POST /v1/chat/completions as `vllm serve` does
(OpenAI schema, vLLM's `return_tokens_as_token_ids`, the stop token returned with its log-prob, the
error JSON {"error": {message, type, param, code}}), sampling with `policy.generate` under a lock
(one model). Like vLLM, a sampling parameter the request leaves out takes the value of the served
model's generation_config.json (`generation_defaults`), so a client that omits top_k gets the model's
top_k. `serve_canned` answers every completion with a fixed status and body, for error tests.
`SGLangApp` answers as SGLang's OpenAI-compatible server does; run as a script, the module serves
either in its own process (`main`), stopped by its PID.
"""

from __future__ import annotations

import base64
import io
import json
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, ClassVar

from PIL import Image

from stages.models.vlm import VLMPolicy

# vLLM's own defaults (ChatCompletionRequest._DEFAULT_SAMPLING_PARAMS, top_k 0 = off), used when neither
# the request nor the model's generation config sets a parameter.
VLLM_DEFAULTS = {"repetition_penalty": 1.0, "temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0}
# The generation-config keys vLLM takes as defaults (ModelConfig.get_diff_sampling_param).
GENERATION_KEYS = (*VLLM_DEFAULTS, "max_new_tokens")


class BadRequest(Exception):
    """A request the server refuses: status, OpenAI error type and message."""

    def __init__(self, status: HTTPStatus, kind: str, message: str, param: str | None = None):
        super().__init__(message)
        self.status, self.kind, self.param = status, kind, param


class _Handler(BaseHTTPRequestHandler):
    """Routes to `self.server.app` (an object with `get(path)` / `post(path, body)` → (status, json bytes))."""

    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def _reply(self, status: int, payload: bytes) -> None:
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    def do_GET(self) -> None:
        self._reply(*self.server.app.get(self.path))  # type: ignore[attr-defined]

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        self._reply(*self.server.app.post(self.path, body))  # type: ignore[attr-defined]


def error_json(status: HTTPStatus, kind: str, message: str, param: str | None = None) -> tuple[int, bytes]:
    body = {"error": {"message": message, "type": kind, "param": param, "code": status.value}}
    return status.value, json.dumps(body).encode()


def _decode_data_url(url: Any) -> Image.Image:
    if not isinstance(url, str) or not url.startswith("data:") or ";base64," not in url:
        raise BadRequest(
            HTTPStatus.BAD_REQUEST, "BadRequestError", "only base64 data: image URLs are served here"
        )
    try:
        return Image.open(io.BytesIO(base64.b64decode(url.split(",", 1)[1]))).convert("RGB")
    except Exception:
        raise BadRequest(HTTPStatus.BAD_REQUEST, "BadRequestError", "an image URL does not decode") from None


def _chat(messages: Any) -> tuple[list[dict[str, Any]], list[Image.Image]]:
    """(messages with each image_url part as an image part, the decoded images in order), as vLLM
    reads a chat request: any roles and turns, content a string or a list of parts."""
    if not isinstance(messages, list) or not messages:
        raise BadRequest(
            HTTPStatus.BAD_REQUEST, "BadRequestError", "`messages` must be a non-empty list", "messages"
        )
    out, images = [], []
    for message in messages:
        if not isinstance(message, dict) or message.get("role") not in ("system", "user", "assistant"):
            raise BadRequest(
                HTTPStatus.BAD_REQUEST, "BadRequestError", f"bad message {message!r}", "messages"
            )
        content = message.get("content")
        if isinstance(content, list):
            parts = []
            for part in content:
                kind = part.get("type") if isinstance(part, dict) else None
                if kind == "text":
                    parts.append({"type": "text", "text": str(part.get("text", ""))})
                elif kind == "image_url":
                    images.append(_decode_data_url((part.get("image_url") or {}).get("url")))
                    parts.append({"type": "image"})
                else:
                    raise BadRequest(
                        HTTPStatus.BAD_REQUEST, "BadRequestError", f"unsupported content part {part!r}"
                    )
            content = parts
        elif not isinstance(content, str):
            raise BadRequest(
                HTTPStatus.BAD_REQUEST, "BadRequestError", f"bad content {content!r}", "messages"
            )
        out.append({"role": message["role"], "content": content})
    return out, images


def generation_defaults(model_dir: str) -> dict[str, Any]:
    """The sampling defaults `vllm serve` reads from a model folder: the generation_config.json values
    that differ from transformers' defaults, for the keys in `GENERATION_KEYS`."""
    from transformers import GenerationConfig

    try:
        config = GenerationConfig.from_pretrained(model_dir).to_diff_dict()
    except OSError:  # no generation_config.json
        return {}
    return {key: config[key] for key in GENERATION_KEYS if config.get(key) is not None}


@contextmanager
def _hf_sampling(model: Any, top_k: int, min_p: float, repetition_penalty: float) -> Iterator[None]:
    """Make `VLMPolicy.generate` (which pins top_k 0 and repetition_penalty 1) sample with these knobs:
    the model's `generate` gets them in place of its own (vLLM's top_k −1 or 0 is transformers' 0)."""
    generate = model.generate
    knobs = {"top_k": max(top_k, 0), "min_p": min_p or None, "repetition_penalty": repetition_penalty}
    model.generate = lambda **kwargs: generate(**{**kwargs, **knobs})
    try:
        yield
    finally:
        del model.generate


class PolicyApp:
    """The OpenAI endpoints over one policy: what vLLM's chat serving returns for these requests."""

    fallbacks: ClassVar[dict[str, float]] = (
        VLLM_DEFAULTS  # a parameter neither the request nor the model's generation config sets
    )
    owner = "vllm"

    def __init__(self, policy: VLMPolicy, model_name: str):
        self.policy = policy
        self.model_name = model_name
        self.lock = threading.Lock()
        self.tokenizer = policy.processor.tokenizer
        eos = policy.model.generation_config.eos_token_id
        self.stop_ids = set(eos if isinstance(eos, list) else [eos])
        self.defaults = generation_defaults(policy.model_path)

    def sampling(self, request: dict[str, Any]) -> dict[str, Any]:
        """The parameters vLLM samples with: the request's, else the model's generation config, else vLLM's."""
        out = {
            key: float(request[key]) if request.get(key) is not None else self.defaults.get(key, default)
            for key, default in self.fallbacks.items()
        }
        out["top_k"] = int(out["top_k"])
        max_tokens = request.get("max_completion_tokens") or request.get("max_tokens")
        out["max_tokens"] = int(max_tokens or self.defaults.get("max_new_tokens", 16))
        for key in ("presence_penalty", "frequency_penalty", "min_tokens"):
            if request.get(key):
                raise BadRequest(
                    HTTPStatus.BAD_REQUEST, "BadRequestError", f"this server takes no {key}", key
                )
        if request.get("use_beam_search") or request.get("ignore_eos"):
            raise BadRequest(HTTPStatus.BAD_REQUEST, "BadRequestError", "this server only samples")
        return out

    def get(self, path: str) -> tuple[int, bytes]:
        if path.rstrip("/") != "/v1/models":
            return error_json(HTTPStatus.NOT_FOUND, "NotFoundError", f"no route {path}")
        card = {"id": self.model_name, "object": "model", "created": int(time.time()), "owned_by": self.owner}
        return 200, json.dumps({"object": "list", "data": [card]}).encode()

    def post(self, path: str, raw: bytes) -> tuple[int, bytes]:
        if path.rstrip("/") != "/v1/chat/completions":
            return error_json(HTTPStatus.NOT_FOUND, "NotFoundError", f"no route {path}")
        try:
            return 200, json.dumps(self.complete(raw)).encode()
        except BadRequest as e:
            return error_json(e.status, e.kind, str(e), e.param)
        except Exception as e:
            return error_json(HTTPStatus.INTERNAL_SERVER_ERROR, "InternalServerError", repr(e))

    def complete(self, raw: bytes) -> dict[str, Any]:
        try:
            request = json.loads(raw)
        except ValueError:
            raise BadRequest(HTTPStatus.BAD_REQUEST, "BadRequestError", "the body is not JSON") from None
        if not isinstance(request, dict):
            raise BadRequest(HTTPStatus.BAD_REQUEST, "BadRequestError", "the body is not a JSON object")
        if request.get("model") != self.model_name:
            # vLLM answers an unknown model with 404 NotFoundError.
            raise BadRequest(
                HTTPStatus.NOT_FOUND,
                "NotFoundError",
                f"The model `{request.get('model')}` does not exist.",
                "model",
            )
        messages, images = _chat(request.get("messages"))
        n = int(request.get("n") or 1)
        params = self.sampling(request)
        if int(request.get("top_logprobs") or 0) != 0:
            raise BadRequest(HTTPStatus.BAD_REQUEST, "BadRequestError", "this server returns no top_logprobs")
        seed = request.get("seed")
        knobs = {k: params[k] for k in ("top_k", "min_p", "repetition_penalty")}
        with self.lock, _hf_sampling(self.policy.model, **knobs):
            prompt = self.policy.chat_inputs([messages], [images])
            roll = self.policy.generate(
                prompt,
                n=n,
                temperature=params["temperature"],
                top_p=params["top_p"],
                max_new_tokens=params["max_tokens"],
                seed=int(seed) if seed is not None else int(time.time_ns() % 2**63),
            )
        choices = []
        for j in range(n):
            keep = roll.response_mask[j]
            ids = roll.response_ids[j][keep].tolist()
            values = roll.log_probs[j][keep].tolist()
            stopped = bool(ids) and ids[-1] in self.stop_ids
            text_ids = ids[:-1] if stopped else ids  # the stop token is left out of the text
            content = self.tokenizer.decode(
                text_ids, skip_special_tokens=request.get("skip_special_tokens", True)
            )
            choices.append(self.choice(request, j, ids, values, stopped, content))
        prompt_tokens = int(prompt["attention_mask"].sum())
        completion_tokens = int(roll.response_mask.sum())
        return {
            "id": f"chatcmpl-{uuid.uuid4().hex}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": self.model_name,
            "choices": choices,
            "usage": {
                "prompt_tokens": prompt_tokens,
                "completion_tokens": completion_tokens,
                "total_tokens": prompt_tokens + completion_tokens,
            },
        }

    def choice(
        self,
        request: dict[str, Any],
        j: int,
        ids: list[int],
        values: list[float],
        stopped: bool,
        content: str,
    ) -> dict[str, Any]:
        """Choice j of a reply: the log-prob tokens as "token_id:<int>" with `return_tokens_as_token_ids`."""
        as_ids = bool(request.get("return_tokens_as_token_ids"))
        entry = None
        if request.get("logprobs"):
            tokens = [f"token_id:{t}" if as_ids else self.tokenizer.decode([t]) for t in ids]
            entry = {
                "content": [
                    {"token": tok, "logprob": lp, "bytes": list(tok.encode("utf-8")), "top_logprobs": []}
                    for tok, lp in zip(tokens, values)
                ]
            }
        return {
            "index": j,
            "message": {"role": "assistant", "content": content},
            "logprobs": entry,
            "finish_reason": "stop" if stopped else "length",
        }


class SGLangApp(PolicyApp):
    """What SGLang's OpenAI-compatible chat serving returns: its fallback sampling values (top_k −1), the
    sampled ids as the choice's `token_ids` with `return_token_ids` (log-prob tokens are always text:
    SGLang has no `return_tokens_as_token_ids`, and like pydantic it ignores fields it does not know),
    the stop token among them with `matched_stop` naming it."""

    fallbacks: ClassVar[dict[str, float]] = {
        "temperature": 1.0,
        "top_p": 1.0,
        "top_k": -1,
        "min_p": 0.0,
        "repetition_penalty": 1.0,
    }
    owner = "sglang"

    def choice(
        self,
        request: dict[str, Any],
        j: int,
        ids: list[int],
        values: list[float],
        stopped: bool,
        content: str,
    ) -> dict[str, Any]:
        out = super().choice(
            {**request, "return_tokens_as_token_ids": False}, j, ids, values, stopped, content
        )
        out["matched_stop"] = ids[-1] if stopped else None
        if request.get("return_token_ids"):
            out["token_ids"] = ids
        return out


class CannedApp:
    """Lists `model_name`, then answers every completion with `status` and `body` after `delay` seconds."""

    def __init__(self, model_name: str, status: int, body: bytes, delay: float = 0.0):
        self.model_name, self.status, self.body, self.delay = model_name, status, body, delay

    def get(self, path: str) -> tuple[int, bytes]:
        return 200, json.dumps(
            {"object": "list", "data": [{"id": self.model_name, "object": "model"}]}
        ).encode()

    def post(self, path: str, raw: bytes) -> tuple[int, bytes]:
        time.sleep(self.delay)
        return self.status, self.body


class _Server(ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request: Any, client_address: Any) -> None:
        """Quiet when a client hung up before the reply (the timeout test does); report anything else."""
        if not isinstance(sys.exc_info()[1], ConnectionError):
            super().handle_error(request, client_address)


@contextmanager
def _running(app: Any) -> Iterator[str]:
    server = _Server(("127.0.0.1", 0), _Handler)
    server.app = app  # type: ignore[attr-defined]
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/v1"
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


@contextmanager
def serve(policy: VLMPolicy, model_name: str) -> Iterator[str]:
    """Serve `policy` as `model_name` on 127.0.0.1 (a free port) in a background thread; yields the /v1 URL."""
    with _running(PolicyApp(policy, model_name)) as url:
        yield url


def main() -> None:
    """``python tests/openai_server.py --model DIR --served-model NAME [--api vllm|sglang]``: serve the
    tiny VLM in DIR as vLLM or SGLang would, on 127.0.0.1 (a free port); prints one JSON line {"pid",
    "url"} once it listens; stop it by its PID (SIGTERM)."""
    import argparse
    import os
    import signal

    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--served-model", required=True)
    parser.add_argument("--api", choices=("vllm", "sglang"), default="vllm")
    args = parser.parse_args()
    app = (SGLangApp if args.api == "sglang" else PolicyApp)(VLMPolicy.load(args.model), args.served_model)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    with _running(app) as url:
        print(json.dumps({"pid": os.getpid(), "url": url}), flush=True)
        stop.wait()


if __name__ == "__main__":
    main()


@contextmanager
def serve_canned(model_name: str, status: int, body: bytes, delay: float = 0.0) -> Iterator[str]:
    """A server listing `model_name` whose completions all return `status` / `body`; yields the /v1 URL."""
    with _running(CannedApp(model_name, status, body, delay)) as url:
        yield url
