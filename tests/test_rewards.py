"""Reward registry, built-in scorers (JPEG, OCR) and batch scoring."""

from __future__ import annotations

import io
import math
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image, ImageDraw, ImageFont

from stages.errors import NonFiniteError, UserInputError
from stages.score import registry
from stages.score.ocr import levenshtein, ocr, ocr_target, ocr_text_reward
from stages.score.registry import available_rewards, get_reward, parse_reward_spec, register_reward
from stages.score.scoring import score_batch


def _noise_image(seed: int, size: int = 64) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (size, size, 3), dtype=np.uint8))


def _flat_image(size: int = 64) -> Image.Image:
    return Image.new("RGB", (size, size), (120, 30, 200))


def _jpeg_kb_reference(image: Image.Image) -> float:
    data = io.BytesIO()
    image.save(data, "JPEG", quality=95)
    return len(data.getvalue()) / 1000


@pytest.fixture
def scratch_registry(monkeypatch):
    """A private copy of the registry so test scorers do not leak into other tests."""
    available_rewards()
    monkeypatch.setattr(registry, "_REGISTRY", dict(registry._REGISTRY))
    monkeypatch.setattr(registry, "_PLUGINS", {})


def _write_module(tmp_path: Path, monkeypatch, name: str, source: str) -> None:
    (tmp_path / f"{name}.py").write_text(textwrap.dedent(source))
    monkeypatch.syspath_prepend(str(tmp_path))


# --- JPEG -----------------------------------------------------------------------------------------


def test_jpeg_rewards_equal_independent_encoding():
    images = [_noise_image(0), _flat_image(), _noise_image(1, size=32)]
    expected_kb = [_jpeg_kb_reference(image) for image in images]
    assert expected_kb[0] > 1.0  # bytes/1000 of a 64x64 noise JPEG: several kB, not bytes
    got_in = get_reward("jpeg_incompressibility")(images, ["p"] * 3, [{}] * 3)
    got_co = get_reward("jpeg_compressibility")(images, ["p"] * 3, [{}] * 3)
    assert got_in == pytest.approx(expected_kb, rel=0, abs=1e-12)
    assert got_co == pytest.approx([-kb / 500 for kb in expected_kb], rel=0, abs=1e-12)


def test_jpeg_converts_non_rgb_modes():
    rgba = _noise_image(2).convert("RGBA")
    assert get_reward("jpeg_incompressibility")([rgba], ["p"], [{}]) == [
        pytest.approx(_jpeg_kb_reference(rgba.convert("RGB")), abs=1e-12)
    ]


def test_flat_image_is_more_compressible_than_noise():
    flat, noise = get_reward("jpeg_compressibility")([_flat_image(), _noise_image(3)], ["p", "p"], [{}, {}])
    assert flat > noise


# --- OCR formula ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("a", "b", "distance"),
    [
        ("kitten", "sitting", 3),
        ("flaw", "lawn", 2),
        ("", "abc", 3),
        ("abc", "", 3),
        ("same", "same", 0),
        ("ab", "ba", 2),
        ("intention", "execution", 5),
    ],
)
def test_levenshtein_known_values(a, b, distance):
    assert levenshtein(a, b) == distance
    assert levenshtein(b, a) == distance


def test_ocr_reward_formula():
    assert ocr_text_reward("xxhelloyy", "hello") == 1.0  # substring
    assert ocr_text_reward("hellp", "hello") == pytest.approx(0.8)  # one substitution in 5 chars
    assert ocr_text_reward("hell", "hello") == pytest.approx(0.8)  # one deletion
    assert ocr_text_reward("", "hello") == 0.0  # d = 5 = len
    assert ocr_text_reward("zzzzzzzzzzzz", "abc") == 0.0  # d = 12, capped at 3
    assert ocr_text_reward("HeL Lo  WORLD", "hello world") == 1.0  # spaces and case ignored
    assert ocr_text_reward("OPEN 24h", "open 24 hours") == pytest.approx(1 - 4 / 11)


def test_ocr_target_from_prompt_and_meta():
    assert ocr_target('a sign that says "Hello 42" and "ignored"', {}) == "Hello 42"
    assert ocr_target('a sign that says "hello"', {"text": "from meta"}) == "from meta"
    assert ocr_target('a sign that says "hello"', {"text": "t", "ocr_text": "preferred"}) == "preferred"
    assert ocr_target('a sign "x"', None) == "x"
    with pytest.raises(UserInputError, match="a plain prompt"):
        ocr_target("a plain prompt", {})
    with pytest.raises(UserInputError, match="empty"):
        ocr_target('a sign that says "  "', {})


