"""The passkey probe: seeded prompts with the key where the docstring says, scored teacher-forced."""

import pytest
import torch
from conftest import tiny_model
from transformers import AutoTokenizer

from hybrid_scale.data import passkey
from hybrid_scale.evaluate import retrieval


def _tokenizer(smollm2):
    return AutoTokenizer.from_pretrained(smollm2.model)


def test_prompts_are_seeded_and_put_the_key_at_the_distance(smollm2):
    tok = _tokenizer(smollm2)
    filler = tok.encode("Plain filler words about nothing in particular. " * 120)
    items = passkey.probes(tok, filler, [8, 40], trials=3, seed=7, lead=20)
    assert [p.distance for p in items] == [8] * 3 + [40] * 3
    assert [p.key for p in items] == [p.key for p in passkey.probes(tok, filler, [8, 40], 3, 7, 20)]
    assert len({p.key for p in items}) == 6 and all(len(p.key) == passkey.DIGITS for p in items)
    question = tok.encode(passkey.QUESTION, add_special_tokens=False)
    for p in items:
        text = tok.decode(p.ids)
        assert text.endswith(f"{passkey.QUESTION} {p.key}") and text.count(p.key) == 3
        head = tok.encode(passkey.NEEDLE.format(key=p.key), add_special_tokens=False)
        assert tok.decode(head[-5:]) == p.key  # the key's digits end the needle's head
        assert p.ids[20 : 20 + len(head) + 1] == head + tok.encode(".")  # after the lead filler
        first_answer = len(p.ids) - p.answer
        assert first_answer - (20 + len(head) - 1) == p.distance  # from the key's last token
        assert p.ids[first_answer - len(question) : first_answer] == question


def test_too_short_a_distance_or_filler_is_a_clear_error(smollm2):
    tok = _tokenizer(smollm2)
    try:
        passkey.probes(tok, list(range(100)), [5], 1, 0)
        raise AssertionError("no error")
    except ValueError as e:
        assert "passkey distances must be >= 6" in str(e)
    try:
        passkey.probes(tok, list(range(100)), [200], 1, 0)
        raise AssertionError("no error")
    except ValueError as e:
        assert "needs 226 tokens of filler, the held-out text has 100" in str(e)


def _cut_from(filler: list[int], head: list[int], tail: list[int]) -> int | None:
    """Where `head + tail` is one contiguous run of `filler` (its start), else None."""
    run = head + tail
    starts = (s for s, t in enumerate(filler) if t == run[0])
    return next((s for s in starts if filler[s : s + len(run)] == run), None)


def test_the_needle_sits_in_the_held_out_text_at_window_multiples_and_past_the_training_length(smollm2):
    """Issue 66's probes: at 2, 4, 8 and 16 windows and past the training length, 40 prompts per distance (nothing
    caps eval.passkey_trials), each a contiguous stretch of the held-out report text (natural text, never a repeated
    filler) with the needle (passkey) or the pair line (recall) after its first `lead` tokens, and the question
    after the rest; every prompt cut from its own place."""
    from hybrid_scale.config import load_config
    from hybrid_scale.data import corpus

    window, seq_len, trials, lead = 16, 1024, 40, 20
    distances = [2 * window, 4 * window, 8 * window, 16 * window, seq_len + 100]
    cfg = load_config(
        overrides=[f"attention.window={window}", f"data.seq_len={seq_len}", f"eval.passkey_trials={trials}",
                   f"eval.passkey_distances={distances}", "eval.recall_pairs=4"]
    )  # fmt: skip
    tok = _tokenizer(smollm2)
    text = corpus.report_text(cfg)[0]
    filler = tok.encode(text)
    assert len(set(text.split("\n\n"))) > 100  # natural documents, not one repeated
    items = passkey.probes(tok, filler, list(cfg.eval.passkey_distances), cfg.eval.passkey_trials, cfg.seed, lead)
    assert [p.distance for p in items] == [d for d in distances for _ in range(trials)]
    question = tok.encode(passkey.QUESTION, add_special_tokens=False)
    starts = {}
    for p in items:
        needle = tok.encode(passkey.NEEDLE.format(key=p.key), add_special_tokens=False) + tok.encode(".")
        assert p.ids[lead : lead + len(needle)] == needle
        assert p.ids[len(p.ids) - p.answer - len(question) :] == question + tok.encode(f" {p.key}")
        start = _cut_from(filler, p.ids[:lead], p.ids[lead + len(needle) : len(p.ids) - p.answer - len(question)])
        assert start is not None, tok.decode(p.ids)
        starts.setdefault(p.distance, set()).add(start)
    assert all(len(s) > 0.9 * trials for s in starts.values()), {d: len(s) for d, s in starts.items()}
    recall = passkey.recall_probes(tok, filler, distances, trials, cfg.seed, passkey.Recall(4, lead))
    assert [p.distance for p in recall] == [d for d in distances for _ in range(trials)]
    starts = set()
    for p in recall:
        line = len(p.ids) - lead - (p.distance - 1) - p.answer  # (the line's tokens: the rest is the distance's)
        assert tok.decode(p.ids[lead : lead + line]).count(":") == 4
        start = _cut_from(filler, p.ids[:lead], p.ids[lead + line : lead + line + p.distance - 8])  # (query < 7)
        assert start is not None, tok.decode(p.ids)
        starts.add(start)
    assert len(starts) > 0.9 * len(recall)


