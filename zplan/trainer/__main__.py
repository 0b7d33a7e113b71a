"""`python -m zplan.trainer`: one rank of a planned run, started by torchrun (zplan launch).

The plan arrives as a file named in $ZPLAN_PLAN. The trainer validates it against the world it
finds (world size, GPU kind) and refuses a mismatch with one line naming the fix.
"""

from __future__ import annotations

import argparse
import os
import sys


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m zplan.trainer", description=__doc__)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--save-every", type=int, default=0)
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


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    path = os.environ.get("ZPLAN_PLAN")
    if not path:
        print("zplan trainer: error: $ZPLAN_PLAN is not set; start runs with zplan launch", file=sys.stderr)
        return 2
    from ..errors import ZplanError
    from .plan_check import check_plan
    from ..plan import load

    try:
        plan = load(path)
    except ZplanError as e:
        print(f"zplan trainer: error: {e}", file=sys.stderr)
        return 2
    import torch
    import torch.distributed as dist

    cuda = torch.cuda.is_available()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    why = check_plan(plan, world, cuda, builtin_model=True)
    if why:
        if int(os.environ.get("RANK", "0")) == 0:
            print(f"zplan trainer: error: {why}", file=sys.stderr)
        return 2
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    backend = "nccl" if cuda else "gloo"
    from .distributed import init_process_group_for
    init_process_group_for("cuda" if cuda else "cpu")
    from .loop import RunConfig, Trainer, compare_lines, write_report

    cfg = RunConfig(steps=args.steps, lr=args.lr, seed=args.seed, save_every=args.save_every,
                    ckpt_dir=args.ckpt_dir, resume=args.resume, data=args.data,
                    measure_memory=not args.no_memory, stop_after=args.stop_after,
                    progress=not args.no_progress and sys.stderr.isatty(), clip=args.clip,
                    deterministic=args.deterministic, log_every=args.log_every)
    try:
        report = Trainer(plan, cfg, backend).run()
        if dist.get_rank() == 0:
            where = write_report(report, cfg.ckpt_dir)
            losses = report["losses"]
            if losses:
                print(f"zplan: {plan.strategy} on {world} {'GPU' if cuda else 'CPU'} ranks, steps "
                      f"{report['start_step']}..{report['end_step']}: loss {losses[0]:.4f} -> {losses[-1]:.4f}")
            for line in compare_lines(report):
                print(line)
            print(f"zplan: run report {where}")
        dist.barrier()
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