def _text_image(text: str) -> Image.Image:
    image = Image.new("RGB", (512, 512), "white")
    fonts = (
        sorted(Path("/usr/share/fonts").rglob("DejaVuSans.ttf")) if Path("/usr/share/fonts").exists() else []
    )
    font = ImageFont.truetype(str(fonts[0]), 72) if fonts else ImageFont.load_default(size=72)
    ImageDraw.Draw(image).text((24, 200), text, fill="black", font=font)
    return image


def test_real_ocr_reads_rendered_text():
    pytest.importorskip("rapidocr_onnxruntime")
    prompt = 'a sign that says "hello 42"'
    scores = ocr([_text_image("HELLO 42"), Image.new("RGB", (512, 512), "white")], [prompt, prompt], [{}, {}])
    assert scores[0] >= 0.8
    assert scores[1] == 0.0


def test_ocr_engine_failure_is_none_not_zero(monkeypatch):
    import stages.score.ocr as ocr_module

    def broken(image):
        raise RuntimeError("engine crashed")

    monkeypatch.setattr(ocr_module, "_get_engine", lambda: object())
    monkeypatch.setattr(ocr_module, "recognize_text", broken)
    assert ocr([_flat_image()], ['say "hi"'], [{}]) == [None]
    with pytest.raises(NonFiniteError, match=r"reward 'ocr' could not score \(None\) for sample 's0'"):
        score_batch([("ocr", 1.0)], [_flat_image()], ['say "hi"'], [{}], sample_ids=["s0"])


# --- registry -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("spec", "expected"),
    [
        ("ocr", ("ocr", 1.0)),
        ("jpeg_compressibility=0.1", ("jpeg_compressibility", 0.1)),
        ("mypkg.mod:fn=2", ("mypkg.mod:fn", 2.0)),
        (" ocr = -0.5 ", ("ocr", -0.5)),
        ("mypkg.mod:fn", ("mypkg.mod:fn", 1.0)),
        ("ocr=0", ("ocr", 0.0)),
    ],
)
def test_parse_reward_spec(spec, expected):
    assert parse_reward_spec(spec) == expected


@pytest.mark.parametrize("spec", ["ocr=abc", "ocr=", "ocr=nan", "ocr=inf", "=2", ""])
def test_parse_reward_spec_rejects_bad_input(spec):
    with pytest.raises(UserInputError, match="--reward"):
        parse_reward_spec(spec)


def test_available_and_unknown_rewards():
    names = available_rewards()
    assert {"ocr", "jpeg_compressibility", "jpeg_incompressibility"} <= set(names)
    with pytest.raises(UserInputError, match=r"unknown reward 'nope'.*jpeg_compressibility"):
        get_reward("nope")


def test_register_reward_refuses_silent_shadowing(scratch_registry):
    def first(images, prompts, meta):
        return [1.0] * len(images)

    register_reward("shadow_me")(first)
    register_reward("shadow_me")(first)
    with pytest.raises(ValueError, match="already registered"):
        register_reward("shadow_me")(lambda images, prompts, meta: [])
    with pytest.raises(ValueError, match="letters"):
        register_reward("bad:name")


def test_plugin_module_function_and_class(tmp_path, monkeypatch, scratch_registry):
    _write_module(
        tmp_path,
        monkeypatch,
        "omnirl_test_plugin_a",
        """
        def brightness(images, prompts, meta):
            return [image.convert("L").getpixel((0, 0)) / 255 for image in images]

        class PromptLength:
            def __init__(self):
                self.calls = 0

            def __call__(self, images, prompts, meta):
                self.calls += 1
                return [float(len(p)) for p in prompts]
    """,
    )
    white, black = Image.new("RGB", (8, 8), "white"), Image.new("RGB", (8, 8), "black")
    scorer = get_reward("omnirl_test_plugin_a:brightness")
    assert scorer([white, black], ["a", "b"], [{}, {}]) == [1.0, 0.0]
    instance = get_reward("omnirl_test_plugin_a:PromptLength")
    assert instance is get_reward("omnirl_test_plugin_a:PromptLength")  # instantiated once
    out = score_batch(
        [("omnirl_test_plugin_a:PromptLength", 2.0)],
        [white, black],
        ["abc", "z"],
        [{}, {}],
        sample_ids=["s0", "s1"],
    )
    assert out["reward"].tolist() == [6.0, 2.0]
    assert instance.calls == 1
    with pytest.raises(UserInputError, match="no attribute 'missing'"):
        get_reward("omnirl_test_plugin_a:missing")
    with pytest.raises(UserInputError, match="cannot import module 'omnirl_no_such_module'"):
        get_reward("omnirl_no_such_module:fn")


