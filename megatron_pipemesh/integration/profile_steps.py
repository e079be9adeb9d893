"""``pipemesh profile``: what Megatron's schedule spends per chunk-micro-batch beyond the pieces the profile times
apart (a layer, the embedding, the output layer and loss, the data loader).

Every schedule, stock or PipeMesh's executor, runs a chunk-micro-batch through Megatron's ``schedules.forward_step``
and ``schedules.backward_step``; the forward runs the training entry's forward step (:mod:`.gpt_step`: its
``get_batch``, the model's forward wrapper, the loss function with its report) and the schedule's own work around it
(the input tensor, the loss scaling, the timers, freeing the output). Timed here on a one-layer chunk of each
:data:`STAGE_KINDS`: the forward's work outside the model's forward is timed in the same call (the model's forward
marked inside it); the backward's pieces' times are taken off its total. On a hidden-128 GPT on this CPU the profile
measured 0-0.6 ms per micro-batch on a middle chunk and 0.5-1.6 ms on the others, against 4.2 ms for a layer's forward
and backward; unpriced, that GPT's runs were 30-37% over their prediction. At hidden 512 it is within
the timer's noise of 0.

The batches are already in memory (the loader's own time is :mod:`.profile_batch`'s). Megatron's parallel state is
set to the stage of each kind (pipeline rank 0, 1 or 2 of 3; 0 of 1 for a chunk that is both), so ``get_batch`` and the
loss take the path they take on that stage.
"""
from __future__ import annotations

import contextlib
import copy
from typing import Callable, Dict, Iterator, Mapping, Optional, Sequence, Tuple

from ..planning.costs import STAGE_KINDS
from ..planning.profile import ComputePoint
from ..planning.profile_quality import Spread, spread_of
from .profile_timing import measure

STAGE_RANKS = dict(zip(STAGE_KINDS, ((0, 1), (0, 3), (1, 3), (2, 3))))
"""(pipeline rank, pipeline size) Megatron's parallel state is given while a chunk of each kind is timed."""


@contextlib.contextmanager
def _as_stage(kind: str) -> Iterator[None]:
    """Megatron's parallel state says this process is the pipeline stage of ``kind``; restored after (unset: both
    are read from the process group again, as ``initialize_model_parallel`` leaves them)."""
    from megatron.core import parallel_state

    rank, size = STAGE_RANKS[kind]
    parallel_state.set_pipeline_model_parallel_rank(rank)
    parallel_state.set_pipeline_model_parallel_world_size(size)
    try:
        yield
    finally:
        parallel_state.set_pipeline_model_parallel_rank(None)
        parallel_state.set_pipeline_model_parallel_world_size(None)


@contextlib.contextmanager
def _training_globals(args) -> Iterator[None]:
    """Megatron's global args and timers as the training loop sets them (the forward step reads both); restored
    after. Megatron has no public setter for the timers alone (``set_global_variables`` also builds the tokenizer,
    the loggers and the micro-batch calculator): its ``_set_timers`` is called when none are set."""
    from megatron.training import global_vars

    before = global_vars._GLOBAL_ARGS
    owned_timers = global_vars._GLOBAL_TIMERS is None
    global_vars.set_args(args)
    if owned_timers:
        global_vars._set_timers(args)
    try:
        yield
    finally:
        global_vars.set_args(before)
        if owned_timers:
            global_vars._GLOBAL_TIMERS = None


def loader_attention_mask(args, size: int, device):
    """The attention mask the command's loader yields for ``size`` samples (``size`` x 1 x s x s, True where a token
    may not attend), or None where the command does not build it (``--no-create-attention-mask-in-dataloader``:
    Megatron's attention then applies its causal mask itself). Built as booleans on ``device`` directly, one byte per
    entry: through an fp32 ``tril`` it would take 8 bytes per entry on the way (128 GiB at s = 128k)."""
    import torch

    if not args.create_attention_mask_in_dataloader:
        return None
    s = args.seq_length
    mask = torch.ones(s, s, dtype=torch.bool, device=device).triu_(1).view(1, 1, s, s)
    return mask if size == 1 else mask.expand(size, 1, s, s).clone()


def _batch(args, size: int, device) -> dict:
    """One micro-batch as the command's loader yields it (tokens, labels, loss mask, positions and, where the
    command builds it in the loader, the attention mask)."""
    import torch

    s, vocab = args.seq_length, args.padded_vocab_size
    generator = torch.Generator().manual_seed(size)
    batch = {"tokens": torch.randint(0, vocab, (size, s), generator=generator),
             "labels": torch.randint(0, vocab, (size, s), generator=generator),
             "loss_mask": torch.ones(size, s), "position_ids": torch.arange(s).unsqueeze(0).expand(size, s).clone()}
    batch = {key: value.to(device) for key, value in batch.items()}
    mask = loader_attention_mask(args, size, device)
    if mask is not None:
        batch["attention_mask"] = mask
    return batch


