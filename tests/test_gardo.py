"""GARDO (arXiv 2512.24138): diversity-aware advantages, the uncertainty-gated KL and the reference reset.

Golden values are worked out by hand from the formulas in `stages.advantage.gardo` (the reference code's):
d_i = min_{j≠i} (1 − cos), A_i = (r_i − mean)·d_i/mean(d) at or above the group mean, r_i − mean below it;
U = rank_main − mean rank_aux (1 = best), gate = U above the (1 − q) quantile of the U ≥ 0.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from helpers import ins, run, staged_update_args
from safetensors.torch import load_file

from stages.advantage.gardo import diversity_advantages, nearest_distances, uncertainty, uncertainty_gate
from stages.shards.reader import open_inputs

C = 1 / math.sqrt(10)  # cos((1, 0), (3, 1)) = 3C and cos((0, 1), (3, 1)) = C
ROWS = [  # (group, reward, feature)
    ("a", 1.0, (1.0, 0.0)),
    ("b", 3.0, (1.0, 2.0)),
    ("a", 4.0, (0.0, 1.0)),
    ("c", 5.0, (2.0, 2.0)),
    ("a", 2.0, (3.0, 1.0)),
    ("b", 3.0, (5.0, 1.0)),
    ("d", 0.0, (1.0, 1.0)),
    ("d", 1.0, (2.0, 2.0)),
    ("e", 0.0, (1.0, 0.0)),
    ("e", 0.0, (1.0, 0.0)),
    ("e", 1.0, (0.0, 1.0)),
    ("e", 3.0, (-1.0, 0.0)),
]
# group a: d = (1 − 3C, 1 − C, 1 − 3C), mean(d) = (3 − 7C)/3; the one sample above the mean 7/3 (reward 4)
# gets (4 − 7/3)·(1 − C)/mean(d). b: equal rewards → 0. c: a singleton → 0. d: identical directions, mean
# distance 0 → plain r − mean. e: d = (0, 0, 1, 1), mean ½, mean reward 1 → (−1, −1, 0·2, 2·2).
A_MEAN_D = (3 - 7 * C) / 3
GOLDEN = [
    1 - 7 / 3,
    0.0,
    (4 - 7 / 3) * (1 - C) / A_MEAN_D,
    0.0,
    2 - 7 / 3,
    0.0,
    -0.5,
    0.5,
    -1.0,
    -1.0,
    0.0,
    4.0,
]


def _rows() -> tuple[torch.Tensor, list[str], torch.Tensor]:
    groups = [g for g, _, _ in ROWS]
    rewards = torch.tensor([r for _, r, _ in ROWS])
    features = torch.tensor([f for _, _, f in ROWS])
    return rewards, groups, features


def test_diversity_advantages_on_hand_made_groups() -> None:
    rewards, groups, features = _rows()
    got = diversity_advantages(rewards, groups, features=features)
    assert GOLDEN[2] == pytest.approx(4.347452517, rel=1e-9)  # the hand value, for the record
    torch.testing.assert_close(got, torch.tensor(GOLDEN, dtype=torch.float32), rtol=1e-6, atol=1e-7)
    clipped = diversity_advantages(rewards, groups, features=features, clip=3.0)
    assert clipped[2] == 3.0 and clipped[11] == 3.0 and clipped[0] == pytest.approx(-4 / 3)


def test_nearest_distances_are_to_the_closest_other_member() -> None:
    feats = torch.tensor([[1.0, 0.0], [0.0, 1.0], [3.0, 1.0], [7.0, 7.0]])
    index = torch.tensor([0, 0, 0, 1])
    got = nearest_distances(feats, index, 2)
    torch.testing.assert_close(got, torch.tensor([1 - 3 * C, 1 - C, 1 - 3 * C, 0.0], dtype=torch.float64))


def test_uncertainty_and_gate_on_a_hand_made_batch() -> None:
    main = torch.tensor([6.0, 5.0, 4.0, 3.0, 2.0, 1.0])  # ranks 1..6
    aux = [main.flip(0), main.clone()]  # ranks 6..1 and 1..6: mean rank 3.5 everywhere
    torch.testing.assert_close(
        uncertainty(main, aux), torch.tensor([-2.5, -1.5, -0.5, 0.5, 1.5, 2.5], dtype=torch.float64)
    )
    # U ≥ 0: (0.5, 1.5, 2.5); quantile 0.9 = 2.3, 0.5 = 1.5, 0.3 = 1.1, 0 = 0.5 (strictly above gates)
    expected = {0.1: [5], 0.5: [5], 0.7: [4, 5], 1.0: [4, 5], 0.0: []}
    for fraction, rows in expected.items():
        gate = uncertainty_gate(main, aux, fraction)
        assert gate.nonzero().flatten().tolist() == rows, fraction
    # ties rank in order of appearance: main (1, 1, 0) ranks (1, 2, 3); aux (0, 1, 1) ranks (3, 1, 2)
    torch.testing.assert_close(
        uncertainty(torch.tensor([1.0, 1.0, 0.0]), [torch.tensor([0.0, 1.0, 1.0])]),
        torch.tensor([-2.0, 1.0, 1.0], dtype=torch.float64),
    )


def _loop_advantages(rewards: list[float], groups: list[str], feats: torch.Tensor) -> list[float]:
    """A plain per-group loop of the published formula, to check the CLI's vectorised one."""
    out = [0.0] * len(rewards)
    for g in set(groups):
        idx = [i for i, x in enumerate(groups) if x == g]
        mean = sum(rewards[i] for i in idx) / len(idx)
        unit = {i: feats[i].double().flatten() / feats[i].double().flatten().norm() for i in idx}
        d = {i: min(1 - float(unit[i] @ unit[j]) for j in idx if j != i) for i in idx}
        mean_d = sum(d.values()) / len(idx)
        for i in idx:
            gap = rewards[i] - mean
            out[i] = gap if gap < 0 else gap * d[i] / mean_d
    return out


