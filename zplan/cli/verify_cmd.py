"""zplan selfcheck, verify and calibrate: the claims held against measurements."""

from __future__ import annotations

from typing import Annotated, Optional

import typer

from ..errors import PlanError, UsageError
from .app import app, emit_json


def _need_torch(what: str) -> None:
    try:
        import torch  # noqa: F401
    except ImportError:
        raise UsageError(f"{what} needs torch: pip install 'zplan[train]'") from None


@app.command()
def selfcheck(
    ranks: Annotated[Optional[list[int]], typer.Option(help="World sizes to run (repeatable; default 1 2 3 4)")] = None,
    ring: Annotated[bool, typer.Option(help="Use the backend's ring reduce-scatter (shows why it is not bitwise)")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object")] = False,
) -> None:
    """ZeRO 1/2/3 from scratch on N local processes against unsharded AdamW, bit for bit."""
    _need_torch("selfcheck")
    from ..reference.selfcheck import run

    worlds = ranks or [1, 2, 3, 4]
    for n in worlds:
        if not 1 <= n <= 64:
            raise UsageError(f"--ranks {n} is out of range; use 1..64")
    results = [r for n in worlds for r in run(n, ring=ring)]
    if as_json:
        emit_json({"results": [dict(r.__dict__, traffic_ok=r.traffic_ok, ok=r.ok) for r in results]})
    else:
        print(f"{'N':>3} {'stage':>6} {'vs unsharded AdamW':<44} {'m+v floats/rank':>16} "
              f"{'(unsharded)':>12} {'master/rank':>12} {'traffic/step':>13} {'predicted':>10}")
        for r in results:
            eq = "bit for bit" if r.bitwise else f"DIFFERS at {r.first_difference}"
            print(f"{r.world:>3} {'zero' + str(r.stage):>6} {eq:<44} {r.moment_floats:>16,} "
                  f"{r.unsharded_moment_floats:>12,} {r.master_floats:>12,} "
                  f"{r.measured_elements[-1]:>13,} {r.predicted_elements:>10,}"
                  f"{'' if r.traffic_ok else '  TRAFFIC MISMATCH'}")
    bad = [r for r in results if not r.ok]
    if bad:
        raise PlanError(f"{len(bad)} of {len(results)} checks failed (first: N={bad[0].world} "
                        f"zero{bad[0].stage}: {bad[0].first_difference or 'traffic'})")


@app.command()
def verify(
    strategy: Annotated[Optional[list[str]], typer.Option(help="Strategies (repeatable; default ddp zero1 zero2 zero3 zero3-noreshard hsdp offload-all)")] = None,
    ranks: Annotated[Optional[list[int]], typer.Option(help="World sizes (repeatable; default 1 2 4)")] = None,
    dtype: Annotated[Optional[list[str]], typer.Option(help="Param dtypes (repeatable; default fp32 bf16)")] = None,
    checkpointing: Annotated[Optional[list[str]], typer.Option(help="Checkpointing modes (repeatable; default none full)")] = None,
    tolerance: Annotated[float, typer.Option(help="Allowed relative error of peak memory")] = 0.05,
    workdir: Annotated[Optional[str], typer.Option(help="Where runs go (default: a temporary folder)")] = None,
    markdown: Annotated[Optional[str], typer.Option(help="Also write the table to this Markdown file")] = None,
) -> None:
    """Short real trainings over a matrix, predicted against measured; exit 1 past tolerance."""
    _need_torch("verify")
    import tempfile
    from pathlib import Path

    from ..plan import write_atomic
    from ..verify import DEFAULT_STRATEGIES, matrix, progress, run_cell, table
    from .parse import check_choice, check_range

    check_range(tolerance, "--tolerance", 0.0, 10.0)
    for s in strategy or ():
        check_choice(s, "--strategy", DEFAULT_STRATEGIES)
    for d in dtype or ():
        check_choice(d, "--dtype", ("fp32", "bf16"))
    for n in ranks or ():
        check_range(n, "--ranks", 1, 64)
    cells = matrix(tuple(strategy or DEFAULT_STRATEGIES), tuple(ranks or (1, 2, 4)),
                   tuple(dtype or ("fp32", "bf16")), tuple(checkpointing or ("none", "full")))
    if not cells:
        raise UsageError("the matrix is empty (hsdp runs only at 4 ranks, as 2 x 2)")
    root = Path(workdir or tempfile.mkdtemp(prefix="zplan-verify-"))
    results = []
    for i, c in enumerate(cells, 1):
        progress(f"[{i}/{len(cells)}] {c.name}")
        results.append(run_cell(c, root))
    lines = table(results, tolerance)
    print("\n".join(lines))
    if markdown:
        write_atomic(markdown, "\n".join(lines) + "\n")
    bad = [r for r in results if not r.ok(tolerance)]
    if bad:
        raise PlanError(f"{len(bad)} of {len(results)} cells outside tolerance "
                        f"({tolerance:.0%} memory, exact traffic): first {bad[0].cell.name}")
