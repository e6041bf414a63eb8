"""`vlm_judge`: a vision-language model answers a templated question about each image; the answer,
parsed, is the reward.

The judge is a local Qwen2.5-VL folder (``model=PATH``, loaded with `VLMPolicy.load`, decoded
greedily) or a model behind an OpenAI-compatible server (``url=http://host:port/v1`` and
``served_model=NAME``, optionally ``token_env=VAR`` naming the environment variable that holds the
API key), asked at temperature 0 with every other sampling knob at its neutral value
(`openai_engine.NEUTRAL_SAMPLING`, so vLLM does not take a repetition penalty from the model's
generation config). One image and one user turn per sample.

Presets (``preset=``), each a question and a parse of the answer:

- ``ocr`` (default): asks what text the image shows; reward = `ocr.ocr_text_reward(answer, target)`
  (Flow-GRPO's edit-distance formula, in [0, 1]) with the target read as `ocr.ocr_target` reads it
  (``meta["ocr_text"]``/``meta["text"]``, else the prompt's first quoted span). Whitespace runs in the
  answer (a VLM may break lines) count as spaces, which the formula removes. verl-omni trains
  with such a judge (Qwen3-VL OCR).
- ``unifiedreward`` / ``unifiedreward2``: flow_grpo's UnifiedReward and verl-omni's UnifiedReward-2.0
  rubrics (`stages.score.rubrics`: question, answer parse, image size), the same definitions that
  ``remote:URL protocol=unifiedreward|unifiedreward2`` asks, so both give the same numbers;
  reward in [0.2, 1] and [0, 1].
- ``yes_no``: "Does this image match: {prompt}? Answer yes or no."; reward 1 for yes, 0 for no.
- ``edit``: an image edit (`stages.score.rubrics.EDIT_RUBRIC`): the judge sees the sample's condition
  image (``meta["condition_images"]``, the source of an editing rollout, `stages.score.stage`) and then
  the result, with the prompt as the instruction, and rates instruction following and consistency with
  the source; reward in [0, 1]. A sample without a condition image is a one-line error.

``template=`` replaces the preset's question (``{prompt}`` stands for the sample's prompt); the
preset still parses the answer. ``max_tokens=0`` and ``image_size=-1`` take the preset's values
(``image_size=0`` sends the image unchanged, N resizes it to N×N). ``batch_size`` is the samples per
local ``generate`` or the requests in flight to a server; ``device``/``dtype`` place a local judge;
``timeout`` (s) bounds one request and ``retries`` repeats one that failed on the server's side
(5xx, 408/429, timeout), 1 s, 2 s, ... apart, before the batch fails.

An answer the preset cannot parse (no "Final Score:" in 1–5, neither yes nor no, no content) is
``None`` for that sample, logged with the batch item, its prompt and the raw answer; flow_grpo
scores such answers 0, which trains on a judge failure as if it were a bad image. The raw answers
of the last batch stay in `VLMJudge.last_answers`.
"""

from __future__ import annotations

import io
import logging
import re
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from PIL import Image

from stages.errors import OmnirlError, RuntimeFailure, UserInputError
from stages.models.condition_images import RECORD as CONDITION_IMAGES
from stages.score.clip_rewards import local_path
from stages.score.ocr import ocr_target, ocr_text_reward
from stages.score.registry import register_reward
from stages.score.rubrics import EDIT_RUBRIC, PROMPT_FIELD, RUBRICS
from stages.web import env_token

logger = logging.getLogger(__name__)

NAME = "vlm_judge"
RETRY_BASE_DELAY_S = 1.0

_YES_NO_RE = re.compile(r"^\W*(yes|no)\b", re.IGNORECASE)


def parse_yes_no(answer: str) -> float | None:
    """1.0 when the answer's first word is "yes", 0.0 when it is "no" (any case, leading punctuation
    ignored); None otherwise."""
    match = _YES_NO_RE.match(answer)
    if match is None:
        return None
    return 1.0 if match.group(1).lower() == "yes" else 0.0


def ocr_answer_reward(answer: str, target: str | None) -> float:
    """Flow-GRPO's OCR reward of the judge's answer: whitespace runs become one space, then
    `ocr_text_reward` (spaces removed, lowercased, edit distance capped at the target's length)."""
    if target is None:
        raise ValueError("the ocr preset scores against a target text; none was given")
    return ocr_text_reward(" ".join(answer.split()), target)


@dataclass(frozen=True)
class Preset:
    """A question (with ``{prompt}``), how to turn (answer, target) into a reward, and defaults."""

    question: str
    parse: Callable[[str, str | None], float | None]
    max_tokens: int
    image_size: int
    needs_target: bool = False
    with_source: bool = False  # the judge sees the condition image before the result