def _ranks(values: list[float]) -> list[int]:
    order = sorted(range(len(values)), key=lambda i: (-values[i], i))
    ranks = [0] * len(values)
    for r, i in enumerate(order, start=1):
        ranks[i] = r
    return ranks


def test_advantage_cli_gardo_estimator_and_gate(staged: dict[str, Path], tmp_path: Path) -> None:
    rewards = tmp_path / "r"
    run(
        "score",
        "--in",
        str(staged["samples"]),
        "--reward",
        "jpeg_compressibility",
        "--reward",
        "jpeg_incompressibility=0",
        "--out",
        str(rewards),
    )
    result = run(
        "advantage",
        *ins(staged["samples"], rewards),
        "--estimator",
        "gardo",
        "--gate-reward",
        "jpeg_incompressibility",
        "--gate-fraction",
        "0.5",
        "--out",
        str(tmp_path / "a"),
    )
    data = open_inputs([staged["samples"], rewards, tmp_path / "a"]).read_all()
    r = data["reward"].double().tolist()
    want = _loop_advantages(r, list(data["group_id"]), data["final_latent"])
    torch.testing.assert_close(data["advantages"][:, 0].double(), torch.tensor(want, dtype=torch.float64))
    aux = data["reward.jpeg_incompressibility"].double().tolist()
    u = [m - a for m, a in zip(_ranks(r), _ranks(aux))]
    candidates = sorted(x for x in u if x >= 0)
    pos = 0.5 * (len(candidates) - 1)
    lo, hi = candidates[math.floor(pos)], candidates[math.ceil(pos)]
    threshold = lo + (hi - lo) * (pos - math.floor(pos))
    assert data["kl_gate"].tolist() == [x > threshold for x in u]
    assert result["kl_gated"] == sum(x > threshold for x in u) > 0


def _metrics(out: Path) -> list[dict]:
    return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]


def _lora(out: Path) -> dict[str, torch.Tensor]:
    return load_file(out / "pytorch_lora_weights.safetensors")


