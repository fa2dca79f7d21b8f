"""The one markdown table writer of the benchmarks' reports (the device harness's, benchmarks/device/report.py, and
benchmarks/attention/kernels.py's): a figure as the tables print it (`fmt`), an exception in one line
(`one_line`), and a table from a header and rows (`table`), where a row that was not measured says why
(`skipped_row`)."""

from __future__ import annotations

import math
from collections.abc import Sequence


def fmt(x, digits: int = 3) -> str:
    """None as n/a; a float to `digits` significant digits (1e5 and above in e-notation); anything else as str."""
    if x is None:
        return "n/a"
    if isinstance(x, float):
        if not math.isfinite(x):
            return str(x)
        return f"{x:.{digits}g}" if abs(x) < 1e5 else f"{x:.{max(digits - 1, 1)}e}"
    return str(x)


def one_line(e: BaseException, limit: int = 300) -> str:
    """`Type: the first line of the message` (at most `limit` characters; a `|` would split a table cell)."""
    text = (str(e).strip().splitlines() or [""])[0][:limit].replace("|", "/")
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


def cell(x, digits: int = 3) -> str:
    text = x if isinstance(x, str) else fmt(x, digits)
    return text.replace("|", "/").replace("\n", " ")


def table(header: Sequence[str], rows: Sequence[Sequence], digits: int = 3) -> list[str]:
    """A markdown table's lines: the header, the rule, then each row's cells (str as given, numbers by fmt); a row
    shorter than the header is padded with empty cells."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for row in rows:
        cells = [cell(x, digits) for x in row] + [""] * (len(header) - len(row))
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def skipped_row(first: Sequence, why: str) -> list:
    """A row that was not measured: its identifying cells, then `skipped: why` (table pads the rest)."""
    return [*first, f"skipped: {why}"]
