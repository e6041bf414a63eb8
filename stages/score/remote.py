"""Remote rewards: ``--reward remote:http://host:port/NAME`` scores images on another machine over HTTP.

A remote reward is a reward like any other (kind image): `RemoteReward` is a configurable class, bound to
its URL by `remote_reward_class`, whose reward arguments (``--reward-arg remote:URL.KEY=VALUE``) are

- ``protocol=`` what the server speaks (below; default ``omnirl``);
- ``token_env=VAR``: the environment variable holding a bearer token, sent as ``Authorization: Bearer``
  (the token itself never reaches a manifest or a log);
- ``timeout=`` seconds to wait for each reply (60), ``retries=`` further tries after a failed one (5),
  ``backoff=`` seconds before the first retry (0.5), doubled after each (capped at 30 s, times a
  0.5–1.5 jitter as the rollout clients; a 429's
  ``Retry-After`` is honoured up to 60 s);
- ``batch_size=`` images per request (32) and ``concurrency=`` requests in flight at once (4);
- ``model=`` and ``template=`` (chat protocols only): the served model name and the question, with
  ``{prompt}`` standing for the sample's prompt.

Connection errors, timeouts, 408, 429 and 5xx replies are retried; a server that stays down raises
`RemoteRewardError` naming the URL, the number of tries and the first prompt of the batch, which
`scoring.score_batch` reports with the batch's sample ids (``--on-error fail``, exit 2) or records as 0
flagged in ``reward_failed`` (``--on-error zero``). A reply the user can act on (401/403: the token;
413: the size; other 4xx: the request or the reward name) is a `UserInputError` at once.

Protocols (what each sends and receives):

``omnirl`` — `omnirl serve-reward` (`stages.score.reward_server`). One ``POST URL`` per batch with the
JSON body ``{"images": [base64 PNG], "prompts": [str], "meta": [object]}``; the images go as lossless
PNG, so the server scores the very pixels the client holds (a conditioned rollout's
``meta["condition_images"]`` too, as lists of base64 PNGs). The reply is ``{"rewards": {NAME: [float |
null]}, "reward": [float | null], "errors": {NAME: str}}`` (``errors`` only when a reward failed on the
batch). With a URL path ``/NAME`` the server scores only reward NAME and the client takes
``rewards[NAME]``, the raw value; with ``/`` or ``/score`` it scores all its rewards and the client takes
``reward``, the server's weighted sum. Errors come back as ``{"error": {"code": int, "message": str}}``.

``unifiedreward`` — flow_grpo's ``unifiedreward_score_sglang`` (yifan123/flow_grpo,
``flow_grpo/rewards.py``): UnifiedReward-7b-v1.5 behind an OpenAI-compatible server (sglang, vLLM).
The URL is the API root (``http://host:17140/v1``); one ``POST /chat/completions`` per image with
``model`` (default ``UnifiedReward-7b-v1.5``), ``temperature`` 0 and one user turn: the image resized
to 512×512 (PIL's default filter), as a base64 PNG data URL, then the question. The answer is read
with the ``unifiedreward`` rubric (`stages.score.rubrics`: flow_grpo's "Final Score:" pattern,
reward = score / 5). flow_grpo scores an answer without one 0; here it is None (reported, never a
silent 0).

``unifiedreward2`` — verl-omni's UnifiedReward-2.0 scorer (verl-project/verl-omni,
``verl_omni/utils/reward_score/unified_reward.py``): the same chat request with ``model`` (default
``CodeGoat24/UnifiedReward-2.0-qwen3vl-2b``), ``temperature`` 0, ``top_p`` 1, ``max_tokens`` 512 and the
image unresized, read with the ``unifiedreward2`` rubric (three 1–5 axis scores → [0, 1]; an answer
without them is None where verl-omni scores 0).

``vlm_judge url=... preset=unifiedreward|unifiedreward2`` asks the same rubric through the OpenAI
engine's client (or a local model) and gives the same numbers; these protocols reproduce the two
projects' request fields exactly. The questions are our wording of the rubrics: pass a project's own
question with ``template=`` to reproduce its numbers.

Not spoken: flow_grpo's GenEval and DeQA servers (yifan123/reward-server ``app_geneval.py``,
``app_deqa.py``; clients ``geneval_score`` / ``deqa_score_remote``), flow_grpo's
``unifiedreward_score_remote`` and verl-omni's generic HTTP scorer (``http_scorer_client.py``) all
exchange pickled dicts (JPEG bytes in, scores out), and omnirl unpickles nothing from the network.
Naming one of them (``flow_grpo_geneval``, ``flow_grpo_deqa``, ``flow_grpo_unifiedreward``,
``verl_omni_http``) is a one-line error that says what to run instead: the model as an omnirl reward
(``geneval``, a plugin) served by ``omnirl serve-reward``.
"""

