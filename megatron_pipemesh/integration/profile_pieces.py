"""``pipemesh profile``: the compute pieces of the command at each micro-batch size, on rank 0.

At every micro-batch size 1, 2, 4, ... up to the command's (:func:`micro_batch_sizes`):

* one layer's forward and backward (a middle stage's ``GPTModel``: input from the previous stage, no embedding, no
  output layer), and again with each recompute level the planner chooses from (Megatron's own selective and full
  recomputation): the extra over none, timed as the forwards its backward runs again
  (:class:`.profile_timing.ForwardsInBackward`);
* the embedding (``GPTModel.embedding``) and the final norm, output layer and loss
  (``compute_language_model_loss``), forward and backward;
* the bytes each keeps for its backward (:mod:`.profile_kept`);

then Megatron's schedule step beyond those pieces on each kind of chunk (:mod:`.profile_steps`) and the data loader
per micro-batch (:mod:`.profile_batch`). Every time goes through the profile's one measuring loop
(:func:`.profile_timing.medians`). The layers get the attention mask the command's loader makes.
"""
from __future__ import annotations

import contextlib
import dataclasses
import statistics
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Dict, List, Optional, Tuple

from ..planning.profile import ComputePoint
from ..planning.profile_quality import Spread, spread_of
from ..schedule.levers import Lever
from .profile_kept import Piece, kept_bytes
from .profile_models import gpt, level_args, megatron_quiet, one_layer_chunks, with_main_grads
from .profile_timing import ForwardsInBackward, Timer, measure

if TYPE_CHECKING:
    from .profile_timing import ProfileSettings

Progress = Callable[[str], None]


def out_of_memory() -> tuple:
    """What running out of host or device memory raises."""
    import torch

    return (MemoryError,) + ((torch.cuda.OutOfMemoryError,) if hasattr(torch.cuda, "OutOfMemoryError") else ())


def micro_batch_sizes(largest: int) -> List[int]:
    """1, 2, 4, ... below ``largest``, and ``largest``."""
    sizes, size = [], 1
    while size < largest:
        sizes.append(size)
        size *= 2
    return sizes + [largest]


def attention_mask(args, device):
    """The mask the layers get, as the command's loader makes it (one sample's; None with
    ``--no-create-attention-mask-in-dataloader``); CommandError naming that flag where it does not fit the device."""
    from .megatron_command import CommandError
    from .profile_steps import loader_attention_mask

    try:
        return loader_attention_mask(args, 1, device)
    except out_of_memory() as error:
        s = args.seq_length
        raise CommandError(f"the command's data loader builds an attention mask of seq x seq = {s} x {s} per sample "
                           f"({s * s / 2**30:.1f} GiB), which does not fit here ({error}); Megatron's attention "
                           "applies its causal mask itself: add --no-create-attention-mask-in-dataloader") from error


def time_pieces(pieces: Dict[str, Piece], grad_of: Callable[[object], object], timer: Timer,
                settings: "ProfileSettings", exclude, label: str) -> Dict[str, Timed]:
    """Per name: the forward and backward samples of ``forward`` then ``backward(grad_of(output))`` (and, for a
    piece that recomputes, its forwards inside the backward: :class:`.profile_timing.ForwardsInBackward`), the pieces
    taking turns until stable (:func:`.profile_timing.measure`, the load watched as ``label``), and the bytes kept on
    one more forward of each (:func:`.profile_kept.kept_bytes`, parameters and ``main_grad`` buffers in
    ``exclude``)."""
    import torch

    meters = {name: ForwardsInBackward(piece.recomputes) for name, piece in pieces.items()
              if piece.recomputes is not None}

    def call(name: str, piece: Piece) -> Callable[[], Tuple[float, ...]]:
        meter = meters.get(name)

        def forward_backward() -> Tuple[float, ...]:
            out, forward_s = timer(piece.forward)
            gradient = grad_of(out)
            with meter.counting(timer) if meter is not None else contextlib.nullcontext() as inside:
                _, backward_s = timer(lambda: torch.autograd.backward(out, gradient))
            return (forward_s, backward_s) + ((inside.seconds,) if meter is not None else ())
        return forward_backward

    try:
        found = measure({name: call(name, piece) for name, piece in pieces.items()}, settings, timer.watch, label,
                        pace=timer.pace)
    finally:
        for meter in meters.values():
            meter.remove()
    return {name: Timed(*found[name].columns[:2], kept_bytes(name, piece, grad_of, exclude), found[name].stable,
                        *found[name].columns[2:]) for name, piece in pieces.items()}


