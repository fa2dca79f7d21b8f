"""The recipes, one table: what stage 1 optimises, the mode stage 2 trains in, whether stage 2 early-stops by
default, and whether it schedules sliding-window dropout. Stages read this table and nothing else about recipes.

- lolcats:   hybrid_output_mse -> hybrid LoRA (the conversion whose LA the paper found bypassed)
- hedgecats: weights_xent (LA-only) -> short hybrid LoRA with early stopping
- ssd:       weights_xent (LA-only) -> hybrid LoRA with Scheduled Sliding-window Dropout
- la_only:   weights_xent -> LoRA in la_only; SWA is added at inference (export.mode=hybrid, gamma fixed/calibrated)
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Recipe:
    name: str
    objective: str  # stage 1's objective (distill.objectives overrides it)
    stage2_mode: str  # the mode every hybrid layer trains in during stage 2
    early_stopping: bool  # stage 2's default for finetune.early_stopping
    ssd: bool  # stage 2 drops each layer's SWA on a schedule


RECIPES = {
    r.name: r
    for r in (
        Recipe("lolcats", "hybrid_output_mse", "hybrid", early_stopping=False, ssd=False),
        Recipe("hedgecats", "weights_xent", "hybrid", early_stopping=True, ssd=False),
        Recipe("ssd", "weights_xent", "hybrid", early_stopping=False, ssd=True),
        Recipe("la_only", "weights_xent", "la_only", early_stopping=False, ssd=False),
    )
}
