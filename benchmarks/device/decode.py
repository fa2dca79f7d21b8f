"""Part 3, decode: decode throughput where a hybrid should win, the serving case (issue 67): a batch of `batch` (32)
sequences, one new token each per step, through 4 layers of Llama-3-8B's shape (hidden 4096, 32 heads, 8 KV heads,
head dim 128, intermediate 14336, vocabulary 128256; random weights): the embedding, the decoder layers, the norm and
lm_head, captured in a CUDA graph and timed over `replays` replays. At B 1 the weights' reads (about 2.8 GB a step)
hide the KV cache's; at B 32 and 32k the cache reads about 17 GB a step, the hybrid's state a few hundred MB.

- kv_cache: the unconverted model's layers over transformers' StaticCache of exactly ctx slots, filled with random
  keys and values; SDPA (GQA) of the new token over all ctx slots. The new token's k/v are written into slot 0 and
  the slot is given back after the step (StaticLayer.crop(-1)), so every replay does the same work.
- hybrid: the same model converted (hybrid_scale.convert_model, the 8B preset's attention: window, the hybrid's own
  sinks, LA decay, hedgehog f = d), through a HybridCache after a prefill of `prompt` tokens (more than window +
  sinks: its ring and sinks are full and its LA state holds folded keys). Its state has a fixed size (the ring, the
  sinks and the LA state: window/recurrent.DecodeState), so its step does the same work at 8k or 32k tokens of
  context: it is measured once and set beside the KV cache at each context.

tokens/s = batch / seconds per step, and their ratio hybrid/kv_cache per context (issue 67's targets: at least 1.8
at 8k, 4 at 32k). Then the largest batch each fits at fit_context: memory per sequence (its cache's or state's bytes
per sequence, plus a step's transient memory above what was allocated before it, per sequence, at `batch`, eager)
into the free memory with only that model resident (torch.cuda.mem_get_info, less fit_margin_gib), checked by
allocating it: a fresh cache at that batch and one eager step. In the dry run the steps run eagerly, the transient is
not measured (0) and cpu_memory_mib stands in for the free memory. The deadline is checked before every row."""

from __future__ import annotations

import json
import traceback

import torch
from transformers import LlamaForCausalLM, StaticCache

from benchmarks.device.machine import llama_config
from benchmarks.device.run import Run, out_of_time
from benchmarks.device.timing import graphed, per_call_ms
from benchmarks.report_table import fmt, one_line, skipped_row, table
from hybrid_scale import HybridCache, convert_model


def attention_settings(run: Run) -> dict:
    """The converted layers' attention: the 8B preset's (window, the hybrid's own sinks, LA decay), hedgehog f = d."""
    return dict(window=run.cfg["window"], sinks=run.cfg["sinks"], hybrid_sinks=True, la_decay=True,
                feature_map="hedgehog", backend=run.cfg["backend"])  # fmt: skip


def llama(run: Run, m: dict, max_positions: int, seed: int = 0):
    config = llama_config(m, m["vocab"], max_positions, tie=False)
    torch.manual_seed(seed)
    with torch.device(run.device):
        return LlamaForCausalLM(config).to(run.dtype).eval()


def decoder_step(model, cache, batch: int, position: int, after=None):
    """One token for each of `batch` sequences at `position` through the model's layers over `cache` (its logits);
    `after()` runs at its end (the KV cache gives its slot back there)."""
    inner = model.model
    ids = torch.full((batch, 1), 7, device=model.device)
    pos = torch.full((1, 1), position, device=model.device)

    def step():
        with torch.no_grad():
            h = inner.embed_tokens(ids)
            rope = inner.rotary_emb(h, position_ids=pos)
            for layer in inner.layers:
                h = layer(h, attention_mask=None, position_embeddings=rope, position_ids=pos, cache=cache,
                          use_cache=True)  # fmt: skip
            logits = model.lm_head(inner.norm(h))
            if after is not None:
                after()
            return logits

    return step


def fresh_step(model, batch: int, ctx: int):
    """(step, cache): a step at `batch` over a fresh cache that its first call allocates: the model's HybridCache if
    it is converted, else a StaticCache of ctx slots whose slot the step gives back at its end (no prefill: what the
    largest batch is checked with, whose prefill's activations a decode batch never holds at once)."""
    if hasattr(model, "hybrid_settings"):  # (convert_model records its settings there)
        cache = HybridCache(model)
        return decoder_step(model, cache, batch, ctx - 1), cache
    cache = StaticCache(config=model.config, max_cache_len=ctx)

    def give_back():
        for layer in cache.layers:
            layer.crop(-1)

    return decoder_step(model, cache, batch, ctx - 1, give_back), cache


