"""A recommendation for people (through render's console: plain text or rich)."""

from __future__ import annotations

import sys

from ..estimate import TIGHT_FREE_FRACTION, measured_error
from ..public_accuracy import sentence
from ..recommend import Recommendation
from ..units import fmt_bytes, fmt_s
from .render import add_columns, bar, make_console, new_table
from .textout import escape


def print_recommendation(rec: Recommendation, top: int, written: str | None, plot: str | None,
                         wide: bool = False, launch_note: str = "") -> None:
    console = make_console()
    w = rec.winner
    sc, t, m = w.sc, w.result.timing, w.result.memory
    console.print(f"[bold]{escape(sc.model.name)}[/] on {sc.n} x {escape(sc.hw.gpu.name)} ({escape(sc.hw.cluster.name)}), "
                  f"global batch {rec.global_batch} x {sc.train.seq_len} tokens; "
                  f"{rec.evaluated} configurations searched. Sizes in GB (10^9 bytes).")
    console.print(f"[bold green]Recommended:[/] {w.label()}")
    once = (f" ({fmt_bytes(m.steady_bytes)} once DeepSpeed's cached parameter "
            f"blocks, {fmt_bytes(m.released_once_bytes)}, are released at the first failed allocation)"
            if m.released_once_bytes else "")
    console.print(f"  per GPU {fmt_bytes(m.total_bytes)} of {fmt_bytes(sc.hw.gpu.memory_bytes)}{once} "
                  f"|{bar(m.as_dict(), sc.hw.gpu.memory_bytes)}|"
                  + (f" [yellow]tight[/] (under {TIGHT_FREE_FRACTION:.0%} free, by --headroom: inside the "
                     "memory model's error, where the caching allocator's retries slow steps)"
                     if w.result.tight else ""))
    console.print(f"  step {fmt_s(t.step_s)} (compute {fmt_s(t.compute_s)}, exposed comm "
                  f"{fmt_s(t.exposed_comm_s)}, optimizer {fmt_s(t.optimizer_s)}, offload {fmt_s(t.offload_s)}, "
                  f"contention {fmt_s(t.contention_s)}, slowest rank {fmt_s(t.slowest_rank_s)}); "
                  f"{t.tokens_per_s_per_gpu:,.0f} tokens/s per GPU; MFU {t.mfu:.1%}")
    if t.units:
        hidden = sum(u.forward_hidden for u in t.units[1:])
        console.print(f"  all-gathers hidden in forward for {hidden} of {len(t.units) - 1} units after the first")
    for f in rec.flags:
        console.print(f"[yellow]  note: {escape(f)}[/]")
    acc = measured_error(sc)
    if acc is not None:
        console.print("  " + escape(sentence(sc.hw.gpu.name, acc)))
    if top:
        console.print(runners_up(rec, top, wide))
        if any(c.result.memory.released_once_bytes for c in rec.ranked[1: top + 1]):
            console.print("  * without DeepSpeed's cached parameter blocks, released once at the first failed allocation")
    if rec.lost or rec.rejected:  # --strategy with one family: nothing else was compared
        console.print("[bold]Each strategy family:[/]")
    for fam, why in rec.lost.items():
        console.print(f"  {fam}: {escape(why)}")
    for fam, why in rec.rejected.items():
        console.print(f"  [red]infeasible[/] {escape(fam)}: {escape(why)}")
    # messages, not data: stderr
    if written:
        print(f"zplan: plan written to {written} ({launch_note})", file=sys.stderr)
    if plot:
        print(f"zplan: plot written to {plot}", file=sys.stderr)


def runners_up(rec: Recommendation, top: int, wide: bool = False):
    """The next `top` candidates; --wide adds compute, exposed communication and traffic."""
    tb = new_table("Runners-up" + ("" if wide else " (--wide: compute, exposed comm, bytes/step)"))
    extra = ("compute", "exposed comm", "bytes/step") if wide else ()
    add_columns(tb, ("#", "configuration", "per GPU", "step", *extra, "tokens/s/GPU", "MFU"), ("configuration",))
    for i, c in enumerate(rec.ranked[1: top + 1], start=2):
        ct = c.result.timing
        more = (fmt_s(ct.compute_s), fmt_s(ct.exposed_comm_s), fmt_bytes(c.result.bytes_per_step)) if wide else ()
        m = c.result.memory  # what it needs: less DeepSpeed's cached blocks, released once (marked *)
        per_gpu = fmt_bytes(m.steady_bytes) + (" *" if m.released_once_bytes else "")
        tb.add_row(str(i), c.label(), per_gpu, fmt_s(ct.step_s), *more,
                   f"{ct.tokens_per_s_per_gpu:,.0f}", f"{ct.mfu:.1%}")
    return tb
