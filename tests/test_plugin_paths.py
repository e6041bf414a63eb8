"""Plugins named by file path (`path/to/file.py:attribute`), and the visual_count task loaded that way."""

from __future__ import annotations

import io
import sys
import textwrap
from pathlib import Path

import pytest

from stages.advantage.estimators import get_estimator
from stages.errors import UserInputError
from stages.plugins import FILE_MODULE_PREFIX, is_file_spec, load_object
from stages.sample.vlm_data import read_vlm_prompts

REPO = Path(__file__).resolve().parents[1]
TASK = REPO / "recipes" / "tasks" / "visual_count.py"


def _write(path: Path, source: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(source))
    return path


def _file_modules() -> set[str]:
    return {name for name in sys.modules if name.startswith(FILE_MODULE_PREFIX)}


def test_is_file_spec():
    assert is_file_spec("rewards.py") and is_file_spec("a/b") and is_file_spec(r"C:\x\r.py")
    assert not is_file_spec("package.module") and not is_file_spec("module")


def test_relative_and_absolute_paths_load_one_module_once(tmp_path, monkeypatch):
    log = tmp_path / "executions.txt"
    _write(
        tmp_path / "plugins" / "my_reward.py",
        f"""
        from dataclasses import dataclass

        with open({str(log)!r}, "a") as f:
            f.write("run\\n")

        @dataclass
        class Scale:
            factor: float

            def __call__(self, responses, prompts, meta):
                return [self.factor * len(r) for r in responses]

        class Nested:
            class Inner:
                value = 42

        double = Scale(2.0)
        """,
    )
    monkeypatch.chdir(tmp_path)
    relative = load_object("plugins/my_reward.py:double", "reward")
    absolute = load_object(f"{tmp_path / 'plugins' / 'my_reward.py'}:double", "reward")
    dotted = load_object("./plugins/../plugins/my_reward.py:Nested.Inner.value", "reward")
    assert relative is absolute
    assert relative(["ab", "xyz"], ["", ""], [{}, {}]) == [4.0, 6.0]
    assert dotted == 42
    assert log.read_text() == "run\n"  # executed once for three specs naming the same file
    assert type(relative).__module__ in sys.modules  # dataclasses need their module registered


def test_same_stem_in_two_folders_are_two_modules(tmp_path, monkeypatch):
    for folder, value in (("a", 1), ("b", 2)):
        _write(tmp_path / folder / "reward.py", f"VALUE = {value}\n")
    monkeypatch.chdir(tmp_path)
    assert load_object("a/reward.py:VALUE", "reward") == 1
    assert load_object("b/reward.py:VALUE", "reward") == 2


