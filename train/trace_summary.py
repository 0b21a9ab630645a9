"""Where a training step spends its time: a jax profiler trace summarised by named scope.

The model labels its operations with `jax.named_scope` (layer kinds `gdn`, `mamba2`, `kda`,
`attn`, `mla`; inside them `norm`, `mixer`, `attention_core`, `ffn`; around them `embed`,
`head`, `loss`; the update `optimizer`; `scan` is the layer scan's own work: stacking the
parameters, slicing them per iteration, writing residuals). XLA keeps these names in each instruction's
`op_name` metadata, and the profiler records, per executed operation, its HLO module and
instruction name (`hlo_module`, `hlo_op`). `op_names(hlo_text)` reads the compiled step's
instruction -> op_name map; `summarize(events, names, wall)` adds up operation time per
layer kind and per op class (backward operations carry `transpose(...)` in their op_name).

Host time is the profiled wall time minus the summed operation time (dispatch, Python,
gaps between operations); on a CPU, where operations of one step may overlap on several
threads, it is a lower bound. On a GPU the kernels on the device's streams say how long the
GPU was busy (`stream_busy`); kernel time that no named operation accounts for is counted
as "unattributed", not as host time, and `thread_totals` says which timelines held what.
"""

from __future__ import annotations

import collections
import glob
import gzip
import json
import os
import re

LAYER_KINDS = ("gdn", "mamba2", "kda", "attn", "mla", "embed", "head", "loss", "optimizer")
# Checked in order: the first scope found names the op class.
OP_CLASSES = (
    "optimizer",
    "attention_core",
    "mixer",
    "ffn",
    "norm",
    "embed",
    "head",
    "loss",
)
# Operations of the layer scan itself: the per-step parameter stack, each iteration's
# slice of it, and the residuals each iteration writes for the backward pass.
_SCAN_WORDS = {"while", "stack"}
TOP = 15
TOP_OP_NAMES = 60  # op_names kept in the JSON: enough to rank levers below the first few
TOP_INSTRUCTIONS = 40  # the costliest HLO instructions kept with their shape and op_name
_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=")
_SHAPE_AND_OPCODE = re.compile(r"=\s*(.+?)\s+([\w\-]+)\(")
_FUSION_KIND = re.compile(r"kind=(k\w+)")
_OP_NAME = re.compile(r'metadata=\{[^}]*op_name="([^"]*)"')
_CALLS = re.compile(r"calls=%?([\w.\-]+)")
_COMPUTATION = re.compile(r"^\s*(?:ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$")


def op_names(hlo_text: str) -> dict:
    """{instruction name: op_name} of an HLO module text. An instruction without metadata
    (XLA drops it on some fusions) takes the first op_name inside the computation it calls."""
    names, calls, inside, computation = {}, {}, {}, None
    for line in hlo_text.splitlines():
        start = _COMPUTATION.match(line)
        if start and "=" not in line.split("{")[0]:
            computation = start.group(1)
            continue
        m = _INSTRUCTION.match(line)
        if not m:
            continue
        op_name, callee = _OP_NAME.search(line), _CALLS.search(line)
        if op_name:
            names[m.group(1)] = op_name.group(1)
            inside.setdefault(computation, op_name.group(1))
        elif callee:
            calls[m.group(1)] = callee.group(1)
    for instruction, callee in calls.items():
        if callee in inside:
            names[instruction] = inside[callee]
    return names


def instruction_shapes(hlo_text: str) -> dict:
    """{instruction name: "result shape opcode[fusion kind]"} of an HLO module text, e.g.
    "f32[8,4096,8,128]{3,2,1,0} fusion[kLoop]": what a profile's costliest kernels are (the
    fused computations' bodies are in the step's HLO text, `profile_step` keeps it)."""
    out = {}
    for line in hlo_text.splitlines():
        m = _INSTRUCTION.match(line)
        shape = m and _SHAPE_AND_OPCODE.search(line, m.end() - 1)
        if shape:
            kind = _FUSION_KIND.search(line)
            out[m.group(1)] = f"{shape.group(1)} {shape.group(2)}" + (
                f"[{kind.group(1)}]" if kind else ""
            )
    return out


