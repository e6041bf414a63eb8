"""Small tokenizers built offline from an embedded prompt corpus, for the tiny-model factory.

Real checkpoints ship tokenizers trained on web-scale text; tests here cannot download them, so the
factory learns vocabularies from `PROMPT_CORPUS` (text-rendering, counting and style prompts plus
common English words). Known words come out whole, anything else splits into known characters, so
OCR prompts such as `a sign that says "omnirl 2026"` never collapse to unknown tokens.

The tokenizers are built through the transformers classes themselves (`CLIPTokenizer`,
`T5Tokenizer`), so `save_pretrained` writes exactly what `from_pretrained` reads back. Learning is
pure Python with a fixed tie-break, hence the same bytes on every run and machine (the `tokenizers`
library's BPE trainer is not reproducible across processes).
"""

from __future__ import annotations

import math
import string
from collections import Counter
from functools import lru_cache
from itertools import pairwise

from tokenizers import pre_tokenizers
from transformers import CLIPTokenizer, T5Tokenizer

PROMPT_CORPUS = """
A sign that says "hello". A neon sign that reads "open". A poster with the text "welcome home".
A storefront with the word "bakery" written above the door. A chalkboard that says "coffee 2 dollars".
A book cover with the title "the night garden". A t-shirt printed with the letters "abc".
A street sign that says "stop". A banner that reads "happy birthday". A label that says "fresh milk".
A handwritten note that says "thank you". A wooden sign with the words "no parking".
A billboard that says "sale 50% off". A logo with the name "river cafe". A cake with "happy new year" on it.
A screen showing the number 2026. A license plate that reads "abc 123". A clock showing 10 past 9.
A photo of a cat. A photo of a dog. A photo of two red apples. A photo of three blue cups.
A photo of a person riding a bicycle. A photo of a car next to a bus. A photo of a green train.
A photo of an airplane above a boat. A photo of a truck and a motorcycle. A photo of a traffic light.
A photo of a fire hydrant. A photo of a stop sign. A photo of a parking meter. A photo of a bench.
A photo of a bird, a horse, a sheep and a cow. A photo of an elephant, a bear, a zebra and a giraffe.
A photo of a backpack, an umbrella, a handbag, a tie and a suitcase. A photo of a frisbee and skis.
A photo of a snowboard, a sports ball, a kite, a baseball bat and a baseball glove.
A photo of a skateboard, a surfboard and a tennis racket. A photo of a bottle and a wine glass.
A photo of a cup, a fork, a knife, a spoon and a bowl. A photo of a banana, an apple and a sandwich.
A photo of an orange, broccoli, a carrot, a hot dog, a pizza, a donut and a cake.
A photo of a chair, a couch, a potted plant, a bed and a dining table. A photo of a toilet and a tv.
A photo of a laptop, a mouse, a remote, a keyboard and a cell phone.
A photo of a microwave, an oven, a toaster, a sink and a refrigerator.
A photo of a book, a clock, a vase, scissors, a teddy bear, a hair drier and a toothbrush.
A purple umbrella to the left of a yellow car. A white dog on the right of a black cat.
A brown horse below a pink kite. An orange bowl above a gray table. Four small birds and five big fish.
Six old trees, seven tall towers, eight round plates, nine square boxes, ten long roads, one short path.
A painting of a mountain lake at sunset, highly detailed, soft light, in the style of watercolor.
A cinematic shot of a city street at night, rain, reflections, realistic, sharp focus, 4k.
A cute robot reading a newspaper in a quiet library. A portrait of an old man with a beard.
A beautiful landscape with a river, a forest, a bridge and a small house under a cloudy sky.
A close up of a flower in a garden, morning light, bokeh. A drawing of a castle on a hill.
A simple icon of a heart. A digital art of a dragon flying over the ocean. A cartoon of a happy child.
The quick brown fox jumps over the lazy dog. What is this? It is a good day to be here with you.
I have not seen them all, but we will make it work if they can come back from their time out there.
Some people think about the world in new ways; there are many more things than one could know.
Also, just look at how each word in your text can be read, said, shown, used, made, found and given.
This image is a picture of the first and last letter of every name and number: 0 1 2 3 4 5 6 7 8 9.
Zero, two, three, hundred, thousand, million. January, monday, summer, winter, spring, autumn.
Please write your own words: yes, no, maybe, love, peace, hope, dream, life, art, music, game, play.
"""


def _printable_characters() -> list[str]:
    """ASCII letters, digits and punctuation: the characters the T5 vocabulary must hold (CLIP covers all bytes)."""
    return list(string.ascii_letters + string.digits + string.punctuation)