def test_module_specs_still_work(tmp_path, monkeypatch):
    _write(tmp_path / "omnirl_test_plugin_paths_mod.py", "def answer():\n    return 7\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert load_object("omnirl_test_plugin_paths_mod:answer", "reward")() == 7
    with pytest.raises(UserInputError, match="module 'omnirl_test_plugin_paths_mod' has no attribute 'nope'"):
        load_object("omnirl_test_plugin_paths_mod:nope", "reward")
    with pytest.raises(UserInputError, match="cannot import module 'omnirl_no_such_mod_xyz'"):
        load_object("omnirl_no_such_mod_xyz:fn", "reward")


def _one_line_error(spec: str) -> str:
    with pytest.raises(UserInputError) as info:
        load_object(spec, "reward")
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith(f"reward {spec!r}: ")
    return message


def test_file_errors_are_one_line_and_name_the_path(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    before = _file_modules()
    message = _one_line_error("missing/reward.py:fn")
    assert f"no such file {tmp_path / 'missing' / 'reward.py'}" in message

    _write(tmp_path / "broken.py", "def fn(:\n    pass\n")
    message = _one_line_error("broken.py:fn")
    assert f"{tmp_path / 'broken.py'} failed to load (SyntaxError:" in message

    _write(tmp_path / "needs.py", "import omnirl_no_such_dependency_xyz\n")
    message = _one_line_error("needs.py:fn")
    assert "ModuleNotFoundError: No module named 'omnirl_no_such_dependency_xyz'" in message

    _write(tmp_path / "raises.py", "raise RuntimeError('bad\\nconfig')\n")
    assert "(RuntimeError: bad config)" in _one_line_error("raises.py:fn")

    _write(tmp_path / "fine.py", "x = 1\n")
    assert "file 'fine.py' has no attribute 'y.z'" in _one_line_error("fine.py:y.z")
    (loaded,) = _file_modules() - before  # failed loads leave nothing in sys.modules
    assert loaded.startswith(f"{FILE_MODULE_PREFIX}fine_")

    _write(tmp_path / "plugins" / "notes.txt", "x = 1\n")
    assert f"{tmp_path / 'plugins' / 'notes.txt'} is not a Python source file" in _one_line_error(
        "plugins/notes.txt:x"
    )
    (tmp_path / "folder.py").mkdir()
    assert "no such file" in _one_line_error("folder.py:fn")
    for bad in ("fine.py", "fine.py:", "fine.py:1x", r"C:\plugins\fine.py"):
        assert "'package.module:attribute' or 'path/to/file.py:attribute'" in _one_line_error(bad)


def test_broken_file_loads_after_it_is_fixed(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    plugin = _write(tmp_path / "later.py", "raise ValueError('not yet')\n")
    _one_line_error("later.py:VALUE")
    plugin.write_text("VALUE = 'ready'\n")
    assert load_object("later.py:VALUE", "reward") == "ready"


def test_advantage_estimator_from_a_file(tmp_path, monkeypatch):
    _write(
        tmp_path / "adv.py",
        """
        import torch

        def centred(rewards, group_ids, *, clip=None, sample_ids=None):
            r = torch.as_tensor(rewards, dtype=torch.float32)
            return r - r.mean()
        """,
    )
    monkeypatch.chdir(tmp_path)
    assert get_estimator("adv.py:centred")([1.0, 2.0, 6.0], ["g"] * 3).tolist() == [-2.0, -1.0, 3.0]


# --- the demo task, loaded through a file spec --------------------------------------------------


def _task_attr(name: str):
    return load_object(f"{TASK}:{name}", "reward")


@pytest.mark.parametrize(
    ("response", "truth", "expected"),
    [
        ("3", "3", 1.0),  # the bare right digit: all digits, all matching, exact
        (" 3\n", 3, 1.0),  # whitespace around it is ignored; an int ground truth works
        ("5", "3", 0.4),  # a digit, the wrong one
        ("33", "3", 0.8),  # all digits, all right, but not the bare answer
        ("a3", "3", 0.4 * 0.5 + 0.4 * 0.5),
        ("x7 3y", "3", 0.4 * 2 / 5 + 0.4 * 1 / 5),  # inner spaces count as characters
        ("\ufffd3", "3", 0.4 * 0.5 + 0.4 * 0.5),  # a replacement character from stray bytes
        ("²3", "3", 0.4 * 0.5 + 0.4 * 0.5),  # only ASCII digits count ("²".isdigit() is True)
        ("hello", "3", 0.0),
        ("", "3", 0.0),
        ("   ", "3", 0.0),
    ],
)
def test_visual_count_reward_values(response, truth, expected):
    assert _task_attr("compute_score")("omnirl/visual_count", response, truth) == pytest.approx(expected)


def test_visual_count_reward_through_the_verl_adapter():
    reward = _task_attr("reward")
    assert reward.reward_kind == "text"
    meta = [
        {"ground_truth": "4", "data_source": "omnirl/visual_count", "extra_info": {"index": i}}
        for i in range(3)
    ]
    assert reward(["4", "x44", None], ["q"] * 3, meta) == pytest.approx(
        [1.0, 0.4 * 2 / 3 + 0.4 * 2 / 3, None]
    )


def _blobs(png: bytes) -> tuple[int, set[tuple[int, int, int]]]:
    """Connected non-white regions (4-neighbour) of an image and their colours, by flood fill."""
    from PIL import Image

    image = Image.open(io.BytesIO(png)).convert("RGB")
    width, height = image.size
    pixels = image.load()
    seen, regions, colours = set(), 0, set()
    for y in range(height):
        for x in range(width):
            if (x, y) in seen or pixels[x, y] == (255, 255, 255):
                continue
            regions += 1
            colours.add(pixels[x, y])
            stack = [(x, y)]
            seen.add((x, y))
            while stack:
                cx, cy = stack.pop()
                for nx, ny in ((cx + 1, cy), (cx - 1, cy), (cx, cy + 1), (cx, cy - 1)):
                    inside = 0 <= nx < width and 0 <= ny < height
                    if inside and (nx, ny) not in seen and pixels[nx, ny] != (255, 255, 255):
                        seen.add((nx, ny))
                        stack.append((nx, ny))
    return regions, colours


def test_visual_count_build_is_deterministic_and_true(tmp_path):
    build = _task_attr("build")
    colours = _task_attr("COLOURS")
    build(tmp_path / "a.parquet", num_prompts=12, seed=3)
    build(tmp_path / "b.parquet", num_prompts=12, seed=3)
    build(tmp_path / "c.parquet", num_prompts=12, seed=4)
    build(tmp_path / "d.parquet", num_prompts=5, seed=3)
    assert (tmp_path / "a.parquet").read_bytes() == (tmp_path / "b.parquet").read_bytes()
    assert (tmp_path / "a.parquet").read_bytes() != (tmp_path / "c.parquet").read_bytes()

    prompts = read_vlm_prompts(tmp_path / "a.parquet")  # the project's verl-layout reader
    assert [p.images for p in read_vlm_prompts(tmp_path / "d.parquet")] == [p.images for p in prompts[:5]]
    for index, prompt in enumerate(prompts):
        assert prompt.meta["data_source"] == "omnirl/visual_count"
        assert prompt.meta["extra_info"] == {"split": "train", "index": index}
        assert len(prompt.images) == 1
        regions, seen_colours = _blobs(prompt.images[0])
        assert str(regions) == prompt.meta["ground_truth"]  # the image shows exactly k shapes
        (name,) = [c for c, rgb in colours.items() if seen_colours == {rgb}]  # of one colour...
        assert f"How many {name} " in prompt.question  # ...named by the question


def test_visual_count_command_line(tmp_path):
    import subprocess

    out = tmp_path / "task.parquet"
    result = subprocess.run(
        [sys.executable, str(TASK), "--out", str(out), "--num-prompts", "4", "--seed", "3"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    _task_attr("build")(tmp_path / "same.parquet", num_prompts=4, seed=3)
    assert out.read_bytes() == (tmp_path / "same.parquet").read_bytes()
    bad = subprocess.run(
        [sys.executable, str(TASK), "--out", str(out), "--num-prompts", "0"], capture_output=True, text=True
    )
    assert bad.returncode == 2 and "num_prompts must be" in bad.stderr