def test_scores_are_the_teacher_forced_answer_and_greedy_generation_agrees():
    model = tiny_model("llama", vocab_size=128)
    g = torch.Generator().manual_seed(0)
    items = [passkey.Probe(8, "k", torch.randint(3, 128, (30,), generator=g).tolist(), 4) for _ in range(3)]
    with torch.no_grad():
        full = model(torch.tensor([p.ids for p in items])).logits
    logp = torch.log_softmax(full[:, -5:-1], -1)
    want = logp.gather(-1, torch.tensor([p.ids[-4:] for p in items])[..., None])[..., 0].sum(-1)
    got = retrieval.score(model, items, "cpu")
    assert [round(ll, 4) for ll, _ in got] == [round(x, 4) for x in want.tolist()]
    # make one prompt's answer what greedy decoding produces: exact match must then be True, and False elsewhere
    prompt = torch.tensor([items[0].ids[:-4]])
    greedy = model.generate(prompt, max_new_tokens=4, do_sample=False, pad_token_id=0)[0, -4:].tolist()
    items[0].ids = items[0].ids[:-4] + greedy
    got = retrieval.score(model, items, "cpu")
    assert got[0][1] is True and not got[1][1]
    summary = retrieval.score_probes(model, items, "cpu", tokens_per_batch=60)  # 2 prompts per forward
    assert summary["8"]["trials"] == 3 and summary["8"]["exact"] == 1 / 3


def test_sanity_flags_a_window_mode_that_retrieves_beyond_the_window():
    hit, miss = {"exact": 0.5, "loglik": -1.0}, {"exact": 0.0, "loglik": -11.0}
    assert retrieval.sanity({"swa_only": {"16": hit, "64": miss}, "base": {"64": hit}}, 32) == []
    assert retrieval.sanity({"swa_sinks": {"64": hit}}, 32) == [
        "swa_sinks retrieved 50% of keys at distance 64 >= window 32"
    ]
    # with the cache of exact keys (issue 66) a window mode may retrieve past its window: no leak
    assert retrieval.sanity({"swa_sinks+cache": {"64": hit}, "swa_only+cache": {"64": hit}}, 32) == []