from __future__ import annotations

import base64
import email.utils
import http.client
import io
import json
import logging
import math
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from PIL import Image

from stages.errors import RuntimeFailure, UserInputError
from stages.models.condition_images import RECORD as CONDITION_IMAGES
from stages.score import REMOTE_PREFIX
from stages.score.rubrics import PROMPT_FIELD, RUBRICS
from stages.web import backoff, env_token, error_message, http_url, one_line, redact_url

logger = logging.getLogger(__name__)

MAX_RETRY_AFTER_S = 60.0
RETRY_STATUSES = frozenset({408, 429})  # plus every 5xx
TOTAL_PATHS = ("", "score")  # URL paths whose reply the client takes as the server's weighted sum

PICKLE_PROTOCOLS = {
    "flow_grpo_geneval": "flow_grpo's GenEval server (yifan123/reward-server app_geneval.py)",
    "flow_grpo_deqa": "flow_grpo's DeQA server (yifan123/reward-server app_deqa.py)",
    "flow_grpo_unifiedreward": "flow_grpo's unifiedreward_score_remote server",
    "verl_omni_http": "verl-omni's generic HTTP scorer (http_scorer_client.py)",
}


class RemoteRewardError(RuntimeFailure):
    """A reward server that stayed unreachable or failing through every retry, or whose reward
    failed on a batch: a per-batch failure, which ``--on-error zero`` may record as 0 and flag."""


def png_bytes(image: Image.Image, compress_level: int = 1) -> bytes:
    """`image` as PNG (lossless: the receiver decodes the same pixels); level 1 favours speed."""
    buffer = io.BytesIO()
    image.save(buffer, format="PNG", compress_level=compress_level)
    return buffer.getvalue()


def check_url(url: str, where: str) -> urllib.parse.SplitResult:
    """`url` split, when it is an http(s) URL with a host, no credentials and no query or fragment;
    `where` names it. Credentials are refused (a reward's URL becomes its column name and is recorded),
    and no message shows their secret (`redact_url`)."""
    shown = redact_url(url)
    parts = http_url(url)
    if parts is None:
        raise UserInputError(
            f"{where}: {shown!r} is not an http(s)://HOST:PORT/PATH URL without query or fragment; "
            "write e.g. remote:http://127.0.0.1:18090/jpeg_compressibility"
        )
    if "@" in parts.netloc:
        raise UserInputError(
            f"{where}: {shown!r} carries credentials, which would be recorded with the reward's name; drop "
            f"them and pass the server's token with --reward-arg {REMOTE_PREFIX}URL.token_env=VAR"
        )
    try:
        parts.port  # noqa: B018  (raises on a port that is not a number)
    except ValueError:
        raise UserInputError(f"{where}: {shown!r} has a port that is not a number") from None
    return parts


def _retry_after(error: urllib.error.HTTPError) -> float | None:
    """A 429/503 reply's ``Retry-After`` in seconds (a number or an HTTP date), when it has one."""
    value = error.headers.get("Retry-After") if error.headers else None
    if not value:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        try:
            when = email.utils.parsedate_to_datetime(value)
        except (TypeError, ValueError):
            return None
        return max(0.0, when.timestamp() - time.time())