@dataclass(frozen=True)
class Timed:
    """One piece's forward and backward samples (seconds, in round order) and the bytes it keeps."""

    forward: Tuple[float, ...]
    backward: Tuple[float, ...]
    kept: float
    stable: bool
    """Whether its medians were stable when the repeats stopped (False: the time cap)."""
    recomputed: Tuple[float, ...] = ()
    """Seconds of the forwards its backward ran again (a recompute level's layer; empty for the others)."""

    @property
    def medians(self) -> Tuple[float, float, float]:
        return statistics.median(self.forward), statistics.median(self.backward), self.kept

    def recompute_extra(self, none: "Timed") -> Tuple[float, ...]:
        """Its extra over ``none`` (the same layer without recomputation) per round: the forwards its backward ran
        again where they were timed, else forward + backward less ``none``'s of the same round."""
        if self.recomputed and statistics.median(self.recomputed) > 0:
            return self.recomputed
        return tuple(f + b - nf - nb for f, b, nf, nb in zip(self.forward, self.backward, none.forward,
                                                             none.backward))


DENSE = "|dense"
"""Suffix of a level's dense layer where a MoE command also has dense layers."""


def _mixed(times: Dict[str, Timed], mix: float) -> Dict[str, Timed]:
    """Per level: the layers' average of a MoE layer's and (where timed) a dense layer's samples (round by round:
    they took turns) and kept bytes, ``mix`` the MoE layers' share (as the cost model averages its layers)."""
    out = {}
    for level, moe in times.items():
        if level.endswith(DENSE):
            continue
        dense = times.get(level + DENSE)
        if dense is None:
            out[level] = moe
            continue
        forward, backward, recomputed = (tuple(mix * a + (1 - mix) * b for a, b in zip(moe_column, dense_column))
                                         for moe_column, dense_column in ((moe.forward, dense.forward),
                                                                          (moe.backward, dense.backward),
                                                                          (moe.recomputed, dense.recomputed)))
        out[level] = Timed(forward, backward, mix * moe.kept + (1 - mix) * dense.kept, moe.stable and dense.stable,
                           recomputed)
    return out


def spreads(times: Dict[str, Timed], embedding: Timed, output: Timed) -> Dict[str, Spread]:
    """The spread of every time a point keeps, by its field's name (a recompute level's extra: :meth:`Timed.
    recompute_extra`)."""
    none = times["none"]
    out = {"layer_forward_s": spread_of(none.forward, none.stable),
           "layer_backward_s": spread_of(none.backward, none.stable)}
    for level, timed in times.items():
        if Lever.parse(level).recomputes:
            out[f"recompute_extra_s:{level}"] = spread_of(timed.recompute_extra(none), timed.stable and none.stable)
    for name, timed in (("embedding", embedding), ("output", output)):
        out[f"{name}_forward_s"] = spread_of(timed.forward, timed.stable)
        out[f"{name}_backward_s"] = spread_of(timed.backward, timed.stable)
    return out


