"""Predicted against measured on the public validation set (benchmarks/published/*.toml).

Usage: python benchmarks/published_accuracy.py [--markdown [FILE]] [--summary [FILE]] [--rows ID ...]

For every row it builds the scenario through the library with the row's facts only (model, GPU,
GPU count and per node, strategy, micro-batch, accumulation, sequence, checkpointing, dtypes, the
HSDP shard size, the attention and norm kernels) and zplan's DEFAULT assumptions, then compares tokens/s per GPU and peak memory.
Rows zplan cannot express (tensor, pipeline, context parallelism; an unstated checkpointing
fraction) are listed with the reason and kept out of the statistics. --markdown writes
docs/accuracy.md; --summary presets/public_accuracy.json, the per-GPU summary `zplan estimate`
prints beside its predictions (zplan/public_accuracy.py). The set is a test set: nothing here may be
tuned to it.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import dataclass, replace
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks" / "published"))
sys.path.insert(0, str(ROOT))

import accuracy_report  # noqa: E402
from published_rows import Row, load  # noqa: E402

from zplan.errors import UsageError  # noqa: E402
from zplan.estimate import TIGHT_FREE_FRACTION, estimate_one  # noqa: E402
from zplan.scenario_options import FIELDS, ScenarioOptions, build  # noqa: E402

COMMAND = "python benchmarks/published_accuracy.py --markdown --summary"
SUMMARY = ROOT / "presets" / "public_accuracy.json"


@dataclass(frozen=True)
class Result:
    row: Row
    tokens_pred: float | None = None
    memory_pred_bytes: int | None = None
    memory_compared_to: str = ""  # which predicted figure the measured memory is held against
    ignored: tuple[str, ...] = ()  # row facts zplan has no option for (compile, float8)
    error: str = ""  # the scenario could not be built: the one-line reason
    fits: bool | None = None  # zplan's verdict on the row's configuration (every row ran)
    comm_share: float | None = None  # predicted collective seconds per step / compute seconds
    free_share: float | None = None  # predicted free GPU memory / the GPU's memory

    @property
    def tokens_err(self) -> float | None:
        r = self.row.tokens_per_s_per_gpu
        return None if r is None or self.tokens_pred is None else self.tokens_pred / r - 1

    @property
    def memory_err(self) -> float | None:
        m = self.row.memory_bytes
        return None if m is None or self.memory_pred_bytes is None else self.memory_pred_bytes / m - 1


def options(row: Row) -> tuple[ScenarioOptions, tuple[str, ...]]:
    """The row's facts as scenario options; what zplan has no option for is returned as ignored."""
    o = ScenarioOptions(
        model=row.model, gpu=row.gpu, cluster=row.cluster, gpus=str(row.num_gpus),
        gpus_per_node=row.gpus_per_node, seq_len=row.seq_len, micro_batch=row.micro_batch,
        grad_accum=row.grad_accum, checkpointing=row.checkpointing, param_dtype=row.param_dtype,
        reduce_dtype=row.reduce_dtype, master_dtype=row.master_dtype,
        optimizer_dtype=row.optimizer_dtype, reduce_last_only=row.reduce_last_only, layout=row.layout, shard_size=row.shard_size,
        attention_kernel=row.attention_kernel, fused_norm=row.fused_norm, loss_fp32=row.loss_fp32,
        checkpoint_early_stop=row.checkpoint_early_stop, fused_loss=row.fused_loss,
        checkpoint_wraps_unit=row.checkpoint_wraps_unit, checkpoint_first=row.checkpoint_first or 1, fsdp1=row.fsdp1,
        linear_loss=row.linear_loss, fused_swiglu=row.fused_swiglu, qkv_fused=True if row.qkv_fused else None,
        norm_output_fp32=row.norm_output_fp32, optimizer_kernels=row.optimizer_kernels,
        optimizer=row.optimizer,
        grad_clip=row.grad_clip, sac_saves_attention=row.sac_saves_attention, zero_init=row.zero_init, embed_head_unit=row.embed_head_unit,
        deepspeed_defaults=row.deepspeed_defaults, deepspeed_param_groups=row.deepspeed_param_groups, deepspeed_sub_group=row.deepspeed_sub_group,
        logits_kept=row.logits_kept, ddp_bucket_view=row.ddp_bucket_view,
        logits_fp32=row.logits_fp32, last_block_kept=row.last_block_kept,
        kv_cache=row.kv_cache, attention_expands_kv=row.attention_expands_kv, attention_heads_first=row.attention_heads_first, loss_chunks=row.loss_chunks, loss_shifted_copy=row.loss_shifted_copy, outputs_until_next_forward=row.outputs_until_next_forward,
        expandable_segments=row.expandable_segments,
    )
    if row.bucket_mib is not None:
        o = replace(o, bucket_mib=row.bucket_mib)
    ignored = []
    if row.compile:
        if "compile" in FIELDS:
            o = replace(o, compile=True, eager_loss=row.compile_loss is False)
            if row.compile_scope != "block":
                o = replace(o, compile_scope=row.compile_scope)
        else:
            ignored.append("compile")
    if row.float8 != "none":
        if row.float8.startswith("tensorwise"):
            # torchao's tensorwise recipe; float8 all-gather as the row states it (tensorwise-fp8-allgather,
            # or float8_all_gather), and where it is not stated zplan's default (on)
            o = replace(o, float8=True)
            if row.float8_all_gather is not None:  # stated by the run (torchao's enable_fsdp_float8_all_gather)
                o = replace(o, float8_all_gather=row.float8_all_gather)
        else:  # torchao's rowwise recipes, TransformerEngine's delayed scaling
            o = replace(o, float8=True, float8_recipe=row.float8)
    return o, tuple(ignored)