def cache_bytes(cache) -> int:
    """What a cache holds: a HybridCache's states, or a StaticCache's keys and values (0 before its first step)."""
    if isinstance(cache, HybridCache):
        return cache.nbytes
    return sum(t.numel() * t.element_size() for layer in cache.layers if layer.is_initialized
               for t in (layer.keys, layer.values))  # fmt: skip


def kv_cache_step(model, batch: int, ctx: int):
    """(step, cache bytes): the static KV cache of ctx slots, allocated by a first step and filled at random."""
    step, cache = fresh_step(model, batch, ctx)
    step()  # (allocates the cache: lazy_initialization at the first update)
    for layer in cache.layers:
        layer.keys.normal_()
        layer.values.normal_()
    return step, cache_bytes(cache)


def hybrid_step(model, batch: int, prompt: int):
    """(step, state bytes): the converted model's step after a prefill of `prompt` tokens into a HybridCache."""
    cache = HybridCache(model)
    ids = torch.randint(8, model.config.vocab_size, (batch, prompt), generator=torch.Generator().manual_seed(prompt))
    with torch.no_grad():
        model(ids.to(model.device), cache=cache, use_cache=True, logits_to_keep=1)
    return decoder_step(model, cache, batch, prompt), cache_bytes(cache)


def transient_bytes(run: Run, step) -> int | None:
    """The memory one eager step allocates above what was allocated before it, at its peak (None on a CPU)."""
    if not run.cuda:
        return None
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    step()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - before


def time_row(run: Run, step, row: dict) -> None:
    """ms per step (CUDA-graph replays; eagerly on a CPU or where the capture fails, and why), tokens/s."""
    if run.cuda:
        try:
            row["ms"], row["timed"] = per_call_ms(True, graphed(step), run.cfg["replays"]), "CUDA graph replays"
        except Exception as e:  # noqa: BLE001  (not capturable on the day: eager, and why)
            row["graph_error"] = one_line(e)
            print(f"device_speed: decode {row['method']}: capture failed: {row['graph_error']}", flush=True)
    if "ms" not in row:
        row["ms"] = per_call_ms(run.cuda, step, run.cfg["replays"])
        row["timed"] = "eager (capture failed)" if run.cuda else "eager (no CUDA: no graphs)"
    row["tokens_per_s"] = row["batch"] / (row["ms"] / 1000)


def measure(run: Run, make, row: dict) -> None:
    """Row `row`: the step make() returns at its batch, timed, with its memory per sequence; what failed, if it did."""
    try:
        step, nbytes = make(row["batch"])
        row["bytes_per_sequence"] = nbytes / row["batch"]
        transient = transient_bytes(run, step)
        row["transient_per_sequence"] = None if transient is None else transient / row["batch"]
        time_row(run, step, row)
        if row["method"] == "hybrid":
            run.kept["decode_step"] = (step, f"hybrid decode step, B={row['batch']}, {run.cfg['model']['layers']} "
                                       f"layers")  # fmt: skip
    except torch.cuda.OutOfMemoryError:
        row["skipped"] = "out of memory"
    except Exception as e:  # noqa: BLE001  (one method failing must not lose the other)
        traceback.print_exc()
        row["skipped"] = row["error"] = one_line(e)


def free_bytes(run: Run) -> float:
    """The memory a batch may take: free device memory less the margin (the dry run: its stand-in)."""
    d = run.cfg["decode"]
    if not run.cuda:
        return d["cpu_memory_mib"] * 2**20
    run.free()
    return torch.cuda.mem_get_info()[0] - d["fit_margin_gib"] * 2**30


