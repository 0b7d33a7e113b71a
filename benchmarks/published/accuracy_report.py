"""Render the accuracy results of benchmarks/published_accuracy.py as text and as docs/accuracy.md."""

from __future__ import annotations

from collections import Counter

GiB = 2**30


def _pct(x) -> str:
    return "-" if x is None or x != x else f"{100 * x:+.1f}%"


def _apct(x) -> str:
    return "-" if x != x else f"{100 * x:.1f}%"


def _num(x, scale: float = 1.0, fmt: str = "{:,.0f}") -> str:
    return "-" if x is None else fmt.format(x / scale)


def _shape(r) -> str:
    row = r.row
    par = row.strategy + (f"/{row.shard_size}" if row.shard_size else "")
    kernels = (f" attn:{row.attention_kernel}" if row.attention_kernel != "flash2" else "") + \
        (" norm:composite" if row.fused_norm is False else "") + \
        (" loss:eager" if row.compile and row.compile_loss is False else "") + \
        (f" compile:{row.compile_scope}" if row.compile_scope != "block" else "") + \
        (" loss:bf16" if not row.loss_fp32 else "") + (" loss:fused" if row.fused_loss else "") + \
        (f" loss:{row.linear_loss}" if row.linear_loss != "none" else "") + (f" loss:chunks{row.loss_chunks}" if row.loss_chunks > 1 else "") + (" swiglu:fused" if row.fused_swiglu else "") + \
        (" ac:no-early-stop" if not row.checkpoint_early_stop and row.checkpointing in ("full", "every-k", "first-k", "selective") else "") + \
        (" ac:around-unit" if row.checkpoint_wraps_unit else "") + \
        (" kv:copied" if row.attention_expands_kv else "") + \
        (" attn:heads-first" if row.attention_heads_first else "") + \
        (f" opt:{row.optimizer}" if row.optimizer != "adamw" else "")
    return (f"{row.model} {row.num_gpus}x{row.gpu} {par} mb{row.micro_batch}x{row.grad_accum} "
            f"s{row.seq_len} ac:{row.checkpointing}{kernels}")


def _flags(r) -> str:
    return r.row.flags + ("*" if r.ignored else "")


def row_cells(r) -> list[str]:
    row = r.row
    mem_meas = _num(row.memory_bytes, GiB, "{:.1f}") + (f" {row.memory_kind[0].upper()}" if row.memory_kind else "")
    return [row.id, _shape(r), _flags(r), _num(row.tokens_per_s_per_gpu), _num(r.tokens_pred), _pct(r.tokens_err),
            mem_meas, _num(r.memory_pred_bytes, GiB, "{:.1f}"), _pct(r.memory_err)]


ROW_HEAD = ["id", "run", "flags", "tok/s meas", "tok/s pred", "tok err", "mem meas GiB", "mem pred GiB", "mem err"]
STAT_HEAD = ["group", "value", "n", "mean abs err", "max abs err", "bias"]


def stat_cells(gname: str, value: str, s) -> list[str]:
    n, mean_abs, max_abs, bias = s
    return [gname, value, str(n), _apct(mean_abs), _apct(max_abs), _pct(bias)]


def text(results, groups: dict) -> str:
    """A plain-text report: every scored row, then the statistics by group."""
    lines = []
    scored = [r for r in results if r.row.expressible]
    width = max(len(r.row.id) for r in results)
    for r in scored:
        c = row_cells(r)
        if r.error:
            lines.append(f"{c[0]:<{width}}  {c[1]}  ERROR: {r.error}")
            continue
        lines.append(f"{c[0]:<{width}}  tok/s {c[3]:>7} pred {c[4]:>7} ({c[5]:>7})   "
                     f"mem GiB {c[6]:>5} pred {c[7]:>5} ({c[8]:>7})  {c[2]}")
    for metric, table in groups.items():
        lines.append("")
        lines.append(f"{metric}: " + "  ".join(STAT_HEAD[2:]))
        for g in table:
            lines.append("  " + "  ".join(stat_cells(*g)))
    lines.append("")
    skipped = [r for r in results if not r.row.expressible]
    lines.append(f"{len(skipped)} rows zplan cannot express (listed in docs/accuracy.md): "
                 + ", ".join(sorted({r.row.why_not.split(' (')[0] for r in skipped})))
    lines.append("* = compile/float8 not modelled by this zplan; predicted without them")
    lines += ["", "issue 8 targets:"] + ["  " + t for t in targets(results)]
    return "\n".join(lines)


TARGETS = {"tokens": (0.12, 0.25), "memory": (0.05, 0.10)}  # issue 8: mean and each, as fractions
ISSUE_GPUS = ("A100", "H100", "H200")  # the GPUs issue 8 asks the set to cover


