"""Where the test suite's time goes: per file and the slowest tests, from pytest's `--durations=0` output.

Run the suite with durations for every phase (setup, call, teardown), keeping the output:

    .venv/bin/pytest -q -p no:cacheprovider --durations=0 > after.log

then `.venv/bin/python -m tools.test_time after.log` prints the tables (markdown); with two logs,
`.venv/bin/python -m tools.test_time before.log after.log`, the files side by side (before, after, ratio) and the
slowest tests of each. A test's time is setup + call + teardown, so a module-scoped fixture counts in the file whose
first test built it. The wall time is pytest's own last line ("... in 812.34s").
"""

from __future__ import annotations

import argparse
import re
from collections import defaultdict
from pathlib import Path

LINE = re.compile(r"^\s*([0-9.]+)s (setup|call|teardown)\s+(\S.*?)\s*$")
WALL = re.compile(r"(\d+) passed.* in ([0-9.]+)s")


def parse(path: Path) -> tuple[dict[str, float], float | None, int | None]:
    """{test id: seconds over its phases}, pytest's wall seconds, tests passed."""
    tests: dict[str, float] = defaultdict(float)
    wall = passed = None
    for line in path.read_text(errors="replace").splitlines():
        if m := LINE.match(line):
            tests[m.group(3)] += float(m.group(1))
        elif m := WALL.search(line):
            passed, wall = int(m.group(1)), float(m.group(2))
    return dict(tests), wall, passed


def by_file(tests: dict[str, float]) -> dict[str, float]:
    out: dict[str, float] = defaultdict(float)
    for test, s in tests.items():
        out[test.split("::")[0]] += s
    return dict(out)


def _m(s: float | None) -> str:
    return "" if s is None else f"{s:.0f} s ({s / 60:.1f} min)"


def slowest(tests: dict[str, float], n: int, title: str) -> list[str]:
    rows = [f"### {title}", "", "| seconds | test |", "|---:|---|"]
    rows += [f"| {s:.1f} | `{t}` |" for t, s in sorted(tests.items(), key=lambda kv: -kv[1])[:n]]
    return [*rows, ""]


def report(paths: list[Path], n: int = 20) -> str:
    runs = [parse(p) for p in paths]
    names = ["before", "after"] if len(runs) == 2 else ["time"]
    out = ["| | " + " | ".join(names) + (" | after / before |" if len(runs) == 2 else " |")]
    out.append("|---|" + "---:|" * (len(runs) + (len(runs) == 2)))
    out.append("| pytest wall | " + " | ".join(_m(w) for _, w, _ in runs) + (" | |" if len(runs) == 2 else " |"))
    out.append("| tests passed | " + " | ".join(str(p) for _, _, p in runs) + (" | |" if len(runs) == 2 else " |"))
    out.append("")
    files = [by_file(t) for t, _, _ in runs]
    keys = sorted(set().union(*files), key=lambda f: -max(fl.get(f, 0.0) for fl in files))
    out += ["| file | " + " | ".join(f"{n} (s)" for n in names) + (" | ratio |" if len(runs) == 2 else " |")]
    out.append("|---|" + "---:|" * (len(runs) + (len(runs) == 2)))
    for f in keys:
        cells = [f"{fl[f]:.0f}" if f in fl else "–" for fl in files]
        ratio = ""
        if len(runs) == 2:
            a, b = files[0].get(f), files[1].get(f)
            ratio = f" | {b / a:.2f}" if a and b is not None else " | "
        out.append(f"| `{f}` | " + " | ".join(cells) + ratio + " |")
    out.append("")
    for (tests, _, _), name in zip(runs, names, strict=True):
        out += slowest(tests, n, f"The {n} slowest tests ({name})")
    return "\n".join(out)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("logs", nargs="+", type=Path, help="pytest output with --durations=0 (one, or before and after)")
    ap.add_argument("--slowest", type=int, default=20, help="how many of the slowest tests to list")
    args = ap.parse_args()
    if len(args.logs) > 2:
        ap.error("one log, or two (before and after)")
    print(report(args.logs, args.slowest))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
