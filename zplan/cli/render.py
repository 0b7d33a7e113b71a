"""Tables for people (textout: plain text where rich would not write to a terminal, else rich); JSON
goes to stdout through main. Imported only when printing."""

from __future__ import annotations

import os
import shutil
import sys

from ..estimate import TIGHT_FREE_FRACTION, StrategyEstimate, measured_error
from ..policy import checkpointing_label
from ..public_accuracy import sentence
from ..scenario import Scenario
from ..units import GiB, fmt_bytes, fmt_count, fmt_s
from .textout import Out, TableSpec, escape

BAR_WIDTH = 24
DEFAULT_WIDTH = 100  # piped output with no COLUMNS: fits a 100-column terminal


def console_width() -> int:
    """COLUMNS if set (also when piped: rich ignores it then), else the terminal's width, else 100."""
    env = os.environ.get("COLUMNS", "")
    if env.isdigit() and int(env) > 0:
        return int(env)
    if sys.stdout is not None and sys.stdout.isatty():  # None: closed (`>&-`)
        return shutil.get_terminal_size((DEFAULT_WIDTH, 24)).columns
    return DEFAULT_WIDTH


def _partial_node(n: int, per_node: int) -> str:
    """A node the GPUs do not fill, said: 2 of one node's 8, or the last node's 4 of 8."""
    if n < per_node:
        return f" ({n} GPUs used)"
    return f" (the last with {n % per_node})" if n % per_node else ""


def make_console() -> Out:
    """Standard output at console_width(): plain text where rich would not write to a terminal
    (piped or redirected output), else a rich Console. Emoji codes are never replaced: a name such as
    `x:fire:` is printed as written (and the replacement pass cost ~5 ms of estimate's 0.3 s).
    Piped with no COLUMNS set, tables are printed whole (--wide's every column), not squeezed to
    the default 100."""
    columns = os.environ.get("COLUMNS", "")
    return Out(console_width(), tables_fit=columns.isdigit() and int(columns) > 0)


def new_table(title: str) -> TableSpec:
    """A table with a rule under the heading and no vertical borders (narrower than rich's box)."""
    return TableSpec(title)


def add_columns(tb: TableSpec, heads, left=("strategy",)) -> None:
    """One column per heading, never wrapped nor cut below its heading's width."""
    for col in heads:
        tb.add_column(col, justify="left" if col in left else "right", no_wrap=True,
                      min_width=len(col))
COMPONENTS = (
    ("params_bytes", "P", "blue"), ("grads_bytes", "G", "magenta"), ("master_bytes", "M", "cyan"),
    ("optimizer_bytes", "O", "green"), ("gather_buffer_bytes", "W", "yellow"),
    ("reduce_buffer_bytes", "R", "bright_yellow"), ("accum_grad_bytes", "a", "bright_magenta"),
    ("activation_bytes", "A", "red"), ("step_temp_bytes", "T", "bright_red"), ("overhead_bytes", "x", "white"),
)


def bar(mem: dict, capacity: int) -> str:
    """A letter per component; the full width is one GPU's memory (or the total, if larger)."""
    total_b = sum(mem.get(k, 0) for k, _, _ in COMPONENTS)
    scale = BAR_WIDTH / max(capacity, total_b)
    out, used = [], 0.0
    for key, letter, colour in COMPONENTS:
        cells = mem.get(key, 0) * scale
        n = int(round(used + cells)) - int(round(used))
        used += cells
        if n > 0:
            out.append(f"[{colour}]{letter * n}[/]")
    text = "".join(out) + "[dim]" + "·" * (BAR_WIDTH - int(round(used))) + "[/]"
    # the multiple is the total printed beside the bar: the components' sum can exceed it (under
    # the torch layout the gradients are counted whole though not all alive at the peak)
    shown = mem.get("total_bytes", total_b)
    if shown > capacity:
        return text + f" [bold red]{shown / capacity:.1f}x the GPU[/]"
    return text


