"""VLM responses sampled by a server speaking the OpenAI chat API (`vllm serve`), as a `Rollout`.

One POST `/chat/completions` per prompt asks for n responses with the prompt's seed and every
sampling parameter that shapes the distribution (`NEUTRAL_SAMPLING`), the sampled tokens as ids
(vLLM's `return_tokens_as_token_ids`, tokens come back as "token_id:<int>") and their log-probs
(`logprobs`, `top_logprobs: 0`); the prompt's chat messages go as they are, each image part an
`image_url` part holding a base64 data URL (a plain question: one user turn, images first). Requests run concurrently; the served model list is checked once before sampling.
Only the standard library talks HTTP, so the engine adds no dependency.

The sampling parameters. For a parameter a request leaves out, `vllm serve` uses the model's
generation_config.json (repetition_penalty, temperature, top_k, top_p, min_p, max_new_tokens; e.g.
Qwen2.5-VL-Instruct ships top_k 1 and repetition_penalty 1.05, which makes a group greedy and
identical). So the request states them all: temperature and top_p as asked, and vLLM's neutral
values for the rest, which is the distribution `VLMPolicy.generate` samples and `omnirl logprob`
replays (logits / temperature, no top-k, min-p or penalties).

The stop token. In vLLM a request finishes when the sampled token is the EOS or one of the stop
token ids (vLLM adds the generation config's other EOS ids there); the check runs after the token
is appended to the output ids, and the chat response's `logprobs.content` is built over those ids,
so the EOS comes back with its log-prob (only the text leaves it out). The rollout therefore keeps
it, as HF `generate` does: the mask covers the returned tokens up to and including the first
`tokenizer.eos_token_id`. A response that finished with "stop" but whose last token is not a special
token (a server that drops the stop token, or a stop string) is an error rather than a response
silently missing its stop decision.

The log-probs are the server's. vLLM's default `--logprobs-mode raw_logprobs` scores the raw logits
(temperature 1, no top-p); `processed_logprobs` scores them after temperature and top-k/top-p. They
equal `VLMPolicy.generate`'s (logits / temperature, no top-p warping) only in processed mode with
top_p = 1, and a different kernel gives different rounding anyway; `omnirl logprob` recomputes them.

SGLang (`--engine sglang`, `python -m sglang.launch_server`) speaks the same chat API with its own
fields (`SGLANG`): it also takes temperature, top_p, top_k, min_p and repetition_penalty from the model's
generation_config.json when a request leaves them out (its default `--sampling-defaults model`; its own
fallbacks are 1, 1, −1, 0 and 1), so the request states them all, at its neutral values; it returns the
sampled ids as the choice's `token_ids` (`return_token_ids`) beside the per-token log-probs, the stop
token included (`matched_stop` names it; only the text trims it), and draws with `seed` (its
`sampling_seed`). Its log-probs are of the raw distribution too; `omnirl logprob` recomputes them.
"""

from __future__ import annotations

import base64
import http.client
import json
import math
import socket
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

from stages.errors import OmnirlError, RuntimeFailure, UserInputError
from stages.models.vlm import VISION_TOKENS, Rollout
from stages.models.vlm_inputs import user_turn
from stages.web import error_message, one_line

START_HINT = "start the server (`vllm serve MODEL`, `python -m sglang.launch_server --model-path MODEL`) or fix --server-url"
TOKEN_ID_PREFIX = "token_id:"
# vLLM reports a log-prob of -inf (a token the sampler could not have drawn) as this value.
LOGPROB_FLOOR = -9999.0
# Every other parameter of vLLM's chat request that changes which tokens are drawn, at its neutral
# value: top_k -1 (off; vLLM takes -1 and 0), min_p 0, no repetition/presence/frequency penalty,
# no forced minimum length, no beam search.
NEUTRAL_SAMPLING: dict[str, Any] = {
    "top_k": -1,
    "min_p": 0.0,
    "repetition_penalty": 1.0,
    "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
    "min_tokens": 0,
    "ignore_eos": False,
    "use_beam_search": False,
}


