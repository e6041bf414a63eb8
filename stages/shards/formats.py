"""The shard file formats by name, and the shard file naming scheme."""

from __future__ import annotations

from types import ModuleType

from stages.errors import UserInputError
from stages.shards import parquet_codec, tar_codec
from stages.shards.manifest import FORMATS

_CODECS: dict[str, ModuleType] = {"parquet": parquet_codec, "webdataset": tar_codec}


def codec(format: str) -> ModuleType:
    """The module with `SUFFIX`, `encode(batch, columns, sink, shard_index)` and
    `decode(buf, columns, num_rows, where)` for a format name."""
    try:
        return _CODECS[format]
    except KeyError:
        raise UserInputError(f"unknown shard format {format!r}; use one of {', '.join(FORMATS)}") from None


# Shard files this writer owns in a shard-set directory: `train-…` since schema version 2 (Hugging Face's
# split naming, so `load_dataset("parquet", data_dir=SET)` takes the shards as the train split and not
# the manifest), `part-…` before it.
SHARD_GLOBS = ("train-*-of-*.*", "part-*-of-*.*")


def shard_file_name(index: int, num_shards: int, format: str) -> str:
    """`train-00000-of-00004.parquet` (zero-based index, Hugging Face datasets' shard naming)."""
    return f"train-{index:05d}-of-{num_shards:05d}.{codec(format).SUFFIX}"