def point(b: int, s: int, h: int, vocab: int, layer_models, ends, dtype, device, timer: Timer,
          settings: "ProfileSettings", exclude, progress: Progress, mask, mix: float = 1.0) -> ComputePoint:
    """The pieces at micro-batch size ``b``, the layers given ``mask`` (the command's loader's, or None); a MoE
    command's layers averaged over its MoE (share ``mix``) and dense layers (:func:`_mixed`)."""
    import torch

    generator = torch.Generator().manual_seed(settings.seed + b)
    hidden = torch.randn(s, b, h, generator=generator).to(device=device, dtype=dtype)

    def like(out):
        return torch.ones_like(out) * 1e-3

    def layer(level: str, model) -> Piece:
        def forward():
            model.set_input_tensor(hidden.clone().requires_grad_(True))
            return model(input_ids=None, position_ids=None, attention_mask=mask)
        recomputes = Lever.parse(level.removesuffix(DENSE)).recomputes
        return Piece(forward, release=lambda: model.set_input_tensor(None), recomputes=model if recomputes else None)
    timed = time_pieces({level: layer(level, model) for level, (model, _) in layer_models.items()}, like, timer,
                        settings, exclude, f"layers mbs {b}")
    samples = _mixed(timed, mix)
    times = {level: found.medians for level, found in samples.items()}
    none = times["none"]
    tokens = torch.randint(0, vocab, (b, s), generator=generator).to(device)
    positions = torch.arange(s, device=device).unsqueeze(0).expand(b, s)

    def embedding_forward():
        return ends.embedding(input_ids=tokens, position_ids=positions)
    embedded = time_pieces({"embedding": Piece(embedding_forward)}, like, timer, settings, exclude,
                           f"embedding mbs {b}")["embedding"]
    embedding = embedded.medians

    def output_forward():
        x = hidden.clone().requires_grad_(True)
        weight = ends.shared_embedding_or_output_weight() if ends.share_embeddings_and_output_weights else None
        logits, _ = ends.output_layer(ends.decoder.final_layernorm(x), weight=weight)
        return ends.compute_language_model_loss(tokens, logits).float().mean()
    outputs = time_pieces({"output": Piece(output_forward)}, lambda out: None, timer, settings, exclude,
                          f"output mbs {b}")["output"]
    output = outputs.medians
    found = ComputePoint(
        tp=1, micro_batch_size=b, layer_forward_s=none[0], layer_backward_s=none[1],
        recompute_extra_s={level: max(0.0, statistics.median(timed.recompute_extra(samples["none"])))
                           for level, timed in samples.items() if Lever.parse(level).recomputes},
        layer_activation_bytes={level: float(t[2]) for level, t in times.items()},
        embedding_forward_s=embedding[0], embedding_backward_s=embedding[1],
        embedding_activation_bytes=float(embedding[2]), output_forward_s=output[0], output_backward_s=output[1],
        output_activation_bytes=float(output[2]), spread=spreads(samples, embedded, outputs))
    progress(f"micro-batch {b}: layer forward {found.layer_forward_s * 1e3:.2f} ms, backward "
             f"{found.layer_backward_s * 1e3:.2f} ms, keeps {found.layer_activation_bytes['none'] / 2**20:.2f} MiB; "
             f"embedding {embedding[0] * 1e3:.2f} + {embedding[1] * 1e3:.2f} ms; output + loss "
             f"{output[0] * 1e3:.2f} + {output[1] * 1e3:.2f} ms; recompute extra "
             + ", ".join(f"{level} {extra * 1e3:.2f} ms" for level, extra in found.recompute_extra_s.items()))
    return found


def measure_compute(args, model_spec, run_spec: str, settings: "ProfileSettings", cuda: bool, progress: Progress,
                    notes: List[str], watch=None, pace=None) -> List[ComputePoint]:
    """The compute points of the command (see the module), without the data loader's times
    (:func:`with_batch_times`); what cannot be measured here is said in ``notes``; ``watch``: the load watch each
    group of pieces is timed under (:meth:`.profile_load.LoadWatch.piece`), or None; ``pace``: the machine's pace the
    samples are taken at (:class:`.profile_pace.Pace`, at its base pace), or None."""
    import torch

    from ..planning.costs import planning_levels
    from ..schedule.levers import DEVICE

    device = torch.device("cuda" if cuda else "cpu")
    timer = Timer(cuda, watch, pace)

    def build(args_of_level, pre: bool, post: bool):
        return gpt(args_of_level, run_spec, settings, cuda, pre, post)

    layer_models = {}
    mix = model_spec.moe_fraction if model_spec.moe is not None else 1.0
    kinds = [("", False)] + ([(DENSE, True)] if mix < 1 else [])  # a MoE command's dense layers measured too
    for level in planning_levels(model_spec):
        try:
            for suffix, dense in kinds:
                layer_models[str(level) + suffix] = build(level_args(args, level, dense), pre=False, post=False)
        except (AssertionError, ValueError, RuntimeError, NotImplementedError) as error:
            for suffix, _ in kinds:
                layer_models.pop(str(level) + suffix, None)
            notes.append(f"recompute level {level} not measured: Megatron refuses it here ({error})")
    ends, config = build(level_args(args, str(DEVICE)), pre=True, post=True)
    exclude = [t for model, _ in layer_models.values() for t in with_main_grads(model)] + with_main_grads(ends)
    dtype = config.params_dtype
    s, h, vocab = args.seq_length, args.hidden_size, args.padded_vocab_size
    # Above the command's own size too when asked: the advice prices every micro-batch size it may change to.
    largest = settings.max_micro_batch or args.micro_batch_size
    mask = attention_mask(args, device)
    points = []
    for b in micro_batch_sizes(largest):
        try:
            points.append(point(b, s, h, vocab, layer_models, ends, dtype, device, timer, settings, exclude,
                                progress, mask, mix))
        except out_of_memory():
            notes.append(f"micro-batch size {b} and above not measured: out of device memory")
            break
    # The step overhead's chunks (two with the embedding, two with the output layer, fp32 main_grads on all) are
    # built once these are gone: with a large vocabulary both sets at once do not fit.
    del layer_models, ends, exclude
    _free_device_memory(cuda)
    return with_step_overhead(args, points, build, timer, device, settings, progress, notes)