def header(console: Out, sc: Scenario, unit: str) -> None:
    m, hw, t = sc.model, sc.hw, sc.train
    psi = sc.params
    console.print(
        f"[bold]{escape(m.name)}[/]: {psi:,} params ({fmt_count(psi)}); 16 bytes/param would be "
        f"{fmt_bytes(16 * psi, unit)} of model state"
    )
    console.print(
        f"{hw.num_gpus} x {escape(hw.gpu.name)} ({fmt_bytes(hw.gpu.memory_bytes, unit)} each), "
        f"{sc.hw.num_nodes} node(s) of {hw.cluster.gpus_per_node}{_partial_node(hw.num_gpus, hw.cluster.gpus_per_node)}"
        f" on {escape(hw.cluster.name)}; "
        f"{len(sc.units)} units; seq {t.seq_len}, micro-batch {t.micro_batch}, accumulation {t.grad_accum}; "
        f"checkpointing {checkpointing_label(t)}; layout {t.layout}; params {t.precision.param}, "
        f"reduce {t.precision.reduce}, master {t.precision.master}, {t.optimizer}"
    )
    facts = run_facts(sc)
    if facts:
        console.print(f"as run: {escape(' '.join(facts))}")
    console.print(f"[dim]Sizes in {unit} ({'10^9' if unit == 'GB' else '2^30'} bytes).[/]")


# how the run holds its loop, loss and units where it departs from zplan's trainer: (field, flag
# when set, flag when cleared); the header names them so the figures say what they assume
_RUN_FACTS = (("embed_head_unit", "--embed-head-unit", None), ("logits_kept", None, "--no-logits-kept"),
              ("ddp_bucket_view", None, "--no-ddp-bucket-view"),
              ("logits_fp32", "--logits-fp32", None), ("last_block_kept", "--last-block-kept", None),
              ("kv_cache", "--kv-cache", None), ("loss_shifted_copy", "--loss-shifted-copy", None),
              ("attention_expands_kv", "--attention-expands-kv", None),
              ("attention_heads_first", "--attention-heads-first", None),
              ("outputs_until_next_forward", "--outputs-until-next-forward", None),
              ("linear_loss", "--linear-loss", None), ("fused_loss", "--fused-loss", None),
              ("loss_chunks", "--loss-chunks", None),
              ("fused_swiglu", "--fused-swiglu", None), ("attention_kernel", "--attention-kernel", None),
              ("sac_saves_attention", None, "--no-sac-saves-attention"),
              ("optimizer_kernels", "--optimizer-kernels", None), ("compile", "--compile", None),
              ("compile_scope", "--compile-scope", None), ("float8", "--float8", None),
              ("float8_recipe", "--float8-recipe", None),
              ("deepspeed_param_groups", "--deepspeed-param-groups", None),
              ("deepspeed_bucket_allreduce", None, "--no-deepspeed-bucket-allreduce"),
              ("deepspeed_sub_group", "--deepspeed-sub-group", None))


def run_facts(sc: Scenario) -> list[str]:
    """The flags of the run's loop, loss and units that differ from TrainSpec's defaults (zplan's
    trainer), expandable segments and a fused q/k/v linear, as the user would pass them."""
    from ..specs import TrainSpec

    t, default = sc.train, TrainSpec()
    out = []
    for field, on, off in _RUN_FACTS:
        v = getattr(t, field)
        if v == getattr(default, field):
            continue
        if isinstance(v, bool):
            out.append(on if v else off)
        else:
            out.append(f"{on} {v}")
    if sc.assume.expandable_segments:
        out.append("--expandable-segments")
    if sc.model.qkv_fused:  # the model's layout or --qkv-fused: one q/k/v linear either way
        out.append("--qkv-fused")
    return [f for f in out if f]


def _fit(r: StrategyEstimate) -> str:
    if r.tight:  # within estimate.TIGHT_FREE_FRACTION of the limit: a note below says what it means
        return "[yellow]tight[/]"
    if r.fits:
        return "[green]yes[/]"
    return "[red]no (host)[/]" if r.headroom_bytes >= 0 and r.host_fits is False else "[red]no[/]"


