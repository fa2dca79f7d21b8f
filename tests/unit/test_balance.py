import math

import pytest
import torch
from conftest import perturb_hybrid, tiny_model

import hybrid_scale as hs
from hybrid_scale import measure
from hybrid_scale.evaluate import balance


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
    ppl = measure.perplexity_by_bucket(model, seqs, [0, 8, 40])
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


def test_each_memory_has_its_share_of_the_output():
    """The balance report's shares of window, sinks, cache and LA add up to 1 per bucket; without a cache the cache's
    is 0 and the LA's is the LA share; with one the cache takes a share past the window, from the LA's."""
    model = perturb_hybrid(hs.convert_model(tiny_model("llama"), {"window": 8, "hybrid_sinks": True, "sinks": 2}))
    ids = torch.randint(3, 128, (1, 64), generator=torch.Generator().manual_seed(1))
    plain = balance.la_share(model, ids, [0, 8, 32, 64])
    hs.models.convert.set_cache(model, 6)
    cached = balance.la_share(model, ids, [0, 8, 32, 64])
    for layer in (0, 1):
        for bucket in ("0-8", "8-32", "32-64"):
            for out in (plain, cached):
                assert sum(out["memories"][layer][bucket].values()) == pytest.approx(1.0)
            assert plain["memories"][layer][bucket]["cache"] == 0.0
            la = sum(plain["share"][layer][bucket]) / 4
            assert plain["memories"][layer][bucket]["la"] == pytest.approx(la, rel=1e-5)
        assert cached["memories"][layer]["32-64"]["cache"] > 0.01
        assert cached["memories"][layer]["32-64"]["la"] < plain["memories"][layer]["32-64"]["la"]


def test_beyond_window_verdict_against_swa_only_and_the_strongest_mode_without_la():
    """Blocks of [NLL sum, tokens], paired by block: "LA used" needs the hybrid better than its own swa_only, and it
    says so when a cheaper mode without LA (here swa_sinks) does as well or better."""
    g = torch.Generator().manual_seed(0)
    base = (torch.rand(40, generator=g) * 16 + 40).tolist()  # NLL sums of 16-token blocks, ~3 nats/token

    def shifted(nats_per_token):
        return [[s + 16 * nats_per_token, 16] for s in base]

    def run(**modes):
        return balance.beyond_window(modes, 64, 0.02, 200, seed=0)

    out = run(swa_only=shifted(1.0), swa_sinks=shifted(0.0), hybrid=shifted(-0.5))
    assert out["against"] == "swa_sinks" and out["tokens"] == 640 and out["verdict"] == "LA used"
    assert out["delta"] == pytest.approx(0.5) and out["lo"] == pytest.approx(0.5) and out["hi"] == pytest.approx(0.5)
    assert out["ratio"] == pytest.approx(math.exp(-0.5)) and out["swa_only"]["ratio"] == pytest.approx(math.exp(-1.5))
    assert out["swa_only"]["delta"] == pytest.approx(1.5)
    assert run(swa_only=shifted(1.0), swa_sinks=shifted(0.0), hybrid=shifted(0.5))["verdict"] == (
        "LA used; swa_sinks without LA is better"
    )
    assert run(swa_only=shifted(1.0), swa_sinks=shifted(0.0), hybrid=shifted(0.0))["verdict"] == (
        "LA used; no better than swa_sinks without LA"
    )
    assert run(swa_only=shifted(0.0), swa_sinks=shifted(0.5), hybrid=shifted(0.0))["verdict"] == "LA bypassed"
    worse = run(swa_only=shifted(0.0), hybrid=shifted(0.5))
    assert worse["against"] == "swa_only" and worse["verdict"] == "LA harmful" and worse["ratio"] > 1
    noisy = [[s + (-40.0 if i % 2 else 39.0), 16] for i, s in enumerate(base)]  # +-2.5 nats/token, mean ~0
    assert run(swa_only=shifted(0.0), hybrid=noisy)["verdict"] == "inconclusive"
    assert run(none=shifted(5.0), hybrid=shifted(0.0))["verdict"] == "LA used"  # no swa_only: against `none` alone
    assert run(hybrid=shifted(0.0), la_only=shifted(1.0)) is None


def test_blocks_beyond_the_window_cover_exactly_the_tokens_past_it():
    nll = torch.arange(2 * 40, dtype=torch.float64).view(2, 40)  # column t predicts position t + 1
    blocks = balance.blocks_beyond(nll, 8)
    assert [c for _, c in blocks] == [16, 16, 1, 16, 16, 1]  # positions 8..40 = columns 7..39, per sequence
    assert sum(s for s, _ in blocks) == nll[:, 7:].sum().item()
    ppl = measure.by_bucket(nll, [0, 8, 40])  # [a, b) of predicted positions 1..40: position 40 is past the end
    assert ppl == {"0-8": math.exp(nll[:, :7].mean()), "8-40": math.exp(nll[:, 7:39].mean())}


def test_gamma_fit_from_one_attention_pass_equals_refitting_through_the_attention():
    """export.fit_gamma runs the attention once and then steps gamma in closed form: the hybrid output at any gamma
    equals the attention's, and 15 Adam steps land where 15 steps through the full attention land."""
    from hybrid_scale.attention.layer import Projections, hybrid_layers
    from hybrid_scale.export import gamma as export

    model = perturb_hybrid(hs.convert_model(tiny_model("llama"), {"window": 8}))
    m = hybrid_layers(model)[0]
    g = torch.Generator().manual_seed(3)
    hidden = torch.randn(2, 40, model.config.hidden_size, generator=g)
    rope = model.model.rotary_emb(hidden, torch.arange(40)[None])
    with torch.no_grad():
        q, k, v, fq, fk = m.project(hidden, rope)[:5]
    parts = export.gamma_parts(m, Projections(q, k, v, fq, fk))
    for gamma in (torch.full((4,), 0.7), torch.rand(4, generator=g)):
        want = m.attend(q, k, v, fq, fk, gamma=gamma, mode="hybrid")
        torch.testing.assert_close(export.hybrid_at(gamma, parts), want, rtol=1e-5, atol=1e-6)
    target = m.attend(q, k, v, fq, fk, gamma=torch.full((4,), 0.9), mode="swa_only").detach()
    logit, before, after = export.fit_gamma(m, Projections(q, k, v, fq, fk), target, steps=15)
    ref = m.gamma_logit.detach().clone().requires_grad_(True)  # the same fit through the full attention
    opt = torch.optim.Adam([ref], lr=0.1)
    for _ in range(15):
        opt.zero_grad()
        (m.attend(q, k, v, fq, fk, gamma=torch.sigmoid(ref), mode="hybrid") - target).pow(2).mean().backward()
        opt.step()
    torch.testing.assert_close(logit, ref.detach(), rtol=1e-4, atol=1e-4)
    assert after < before