def scope_words(op_name: str) -> set[str]:
    """The names in an op_name: its scopes and transformations ("jvp(gdn)" gives "jvp", "gdn")."""
    return set(re.findall(r"[A-Za-z0-9_]+", op_name))


def classify(op_name: str) -> tuple[str, str, str]:
    """(layer kind, op class, "forward" | "backward" | "update") of one op_name."""
    words = scope_words(op_name)
    kind = next((k for k in LAYER_KINDS if k in words), "other")
    op_class = next((c for c in OP_CLASSES if c in words), "other")
    if op_class == "other" and words & _SCAN_WORDS:  # slicing layers, stacking residuals
        kind = op_class = "scan"
    if op_class == "optimizer":
        return "optimizer", op_class, "update"
    return kind, op_class, "backward" if "transpose" in words else "forward"


def read_trace(trace_dir: str) -> list[dict]:
    """The complete ('X') events of the newest perfetto trace under `trace_dir`."""
    paths = glob.glob(os.path.join(trace_dir, "**", "perfetto_trace.json.gz"), recursive=True)
    paths += glob.glob(os.path.join(trace_dir, "**", "*.trace.json.gz"), recursive=True)
    if not paths:
        raise FileNotFoundError(f"no trace (perfetto_trace.json.gz) under {trace_dir}")
    with gzip.open(max(paths, key=os.path.getmtime)) as f:
        data = json.load(f)
    events = data["traceEvents"] if isinstance(data, dict) else data
    threads = {
        (e.get("pid"), e.get("tid")): e["args"].get("name", "")
        for e in events
        if e.get("ph") == "M" and e.get("name") == "thread_name"
    }
    out = []
    for e in events:
        if e.get("ph") == "X":
            out.append(dict(e, thread=threads.get((e.get("pid"), e.get("tid")), "")))
    return out


def op_events(events: list[dict], module: str, names: dict | None = None) -> list[dict]:
    """Executed operations of HLO modules whose name contains `module`, one per execution,
    with `args["hlo_op"]` set. Where the trace has the GPU's stream timelines, their kernels
    (`stream_kernels`: device time, each named by its HLO op where the trace allows);
    else the 'XLA Ops' timeline (device time per HLO operation; the event name is the op
    when its args do not say), else every event that names its HLO op; control flow that
    encloses other operations is left out."""
    if any(_on_stream(e) for e in events):
        return stream_kernels(events, module, names or {})

    def op(e):
        args = e.get("args", {})
        if "hlo_op" in args:
            return e
        if e["thread"] == "XLA Ops":
            return dict(e, args=dict(args, hlo_op=e.get("name", "")))
        return None

    ops = []
    for e in events:
        e = op(e)
        if e is not None and _in_module(e, module):
            ops.append(e)
    xla_ops = [e for e in ops if e["thread"] == "XLA Ops"]
    return _leaves(xla_ops or ops)


def stream_kernels(events: list[dict], module: str, names: dict) -> list[dict]:
    """The kernels and copies on the GPU's streams, each with `args["hlo_op"]`: its own
    annotation; else the op of the host event that launched it (the launch call with the
    same `correlation_id`, inside an event that names its op: how library kernels such as
    cuBLAS's appear); else the instruction whose name the kernel carries (XLA names a
    fusion's kernel after it, '.' -> '_'; `names` from `op_names`); else the kernel's own
    name, which no op_name matches (listed among the unnamed ops)."""
    launched = _launches(events)
    by_kernel_name = {re.sub(r"[^A-Za-z0-9_]", "_", n): n for n in names}
    out = []
    for e in events:
        args = e.get("args", {})
        if not (_on_stream(e) and _in_module(e, module)):
            continue
        op = args.get("hlo_op") or launched.get(str(args.get("correlation_id")))
        op = op or by_kernel_name.get(e.get("name", "")) or e.get("name", "")
        out.append(dict(e, args=dict(args, hlo_op=op)))
    return out


