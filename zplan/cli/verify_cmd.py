"""zplan selfcheck, verify and calibrate: the claims held against measurements."""

from __future__ import annotations

import re
from typing import Annotated, Optional

import typer

from ..errors import PlanError, UsageError
from .app import app
from .json_out import emit_json


def _need_torch(what: str, *, load: bool = True) -> None:
    """Refuse, in one line, a command that needs torch where it is not installed. load=False only
    looks for it (importlib's finder, milliseconds): `zplan launch` runs torch in its ranks, not
    in its own process, and importing it there cost every launch ~1.5 s of CPU before torchrun."""
    if not load:
        import importlib.util

        if importlib.util.find_spec("torch") is None:
            raise UsageError(f"{what} needs torch: pip install 'zplan[train]'")
        return
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
    full: Annotated[bool, typer.Option(help="The whole matrix (strategy x N 1 2 4 x fp32 bf16 x none full; about 20 minutes on 2 cores)")] = False,
    strategy: Annotated[Optional[list[str]], typer.Option(help="Strategies (repeatable; a matrix over the other flags)")] = None,
    ranks: Annotated[Optional[list[int]], typer.Option(help="World sizes (repeatable; default 1 2 4)")] = None,
    dtype: Annotated[Optional[list[str]], typer.Option(help="Param dtypes (repeatable; default fp32 bf16)")] = None,
    checkpointing: Annotated[Optional[list[str]], typer.Option(help="Checkpointing modes (repeatable; default none full)")] = None,
    checkpoint_every: Annotated[Optional[int], typer.Option(help="every-k: checkpoint one block in k (default 2)")] = None,
    checkpoint_first: Annotated[Optional[int], typer.Option(help="first-k: checkpoint the first k blocks (default 1)")] = None,
    tolerance: Annotated[float, typer.Option(help="Allowed |predicted - measured| / measured of peak memory")] = 0.05,
    workdir: Annotated[Optional[str], typer.Option(help="Where runs go (default: a temporary folder)")] = None,
    markdown: Annotated[Optional[str], typer.Option(help="Also write the table to this Markdown file")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object instead of the table")] = False,
    fake: Annotated[bool, typer.Option(help="Trace at real scale under FakeTensorMode and a fake process group instead")] = False,
    world_size: Annotated[int, typer.Option(help="--fake: ranks to trace")] = 8,
    model: Annotated[str, typer.Option(help="--fake: model preset")] = "llama-3.1-8b",
    seq_len: Annotated[int, typer.Option(help="--fake: sequence length")] = 4096,
    micro_batch: Annotated[int, typer.Option(help="--fake: micro-batch")] = 1,
    linear_loss: Annotated[str, typer.Option(help="--fake: the loss, none (logits, then cross-entropy) or chunked (the trainer's linear loss)")] = "none",
    reserved: Annotated[bool, typer.Option(help="--fake: also reserved memory, planned against PyTorch's caching allocator simulated over three traced steps (three times as long)")] = False,
    expandable_segments: Annotated[bool, typer.Option(help="--fake --reserved: the allocator with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True")] = False,
    logits_kept: Annotated[bool, typer.Option(help="--fake: the loop holds the logits until backward returns (--no-logits-kept: dropped first, as torchtitan's `del pred`)")] = True,
    embed_head_unit: Annotated[str, typer.Option(help="--fake: where embedding and head sit: separate | head-kept | root | root-kept | head-root-kept (torchtitan 2024: root-kept)")] = "separate",
    logits_fp32: Annotated[bool, typer.Option(help="--fake: the model returns fp32 logits (torchtitan until 2024-10)")] = False,
    last_block_kept: Annotated[bool, typer.Option(help="--fake: the last block stays gathered from its forward to its backward (torchtitan 2024-03..2025-07)")] = False,
    kv_cache: Annotated[bool, typer.Option(help="--fake: the model returns every layer's keys and values (Hugging Face's use_cache in training)")] = False,
    outputs_until_next_forward: Annotated[bool, typer.Option(help="--fake: the loop holds each output until the next forward returns (`outputs = model(**batch)`; two steps traced)")] = False,
    loss_shifted_copy: Annotated[bool, typer.Option(help="--fake: the loss on a shifted copy of the fp32 logits (transformers 4.31; with --logits-fp32)")] = False,
    attention_expands_kv: Annotated[bool, typer.Option(help="--fake: keys and values copied to every query head before attention (Hugging Face's repeat_kv ahead of SDPA)")] = False,
    loss_chunks: Annotated[int, typer.Option(help="--fake: the cross-entropy over this many sequence chunks of the logits (torchtitan's chunked loss)")] = 1,
) -> None:
    """Short real trainings, predicted against measured; exit 1 past tolerance.

    By default a quick matrix: each strategy once (both dtypes across it), about 2 minutes on an
    idle 2-core machine. error = (predicted - measured) / measured."""
    _need_torch("verify", load=fake)  # the real matrix's cells run torch in torchrun's ranks
    for flag, k, mode in (("--checkpoint-every", checkpoint_every, "every-k"),
                          ("--checkpoint-first", checkpoint_first, "first-k")):
        if k is not None and mode not in (checkpointing or ()):
            raise UsageError(f"{flag} {k} sets the k of --checkpointing {mode}: add --checkpointing {mode}")
    ks = {**({"checkpoint_every": checkpoint_every} if checkpoint_every is not None else {}),
          **({"checkpoint_first": checkpoint_first} if checkpoint_first is not None else {})}
    if fake and markdown is not None:
        raise UsageError("--markdown writes the real matrix's table; drop it with --fake (its table is on stdout)")
    if fake:
        return _verify_fake(strategy, world_size, model, seq_len, micro_batch, tolerance,
                            checkpointing or ["none"], linear_loss, reserved, expandable_segments,
                            logits_kept, embed_head_unit, as_json, logits_fp32=logits_fp32,
                            last_block_kept=last_block_kept, kv_cache=kv_cache,
                            outputs_until_next_forward=outputs_until_next_forward,
                            loss_shifted_copy=loss_shifted_copy, attention_expands_kv=attention_expands_kv,
                            **({"loss_chunks": loss_chunks} if loss_chunks != 1 else {}), **ks)
    from .options import given_on_command_line

    typed = given_on_command_line(("model", "world_size", "seq_len", "micro_batch"))
    if typed:  # the real matrix runs its own small models: these were ignored without a word
        shown = ", ".join(f"--{n.replace('_', '-')}" for n in ("model", "world_size", "seq_len", "micro_batch")
                          if n in typed)
        raise UsageError(f"{shown} {'go' if len(typed) > 1 else 'goes'} with --fake (the real matrix runs its own tiny models on CPU ranks): add "
                         f"--fake, or drop them")
    if linear_loss != "none":
        raise UsageError("--linear-loss goes with --fake (the real matrix runs the plain loss): add --fake")
    if (reserved or expandable_segments or not logits_kept or embed_head_unit != "separate"
            or logits_fp32 or last_block_kept or kv_cache or outputs_until_next_forward or loss_shifted_copy
            or attention_expands_kv or loss_chunks != 1):
        raise UsageError("--reserved, --expandable-segments, --no-logits-kept, --embed-head-unit, "
                         "--logits-fp32, --last-block-kept, --kv-cache, --outputs-until-next-forward, "
                         "--loss-shifted-copy, --attention-expands-kv and --loss-chunks go with --fake: add --fake")
    import tempfile
    from pathlib import Path

    from ..plan import write_atomic
    from ..verify import ALL_STRATEGIES, SIGN, matrix, progress, quick_matrix, run_cell, table
    from ..parse import check_choice, check_range

    check_range(tolerance, "--tolerance", 0.0, 10.0)
    if markdown is not None:
        from ..files import check_user_output

        check_user_output(markdown, "--markdown", "table", replaces="not-plan")
    for s in strategy or ():
        check_choice(s, "--strategy", ALL_STRATEGIES)
    for d in dtype or ():
        check_choice(d, "--dtype", ("fp32", "bf16"))
    for c in checkpointing or ():
        check_choice(c, "--checkpointing", ("none", "full", "selective", "attention", "every-k", "first-k"))
    for n in ranks or ():
        check_range(n, "--ranks", 1, 64)
    from ..presets import model as model_preset

    blocks = model_preset("tiny").num_layers  # the real matrix's model
    for flag, k in (("--checkpoint-every", checkpoint_every), ("--checkpoint-first", checkpoint_first)):
        check_range(k, flag, 1, blocks)
    if full or strategy or ranks or dtype or checkpointing:
        from ..verify import DEFAULT_STRATEGIES

        cells = matrix(tuple(strategy or DEFAULT_STRATEGIES), tuple(ranks or (1, 2, 4)),
                       tuple(dtype or ("fp32", "bf16")), tuple(checkpointing or ("none", "full")),
                       every=checkpoint_every, first=checkpoint_first)
    else:
        cells = quick_matrix()
        progress("zplan: the quick matrix (each strategy once); --full runs all of them, some of which "
                 "miss 5% (docs/verification.md lists them and says why)")
    if not cells:
        raise UsageError("the matrix is empty (hsdp runs only at 4 ranks, as 2 x 2)")
    root = Path(workdir or tempfile.mkdtemp(prefix="zplan-verify-"))
    results = []
    for i, c in enumerate(cells, 1):
        progress(f"[{i}/{len(cells)}] {c.name}")
        results.append(run_cell(c, root))
    lines = table(results, tolerance)
    if as_json:
        emit_json({"sign": SIGN, "tolerance": tolerance, "traffic": "bytes per step, exact",
                   "cells": [r.as_dict(tolerance) for r in results],
                   "ok": all(r.ok(tolerance) for r in results)})
    else:
        print("\n".join(lines))
    if markdown is not None:
        write_atomic(markdown, "\n".join(lines) + "\n")
    for r in results:
        if r.skipped:
            progress(f"{r.cell.name}: {r.skipped}")
    bad = [r for r in results if not r.ok(tolerance)]
    if bad:
        raise PlanError(f"{len(bad)} of {len(results)} cells outside tolerance "
                        f"({tolerance:.0%} memory, exact traffic bytes): first {bad[0].cell.name}")


