"""Rich tables for people; JSON goes to stdout through main. Imported only when printing."""

from __future__ import annotations

from rich.console import Console
from rich.table import Table

from ..estimate import StrategyEstimate
from ..scenario import Scenario
from ..units import GiB, fmt_bytes, fmt_count, fmt_s

BAR_WIDTH = 24
COMPONENTS = (
    ("params_bytes", "P", "blue"), ("grads_bytes", "G", "magenta"), ("master_bytes", "M", "cyan"),
    ("optimizer_bytes", "O", "green"), ("gather_buffer_bytes", "W", "yellow"),
    ("reduce_buffer_bytes", "R", "bright_yellow"), ("accum_grad_bytes", "a", "bright_magenta"),
    ("activation_bytes", "A", "red"), ("overhead_bytes", "x", "white"),
)


def bar(mem: dict, capacity: int) -> str:
    """A letter per component; the full width is one GPU's memory (or the total, if larger)."""
    total_b = sum(mem[k] for k, _, _ in COMPONENTS)
    scale = BAR_WIDTH / max(capacity, total_b)
    out, used = [], 0.0
    for key, letter, colour in COMPONENTS:
        cells = mem[key] * scale
        n = int(round(used + cells)) - int(round(used))
        used += cells
        if n > 0:
            out.append(f"[{colour}]{letter * n}[/]")
    text = "".join(out) + "[dim]" + "·" * (BAR_WIDTH - int(round(used))) + "[/]"
    if total_b > capacity:
        return text + f" [bold red]{total_b / capacity:.1f}x the GPU[/]"
    return text


def header(console: Console, sc: Scenario, unit: str) -> None:
    m, hw, t = sc.model, sc.hw, sc.train
    psi = sc.params
    console.print(
        f"[bold]{m.name}[/]: {psi:,} params ({fmt_count(psi)}); 16 bytes/param would be "
        f"{fmt_bytes(16 * psi, unit)} of model state"
    )
    console.print(
        f"{hw.num_gpus} x {hw.gpu.name} ({fmt_bytes(hw.gpu.memory_bytes, unit)} each), "
        f"{sc.hw.num_nodes} node(s) of {hw.cluster.gpus_per_node} on {hw.cluster.name}; "
        f"{len(sc.units)} units; seq {t.seq_len}, micro-batch {t.micro_batch}, accumulation {t.grad_accum}; "
        f"checkpointing {t.checkpointing}; layout {t.layout}; params {t.precision.param}, "
        f"reduce {t.precision.reduce}, master {t.precision.master}, {t.optimizer}"
    )
    console.print(f"[dim]Sizes in {unit} ({'10^9' if unit == 'GB' else '2^30'} bytes).[/]")


def memory_table(results: list[StrategyEstimate], sc: Scenario, unit: str) -> Table:
    tb = Table(title="Memory per GPU", title_justify="left")
    for col in ("strategy", "params", "grads", "master", "optim", "model state", "gather",
                "reduce", "activ.", "overhead", "total", "fits (headroom)"):
        tb.add_column(col, justify="left" if col == "strategy" else "right")
    for r in results:
        if r.memory is None:
            tb.add_row(r.name, *[""] * 10, f"[dim]n/a: {r.unavailable}[/]")
            continue
        d = r.memory.as_dict()
        f = lambda k: fmt_bytes(d[k], unit)  # noqa: E731
        ok = "[green]yes[/]" if r.fits else "[red]no[/]"
        head = fmt_bytes(abs(r.headroom_bytes), unit)
        fit = f"{ok} ({'' if r.headroom_bytes >= 0 else '-'}{head})"
        if r.host_fits is not None:
            fit += f", host {fmt_bytes(d['host_bytes_per_node'], unit)}/node " + ("ok" if r.host_fits else "[red]too much[/]")
        tb.add_row(r.name, f("params_bytes"), f("grads_bytes"), f("master_bytes"),
                   f("optimizer_bytes"), f("model_state_bytes"), f("gather_buffer_bytes"),
                   f("reduce_buffer_bytes"), f("activation_bytes"), f("overhead_bytes"),
                   f("total_bytes"), fit)
    return tb