def test_the_probe_scores_the_evaluated_modes_unless_told_otherwise():
    """eval.passkey_modes unset: the probe runs in the evaluated modes only (`evaluate eval.modes=[base]` no longer
    also runs it in hybrid, swa_only, swa_sinks and la_only); set, it is what was asked; no distances or trials: no
    probe. The evaluation's cells count it the same way, and plan states it with its estimated time."""
    from hybrid_scale.config import load_config
    from hybrid_scale.evaluate.cells import count_cells
    from hybrid_scale.preflight.plan import plan

    base = load_config(overrides=["eval.modes=[base]", "eval.tasks=[arc_challenge]"])
    assert passkey.probe_modes(base.eval) == ["base"]
    assert count_cells(base.eval) == 1 + 1 + 1 + 2  # the task, perplexity, the LA share, the two probes in base
    no_recall = load_config(overrides=["eval.modes=[base]", "eval.tasks=[arc_challenge]", "eval.recall_pairs=0"])
    assert count_cells(no_recall.eval) == 1 + 1 + 1 + 1  # the passkey probe alone
    twins = load_config(overrides=["eval.modes=[hybrid,swa_only,swa_sinks]", "eval.tasks=[piqa,arc_easy]"]).eval
    assert count_cells(twins) == 3 * 2 + 3 + 1 + 3 * 2
    assert count_cells(twins, keeps_sinks=True) == 2 * 2 + 2 + 1 + 2 * 2  # swa_sinks is swa_only: no cells of its own
    asked = load_config(overrides=["eval.modes=[base]", "eval.passkey_modes=[hybrid,swa_sinks]"])
    assert passkey.probe_modes(asked.eval) == ["hybrid", "swa_sinks"]
    assert passkey.probe_modes(load_config(overrides=["eval.passkey_trials=0"]).eval) == []
    rows = {q: v for s, q, v in plan(base).rows if s == "evaluate"}
    # 5 distances x 20 prompts; (32 + 128 + 512 + 1024 + 2048) + 5 x (32 lead + 25) tokens each = 80,580; the recall
    # probe as many again
    assert rows["passkey probe"].startswith(
        "200 prompts (with the recall probe's) x 1 mode(s) (eval.passkey_modes unset: the evaluated modes): base; "
        "161 k tokens, ~"
    ), rows["passkey probe"]
    assert "no passkey" not in rows["passkey probe"] and "passkey probe" not in dict.fromkeys(
        q for s, q, _ in plan(load_config(overrides=["eval.passkey_distances=[]"])).rows
    )


def test_recall_prompts_state_several_pairs_and_ask_one_at_the_distance(smollm2):
    """The associative-recall probe: a line of key-value pairs after the lead filler, filler, then one key again; the
    answer is its value, `distance` tokens after the line's last token; seeded; keys are words of the text."""
    tok = _tokenizer(smollm2)
    text = "Gardens river mountain orchard lantern harvest meadow quarry village thunder. " * 60
    filler = tok.encode(text)
    items = passkey.recall_probes(tok, filler, [8, 40], trials=4, seed=3, layout=passkey.Recall(4, 20))
    again = passkey.recall_probes(tok, filler, [8, 40], trials=4, seed=3, layout=passkey.Recall(4, 20))
    assert [p.ids for p in items] == [p.ids for p in again]
    assert [p.distance for p in items] == [8] * 4 + [40] * 4
    for p in items:
        assert len(p.key) == passkey.RECALL_DIGITS and p.key.isdigit()
        body = tok.decode(p.ids[20:])
        line = body.split(".")[0]
        pairs = dict(x.strip().split(": ") for x in line.split(","))
        assert len(pairs) == 4 and all(k.istitle() and k.lower() in text.lower() for k in pairs)
        asked = tok.decode(p.ids[-p.answer - 3 : -p.answer]).strip().rstrip(":").split()[-1]
        assert pairs[asked] == p.key and tok.decode(p.ids[-p.answer :]) == f" {p.key}"
        line_end = 20 + len(tok.encode(line + ".", add_special_tokens=False)) - 1
        assert len(p.ids) - p.answer - line_end == p.distance  # from the line's last token to the first answer token
    assert len({p.key for p in items}) > 1


def test_recall_needs_enough_filler_and_words(smollm2):
    tok = _tokenizer(smollm2)
    with pytest.raises(ValueError, match=r"recall distance 500 needs \d+ tokens of filler, the held-out text has"):
        passkey.recall_probes(
            tok, tok.encode("Gardens river mountain orchard lantern. " * 10), [500], 1, 0, passkey.Recall(4, 20)
        )
    with pytest.raises(ValueError, match="needs 4 distinct words"):
        passkey.recall_probes(tok, tok.encode("a b c " * 200), [50], 1, 0, passkey.Recall(4, 20))