def test_gated_kl_penalises_only_gated_rows(staged: dict[str, Path], tmp_path: Path) -> None:
    """No row gated: exactly the update without KL; some gated: a KL term that moves the weights."""
    common = ["--estimator", "grpo", "--gate-reward", "jpeg_incompressibility"]
    rewards = tmp_path / "r"
    run("score", "--in", str(staged["samples"]), "--reward", "jpeg_compressibility", "--reward",
        "jpeg_incompressibility=0", "--out", str(rewards))  # fmt: skip
    for name, fraction in (("none", "0"), ("some", "1")):
        run("advantage", *ins(staged["samples"], rewards), *common, "--gate-fraction", fraction,
            "--out", str(tmp_path / f"a-{name}"))  # fmt: skip
    base = [
        "update",
        "--model",
        str(staged["model"]),
        "--lora-rank",
        "4",
        "--lora-alpha",
        "8",
        "--lr",
        "1e-2",
    ]
    for name, adv, beta in (("free", "a-none", "0"), ("none", "a-none", "1"), ("some", "a-some", "1")):
        run(*base, *ins(staged["samples"], staged["logprobs"], tmp_path / adv), "--beta", beta,
            "--out", str(tmp_path / f"p-{name}"))  # fmt: skip
    free, none, some = (_lora(tmp_path / f"p-{n}") for n in ("free", "none", "some"))
    assert all(torch.equal(free[k], none[k]) for k in free)
    assert all(m["actor/kl_loss"] == 0.0 for m in _metrics(tmp_path / "p-none"))
    assert _metrics(tmp_path / "p-some")[-1]["actor/kl_loss"] > 0
    assert any(not torch.equal(free[k], some[k]) for k in free)


def test_reference_resets_at_the_stated_interval(staged: dict[str, Path], tmp_path: Path) -> None:
    """--ref-reset-every 2: updates 1 and 2 keep the base model as reference; update 3 (2 updates since
    the start) resets it to the weights it starts from, so its first KL is 0 and its saved reference
    equals update 2's adapter."""
    reset = ["--beta", "0.04", "--ref-reset-every", "2", "--lr", "1e-2"]
    p1, p2, p3 = (tmp_path / f"p{i}" for i in (1, 2, 3))
    run(*staged_update_args(staged, p1, *reset))
    run(*staged_update_args(staged, p2, "--adapter", str(p1), *reset))
    run(*staged_update_args(staged, p3, "--adapter", str(p2), *reset))
    m1, m2, m3 = (_metrics(p) for p in (p1, p2, p3))
    assert [m[-1]["ref/reset"] for m in (m1, m2, m3)] == [0.0, 0.0, 1.0]
    assert [m[-1]["ref/age"] for m in (m1, m2, m3)] == [1.0, 2.0, 1.0]
    assert not (p2 / "trainer_state" / "ref_weights.safetensors").exists()
    ref = load_file(p3 / "trainer_state" / "ref_weights.safetensors")
    before = _lora(p2)
    keys = [k for k in ref if "lora" in k]
    assert keys and all(torch.equal(ref[k], before["transformer." + k.replace(".default", "")]) for k in keys)
    assert m2[0]["actor/kl_loss"] > 0 and m3[0]["actor/kl_loss"] == 0.0


def test_reference_resets_after_a_kl_above_the_bound(staged: dict[str, Path], tmp_path: Path) -> None:
    """--ref-reset-kl 0: update 1's second step has KL > 0, so update 2 starts by resetting."""
    p1, p2 = tmp_path / "p1", tmp_path / "p2"
    run(*staged_update_args(staged, p1, "--beta", "0.04", "--ref-reset-kl", "0", "--lr", "1e-2"))
    run(*staged_update_args(staged, p2, "--adapter", str(p1), "--beta", "0.04", "--ref-reset-kl", "1e9"))
    assert _metrics(p1)[-1]["actor/kl_loss"] > 0 and _metrics(p1)[-1]["ref/reset"] == 0.0
    assert _metrics(p2)[-1]["ref/reset"] == 1.0 and _metrics(p2)[0]["actor/kl_loss"] == 0.0
    ref = load_file(p2 / "trainer_state" / "ref_weights.safetensors")
    first = _lora(p1)
    assert all(torch.equal(v, first["transformer." + k.replace(".default", "")]) for k, v in ref.items())


@pytest.mark.parametrize(("rows", "expected"), [(None, 2.5), ([True, False], 1.0), ([False, True], 4.0)])
def test_nft_kl_averages_over_the_gated_rows(rows: list[bool] | None, expected: float) -> None:
    """GARDO on DiffusionNFT: the reference-velocity MSE over the gated rows (rows 1 and 2 differ from the
    reference by 1 and 2 in every dim)."""
    from stages.update.family_losses import nft_loss

    v = torch.tensor([[1.0, 1.0], [2.0, 2.0]])
    gate = None if rows is None else torch.tensor(rows)
    _, m = nft_loss(v, v, torch.zeros_like(v), torch.zeros_like(v), torch.ones_like(v), 0.5,
                    torch.full((2,), 0.5), beta=1.0, kl_beta=0.1, kl_rows=gate)  # fmt: skip
    assert m["actor/kl_loss"] == pytest.approx(expected)