def targets(results) -> list[str]:
    """Issue 8's 'done when' line for each metric, over the scored rows; with the mean over sources
    weighted equally, since one source (llm-foundry) holds most tokens/s rows."""
    out = []
    for metric, (mean_max, each_max) in TARGETS.items():
        scored = [(r.row.source.name, r.row.gpu_kind, abs(getattr(r, f"{metric}_err"))) for r in results
                  if r.row.expressible and not r.error and getattr(r, f"{metric}_err") is not None]
        if not scored:
            continue
        errs = [e for _, _, e in scored]
        by_source: dict[str, list[float]] = {}
        for name, _, e in scored:
            by_source.setdefault(name, []).append(e)
        macro = sum(sum(v) / len(v) for v in by_source.values()) / len(by_source)
        over = sum(e > each_max for e in errs)
        out.append(f"{metric}: mean abs error {100 * sum(errs) / len(errs):.1f}% (target <= {100 * mean_max:.0f}%; "
                   f"{100 * macro:.1f}% with the {len(by_source)} sources weighted equally), "
                   f"{over} of {len(errs)} rows beyond {100 * each_max:.0f}% (target: none)")
        scope = [e for _, kind, e in scored if kind in ISSUE_GPUS]
        if scope and len(scope) < len(errs):
            out.append(f"  on {', '.join(ISSUE_GPUS)} (the issue's scope): {100 * sum(scope) / len(scope):.1f}%, "
                       f"{sum(e > each_max for e in scope)} of {len(scope)} rows beyond {100 * each_max:.0f}%")
    judged = [r for r in results if r.row.expressible and not r.error and r.fits is not None]
    wrong = [r.row.id for r in judged if not r.fits]
    if judged:  # every row is a run that happened: a verdict of 'does not fit' is wrong
        out.append(f"fits: {len(judged) - len(wrong)} of {len(judged)} runs that ran are predicted to fit"
                   + (f" (not: {', '.join(wrong)})" if wrong else ""))
    return out


def _md_table(head: list[str], rows: list[list[str]]) -> list[str]:
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    out += ["| " + " | ".join(c.replace("|", "/") for c in r) + " |" for r in rows]
    return out


def markdown(results, groups: dict, command: str, compared_to: str) -> str:
    rows = [r.row for r in results]
    sources = {}
    for r in rows:
        sources.setdefault(r.source.name, r.source)
    per = Counter((r.source.name, r.gpu_kind) for r in rows)
    scored = [r for r in results if r.row.expressible]
    skipped = [r for r in results if not r.row.expressible]
    out = [
        "# Accuracy against published measurements",
        "",
        f"Generated by `{command}`; do not edit by hand. The rows are in benchmarks/published/*.toml,",
        "one file per source, each with the exact document, table and commit they come from.",
        "",
        "Every prediction uses the row's facts (model, GPU, GPUs and GPUs per node, strategy, HSDP shard",
        "size, micro-batch, accumulation, sequence, checkpointing, dtypes, the attention kernel and the norm's "
        "implementation and the loss's where the source names them: attn:, norm:, loss: in the run column; loss:eager",
        "is a compiled run whose loss was not compiled, loss:bf16 a loss without the fp32 upcast) and zplan's",
        "default assumptions;",
        "nothing is tuned per row. Errors are predicted / measured - 1 (positive: zplan predicts more).",
        "Measured memory is a peak of PyTorch's caching allocator, reserved (R) or allocated (A) as the source",
        "states. Neither includes the CUDA context, and allocated memory has no fragmentation, so each is held",
        f"against the matching part of the prediction: {compared_to}. Rows that ran with torch.compile or",
        "float8 are predicted with --compile and --float8 (torchao's tensorwise scaling; its rowwise recipes",
        "with --float8-recipe rowwise or rowwise-gw-hp; TransformerEngine's delayed scaling with --float8-recipe",
        "te-delayed). Both are grouped apart below.",
        "",
        f"{len(rows)} rows from {len(sources)} sources ({len({s.org for s in sources.values()})} independent "
        f"organisations); {len(scored)} expressible, {len(skipped)} not (listed at the end).",
        "",
    ]
    out += ["Against issue 8's targets (all scored rows, compile/float8 rows included):", ""]
    out += ["- " + t for t in targets(results)] + [""]
    out += _md_table(["source", "who", "A100", "H100", "H200", "file"],
                     [[s.name, s.org, str(per[(s.name, 'A100')]), str(per[(s.name, 'H100')]), str(per[(s.name, 'H200')]),
                       f"[{s.file}]({s.url})"] for s in sources.values()])
    for metric, table in groups.items():
        out += ["", f"## {metric}: errors by group", ""]
        out += _md_table(STAT_HEAD, [stat_cells(*g) for g in table])
    for metric in ("tokens", "memory"):
        worst = sorted((r for r in scored if getattr(r, f"{metric}_err") is not None),
                       key=lambda r: -abs(getattr(r, f"{metric}_err")))[:8]
        out += ["", f"## Largest {metric} misses", ""]
        out += _md_table(ROW_HEAD, [row_cells(r) for r in worst])
    out += ["", "## Every expressible row", ""]
    out += _md_table(ROW_HEAD, [row_cells(r) for r in scored if not r.error])
    errors = [r for r in scored if r.error]
    if errors:
        out += ["", "Rows whose scenario zplan refused:", ""] + [f"- {r.row.id}: {r.error}" for r in errors]
    out += ["", "## Rows zplan cannot express", ""]
    out += _md_table(["id", "run", "parallelism", "why", "tok/s meas", "mem meas GiB"],
                     [[r.row.id, _shape(r), r.row.parallelism, r.row.why_not, _num(r.row.tokens_per_s_per_gpu),
                       _num(r.row.memory_bytes, GiB, "{:.1f}")] for r in skipped])
    out += ["", "## Sources", ""]
    for s in sources.values():
        out += [f"- **{s.name}** ({s.who}; {s.date}): [{s.file}]({s.url})"
                + (f", commit {s.commit}" if s.commit else "") + f". Tokens/s: {s.tokens}."]
    return "\n".join(out) + "\n"