def scenario(row: Row):
    """The row's scenario, built through the library; returns (scenario, ignored facts)."""
    o, ignored = options(row)
    sc = build(o)
    if sc.model.position == "learned" and sc.model.max_seq_len != row.seq_len:
        # a learned position table is built for the run's sequence (llm-foundry sets model.max_seq_len)
        sc = replace(sc, model=sc.model.model_copy(update={"max_seq_len": row.seq_len}))
    return sc, ignored


def predict(row: Row) -> Result:
    """One row through the library: build the scenario, estimate the row's strategy."""
    try:
        sc, ignored = scenario(row)
    except UsageError as e:
        return Result(row, ignored=options(row)[1], error=str(e))
    est = estimate_one(sc, row.strategy)
    if est.memory is None or est.timing is None:
        return Result(row, ignored=ignored, error=est.unavailable or "no estimate")
    mem, compared = _memory_figure(est.memory, sc, row.memory_kind or "reserved")
    comm_s = sum(c.seconds_per_step for c in est.collectives)
    return Result(row, est.timing.tokens_per_s_per_gpu, mem, compared, ignored, fits=est.fits,
                  comm_share=comm_s / est.timing.compute_s,
                  free_share=1 - est.memory.total_bytes / sc.hw.gpu.memory_bytes)


COMM_GROUP = "communication / compute (predicted)"
COMM_BANDS = ((0.02, "00-02%"), (0.05, "02-05%"), (0.10, "05-10%"), (0.30, "10-30%"),
              (1.00, "30-100%"))


def comm_band(share: float | None) -> str:
    """The band of a row's predicted communication per step against its compute: the rows
    where more of the step is communication the model overlaps."""
    if share is None:
        return "-"
    return next((label for top, label in COMM_BANDS if share < top), ">100%")


FREE_GROUP = "free memory (predicted)"


def free_band(share: float | None, fits: bool | None = True) -> str:
    """The band of a row's predicted free GPU memory: under estimate's tight line
    (TIGHT_FREE_FRACTION) a run is near the allocator's limit, where PyTorch's caching allocator
    frees its cache and retries (a device synchronisation) when a request fails; a row zplan
    predicts not to fit has a band of its own."""
    if share is None:
        return "-"
    if fits is False:
        return "does not fit"
    return f"under {TIGHT_FREE_FRACTION:.0%} (tight)" if share < TIGHT_FREE_FRACTION else (
        f"{TIGHT_FREE_FRACTION:.0%}-20%" if share < 0.20 else "20% or more")


def _memory_figure(memory, sc, kind: str) -> tuple[int, str]:
    """The predicted figure comparable to a measured peak of PyTorch's caching allocator.

    reserved: reserved memory excludes the CUDA context (not allocator memory), so the context
    assumption is taken off the total. allocated: live tensors only, so the whole overhead
    (context and the fragmentation allowance) is taken off. A reserved or allocated prediction,
    where the planner offers one, is used as it is.
    """
    own = getattr(memory, f"{kind}_bytes", None)
    if own is not None:
        return int(own), f"{kind}_bytes"
    if kind == "allocated":
        return memory.total_bytes - memory.overhead_bytes, "total_bytes - overhead"
    return memory.total_bytes - sc.assume.cuda_context_bytes, "total_bytes - context"


def run(rows: list[Row]) -> list[Result]:
    return [predict(r) if r.expressible else Result(r) for r in rows]


