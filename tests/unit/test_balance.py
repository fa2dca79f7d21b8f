import math

import pytest
import torch
from conftest import perturb_hybrid, tiny_model

import hybrid_scale as hs
from hybrid_scale.stages import balance


def test_paired_bootstrap_and_verdicts():
    a = {"x": [1.0, 0.0, 1.0, 1.0] * 10, "y": [0.0, 1.0] * 20}
    same = balance.paired_bootstrap(a, a, 200, seed=0)
    assert same["avg"] == {"delta": 0.0, "lo": 0.0, "hi": 0.0}
    assert balance.verdict(same["avg"], 0.01) == "LA bypassed"
    better = balance.paired_bootstrap({"x": [1.0] * 40, "y": [1.0] * 40}, {"x": [0.0] * 40, "y": [0.0] * 40}, 200, 0)
    assert better["avg"]["delta"] == 1.0 and balance.verdict(better["avg"], 0.01) == "LA used"
    worse = balance.paired_bootstrap({"x": [0.0] * 40}, {"x": [1.0] * 20 + [0.0] * 20}, 500, 0)
    assert worse["x"]["delta"] == -0.5 and worse["x"]["hi"] < 0
    assert balance.verdict(worse["avg"], 0.01) == "LA harmful"
    noisy = balance.paired_bootstrap({"x": [1.0, 0.0] * 10}, {"x": [0.0, 1.0] * 5 + [0.0] * 10}, 500, 0)
    assert noisy["x"]["lo"] < 0.01 < noisy["x"]["hi"] and balance.verdict(noisy["avg"], 0.01) == "inconclusive"
    # paired: the same resampled items for both sides, so a constant shift has a zero-width CI
    shifted = balance.paired_bootstrap({"x": [1.0] * 30}, {"x": [0.0] * 30}, 100, 3)
    assert shifted["x"]["lo"] == shifted["x"]["hi"] == 1.0
    # fixed seed: the same CI twice
    assert balance.paired_bootstrap(a, {"x": a["y"] * 1, "y": a["x"]}, 300, 7) == balance.paired_bootstrap(
        a, {"x": a["y"] * 1, "y": a["x"]}, 300, 7
    )


def test_perplexity_by_bucket_matches_a_direct_computation():
    model = tiny_model("llama")
    seqs = torch.randint(3, 128, (2, 40), generator=torch.Generator().manual_seed(0))
    ppl = balance.perplexity_by_bucket(model, seqs, [0, 8, 40])
    with torch.no_grad():
        logits = model(seqs).logits[:, :-1]
    nll = torch.nn.functional.cross_entropy(logits.reshape(-1, 128), seqs[:, 1:].reshape(-1), reduction="none")
    nll = nll.view(2, 39)
    assert list(ppl) == ["0-8", "8-40"]
    assert ppl["0-8"] == pytest.approx(math.exp(nll[:, :7].mean().item()), rel=1e-5)  # positions 1..7
    assert ppl["8-40"] == pytest.approx(math.exp(nll[:, 7:].mean().item()), rel=1e-5)


def test_la_share_is_zero_inside_the_window_and_grows():
    model = perturb_hybrid(hs.convert_model(tiny_model("llama"), {"window": 8}))
    ids = torch.randint(3, 128, (1, 64), generator=torch.Generator().manual_seed(1))
    out = balance.la_share(model, ids, [0, 8, 32, 64])
    assert sorted(out["share"]) == [0, 1]
    for layer in (0, 1):
        share, effect = out["share"][layer], out["effect"][layer]
        assert share["0-8"] == [0.0] * 4 and effect["0-8"] == [0.0] * 4  # n < w: hybrid is exact softmax
        assert all(0 < s < 1 for s in share["8-32"]) and all(e > 0 for e in effect["8-32"])
        assert sum(share["32-64"]) > sum(share["8-32"])  # more keys have left the window