@dataclass(frozen=True)
class Transport:
    """How requests reach the server of reward `name`: bearer token, per-reply timeout, retries, backoff."""

    name: str
    protocol: str
    token: str | None
    token_env: str
    timeout: float
    retries: int
    backoff: float

    def post(self, url: str, body: dict[str, Any], prompt: str, abort: threading.Event) -> Any:
        """POST `body` as JSON to `url`; the decoded JSON reply.

        Retries what may pass (connection errors, timeouts, 408, 429, 5xx) with exponential backoff,
        then raises `RemoteRewardError` naming the URL and `prompt` (the batch's first); stops early
        when `abort` is set (another request of the same call failed).
        """
        data = json.dumps(body).encode("utf-8")
        headers = {"Content-Type": "application/json", "Accept": "application/json"}
        if self.token:
            headers["Authorization"] = f"Bearer {self.token}"
        tries = self.retries + 1
        start = time.monotonic()
        last = ""
        for attempt in range(tries):
            wait = backoff(attempt, self.backoff)
            try:
                request = urllib.request.Request(url, data=data, headers=headers, method="POST")
                with urllib.request.urlopen(request, timeout=self.timeout) as response:
                    raw = response.read()
            except urllib.error.HTTPError as exc:
                detail = error_message(exc.read() if exc.fp else b"") or str(exc.reason)
                if exc.code not in RETRY_STATUSES and exc.code < 500:
                    raise self._refused(url, exc.code, detail, len(data)) from None
                last = f"HTTP {exc.code}: {detail}"
                after = _retry_after(exc)
                if after is not None:
                    wait = min(max(wait, after), MAX_RETRY_AFTER_S)
            except urllib.error.URLError as exc:
                if not isinstance(exc.reason, OSError):  # "unknown url type" and the like
                    raise UserInputError(f"{url}: not a usable URL ({one_line(exc.reason)})") from None
                last = one_line(exc.reason)
            except (http.client.HTTPException, OSError) as exc:  # timeout, reset, disconnect, cut reply
                last = (
                    f"no reply within {self.timeout:g} s"
                    if isinstance(exc, TimeoutError)
                    else one_line(f"{type(exc).__name__}: {exc}")
                )
            else:
                try:
                    return json.loads(raw)
                except ValueError:
                    raise UserInputError(
                        f"{url}: the reply is not JSON ({one_line(raw[:80].decode('utf-8', 'replace'))!r}); "
                        f"does the server speak protocol={self.protocol}?"
                    ) from None
            if attempt + 1 < tries:
                logger.info("%s: %s; retry %d of %d in %.1f s", url, last, attempt + 1, self.retries, wait)
                if abort.wait(wait):
                    break
        raise RemoteRewardError(
            f"{url}: no answer after {tries} tries over {time.monotonic() - start:.1f} s (last: {last}); "
            f"start the reward server or fix the URL; the batch starts with prompt {prompt!r}"
        )

    def _refused(self, url: str, code: int, detail: str, size: int) -> UserInputError:
        """The one-line error for a 4xx reply that a retry cannot fix."""
        if code in (401, 403):
            how = (
                f"the token in ${self.token_env} is refused; put the server's token there"
                if self.token
                else f"the server wants a token; pass --reward-arg {self.name}.token_env=VAR"
            )
            return UserInputError(f"{url}: HTTP {code} ({detail}); {how}")
        if code == 413:
            return UserInputError(
                f"{url}: HTTP 413 ({detail}) for a {size / 2**20:.1f} MiB request; lower "
                f"--reward-arg {self.name}.batch_size or raise the server's --max-request-mb / --max-batch"
            )
        return UserInputError(f"{url}: HTTP {code} ({detail})")


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _wire_meta(meta: dict) -> dict:
    """A sample's meta as JSON: its condition images (`stages.score.stage`, PIL images) as base64 PNGs,
    which `reward_server` decodes back."""
    if CONDITION_IMAGES not in meta:
        return meta
    sources = [base64.b64encode(png_bytes(image)).decode("ascii") for image in meta[CONDITION_IMAGES]]
    return {**meta, CONDITION_IMAGES: sources}


class OmnirlProtocol:
    """`omnirl serve-reward`'s JSON protocol (module docstring): batches of base64 PNGs."""

    def __init__(self, url: str, batch_size: int):
        self.url = url
        self.batch_size = batch_size
        path = urllib.parse.unquote(urllib.parse.urlsplit(url).path.strip("/"))
        self.reward = None if path in TOTAL_PATHS else path

    def spans(self, n: int) -> list[range]:
        """The sample indices of each request."""
        return [range(s, min(n, s + self.batch_size)) for s in range(0, n, self.batch_size)]

    def request(
        self, span: range, images: Sequence[Any], prompts: Sequence[str], meta: Sequence[dict]
    ) -> tuple[str, dict[str, Any]]:
        """(URL, JSON body) scoring the samples of `span`."""
        body = {
            "images": [base64.b64encode(png_bytes(images[i])).decode("ascii") for i in span],
            "prompts": [prompts[i] for i in span],
            "meta": [_wire_meta(meta[i]) for i in span],
        }
        return self.url, body

    def parse(self, reply: Any, span: range, prompt: str) -> list[float | None]:
        """The values of `span` from a reply: ``rewards[NAME]``, or the weighted ``reward``."""
        key = "reward" if self.reward is None else f"rewards.{self.reward}"
        values = None
        if isinstance(reply, dict):
            errors = reply.get("errors") or {}
            failed = errors.get(self.reward) if self.reward else next(iter(errors.values()), None)
            if failed:
                raise RemoteRewardError(
                    f"{self.url}: the server's reward failed on the batch that starts with prompt "
                    f"{prompt!r}: {one_line(failed)}"
                )
            rewards = reply.get("rewards")
            if self.reward is None:
                values = reply.get("reward")
            elif isinstance(rewards, dict):
                values = rewards.get(self.reward)
        n = len(span)
        if (
            not isinstance(values, list)
            or len(values) != n
            or not all(v is None or _number(v) for v in values)
        ):
            raise UserInputError(
                f"{self.url}: the reply has no list of {n} numbers or nulls under {key!r}; is this "
                "`omnirl serve-reward`, serving that reward (GET /health lists them)?"
            )
        return [None if v is None else float(v) for v in values]


