"""HedgeCATs early stopping on stage 2's held-out losses (the `selection` half of the held-out text)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class EarlyStopping:
    """Keep the best hybrid loss; stop after `patience` evaluations without a better one, or as soon as the la_only
    loss rises more than `margin` above its best (the LA path is being abandoned)."""

    best_hybrid: float | None = None
    best_la: float | None = None
    best_step: int | None = None
    last_la: float | None = None
    bad_evals: int = 0
    reason: str | None = None

    def update(self, step: int, hybrid: float, la_only: float) -> bool:
        """Record one evaluation; True when the hybrid loss is the best so far."""
        self.last_la = la_only
        if self.best_la is None or la_only < self.best_la:
            self.best_la = la_only
        if self.best_hybrid is None or hybrid < self.best_hybrid:
            self.best_hybrid, self.best_step, self.bad_evals = hybrid, step, 0
            return True
        self.bad_evals += 1
        return False

    def verdict(self, patience: int, margin: float) -> str | None:
        if self.last_la is not None and self.last_la > self.best_la + margin:
            return (
                f"la_only loss {self.last_la:.4f} rose more than {margin} above its best {self.best_la:.4f} "
                "(the LA path is being abandoned)"
            )
        if self.bad_evals >= patience:
            return f"patience: no better hybrid loss in {patience} evaluations"
        return None