def _learn_bpe_merges(word_counts: dict[str, int], end_of_word: str) -> list[tuple[str, str]]:
    """Learn BPE merges until every corpus word is one symbol.

    Each round merges the most frequent adjacent pair (ties: the smallest pair as strings), then
    updates the counts of the words that contained it, so the result is deterministic.
    """
    words = sorted(word_counts)
    symbols = [[*word[:-1], word[-1] + end_of_word] for word in words]
    counts = [word_counts[word] for word in words]
    pair_counts: Counter[tuple[str, str]] = Counter()
    where: dict[tuple[str, str], set[int]] = {}
    for index, parts in enumerate(symbols):
        for pair in pairwise(parts):
            pair_counts[pair] += counts[index]
            where.setdefault(pair, set()).add(index)
    merges: list[tuple[str, str]] = []
    while pair_counts:
        best = min(pair_counts, key=lambda pair: (-pair_counts[pair], pair))
        merges.append(best)
        for index in sorted(where.pop(best)):
            parts = symbols[index]
            for pair in pairwise(parts):
                pair_counts[pair] -= counts[index]
                if pair_counts[pair] <= 0:
                    del pair_counts[pair]
            merged: list[str] = []
            position = 0
            while position < len(parts):
                if position + 1 < len(parts) and (parts[position], parts[position + 1]) == best:
                    merged.append(parts[position] + parts[position + 1])
                    position += 2
                else:
                    merged.append(parts[position])
                    position += 1
            symbols[index] = merged
            for pair in pairwise(merged):
                pair_counts[pair] += counts[index]
                where.setdefault(pair, set()).add(index)
    return merges


@lru_cache(maxsize=1)
def _clip_vocab_and_merges() -> tuple[dict[str, int], list[tuple[str, str]]]:
    """CLIP-style byte-level BPE: every byte symbol, alone and word-final, then the learned merges."""
    splitter = CLIPTokenizer(vocab=None, merges=None).backend_tokenizer
    text = splitter.normalizer.normalize_str(PROMPT_CORPUS)
    word_counts = Counter(piece for piece, _ in splitter.pre_tokenizer.pre_tokenize_str(text))
    byte_symbols = sorted(pre_tokenizers.ByteLevel.alphabet())
    merges = _learn_bpe_merges(word_counts, "</w>")
    tokens = byte_symbols + [symbol + "</w>" for symbol in byte_symbols]
    tokens += [left + right for left, right in merges]
    tokens += ["<|startoftext|>", "<|endoftext|>"]
    vocab: dict[str, int] = {}
    for token in tokens:
        vocab.setdefault(token, len(vocab))
    return vocab, merges


def build_clip_tokenizer(model_max_length: int = 77) -> CLIPTokenizer:
    """A CLIP byte-level BPE tokenizer learned from `PROMPT_CORPUS` (about 1.3k tokens).

    Like OpenAI's CLIP vocabulary it lowercases, keeps `<|startoftext|>`/`<|endoftext|>` as the last
    two ids and pads with `<|endoftext|>`; `model_max_length` is the padded length SD3 encodes to.
    """
    vocab, merges = _clip_vocab_and_merges()
    return CLIPTokenizer(vocab=dict(vocab), merges=list(merges), model_max_length=model_max_length)


@lru_cache(maxsize=1)
def _t5_pieces() -> tuple[tuple[str, float], ...]:
    """SentencePiece-style unigram pieces with log-frequency scores.

    Every corpus word is a `▁word` piece (also capitalised), scored by its log frequency; every
    printable character exists bare and as `▁c`, scored below any word so whole words win the
    Viterbi split and unknown words fall back to characters.
    """
    words = Counter(
        word.strip(string.punctuation)
        for word in PROMPT_CORPUS.lower().split()
        if word.strip(string.punctuation)
    )
    total = sum(words.values())
    word_scores: dict[str, float] = {}
    for word, count in sorted(words.items()):
        score = math.log(count / total)
        word_scores["▁" + word] = score
        word_scores.setdefault("▁" + word.capitalize(), score - 1.0)
    character_score = min(word_scores.values()) - 2.0
    pieces: dict[str, float] = {"<pad>": 0.0, "</s>": 0.0, "<unk>": 0.0, "▁": -2.0}
    for piece, score in word_scores.items():
        pieces.setdefault(piece, score)
    for character in _printable_characters():
        pieces.setdefault("▁" + character, character_score)
        pieces.setdefault(character, character_score - 1.0)
    return tuple(pieces.items())


def build_t5_tokenizer(model_max_length: int = 256) -> T5Tokenizer:
    """A T5 unigram tokenizer over `PROMPT_CORPUS` (ids: `<pad>` 0, `</s>` 1, `<unk>` 2), case-sensitive.

    No sentinel `<extra_id_*>` tokens: the text encoders here are only used to embed prompts.
    """
    return T5Tokenizer(vocab=list(_t5_pieces()), extra_ids=0, model_max_length=model_max_length)