def fit(run: Run, model, measured: dict) -> dict:
    """The largest batch from `measured`'s memory per sequence, checked by a fresh cache at that batch and a step
    (what the cache then holds: allocated_bytes)."""
    ctx = run.cfg["decode"]["fit_context"]
    row = dict(method=measured["method"], context=measured["context"], fit=True)
    per = measured["bytes_per_sequence"] + (measured.get("transient_per_sequence") or 0)
    free = free_bytes(run)
    row |= dict(bytes_per_sequence=per, free_bytes=free, batch=max(0, int(free // per)))
    try:
        step, cache = fresh_step(model, row["batch"], ctx)
        step()
        row["allocated"], row["allocated_bytes"] = True, cache_bytes(cache)
    except torch.cuda.OutOfMemoryError:
        row["allocated"], row["error"] = False, "out of memory"
    except Exception as e:  # noqa: BLE001
        traceback.print_exc()
        row["allocated"], row["error"] = False, one_line(e)
    run.free()
    return row


def one_row(run: Run, model, row: dict, measured: dict | None) -> dict:
    """A measured row (its step at its batch), or with measured (that row) given, the largest batch that fits."""
    if row["fit"]:
        if not measured or "ms" not in measured:
            return row | dict(skipped="its step at the batch was not measured")
        return fit(run, model, measured)
    if row["method"] == "kv_cache":
        measure(run, lambda b: kv_cache_step(model, b, row["context"]), row)
    else:
        measure(run, lambda b: hybrid_step(model, b, run.cfg["decode"]["prompt"]), row)
    return row


def part_decode(run: Run) -> dict:
    cfg, d = run.cfg, run.cfg["decode"]
    end = run.part_deadline("decode")
    model = llama(run, cfg["model"], max(d["contexts"]) + 64)
    rows, at = [], {}
    plan = [("kv_cache", ctx, False) for ctx in d["contexts"]] + [("kv_cache", d["fit_context"], True)]
    plan += [("hybrid", None, False), ("hybrid", None, True)]  # (the hybrid's rows hold at every context)
    for method, ctx, fitting in plan:
        if method == "hybrid" and not hasattr(model, "hybrid_settings"):  # converted in place: the base is done
            model = convert_model(model, attention_settings(run))
        row = dict(method=method, context=ctx, batch=d["batch"], fit=fitting)
        why = out_of_time(end, f"the decode budget ({cfg['budgets']['decode']:.0f} s)")
        if why:
            rows.append(row | {"skipped": why})
            continue
        row = one_row(run, model, row, at.get((method, ctx)))
        at.setdefault((method, ctx), row)
        rows.append(row)
        print(f"device_speed: decode {json.dumps(row)}", flush=True)
        run.free()
    h = at.get(("hybrid", None), {})
    for ctx in d["contexts"]:
        kv = at.get(("kv_cache", ctx), {})
        if "ms" in h and "ms" in kv:
            run.ratio(f"decode tokens/s hybrid/kv_cache, B={d['batch']}, ctx={ctx}", kv["ms"] / h["ms"],
                      f"({h['timed']} hybrid / {kv['timed']} kv_cache)")  # fmt: skip
    return dict(rows=rows, batch=d["batch"], prompt=d["prompt"], model=cfg["model"])


def section(d: dict) -> list[str]:
    """The report's section of part decode (none when it did not run)."""
    b = d.get("decode")
    if not b:
        return []
    m = b["model"]
    lines = ["", "## 3. Decode throughput: a batch of sequences, CUDA graphs", "",
             f"{m['layers']} layers of hidden {m['hidden']}, {m['heads']} heads, {m['kv']} KV heads, head dim "
             f"{m['head_dim']}, intermediate {m['inter']}, vocabulary {m['vocab']} (random weights); a step: one token "
             f"for each of {b['batch']} sequences through the embedding, the layers, the norm and lm_head. kv_cache: "
             "transformers' StaticCache of ctx slots, filled at random; hybrid: a HybridCache after a prefill of "
             f"{b['prompt']} tokens (its state and step do not grow with the context: one row for every context). "
             "Fit: the largest batch at the context, from the memory per sequence (state + a step's transient) and "
             "the free memory, then allocated with one step.", ""]  # fmt: skip
    rows = []
    for r in b["rows"]:
        ctx = "any" if r["context"] is None else r["context"]
        if "skipped" in r:
            rows.append(skipped_row([r["method"], ctx, "fit" if r.get("fit") else r.get("batch", "")], r["skipped"]))
        elif r.get("fit"):
            ok = f"{fmt(r['allocated_bytes'] / 2**30)} GiB allocated, one step ran" if r["allocated"] else (
                f"FAILED: {r['error']}")  # fmt: skip
            rows.append([r["method"], ctx, f"fit: {r['batch']:,}", "", "", "", fmt(r["bytes_per_sequence"] / 2**20),
                         f"free {fmt(r['free_bytes'] / 2**30)} GiB; {ok}"])  # fmt: skip
        else:
            transient = r["transient_per_sequence"]
            note = f"transient {fmt(transient / 2**20)} MiB per sequence" if transient is not None else ""
            note += f"; capture failed: {r['graph_error']}" if r.get("graph_error") else ""
            rows.append([r["method"], ctx, r["batch"], r["timed"], fmt(r["ms"]), fmt(r["tokens_per_s"]),
                         fmt(r["bytes_per_sequence"] / 2**20), note])  # fmt: skip
    head = ["method", "context", "batch", "timed", "ms per step", "tokens/s", "state MiB per sequence", "note"]
    return lines + table(head, rows)
