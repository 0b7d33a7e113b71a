"""The plan file: the one contract between planning (recommend) and running (launch, trainer).

Versioned and validated (pydantic, extra fields refused). It embeds the full model, GPU and
cluster specs so it runs the same wherever it is read, and the predicted figures so a run can
report measured against predicted. Written atomically. Documented in docs/plan-file.md.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from . import __version__
from .errors import UsageError
from .scenario import Scenario
from .specs import Assumptions, ClusterSpec, GPUSpec, Hardware, ModelSpec, StrategyName, TrainSpec

PLAN_VERSION = 1


class Mesh(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")
    shape: list[int]
    dim_names: list[str]


class Predicted(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")
    per_gpu: dict[str, int]
    step_s: float
    tokens_per_s_per_gpu: float
    mfu: float
    elements_per_step: int
    bytes_per_step: int
    exposed_comm_s: float


class Plan(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")
    plan_version: Literal[1] = PLAN_VERSION
    created_by: str = f"zplan {__version__}"
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

    def scenario(self) -> Scenario:
        hw = Hardware(gpu=self.gpu, cluster=self.cluster, num_gpus=self.num_gpus)
        return Scenario(self.model, hw, self.train, self.assumptions, self.shard_size)


def mesh_for(sc: Scenario, strategy: str) -> Mesh:
    if strategy == "hsdp":
        s = sc.hsdp_shard
        return Mesh(shape=[sc.n // s, s], dim_names=["replicate", "shard"])
    return Mesh(shape=[sc.n], dim_names=["shard" if strategy not in ("ddp",) else "replicate"])


def make_plan(sc: Scenario, strategy: str, global_batch: int, result=None) -> Plan:
    predicted = None
    if result is not None and result.memory is not None:
        t = result.timing
        predicted = Predicted(
            per_gpu=result.memory.as_dict(), step_s=t.step_s,
            tokens_per_s_per_gpu=t.tokens_per_s_per_gpu, mfu=t.mfu,
            elements_per_step=result.elements_per_step, bytes_per_step=result.bytes_per_step,
            exposed_comm_s=t.exposed_comm_s)
    train = sc.train.model_copy(update={
        "reshard_after_forward": strategy not in ("zero2", "zero3-noreshard")})
    return Plan(model=sc.model, gpu=sc.hw.gpu, cluster=sc.hw.cluster, num_gpus=sc.n,
                strategy=strategy, shard_size=sc.hsdp_shard if strategy == "hsdp" else None,
                mesh=mesh_for(sc, strategy), train=train, global_batch=global_batch,
                assumptions=sc.assume, predicted=predicted)


def write_atomic(path: str | Path, text: str) -> None:
    """Write beside the target, fsync, then rename over it: the file is old or new, never half."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def save(plan: Plan, path: str | Path) -> None:
    write_atomic(path, plan.model_dump_json(indent=2) + "\n")


def load(path: str | Path) -> Plan:
    p = Path(path)
    try:
        data = json.loads(p.read_text())
    except OSError as e:
        raise UsageError(f"cannot read plan {p}: {e.strerror}; write one with zplan recommend --write {p}") from None
    except json.JSONDecodeError as e:
        raise UsageError(f"plan {p} is not valid JSON (line {e.lineno}: {e.msg})") from None
    if isinstance(data, dict) and data.get("plan_version") not in (None, PLAN_VERSION):
        raise UsageError(f"plan {p} has plan_version {data.get('plan_version')!r}; this zplan reads "
                         f"version {PLAN_VERSION}: write it again with zplan recommend --write")
    try:
        return Plan.model_validate(data)
    except ValidationError as e:
        err = e.errors()[0]
        loc = ".".join(str(x) for x in err["loc"])
        raise UsageError(f"plan {p}: field '{loc}': {err['msg']}") from None
