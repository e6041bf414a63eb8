"""Prompt conditioning stored once per rollout, so that the stages after `sample` load no text encoder.

`sample` writes, beside each shard, `conditioning-SSSSS-of-NNNNN.safetensors`: what the family adapter's
`encode_prompts` gave for every unique (prompt, negative prompt, max length, condition images) of that
shard (the images named by their digest, `stages.models.condition_images`; an editing model's
conditioning holds what it encodes of them, e.g. their VAE latents), both CFG
branches (embeddings, pooled embeddings, masks; tensors without a batch dim, as `FlowPolicy` caches
them), bit for bit. The rollout's manifest, written last, lists the files (bytes, sha256) under
`extra["conditioning"]` with the encoder identity: the pipeline class, the content digest of every text
encoder and tokenizer folder, the max sequence length and the weights dtype. `logprob` and `update` read
it (`stored_conditioning`) and load the pipeline without text encoders and tokenizers
(`FlowPolicy.load(conditioning=...)`); a rollout without it is encoded as before.
Safetensors only: nothing is unpickled.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from stages.errors import UserInputError

CONDITIONING = "conditioning"  # the rollout manifest's extra key
METADATA = "omnirl_conditioning"  # the safetensors metadata key of a conditioning file's entries and run
# model_index.json components that turn prompts into conditioning (SD3: text_encoder_3, tokenizer_3, ...;
# Qwen-Image-Edit: its processor)
# (prompt, negative prompt, max sequence length, condition images' digest ("" for none)): the key
# `FlowPolicy.encode` caches a prompt under
Key = tuple[str, str, int, str]
# per key the (positive, negative) branch: name → tensor without a batch dim
Entries = dict[Key, tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]]


def encoder_identity(model: str | Path, dtype: str, max_sequence_length: int) -> dict[str, Any]:
    """What makes stored conditioning valid for a run: the pipeline class, the content digest of each text
    encoder and tokenizer folder of `model` (its family's `encoder_files`), the text length and the weights dtype (e.g. "bf16")."""
    from stages.models.families import adapter_class
    from stages.models.folders import pipeline_index
    from stages.shards.digest import content_digest

    index = pipeline_index(model)
    family = adapter_class(index["_class_name"], str(model))
    return {
        "pipeline": index["_class_name"],
        "components": {
            name: content_digest(Path(model) / name, "--model")
            for name in family.encoder_files(Path(model), index)
        },
        "max_sequence_length": int(max_sequence_length),
        "dtype": dtype,
    }


def conditioning_file(shard: int, num_shards: int) -> str:
    """The file name of shard `shard`'s conditioning (not a `part-*` name: the shard writer owns those)."""
    return f"conditioning-{shard:05d}-of-{num_shards:05d}.safetensors"


def to_bytes(entries: Entries, run: str = "") -> bytes:
    """`entries` as the bytes of a safetensors file: tensor `<i>.<pos|neg>.<name>`, and in the metadata
    each entry's key and branch names (a branch may be empty: FLUX.1 has no negative) and `run` (the
    writing run's content id, so a file left by another run is never listed). Also how `online`'s
    sampler hands its conditioning to the trainer."""
    from safetensors.torch import save

    tensors: dict[str, torch.Tensor] = {}
    listed = []
    for i, ((prompt, negative, length, images), branches) in enumerate(entries.items()):
        names = []
        for branch, values in zip(("pos", "neg"), branches, strict=True):
            names.append(sorted(values))
            for name, value in values.items():
                tensors[f"{i}.{branch}.{name}"] = value.detach().to("cpu").contiguous()
        entry = {"prompt": prompt, "negative": negative, "max_sequence_length": length, "names": names}
        listed.append({**entry, "images": images} if images else entry)
    # one metadata key: safetensors writes several in a random order, and equal runs give equal bytes
    return save(tensors, metadata={METADATA: json.dumps({"entries": listed, "run": run}, sort_keys=True)})


def from_bytes(data: bytes) -> Entries:
    """The entries of `to_bytes`'s output."""
    from safetensors.torch import load

    tensors = load(data)
    entries: Entries = {}
    for i, entry in enumerate(_metadata(data)["entries"]):
        key = (entry["prompt"], entry["negative"], int(entry["max_sequence_length"]), entry.get("images", ""))
        pos, neg = (
            {name: tensors[f"{i}.{branch}.{name}"] for name in names}
            for branch, names in zip(("pos", "neg"), entry["names"], strict=True)
        )
        entries[key] = (pos, neg)
    return entries


def write_conditioning(path: Path, entries: Entries, run: str) -> None:
    """Write `entries` of run `run` to `path` atomically (`to_bytes`), removing what a killed writer of
    it left (as the shard writer does for its shards)."""
    from stages.shards.atomic import atomic_write_bytes, remove_stale_temps

    remove_stale_temps(path)
    atomic_write_bytes(path, to_bytes(entries, run))


def _metadata(data: bytes) -> dict[str, Any]:
    """The entries and run of `to_bytes`'s output, from its safetensors header (an 8-byte length, then
    JSON); ValueError (or KeyError) when the bytes are not such a file."""
    size = int.from_bytes(data[:8], "little")
    if len(data) < 8 + size:
        raise ValueError("truncated safetensors header")
    metadata = json.loads(data[8 : 8 + size]).get("__metadata__") or {}
    return json.loads(metadata[METADATA])


def conditioning_record(
    out_dir: Path, num_shards: int, run: str, *, model: str | Path, dtype: str, max_sequence_length: int
) -> dict[str, Any] | None:
    """The manifest's `extra["conditioning"]` for a finished rollout in `out_dir` sampled from `model`: the
    encoder identity (`encoder_identity`) and every shard's file (name, bytes, sha256). None when a shard
    has no file of this run `run` (an engine that returns none, or a shard resumed from a run that stored
    none): such a rollout is encoded downstream, as an older one, and the encoders are never hashed."""
    files = []
    for shard in range(num_shards):
        path = out_dir / conditioning_file(shard, num_shards)
        try:
            data = path.read_bytes()
            if _metadata(data)["run"] != run:
                return None
        except (OSError, ValueError, KeyError):  # missing, or not a conditioning file: not this run's
            return None
        files.append({"file": path.name, "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()})
    identity = encoder_identity(model, dtype, max_sequence_length)
    return {CONDITIONING: {"identity": identity, "files": files}}


def _encoder(identity: dict[str, Any]) -> dict[str, Any]:
    """What of an identity names the encoder (all but the dtype, which only decides whether to re-encode)."""
    return {k: v for k, v in identity.items() if k != "dtype"}


def _describe(identity: dict[str, Any]) -> str:
    digests = ", ".join(f"{name} {digest[:12]}" for name, digest in sorted(identity["components"].items()))
    return f"{identity['pipeline']} ({digests}), max length {identity['max_sequence_length']}"


def stored_conditioning(
    paths: Sequence[Path], manifests: Sequence[Any], identity: dict[str, Any]
) -> tuple[Entries | None, str]:
    """The stored conditioning of the rollout among zipped inputs (`paths` and their `manifests`), read
    and checked against this run's encoder `identity`, with how the run gets its conditioning: "stored",
    or why it encodes the prompts itself ("encoded: ..."), for a rollout without stored conditioning or one
    stored at another --dtype (re-encoding gives today's numbers). A stored conditioning of another
    pipeline, text encoder, tokenizer or max length is a one-line UserInputError naming both; a file that
    does not match the manifest's sha256 is one too."""
    found = next(
        (
            (Path(p), m.extra[CONDITIONING])
            for p, m in zip(paths, manifests)
            if CONDITIONING in (m.extra or {})
        ),
        None,
    )
    if found is None:
        return None, "encoded: the rollout stores no conditioning"
    folder, record = found
    stored = record["identity"]
    if _encoder(stored) != _encoder(identity):
        raise UserInputError(
            f"--in {folder}: its stored conditioning was made by {_describe(stored)}, but --model has "
            f"{_describe(identity)}; pass the --model the rollout was sampled with, or sample again"
        )
    if stored["dtype"] != identity["dtype"]:
        return (
            None,
            f"encoded: the rollout stored it at {stored['dtype']}, this run's --dtype is {identity['dtype']}",
        )
    entries: Entries = {}
    for info in record["files"]:
        path = folder / Path(info["file"]).name
        try:
            data = path.read_bytes()
        except OSError:
            data = b""
        if hashlib.sha256(data).hexdigest() != info["sha256"]:
            raise UserInputError(
                f"--in {folder}: {path.name} is missing or does not match its manifest sha256; sample the "
                "rollout again into a new --out"
            )
        entries.update(from_bytes(data))
    return entries, "stored"
