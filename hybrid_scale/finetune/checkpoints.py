"""Stage 2 on disk: committed step checkpoints (trainable state only, whole tensors, any world size), their rotation,
and the model form of the stage's output (a converted model + its LoRA adapter). Every directory is built as a
tagged `.partial`, committed (hashes written last) and moved into place; only the toolkit's own are replaced."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file

from ..attention.layer import HybridAttention
from ..distributed import runtime, tensor_parallel
from ..distributed.deepspeed import gather_full, restore_trainable, trainable_state
from ..distributed.replicated import ReplicatedEngine
from ..models.convert import set_modes
from ..models.converted import ADAPTER_DIR, describe, mark_adapter, write_converted
from ..storage.commits import commit, is_committed, remove_dir, replace_dir, save_tensors, sibling, start_partial
from ..storage.faults import fault, fault_enospc
from .schedule import resume_schedule
from .state import Stage2


def committed_steps(stage2: Path) -> list[Path]:
    steps = sorted(p for p in stage2.glob("step_*") if p.is_dir() and p.name[5:].isdigit())
    return [p for p in steps if is_committed(p)]


def save_step(dest: Path, engine, named, state: dict, rt) -> Path:
    """A committed step checkpoint: trainable weights and AdamW moments (gathered whole), the loop's state (its
    step sets the learning-rate schedule on resume), every rank's RNG state as a tensor. Collective."""
    weights, moments = engine.trainable_state() if isinstance(engine, ReplicatedEngine) else trainable_state(named)
    tmp = sibling(dest, "partial")
    if rt.main:
        start_partial(dest, "run_dir")
        fault_enospc(f"save:{dest.name}")
        save_tensors(weights, tmp / "trainable.safetensors")
        save_tensors(moments, tmp / "optimizer.safetensors")
        state = {**state, "world": rt.world, "tensor_parallel": rt.tp}
        (tmp / "state.json").write_text(json.dumps(state, indent=1))
    runtime.barrier(rt)
    save_tensors(rng_state(rt.device), tmp / f"rng_rank{rt.rank}.safetensors")
    runtime.barrier(rt)  # every rank's files are on disk before the marker
    if rt.main:
        fault("save:before_commit")
        commit(tmp)
        replace_dir(tmp, dest, "run_dir")
    runtime.barrier(rt)
    return dest


def load_step(checkpoint: Path, engine, named, rt, seed: int) -> dict:
    """Restore a step checkpoint into this world size's partitions, the learning-rate schedule at its step and this
    rank's RNG (another world size or tensor-parallel size: a fresh stream per data-parallel rank derived from the
    seed and the step, the same on the ranks of a tensor-parallel group, whose LoRA dropout masks must agree). Returns
    the loop's saved state."""
    state = json.loads((checkpoint / "state.json").read_text())
    step = state["step"]
    weights, moments = load_file(checkpoint / "trainable.safetensors"), load_file(checkpoint / "optimizer.safetensors")
    if isinstance(engine, ReplicatedEngine):
        engine.restore(weights, moments, step)
    else:
        restore_trainable(engine, named, weights, moments, step)
    resume_schedule(engine.lr_scheduler, step)  # (a function of the step: a checkpoint of any version resumes)
    rng = checkpoint / f"rng_rank{rt.rank}.safetensors"
    if (state["world"], state.get("tensor_parallel", 1)) == (rt.world, rt.tp) and rng.is_file():
        set_rng_state(load_file(rng), rt.device)  # tensors only: no pickle is ever loaded
    else:
        torch.manual_seed(seed * 1_000_003 + step * 101 + rt.dp_rank)  # (seeds the CPU and every GPU)
    return state


def rng_state(device: torch.device) -> dict[str, torch.Tensor]:
    """This rank's random state: the CPU generator's and, on a GPU, its device's (LoRA dropout draws there)."""
    state = {"rng": torch.get_rng_state()}
    if device.type == "cuda":
        state["cuda_rng"] = torch.cuda.get_rng_state(device)
    return state


def set_rng_state(state: dict[str, torch.Tensor], device: torch.device) -> None:
    torch.set_rng_state(state["rng"])
    if device.type == "cuda" and "cuda_rng" in state:  # (a checkpoint saved on CPU has none: the GPU's stays seeded)
        torch.cuda.set_rng_state(state["cuda_rng"], device)


def rotate(stage2: Path, keep: int) -> None:
    """Keep the newest `keep` committed step checkpoints; drop tagged partial ones older than the newest."""
    steps = committed_steps(stage2)
    for old in steps[:-keep]:
        remove_dir(old)
    newest = steps[-1].name if steps else ""
    for partial in stage2.glob("step_*.partial"):  # left by a run killed while saving (tagged as the toolkit's)
        if partial.name < newest:
            remove_dir(partial)


def write_model(stage: Stage2, dest: Path, step: int) -> None:
    """The model form of stage 2's output at `step` in `dest`: converted model (phi/gamma as trained, every layer in
    the recipe's mode, the window in force, the checkpoint and step it is) + PEFT adapter. Collective."""
    peft_model, model, rt, source_meta = stage.peft_model, stage.model, stage.rt, stage.source.hybrid_config
    set_modes(model, stage.mode)  # not the modes SSD or a held-out evaluation left behind
    hybrid_names = {
        f"{prefix}.{n}"
        for prefix, m in model.named_modules()
        if isinstance(m, HybridAttention)
        for n, _ in m.hybrid_parameters()
    }
    hybrid = _whole([(n, p) for n, p in model.named_parameters() if n in hybrid_names], model, rt)
    lora = _whole([(n, p) for n, p in peft_model.named_parameters() if "lora_" in n], model, rt)
    if rt.main:
        tmp = start_partial(dest, "run_dir")
        origin = {"stage": "stage2", "checkpoint": dest.name, "step": step}
        settings = describe(model) | {"cache": stage.cfg.attention.cache}  # the run's, also when trained without
        write_converted(tmp, source_meta["architecture"], source_meta["base_model"], settings, hybrid, origin)
        peft_model.save_pretrained(tmp / ADAPTER_DIR, state_dict=lora)
        mark_adapter(tmp / ADAPTER_DIR, dest)
        commit(tmp)
        replace_dir(tmp, dest, "run_dir")
    runtime.barrier(rt)


def _whole(named: list, model, rt) -> dict:
    """{name: whole tensor on the CPU} of parameters partitioned by ZeRO-3 or split by tensor parallelism."""
    if rt.tp == 1:
        return gather_full(named)
    heads = tensor_parallel.head_sharded(model)
    return {n: tensor_parallel.whole(p, tensor_parallel.placement(p, heads), rt).cpu().contiguous() for n, p in named}
