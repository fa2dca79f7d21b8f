"""What the preflight reports: the table's rows, the problems that block a stage (and which stages), the warnings,
and the per-stage figures the dry run checks."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..config import STAGES


@dataclass
class Plan:
    rows: list[tuple[str, str, str]] = field(default_factory=list)  # (stage, quantity, value)
    problems: list[str] = field(default_factory=list)  # blocking
    warnings: list[str] = field(default_factory=list)  # the run works, but wastes something
    scope: dict[str, tuple[str, ...]] = field(default_factory=dict)  # problem -> the stages it blocks
    figures: dict[str, dict] = field(default_factory=dict)  # stage -> {figure: value}, what the dry run checks

    def block(self, message: str, *stages: str) -> None:
        self.problems.append(message)
        self.scope[message] = stages or STAGES

    def blocking(self, stage: str | None = None) -> list[str]:
        return [m for m in self.problems if stage is None or stage in self.scope.get(m, STAGES)]

    @property
    def ok(self) -> bool:
        return not self.problems

    def table(self) -> str:
        width = max(len(q) for _, q, _ in self.rows) if self.rows else 10
        lines = [f"{'stage':<9} {'quantity':<{width}}  value", "-" * (width + 40)]
        lines += [f"{s:<9} {q:<{width}}  {v}" for s, q, v in self.rows]
        lines += [f"WARNING: {w}" for w in self.warnings]
        lines += [f"BLOCKING ({', '.join(self.scope.get(p, STAGES))}): {p}" for p in self.problems]
        lines.append("plan: OK" if self.ok else f"plan: {len(self.problems)} blocking problem(s)")
        return "\n".join(lines)