class ChatProtocol:
    """A VLM judge behind an OpenAI-compatible chat API: one request per image, its answer parsed."""

    def __init__(
        self,
        url: str,
        *,
        model: str,
        question: str,
        sampling: dict[str, Any],
        image_size: int,
        parse: Callable[[str], float | None],
    ):
        root = url.rstrip("/")
        self.url = root if root.endswith("/chat/completions") else f"{root}/chat/completions"
        self.model, self.question, self.sampling = model, question, sampling
        self.image_size, self.parse_answer = image_size, parse

    def spans(self, n: int) -> list[range]:
        return [range(i, i + 1) for i in range(n)]

    def request(
        self, span: range, images: Sequence[Any], prompts: Sequence[str], meta: Sequence[dict]
    ) -> tuple[str, dict[str, Any]]:
        """(URL, chat completion body) asking about the one image of `span`."""
        image, prompt = images[span[0]], prompts[span[0]]
        if self.image_size:
            image = image.resize((self.image_size, self.image_size))
        data_url = f"data:image/png;base64,{base64.b64encode(png_bytes(image, 6)).decode('ascii')}"
        content = [
            {"type": "image_url", "image_url": {"url": data_url}},
            {"type": "text", "text": self.question.replace(PROMPT_FIELD, prompt)},
        ]
        return self.url, {
            "model": self.model,
            "messages": [{"role": "user", "content": content}],
            **self.sampling,
        }

    def parse(self, reply: Any, span: range, prompt: str) -> list[float | None]:
        """The parsed score of the answer, None (logged with the answer) when it has none."""
        try:
            answer = reply["choices"][0]["message"]["content"]
        except (KeyError, IndexError, TypeError):
            raise UserInputError(
                f"{self.url}: the reply is not an OpenAI chat completion; point the URL at the API root "
                "(http://host:port/v1) of an OpenAI-compatible server"
            ) from None
        value = self.parse_answer(answer if isinstance(answer, str) else "")
        if value is None:
            logger.warning(
                "%s: no score in the answer %r for prompt %r; recorded as None",
                self.url,
                one_line(str(answer), 200),
                prompt,
            )
        return [value]


# Each chat protocol asks its rubric (`stages.score.rubrics`) with the request fields of the project
# whose client it reproduces.
_CHAT_SAMPLING: dict[str, dict[str, Any]] = {
    "unifiedreward": {"temperature": 0.0},
    "unifiedreward2": {"temperature": 0.0, "top_p": 1.0, "max_tokens": 512},
}
CHAT_PROTOCOLS: dict[str, dict[str, Any]] = {
    name: {
        "model": RUBRICS[name].model,
        "question": RUBRICS[name].question,
        "sampling": sampling,
        "image_size": RUBRICS[name].image_size,
        "parse": RUBRICS[name].parse,
    }
    for name, sampling in _CHAT_SAMPLING.items()
}
PROTOCOLS = ("omnirl", *CHAT_PROTOCOLS)


