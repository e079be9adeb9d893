"""``pipemesh profile``: Megatron's optimizer per parameter, as the command builds it.

``get_megatron_optimizer`` with the command's flags (``get_megatron_optimizer_config``, the distributed optimizer
included where the command has it) over a one-layer model with its embedding and output layer (the tensors of a
stage) wrapped in Megatron's DDP, timed as ``train_step`` runs it: zeroing the gradient buffers and the optimizer's
gradients, then its ``step()`` (the gradient norm and clipping, Adam's step, the fp32 main copy of 16-bit weights).
torch's Adam alone measured 1.9 ns per parameter where Megatron's step took 3-4 here.

The model's process groups are this rank's alone (:func:`own_groups`): the distributed optimizer's shard is then
every parameter and its step's cost per parameter what a shard's is (the planner divides the parameters by the
data-parallel size), while its gathers and reductions, data-parallel traffic priced apart, copy nothing. A command
whose optimizer Megatron refuses on this machine is refused before anything is measured (:func:`optimizer_config`).
"""
from __future__ import annotations

import copy
from typing import TYPE_CHECKING

from .profile_models import gpt, level_args, megatron_quiet
from .profile_timing import Timer, medians

if TYPE_CHECKING:
    from .profile_timing import ProfileSettings


def optimizer_args(args):
    """``args`` for the optimizer measurement: the command's optimizer flags, on one instance of the distributed
    optimizer where the command has several (a shard's step costs the same per parameter)."""
    out = copy.copy(args)
    out.num_distributed_optimizer_instances = 1
    return out


def optimizer_config(args):
    """(Megatron's ``OptimizerConfig`` of the command, its overrides) as ``train_step`` builds them; CommandError
    naming the cause where Megatron refuses it on this machine (``--use-precision-aware-optimizer`` needs
    Transformer Engine's FusedAdam and the distributed optimizer): checked before anything is measured, so that no
    rank fails after the others measured for minutes."""
    from megatron.training.training import get_megatron_optimizer_config

    from .megatron_command import CommandError

    try:
        with megatron_quiet():
            return get_megatron_optimizer_config(optimizer_args(args))
    except (AssertionError, RuntimeError, ValueError, ImportError) as error:
        raise CommandError(f"pipemesh profile cannot build the command's optimizer on this machine, as Megatron's "
                           f"train_step would: {error or type(error).__name__}") from error


def own_groups():
    """Megatron's process groups for a model of this rank alone: every group of the collection Megatron would use
    replaced by a one-rank group of this rank (every rank creates every one, in the same order)."""
    import torch.distributed as dist
    from megatron.core.process_groups_config import ProcessGroupCollection

    mine, _ = dist.new_subgroups(group_size=1)
    mpu = ProcessGroupCollection.use_mpu_process_groups()
    return ProcessGroupCollection(**{name: mine if isinstance(value, dist.ProcessGroup) else value
                                     for name, value in vars(mpu).items()})


def optimizer_s_per_param(args, run_spec: str, settings: "ProfileSettings", cuda: bool, pace=None) -> float:
    """Seconds per parameter of what Megatron's ``train_step`` spends on the command's optimizer (see the module),
    at the base pace of ``pace`` where given (:class:`.profile_pace.Pace`). Launched on several ranks every rank
    measures at once; the caller keeps rank 0's."""
    import torch
    from megatron.core.distributed import DistributedDataParallel
    from megatron.core.optimizer import get_megatron_optimizer
    from megatron.training.training import get_megatron_ddp_config

    from ..schedule.levers import DEVICE

    timer = Timer(cuda)
    args = optimizer_args(args)
    config_, overrides = optimizer_config(args)
    model, config = gpt(level_args(args, str(DEVICE)), run_spec, settings, cuda, pre=True, post=True)
    groups = own_groups()
    with megatron_quiet():  # DDP and the optimizer log their buckets and config at INFO
        wrapped = DistributedDataParallel(config=config, ddp_config=get_megatron_ddp_config(args), module=model,
                                          pg_collection=groups)
        optimizer = get_megatron_optimizer(config_, [wrapped], config_overrides=overrides,
                                           use_gloo_process_groups=False, pg_collection=groups)
    params = [p for p in model.parameters() if p.requires_grad]
    generator = torch.Generator().manual_seed(settings.seed)
    grads = [torch.randn(p.shape, generator=generator).mul_(1e-3) for p in params]

    def zero() -> None:
        wrapped.zero_grad_buffer()
        optimizer.zero_grad()

    def step():
        _, zero_s = timer(zero)
        with torch.no_grad():
            for param, grad in zip(params, grads):
                param.main_grad.copy_(grad)  # what the backward leaves in DDP's buffers
        _, step_s = timer(optimizer.step)
        return (zero_s + step_s,)

    seconds, = medians({"optimizer": step}, settings.warmup, settings.repeats, pace)["optimizer"]
    return seconds / sum(p.numel() for p in params)