def _launches(events: list[dict]) -> dict:
    """{correlation id: hlo_op} of host events that carry a correlation id (launch calls),
    from the innermost event of the same thread enclosing them that names its op."""
    by_thread = {}
    for e in events:
        if not _on_stream(e):
            by_thread.setdefault((e.get("pid"), e.get("tid")), []).append(e)
    launched = {}
    for line in by_thread.values():
        line.sort(key=lambda e: (float(e["ts"]), -float(e.get("dur", 0.0))))
        stack = []  # (end, hlo_op or None) of the events enclosing the current one
        for e in line:
            ts, args = float(e["ts"]), e.get("args", {})
            while stack and stack[-1][0] <= ts:
                stack.pop()
            op = args.get("hlo_op") or next((o for _, o in reversed(stack) if o), None)
            if "correlation_id" in args and op:
                launched[str(args["correlation_id"])] = op
            stack.append((ts + float(e.get("dur", 0.0)), args.get("hlo_op")))
    return launched


def _in_module(event: dict, module: str) -> bool:
    """Whether the event ran in an HLO module whose name contains `module` (an event that
    names no module counts)."""
    return module in str(event.get("args", {}).get("hlo_module", module))


def _on_stream(event: dict) -> bool:
    """A kernel or copy on one of the GPU's streams (timelines named "Stream #N...")."""
    return event["thread"].startswith("Stream")


def stream_busy(events: list[dict], module: str) -> float | None:
    """Seconds during which at least one stream of the GPU ran a kernel or copy of HLO
    modules whose name contains `module` (events without a module name count too), or None
    when the trace has no stream timeline (a CPU)."""
    spans = sorted(
        (float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0.0)))
        for e in events
        if _on_stream(e) and _in_module(e, module)
    )
    if not spans:
        return None
    busy, (start, end) = 0.0, spans[0]
    for s, e in spans[1:]:
        if s > end:
            busy, start = busy + end - start, s
        end = max(end, e)
    return (busy + end - start) * 1e-6


def thread_totals(events: list[dict], steps: int, top: int = 20) -> dict:
    """{timeline (thread) name: [complete events, summed duration in seconds]} per step,
    the `top` largest by duration: which timelines the trace filled."""
    totals = collections.defaultdict(lambda: [0.0, 0.0])
    for e in events:
        row = totals[e["thread"] or str(e.get("tid"))]
        row[0] += 1 / steps
        row[1] += float(e.get("dur", 0.0)) * 1e-6 / steps
    ranked = sorted(totals.items(), key=lambda kv: -kv[1][1])[:top]
    return {name: [round(n, 1), secs] for name, (n, secs) in ranked}


def _leaves(events: list[dict]) -> list[dict]:
    """Events that enclose no other event of their thread: a `while` or `call` operation
    spans the operations of its body, which are counted themselves."""
    by_thread = {}
    for e in events:
        by_thread.setdefault((e.get("pid"), e.get("tid")), []).append(e)
    leaves = []
    for line in by_thread.values():
        line.sort(key=lambda e: (float(e["ts"]), -float(e.get("dur", 0.0))))
        for e, nxt in zip(line, line[1:] + [None]):
            end = float(e["ts"]) + float(e.get("dur", 0.0))
            if nxt is None or float(nxt["ts"]) >= end:
                leaves.append(e)
    return leaves


