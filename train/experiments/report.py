"""`report.md` of a comparison: one summary row per arm, then per-arm detail tables.

Arm results are the JSON-ready dicts `compare.py` writes to `results/<arm>.json`:
  arm, status, reason, steps, train_ce, val_ce, tokens_per_s, train_seconds, eval_seconds,
  gains {layer: {max_gain, top1_share, top4_share}}, masking {layer, ce, ce_masked, increase},
  residuals [{layer, delta, pre_cast, post_cast}], residual_ratio_post {layer: ratio},
  ruler [{task, context_length, n, exact_match, partial_match, gold_logprob, margin, choice}],
  ruler_summary {length: {the same means over tasks}},
  errors {evaluation part: message}, residual_implementation (when the probe fell back).
Missing entries print as "-".
"""

from __future__ import annotations

import math
import os
from typing import Mapping, Sequence


LEGEND = (
    "EM: greedy exact match (every gold answer in the first line the model writes); logprob: mean "
    "log-likelihood per token of the gold answer (nats, higher is better); margin: gold minus "
    "distractor log-likelihood (a wrong answer of the same form, e.g. another key's value; 0 = no "
    "retrieval). Max QK gain / top-1 share: worst attention layer. Masking dCE: validation CE "
    "increase when the last attention layer's output is zeroed. Post-cast ratio: mean normalized dS "
    "row-sum residual after the FP8 cast, stale delta over Delta-Matching, on this arm's trained "
    "activations (mean over layers)."
)


def fmt(x, spec: str = ".4f") -> str:
    """`x` formatted with `spec`; "-" for None and NaN; strings (e.g. "nan") as they are."""
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-"
    return format(x, spec) if isinstance(x, (int, float)) else str(x)


def _table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return lines + ["| " + " | ".join(r) + " |" for r in rows]


def _mean(values) -> float | None:
    values = [v for v in values if isinstance(v, (int, float)) and math.isfinite(v)]
    return sum(values) / len(values) if values else None


def _lengths(results) -> list[str]:
    return sorted({str(k) for r in results for k in (r.get("ruler_summary") or {})}, key=int)


def summary_table(results: Sequence[Mapping]) -> list[str]:
    """One row per arm: losses, long-context means, worst gain layer, probes, throughput."""
    lengths = _lengths(results)
    header = (
        ["arm", "status", "steps", "train CE", "val CE"]
        + [f"RULER-{n} EM / logprob / margin" for n in lengths]
        + [
            "max QK gain",
            "max top-1 share",
            "masking dCE",
            "post-cast ratio stale/matched",
            "tokens/s",
        ]
    )
    rows = []
    for r in results:
        gains = (r.get("gains") or {}).values()
        summ = r.get("ruler_summary") or {}
        ruler = [
            " / ".join(
                fmt((summ.get(n) or {}).get(k), ".3f")
                for k in ("exact_match", "gold_logprob", "margin")
            )
            for n in lengths
        ]
        rows.append(
            [
                r["arm"],
                r["status"],
                fmt(r.get("steps"), "d"),
                fmt(r.get("train_ce")),
                fmt(r.get("val_ce")),
            ]
            + ruler
            + [
                fmt(max((g["max_gain"] for g in gains), default=None), ".3f"),
                fmt(max((g["top1_share"] for g in gains), default=None), ".3f"),
                fmt((r.get("masking") or {}).get("increase")),
                fmt(_mean((r.get("residual_ratio_post") or {}).values()), ".2f"),
                fmt(r.get("tokens_per_s"), ",.0f"),
            ]
        )
    return _table(header, rows)


def arm_section(r: Mapping) -> list[str]:
    """Detail tables of one arm (or the reason it has none)."""
    lines = [f"### {r['arm']}", ""]
    if r.get("reason"):
        lines += [f"Status: **{r['status']}**: {r['reason']}", ""]
    if r["status"] == "not run":
        return lines
    lines += [
        f"Trained {fmt(r.get('steps'), 'd')} steps in {fmt(r.get('train_seconds'), '.0f')} s; "
        f"evaluated in {fmt(r.get('eval_seconds'), '.0f')} s.",
        "",
    ]
    lines += [
        f"- evaluation part failed: {name}: {msg}" for name, msg in (r.get("errors") or {}).items()
    ]
    if r.get("residual_implementation"):
        lines.append(f"- residual probe ran with the {r['residual_implementation']} implementation")
    lines += [""] if r.get("errors") or r.get("residual_implementation") else []
    gains, res = r.get("gains") or {}, r.get("residuals") or []
    layers = sorted({int(k) for k in gains} | {int(x["layer"]) for x in res})
    modes = list(dict.fromkeys(x["delta"] for x in res))
    by = {(int(x["layer"]), x["delta"]): x for x in res}
    if layers:
        header = ["attention layer", "max gain", "top-1 share", "top-4 share"] + [
            f"residual {m} pre / post" for m in modes
        ]
        rows = []
        for layer in layers:
            g = gains.get(str(layer), gains.get(layer, {}))
            rows.append(
                [
                    str(layer),
                    fmt(g.get("max_gain"), ".3f"),
                    fmt(g.get("top1_share"), ".3f"),
                    fmt(g.get("top4_share"), ".3f"),
                ]
                + [
                    f"{fmt(by.get((layer, m), {}).get('pre_cast'), '.2e')} / "
                    f"{fmt(by.get((layer, m), {}).get('post_cast'), '.2e')}"
                    for m in modes
                ]
            )
        lines += _table(header, rows) + [""]
    m = r.get("masking")
    if m:
        lines += [
            f"Masking probe (attention layer {m['layer']} output zeroed): validation CE "
            f"{fmt(m['ce'])} -> {fmt(m['ce_masked'])} (+{fmt(m['increase'])}).",
            "",
        ]
    if r.get("ruler"):
        keys = ("exact_match", "partial_match", "gold_logprob", "margin", "choice")
        lines += _table(
            [
                "task",
                "context",
                "n",
                "exact match",
                "partial match",
                "gold logprob/token",
                "margin over distractor",
                "gold preferred",
            ],
            [
                [s["task"], str(s["context_length"]), str(s["n"])]
                + [fmt(s.get(k), ".3f") for k in keys]
                for s in r["ruler"]
            ],
        )
        lines.append("")
    return lines


def write_report(
    path: str,
    results: Sequence[Mapping],
    *,
    title: str,
    setup: Sequence[str],
    plots: Mapping[str, str],
) -> str:
    """Writes the markdown report to `path` (plots linked relative to it); returns the path."""
    here = os.path.dirname(path)
    lines = [f"# {title}", "", *[f"- {s}" for s in setup], "", "## Summary", ""]
    lines += summary_table(results)
    lines += ["", LEGEND, ""]
    if plots:
        lines += (
            ["## Plots", ""]
            + [f"![{name}]({os.path.relpath(p, here)})" for name, p in plots.items()]
            + [""]
        )
    lines += ["## Arms", ""]
    for r in results:
        lines += arm_section(r)
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")
    return path