def _backward_pieces(point: ComputePoint, kind: str) -> float:
    """Seconds the profile's pieces' backwards sum to on a one-layer chunk of ``kind``."""
    backward = point.layer_backward_s
    if kind in ("only", "first"):
        backward += point.embedding_backward_s
    if kind in ("only", "last"):
        backward += point.output_backward_s
    return backward


def _schedule_sets_the_moe_loss_scale() -> None:
    """Let Megatron's schedule step set the MoE auxiliary loss's scale as in training, where its forward_step sets it
    before any backward: the pieces' own backwards (run first here) left the scalar Megatron's
    ``MoEAuxLossAutoScaler.backward`` makes when none is set, and ``set_loss_scale`` then copies a shape-[1] tensor
    into it (``moe_utils.py:316,334``)."""
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

    MoEAuxLossAutoScaler.main_loss_backward_scale = None


def measure_step_overhead(args, models: Mapping[str, Tuple[object, object]], points: Sequence[ComputePoint],
                          timer, device, settings,
                          spreads: Optional[Dict[int, Dict[str, Spread]]] = None
                          ) -> Dict[int, Dict[str, Tuple[float, float]]]:
    """Per micro-batch size of ``points``, per kind of ``models`` (kind -> (a one-layer ``GPTModel`` of that kind
    on ``device``, its ``TransformerConfig``)), timed with the profile's ``timer`` until stable (``settings``, a
    :class:`.profile_timing.ProfileSettings`): (forward, backward) seconds of Megatron's schedule step beyond the
    point's pieces, never below 0 (the step runs the pieces and more; below 0 is the timer's noise). The kinds take
    turns in every round, so a drift of the machine's speed reaches them alike. ``spreads``, where given, gets per
    size the spread of each kind's samples less the pieces ('step_forward_s:<kind>', 'step_backward_s:<kind>')."""
    import torch
    from megatron.core.pipeline_parallel import schedules
    from megatron.training import global_vars

    from .gpt_step import forward_step

    _schedule_sets_the_moe_loss_scale()
    found: Dict[int, Dict[str, Tuple[float, float]]] = {}
    for point in points:
        b = point.micro_batch_size
        sized = copy.copy(args)
        sized.micro_batch_size = b
        with _training_globals(sized):
            for _, config in models.values():
                config.timers = global_vars.get_timers()
            batch = _batch(sized, b, device)
            hidden = torch.randn(sized.seq_length, b, sized.hidden_size, generator=torch.Generator().manual_seed(b))
            dtype = next(iter(models.values()))[1].params_dtype
            hidden = hidden.to(device=device, dtype=dtype)  # what a stage receives

            def step(kind: str, model, config) -> Callable[[], Tuple[float, float]]:
                def one() -> Tuple[float, float]:
                    with _as_stage(kind):
                        return _one_step(schedules, forward_step, model, config, kind, batch, hidden, timer)
                return one

            times = measure({kind: step(kind, model, config) for kind, (model, config) in models.items()}, settings,
                            timer.watch, f"schedule step mbs {b}", pace=timer.pace)
        found[b] = {}
        for kind, timed in times.items():
            (outside, backward), pieces = timed.medians, (0.0, _backward_pieces(point, kind))
            found[b][kind] = (max(0.0, outside), max(0.0, backward - pieces[1]))
            if spreads is not None:
                for name, column, piece in zip(("step_forward_s", "step_backward_s"), timed.columns, pieces):
                    spreads.setdefault(b, {})[f"{name}:{kind}"] = spread_of([t - piece for t in column], timed.stable)
    return found


def _one_step(schedules, forward_step, model, config, kind: str, batch: dict, hidden, timer) -> Tuple[float, float]:
    """(seconds of the forward step outside the model's forward, backward seconds) of one micro-batch through
    Megatron's schedule step on a chunk of ``kind``. The forward's part outside the model is timed in the same call
    (:class:`.profile_timing.Span` around the model's forward): it is about 1 ms of a 15-50 ms step here, and a
    difference of separately taken medians would carry the pieces' own 1-2% noise, as much as itself."""
    import torch

    first, last = kind in ("only", "first"), kind in ("only", "last")
    received = None if first else hidden.clone().requires_grad_(True)
    batches = iter((batch,))
    inside = timer.span()
    hooks = (model.register_forward_pre_hook(lambda *_: inside.start()),
             model.register_forward_hook(lambda *_: inside.stop()))
    try:
        (output, _), forward_s = timer(lambda: schedules.forward_step(
            forward_step, batches, model, 1, received, [], config, 1, is_first_microbatch=False,
            current_microbatch=0, is_last_stage=last))
    finally:
        for hook in hooks:
            hook.remove()
    gradient = None
    if not last:
        gradient = torch.ones_like(output) * 1e-3  # what the next stage sends back
        schedules.deallocate_output_tensor(output, config.deallocate_pipeline_outputs)  # as after the send
    _, backward_s = timer(lambda: schedules.backward_step(received, output, gradient, config))
    return forward_s - inside.seconds, backward_s
