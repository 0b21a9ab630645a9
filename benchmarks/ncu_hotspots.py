"""The instructions where a kernel's warps stall most, from Nsight Compute's source page.

    ncu --import REPORT.ncu-rep --page source --csv --print-source sass > pass.csv
    python3 benchmarks/ncu_hotspots.py pass.csv [--top 40]

Prints each SASS instruction's share of the warp-stall samples (the hottest first) and the
share by opcode, so a stall reason ncu reports for the whole kernel (say the L1TEX
scoreboard) can be tied to the instructions that wait on it; then the main loop (the
instructions executed most often, by execution count): its share of the samples, its stall
reasons, and its instructions per iteration by opcode. Columns are found by name, so the
script reads what ncu versions name "Warp Stall Sampling (All Samples)" and the like.
"""

from __future__ import annotations

import argparse
import collections
import csv
import re
import sys


def _number(text: str) -> float:
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return 0.0


def read(path: str):
    """(header, rows) of the CSV's first table that has a source column."""
    with open(path, newline="") as f:
        lines = [line for line in f if line.startswith('"')]
    table = list(csv.reader(lines))
    for n, row in enumerate(table):
        if any(cell == "Source" for cell in row):
            return row, table[n + 1 :]
    raise SystemExit(f"{path}: no table with a 'Source' column (is it ncu --page source --csv?)")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("csv")
    p.add_argument("--top", type=int, default=40)
    args = p.parse_args(argv)
    header, rows = read(args.csv)
    source = header.index("Source")
    stall_cols = [i for i, h in enumerate(header) if h.startswith("Warp Stall Sampling")]
    if not stall_cols:
        raise SystemExit(f"no 'Warp Stall Sampling' column; columns: {header}")
    every = stall_cols[0]
    address = header.index("Address") if "Address" in header else None
    total = sum(_number(r[every]) for r in rows if len(r) > every) or 1.0
    print(f"{args.csv}: {len(rows)} instructions, {total:.0f} samples ({header[every]})")
    print("columns:", "; ".join(header))
    by_op = collections.Counter()
    for r in rows:
        if len(r) > every:
            by_op[r[source].split()[0] if r[source].split() else "?"] += _number(r[every])
    print("\nshare by opcode:")
    for op, n in by_op.most_common(15):
        print(f"  {100 * n / total:5.1f}%  {op}")
    print(f"\nhottest {args.top} instructions:")
    hot = sorted((r for r in rows if len(r) > every), key=lambda r: -_number(r[every]))
    for r in hot[: args.top]:
        where = r[address] if address is not None else ""
        extra = " ".join(f"{header[i]}={r[i]}" for i in stall_cols[1:])
        print(f"  {100 * _number(r[every]) / total:5.1f}%  {where}  {r[source][:90]}  {extra}")
    loop(header, rows, every, total)


def _opcode(text: str) -> str:
    words = [w for w in text.split() if not w.startswith("@")]
    return words[0].split(".")[0] if words else "?"


def loop(header, rows, every, total):
    """The loop body: instructions whose execution count is the one that covers the most
    executed instructions; the warp-level count per iteration is that count over the
    iterations, which the body's first instruction gives."""
    if "Instructions Executed" not in header:
        return
    executed = header.index("Instructions Executed")
    weight = collections.Counter()
    for r in rows:
        weight[_number(r[executed])] += _number(r[executed])
    count, _ = weight.most_common(1)[0]
    body = [r for r in rows if _number(r[executed]) == count]
    samples = sum(_number(r[every]) for r in body) or 1.0
    print(f"\nmain loop: {len(body)} instructions per iteration (each executed {count:.0f}")
    print(f"times by warps), {100 * samples / total:.1f}% of the samples; its stall reasons:")
    reasons = [i for i, h in enumerate(header) if re.fullmatch(r"stall_[a-z_]+", h)]
    share = {header[i]: sum(_number(r[i]) for r in body) / samples for i in reasons}
    for name, value in sorted(share.items(), key=lambda kv: -kv[1]):
        if value >= 0.01:
            print(f"  {100 * value:5.1f}%  {name}")
    mix = collections.Counter(_opcode(r[header.index("Source")]) for r in body)
    print("  per iteration:", ", ".join(f"{op} {n}" for op, n in mix.most_common(24)))


if __name__ == "__main__":
    sys.exit(main())
