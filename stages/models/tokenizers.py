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
import re
import string
from collections import Counter
from collections.abc import Mapping, Sequence
from functools import lru_cache
from itertools import pairwise

from tokenizers import AddedToken, pre_tokenizers
from transformers import CLIPTokenizer, Qwen2Tokenizer, T5Tokenizer

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


VLM_CORPUS = """
What is shown in the image? The image shows a small red ball on a wooden table next to a blue cup.
How many apples are there in the picture? Let me count them one by one: 1, 2, 3, 4, 5. There are 5 apples.
What color is the car on the left? The car on the left is yellow, and the one on the right is dark green.
What is written on the sign? The sign says "OPEN 24 HOURS" in white capital letters on a black board.
Is there a dog in this photo? Yes, there is a brown dog sleeping under the chair. No, I do not see a cat.
Which shape has the largest area: the circle, the square or the triangle? Compare their areas carefully.
Look at the chart. Which month had the highest sales? March had the highest value, about 42 thousand.
Read the table and find the total. Add the numbers in the second column: 12 + 7 + 30 = 49.
Answer the question using a single word or phrase. Answer with the option's letter from the given choices.
Choices: (A) 3 (B) 4 (C) 6 (D) 8. Options: A. red B. blue C. green D. white. The correct option is B.
First, I identify the objects in the scene. Then I check their positions relative to each other.
Let's think step by step. We know that the angle ABC is 60 degrees and the triangle is isosceles.
So the other two angles are equal, and each one is (180 - 60) / 2 = 60 degrees. Therefore it is equilateral.
In the figure, AB = 6 cm, BC = 8 cm and angle B = 90°. By the Pythagorean theorem AC = sqrt(6^2 + 8^2) = 10.
The radius of the circle is 5, so its area is 25π and its circumference is 10π ≈ 31.4 units.
If x + 3 = 11, then x = 8. If 2y - 4 = 10, then y = 7. The value of f(2) = 2 * 2 + 1 = 5.
The final answer is \\boxed{48}. The answer is \\boxed{7}. So the result is 3/4, or 0.75, or 75%.
Find the value of the unknown variable. Solve for x. Compute the perimeter of the rectangle.
Hint: Please answer the question and provide the correct option letter, e.g., A, B, C, D, at the end.
Question: What is the length of side AD? Solution: Since ABCD is a parallelogram, AD = BC = 9.
Output the bounding box of the person in the image as JSON: {"bbox_2d": [12, 34, 156, 278], "label": "person"}.
Locate the cup and return its coordinates [x1, y1, x2, y2]. The box is [40, 60, 120, 180].
Describe this image in detail. A group of children are playing football on a green field under a clear sky.
There are two people standing near a white boat, and a woman is holding a black umbrella in the rain.
The text at the top reads "Welcome to the City Museum", and the date below it is 12/05/2024.
Wait, I made a mistake in the previous step. Let me check again: 15 - 9 = 6, not 5. Now it is correct.
Hmm, the shadow suggests the light comes from the right side, so the photo was taken in the afternoon.
The graph of y = 2x + 1 is a straight line with slope 2 and intercept 1; it passes through (0, 1) and (1, 3).
The probability of drawing a red marble is 3/10 = 0.3. The mean of 4, 8 and 12 is 8; the median is 8 too.
Based on the diagram, the force F acts downward, the mass m = 2 kg, and the acceleration is g = 9.8 m/s^2.
You are a helpful assistant. A conversation between User and Assistant. The user asks a question, and the
Assistant solves it. The assistant first thinks about the reasoning process in the mind and then provides
the user with the answer. The reasoning process and answer are enclosed within think and answer tags.
Output the thinking process in the tags and the final answer in the answer tags. Keep it short and clear.
Please reason step by step, and put your final answer within a box. Give a brief explanation first.
Who is holding the bat? What time does the clock show? Where is the bird sitting? Why is the road wet?
Which animal is the tallest? When was this building built? How far is the tree from the house?
Yes. No. True. False. Maybe. I'm not sure. It's hard to tell. They're both correct. We'll see. You've got it.
Numbers: 0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 20 25 30 40 50 60 64 90 100 128 180 256 360 1000 2048.
Symbols: + - * / = < > ( ) [ ] { } # $ % & @ ! ? . , ; : ' " _ ^ ~ | \\ ` ... -> => <= >= != == ** //
"""


