"""Vision-language and omni models (Qwen2.5-VL, Qwen3-VL dense and MoE, the Qwen3-Omni thinker) seen as
RL policies over response tokens.

A `VLMPolicy` builds chat inputs with the model's processor (for Qwen2.5-VL and Qwen3-VL always with
`mm_token_type_ids`, without which transformers 5 silently gives image tokens 1-D positions; the
thinker derives its positions from the ids, grids and audio lengths), samples responses with HF
`generate`, and scores response tokens under its current weights. The rollout log-probs come from the
raw logits `generate` returns, divided by the temperature (no top-p warping), exactly as the replay
computes them, so the two agree to float rounding (the replay is one full forward, the rollout an
incremental one with a KV cache).
"""

from __future__ import annotations

import inspect
import json
import re
import warnings
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from stages.dist import unwrap
from stages.errors import UserInputError
from stages.knobs import PACKING
from stages.models.diffusion import DTYPES
from stages.models.folders import (
    ADAPTER_CONFIG,
    PEFT_CONFIG,
    adapter_loading,
    check_adapter_layout,
    read_adapter_config,
)
from stages.models.hub import base_model_record
from stages.models.tokens import token_entropy, token_log_probs
from stages.models.vlm_families import (
    family_module,
    is_vlm_model,
    load_model,
    load_processor,
    model_type,
    understands,
)
from stages.models.vlm_inputs import chat_inputs, pack_inputs, response_inputs
from stages.safe_files import refuse_pickled_weights

# Vision markers a response must never contain: sampled into a response, an image pad token would
# make the model look for image features that do not exist. They are removed from the policy's
# distribution (at sampling and in every log-prob), as trl does after its issue #3847.
VISION_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")
# The audio markers of omni models, banned likewise (absent from a vision-only vocabulary).
AUDIO_TOKENS = ("<|audio_start|>", "<|audio_end|>", "<|audio_pad|>")
BANNED_LOGIT = -1e9

# LoRA targets: the language model's projections (in an MoE model the experts are fused tensors, so the
# attention projections); the vision and audio towers stay frozen unless asked.
TEXT_LORA_TARGETS = r".*language_model.*\.(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj)"
# The encoder towers' module names (Qwen2.5-VL: visual; Qwen3-Omni thinker: visual and audio_tower).
TOWERS = (".visual.", ".audio_tower.")


@dataclass
class Rollout:
    """Sampled responses for B prompts × n: ids/mask [B·n, T] (right-padded), log-probs [B·n, T], text."""

    prompt_index: list[int]
    response_ids: torch.Tensor
    response_mask: torch.Tensor
    log_probs: torch.Tensor
    text: list[str]


@dataclass
class ResponseForward:
    """One forward over prompt + response: log-probs [B, T], entropies [B, T] (or None) and, for an MoE
    model asked for them, each layer's router logits [B·L, E] over the attention mask [B, L]."""

    log_probs: torch.Tensor
    entropy: torch.Tensor | None = None
    router_logits: tuple[torch.Tensor, ...] | None = None
    attention_mask: torch.Tensor | None = None


