"""`python -m zplan.trainer`: one rank of a planned run, started by torchrun (zplan launch).

The plan arrives as a file named in $ZPLAN_PLAN. The trainer validates it against the world it
finds (world size, GPU kind) and refuses a mismatch with one line naming the fix. Every error
inside a rank is one line (zplan/trainer/rank_errors.py); ZPLAN_DEBUG=1 shows the traceback.
"""

from __future__ import annotations

import argparse
import os
import sys


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, reported like every other error in a rank
        from ..errors import UsageError

        raise UsageError(f"trainer option: {message} (see python -m zplan.trainer --help)")


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    ap = _Parser(prog="python -m zplan.trainer", description=__doc__)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--save-every", type=int, default=0, help="checkpoint every N steps (0: only at the end)")
    ap.add_argument("--keep", type=int, default=0, help="keep the newest K checkpoints (0: all)")
    ap.add_argument("--no-save", action="store_true", help="write no checkpoint, not even at the end")
    ap.add_argument("--ckpt-dir", default="runs/zplan")
    ap.add_argument("--resume", action="store_true")
    ap.add_argument("--data", default=None, help="a local text file (byte-level tokens); default synthetic")
    ap.add_argument("--no-memory", action="store_true", help="skip the memory tracker (CPU)")
    ap.add_argument("--stop-after", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--no-progress", action="store_true")
    ap.add_argument("--log-every", type=int, default=None,
                    help="a step line on stdout every K steps (default: 10 without a terminal; 0: none)")
    ap.add_argument("--clip", type=float, default=1.0, help="gradient clipping by the global norm")
    ap.add_argument("--deterministic", action="store_true",
                    help="FSDP2: rank-ordered reduce-scatter, bit for bit the rank-ordered mean gradient")
    return ap.parse_args(argv)


def restarted() -> bool:
    """Whether this is a restart of a failed run (zplan's restart loop or torchrun's own)."""
    return int(os.environ.get("ZPLAN_ATTEMPT", "0") or 0) > 0 or \
        int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0) > 0


def _check_args(args, plan) -> None:
    from ..errors import UsageError

    for name in ("steps", "save_every", "keep", "log_every"):
        v = getattr(args, name)
        if v is not None and v < (1 if name == "steps" else 0):
            raise UsageError(f"--{name.replace('_', '-')} {v} must be {'at least 1' if name == 'steps' else '0 or more'}")
    for name in ("save_every", "keep"):
        if args.no_save and getattr(args, name):
            raise UsageError(f"--{name.replace('_', '-')} {getattr(args, name)} with --no-save: drop one of them")
    if args.deterministic and plan.strategy in ("ddp", "zero1"):
        raise UsageError(f"--deterministic applies to the FSDP2 strategies, not {plan.strategy}: "
                         f"drop it or plan with --strategy zero3")
    if args.data is not None and not os.path.isfile(args.data):
        raise UsageError(f"--data {args.data}: no such file; pass a local text file")


def _print_outcome(report, plan, cfg, world: int, cuda: bool, reached: int = 0) -> None:
    from .report import compare_lines, write_report
    from .run_setup import finished_line, stopped_line

    if report is None:
        print(finished_line(cfg.ckpt_dir, reached, cfg.steps), file=sys.stderr)
        return
    where = write_report(report, cfg.ckpt_dir)
    losses = report["losses"]
    if losses:
        print(f"zplan: {plan.strategy} on {world} {'GPU' if cuda else 'CPU'} ranks, steps "
              f"{report['start_step']}..{report['end_step']}: loss {losses[0]:.4f} -> {losses[-1]:.4f}")
    for line in compare_lines(report):
        print(line)
    print(f"zplan: run report {where}")
    if report.get("stopped_by"):
        print(stopped_line(report["stopped_by"], reached, cfg), file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    from .rank_errors import guarded

    return guarded(lambda: _main(parse(argv)))


def _main(args: argparse.Namespace) -> int:
    from .stop import StopRequests

    # a stop signal from here on: before the first step the rank ends in one line, not by the
    # signal's default action; from it, the run stops after a step with a checkpoint (stop.py)
    stops = StopRequests(armed=False).__enter__()
    path = os.environ.get("ZPLAN_PLAN")
    from ..errors import UsageError

    if not path:
        raise UsageError("$ZPLAN_PLAN is not set; start runs with zplan launch")
    from .. import arch
    from ..launch.run_dir import check_run_dir, checkpoint_bytes
    from .plan_check import check_plan
    from ..plan import load

    plan = load(path)
    _check_args(args, plan)
    resume = args.resume or restarted()
    check_run_dir(args.ckpt_dir, resume=resume,  # a restart attempt resumes too
                  need_bytes=0 if args.no_save else checkpoint_bytes(arch.param_count(plan.model)))
    import torch
    import torch.distributed as dist

    cuda = torch.cuda.is_available()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    from .run_setup import set_host_threads, set_local_device

    if cuda:  # before anything asks the current device (check_plan reads this rank's GPU's name)
        set_local_device()
    why = check_plan(plan, world, cuda, builtin_model=True)
    if why:
        raise UsageError(why)
    set_host_threads(plan.strategy, cuda)
    backend = "nccl" if cuda else "gloo"
    from .distributed import init_process_group_for
    init_process_group_for("cuda" if cuda else "cpu")
    from .loop import RunConfig, Trainer
    from .run_setup import agree_on_run_dir

    cfg = RunConfig(steps=args.steps, lr=args.lr, seed=args.seed, save_every=args.save_every, save=not args.no_save,
                    ckpt_dir=args.ckpt_dir, resume=resume, data=args.data,
                    measure_memory=not args.no_memory, stop_after=args.stop_after,
                    progress=not args.no_progress and sys.stderr.isatty(), clip=args.clip,
                    deterministic=args.deterministic, keep=args.keep, log_every=args.log_every)
    agree_on_run_dir(cfg.ckpt_dir)
    trainer = Trainer(plan, cfg, backend)
    report = trainer.run(stops)
    if dist.get_rank() == 0:
        _print_outcome(report, plan, cfg, world, cuda, trainer.step)
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    from .rank_errors import leave

    leave(main())  # not sys.exit: a rank that finished must not abort in gloo's teardown