@dataclass(frozen=True)
class ServerAPI:
    """What one OpenAI-compatible server needs beyond the OpenAI chat schema to return a replayable
    rollout: its `engine` name (`sample --engine`), the program serving it, every sampling field that
    changes which tokens are drawn at its neutral value (`neutral`), and the request fields that make it
    return the sampled token ids (`ids_request`): vLLM spells them as "token_id:<int>" tokens of the
    log-probs, SGLang lists them as the choice's `token_ids`."""

    engine: str
    program: str
    neutral: dict[str, Any]
    ids_request: dict[str, Any]


VLLM = ServerAPI("openai", "vLLM", NEUTRAL_SAMPLING, {"return_tokens_as_token_ids": True})
# SGLang's chat request (its ChatCompletionRequest) at its neutral values: top_k −1 (off), min_p 0, no
# repetition/presence/frequency penalty, no forced minimum length, the EOS honoured.
SGLANG = ServerAPI(
    "sglang",
    "SGLang",
    {
        "top_k": -1,
        "min_p": 0.0,
        "repetition_penalty": 1.0,
        "presence_penalty": 0.0,
        "frequency_penalty": 0.0,
        "min_tokens": 0,
        "ignore_eos": False,
    },
    {"return_token_ids": True},
)
SERVER_APIS = {api.engine: api for api in (VLLM, SGLANG)}

_IMAGE_MAGIC = ((b"\x89PNG\r\n\x1a\n", "image/png"), (b"\xff\xd8\xff", "image/jpeg"), (b"GIF8", "image/gif"))


def image_data_url(blob: bytes, where: str) -> str:
    """An encoded image file as a base64 data URL, its MIME type read from the magic bytes."""
    mime = next((m for magic, m in _IMAGE_MAGIC if blob.startswith(magic)), None)
    if mime is None and blob[:4] == b"RIFF" and blob[8:12] == b"WEBP":
        mime = "image/webp"
    if mime is None:
        raise UserInputError(f"{where}: an image is not a PNG, JPEG, GIF or WebP file")
    return f"data:{mime};base64,{base64.b64encode(blob).decode('ascii')}"


def chat_messages(
    prompt: str | list[dict[str, Any]], images: list[bytes], where: str
) -> list[dict[str, Any]]:
    """The OpenAI chat messages of a prompt: its messages (a plain question: `user_turn`) with each image
    part, in order, an `image_url` part holding the next image as a base64 data URL."""
    messages = user_turn(prompt, len(images)) if isinstance(prompt, str) else prompt
    urls = iter([image_data_url(b, f"{where}, image {k}") for k, b in enumerate(images)])
    out = []
    for m in messages:
        content = m["content"]
        if isinstance(content, list):
            content = [
                {"type": "image_url", "image_url": {"url": next(urls)}}
                if part.get("type") == "image"
                else {k: v for k, v in part.items() if v is not None}
                for part in content
            ]
        out.append({**m, "content": content})
    return out


def chat_request(
    model: str,
    prompt: str | list[dict[str, Any]],
    images: list[bytes],
    *,
    n: int,
    temperature: float,
    top_p: float,
    max_new_tokens: int,
    seed: int,
    where: str = "prompt",
    banned_ids: list[int] | None = None,
    api: ServerAPI = VLLM,
) -> dict[str, Any]:
    """The JSON body asking server `api` for n responses to a prompt (`chat_messages`), every sampling
    parameter explicit (`ServerAPI.neutral`) and the sampled ids returned (`ServerAPI.ids_request`);
    `banned_ids` (the vision markers) get OpenAI's strongest logit bias, −100."""
    return {
        "model": model,
        "messages": chat_messages(prompt, images, where),
        "n": n,
        "temperature": temperature,
        "top_p": top_p,
        **api.neutral,
        # vLLM and SGLang read max_completion_tokens first and fall back to the older max_tokens.
        "max_completion_tokens": max_new_tokens,
        "max_tokens": max_new_tokens,
        "seed": seed,
        "logprobs": True,
        "top_logprobs": 0,
        **api.ids_request,
        "stream": False,
        **({"logit_bias": {str(i): -100 for i in banned_ids}} if banned_ids else {}),
    }


