"""The plan file: the one contract between planning (recommend) and running (launch, trainer).

Versioned and validated (zplan/validated.py, extra fields refused). It embeds the full model, GPU and
cluster specs so it runs the same wherever it is read, and the predicted figures so a run can
report measured against predicted. Written atomically. Documented in docs/plan-file.md.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from . import __version__
from .errors import UsageError
from .files import read_json, write_text as write_atomic  # noqa: F401  (write_atomic: re-exported)
from .scenario import Scenario
from .strategies import effective
from .specs import (Assumptions, ClusterSpec, GPUSpec, Hardware, ModelSpec, StrategyName, TrainSpec,
                    validation_line)
from .validated import Field, Record, ValidationError, model_validator

PLAN_VERSION = 1
Runner = Literal["zplan", "deepspeed"]
# What runs the plan decides the memory layout: zplan's FSDP2 trainer keeps full-precision
# sharded weights (torch layout); DeepSpeed keeps 16-bit weights and a separate master (zero).
RUNNER_LAYOUT = {"zplan": "torch", "deepspeed": "zero"}
LAYOUT_RUNNER = {v: k for k, v in RUNNER_LAYOUT.items()}
NO_RESHARD = ("zero2", "zero3-noreshard")  # FSDP2 keeps the weights gathered after forward


class Mesh(Record):
    shape: list[int]
    dim_names: list[str]


class Predicted(Record):
    per_gpu: dict[str, int]
    step_s: float
    tokens_per_s_per_gpu: float
    mfu: float
    elements_per_step: int
    bytes_per_step: int
    exposed_comm_s: float


class Plan(Record):
    plan_version: Literal[1] = PLAN_VERSION
    created_by: str = f"zplan {__version__}"
    runner: Runner = Field("zplan", description="what runs it: zplan's trainer (launch) or DeepSpeed (export)")
    model: ModelSpec
    gpu: GPUSpec
    cluster: ClusterSpec
    num_gpus: int = Field(ge=1)
    strategy: StrategyName
    shard_size: int | None = None
    mesh: Mesh
    train: TrainSpec
    global_batch: int = Field(ge=1, description="sequences per optimizer step, all ranks")
    assumptions: Assumptions = Assumptions()
    predicted: Predicted | None = None

    @model_validator(mode="before")
    @classmethod
    def _runner_from_layout(cls, data):
        """A plan written before `runner` existed is for whatever its layout implies."""
        if isinstance(data, dict) and "runner" not in data:
            train = data.get("train")
            layout = train.get("layout", "zero") if isinstance(train, dict) else None
            if layout in LAYOUT_RUNNER:
                data = {**data, "runner": LAYOUT_RUNNER[layout]}
        return data

    @model_validator(mode="after")
    def _consistent(self) -> Plan:
        why = inconsistency(self)
        if why:
            raise ValueError(why)
        return self

    def scenario(self) -> Scenario:
        hw = Hardware(gpu=self.gpu, cluster=self.cluster, num_gpus=self.num_gpus)
        return Scenario(self.model, hw, self.train, self.assumptions, self.shard_size)


def inconsistency(plan: Plan) -> str | None:
    """Why the plan's fields contradict one another (with the fix), or None."""
    n, t, s = plan.num_gpus, plan.train, plan.shard_size
    fix = "write it again with zplan recommend --write"
    if t.layout != RUNNER_LAYOUT[plan.runner]:
        return (f"runner {plan.runner!r} keeps the {RUNNER_LAYOUT[plan.runner]} memory layout but "
                f"train.layout is {t.layout!r}; {fix} (--for {LAYOUT_RUNNER[t.layout]} plans the {t.layout} layout)")
    if plan.strategy == "hsdp":
        if s is None or s < 1 or n % s:
            return f"hsdp needs a shard_size that divides num_gpus {n}, not {s}; {fix}"
        want = Mesh(shape=[n // s, s], dim_names=["replicate", "shard"])
    else:
        if s is not None:
            return f"shard_size {s} is for hsdp; strategy {plan.strategy} has none (null); {fix}"
        want = mesh_for_n(n, plan.strategy)
    if plan.mesh != want:
        return (f"mesh {plan.mesh.shape} {plan.mesh.dim_names} does not match {plan.strategy} on "
                f"{n} ranks ({want.shape} {want.dim_names}); {fix}")
    per_step = t.micro_batch * t.grad_accum * n
    if plan.global_batch != per_step:
        return (f"global_batch {plan.global_batch} is not micro_batch {t.micro_batch} x grad_accum "
                f"{t.grad_accum} x {n} data-parallel ranks = {per_step} (ranks would read "
                f"overlapping or missing samples); {fix}")
    if plan.strategy not in ("ddp", "zero1") and t.reshard_after_forward != (plan.strategy not in NO_RESHARD):
        return (f"train.reshard_after_forward {t.reshard_after_forward} contradicts strategy "
                f"{plan.strategy}; {fix} (zero3-noreshard is zero3 without resharding)")
    L = plan.model.num_layers
    if t.checkpointing == "first-k" and t.checkpoint_first > L:
        return f"checkpoint_first {t.checkpoint_first} exceeds the model's {L} layers; {fix}"
    over = [f"{k} {v}" for k, v, used in (("blocks_per_unit", t.blocks_per_unit, True),
                                          ("checkpoint_every", t.checkpoint_every, t.checkpointing == "every-k"))
            if used and v > L]
    if over:  # only what is out of range, and checkpoint_every only where every-k reads it
        return f"{' and '.join(over)} exceed{'s' if len(over) == 1 else ''} the model's {L} layers; {fix}"
    return None


# ------------------------------------------------------------ what zplan's trainer runs

TRAINER_PARAM_DTYPES = ("fp32", "bf16")  # fp16 would need a loss scaler, which the trainer lacks
TRAINER_STATE_DTYPES = ("fp32", "bf16")


def trainer_refusal(plan: Plan, builtin_model: bool = True) -> str | None:
    """Why zplan's trainer (zplan launch, python -m zplan.trainer) cannot run this plan as
    planned, with the fix; None when it applies every field. Torch-free: launch asks before
    starting any process, the trainer asks again in every rank. `builtin_model` False: a user's
    script brings its own model (zplan.trainer.api), so the model's architecture is not checked."""
    t, p, m = plan.train, plan.train.precision, plan.model
    if plan.runner != "zplan":
        return (f"this plan is for {plan.runner} (runner {plan.runner!r}, {t.layout} layout): run it with "
                f"zplan export --to {plan.runner}, or plan for zplan's trainer with zplan recommend --for zplan")
    if plan.strategy == "offload-opt":
        return ("offload-opt keeps the weights on the GPU and only the optimizer in host RAM, which "
                "FSDP2 cannot do: plan again with --strategy offload-all, or --for deepspeed and export")
    if t.optimizer != "adamw":
        # DeepSpeed's export writes SGD and Muon, not 8-bit Adam (export.deepspeed_config)
        other = ", or --for deepspeed and export" if t.optimizer != "adam8bit" else ", or run it in your own script"
        return (f"the trainer runs AdamW; the plan asks for {t.optimizer}: plan again with "
                f"--optimizer adamw{other}")
    if p.param not in TRAINER_PARAM_DTYPES:
        return (f"param dtype {p.param}: the trainer computes in {' or '.join(TRAINER_PARAM_DTYPES)} "
                f"(fp16 needs a loss scaler it does not have): plan again with --param-dtype bf16")
    for what, v in (("reduce", p.reduce), ("master", p.master)):
        if v not in TRAINER_STATE_DTYPES:
            return f"{what} dtype {v}: the trainer keeps fp32 or bf16: plan again with --{what}-dtype fp32"
    if p.optimizer != p.master:
        return (f"optimizer dtype {p.optimizer} differs from master dtype {p.master}: torch's AdamW "
                f"keeps its state in the weights' dtype: plan again with --optimizer-dtype {p.master}")
    if plan.strategy in ("ddp", "zero1") and p.reduce != p.master:
        return (f"{plan.strategy} reduces gradients in the weights' dtype ({p.master}), not {p.reduce}: "
                f"plan again with --reduce-dtype {p.master}")
    if t.float8 or t.compile:
        flag = "--float8" if t.float8 else "--compile"
        return (f"the trainer runs eager bf16/fp32 linears, not {flag[2:]}: plan again without "
                f"{flag}, or export the plan for your own training code")
    if not t.checkpoint_early_stop and t.checkpointing in ("full", "every-k", "first-k", "selective"):
        return ("the trainer checkpoints with torch's non-reentrant checkpoint, which stops "
                "recomputing once backward's tensors are rebuilt: plan again without "
                "--no-checkpoint-early-stop, or export the plan")
    if t.checkpoint_wraps_unit:
        return ("the trainer checkpoints inside each sharded unit (one gather in backward): plan "
                "again without --checkpoint-wraps-unit, or export the plan")
    if t.fsdp1 and effective(plan.strategy, t.layout).fsdp:
        return ("the trainer shards with fully_shard (FSDP2), not FullyShardedDataParallel: plan "
                "again without --fsdp1, or export the plan")
    if t.kv_cache and t.linear_loss != "none" and builtin_model:
        return ("the trainer's chunked loss runs inside its head, whose model then returns no keys and "
                "values: plan again without --kv-cache, or with --linear-loss none")
    if not t.flash_attention:
        return ("the trainer always runs fused attention (scaled_dot_product_attention), which keeps "
                "no s x s scores: plan again with --flash")
    if not builtin_model:  # the script computes its own loss
        if t.last_block_kept and plan.strategy not in NO_RESHARD:
            return ("the plan keeps the last block gathered after forward (--last-block-kept), and "
                    "which of your script's units holds it is not known to zplan.trainer.api: plan "
                    "again without --last-block-kept, or run the built-in model")
        return None
    if t.attention_kernel not in ("flash2", "cudnn"):
        return (f"the trainer's attention is PyTorch's causal scaled_dot_product_attention, with "
                f"its FlashAttention-2 (flash2) or cuDNN (cudnn) kernel first, not {t.attention_kernel}: "
                f"plan again with --attention-kernel flash2 or cudnn, or export the plan")
    if plan.gpu.device != "cpu" and p.param == "fp32" and m.num_kv_heads != m.num_heads:
        # torch's SDPA docs: GQA works only in the flash and math kernels on CUDA; flash takes
        # fp16/bf16 alone, so fp32 falls to math, which keeps b x h x s x s fp32 scores
        return (f"fp32 attention with grouped KV heads ({m.num_kv_heads} of {m.num_heads}) runs "
                f"PyTorch's math kernel on CUDA (flash takes bf16/fp16 only), which keeps every "
                f"s x s score, not the flash kernel the plan prices: plan again with --param-dtype bf16")
    if t.attention_heads_first:
        return ("--attention-heads-first describes a model whose q reaches the attention heads-first "
                "in memory (litgpt's); the trainer's applies RoPE before the heads move, so the kernel's "
                "output is read as a view: plan again without --attention-heads-first, or run your "
                "own model (zplan.trainer.api) or export the plan")
    if t.linear_loss == "liger" or t.fused_swiglu:
        flag = "--linear-loss liger" if t.linear_loss == "liger" else "--fused-swiglu"
        return (f"{flag} is Liger-Kernel's (Triton); the trainer runs torch ops: plan again "
                f"{'with --linear-loss chunked' if t.linear_loss == 'liger' else 'without --fused-swiglu'}, "
                f"or export the plan")
    if not t.fused_norm and not t.norm_output_fp32:
        return ("the trainer's unfused norm is F.rms_norm, which keeps its normalized output in "
                "fp32: plan again without --no-norm-output-fp32, or export the plan")
    if t.loss_fused or not plan.assumptions.loss_fp32:
        why, flag = (("compiled", "--compile") if t.compile_loss else
                     ("fused", "--fused-loss") if t.fused_loss else ("in the logits' dtype", "--no-loss-fp32"))
        return (f"the trainer computes the loss eager over fp32 logits, not {why}: plan again "
                f"without {flag}, or export the plan")
    why = model_refusal(m)
    if why:
        fix = ("plan again with --model NAME" if m.total_params is not None else
               "plan again with --no-qkv-fused, or export the plan" if why.startswith("the trainer runs q")
               else "export the plan for your own training code")
        return f"{why}: {fix}"
    return None


def model_refusal(m) -> str | None:
    """Why zplan's trainer cannot build model `m` (a ModelSpec), without the fix (the caller's:
    launch and the trainer say how to plan again, verify --fake which models it traces); None
    where it can."""
    if m.total_params is not None:
        return f"model {m.name} is a bare parameter count, not an architecture the trainer can build"
    if m.num_experts or m.position != "rope" or m.norm != "rmsnorm" or m.dropout:
        return f"the trainer builds dense RoPE/RMSNorm decoders without dropout; {m.name} is not one"
    if m.qkv_fused:
        return f"the trainer runs q, k and v as three linears, not one ({m.name}'s layout or --qkv-fused)"
    return None


def node_problem(plan: Plan, ranks_per_node: int, gpus_found: int) -> str | None:
    """Why `ranks_per_node` ranks of this plan cannot run on a node with `gpus_found` GPUs (0:
    CPU ranks), or None: the launcher asks before starting torchrun."""
    if plan.num_gpus % ranks_per_node:
        return (f"the plan is for {plan.num_gpus} ranks, not a multiple of {ranks_per_node} per node: "
                f"pick a divisor of {plan.num_gpus}")
    if plan.gpu.device == "cpu":
        if gpus_found:
            return (f"the plan is for CPU ranks but this node has {gpus_found} GPUs: plan again with "
                    f"--gpu auto --gpus {gpus_found}")
        return None
    if ranks_per_node > gpus_found:
        nodes = -(-plan.num_gpus // max(1, gpus_found))
        return (f"the plan puts {ranks_per_node} ranks on a node but this node has {gpus_found} GPUs: "
                f"run it on {nodes} nodes (--nnodes {nodes}) or plan again with --gpus {gpus_found}"
                if gpus_found else
                f"the plan is for {plan.gpu.name} GPUs but this node has none: plan for CPU ranks "
                f"with zplan recommend --gpu cpu --cluster cpu-local")
    return None


def mesh_for_n(n: int, strategy: str) -> Mesh:
    return Mesh(shape=[n], dim_names=["replicate" if strategy == "ddp" else "shard"])


def mesh_for(sc: Scenario, strategy: str) -> Mesh:
    if strategy == "hsdp":
        s = sc.hsdp_shard
        return Mesh(shape=[sc.n // s, s], dim_names=["replicate", "shard"])
    return mesh_for_n(sc.n, strategy)


def planned_train(train, strategy: str):
    """The train fields as a plan file records them for `strategy`: FSDP2 keeps the weights
    gathered after forward under zero2 and zero3-noreshard (NO_RESHARD)."""
    return train.model_copy(update={"reshard_after_forward": strategy not in NO_RESHARD})


def make_plan(sc: Scenario, strategy: str, global_batch: int, result=None) -> Plan:
    predicted = None
    if result is not None and result.memory is not None:
        t = result.timing
        predicted = Predicted(
            per_gpu=result.memory.as_dict(), step_s=t.step_s,
            tokens_per_s_per_gpu=t.tokens_per_s_per_gpu, mfu=t.mfu,
            elements_per_step=result.elements_per_step, bytes_per_step=result.bytes_per_step,
            exposed_comm_s=t.exposed_comm_s)
    train = planned_train(sc.train, strategy)
    return Plan(runner=LAYOUT_RUNNER[sc.train.layout], model=sc.model, gpu=sc.hw.gpu, cluster=sc.hw.cluster, num_gpus=sc.n,
                strategy=strategy, shard_size=sc.hsdp_shard if strategy == "hsdp" else None,
                mesh=mesh_for(sc, strategy), train=train, global_batch=global_batch,
                assumptions=sc.assume, predicted=predicted)


def save(plan: Plan, path: str | Path) -> None:
    write_atomic(path, plan.model_dump_json(indent=2) + "\n")


def load(path: str | Path) -> Plan:
    """Read and validate a plan file (files.read_json: regular file, size, UTF-8, depth, no NaN)."""
    p = Path(path)
    data = read_json(p, "plan")
    if not isinstance(data, dict):
        raise UsageError(f"plan {p} is not a JSON object; write one with zplan recommend --write {p}")
    if data.get("plan_version") not in (None, PLAN_VERSION):
        shown = " ".join(repr(data.get("plan_version")).split())[:40]
        raise UsageError(f"plan {p} has plan_version {shown}; this zplan reads "
                         f"version {PLAN_VERSION}: write it again with zplan recommend --write")
    missing = _missing_fields(data)
    if missing:
        raise UsageError(f"plan {p} has no field '{missing}', which every plan names (its default would run a "
                         f"configuration nobody chose): put it back, or write the plan again with zplan recommend --write")
    try:
        plan = Plan.model_validate(data)
    except ValidationError as e:
        raise UsageError(validation_line(f"plan {p}", e)) from None
    check_plan_numbers(plan, p)
    return plan


# The settings every plan has named since plan_version 1 (zplan/specs.py at e6214e3, the first
# plan.py): a file without one was edited by hand, and its default would run a configuration
# nobody chose. Fields added since are read at their defaults, which are what the zplan that
# wrote an older plan assumed, but for the assumptions that price what it left out (DeepSpeed's
# hook time, 2026-12-07: 0 then, measured now), which an older plan reads at today's figure and
# its fresh prediction shows; a field added later never joins this list.
PLAN_V1_FIELDS = {
    "train": ("seq_len", "micro_batch", "grad_accum", "checkpointing", "checkpoint_every", "flash_attention",
              "optimizer", "precision", "layout", "blocks_per_unit", "reshard_after_forward", "prefetch",
              "reduce_every_microbatch"),
    "assumptions": ("compute_efficiency", "cuda_context_bytes", "fragmentation", "ddp_bucket_bytes", "overlap"),
}


def _missing_fields(data: dict) -> str | None:
    """The first setting a plan file lacks of those every plan has carried (PLAN_V1_FIELDS), the
    sections themselves and the other fields the run reads; under first-k, its k (no plan with
    first-k was written without checkpoint_first)."""
    for name in ("model", "gpu", "cluster", "num_gpus", "strategy", "mesh", "train", "global_batch", "assumptions"):
        if name not in data:
            return name
    for name, fields in PLAN_V1_FIELDS.items():
        section = data[name]
        if isinstance(section, dict):  # a section of another type: the validator's line names it
            needed = fields + (("checkpoint_first",) if name == "train" and section.get("checkpointing") == "first-k" else ())
            for field in needed:
                if field not in section:
                    return f"{name}.{field}"
    return None


def check_plan_numbers(plan: Plan, p: Path) -> None:
    """Every number in the plan finite, non-negative and sane (specs' bounds); N and batch bounded."""
    from .specs import MAX_GPUS, MAX_GRAD_ACCUM, MAX_MICRO_BATCH, bad_number

    for name in Plan.model_fields:
        why = bad_number(getattr(plan, name).model_dump() if isinstance(getattr(plan, name), Record)
                         else getattr(plan, name))
        if why:
            raise UsageError(f"plan {p}: field '{name}': {why}; write it again with zplan recommend --write")
    limits = (("num_gpus", plan.num_gpus, MAX_GPUS),
              ("global_batch", plan.global_batch, MAX_GPUS * MAX_MICRO_BATCH * MAX_GRAD_ACCUM),
              ("shard_size", plan.shard_size, plan.num_gpus))
    for name, v, hi in limits:
        if v is not None and not 1 <= v <= hi:
            raise UsageError(f"plan {p}: field '{name}' is {v}, outside 1..{hi}; "
                             f"write it again with zplan recommend --write")


def fresh_prediction(plan: Plan, path: str) -> tuple[Plan, str | None]:
    """The plan with the figures its own settings give now (estimate_one), and a note where the
    file's `predicted` differs from them (a plan edited by hand keeps the figures of the plan it
    was: a run compared with those would blame the model for the edit) or has none."""
    from .estimate import estimate_one
    from .units import fmt_bytes, fmt_s

    r = estimate_one(plan.scenario(), plan.strategy)
    if r.memory is None:
        return plan, None
    fresh = make_plan(plan.scenario(), plan.strategy, plan.global_batch, r).predicted
    old = plan.predicted
    same = old is not None and old.per_gpu == fresh.per_gpu and \
        abs(old.step_s - fresh.step_s) <= 1e-9 * max(1.0, fresh.step_s)
    if same:
        return plan, None
    why = ("has no predicted figures" if old is None else
           "holds predicted figures its settings do not give (edited by hand, or written by another zplan)")
    return (plan.model_copy(update={"predicted": fresh}),
            f"{path} {why}: the run is compared with zplan's estimate of its settings "
            f"({fmt_bytes(fresh.per_gpu['total_bytes'])} per GPU, step {fmt_s(fresh.step_s)})")


def fit_note(plan: Plan, path: str) -> str | None:
    """A plan that does not fit its own GPU by zplan's estimate (a hand-edited one: recommend
    writes only plans that fit), said before it is exported or launched; None where it fits."""
    from .estimate import estimate_one

    r = estimate_one(plan.scenario(), plan.strategy)
    if r.memory is None or r.fits:
        return None
    return (f"by zplan's own estimate {path} does not fit a {plan.gpu.name} ({r.memory.total_bytes / 1e9:.1f} "
            f"GB of {plan.gpu.memory_bytes / 1e9:.1f} GB); zplan estimate --plan {path} says why")