PRESET_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")


def _check_calibrate_output(output: str, name: str) -> None:
    """`--name` is a preset's name, not a path (../../x wrote outside --output, the cluster preset
    over the GPU's); `--output` a folder, checked before anything is measured."""
    from pathlib import Path

    if not PRESET_NAME.fullmatch(name):
        raise UsageError(f"--name {name!r} is not a preset name: letters, digits, '.', '_' and '-', starting "
                         f"with a letter or digit (e.g. --name my-h100)")
    if not output.strip():
        raise UsageError("--output '' is empty; name a folder for the presets (e.g. --output zplan-presets)")
    out = Path(output)
    for where in (out, out / "gpus", out / "clusters"):
        if where.exists() and not where.is_dir():
            raise UsageError(f"--output {output!r}: {where} is not a folder; name another --output")


@app.command()
def calibrate(
    output: Annotated[str, typer.Option(help="Folder for the presets (gpus/NAME.toml, clusters/NAME.toml)")] = "zplan-presets",
    name: Annotated[str, typer.Option(help="Preset name to write")] = "calibrated",
    ranks: Annotated[Optional[int], typer.Option(help="Processes for the collective test (default: GPUs, or 2 CPU ranks)")] = None,
    max_mb: Annotated[Optional[int], typer.Option(help="Largest message, MB (default 1024 on GPUs, 64 on CPUs)")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object")] = False,
) -> None:
    """Measure matmul FLOP/s, memory bandwidth and collective bus bandwidth; write presets."""
    _check_calibrate_output(output, name)  # before the minutes of measuring, and before torch
    _need_torch("calibrate")
    from pathlib import Path

    import torch

    from .. import calibrate as cal
    from ..hardware import detect, nccl_net_overhead_s, preset_for
    from ..parse import check_range

    found = detect()
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    if not cuda:
        torch.set_num_threads(1)  # as each torchrun rank runs (OMP_NUM_THREADS=1)
    check_range(ranks, "--ranks", 1, 1024)  # 0 must not mean "the default"
    check_range(max_mb, "--max-mb", 1, 1 << 20)
    world = ranks or (torch.cuda.device_count() if cuda else 2)
    check_range(world, "--ranks", 1, 1024)
    if world > 1:  # the ranks' group reads it: a bad value is one line here, not a rank's traceback
        from ..trainer.distributed import collective_timeout
        collective_timeout()
    top_mb = max_mb or (1024 if cuda else 64)
    check_range(top_mb, "--max-mb", 1, 1 << 20)
    sizes, mb = [], 1
    while mb <= top_mb:
        sizes.append(mb * 2**20)
        mb *= 4
    flops = cal.matmul_flops(device)
    hbm = cal.memory_bandwidth(device)
    adam = cal.adamw_params_per_s(n=16_000_000, threads=found.cpus)  # the node's CPUs together
    link, slowdown = {}, None
    if world > 1:
        times = cal.collective_times(world, sizes, backend="nccl" if cuda else "gloo")
        bw, alpha, busbw = cal.fit_link(times, world)
        ov = times["overlap"]
        slowdown = cal.slowdown_beside(ov["collective_s"], ov["gemm_s"], ov["overlapped_s"])
        link = {"busbw_bytes_per_s": bw, "latency_s": alpha,
                "per_size": {op: {str(k): v for k, v in d.items()} for op, d in busbw.items()},
                "overlap": dict(ov, slowdown_beside=slowdown), "gemm_per_rank_s": times["gemm_per_rank_s"],
                "rank_speed_spread": cal.rank_speed_spread(times["gemm_per_rank_s"])}
    else:
        bw, alpha = hbm, 0.0
    peak = {d: max(v.values()) for d, v in flops.items()}
    mem = torch.cuda.get_device_properties(0).total_memory if cuda else found.host_ram_bytes // world
    host_link = hbm
    if cuda:
        x = torch.empty(64 * 2**20 // 4).pin_memory()
        y = torch.empty_like(x, device=device)
        host_link = 64 * 2**20 / cal._timeit(lambda: y.copy_(x, non_blocking=False), device, 5)
    source = (f"measured by zplan calibrate on {torch.cuda.get_device_name(0) if cuda else 'CPU (1 thread per rank)'}, "
              f"torch {torch.__version__}")
    gpu = {"name": name, "memory_bytes": int(mem), "peak_flops": {k: float(f"{v:.4g}") for k, v in peak.items()},
           "hbm_bytes_per_s": float(f"{hbm:.4g}"), "host_link_bytes_per_s": float(f"{host_link:.4g}"),
           "measured": True, "device": "gpu" if cuda else "cpu", "source": source}
    if cuda:  # the per-op kernel model's constants (zplan/kernels.py), measured here
        gpu["kernels"] = cal.kernel_constants(device)
        if slowdown is not None:
            ov = link["overlap"]
            gpu["kernels"]["collective_slowdown"] = float(f"{slowdown:.3g}")
            gpu["kernels"]["source"] += (f"; compute beside a collective: {ov['gemms']} GEMMs of {ov['n']}^3 "
                                         f"beside an all-gather of {ov['nbytes'] / 2**20:g} MiB")
        cal.record_spread(gpu["kernels"], link.get("rank_speed_spread"), world)
        cal.keep_identity(gpu, preset_for(torch.cuda.get_device_name(0)))
    cluster = {"name": name, "gpu": name, "gpus_per_node": int(world),
               "intra_node_busbw_bytes_per_s": float(f"{bw:.4g}"),
               "inter_node_busbw_bytes_per_s": float(f"{bw / 10:.4g}"),
               "intra_node_latency_s": float(f"{alpha:.3g}"), "inter_node_latency_s": float(f"{alpha * 4:.3g}"),
               "link": "nvlink" if cuda else "loopback", "net_overhead_s": nccl_net_overhead_s(),
               "host_ram_bytes": int(found.host_ram_bytes), "cpu_adam_params_per_s": float(f"{adam:.4g}"),
               "source": source + ("; inter-node figures are not measured (assumed 1/10 and 4x)" if world > 1 else "")}
    if cuda and world > 1:
        cluster.update(cal.nvls_fields(busbw, bw, world))
    if cuda and world == 1:
        cal.one_gpu_links(cluster, gpu.get("base"))
    if not cuda and world == 1:  # CPU ranks share this host: one node of them, on cpu-local's links
        from ..presets import cluster as cluster_preset

        cal.one_gpu_links(cluster, "cpu", "rank")
        cluster["gpus_per_node"] = cluster_preset("cpu-local").gpus_per_node
    g, c = cal.write_presets(Path(output), name, gpu, cluster)
    if as_json:
        emit_json({"gpu": gpu, "cluster": cluster, "matmul_flops": {d: {str(k): v for k, v in x.items()} for d, x in flops.items()},
                   "link": link, "files": [str(g), str(c)]})
        return
    for d, per in flops.items():
        print(f"matmul {d}: " + ", ".join(f"{n}: {v / 1e9:,.1f} GFLOP/s" for n, v in per.items()))
    print(f"memory bandwidth: {hbm / 1e9:,.1f} GB/s; CPU AdamW: {adam / 1e6:,.0f} M params/s on {found.cpus} CPUs")
    if link:
        print(f"collectives over {world} ranks: bus bandwidth {bw / 1e9:,.2f} GB/s, latency {alpha * 1e6:,.0f} us per step")
        ov = link["overlap"]
        how = (f"{slowdown:.2f}x as long" if slowdown is not None else
               "not measured (the all-gather outlasted the GEMMs)")
        print(f"compute beside a collective: GEMMs {ov['gemm_s'] * 1e3:,.2f} ms alone, all-gather "
              f"{ov['collective_s'] * 1e3:,.2f} ms alone, {ov['overlapped_s'] * 1e3:,.2f} ms together: {how}")
        per, spread = link["gemm_per_rank_s"], link["rank_speed_spread"]
        print(f"one GEMM on each rank at once: {min(per) * 1e3:,.2f}-{max(per) * 1e3:,.2f} ms; spread "
              + (f"{spread:.2%} (one standard deviation over the median)" if spread is not None
                 else f"not estimated from {len(per)} ranks (4 or more)")
              + ("" if cuda else "; CPU ranks share cores, so this is not a device's spread"))
    print(f"wrote {g} and {c}; use --presets {output} --gpu {name} --cluster {name}")


def _verify_fake(strategy, world: int, model: str, seq_len: int, micro_batch: int, tolerance: float,
                 modes: list[str], linear_loss: str = "none", reserved: bool = False,
                 expandable: bool = False, logits_kept: bool = True,
                 embed_head_unit: str = "separate", as_json: bool = False, **options) -> None:
    """One traced step per strategy at real scale, against the planner (torch layout): the
    allocated peak (the tracker counts live tensors, not the allocator's reserve) and its phase;
    with `reserved`, the planner's reserved bytes against the caching allocator simulated over
    the traced steps' tensors (printed, not judged: the planner packs all but the loss's).
    `options`: further ScenarioOptions the trainer runs too (logits_fp32, last_block_kept,
    kv_cache, outputs_until_next_forward, loss_shifted_copy, attention_expands_kv, loss_chunks)."""
    from ..specs import CHECKPOINTING
    from typing import get_args

    from ..specs import EmbedHeadUnit
    from ..trainer.fake_trace import RESERVE_STEPS, fake_cell
    from ..parse import check_choice, check_range

    check_range(world, "--world-size", 1, 1 << 20)
    names = strategy or ["zero3"]
    from ..strategies import STRATEGIES

    for name in names:
        check_choice(name, "--strategy", tuple(STRATEGIES))
    for mode in modes:
        check_choice(mode, "--checkpointing", CHECKPOINTING)
    check_choice(linear_loss, "--linear-loss", ("none", "chunked"))
    check_choice(embed_head_unit, "--embed-head-unit", get_args(EmbedHeadUnit))
    from ..trainer.fake_trace import planned_cell

    for name in names:  # a refused strategy or model is said before the table's header
        planned_cell(model, world, seq_len, micro_batch, modes[0], name, linear_loss,
                     embed_head_unit=embed_head_unit, logits_kept=logits_kept, **options)
    bad, cells = [], []
    if not as_json:  # --json: one object at the end, the exact bytes of every cell
        print(f"{'strategy':28s} {'predicted':>12s} {'traced':>12s} {'error':>8s} {'phase (pred/traced)':>22s}"
              f"   traced by category (GiB)")
    if expandable and not reserved:
        raise UsageError("--expandable-segments goes with --reserved: add --reserved")
    for name, mode in ((n, md) for n in names for md in modes):
        c = fake_cell(model, world, seq_len, micro_batch, mode, name, linear_loss,
                      embed_head_unit=embed_head_unit, logits_kept=logits_kept, reserved=reserved,
                      **options)
        from ..policy import K_FIELD

        k = options.get(K_FIELD.get(mode, ""))
        label = f"{name} ckpt={mode}" + (f" k={k}" if k else "")
        cats = ", ".join(f"{k} {v / 2**30:.2f}" for k, v in c.categories.items() if v and k != "Total")
        cells.append({"cell": label, "strategy": name, "checkpointing": mode, "checkpoint_k": k,
                      "predicted_bytes": c.predicted_bytes, "traced_bytes": c.traced_bytes, "error": c.error,
                      "predicted_phase": c.predicted_phase, "traced_phase": c.traced_phase,
                      "traced_by_category": c.categories, "ok": c.ok(tolerance),
                      "reserved": ({how: {"predicted_bytes": p, "simulated_bytes": t}
                                    for how, (p, t) in c.reserved_by_allocator.items()}
                                   if c.reserved_by_allocator else None)})
        if as_json:
            if not c.ok(tolerance):
                bad.append(label)
            continue
        print(f"{label:28s} {c.predicted_bytes / 2**30:>8.2f} GiB {c.traced_bytes / 2**30:>8.2f} GiB "
              f"{c.error:>+8.1%} {c.predicted_phase + '/' + c.traced_phase:>22s}   {cats}")
        if reserved:
            how = "expandable" if expandable else "classic"
            p, t = c.reserved_by_allocator[how]
            print(f"{'  reserved (' + how + ')':28s} {p / 2**30:>8.2f} GiB {t / 2**30:>8.2f} GiB "
                  f"{(p - t) / t:>+8.1%}   traced: the caching allocator simulated over "
                  f"{RESERVE_STEPS} steps' tensors")
        if not c.ok(tolerance):
            bad.append(label)
    if as_json:
        from ..verify import SIGN

        emit_json({"sign": SIGN, "tolerance": tolerance, "model": model, "world": world, "seq_len": seq_len,
                   "micro_batch": micro_batch, "compared": "allocated peak, FSDPMemTracker under FakeTensorMode",
                   "cells": cells, "ok": not bad})
    if bad:
        raise PlanError(f"{', '.join(bad)}: predicted peak outside {tolerance:.0%} of PyTorch's tracker, "
                        f"or in another phase, at {world} ranks")