PRESETS: dict[str, Preset] = {
    "ocr": Preset(
        question="What text is written in this image? Reply with exactly that text and nothing else.",
        parse=ocr_answer_reward,
        max_tokens=128,
        image_size=0,
        needs_target=True,
    ),
    "yes_no": Preset(
        question=f"Does this image match: {PROMPT_FIELD}? Answer yes or no.",
        parse=lambda answer, target: parse_yes_no(answer),
        max_tokens=16,
        image_size=0,
    ),
    **{
        name: Preset(
            question=rubric.question,
            parse=lambda answer, target, parse=rubric.parse: parse(answer),
            max_tokens=rubric.max_tokens,
            image_size=rubric.image_size,
        )
        for name, rubric in RUBRICS.items()
    },
    "edit": Preset(
        question=EDIT_RUBRIC.question,
        parse=lambda answer, target: EDIT_RUBRIC.parse(answer),
        max_tokens=EDIT_RUBRIC.max_tokens,
        image_size=EDIT_RUBRIC.image_size,
        with_source=True,
    ),
}

# Messages of the OpenAI engine name the sampling command's flags; a judge is set by reward arguments.
_FLAG_NAMES = (("--server-url", f"{NAME}.url"), ("--served-model", f"{NAME}.served_model"))


def _reward_error(exc: OmnirlError) -> OmnirlError:
    """`exc` (from `openai_engine`) reworded for this reward: prefixed, its flags named as reward args."""
    message = str(exc)
    for flag, arg in _FLAG_NAMES:
        message = message.replace(flag, f"--reward-arg {arg}")
    return type(exc)(f"reward {NAME!r}: {message}")


