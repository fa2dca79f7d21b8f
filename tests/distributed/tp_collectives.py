"""Run under torchrun with the collective checker (tests/distributed/test_tensor_parallel.py): one training step
(forward, backward, optimizer step) of a tiny converted Llama split over all the ranks (tp = world), through stage
2's engine at tensor_parallel > 1 (replicated.ReplicatedEngine: the loss-parallel cross-entropy, the gradient
reductions), at 2 and at 3 decoder layers, without LoRA and (--lora) with it; a marker line between the phases in
each rank's record, so that the test can count the collectives per phase and, from the difference between 3 and 2
layers, per block."""

import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from conftest import tiny_model  # noqa: E402

import hybrid_scale as hs  # noqa: E402
from hybrid_scale.distributed import runtime  # noqa: E402
from hybrid_scale.distributed.parallelize import Zero3, parallelize  # noqa: E402

ENGINE = {  # the part of stage 2's DeepSpeed config that the replicated engine reads
    "optimizer": {"params": {"lr": 1e-3, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.0}},
    "gradient_accumulation_steps": 1,
    "gradient_clipping": 1.0,
}


def mark(rt, what: str) -> None:
    with open(f"{os.environ['HYBRID_SCALE_COLLECTIVES']}.rank{rt.rank}", "a") as fh:
        fh.write(json.dumps({"op": "marker", "dtype": [], "shape": [], "device": [], "where": what}) + "\n")


def step(rt, layers: int, lora: bool) -> None:
    from peft import LoraConfig, get_peft_model

    model = hs.convert_model(
        tiny_model("llama", num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=4, vocab_size=128),
        {"window": 4, "sinks": 2},
    )
    for n, p in model.named_parameters():
        p.requires_grad_("feature_map" in n or "gamma_logit" in n)
    targets = ["q_proj", "k_proj", "v_proj", "o_proj"]
    adapt = (lambda m: get_peft_model(m, LoraConfig(r=4, lora_alpha=8, target_modules=targets))) if lora else None
    torch.manual_seed(0)
    engine, model = parallelize(model, adapt=adapt, rt=rt, zero3=Zero3(ENGINE, train=True))
    ids = torch.randint(3, 128, (1, 16), generator=torch.Generator().manual_seed(0))
    mark(rt, f"forward layers={layers} lora={lora}")
    loss = engine(input_ids=ids, labels=ids).loss
    mark(rt, f"backward layers={layers} lora={lora}")
    engine.backward(loss)
    mark(rt, f"step layers={layers} lora={lora}")
    engine.step()
    mark(rt, "end")


if __name__ == "__main__":
    rt = runtime.init("cpu", tp=int(os.environ["WORLD_SIZE"]))
    for lora in (False, True) if "--lora" in sys.argv else (False,):
        for layers in (2, 3):
            step(rt, layers, lora)
