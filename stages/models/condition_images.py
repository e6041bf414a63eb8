"""Condition images: the source image(s) of an editing prompt, from the prompt table to the policy.

Prompt tables. A row's `image` column holds one condition image, `images` a list of them (several
references, Qwen-Image-Edit Plus); each is a path relative to the table (or absolute), the file's bytes,
or a `datasets` Image struct {bytes, path}, so every prompt source (`stages.sample.sources`: files,
folders, saved and Hub datasets) carries them. `row_images` reads them as encoded files and checks that
each decodes, naming the row.

The policy. The family adapter receives each prompt's images as PIL images when it encodes the prompt
(`FamilyAdapter.encode_prompts`); `images_digest` names them in the prompt cache's key, so one prompt
text over two source images is two conditionings (`stages.models.conditioning.Key`).

The rollout. `sample` writes beside each shard `condition-images-SSSSS-of-NNNNN.parquet`: one row per
prompt group (not per sample), columns `group_id` and `images` (a list of the `datasets` Image feature,
so `datasets.load_dataset("parquet", data_files=...)` gives PIL images), listed in the manifest's
`extra["condition_images"]` (bytes, sha256). `logprob`, `update` and `online` look a row's images up by its
group id (`stored_condition_images`) and rebuild the model's image conditioning from them.
"""

from __future__ import annotations

import hashlib
import io
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from stages.errors import UserInputError
from stages.tables import image_bytes

IMAGE_COLUMN = "image"  # one condition image per row
IMAGES_COLUMN = "images"  # several (reference images)
COLUMNS = (IMAGE_COLUMN, IMAGES_COLUMN)
RECORD = "condition_images"  # the rollout manifest's extra key
_RUN_KEY = b"omnirl_run"
# the `datasets` features of a condition-images file: group_id, and a list of Image
_FEATURES = {
    "info": {
        "features": {
            "group_id": {"dtype": "string", "_type": "Value"},
            "images": {"feature": {"_type": "Image"}, "_type": "List"},
        }
    }
}


def decode_images(images: Sequence[bytes], where: str) -> list[Any]:
    """Encoded image files → RGB PIL images; an unreadable one is a one-line error naming `where`."""
    from PIL import Image

    decoded = []
    for k, blob in enumerate(images):
        try:
            with Image.open(io.BytesIO(blob)) as image:
                decoded.append(image.convert("RGB"))
        except Exception:
            raise UserInputError(
                f"{where}: condition image {k} is not a readable image file (PNG, JPEG, WebP ...); fix or "
                "replace it"
            ) from None
    return decoded


def row_images(record: Mapping[str, Any], base: Path, where: str) -> list[bytes]:
    """The condition images of a prompt row (`image` or `images`; none when both are absent or null) as
    encoded files; paths resolve against `base` (the table's folder). Each must decode."""
    present = [c for c in COLUMNS if record.get(c) is not None]
    if len(present) > 1:
        raise UserInputError(
            f"{where}: both columns '{IMAGE_COLUMN}' and '{IMAGES_COLUMN}' are set; give one condition image in "
            f"'{IMAGE_COLUMN}' or a list in '{IMAGES_COLUMN}'"
        )
    if not present:
        return []
    value = record[present[0]]
    if present[0] == IMAGES_COLUMN:
        if hasattr(value, "tolist") and not isinstance(value, (bytes, bytearray)):
            value = value.tolist()
        if not isinstance(value, (list, tuple)):
            raise UserInputError(f"{where}: column '{IMAGES_COLUMN}' must hold a list of images per row")
        values = list(value)
    else:
        values = [value]
    blobs = [image_bytes(v, base, f"{where}, column '{present[0]}'") for v in values]
    decode_images(blobs, f"{where}, column '{present[0]}'")
    return blobs


def images_digest(images: Sequence[bytes]) -> str:
    """sha256 naming an ordered list of encoded images ("" for none: a text-only prompt)."""
    if not images:
        return ""
    h = hashlib.sha256()
    for blob in images:
        h.update(len(blob).to_bytes(8, "little") + bytes(blob))
    return h.hexdigest()


def condition_images_file(shard: int, num_shards: int) -> str:
    """The file name of shard `shard`'s condition images (not a `part-*` name: the shard writer owns those)."""
    return f"condition-images-{shard:05d}-of-{num_shards:05d}.parquet"


def to_parquet(groups: Mapping[str, Sequence[bytes]], run: str) -> bytes:
    """One row per group (`group_id`, `images` as the `datasets` Image feature) as Parquet bytes, the
    writing run's content id `run` in the schema metadata."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    image = pa.struct([("bytes", pa.binary()), ("path", pa.string())])
    schema = pa.schema([("group_id", pa.string()), ("images", pa.list_(image))]).with_metadata(
        {b"huggingface": json.dumps(_FEATURES).encode(), _RUN_KEY: run.encode()}
    )
    table = pa.table(
        {
            "group_id": list(groups),
            "images": [[{"bytes": bytes(b), "path": None} for b in images] for images in groups.values()],
        },
        schema=schema,
    )
    sink = io.BytesIO()
    pq.write_table(table, sink, compression="zstd")
    return sink.getvalue()


def from_parquet(data: bytes) -> tuple[dict[str, list[bytes]], str]:
    """The groups and run of `to_parquet`'s output."""
    import pyarrow.parquet as pq

    table = pq.read_table(io.BytesIO(data))
    run = (table.schema.metadata or {}).get(_RUN_KEY, b"").decode()
    groups = {
        group: [item["bytes"] for item in images]
        for group, images in zip(table.column("group_id").to_pylist(), table.column("images").to_pylist())
    }
    return groups, run


def write_condition_images(path: Path, groups: Mapping[str, Sequence[bytes]], run: str) -> None:
    """Write `groups` of run `run` to `path` atomically, removing what a killed writer of it left."""
    from stages.shards.atomic import atomic_write_bytes, remove_stale_temps

    remove_stale_temps(path)
    atomic_write_bytes(path, to_parquet(groups, run))


def condition_images_record(out_dir: Path, num_shards: int, run: str) -> dict[str, Any] | None:
    """The manifest's `extra["condition_images"]` of a finished rollout in `out_dir`: the file (name, bytes,
    sha256) of every shard that has one of run `run` (a shard whose prompts have no condition images has
    none); None when no shard has one (a text-to-image rollout)."""
    files = []
    for shard in range(num_shards):
        path = out_dir / condition_images_file(shard, num_shards)
        try:
            data = path.read_bytes()
            if from_parquet(data)[1] != run:
                continue
        except OSError:
            continue
        files.append({"file": path.name, "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()})
    return {RECORD: {"files": files}} if files else None


def stored_condition_images(paths: Sequence[Path], manifests: Sequence[Any]) -> dict[str, list[bytes]]:
    """group_id → condition images of the rollout among zipped inputs (`paths`, their `manifests`); empty
    when it has none. A file that does not match its manifest's sha256 is a one-line UserInputError."""
    groups: dict[str, list[bytes]] = {}
    for folder, manifest in zip(paths, manifests):
        record = (manifest.extra or {}).get(RECORD)
        if not record:
            continue
        for info in record["files"]:
            path = Path(folder) / Path(info["file"]).name
            try:
                data = path.read_bytes()
            except OSError:
                data = b""
            if hashlib.sha256(data).hexdigest() != info["sha256"]:
                raise UserInputError(
                    f"--in {folder}: {path.name} is missing or does not match its manifest sha256; sample "
                    "the rollout again into a new --out"
                )
            groups.update(from_parquet(data)[0])
    return groups