def _error_detail(error: urllib.error.HTTPError) -> str:
    """The message of an error reply (`stages.web.error_message`), else the HTTP reason."""
    try:
        raw = error.read()
    except OSError:
        raw = b""
    return error_message(raw) or str(error.reason)


def _request_json(
    url: str,
    body: dict[str, Any] | None,
    *,
    api_key: str | None,
    timeout: float,
    bad_reply: type[OmnirlError],
) -> Any:
    """GET (no body) or POST JSON to `url`; the decoded JSON reply, or the error a user can act on.

    `bad_reply` is raised for a 2xx reply that is not JSON: for the model list that means the URL is
    not an OpenAI API, for a completion that the server failed.
    """
    headers = {"Accept": "application/json"}
    data = None
    if body is not None:
        data = json.dumps(body).encode("utf-8")
        headers["Content-Type"] = "application/json"
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    try:
        request = urllib.request.Request(
            url, data=data, headers=headers, method="GET" if data is None else "POST"
        )
        with urllib.request.urlopen(request, timeout=timeout) as response:
            raw = response.read()
    except urllib.error.HTTPError as e:
        detail = _error_detail(e)
        if e.code in (401, 403):
            raise UserInputError(
                f"{url}: HTTP {e.code} ({detail}); the server wants a valid API key"
            ) from None
        if e.code in (408, 429) or e.code >= 500:
            raise RuntimeFailure(
                f"{url}: the server failed (HTTP {e.code}: {detail}); check its log and retry"
            ) from None
        raise UserInputError(
            f"{url}: HTTP {e.code} ({detail}); check --server-url (the API root, e.g. http://host:8000/v1), "
            "--served-model and the sampling options"
        ) from None
    except urllib.error.URLError as e:
        reason = e.reason
        if isinstance(reason, TimeoutError):
            raise RuntimeFailure(
                f"{url}: no answer within {timeout:g} s; the server is stuck or overloaded (check its log)"
            ) from None
        if isinstance(reason, (ConnectionRefusedError, socket.gaierror)) or not isinstance(reason, OSError):
            raise UserInputError(f"{url}: cannot connect ({one_line(str(reason))}); {START_HINT}") from None
        raise RuntimeFailure(f"{url}: the connection failed ({one_line(str(reason))}); retry") from None
    except TimeoutError:
        raise RuntimeFailure(
            f"{url}: no answer within {timeout:g} s; the server is stuck or overloaded (check its log)"
        ) from None
    except (ValueError, http.client.InvalidURL) as e:  # "unknown url type", a bad port...
        raise UserInputError(f"{url}: not a usable URL ({one_line(str(e))}); fix --server-url") from None
    except (http.client.HTTPException, OSError) as e:
        raise RuntimeFailure(f"{url}: the connection failed ({one_line(repr(e))}); retry") from None
    try:
        return json.loads(raw)
    except ValueError:
        raise bad_reply(
            f"{url}: the reply is not JSON ({one_line(raw[:80].decode('utf-8', 'replace'))!r}); "
            + (START_HINT if bad_reply is UserInputError else "check the server log")
        ) from None


def served_models(base_url: str, *, api_key: str | None = None, timeout: float = 60.0) -> list[str]:
    """The model names `GET {base_url}/models` lists (what `model` in a request may be)."""
    url = f"{base_url.rstrip('/')}/models"
    reply = _request_json(url, None, api_key=api_key, timeout=timeout, bad_reply=UserInputError)
    try:
        return [str(entry["id"]) for entry in reply["data"]]
    except (TypeError, KeyError):
        raise UserInputError(f"{url}: not an OpenAI model list; {START_HINT}") from None