def test_entry_point_reward(tmp_path, monkeypatch, scratch_registry):
    import importlib.metadata

    _write_module(
        tmp_path,
        monkeypatch,
        "omnirl_test_plugin_ep",
        """
        def constant(images, prompts, meta):
            return [0.25] * len(images)
    """,
    )
    ep = importlib.metadata.EntryPoint(
        name="quarter", value="omnirl_test_plugin_ep:constant", group="omnirl.rewards"
    )
    real = importlib.metadata.entry_points
    monkeypatch.setattr(
        importlib.metadata,
        "entry_points",
        lambda group=None: [ep] if group == "omnirl.rewards" else real(group=group),
    )
    assert "quarter" in available_rewards()
    assert get_reward("quarter")([None, None], ["", ""], [{}, {}]) == [0.25, 0.25]


# --- score_batch ----------------------------------------------------------------------------------


def _register_fixed(name: str, values):
    @register_reward(name)
    def scorer(images, prompts, meta):
        return list(values)

    return scorer


def test_score_batch_weighted_sum(scratch_registry):
    a = [0.1, 0.7, -2.0]
    b = [3.0, 1.0 / 3.0, 0.0]
    _register_fixed("fixed_a", a)
    _register_fixed("fixed_b", b)
    out = score_batch(
        [("fixed_a", 2.0), ("fixed_b", 0.5)], [None] * 3, ["p"] * 3, [{}] * 3, sample_ids=["x", "y", "z"]
    )
    assert list(out) == ["reward", "reward.fixed_a", "reward.fixed_b"]
    expected = np.float32(2.0 * np.array(a, dtype=np.float64) + 0.5 * np.array(b, dtype=np.float64))
    for key in out:
        assert out[key].dtype == torch.float32 and out[key].shape == (3,)
    np.testing.assert_array_equal(out["reward"].numpy(), expected)
    np.testing.assert_array_equal(out["reward.fixed_a"].numpy(), np.float32(a))
    np.testing.assert_array_equal(out["reward.fixed_b"].numpy(), np.float32(b))


def test_score_batch_calls_each_scorer_once_per_batch(scratch_registry):
    calls = []

    @register_reward("counting")
    def counting(images, prompts, meta):
        calls.append(len(images))
        return [1.0] * len(images)

    score_batch([("counting", 1.0)], [None] * 5, ["p"] * 5, [{}] * 5, sample_ids=[f"s{i}" for i in range(5)])
    assert calls == [5]


@pytest.mark.parametrize(
    ("bad", "text"),
    [(math.nan, "returned nan"), (math.inf, "returned inf"), (None, r"could not score \(None\)")],
)
def test_non_finite_score_names_scorer_and_sample(scratch_registry, bad, text):
    _register_fixed("flaky", [1.0, bad, 2.0])
    with pytest.raises(NonFiniteError, match=rf"reward 'flaky' {text} for sample 'id-1'"):
        score_batch([("flaky", 1.0)], [None] * 3, ["p"] * 3, [{}] * 3, sample_ids=["id-0", "id-1", "id-2"])


def test_on_error_zero_records_and_flags(scratch_registry, caplog):
    _register_fixed("flaky", [1.0, math.nan, 2.0])
    _register_fixed("steady", [1.0, 1.0, 1.0])
    out = score_batch(
        [("flaky", 1.0), ("steady", 3.0)],
        [None] * 3,
        ["p"] * 3,
        [{}] * 3,
        sample_ids=["a", "b", "c"],
        on_error="zero",
    )
    assert out["reward.flaky"].tolist() == [1.0, 0.0, 2.0]
    assert out["reward"].tolist() == [4.0, 3.0, 5.0]
    assert out["reward_failed"].tolist() == [False, True, False]
    assert "'b'" in caplog.text


def test_raising_scorer(scratch_registry):
    @register_reward("crashy")
    def crashy(images, prompts, meta):
        raise RuntimeError("server down")

    args = ([None] * 2, ["p"] * 2, [{}] * 2)
    with pytest.raises(
        NonFiniteError, match=r"reward 'crashy' raised RuntimeError: server down .*'s0'\.\.'s1'"
    ):
        score_batch([("crashy", 1.0)], *args, sample_ids=["s0", "s1"])
    out = score_batch([("crashy", 1.0)], *args, sample_ids=["s0", "s1"], on_error="zero")
    assert out["reward_failed"].tolist() == [True, True]
    assert out["reward"].tolist() == [0.0, 0.0]


def test_user_input_error_from_scorer_propagates_even_with_zero(scratch_registry):
    with pytest.raises(UserInputError, match=r"reward 'ocr': .*no text in double quotes") as info:
        score_batch(
            [("ocr", 1.0)], [_flat_image()], ["no quotes here"], [{}], sample_ids=["s0"], on_error="zero"
        )
    assert not isinstance(info.value, NonFiniteError)