def summarize(
    events: list[dict],
    names: dict,
    wall_s: float,
    steps: int,
    busy_s: float | None = None,
    shapes: dict | None = None,
) -> dict:
    """Seconds per step by layer kind, op class and direction, with their shares of the step.

    `events`: from `op_events`; `names`: from `op_names`; `wall_s`: profiled wall time of
    `steps` steps; `busy_s`: the GPU's busy time over those steps (`stream_busy`), if known.
    Returns {"step_s", "op_s", "host_s", "busy_s", "unattributed_s", "by_layer_kind",
    "by_op_class", "by_direction", "top_op_names", "unnamed_ops"} (seconds per step; each
    "by_*" maps to [seconds, share]; the last two hold the `TOP_OP_NAMES` costliest
    op_names and the `TOP` costliest unnamed ops), and "top_instructions": the
    `TOP_INSTRUCTIONS` costliest HLO instructions, {instruction: [seconds, launches per
    step, op_name, shape and opcode from `shapes` (`instruction_shapes`) or ""]}. With
    `busy_s`, kernel time beyond the named operations' is "unattributed" and host time is
    the step minus the busy time."""
    tables = {k: collections.Counter() for k in ("by_layer_kind", "by_op_class", "by_direction")}
    unnamed, by_op_name = collections.Counter(), collections.Counter()
    by_instruction, launches = collections.Counter(), collections.Counter()
    for e in events:
        op = e["args"]["hlo_op"]
        seconds = float(e.get("dur", 0.0)) * 1e-6 / steps
        by_instruction[op] += seconds
        launches[op] += 1 / steps
        op_name = names.get(op)
        if op_name is None:
            unnamed[op] += seconds
            kind, op_class, direction = "other", "other", "other"
        else:
            kind, op_class, direction = classify(op_name)
            by_op_name[op_name] += seconds
        tables["by_layer_kind"][kind] += seconds
        tables["by_op_class"][op_class] += seconds
        tables["by_direction"][direction] += seconds
    step_s = wall_s / steps
    op_s = sum(tables["by_op_class"].values())
    busy = None if busy_s is None else busy_s / steps
    unattributed = 0.0 if busy is None else max(busy - op_s, 0.0)
    host_s = max(step_s - op_s - unattributed, 0.0)
    for counter in tables.values():
        counter["host"] = host_s
        if unattributed:
            counter["unattributed"] = unattributed
    total = max(op_s + unattributed + host_s, 1e-30)
    out = {
        name: {k: [v, v / total] for k, v in counter.most_common()}
        for name, counter in tables.items()
    }
    return dict(
        step_s=step_s,
        op_s=op_s,
        host_s=host_s,
        busy_s=busy,
        unattributed_s=unattributed,
        top_op_names=dict(by_op_name.most_common(TOP_OP_NAMES)),
        unnamed_ops=dict(unnamed.most_common(TOP)),
        top_instructions={
            op: [secs, round(launches[op], 2), names.get(op, ""), (shapes or {}).get(op, "")]
            for op, secs in by_instruction.most_common(TOP_INSTRUCTIONS)
        },
        **out,
    )


def markdown(summary: dict, title: str) -> str:
    """The summary as markdown tables: share of the step per layer kind and per op class."""
    lines = [
        f"## {title}",
        "",
        f"Step {summary['step_s'] * 1e3:.1f} ms, of which operations "
        f"{summary['op_s'] * 1e3:.1f} ms and host/gaps {summary['host_s'] * 1e3:.1f} ms.",
    ]
    if summary.get("busy_s") is not None:
        lines[-1] += (
            f" The GPU's streams were busy {summary['busy_s'] * 1e3:.1f} ms; "
            f"{summary['unattributed_s'] * 1e3:.1f} ms of kernel time is not attributed to a "
            "named operation (row 'unattributed')."
        )
    core = summary["by_op_class"].get("attention_core")
    if core:
        share = core[1]
        lines += [
            "",
            f"The attention core is {share:.1%} of the step: a core twice as fast saves "
            f"{share / 2:.1%} of the step, and no core at all would make the step at most "
            f"{1 / max(1 - share, 1e-9):.2f}x faster (the bound on any attention speed-up).",
        ]
    for key, label in (
        ("by_layer_kind", "layer kind"),
        ("by_op_class", "op class"),
        ("by_direction", "direction"),
    ):
        lines += ["", f"| {label} | ms / step | share |", "| --- | ---: | ---: |"]
        for name, (seconds, share) in summary[key].items():
            lines.append(f"| {name} | {seconds * 1e3:.2f} | {share:.1%} |")
    top = list(summary.get("top_instructions", {}).items())[:TOP]
    if top:
        lines += [
            "",
            "| instruction | ms / step | launches / step | shape, opcode | op_name |",
            "| --- | ---: | ---: | --- | --- |",
        ]
        for op, (seconds, n, op_name, shape) in top:
            lines.append(f"| {op} | {seconds * 1e3:.2f} | {n:g} | {shape} | {op_name} |")
    return "\n".join(lines) + "\n"