def _free_device_memory(cuda: bool) -> None:
    """Collect what the pieces left (Megatron's modules hold reference cycles) and, on CUDA, give the cached blocks
    back, so that the next models get the memory whole."""
    import gc

    import torch

    gc.collect()
    if cuda:
        torch.cuda.empty_cache()


def with_step_overhead(args, points: List[ComputePoint], build, timer: Timer, device, settings: "ProfileSettings",
                       progress: Progress, notes: List[str]) -> List[ComputePoint]:
    """``points`` with what Megatron's schedule step spends beyond their pieces on each kind of chunk
    (:mod:`.profile_steps`), timed on one-layer models of each kind; where those do not fit the device, ``points``
    as they are and a note saying so."""
    from .profile_steps import measure_step_overhead

    spreads: Dict[int, Dict[str, Spread]] = {}
    try:
        models = one_layer_chunks(args, build)
        with megatron_quiet():
            overhead = measure_step_overhead(args, models, points, timer, device, settings, spreads)
    except out_of_memory() as error:
        notes.append(f"the schedule step beyond the pieces was not measured: out of device memory with a one-layer "
                     f"chunk of every kind ({str(error).splitlines()[0]}); plans price it at 0")
        return points
    out = []
    for found in points:
        steps = overhead[found.micro_batch_size]
        progress(f"micro-batch {found.micro_batch_size}: schedule step beyond the pieces (forward + backward) "
                 + ", ".join(f"{kind} {(f + b) * 1e3:.2f} ms" for kind, (f, b) in steps.items()))
        out.append(dataclasses.replace(found, step_forward_s={kind: f for kind, (f, _) in steps.items()},
                                       step_backward_s={kind: b for kind, (_, b) in steps.items()},
                                       spread={**(found.spread or {}), **spreads[found.micro_batch_size]}))
    return out


def with_batch_times(args, points: List[ComputePoint], settings: "ProfileSettings", progress: Progress,
                     notes: List[str], apart: Optional[Tuple[List[str], int]] = None) -> List[ComputePoint]:
    """``points`` with the data loader's time per batch (:mod:`.profile_batch`), each batch taken after a pause of
    one layer's forward and backward, in this process or, with ``apart`` (the command's words, this rank's device),
    in a one-process child; where the command's data path cannot be built here, the points unchanged and a note
    saying so."""
    from .profile_batch import measure_batch_s, measure_batch_s_apart

    pauses = {found.micro_batch_size: found.layer_forward_s + found.layer_backward_s for found in points}
    try:
        if apart is not None:
            batch = measure_batch_s_apart(apart[0], pauses, settings, device=apart[1])
        else:
            with megatron_quiet():
                batch = measure_batch_s(args, pauses, settings)
    except Exception as error:  # the user's data path, tokenizer or loader: whatever it raises, the plan must say
        notes.append(f"the data loader was not measured ({type(error).__name__}: {error}); plans price it at 0")
        return points
    out = []
    for found in points:
        timed = batch[found.micro_batch_size]
        progress(f"micro-batch {found.micro_batch_size}: data loader {timed.medians[0] * 1e3:.2f} ms per batch")
        out.append(dataclasses.replace(found, batch_s=timed.medians[0], spread={
            **(found.spread or {}), "batch_s": spread_of(timed.columns[0], timed.stable)}))
    return out