def _png(image: Image.Image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


@register_reward(NAME, kind="image")
class VLMJudge:
    """A VLM asked one question per image; see the module docstring for presets and arguments."""

    def __init__(
        self,
        model: str | None = None,
        url: str | None = None,
        served_model: str | None = None,
        token_env: str | None = None,
        preset: str = "ocr",
        template: str | None = None,
        max_tokens: int = 0,
        image_size: int = -1,
        device: str | None = None,
        dtype: str = "fp32",
        batch_size: int = 8,
        timeout: float = 600.0,
        retries: int = 2,
    ):
        from stages.models.diffusion import DTYPES
        from stages.models.vlm_families import VLM_MODEL_TYPES, is_vlm_model

        if preset not in PRESETS:
            raise UserInputError(
                f"reward {NAME!r}: preset={preset} is not one of {', '.join(PRESETS)}; "
                f"pass --reward-arg {NAME}.preset=ocr"
            )
        if (model is None) == (url is None):
            raise UserInputError(
                f"reward {NAME!r} needs exactly one judge: pass --reward-arg {NAME}.model=PATH (a local "
                f"Qwen2.5-VL folder) or --reward-arg {NAME}.url=http://HOST:PORT/v1 (an OpenAI-compatible server)"
            )
        for key, value, least in (("batch_size", batch_size, 1), ("retries", retries, 0)):
            if value < least:
                raise UserInputError(
                    f"reward {NAME!r}: {key}={value} must be at least {least}; pass --reward-arg {NAME}.{key}=N"
                )
        if max_tokens < 0 or image_size < -1 or timeout <= 0:
            raise UserInputError(
                f"reward {NAME!r}: max_tokens={max_tokens}, image_size={image_size}, timeout={timeout}: "
                "max_tokens ≥ 0 (0: the preset's), image_size ≥ −1 (−1: the preset's, 0: unchanged), timeout > 0"
            )
        if dtype not in DTYPES:
            raise UserInputError(
                f"reward {NAME!r}: dtype={dtype} is not one of {', '.join(DTYPES)}; pass --reward-arg {NAME}.dtype=bf16"
            )
        self.preset_name = preset
        self.preset = PRESETS[preset]
        self.question = self.preset.question if template is None else template
        if not self.question.strip():
            raise UserInputError(f"reward {NAME!r}: template is empty; pass a question with {PROMPT_FIELD}")
        self.max_tokens = max_tokens or self.preset.max_tokens
        self.image_size = self.preset.image_size if image_size == -1 else image_size
        self.batch_size = batch_size
        self.timeout = timeout
        self.retries = retries
        self.device_name = device
        self.dtype = dtype
        self.model_path: Path | None = None
        self.url: str | None = None
        self.served_model = served_model
        self._api_key: str | None = None
        if model is not None:
            if served_model is not None or token_env is not None:
                raise UserInputError(
                    f"reward {NAME!r}: served_model and token_env go with url=, not with a local model=; remove them"
                )
            self.model_path = local_path(NAME, "model", model, "a local Qwen2.5-VL folder")
            if not is_vlm_model(self.model_path):
                raise UserInputError(
                    f"reward {NAME!r}: model={model} is not a {'/'.join(VLM_MODEL_TYPES)} transformers folder "
                    f"(its config.json model_type); pass --reward-arg {NAME}.model=PATH"
                )
        else:
            if device is not None or dtype != "fp32":
                raise UserInputError(
                    f"reward {NAME!r}: device and dtype apply to a local model=; the server at url= "
                    "decides its own, remove them"
                )
            self.url = str(url).rstrip("/")
            if token_env is not None:
                self._api_key = env_token(token_env, f"reward {NAME!r}: token_env={token_env}")
        self.last_answers: list[str | None] = []
        self._lock = threading.Lock()
        self._policy: Any = None
        self._served: str | None = None

    @property
    def weight_paths(self) -> dict[str, Path]:
        """The local files whose content determines this reward's numbers: the judge's folder, or
        nothing for a server (its url and served_model are arguments, already in a run's identity)."""
        return {"model": self.model_path} if self.model_path is not None else {}

    def questions(self, prompts: Sequence[str]) -> list[str]:
        """The question put to the judge for each prompt (the template with ``{prompt}`` filled)."""
        return [self.question.replace(PROMPT_FIELD, str(prompt)) for prompt in prompts]

    def prepare(self, image: Any, index: int) -> Image.Image:
        """Sample `index`'s image as RGB, resized to image_size × image_size when that is set."""
        if not isinstance(image, Image.Image):
            raise UserInputError(
                f"reward {NAME!r} scores images, but batch item {index} is a {type(image).__name__}; "
                "score an image rollout"
            )
        image = image.convert("RGB")
        if self.image_size:
            image = image.resize((self.image_size, self.image_size))
        return image

    def _targets(self, prompts: Sequence[str], meta: Sequence[dict]) -> list[str | None]:
        if not self.preset.needs_target:
            return [None] * len(prompts)
        try:
            return [ocr_target(prompt, item) for prompt, item in zip(prompts, meta, strict=True)]
        except UserInputError as exc:
            raise UserInputError(str(exc).replace("reward 'ocr'", f"reward {NAME!r}", 1)) from None

    def _load_policy(self) -> Any:
        """The judge as a `VLMPolicy` on its device (eval mode, no gradients), loaded on first use."""
        from stages.dist import device as default_device
        from stages.models.factory import no_progress_bars
        from stages.models.vlm import VLMPolicy

        if self._policy is None:
            device = torch.device(self.device_name) if self.device_name else default_device()
            try:
                with no_progress_bars():
                    self._policy = VLMPolicy.load(self.model_path, device=device, dtype=self.dtype)
            except (OSError, ValueError) as exc:
                raise UserInputError(
                    f"reward {NAME!r}: cannot load a Qwen2.5-VL judge from {self.model_path}: "
                    f"{' '.join(str(exc).split())[:300]}"
                ) from exc
        return self._policy

    def _sources(self, meta: Sequence[dict], prompts: Sequence[str]) -> list[list[Image.Image]]:
        """Per sample, the images the judge sees before its result: the condition image for a preset
        `with_source` (checked to be there), none otherwise."""
        if not self.preset.with_source:
            return [[] for _ in meta]
        out = []
        for index, item in enumerate(meta):
            given = (item or {}).get(CONDITION_IMAGES) or []
            if len(given) != 1:
                raise UserInputError(
                    f"reward {NAME!r} (preset {self.preset_name}): batch item {index} (prompt {prompts[index]!r}) "
                    f"has {len(given)} condition images, the preset judges an edit of one source; score a "
                    "rollout of an editing model sampled from prompts with an 'image' column"
                )
            out.append([self.prepare(image, index) for image in given])
        return out

    @torch.inference_mode()
    def _ask_local(self, questions: list[str], images: list[list[Image.Image]]) -> list[str | None]:
        """Greedy answers of the local judge, `batch_size` samples per `generate` (left-padded); each
        question comes with its images (the source first for an edit, then the sample)."""
        answers: list[str | None] = []
        with self._lock:
            policy = self._load_policy()
            stops = torch.tensor(policy.stop_ids, device=policy.device)
            for start in range(0, len(questions), self.batch_size):
                chunk = slice(start, start + self.batch_size)
                prompt = policy.chat_inputs(questions[chunk], images[chunk])
                # Greedy with every logits processor explicit: a checkpoint's generation config (Qwen
                # ships a repetition penalty and sampling knobs) cannot change the answer.
                out = policy.model.generate(
                    **prompt,
                    do_sample=False,
                    temperature=None,
                    top_p=None,
                    top_k=None,
                    repetition_penalty=1.0,
                    suppress_tokens=policy.banned_ids or None,
                    max_new_tokens=self.max_tokens,
                    eos_token_id=policy.stop_ids,
                    pad_token_id=policy.pad_id,
                )
                response = out[:, prompt["input_ids"].shape[1] :]
                stop = torch.isin(response, stops).long()
                keep = (torch.cumsum(stop, dim=1) - stop) == 0  # up to and including the first stop
                response = response.masked_fill(~keep, policy.pad_id)
                answers.extend(policy.processor.tokenizer.batch_decode(response, skip_special_tokens=True))
        return answers

    def _request(self, body: dict[str, Any]) -> Any:
        """POST one chat completion, retrying a server failure `retries` times (1 s, 2 s, ... apart)."""
        from stages.sample.openai_engine import _request_json

        attempt = 0
        while True:
            try:
                return _request_json(
                    f"{self.url}/chat/completions",
                    body,
                    api_key=self._api_key,
                    timeout=self.timeout,
                    bad_reply=RuntimeFailure,
                )
            except RuntimeFailure as exc:
                if attempt == self.retries:
                    raise _reward_error(exc) from None
                delay = RETRY_BASE_DELAY_S * 2**attempt
                logger.warning(
                    "reward %r: %s (retry %d of %d in %g s)", NAME, exc, attempt + 1, self.retries, delay
                )
                time.sleep(delay)
                attempt += 1
            except OmnirlError as exc:
                raise _reward_error(exc) from None

    def _model_name(self) -> str:
        """`served_model`, checked against the server's model list (the only model when not given)."""
        from stages.sample.openai_engine import served_models

        if self._served is not None:
            return self._served
        try:
            names = served_models(self.url, api_key=self._api_key, timeout=min(self.timeout, 60.0))
        except OmnirlError as exc:
            raise _reward_error(exc) from None
        name = names[0] if self.served_model is None and len(names) == 1 else self.served_model
        if name not in names:
            raise UserInputError(
                f"reward {NAME!r}: {self.url}/models serves {', '.join(names) or 'no model'}; "
                f"pass one with --reward-arg {NAME}.served_model=NAME"
            )
        self._served = name
        return name

    def _ask_remote(self, questions: list[str], images: list[list[Image.Image]]) -> list[str | None]:
        """Greedy answers from the server, `batch_size` requests in flight; None where a reply has no text."""
        from stages.sample.openai_engine import NEUTRAL_SAMPLING, image_data_url

        model = self._model_name()

        def ask(index: int) -> str | None:
            where = f"reward {NAME!r}, batch item {index}"
            shown = [
                {"type": "image_url", "image_url": {"url": image_data_url(_png(image), where)}}
                for image in images[index]
            ]
            body = {
                "model": model,
                "messages": [
                    {"role": "user", "content": [*shown, {"type": "text", "text": questions[index]}]}
                ],
                "n": 1,
                "temperature": 0.0,
                "top_p": 1.0,
                **NEUTRAL_SAMPLING,
                "max_completion_tokens": self.max_tokens,
                "max_tokens": self.max_tokens,
                "seed": 0,
                "stream": False,
            }
            reply = self._request(body)
            try:
                content = reply["choices"][0]["message"]["content"]
            except (TypeError, KeyError, IndexError):
                raise RuntimeFailure(
                    f"reward {NAME!r}: {self.url}/chat/completions answered batch item {index} without "
                    "choices[0].message; check the server log"
                ) from None
            return content if isinstance(content, str) else None

        with ThreadPoolExecutor(max_workers=max(1, min(self.batch_size, len(questions)))) as pool:
            return list(pool.map(ask, range(len(questions))))

    def __call__(
        self, images: Sequence[Any], prompts: Sequence[str], meta: Sequence[dict]
    ) -> list[float | None]:
        """One reward per sample (see the preset); None where the answer does not parse."""
        targets = self._targets(prompts, meta)
        questions = self.questions(prompts)
        sources = self._sources(meta, prompts)
        prepared = [
            [*source, self.prepare(image, index)]
            for index, (image, source) in enumerate(zip(images, sources))
        ]
        if not prepared:
            return []
        ask = self._ask_local if self.model_path is not None else self._ask_remote
        answers = ask(questions, prepared)
        self.last_answers = answers
        scores: list[float | None] = []
        for index, (answer, target) in enumerate(zip(answers, targets, strict=True)):
            score = None if answer is None else self.preset.parse(answer, target)
            if score is None:
                logger.warning(
                    "reward %r (preset %s): cannot parse the answer to batch item %d (prompt %r): %r; scored None",
                    NAME,
                    self.preset_name,
                    index,
                    prompts[index],
                    answer if answer is None else answer[:500],
                )
            scores.append(score)
        return scores
