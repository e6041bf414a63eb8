"""BAGEL's understanding as a VLM family of the token stages (`stages.models.vlm_families.VLM_FAMILIES["bagel"]`):
`sample --understand`, `logprob` and `update --algo grpo` answer questions about images with the
understanding expert, through `VLMPolicy` like any transformers VLM.

A prompt is BAGEL's interleaved context, which has no roles: each text part of the chat messages is one
`<|im_start|>` text `<|im_end|>` chunk, each image part one `<|vision_start|>` ViT tokens
`<|vision_end|>` chunk (full attention within, one RoPE position), and the answer starts after a last
`<|im_start|>` and ends at `<|im_end|>`, as the reference's understanding inference lays it out. The
processor writes one `<|image_pad|>` per ViT token, which the model's forward fills with the image's
tokens (`Bagel.vit_tokens`); its logits equal `Bagel.understanding_logits` of the same pieces.
LoRA layers go on both experts' projections (`LORA_TARGETS`): an answer trains the understanding
expert's, never reaching the generation expert's, which a generation update trains from the same folder
(UniGRPO, recipes/unigrpo.mk); the ViT, the connector, the embeddings and the head stay frozen.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
from transformers.modeling_outputs import CausalLMOutputWithPast

from stages.errors import UserInputError
from stages.models.bagel_folder import BOS, EOS, IMAGE_END, IMAGE_START, VIT_CONFIG, WEIGHTS, load_bagel
from stages.models.bagel_layers import Context, patchify
from stages.models.bagel_model import Bagel

IMAGE_PAD = "<|image_pad|>"
# Both experts' attention projections and MLPs: understanding trains the understanding expert's (the
# generation expert sees no token of it, so its LoRA stays zero), and the one PEFT folder also holds the
# generation expert's layers, which a generation update (`BagelAdapter`) trains from the same folder:
# one policy for both kinds (UniGRPO, docs/families.md).
LORA_TARGETS = (
    r".*language_model.*\.(self_attn\.(q|k|v|o)_proj(_moe_gen)?|mlp(_moe_gen)?\.(gate|up|down)_proj)"
)
# The understanding expert's layers, which an answer runs through: a LoRA on none of them trains nothing.
ANSWER_LORA = r".*language_model.*\.(self_attn\.(q|k|v|o)_proj|mlp\.(gate|up|down)_proj)"
# `--full` is not offered: its adapter would be a whole BAGEL folder, which `export` writes from a LoRA
TRAINS_FULL = False
# The shortest side BAGEL's ViT transform resizes an image to (at most the position table's side).
MIN_SIDE = 224


class BagelProcessor:
    """Chat messages and images → BAGEL's understanding inputs: `input_ids`/`attention_mask` [B, L]
    (left-padded), and with images `pixel_values` [P, 3·14·14] (every image's patches, in order) and
    `image_grid` [images, 2] (each one's patch rows and columns)."""

    def __init__(self, tokenizer: Any, *, patch: int, max_side: int) -> None:
        self.tokenizer, self.patch, self.max_side = tokenizer, patch, max_side

    def apply_chat_template(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, tokenize: bool = False
    ) -> str:
        """The context as text (module docstring), one `<|image_pad|>` per image until `__call__`."""
        chunks = []
        for message in messages:
            content = message["content"]
            for part in [{"type": "text", "text": content}] if isinstance(content, str) else content:
                if part.get("type") == "image":
                    chunks.append(f"{IMAGE_START}{IMAGE_PAD}{IMAGE_END}")
                elif part.get("type") == "text":
                    chunks.append(f"{BOS}{part['text']}{EOS}")
        return "".join(chunks) + (BOS if add_generation_prompt else "")

    def image_patches(self, image: Any) -> tuple[torch.Tensor, tuple[int, int]]:
        """A PIL image → its patches [h·w, 3·p·p] in [−1, 1] and grid (h, w): resized (bicubic) so its long
        side is at most the position table's, its short side at least `MIN_SIDE` where that fits, each
        side a multiple of the patch."""
        from PIL import Image

        image = image.convert("RGB")
        width, height = image.size
        scale = min(1.0, self.max_side / max(width, height))
        scale = max(scale, min(MIN_SIDE, self.max_side) / min(width, height))
        sides = [
            min(self.max_side, max(self.patch, round(s * scale / self.patch) * self.patch))
            for s in (width, height)
        ]
        image = image.resize(tuple(sides), Image.Resampling.BICUBIC)
        data = torch.frombuffer(bytearray(image.tobytes()), dtype=torch.uint8)
        pixels = data.view(sides[1], sides[0], 3).permute(2, 0, 1).float() / 127.5 - 1.0
        return patchify(pixels, self.patch), (sides[1] // self.patch, sides[0] // self.patch)

    def __call__(
        self, text: list[str], images: list[Any] | None = None, padding_side: str = "left", **_: Any
    ) -> dict[str, torch.Tensor]:
        """Tokenised texts, each `<|image_pad|>` widened to its image's token count (images in order)."""
        pending = list(images or [])
        patches, grids, rows = [], [], []
        for t in text:
            pieces = t.split(IMAGE_PAD)
            ids = self.tokenizer.encode(pieces[0], add_special_tokens=False)
            for piece in pieces[1:]:
                if not pending:
                    raise UserInputError(f"more image parts than images ({len(images or [])})")
                image_patches, grid = self.image_patches(pending.pop(0))
                patches.append(image_patches)
                grids.append(grid)
                ids += [self.tokenizer.convert_tokens_to_ids(IMAGE_PAD)] * (grid[0] * grid[1])
                ids += self.tokenizer.encode(piece, add_special_tokens=False)
            rows.append(ids)
        width = max(len(r) for r in rows)
        pad = self.tokenizer.pad_token_id
        fill = [[pad] * (width - len(r)) for r in rows]
        left = padding_side == "left"
        out = {
            "input_ids": torch.tensor([f + r if left else r + f for r, f in zip(rows, fill)]),
            "attention_mask": torch.tensor(
                [
                    [0] * len(f) + [1] * len(r) if left else [1] * len(r) + [0] * len(f)
                    for r, f in zip(rows, fill)
                ]
            ),
        }
        if patches:
            out["pixel_values"] = torch.cat(patches)
            out["image_grid"] = torch.tensor(grids)
        return out


class BagelForUnderstanding(Bagel):
    """`Bagel` with the interface `VLMPolicy` drives a transformers VLM by: `forward` over token ids and
    images returning `.logits`, `generate` with raw per-step logits, and `generation_config`."""

    image_pad_id: int = -1  # set by `load_model` from the tokenizer

    @property
    def generation_config(self) -> Any:
        """A response ends at `<|im_end|>`."""
        return SimpleNamespace(eos_token_id=[self.config.prompt_ends[1]])

    def gradient_checkpointing_enable(
        self, gradient_checkpointing_kwargs: dict[str, Any] | None = None
    ) -> None:
        """Recompute each language-model layer in the backward (always non-reentrant)."""
        self.language_model.checkpointing = True

    def _layout(self, ids: torch.Tensor, valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """RoPE positions [B, L] (one a text token, one an image chunk) and the attention mask [B, 1, L, L]:
        causal over valid tokens, full within each image chunk; a padded row attends to itself."""
        start, end = self.config.image_markers
        inner = (ids == end) | (ids == self.image_pad_id)
        image = inner | (ids == start)
        positions = ((valid & ~inner).long().cumsum(1) - 1).clamp(min=0)
        chunk = torch.where(image, (ids == start).long().cumsum(1), -1)
        length = ids.shape[1]
        causal = torch.ones(length, length, dtype=torch.bool, device=ids.device).tril()
        same = image[:, :, None] & (chunk[:, :, None] == chunk[:, None, :])
        eye = torch.eye(length, dtype=torch.bool, device=ids.device)
        return positions, (((causal | same) & valid[:, None, :]) | eye)[:, None]

    def _embed_inputs(
        self, ids: torch.Tensor, pixel_values: torch.Tensor | None, image_grid: torch.Tensor | None
    ) -> torch.Tensor:
        """Token embeddings [B, L, hidden], each image's ViT tokens in place of its `<|image_pad|>`s."""
        x = self._embed(ids)
        if pixel_values is None:
            return x
        grids = [tuple(g) for g in image_grid.tolist()]
        parts = pixel_values.split([h * w for h, w in grids])
        tokens = torch.cat([self.vit_tokens(p, g) for p, g in zip(parts, grids, strict=True)])
        slots = ids == self.image_pad_id
        if int(slots.sum()) != tokens.shape[0]:
            raise UserInputError(
                f"{int(slots.sum())} image placeholder tokens for {tokens.shape[0]} image tokens"
            )
        return x.masked_scatter(slots[..., None], tokens.to(x.dtype))

    def forward(  # type: ignore[override]
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        pixel_values: torch.Tensor | None = None,
        image_grid: torch.Tensor | None = None,
        logits_to_keep: int = 0,
        **_: Any,
    ) -> CausalLMOutputWithPast:
        """Next-token logits [B, L, vocab] (the last `logits_to_keep` positions; 0: all) of one forward, as a
        transformers output (a dict, which a data-parallel wrapper searches for the graph's tensors)."""
        valid = attention_mask.bool()
        positions, mask = self._layout(input_ids, valid)
        x = self._embed_inputs(input_ids, pixel_values, image_grid)
        gen = torch.zeros_like(valid)
        hidden, _ = self.language_model(x, gen, positions, mask)
        return CausalLMOutputWithPast(logits=self.language_model.lm_head(hidden[:, -logits_to_keep:]))

    @torch.no_grad()
    def generate(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        pixel_values: torch.Tensor | None = None,
        image_grid: torch.Tensor | None = None,
        *,
        num_return_sequences: int = 1,
        do_sample: bool = True,
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int | None = 0,
        repetition_penalty: float = 1.0,
        suppress_tokens: list[int] | None = None,
        max_new_tokens: int = 64,
        pad_token_id: int = 0,
        **_: Any,
    ) -> SimpleNamespace:
        """Sample `num_return_sequences` responses per row with a KV cache (the images encoded once per
        row): `.sequences` [B·n, L + T] and `.logits`, the raw logits [B·n, vocab] of each step (T of
        them), as transformers' `generate(output_logits=True, return_dict_in_generate=True)` gives."""
        if top_k or repetition_penalty != 1.0:
            raise ValueError("BAGEL's generate takes no top_k or repetition_penalty")
        n = num_return_sequences
        x = self._embed_inputs(input_ids, pixel_values, image_grid).repeat_interleave(n, 0)
        ids, valid = input_ids.repeat_interleave(n, 0), attention_mask.bool().repeat_interleave(n, 0)
        positions, mask = self._layout(ids, valid)
        gen = torch.zeros_like(valid)
        hidden, kvs = self.language_model(x, gen, positions, mask)
        context = Context([k for k, _ in kvs], [v for _, v in kvs], valid, valid.sum(1))
        stops = torch.tensor(self.generation_config.eos_token_id, device=ids.device)
        done = torch.zeros(ids.shape[0], dtype=torch.bool, device=ids.device)
        position = positions[:, -1:]
        tokens, logits = [], []
        for _ in range(max_new_tokens):
            raw = self.language_model.lm_head(hidden[:, -1])
            logits.append(raw)
            token = _draw(raw.float(), temperature, top_p, suppress_tokens, do_sample)
            token = torch.where(done, torch.full_like(token, pad_token_id), token)
            tokens.append(token)
            done |= torch.isin(token, stops)
            if bool(done.all()):
                break
            position = position + 1
            context.valid = torch.cat([context.valid, torch.ones_like(done[:, None])], 1)
            hidden, kvs = self.language_model(
                self._embed(token[:, None]), gen[:, :1], position, context.valid[:, None, None], context
            )
            context.keys = [torch.cat([k, new], 2) for k, (new, _) in zip(context.keys, kvs, strict=True)]
            context.values = [torch.cat([v, new], 2) for v, (_, new) in zip(context.values, kvs, strict=True)]
        return SimpleNamespace(sequences=torch.cat([ids, torch.stack(tokens, 1)], 1), logits=tuple(logits))


def _draw(
    logits: torch.Tensor, temperature: float, top_p: float, suppress: list[int] | None, sample: bool
) -> torch.Tensor:
    """A token per row [B] of logits [B, V]: softmax(logits / temperature) without the suppressed ids,
    cut to the smallest set of top tokens holding `top_p` of the mass, sampled (or the argmax)."""
    scores = logits / temperature
    if suppress:
        scores[:, suppress] = -math.inf
    if top_p < 1.0:
        ordered, order = scores.sort(dim=-1, descending=True)
        before = ordered.softmax(-1).cumsum(-1) - ordered.softmax(-1)  # mass of the better tokens
        scores = scores.scatter(-1, order, ordered.masked_fill(before >= top_p, -math.inf))
    if not sample:
        return scores.argmax(-1)
    return torch.multinomial(scores.softmax(-1), 1)[:, 0]


def load_model(model_dir: str | Path, dtype: torch.dtype) -> BagelForUnderstanding:
    """A BAGEL folder's model for understanding (the whole released model; `load_bagel`)."""
    model, tokenizer = load_bagel(model_dir, dtype, cls=BagelForUnderstanding)
    model.image_pad_id = tokenizer.convert_tokens_to_ids(IMAGE_PAD)
    return model


def load_processor(model_dir: str | Path) -> BagelProcessor:
    """A BAGEL folder's processor: its tokenizer, the ViT's patch from `vit_config.json` and the largest
    side its position table covers (read from the weights' header alone)."""
    from safetensors import safe_open
    from transformers import AutoTokenizer

    folder = Path(model_dir)
    try:
        patch = int(json.loads((folder / VIT_CONFIG).read_text())["patch_size"])
        with safe_open(str(folder / WEIGHTS), framework="pt") as f:
            side = math.isqrt(f.get_slice("vit_pos_embed.pos_embed").get_shape()[0])
    except (OSError, KeyError, ValueError) as error:
        raise UserInputError(f"--model {folder}: not a readable BAGEL folder ({error})") from None
    return BagelProcessor(AutoTokenizer.from_pretrained(folder), patch=patch, max_side=side * patch)
