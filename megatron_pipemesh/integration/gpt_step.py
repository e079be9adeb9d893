"""The GPT forward step the training entry point hands Megatron's schedule (:mod:`..training.pretrain_gpt`): this
chunk's batch (:func:`.gpt_data.get_batch`), the model's forward and the loss function with its ``lm loss`` report.
``pipemesh profile`` times it inside Megatron's ``schedules.forward_step`` (:mod:`.profile_steps`). Megatron is
imported inside the functions: its import needs :func:`.bootstrap.prepare_megatron_import` first.
"""
from __future__ import annotations

from functools import partial

from .gpt_data import get_batch


def loss_func(loss_mask, output_tensor):
    """Masked token-loss sum, token count and an ``lm loss`` report.

    The report holds a *clone*: Megatron's schedule divides the returned loss in place
    (``schedules.py:334-335``), and logging the same tensor would log loss / num_microbatches.
    """
    import torch
    from megatron.core.rerun_state_machine import get_rerun_state_machine
    from megatron.training import get_args

    args = get_args()
    losses = output_tensor.view(-1).float()
    mask = loss_mask.view(-1).float()
    loss = torch.sum(losses * mask)
    num_tokens = mask.sum().clone().detach().to(torch.int)
    report = {"lm loss": torch.cat([loss.clone().detach().view(1), num_tokens.view(1)])}
    if args.check_for_nan_in_loss_and_grad:
        rsm = get_rerun_state_machine()
        rsm.validate_result(result=loss, rejection_func=torch.isnan,
                            message="found NaN in local forward loss calculation",
                            tolerance=0.0, fatal=True)
        rsm.validate_result(result=loss, rejection_func=torch.isinf,
                            message="found Inf in local forward loss calculation",
                            tolerance=0.0, fatal=True)
    return loss, num_tokens, report


def forward_step(data_iterator, model):
    """Megatron forward-step function: ``(output_tensor, loss_func)``."""
    from megatron.core.utils import get_attr_wrapped_model
    from megatron.training import get_timers

    timers = get_timers()
    timers("batch-generator", log_level=2).start()
    vp_stage = get_attr_wrapped_model(model, "vp_stage") if _has_vp(model) else None
    tokens, labels, loss_mask, attention_mask, position_ids = get_batch(data_iterator, vp_stage)
    timers("batch-generator").stop()
    output_tensor = model(tokens, position_ids, attention_mask, labels=labels, loss_mask=loss_mask)
    return output_tensor, partial(loss_func, loss_mask)


def _has_vp(model) -> bool:
    from megatron.core import parallel_state as mpu

    return mpu.get_virtual_pipeline_model_parallel_world_size() is not None
