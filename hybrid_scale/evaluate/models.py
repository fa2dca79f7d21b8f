"""The two models the evaluation compares, each loaded once, on demand: the base (softmax) model and the converted
one (its modes set per cell), on this rank's device, split over the tensor-parallel ranks or partitioned by ZeRO-3
(eval.shard_weights) as the config says."""

from __future__ import annotations

import torch

from ..config.schema import Config, eval_cache, eval_mode
from ..data import corpus
from ..distributed import runtime, tensor_parallel
from ..distributed.deepspeed import init_comm, zero3_config
from ..distributed.parallelize import Zero3, parallelize
from ..models.cache_heads import default_prompts, retrieval_budgets
from ..models.convert import convert_model, set_cache, set_modes, set_window
from ..models.converted import load_base_model, load_converted, load_tokenizer
from ..run.sources import ModelSource
from .cells import TWINS, evaluation_window


class Models:
    """The base model and the converted model, each loaded once, on demand."""

    def __init__(self, cfg: Config, source: ModelSource, rt: runtime.Runtime):
        self.cfg, self.source, self.device = cfg, source, rt.device
        self.path, self.converted = source.path, source.converted
        # its attention settings: the model's own (hybrid_config.json, read once by the stage's entry) when converted
        self.attention = source.hybrid_config["attention"] if source.converted else cfg.attention
        self.dtype = getattr(torch, cfg.model.dtype)
        self._base = self._hybrid = None
        self._budgets: dict[int, dict] = {}  # attention.cache_heads=retrieval: {keys: {layer: [Hkv]}} (calibrated once)
        self.untrained = not source.converted
        self._zero3 = None
        self.rt = rt
        self.split = {}  # what the tensor-parallel split left each rank, per model loaded (results.json)
        if rt.tp > 1:  # the heads split over the tensor-parallel ranks (each reads only its part of each weight)
            runtime.join_group(rt)
        elif cfg.eval.shard_weights:  # load partitioned: no rank ever holds the whole model (ZeRO-3 init while alive)
            from transformers.integrations import HfDeepSpeedConfig

            runtime.join_group(rt)  # the group DeepSpeed then finds: gloo for CPU tensors too on GPUs
            init_comm("nccl" if rt.device.type == "cuda" else "gloo")
            self._zero3 = HfDeepSpeedConfig(zero3_config(self.dtype))

    def _load_base(self):
        # an export's base architecture: "base" is its softmax model (merged weights)
        return load_base_model(self.source.base, self.dtype, self.rt).to(self.device).eval()

    def _ready(self, model, name: str):
        if self.rt.tp > 1:
            model = parallelize(model, rt=self.rt)[1]
            self.split[name] = tensor_parallel.split_report(model, self.rt)
            return model
        return parallelize(model, zero3=Zero3(zero3_config(self.dtype)))[1] if self.cfg.eval.shard_weights else model

    def get(self, mode: str):
        """The model that computes eval mode `mode`: the base, or the converted model in the layers' mode with its
        cache set for this mode: eval.cache keys per KV head for a `+cache` mode and cache_only (shared out over the
        KV heads by their retrieval with attention.cache_heads=retrieval), none otherwise (set at every call, so that
        no mode inherits another's cache)."""
        if mode == "base":
            if self._base is None:
                self._base = self._ready(self._load_base(), "base")
            return self._base
        if self._hybrid is None:
            self._hybrid = self._load_hybrid()
        layers, cached = eval_mode(mode)
        keys = eval_cache(self.cfg) if cached else 0
        budgets = self.cache_budgets(keys) if keys else None
        set_modes(self._hybrid, layers)
        set_cache(self._hybrid, keys, self.cfg.attention.cache_select, budgets)
        return self._hybrid

    def cache_budgets(self, keys: int) -> dict | None:
        """attention.cache_heads=retrieval: each layer's budgets per KV head for a cache of `keys` (models/
        cache_heads.py), calibrated once per model and size on passkey prompts cut from the held-out report text
        with a seed the probes never use; None with uniform budgets."""
        if self.cfg.attention.cache_heads != "retrieval":
            return None
        if keys not in self._budgets:
            tokenizer = load_tokenizer(self.source.base)
            filler = tokenizer.encode(corpus.report_text(self.cfg)[0])
            prompts = default_prompts(self._hybrid, self.cfg.seed)
            select = self.cfg.attention.cache_select
            self._budgets[keys] = retrieval_budgets(self._hybrid, tokenizer, filler, keys, prompts, select=select)
        return self._budgets[keys]

    def cache_key(self, mode: str) -> dict:
        """What a cell's key adds for a mode that runs with the cache: its size and selection (nothing otherwise: the
        cells of the plain modes keep their keys)."""
        if not eval_mode(mode)[1]:
            return {}
        key = {"cache": eval_cache(self.cfg), "cache_select": self.cfg.attention.cache_select}
        if self.cfg.attention.cache_heads != "uniform":  # (the uniform cells keep their keys)
            key["cache_heads"] = self.cfg.attention.cache_heads
        return key

    def _load_hybrid(self):
        if self.converted:
            backend, meta = self.cfg.attention.backend, self.source.hybrid_config
            model = load_converted(self.path, self.dtype, self.device, backend, self.rt, meta)
        else:  # a plain model: converted with untrained (identity) feature maps, said so in the report
            model = convert_model(self._load_base(), self.cfg.attention)
        if self.cfg.eval.window is not None:
            set_window(model, self.cfg.eval.window)
        return self._ready(model, "hybrid")

    def twin(self, mode: str, evaluated) -> str | None:
        """A mode among `evaluated` (evaluated before, on every rank) that computes the same function as `mode` on this
        model: for a hybrid with its own sinks, swa_only (the hybrid without its LA) is swa_sinks. Its results are
        reused, not computed twice."""
        other = TWINS.get(mode)
        return other if other in evaluated and self.sinks()[1] else None

    def twin_reason(self, mode: str, twin: str) -> str:
        return f"the same keys as {twin} on this model (its hybrid keeps {self.sinks()[0]} sinks)"

    def sinks(self) -> tuple[int, bool]:
        """(S, whether the hybrid keeps them): the model's own when converted, else the config's."""
        return int(self.attention["sinks"]), bool(self.attention.get("hybrid_sinks", False))

    def la_decay(self) -> bool:
        """Whether the hybrid's LA decays: the model's own setting when converted, else the config's."""
        return bool(self.attention.get("la_decay", False))

    def window(self) -> int:
        return evaluation_window(self.cfg, self.source)