class RemoteReward:
    """A reward computed by the server at `url` (bound by `remote_reward_class`); its arguments are in
    the module docstring. Called like every scorer: ``(images, prompts, meta) -> list[float | None]``."""

    url = ""
    reward_kind = "image"

    def __init__(
        self,
        protocol: str = "omnirl",
        token_env: str = "",
        timeout: float = 60.0,
        retries: int = 5,
        backoff: float = 0.5,
        batch_size: int = 32,
        concurrency: int = 4,
        model: str = "",
        template: str = "",
    ):
        self.name = f"{REMOTE_PREFIX}{self.url}"
        source = f"reward {self.name!r}"
        if protocol in PICKLE_PROTOCOLS:
            raise UserInputError(
                f"{source}: protocol={protocol} is {PICKLE_PROTOCOLS[protocol]}, which exchanges pickles, and "
                "omnirl never unpickles network data; serve the model as an omnirl reward with "
                "`omnirl serve-reward --reward NAME` and use protocol=omnirl"
            )
        if protocol not in PROTOCOLS:
            raise UserInputError(f"{source}: protocol={protocol} is not one of {', '.join(PROTOCOLS)}")
        for key, value, least in (
            ("retries", retries, 0),
            ("batch_size", batch_size, 1),
            ("concurrency", concurrency, 1),
        ):
            if value < least:
                raise UserInputError(f"{source}: {key}={value} must be at least {least}")
        if not (math.isfinite(timeout) and timeout > 0 and math.isfinite(backoff) and backoff >= 0):
            raise UserInputError(f"{source}: timeout={timeout} must be > 0 and backoff={backoff} ≥ 0 seconds")
        token = env_token(token_env, f"{source}: token_env={token_env}")
        self.transport = Transport(self.name, protocol, token, token_env, timeout, retries, backoff)
        self.concurrency = concurrency
        self.protocol: OmnirlProtocol | ChatProtocol
        if protocol == "omnirl":
            if model or template:
                raise UserInputError(f"{source}: model= and template= apply to the chat protocols only")
            self.protocol = OmnirlProtocol(self.url, batch_size)
        else:
            spec = {key: value for key, value in CHAT_PROTOCOLS[protocol].items() if key != "question"}
            question = template or CHAT_PROTOCOLS[protocol]["question"]
            if PROMPT_FIELD not in question:
                raise UserInputError(f"{source}: template= must contain {PROMPT_FIELD} (the sample's prompt)")
            self.protocol = ChatProtocol(
                self.url, **{**spec, "model": model or spec["model"]}, question=question
            )

    @property
    def weight_paths(self) -> dict[str, Any]:
        """No local file determines a remote reward's numbers (`registry.reward_files`)."""
        return {}

    def __call__(
        self, images: Sequence[Any], prompts: Sequence[str], meta: Sequence[dict]
    ) -> list[float | None]:
        """One value per sample, in order; `concurrency` requests at a time, each encoding its own
        images. The first failing request (in sample order) is raised once the others stop."""
        spans = self.protocol.spans(len(images))
        abort = threading.Event()

        def run(span: range) -> list[float | None]:
            prompt = prompts[span[0]]
            try:
                url, body = self.protocol.request(span, images, prompts, meta)
                return self.protocol.parse(self.transport.post(url, body, prompt, abort), span, prompt)
            except BaseException:
                abort.set()
                raise

        values: list[float | None] = [None] * len(images)
        if not spans:
            return values
        with ThreadPoolExecutor(max_workers=min(self.concurrency, len(spans))) as pool:
            futures = [pool.submit(run, span) for span in spans]
            try:
                for span, future in zip(spans, futures):
                    for i, value in zip(span, future.result(), strict=True):
                        values[i] = value
            except BaseException:
                abort.set()
                for future in futures:
                    future.cancel()
                raise
        return values


_CLASSES: dict[str, type[RemoteReward]] = {}
_lock = threading.Lock()


def remote_reward_class(url: str) -> type[RemoteReward]:
    """The `RemoteReward` subclass bound to `url` (one per URL, so the registry caches its instances)."""
    check_url(url, f"--reward {REMOTE_PREFIX}{redact_url(url)}")
    with _lock:
        if url not in _CLASSES:
            _CLASSES[url] = type(
                "RemoteReward", (RemoteReward,), {"url": url, "__doc__": RemoteReward.__doc__}
            )
        return _CLASSES[url]


def remote_column(url: str) -> str:
    """The shard-set column suffix of reward ``remote:URL``: ``remote:HOST:PORT:PATH:SEGMENTS`` (no '/',
    no scheme), e.g. ``remote:127.0.0.1:18090:jpeg_compressibility``."""
    parts = urllib.parse.urlsplit(url)
    path = ":".join(segment for segment in parts.path.split("/") if segment)
    return f"{REMOTE_PREFIX}{parts.netloc}" + (f":{path}" if path else "")