def _finite_logprob(value: Any) -> bool:
    return (
        isinstance(value, (int, float))
        and not isinstance(value, bool)
        and math.isfinite(value)
        and value > LOGPROB_FLOOR
    )


def _token_ids(choice: dict[str, Any], content: list[Any], url: str, j: int, api: ServerAPI) -> list[int]:
    """The sampled ids of choice `j`, one per log-prob entry of `content`: SGLang's `token_ids`, or
    vLLM's "token_id:<int>" tokens."""
    if api is SGLANG:
        ids = choice.get("token_ids")
        if not isinstance(ids, list) or len(ids) != len(content):
            got = f"{len(ids)} token_ids" if isinstance(ids, list) else "no token_ids"
            raise RuntimeFailure(
                f"{url}: choice {j} has {got} for {len(content)} log-probs; the server ignored "
                "`return_token_ids` (serve with SGLang)"
            )
        if not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids):
            raise RuntimeFailure(f"{url}: choice {j}'s token_ids are not all token ids; check the server log")
        return ids
    ids = []
    for k, entry in enumerate(content):
        token = entry.get("token") if isinstance(entry, dict) else None
        if not isinstance(token, str) or not token.startswith(TOKEN_ID_PREFIX):
            raise RuntimeFailure(
                f"{url}: choice {j} token {k} is {token!r}, not 'token_id:<int>'; the server ignored "
                "`return_tokens_as_token_ids` (serve with vLLM)"
            )
        try:
            ids.append(int(token[len(TOKEN_ID_PREFIX) :]))
        except ValueError:
            raise RuntimeFailure(f"{url}: choice {j} token {k} is {token!r}, not 'token_id:<int>'") from None
    return ids


def parse_choices(
    reply: Any, url: str, *, n: int, max_new_tokens: int, stop_ids: set[int], api: ServerAPI = VLLM
) -> list[tuple[list[int], list[float]]]:
    """(token ids, log-probs) of the n choices of a chat completion from server `api`, in choice-index
    order, checked."""
    choices = reply.get("choices") if isinstance(reply, dict) else None
    if not isinstance(choices, list) or len(choices) != n:
        got = len(choices) if isinstance(choices, list) else "no"
        raise RuntimeFailure(f"{url}: asked for {n} choices, the reply has {got}; check the server log")
    by_index = {c.get("index") if isinstance(c, dict) else None: c for c in choices}
    if set(by_index) != set(range(n)):
        raise RuntimeFailure(f"{url}: the choice indices are not 0..{n - 1}; check the server log")
    out = []
    for j in range(n):
        choice = by_index[j]
        logprobs = choice.get("logprobs")
        content = logprobs.get("content") if isinstance(logprobs, dict) else None
        if not isinstance(content, list):
            raise RuntimeFailure(
                f"{url}: choice {j} has no token log-probs; serve with {api.program} (it honours `logprobs`)"
            )
        ids = _token_ids(choice, content, url, j, api)
        values = []
        for k, (token_id, entry) in enumerate(zip(ids, content)):
            value = entry.get("logprob") if isinstance(entry, dict) else None
            if not _finite_logprob(value) or token_id < 0:
                raise RuntimeFailure(
                    f"{url}: choice {j} token {k} (id {token_id}) has log-prob {value!r}, not a finite "
                    "number; check the server log"
                )
            values.append(float(value))
        if len(ids) > max_new_tokens:
            raise RuntimeFailure(
                f"{url}: choice {j} has {len(ids)} tokens, more than max_tokens {max_new_tokens}"
            )
        finish = choice.get("finish_reason")
        if finish not in ("stop", "length"):
            raise RuntimeFailure(f"{url}: choice {j} finished with {finish!r}; check the server log")
        if finish == "stop" and (not ids or ids[-1] not in stop_ids):
            raise RuntimeFailure(
                f"{url}: choice {j} stopped without returning its stop token; serve with {api.program}, which "
                "returns it"
            )
        out.append((ids, values))
    return out