def bars(console: Console, results: list[StrategyEstimate], sc: Scenario, unit: str) -> None:
    cap = sc.hw.gpu.memory_bytes
    legend = " ".join(f"[{c}]{l}[/]={k.removesuffix('_bytes').replace('_', ' ')}" for k, l, c in COMPONENTS)
    console.print(f"[bold]Memory against one GPU[/] ({fmt_bytes(cap, unit)}): {legend}")
    width = max(len(r.name) for r in results)
    for r in results:
        if r.memory is None:
            continue
        d = r.memory.as_dict()
        console.print(f"  {r.name:<{width}} |{bar(d, cap)}| {fmt_bytes(d['total_bytes'], unit)}")


def comm_table(results: list[StrategyEstimate], sc: Scenario, unit: str) -> Table:
    tb = Table(title="Communication and time per step", title_justify="left")
    for col in ("strategy", "elements/step", "x params", "bytes/step", "links",
                "compute", "exposed comm", "optimizer", "offload", "step", "tokens/s/GPU", "MFU"):
        tb.add_column(col, justify="left" if col in ("strategy", "links") else "right")
    psi = sc.params
    for r in results:
        if r.timing is None:
            continue
        t = r.timing
        scopes = sorted({c.scope for c in r.collectives if c.op not in ("h2d", "d2h")})
        tb.add_row(r.name, fmt_count(r.elements_per_step), f"{r.elements_per_step / psi:.3f}",
                   fmt_bytes(r.bytes_per_step, unit), ", ".join(scopes), fmt_s(t.compute_s),
                   fmt_s(t.exposed_comm_s), fmt_s(t.optimizer_s), fmt_s(t.offload_s),
                   fmt_s(t.step_s), f"{t.tokens_per_s_per_gpu:,.0f}", f"{t.mfu:.1%}")
    return tb


def overlap_table(r: StrategyEstimate) -> Table:
    """Per unit: does its all-gather hide? Identical consecutive units are folded into one row."""
    tb = Table(title=f"Overlap per unit ({r.name}, one micro-batch)", title_justify="left")
    for col in ("unit", "all-gather", "fwd compute", "forward", "reduce", "bwd compute", "backward"):
        tb.add_column(col, justify="left" if col == "unit" else "right")
    rows: list[list] = []
    for u in r.timing.units:
        key = (round(u.all_gather_s, 9), round(u.forward_s, 9), round(u.forward_exposed_s, 9),
               round(u.backward_exposed_s, 9), round(u.reduce_s, 9))
        if rows and rows[-1][0] == key:
            rows[-1][2] += 1
            continue
        rows.append([key, u, 1])
    for _, u, count in rows:
        name = u.name if count == 1 else f"{u.name} (+{count - 1} alike)"
        fw = "[green]hidden[/]" if u.forward_hidden else f"[red]exposed {fmt_s(u.forward_exposed_s)}[/]"
        bw = "[green]hidden[/]" if u.backward_hidden else f"[red]exposed {fmt_s(u.backward_exposed_s)}[/]"
        tb.add_row(name, fmt_s(u.all_gather_s), fmt_s(u.forward_s), fw, fmt_s(u.reduce_s),
                   fmt_s(u.backward_s), bw)
    return tb


def assumptions_lines(console: Console, assumed: dict) -> None:
    console.print("[bold]Assumptions[/] (change them with the flag shown):")
    for k, v in assumed.items():
        val = v["value"]
        if k.endswith("_bytes"):
            val = f"{val / GiB:.2f} GiB"
        console.print(f"  {k} = {val}  [dim]{v['meaning']}; {v['flag']}[/]")


def print_estimate(sc: Scenario, results: list[StrategyEstimate], assumed: dict, unit: str) -> None:
    console = Console(width=max(Console().width, 160))
    header(console, sc, unit)
    console.print(memory_table(results, sc, unit))
    bars(console, results, sc, unit)
    console.print(comm_table(results, sc, unit))
    fsdp = [r for r in results if r.timing and r.timing.units]
    pick = next((r for r in fsdp if r.name == "zero3"), fsdp[0] if fsdp else None)
    if pick is not None:
        console.print(overlap_table(pick))
    assumptions_lines(console, assumed)

