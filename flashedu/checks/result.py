"""What a check returns: one result per exercise, one row per test case.

A result prints as plain text (terminal, ``flashedu check``) and renders as a small HTML card in
a notebook (``_repr_html_``): a green tick or a red cross, the message, and the table of cases.
"""

from __future__ import annotations

import html
from dataclasses import asdict, dataclass, field

# Status of a case, and of a whole check.
PASSED = "passed"
FAILED = "failed"
SKIPPED = "skipped"  # not run: an earlier case failed, or the machine cannot run it
NOT_IMPLEMENTED = "not implemented yet"


@dataclass
class CaseResult:
    label: str  # the case in words, e.g. "causal, Nq=Nk=37, Br=8, Bc=16, float64"
    status: str  # PASSED, FAILED or SKIPPED
    detail: str = ""  # what went wrong, or why it was skipped; empty when it passed
    max_error: float | None = None  # largest normalized error over the outputs compared
    seconds: float = 0.0


@dataclass
class CheckResult:
    name: str
    passed: bool
    message: str
    points: float  # points earned: all of max_points when passed, else 0
    max_points: float
    status: str = FAILED  # PASSED, FAILED or NOT_IMPLEMENTED
    cases: list[CaseResult] = field(default_factory=list)

    def to_dict(self) -> dict:
        return asdict(self)

    def __bool__(self) -> bool:
        return self.passed

    def __str__(self) -> str:
        mark = "PASSED" if self.passed else self.status.upper()
        lines = [f"{self.name}: {mark} ({self.points:g}/{self.max_points:g} points)"]
        lines += ["  " + line for line in self.message.splitlines()]
        for case in self.cases:
            err = "" if case.max_error is None else f"  err {case.max_error:.1e}"
            lines.append(f"  [{_symbol(case.status)}] {case.label}{err}")
        return "\n".join(lines)

    __repr__ = __str__

    def _repr_html_(self) -> str:
        ok = self.passed
        colour = "#1a7f37" if ok else ("#9a6700" if self.status == NOT_IMPLEMENTED else "#cf222e")
        icon = "&#10004;" if ok else ("&#9998;" if self.status == NOT_IMPLEMENTED else "&#10008;")
        head = (f'<div style="font-size:1.1em;color:{colour}"><b>{icon} {html.escape(self.name)}'
                f'</b>: {html.escape(self.status)} ({self.points:g}/{self.max_points:g} points)</div>')
        message = f'<pre style="white-space:pre-wrap;margin:4px 0">{html.escape(self.message)}</pre>'
        rows = "".join(_html_row(c) for c in self.cases)
        table = ('<table style="font-size:0.9em"><tr><th></th><th style="text-align:left">case'
                 '</th><th>max error</th><th>time</th></tr>' + rows + "</table>") if rows else ""
        return f'<div style="border-left:4px solid {colour};padding-left:8px">{head}{message}{table}</div>'


def _symbol(status: str) -> str:
    return {PASSED: "ok", FAILED: "XX", SKIPPED: "--"}.get(status, "..")


def _html_row(case: CaseResult) -> str:
    icon = {PASSED: "&#10004;", FAILED: "&#10008;", SKIPPED: "&ndash;"}.get(case.status, "")
    colour = {PASSED: "#1a7f37", FAILED: "#cf222e"}.get(case.status, "#57606a")
    err = "" if case.max_error is None else f"{case.max_error:.1e}"
    title = html.escape(case.detail, quote=True)
    return (f'<tr title="{title}"><td style="color:{colour}">{icon}</td>'
            f'<td style="text-align:left">{html.escape(case.label)}</td>'
            f"<td>{err}</td><td>{case.seconds:.2f}s</td></tr>")