def _qwen2_training_corpus() -> str:
    """The text the Qwen-style vocabulary is learned from: VLM questions and reasoning plus image prompts."""
    return VLM_CORPUS + PROMPT_CORPUS


QWEN2_SPECIAL_TOKENS = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|object_ref_start|>",
    "<|object_ref_end|>",
    "<|box_start|>",
    "<|box_end|>",
    "<|quad_start|>",
    "<|quad_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
)
REASONING_TAGS = ("<think>", "</think>", "<answer>", "</answer>")

# Qwen3's chat template for the turns the diffusion pipelines render (one user message, a generation prompt):
# with `enable_thinking=False` Qwen3 opens an empty think block (FLUX.2 klein passes False, Z-Image True).
QWEN3_CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}"
    "{%- if enable_thinking is defined and enable_thinking is false -%}"
    "{{- '<think>\\n\\n</think>\\n\\n' -}}"
    "{%- endif -%}{%- endif -%}"
)


@lru_cache(maxsize=4)
def _qwen2_vocab_and_merges(extra_text: str = "") -> tuple[dict[str, int], list[tuple[str, str]]]:
    """GPT-2-style byte-level BPE (no end-of-word marker): the 256 byte symbols, then the merges learned
    on the corpus as split by Qwen2's own pre-tokenizer (digits stay single, words keep their space).

    Every corpus word also counts once in each of the forms it can take after that split (with and
    without the leading space, lower-case and capitalised), so `user` after `<|im_start|>` or a word at
    the start of a line is one token as well.
    """
    splitter = Qwen2Tokenizer().backend_tokenizer
    corpus = _qwen2_training_corpus() + extra_text
    words = sorted({word.lower() for word in re.findall(r"[A-Za-z]+", corpus)})
    variants = [
        form for word in words for form in (word, " " + word, word.capitalize(), " " + word.capitalize())
    ]
    text = splitter.normalizer.normalize_str(corpus + "\n".join(variants))
    word_counts = Counter(piece for piece, _ in splitter.pre_tokenizer.pre_tokenize_str(text))
    merges = _learn_bpe_merges(word_counts, "")
    vocab: dict[str, int] = {}
    for token in sorted(pre_tokenizers.ByteLevel.alphabet()) + [left + right for left, right in merges]:
        vocab.setdefault(token, len(vocab))
    return vocab, merges


def build_qwen2_tokenizer(
    model_max_length: int = 4096,
    extra_text: str = "",
    *,
    special_tokens: Sequence[str] = QWEN2_SPECIAL_TOKENS,
    named_tokens: Mapping[str, str] | None = None,
) -> Qwen2Tokenizer:
    """A Qwen2 byte-level BPE tokenizer learned from `VLM_CORPUS` and `PROMPT_CORPUS` (about 2.5k tokens).

    Laid out like Qwen2.5-VL's: BPE tokens first, then the ChatML/vision special tokens of
    `special_tokens` in their published order (`<|endoftext|>` pads, `<|im_end|>` ends a turn),
    then the `REASONING_TAGS` as ordinary added tokens, so they stay whole but survive
    `decode(skip_special_tokens=True)`, which format rewards rely on. Any byte sequence encodes.
    `extra_text` joins the training text, so a pipeline's fixed prompt template comes out in whole words
    (Qwen-Image drops a fixed count of template tokens: it must tokenise to that count).
    `named_tokens` gives special tokens attribute names (`image_token` → `tokenizer.image_token` and
    `tokenizer.image_token_id`), which processors such as Qwen3-Omni's read.
    """
    vocab, merges = _qwen2_vocab_and_merges(extra_text)
    vocab = dict(vocab)
    for token in special_tokens:
        vocab[token] = len(vocab)
    tokenizer = Qwen2Tokenizer(
        vocab=vocab,
        merges=list(merges),
        unk_token=None,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        extra_special_tokens=dict(named_tokens) if named_tokens else list(special_tokens),
        model_max_length=model_max_length,
    )
    if named_tokens:  # the unnamed ones stay whole and special too
        tokenizer.add_tokens(
            [AddedToken(token, special=True, normalized=False) for token in special_tokens],
            special_tokens=True,
        )
    tokenizer.add_tokens([AddedToken(tag, special=False, normalized=False) for tag in REASONING_TAGS])
    return tokenizer