def _headroom(r: StrategyEstimate, unit: str) -> str:
    return ("" if r.headroom_bytes >= 0 else "-") + fmt_bytes(abs(r.headroom_bytes), unit)


def _host(r: StrategyEstimate, d: dict, unit: str) -> str:
    if r.host_fits is None:
        return ""
    return fmt_bytes(d["host_bytes_per_node"], unit) + ("" if r.host_fits else " [red]too much[/]")


# (heading, how a row fills it); the narrow table keeps the columns a reader decides by
MEMORY_WIDE = ("params", "grads", "master", "optim", "model state", "gather", "reduce", "activ.",
               "step temps", "overhead", "allocated", "reserved", "peak at")
MEMORY_NARROW = ("model state", "buffers", "activ.", "reserved")


def _memory_cells(d: dict, unit: str, phase: str = "") -> dict[str, str]:
    f = lambda k: fmt_bytes(d[k], unit)  # noqa: E731
    return {"params": f("params_bytes"), "grads": f("grads_bytes"), "master": f("master_bytes"),
            "optim": f("optimizer_bytes"), "model state": f("model_state_bytes"),
            "gather": f("gather_buffer_bytes"), "reduce": f("reduce_buffer_bytes"),
            "buffers": fmt_bytes(d["gather_buffer_bytes"] + d["reduce_buffer_bytes"]
                                 + d.get("step_temp_bytes", 0), unit),
            "activ.": f("activation_bytes"), "step temps": fmt_bytes(d.get("step_temp_bytes", 0), unit),
            "overhead": f("overhead_bytes"),
            "allocated": f("allocated_bytes"), "reserved": f("reserved_bytes"), "peak at": phase}


def memory_table(results: list[StrategyEstimate], sc: Scenario, unit: str, wide: bool = False) -> TableSpec:
    """Per GPU; the narrow form folds params/grads/master/optim into model state and the
    gather and reduce buffers into one column (--wide shows each)."""
    tb = new_table("Memory per GPU" + ("" if wide else " (--wide: every component)"))
    cols = MEMORY_WIDE if wide else MEMORY_NARROW
    host = wide and any(r.host_fits is not None for r in results)  # narrow: "no (host)" in fits
    heads = ("strategy",) + cols + ("total", "fits", "headroom") + (("host/node",) if host else ())
    add_columns(tb, heads, ("strategy", "fits"))
    for r in results:
        if r.memory is None:
            tb.add_row(r.name, *[""] * (len(heads) - 2), f"[dim]n/a: {escape(r.unavailable)}[/]")
            continue
        d = r.memory.as_dict()
        cells = _memory_cells(d, unit, r.memory.peak_phase)
        tb.add_row(r.name, *[cells[c] for c in cols], fmt_bytes(d["total_bytes"], unit), _fit(r),
                   _headroom(r, unit), *((_host(r, d, unit),) if host else ()))
    return tb


def bars(console: Out, results: list[StrategyEstimate], sc: Scenario, unit: str) -> None:
    cap = sc.hw.gpu.memory_bytes
    legend = " ".join(f"[{c}]{l}[/]={k.removesuffix('_bytes').replace('_', ' ')}" for k, l, c in COMPONENTS)
    console.print(f"[bold]Memory against one GPU[/] ({fmt_bytes(cap, unit)}): {legend}")
    width = max(len(r.name) for r in results)
    for r in results:
        if r.memory is None:
            continue
        d = r.memory.as_dict()
        console.print(f"  {r.name:<{width}} |{bar(d, cap)}| {fmt_bytes(d['total_bytes'], unit)}")


COMM_WIDE = ("elements/step", "x params", "bytes/step", "links", "compute", "exposed comm",
             "optimizer", "offload", "step", "tokens/s/GPU", "MFU")
COMM_NARROW = ("bytes/step", "links", "exposed comm", "step", "tokens/s/GPU", "MFU")


