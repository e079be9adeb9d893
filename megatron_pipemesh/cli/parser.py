"""The subcommands of this package on the ``pipemesh`` command's parser (one per module), and the two that read
their own words (``plan --megatron-args`` and ``profile``). The command's table, which adds the wings' subcommands
too, is :mod:`..command`."""
from __future__ import annotations

import argparse
from typing import Optional, Sequence

from ..config import add_cli_arguments
from .arguments import add_cost_args, add_schedule_args
from .common import UsageError, positive_int, run_command
from .plan import cmd_plan
from .show import cmd_show
from .simulate import cmd_simulate


PLAN_MODES = """the other mode, your own command (its flags: pipemesh plan --megatron-args '' --help):
  pipemesh plan --megatron-args "<your pretrain_gpt.py flags>" --nodes N --gpus-per-node G --gpu MODEL
                [--nic-gbps R] [--profile FILE] [--json]
  --megatron-args "FLAGS"   your pretrain_gpt.py command's flags (or after --)
  --nodes N, --gpus-per-node G (torchrun's --nnodes, --nproc-per-node)   the cluster
  --gpu MODEL               the GPU (A10G, L4, 'H100 SXM', ...): its rate and memory"""
"""How ``pipemesh plan --help`` (the --pp mode) names the --megatron-args mode."""


def add_subcommands(sub) -> None:
    """``show``, ``simulate``, ``plan`` and ``profile`` on the subparsers ``sub``."""
    show = sub.add_parser("show", help="print each rank's op order")
    add_schedule_args(show)
    show.add_argument("--json", action="store_true", help='one JSON object: {"ranks": [["F0.0", ...], ...], ...}')
    show.add_argument("--lowered", action="store_true", help="include sends, receives and data-parallel sync ops")
    show.add_argument("--picture", action="store_true", help="draw a text timeline (F = 1, B = 2 time units)")
    show.add_argument("--sharding", nargs="+", metavar="LEVEL", help="ZeRO level per chunk (optim, optim_grads, "
                      "optim_grads_params): --lowered then shows the GATHER / RELEASE / REDUCE ops")
    show.add_argument("--num-layers", type=positive_int, default=None,
                      help="transformer layers: with the split flags, print the layers of every stage")
    show.set_defaults(func=cmd_show)
    sim = sub.add_parser("simulate", help="simulate the schedule next to depth-first and breadth-first")
    add_schedule_args(sim)
    add_cost_args(sim)
    add_cli_arguments(sim.add_argument_group("budget (optional: fit each schedule to it, as `pipemesh plan` does)"),
                      ("memory_budget_gb", "activation_placement", "host_memory_gb"))
    add_cli_arguments(sim.add_argument_group("mixed sharding"), ("sharding", "shard_scope"))
    sim.add_argument("--json", action="store_true", help="print the numbers as JSON")
    sim.add_argument("--trace", metavar="FILE", help="write a Chrome/Perfetto trace of the given schedule")
    sim.add_argument("--plot", metavar="FILE.png", help="draw the three timelines")
    sim.set_defaults(func=cmd_simulate)
    plan = sub.add_parser("plan", help="choose groups and recomputation that fit a memory budget, or (with "
                          "--megatron-args) what to run on your cluster", epilog=PLAN_MODES,
                          formatter_class=argparse.RawDescriptionHelpFormatter,
                          description="Two modes. This one (--pp, --microbatches): the fastest groups and "
                          "recomputation of one pipeline, from the model and cost flags below.")
    add_schedule_args(plan, groups=False)
    add_cost_args(plan)
    add_cli_arguments(plan.add_argument_group("budget"), ("memory_budget_gb", "activation_placement", "host_memory_gb"))
    add_cli_arguments(plan.add_argument_group("mixed sharding"), ("sharding", "shard_scope"))
    plan.add_argument("--json", action="store_true", help="print the plan as JSON")
    plan.add_argument("--output", metavar="PLAN.json", help="save the plan (groups and recomputation) for --pipemesh-plan")
    plan.add_argument("--megatron-args", metavar='"FLAGS"', help="instead of the flags above: your pretrain_gpt.py "
                      "command's flags and your cluster; prints the best stock flags, PipeMesh and the best layout for "
                      "it (its own flags: pipemesh plan --megatron-args '' --help)")
    plan.set_defaults(func=cmd_plan)
    # Parsed by its own parser (cli/profile.py), as plan --megatron-args is: listed here for `pipemesh --help`.
    sub.add_parser("profile", add_help=False, help="measure a layer, the embedding, the output layer, the optimizer "
                   "and activation bytes of your command on this machine (pipemesh profile --help)")


def own_words(argv: Sequence[str]) -> Optional[int]:
    """Run ``plan --megatron-args ...`` or ``profile ...``, which parse their own words, and return the exit status;
    None for any other command."""
    if argv[:1] == ["plan"]:
        from .megatron_args import cmd_advice, wants_advice
        if wants_advice(argv[1:]):  # the user's own command: its own parser (none of plan's model flags apply)
            return run_command(argparse.Namespace(command="plan", func=lambda _: cmd_advice(argv[1:])))
        if not {"--pp", "-h", "--help"} & {word.split("=")[0] for word in argv[1:]}:
            return run_command(argparse.Namespace(command="plan", func=_neither_mode))
    if argv[:1] == ["profile"]:
        from .profile import cmd_profile
        return run_command(argparse.Namespace(command="profile", func=lambda _: cmd_profile(argv[1:])))
    return None


def _neither_mode(_) -> int:
    raise UsageError("give your command or a pipeline: --megatron-args \"<your pretrain_gpt.py flags>\" --nodes N "
                     "--gpus-per-node G --gpu MODEL (what to run on your cluster; pipemesh plan --megatron-args '' "
                     "--help), or --pp P --microbatches M [--vpp V] (the groups of one pipeline; pipemesh plan --help)")