def stats(errs: list[float]) -> tuple[int, float, float, float]:
    """n, mean |error|, max |error|, mean signed error (bias), as fractions."""
    if not errs:
        return 0, math.nan, math.nan, math.nan
    return len(errs), sum(map(abs, errs)) / len(errs), max(map(abs, errs)), sum(errs) / len(errs)


GROUPS = {
    "all": lambda r: "all",
    "GPU": lambda r: r.row.gpu_kind,
    "GPU variant": lambda r: r.row.gpu_variant or r.row.gpu,
    "source": lambda r: r.row.source.name,
    "compile/float8": lambda r: r.row.flags,
    "checkpointing": lambda r: r.row.checkpointing,
    COMM_GROUP: lambda r: comm_band(r.comm_share),
    FREE_GROUP: lambda r: free_band(r.free_share, r.fits),
    "memory kind": lambda r: r.row.memory_kind or "-",
}


def group_table(results: list[Result], metric: str) -> list[tuple[str, str, tuple]]:
    """(group, value, stats) for every grouping of the scored rows."""
    scored = [r for r in results if r.row.expressible and not r.error]
    out = []
    for gname, key in GROUPS.items():
        if (metric, gname) in (("tokens", "memory kind"), ("memory", COMM_GROUP)):
            continue
        values = sorted({key(r) for r in scored})
        for v in values:
            errs = [getattr(r, f"{metric}_err") for r in scored if key(r) == v]
            errs = [e for e in errs if e is not None]
            if errs:
                out.append((gname, v, stats(errs)))
    return out


def _errors_summary(errs: list[float]) -> dict | None:
    """rows, mean |error|, the 90th percentile of |error| (nearest rank) and the mean signed
    error (+: predicted above measured), as fractions rounded to 0.1%."""
    if not errs:
        return None
    a = sorted(abs(e) for e in errs)
    return {"rows": len(errs), "mean_abs": round(sum(a) / len(a), 3),
            "p90_abs": round(a[math.ceil(0.9 * len(a)) - 1], 3), "bias": round(sum(errs) / len(errs), 3)}


def summary(results: list[Result]) -> dict:
    """What `zplan estimate` prints beside its predictions: for each GPU preset the set's rows
    were predicted with (those on a variant of it, such as a power-capped board, included), and
    over every scored row, how far tokens/s and peak memory were from the measurements."""
    scored = [r for r in results if r.row.expressible and not r.error]

    def block(rs: list[Result]) -> dict:
        return {m: _errors_summary([e for e in (getattr(r, f"{m}_err") for r in rs) if e is not None])
                for m in ("tokens", "memory")}

    return {"generated_by": COMMAND, "report": "docs/accuracy.md", "all": block(scored),
            "gpus": {g: block([r for r in scored if r.row.gpu == g]) for g in sorted({r.row.gpu for r in scored})}}


def write_atomically(path: Path, text: str) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(text)
    tmp.replace(path)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--markdown", nargs="?", const=str(ROOT / "docs" / "accuracy.md"), default=None,
                    help="write the report as Markdown (default docs/accuracy.md)")
    ap.add_argument("--summary", nargs="?", const=str(SUMMARY), default=None,
                    help="write the per-GPU summary estimate prints (default presets/public_accuracy.json)")
    ap.add_argument("--rows", nargs="+", metavar="ID", help="only these row ids")
    a = ap.parse_args(argv)
    rows = load()
    if a.rows:
        unknown = sorted(set(a.rows) - {r.id for r in rows})
        if unknown:
            print(f"unknown row id(s): {', '.join(unknown)}; ids are in benchmarks/published/*.toml", file=sys.stderr)
            return 2
        rows = [r for r in rows if r.id in a.rows]
    results = run(rows)
    groups = {"tokens/s per GPU": group_table(results, "tokens"), "peak memory": group_table(results, "memory")}
    print(accuracy_report.text(results, groups))
    if a.markdown:
        compared = sorted({f"{r.row.memory_kind} against `{r.memory_compared_to}`" for r in results
                           if r.memory_compared_to and r.row.memory is not None})
        text = accuracy_report.markdown(results, groups, COMMAND, "; ".join(compared))
        out = Path(a.markdown)
        write_atomically(out, text)
        print(f"wrote {out}")
    if a.summary:
        if a.rows:
            print("--summary is of the whole set: drop --rows", file=sys.stderr)
            return 2
        write_atomically(Path(a.summary), json.dumps(summary(results), indent=1, sort_keys=True) + "\n")
        print(f"wrote {a.summary}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
