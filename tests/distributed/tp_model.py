"""Run under torchrun with 2 ranks (tests/distributed/test_tensor_parallel.py): a tiny model split over 2
tensor-parallel ranks against the same model whole on each rank. Prints one JSON line of measured differences."""

import copy
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from conftest import perturb_hybrid, tiny_model  # noqa: E402

import hybrid_scale as hs  # noqa: E402
from hybrid_scale.attention.settings import MODES  # noqa: E402
from hybrid_scale.distributed import runtime, tensor_parallel  # noqa: E402
from hybrid_scale.models.convert import hybrid_layers, set_cache, set_modes  # noqa: E402


def lora(model):
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(3)
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "down_proj"]
    peft_model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=targets))
    with torch.no_grad():
        for n, p in peft_model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.1)
    return peft_model


def main(arch: str, rt) -> dict:
    out = {"arch": arch}
    whole = perturb_hybrid(hs.convert_model(tiny_model(arch, tie_word_embeddings=True), {"window": 4, "sinks": 2}))
    split = tensor_parallel.apply(copy.deepcopy(whole), rt)
    out["bytes_ratio"] = tensor_parallel.parameter_bytes(split) / tensor_parallel.parameter_bytes(whole)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 128, (2, 16), generator=g)
    out["logits"] = {}
    with torch.no_grad():
        for mode in MODES:
            set_modes(whole, mode)
            set_modes(split, mode)
            ref, got = whole(ids).logits, split(ids).logits
            out["logits"][mode] = (ref - got).abs().max().item()
        set_modes(whole, "hybrid")
        set_modes(split, "hybrid")
        for m in (*hybrid_layers(whole).values(), *hybrid_layers(split).values()):
            m.hybrid_sinks = True  # the hybrid with its own sinks: the split keeps them per rank's heads
        out["logits"]["hybrid+sinks"] = (whole(ids).logits - split(ids).logits).abs().max().item()
        part = hs.convert_model(tiny_model(arch), {"window": 4, "sinks": 2, "layers": [1]})  # layer 0 stays softmax
        part_split = tensor_parallel.apply(copy.deepcopy(part), rt)
        out["partial"] = (part(ids).logits - part_split(ids).logits).abs().max().item()
        kw = dict(max_new_tokens=20, do_sample=False, pad_token_id=0)
        mask = torch.ones_like(ids)
        mask[1, :3] = 0  # left padding on one row
        a = whole.generate(ids, attention_mask=mask, **kw)
        b = split.generate(ids, attention_mask=mask, **kw)
        out["decode_equal"] = bool(torch.equal(a, b))
        for m in (*hybrid_layers(whole).values(), *hybrid_layers(split).values()):
            m.hybrid_sinks = False
        out["decode_tokens"] = int(a.shape[1] - ids.shape[1])
        out["cache"] = with_cache(whole, split, ids)
    # gradients of LoRA (every factor) and of phi/gamma/rho, whole vs split, in hybrid mode with the LA's decay (rho
    # per KV head: each rank keeps its KV heads' rho, like gamma); and that model's logits and decode, whole vs split
    base = perturb_hybrid(hs.convert_model(tiny_model(arch), {"window": 4, "sinks": 2, "la_decay": True}))
    with torch.no_grad():
        for m in hybrid_layers(base).values():
            m.la_decay_rho.copy_(torch.tensor([0.1, 0.3]))
        decay_split = tensor_parallel.apply(copy.deepcopy(base), rt)
        out["logits"]["hybrid+decay"] = (base(ids).logits - decay_split(ids).logits).abs().max().item()
        kw = dict(max_new_tokens=12, do_sample=False, pad_token_id=0)
        out["decode_equal"] &= bool(torch.equal(base.generate(ids, **kw), decay_split.generate(ids, **kw)))
    ref_model = lora(copy.deepcopy(base))
    tp_model = lora(copy.deepcopy(base))
    for m in (ref_model, tp_model):
        for n, p in m.named_parameters():
            if "feature_map" in n or "gamma_logit" in n or "la_decay_rho" in n:
                p.requires_grad_(True)
    tensor_parallel.apply(tp_model, rt)
    heads = tensor_parallel.head_sharded(tp_model)
    loss_ref = ref_model(input_ids=ids, labels=ids).loss
    loss_ref.backward()
    with tensor_parallel.vocab_parallel_loss(tp_model):  # as in training: the cross-entropy on each rank's columns
        result = tp_model(input_ids=ids, labels=ids)
        result.loss.backward()
    out["train_logits"] = [type(result.logits).__name__, list(tensor_parallel.local(result.logits).shape)]
    out["loss"] = abs(loss_ref.item() - tensor_parallel.whole(result.loss, None, rt).item())
    grads, n = 0.0, 0
    ref_named = dict(ref_model.named_parameters())
    for name, p in tp_model.named_parameters():
        if not p.requires_grad:
            continue
        full = tensor_parallel.whole(p.grad, tensor_parallel.placement(p, heads), rt)
        grads = max(grads, (full - ref_named[name].grad).abs().max().item())
        n += 1
    out["grads"], out["trainable"] = grads, n
    out["delta"] = gated_delta(arch, rt, ids)
    return out