def generate_openai(
    base_url: str,
    model: str,
    questions: list[str | list[dict[str, Any]]],
    images: list[list[bytes]],
    *,
    tokenizer: Any,
    n: int,
    temperature: float,
    top_p: float,
    max_new_tokens: int,
    seeds: list[int],
    api_key: str | None = None,
    timeout: float = 600.0,
    concurrency: int = 8,
    api: ServerAPI = VLLM,
) -> Rollout:
    """n responses per prompt from the server at `base_url` (e.g. http://host:8000/v1) serving `model`,
    speaking `api`'s dialect of the chat API (`VLLM`, `SGLANG`).

    `questions` are plain questions or chat messages (`chat_messages`). Same conventions as
    `VLMPolicy.generate`: rows prompt by prompt, n each; ids int64 [B·n, max_new_tokens]
    right-padded with the pad id; mask bool (the returned tokens up to and including the first eos);
    log-probs float32 [B·n, max_new_tokens], 0 at padding; text decoded without special tokens.
    """
    if not len(questions) == len(images) == len(seeds):
        raise UserInputError(
            f"generate_openai: {len(questions)} questions, {len(images)} image lists and {len(seeds)} seeds; "
            "pass one of each per prompt"
        )
    if n < 1 or max_new_tokens < 1 or concurrency < 1:
        raise UserInputError("generate_openai: n, max_new_tokens and concurrency must be at least 1")
    base = base_url.rstrip("/")
    names = served_models(base, api_key=api_key, timeout=min(timeout, 60.0))
    if model not in names:
        raise UserInputError(
            f"--served-model {model}: {base}/models serves {', '.join(names) or 'no model'}; pass one of these"
        )
    eos = tokenizer.eos_token_id
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos
    stop_ids = set(tokenizer.all_special_ids)
    banned = sorted(
        {
            i
            for i in tokenizer.convert_tokens_to_ids(list(VISION_TOKENS))
            if i is not None and i != tokenizer.unk_token_id
        }
    )
    url = f"{base}/chat/completions"
    bodies = [
        chat_request(
            model,
            q,
            imgs,
            n=n,
            temperature=temperature,
            top_p=top_p,
            max_new_tokens=max_new_tokens,
            seed=seed,
            where=f"prompt {i}",
            banned_ids=banned,
            api=api,
        )
        for i, (q, imgs, seed) in enumerate(zip(questions, images, seeds))
    ]

    def sample(body: dict[str, Any]) -> list[tuple[list[int], list[float]]]:
        reply = _request_json(url, body, api_key=api_key, timeout=timeout, bad_reply=RuntimeFailure)
        return parse_choices(reply, url, n=n, max_new_tokens=max_new_tokens, stop_ids=stop_ids, api=api)

    with ThreadPoolExecutor(max_workers=max(1, min(concurrency, len(bodies)))) as pool:
        futures = [pool.submit(sample, body) for body in bodies]
        try:
            responses = [row for future in futures for row in future.result()]
        except BaseException:
            for future in futures:
                future.cancel()
            raise

    rows = len(responses)
    ids = torch.full((rows, max_new_tokens), pad, dtype=torch.int64)
    mask = torch.zeros(rows, max_new_tokens, dtype=torch.bool)
    log_probs = torch.zeros(rows, max_new_tokens, dtype=torch.float32)
    for r, (tokens, values) in enumerate(responses):
        length = tokens.index(eos) + 1 if eos in tokens else len(tokens)
        if set(tokens[:length]) & set(banned):
            raise RuntimeFailure(
                f"{url}: response {r} contains an image/video marker token despite logit_bias; "
                "a response with one cannot be replayed, use a server that applies logit_bias"
            )
        ids[r, :length] = torch.tensor(tokens[:length], dtype=torch.int64)
        mask[r, :length] = True
        log_probs[r, :length] = torch.tensor(values[:length], dtype=torch.float32)
    text = tokenizer.batch_decode(ids, skip_special_tokens=True)
    index = [b for b in range(len(bodies)) for _ in range(n)]
    return Rollout(index, ids, mask, log_probs, text)