def test_score_batch_input_errors(scratch_registry):
    _register_fixed("short", [1.0])
    _register_fixed("texty", ["high", "low"])
    args = ([None] * 2, ["p"] * 2, [{}] * 2)
    with pytest.raises(UserInputError, match="reward 'short' returned 1 scores for 2 samples"):
        score_batch([("short", 1.0)], *args, sample_ids=["a", "b"])
    with pytest.raises(UserInputError, match="reward 'texty' returned 'high' for sample 'a'"):
        score_batch([("texty", 1.0)], *args, sample_ids=["a", "b"])
    with pytest.raises(UserInputError, match="more than once"):
        score_batch([("short", 1.0), ("short", 2.0)], *args, sample_ids=["a", "b"])
    with pytest.raises(UserInputError, match="on_error 'skip'"):
        score_batch([("short", 1.0)], *args, sample_ids=["a", "b"], on_error="skip")


@pytest.mark.parametrize(
    ("bad", "kind"), [("0.25", "str"), (True, "bool"), (np.bool_(False), "bool"), ([0.5], "list")]
)
def test_a_plugin_returning_no_number_is_refused_not_converted(scratch_registry, bad, kind):
    from stages.score.registry import FrameAggregate
    from stages.score.reward_server import _values
    from stages.score.text_rewards import trl_reward, verl_compute_score

    args = ([None] * 2, ["p"] * 2, [{}] * 2)
    _register_fixed("stringly", [0.5, bad])
    with pytest.raises(UserInputError, match=rf"reward 'stringly' returned .* for sample 'b', a {kind};"):
        score_batch([("stringly", 1.0)], *args, sample_ids=["a", "b"])
    # the frame reduction, the wrappers of verl / trl functions and the reward server refuse it too
    frames = FrameAggregate(lambda images, prompts, meta: [0.5, bad], "mean")
    with pytest.raises(UserInputError, match="scores must be numbers or None"):
        frames([["f0", "f1"]], ["p"], [{}])
    for wrapped in (verl_compute_score(lambda **kw: bad), trl_reward(lambda completions, **kw: [bad, bad])):
        register_reward("wrapped")(wrapped)
        with pytest.raises(UserInputError, match=rf"reward 'wrapped' returned .* a {kind};"):
            score_batch([("wrapped", 1.0)], ["x", "y"], ["p"] * 2, [{}] * 2, sample_ids=["a", "b"])
        registry._REGISTRY.pop("wrapped")
    with pytest.raises(ValueError, match="scores must be numbers or None"):
        _values([0.5, bad], 2)


def test_score_with_a_plugin_returning_strings_is_one_line_exit_2(staged, tmp_path):
    from helpers import fails

    plugin = tmp_path / "stringly.py"
    plugin.write_text("def reward(images, prompts, meta):\n    return ['0.25'] * len(images)\n")
    out = tmp_path / "rewards"
    args = ["score", "--in", str(staged["samples"]), "--reward", f"{plugin}:reward", "--out", str(out)]
    fails(args, "returned '0.25'", "a str", "scores must be numbers or None")
    assert not out.exists()


def test_numbers_of_every_numeric_type_and_none_are_scores(scratch_registry):
    values = [1, 0.5, np.float32(0.25), np.int64(2), torch.tensor(0.75), np.array(1.5), None]
    _register_fixed("numeric", values)
    ids = [f"s{i}" for i in range(len(values))]
    out = score_batch(
        [("numeric", 1.0)],
        [None] * len(ids),
        ["p"] * len(ids),
        [{}] * len(ids),
        sample_ids=ids,
        on_error="zero",
    )
    assert out["reward.numeric"].tolist() == [1.0, 0.5, 0.25, 2.0, 0.75, 1.5, 0.0]
    assert out["reward_failed"].tolist() == [False] * 6 + [True]


def test_weighted_sum_overflowing_float32_is_reported(scratch_registry):
    _register_fixed("huge", [1.0, 1e39])
    with pytest.raises(NonFiniteError, match="sample 'b' does not fit in float32"):
        score_batch([("huge", 1.0)], [None] * 2, ["p"] * 2, [{}] * 2, sample_ids=["a", "b"])


def test_score_reports_each_rewards_speed_when_it_scores(staged, tmp_path):
    from helpers import run

    args = [
        "score",
        "--in",
        str(staged["samples"]),
        "--reward",
        "jpeg_compressibility",
        "--reward",
        "jpeg_incompressibility=0",
    ]
    first = run(*args, "--out", str(tmp_path / "r"))
    speeds = {k: v for k, v in first.items() if k.startswith("perf/")}
    assert set(speeds) == {
        "perf/jpeg_compressibility/samples_per_s",
        "perf/jpeg_incompressibility/samples_per_s",
    }
    assert all(v > 0 for v in speeds.values())
    again = run(*args, "--out", str(tmp_path / "r"))  # already complete: nothing scored, no speed
    assert not any(k.startswith("perf/") for k in again)