def with_cache(whole, split, ids) -> dict:
    """The cache of exact keys (3 per KV head: keys leave the 4-token window and some lose to it, so the LA takes
    them) under each selection, whole vs split: the logits of the modes that read it and a greedy decode. The models
    are left with the cache off and in hybrid mode."""
    res, kw = {"logits": {}, "decode_equal": True}, dict(max_new_tokens=12, do_sample=False, pad_token_id=0)
    for select in ("attention", "self_recall", "recency"):
        for m in (whole, split):
            set_cache(m, 3, select)
        for mode in ("hybrid", "swa_sinks", "cache_only"):
            set_modes(whole, mode)
            set_modes(split, mode)
            res["logits"][f"{mode}+{select}"] = (whole(ids).logits - split(ids).logits).abs().max().item()
        set_modes(whole, "hybrid")
        set_modes(split, "hybrid")
        res["decode_equal"] &= bool(torch.equal(whole.generate(ids, **kw), split.generate(ids, **kw)))
    for m in (whole, split):
        set_cache(m, 0)
    return res


def gated_delta(arch: str, rt, ids) -> dict:
    """The gated delta-rule LA (with its short convolution, the mix gate and the own sinks), whole vs split: logits in
    every mode, greedy decode, and the gradients of LoRA and of its gates, convolutions and gamma."""
    settings = {"window": 4, "sinks": 2, "la_kind": "gated_delta", "la_conv": 3, "la_combine": "mix",
                "hybrid_sinks": True, "la_qk_map": True}  # fmt: skip
    whole = perturb_hybrid(hs.convert_model(tiny_model(arch), settings))
    split = tensor_parallel.apply(copy.deepcopy(whole), rt)
    res = {"logits": {}}
    with torch.no_grad():
        for mode in MODES:
            set_modes(whole, mode)
            set_modes(split, mode)
            res["logits"][mode] = (whole(ids).logits - split(ids).logits).abs().max().item()
        set_modes(whole, "hybrid")
        set_modes(split, "hybrid")
        kw = dict(max_new_tokens=12, do_sample=False, pad_token_id=0)
        res["decode_equal"] = bool(torch.equal(whole.generate(ids, **kw), split.generate(ids, **kw)))
        res["cache"] = with_cache(whole, split, ids)
    ref_model, tp_model = lora(copy.deepcopy(whole)), lora(copy.deepcopy(whole))
    for m in (ref_model, tp_model):
        for n, p in m.named_parameters():
            if any(k in n for k in ("la_gates", "la_conv", "la_map")):  # (gamma: unused by la_combine=mix)
                p.requires_grad_(True)
    tensor_parallel.apply(tp_model, rt)
    heads = tensor_parallel.head_sharded(tp_model)
    ref_model(input_ids=ids, labels=ids).loss.backward()
    with tensor_parallel.vocab_parallel_loss(tp_model):
        tp_model(input_ids=ids, labels=ids).loss.backward()
    ref_named, grads, n = dict(ref_model.named_parameters()), 0.0, 0
    for name, p in tp_model.named_parameters():
        if p.requires_grad:
            full = tensor_parallel.whole(p.grad, tensor_parallel.placement(p, heads), rt)
            grads, n = max(grads, (full - ref_named[name].grad).abs().max().item()), n + 1
    res["grads"], res["trainable"] = grads, n
    return res


if __name__ == "__main__":
    rt = runtime.init("cpu", tp=2)
    results = [main(arch, rt) for arch in sys.argv[1:]]  # one process start for every architecture
    if rt.main:
        print(json.dumps(results))