@contextmanager
def _quiet_peft() -> Iterator[None]:
    """Silence the transformers deprecation notice PEFT triggers on every wrap, load and save."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        yield


class VLMPolicy:
    """A transformers VLM with its processor, as a token-level policy."""

    def __init__(self, model: Any, processor: Any, *, device: torch.device, model_path: str = ""):
        self.model = model
        self.processor = processor
        self.device = device
        self.model_path = model_path
        self.lora = bool(getattr(model, "peft_config", None))
        self._reference: torch.nn.Module | None = None
        self.packed = model is not None and self.can_pack and self.varlen_attention  # `use_packing("auto")`
        tok = processor.tokenizer
        self.pad_id = tok.pad_token_id
        self.banned_ids = sorted(
            {
                i
                for i in tok.convert_tokens_to_ids([*VISION_TOKENS, *AUDIO_TOKENS])
                if i is not None and i != tok.unk_token_id
            }
        )

    @property
    def module(self) -> torch.nn.Module:
        """The trained network (the whole VLM; `trainable_parameters` picks what moves)."""
        return unwrap(self.model)

    def gradient_checkpointing(self) -> None:
        """Recompute the language model's activations in the backward (transformers' checkpointing,
        non-reentrant so frozen embeddings under LoRA still pass gradients on)."""
        self.module.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})

    @classmethod
    def load(
        cls,
        model_dir: str | Path,
        *,
        adapter: str | Path | None = None,
        device: torch.device | str = "cpu",
        dtype: str = "fp32",
    ) -> VLMPolicy:
        """Load a VLM folder (`VLM_FAMILIES`; of a whole Qwen3-Omni folder only the thinker) and its
        processor from disk (no network), then an omnirl adapter.

        A LoRA adapter is a PEFT folder (`PeftModel.from_pretrained` loads it); a full one holds the
        whole fine-tuned model, loaded in place of the base weights.
        """
        model_dir = Path(model_dir)
        if not (model_dir / "config.json").is_file() and not understands(model_dir):
            raise UserInputError(f"--model {model_dir}: not a transformers model folder (no config.json)")
        if dtype not in DTYPES:
            raise UserInputError(f"--dtype {dtype}: choose one of {', '.join(DTYPES)}")
        refuse_pickled_weights(model_dir, "--model")
        config = read_adapter_config(adapter) if adapter else None
        if adapter:
            refuse_pickled_weights(adapter, "--adapter")
        if config:
            check_adapter_layout(adapter, config, lora_files=(PEFT_CONFIG,), full_file="config.json")
        full = bool(config and config["kind"] == "full")
        with adapter_loading(adapter, model_dir) if full else nullcontext():
            model = load_model(Path(adapter) if full else model_dir, DTYPES[dtype])
        if config and config["kind"] == "lora":
            from peft import PeftModel

            with _quiet_peft(), adapter_loading(adapter, model_dir):
                model = PeftModel.from_pretrained(model, str(adapter), is_trainable=True)
        model = model.to(device).eval()
        model.requires_grad_(False)
        return cls(model, load_processor(model_dir), device=torch.device(device), model_path=str(model_dir))

    def add_lora(self, *, rank: int = 16, alpha: int = 32, seed: int = 0) -> None:
        """Attach a fresh LoRA adapter to the language model (zero B: the policy starts unchanged)."""
        from peft import LoraConfig, get_peft_model

        # The regex is resolved to full module names here: PEFT rewrites a regex on MoE models whose
        # experts transformers 5 fused (Qwen3-Omni) into bare leaf names, which would also wrap the
        # audio tower's q/k/v projections.
        pattern = getattr(family_module(self.model_path), "LORA_TARGETS", TEXT_LORA_TARGETS)
        targets = [name for name, _ in self.model.named_modules() if re.fullmatch(pattern, name)]
        with torch.random.fork_rng(devices=[]), _quiet_peft():
            torch.manual_seed(seed)
            self.model = get_peft_model(
                self.model, LoraConfig(r=rank, lora_alpha=alpha, target_modules=targets)
            )
        self.lora = True

    def trainable_parameters(
        self, *, full: bool = False, train_vision: bool = False
    ) -> list[torch.nn.Parameter]:
        """Mark and return the trained weights: LoRA, or everything but (unless asked) the encoder towers
        (`TOWERS`: vision, and audio in omni models).
        They are cast to fp32 whatever --dtype (diffusers' `cast_training_params`), so the optimizer
        steps in fp32; --dtype stays the storage dtype of the frozen weights."""
        family = family_module(self.model_path)
        if full and not getattr(family, "TRAINS_FULL", True):
            raise UserInputError(
                f"--full: --model {self.model_path} ({model_type(self.model_path)}) trains a LoRA adapter only "
                "here; drop --full"
            )
        params, layers = [], set()
        for name, p in self.model.named_parameters():
            tower = any(t in f".{name}" for t in TOWERS)
            train = ("lora_" in name) if not full else (train_vision or not tower)
            p.requires_grad_(train)
            if train:
                p.data = p.data.float()
                params.append(p)
                layers.add(name.split(".lora_")[0])
        if not params:
            raise UserInputError("nothing to train: add a LoRA adapter or pass --full")
        # a family whose answers run through some modules only (BAGEL's understanding expert): a LoRA on
        # none of them (a generation-only adapter) would train nothing
        answering = getattr(family, "ANSWER_LORA", None)
        if not full and answering and not any(re.fullmatch(answering, layer) for layer in layers):
            raise UserInputError(
                f"--adapter: its LoRA has no layer an answer of --model {self.model_path} runs through (a "
                "generation-only adapter); start from an understanding update or without --adapter"
            )
        return params

    @property
    def stop_ids(self) -> list[int]:
        """Ids that end a response: the generation config's eos ids (Qwen: <|im_end|> and
        <|endoftext|>) and the tokenizer's eos."""
        ids = getattr(getattr(self.model, "generation_config", None), "eos_token_id", None)
        ids = ids if isinstance(ids, list) else [] if ids is None else [ids]
        return sorted({*ids, self.processor.tokenizer.eos_token_id})

    @classmethod
    def for_prompts(cls, model_dir: str | Path) -> VLMPolicy:
        """A weightless policy that only builds prompt inputs (remote engines sample; no model is loaded)."""
        return cls(None, load_processor(model_dir), device=torch.device("cpu"), model_path=str(model_dir))

    @contextmanager
    def reference(self) -> Iterator[None]:
        """Run the frozen base model inside the block (KL reference): LoRA switched off, or, after full
        fine-tuning, a frozen copy of the base weights loaded once from the model folder."""
        if self.lora:
            with self.model.disable_adapter():
                yield
            return
        if self._reference is None:
            self._reference = (
                load_model(self.model_path, next(self.model.parameters()).dtype)
                .to(self.device)
                .requires_grad_(False)
                .eval()
            )
        trained, self.model = self.model, self._reference
        try:
            yield
        finally:
            self.model = trained

    def save_adapter(
        self,
        out: Path,
        *,
        kind: str,
        extra: dict[str, Any],
        state: dict[str, torch.Tensor] | None = None,
    ) -> None:
        """Write the trained weights: a PEFT LoRA folder (`PeftModel.from_pretrained`, vLLM `--lora-modules`)
        or, for `full`, the whole model with its processor (`from_pretrained`, `vllm serve OUT`).

        state: the model's full state dict when it is sharded (gathered by the caller); None reads the
        model's own.
        """
        out.mkdir(parents=True, exist_ok=True)
        base = base_model_record(self.model_path)
        # adapter_config.json names a transformers base by absolute path, so `AutoPeftModelForCausalLM`
        # loads the adapter from any working directory (a BAGEL folder is none: PEFT would warn, on every
        # save and load, that it has no config.json)
        for peft_config in (getattr(self.module, "peft_config", None) or {}).values():
            peft_config.base_model_name_or_path = (
                base["base_model"] if is_vlm_model(self.model_path) else None
            )
        options = {} if state is None else {"state_dict": state}
        with _quiet_peft():
            self.module.save_pretrained(out, **options)
        if kind == "full":
            self.processor.save_pretrained(out)
        config = {"kind": kind, **base, **extra}
        (out / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2, sort_keys=True))

    def chat_inputs(
        self,
        prompts: Sequence[str | list[dict[str, Any]]],
        images: list[list[Any]],
        *,
        videos: list[list[Any]] | None = None,
        audios: list[list[Any]] | None = None,
    ) -> dict[str, torch.Tensor]:
        """`vlm_inputs.chat_inputs` of the prompts and their media by this policy's processor, on its device."""
        inputs = chat_inputs(
            self.processor,
            prompts,
            images,
            videos=videos,
            audios=audios,
            model_path=self.model_path,
            token_types=self._takes_token_types,
        )
        return {k: v.to(self.device) if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}

    @property
    def _takes_token_types(self) -> bool:
        """True for models whose forward needs `mm_token_type_ids` for 3-D positions (Qwen2.5-VL, Qwen3-VL; the
        Qwen3-Omni thinker derives them from the ids and grids; a weightless policy runs no forward)."""
        if self.model is None:
            return False
        return "mm_token_type_ids" in inspect.signature(type(self._base_model).forward).parameters

    @property
    def can_pack(self) -> bool:
        """True when the model's forward takes packed sequences: its M-RoPE positions come from the ids,
        token types and grids alone (`compute_3d_position_ids`: Qwen2.5-VL, Qwen3-VL), so they can be
        computed on the padded batch and packed with the tokens. The Qwen3-Omni thinker also needs its
        audio lengths there and is replayed padded."""
        inner = getattr(self._base_model, "model", None)
        return self._takes_token_types and hasattr(inner, "compute_3d_position_ids")

    @property
    def _base_model(self) -> Any:
        """The transformers model under any data-parallel or PEFT wrapper."""
        model = self.module
        return model.get_base_model() if hasattr(model, "get_base_model") else model

    @property
    def varlen_attention(self) -> bool:
        """True when the model attends with a variable-length kernel (transformers' flash-attention paths,
        which take each sequence's start from the restarting position ids), so a packed row costs the
        sum of its sequences' L². The others (sdpa, eager) attend over a dense N × N mask of the packed
        row: more work than the padded batch's B × L², so packing does not pay there."""
        return "flash" in str(getattr(self._base_model.config, "_attn_implementation", "") or "")

    def use_packing(self, mode: str) -> None:
        """--packing: `on` packs every forward over prompt + response (refused, one line, for a model that
        cannot), `off` pads, `auto` (the default) packs where the model can and attends with a
        variable-length kernel (`varlen_attention`)."""
        if mode not in PACKING:
            raise UserInputError(f"--packing {mode}: choose one of {', '.join(PACKING)}")
        if mode == "on" and not self.can_pack:
            raise UserInputError(
                f"--packing on: --model {self.model_path} ({model_type(self.model_path)}) does not take packed "
                "sequences (only Qwen2.5-VL and Qwen3-VL do); use --packing auto or off"
            )
        self.packed = self.can_pack and (mode == "on" or (mode == "auto" and self.varlen_attention))

    def response_log_probs(
        self,
        prompt: dict[str, torch.Tensor],
        response_ids: torch.Tensor,
        response_mask: torch.Tensor,
        temperature: float = 1.0,
    ) -> torch.Tensor:
        """log π(response tokens) [B, T] in one forward over prompt + response (grad follows the caller)."""
        return self.response_stats(prompt, response_ids, response_mask, temperature)[0]

    def response_stats(
        self,
        prompt: dict[str, torch.Tensor],
        response_ids: torch.Tensor,
        response_mask: torch.Tensor,
        temperature: float = 1.0,
        entropy: bool = False,
        entropy_grad: bool = True,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Log-probs of the response tokens [B, T] and, with `entropy`, each token distribution's
        entropy [B, T] (None otherwise). With gradient it keeps several [B, T, V] buffers for the
        backward, so a caller that only logs it passes `entropy_grad=False`."""
        out = self.response_forward(prompt, response_ids, response_mask, temperature, entropy, entropy_grad)
        return out.log_probs, out.entropy

    @property
    def moe(self) -> bool:
        """True for a mixture-of-experts language model (the Qwen3-Omni thinker), whose forward can
        return its router logits."""
        config = self.module.config
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        return int(getattr(text, "num_experts", 0) or 0) > 0

    def response_forward(
        self,
        prompt: dict[str, torch.Tensor],
        response_ids: torch.Tensor,
        response_mask: torch.Tensor,
        temperature: float = 1.0,
        entropy: bool = False,
        entropy_grad: bool = True,
        router: bool = False,
    ) -> ResponseForward:
        """`response_stats` in one forward over prompt + response, plus, with `router` (MoE models), the
        router logits of every layer and the attention mask they are over (`ResponseForward`).

        Packed (`packed`, `vlm_inputs.pack_inputs`), the forward runs over the real tokens only, one row of N = Σ lengths
        instead of B × (prompt + response width): the same values to float rounding; less compute and
        memory wherever lengths differ under a variable-length attention kernel (`varlen_attention`)."""
        inputs = response_inputs(prompt, response_ids, response_mask)
        b, t = response_ids.shape
        routing = {"output_router_logits": True} if router else {}
        mask = inputs["attention_mask"]
        if self.packed:  # packed: the logits of the positions predicting response tokens, picked by index
            packed, index = pack_inputs(self._base_model.model, inputs, t)
            # no KV cache: transformers derives the block-diagonal mask only for a forward without one
            out = self.model(**packed, logits_to_keep=index, use_cache=False, **routing)
            aligned = self.allowed(out.logits.view(b, t, -1))
            mask = torch.ones_like(packed["input_ids"])
        else:
            out = self.model(**inputs, logits_to_keep=t + 1, **routing)
            # logits only where a response token is predicted: the last prompt position onwards (a model
            # that ignores logits_to_keep, as the Qwen3-Omni thinker does, returns them all)
            aligned = self.allowed(out.logits[:, -(t + 1) : -1])
        logp = token_log_probs(aligned, response_ids, temperature)
        ent = None
        if entropy and not entropy_grad:
            with torch.no_grad():
                ent = token_entropy(aligned.detach(), temperature)
        elif entropy:
            ent = token_entropy(aligned, temperature)
        logits = tuple(out.router_logits) if router else None
        return ResponseForward(logp, ent, logits, mask if router else None)

    def allowed(self, logits: torch.Tensor) -> torch.Tensor:
        """Logits [..., V] with the vision markers (`VISION_TOKENS`) pushed to a finite −1e9, so they get
        zero probability (and the entropy stays finite)."""
        if not self.banned_ids:
            return logits
        index = torch.tensor(self.banned_ids, device=logits.device)
        return logits.index_fill(-1, index, BANNED_LOGIT)

    @torch.no_grad()
    def generate(
        self,
        prompt: dict[str, torch.Tensor],
        *,
        n: int,
        temperature: float = 1.0,
        top_p: float = 1.0,
        max_new_tokens: int = 64,
        seed: int = 0,
    ) -> Rollout:
        """n responses per prompt; log-probs from the raw logits / temperature of each sampled token
        (vision markers excluded, no top-p warping, which only shapes which tokens get drawn).

        A response ends at its first stop token (`stop_ids`), which it keeps; the rest is padding.
        """
        batch = prompt["input_ids"].shape[0]
        per_prompt = n
        # The thinker's audio clips and videos: `generate` would repeat clips one by one, not per prompt,
        # and videos not at all (its placeholders would outnumber their features).
        if "input_features" in prompt or "video_second_per_grid" in prompt:
            from stages.models.qwen3_omni import repeat_prompts

            prompt, per_prompt = repeat_prompts(prompt, n, self.module.config), 1
        torch.manual_seed(seed)
        # Every sampling knob is explicit, so a checkpoint's generation_config (Qwen ships top_k,
        # repetition_penalty) cannot change the distribution the log-probs describe.
        out = self.model.generate(
            **prompt,
            num_return_sequences=per_prompt,  # the images are encoded once per prompt, not per response
            do_sample=True,
            temperature=temperature,
            top_p=top_p,
            top_k=0,
            repetition_penalty=1.0,
            suppress_tokens=self.banned_ids or None,
            max_new_tokens=max_new_tokens,
            output_logits=True,
            return_dict_in_generate=True,
            pad_token_id=self.pad_id,
        )
        prompt_len = prompt["input_ids"].shape[1]
        response = out.sequences[:, prompt_len:]
        stop = torch.isin(response, torch.tensor(self.stop_ids, device=response.device)).long()
        mask = (torch.cumsum(stop, dim=1) - stop) == 0  # tokens up to and including the first stop token
        response = torch.where(mask, response, torch.full_like(response, self.pad_id))
        logits = self.allowed(torch.stack(out.logits, dim=1).float())
        log_probs = torch.where(mask, token_log_probs(logits, response, temperature), torch.zeros(()))
        text = self.processor.tokenizer.batch_decode(
            response.masked_fill(~mask, self.pad_id), skip_special_tokens=True
        )
        index = [b for b in range(batch) for _ in range(n)]
        return Rollout(index, response, mask, log_probs, text)