def comm_table(results: list[StrategyEstimate], sc: Scenario, unit: str, wide: bool = False) -> TableSpec:
    tb = new_table("Communication and time per step" + ("" if wide else " (--wide: every column)"))
    cols = COMM_WIDE if wide else COMM_NARROW
    add_columns(tb, ("strategy",) + cols, ("strategy", "links"))
    psi = sc.params
    for r in results:
        if r.timing is None:
            continue
        t = r.timing
        scopes = sorted({c.scope for c in r.collectives if c.op not in ("h2d", "d2h")})
        cells = {"elements/step": fmt_count(r.elements_per_step),
                 "x params": f"{r.elements_per_step / psi:.3f}",
                 "bytes/step": fmt_bytes(r.bytes_per_step, unit),
                 "links": ", ".join(scopes) if wide else "+".join(x.removesuffix("-node") for x in scopes),
                 "compute": fmt_s(t.compute_s), "exposed comm": fmt_s(t.exposed_comm_s),
                 "optimizer": fmt_s(t.optimizer_s), "offload": fmt_s(t.offload_s),
                 "step": fmt_s(t.step_s), "tokens/s/GPU": f"{t.tokens_per_s_per_gpu:,.0f}",
                 "MFU": f"{t.mfu:.1%}"}
        tb.add_row(r.name, *[cells[c] for c in cols])
    return tb


def overlap_table(r: StrategyEstimate) -> TableSpec:
    """Per unit: does its all-gather hide? Identical consecutive units are folded into one row
    (count: how many); an exposed time is the part of the gather not hidden behind compute."""
    tb = new_table(f"Overlap per unit ({r.name}, one micro-batch)")
    add_columns(tb, ("unit", "count", "all-gather", "fwd compute", "fwd exposed", "reduce",
                     "bwd compute", "bwd exposed"), ("unit",))
    rows: list[list] = []
    for u in r.timing.units:
        key = (round(u.all_gather_s, 9), round(u.forward_s, 9), round(u.forward_exposed_s, 9),
               round(u.backward_s, 9), round(u.backward_exposed_s, 9), round(u.reduce_s, 9))
        if rows and rows[-1][0] == key:
            rows[-1][2] += 1
            continue
        rows.append([key, u, 1])
    for _, u, count in rows:
        fw = "[green]hidden[/]" if u.forward_hidden else f"[red]{fmt_s(u.forward_exposed_s)}[/]"
        bw = "[green]hidden[/]" if u.backward_hidden else f"[red]{fmt_s(u.backward_exposed_s)}[/]"
        tb.add_row(u.name, str(count), fmt_s(u.all_gather_s), fmt_s(u.forward_s), fw,
                   fmt_s(u.reduce_s), fmt_s(u.backward_s), bw)
    return tb


def assumptions_lines(console: Out, assumed: dict) -> None:
    console.print("[bold]Assumptions[/] (change them with the flag shown):")
    for k, v in assumed.items():
        val = v["value"]
        if k.endswith("_bytes"):
            val = f"{val / GiB:.2f} GiB"
        console.print(f"  {k} = {escape(str(val))}  [dim]{escape(v['meaning'])}; {escape(v['flag'])}[/]")


def print_estimate(sc: Scenario, results: list[StrategyEstimate], assumed: dict, unit: str,
                   wide: bool = False) -> None:
    console = make_console()
    header(console, sc, unit)
    console.print(memory_table(results, sc, unit, wide))
    tight = [r.name for r in results if r.tight]
    if tight:
        console.print(f"[yellow]tight[/]: {', '.join(tight)} {'fits' if len(tight) == 1 else 'fit'} with under "
                      f"{TIGHT_FREE_FRACTION:.0%} of the GPU free, inside the memory model's error; "
                      "near the limit the caching allocator frees its cache and retries, which "
                      "slows steps (and the step time below does not include it)")
    bars(console, results, sc, unit)
    console.print(comm_table(results, sc, unit, wide))
    fsdp = [r for r in results if r.timing and r.timing.units]
    pick = next((r for r in fsdp if r.name == "zero3"), fsdp[0] if fsdp else None)
    if pick is not None:
        console.print(overlap_table(pick))
    acc = measured_error(sc)
    if acc is not None:
        console.print(escape(sentence(sc.hw.gpu.name, acc)))
    assumptions_lines(console, assumed)

