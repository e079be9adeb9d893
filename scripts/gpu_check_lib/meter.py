"""The activation meter on one chunk (``meter``): what one forward keeps, measured by the runtime's meter, against
the activation model of ``planning/memory.py`` at each recompute level."""
from __future__ import annotations

from .common import NEEDS_CUDA, make_batches, make_config, make_gpt, raise_allocator_peak, set_weights

from megatron_pipemesh.schedule.levers import BASIC_LEVERS, DEVICE  # noqa: E402 (pure)

METER_TOLERANCE = 0.10
"""Largest relative difference between the meter and the activation model: the model counts the tensors Megatron's
layers save, analytically; what it leaves out (small per-layer vectors, allocator rounding) stays well inside it."""


def _chunk_setup(device, pp: int, vpp: int, rank: int, chunk: int, layers_per_stage: int, hidden: int, seq: int,
                 mbs: int, vocab: int):
    stage = chunk * pp + rank
    stages = pp * vpp
    model = make_gpt(make_config(layers_per_stage, hidden=hidden), device, vocab, seq, pre=stage == 0,
                     post=stage == stages - 1)
    set_weights(model, stage * layers_per_stage)
    return model


def check_meter(device, levels=BASIC_LEVERS, hidden: int = 256, heads: int = 4, seq: int = 128,
                mbs: int = 2, vocab: int = 1024, layers_per_stage: int = 2):
    """A middle stage (pipeline rank 1 of 2, chunk 0) under the runtime's meter vs the activation model: what its
    forward keeps (saved tensors, received input, output) within 10% of ``planning/memory.py`` at each recompute
    level. On CUDA also the meter's semantics: its peak is what the forward keeps (the forward's temporaries, such as
    attention scores and softmax outputs that are not saved, never count) and Megatron's peak statistics are never
    reset (``max_memory_allocated`` after the meter is still the earlier, larger peak)."""
    import torch

    from megatron_pipemesh.planning.memory import ActivationShape, chunk_bytes
    from megatron_pipemesh.runtime.memory import make_memory_meter
    from megatron_pipemesh.runtime.recompute import recompute_scope

    cuda = device.type == "cuda"
    pp, vpp, rank, chunk = 2, 2, 1, 0
    model = _chunk_setup(device, pp, vpp, rank, chunk, layers_per_stage, hidden, seq, mbs, vocab)
    batch = make_batches(1, mbs, seq, vocab, device)[0]
    shape = ActivationShape(seq_length=seq, micro_batch_size=mbs, hidden_size=hidden, num_attention_heads=heads,
                            vocab_size=vocab, ffn_hidden_size=4 * hidden, dtype_bytes=4)
    peak_before = raise_allocator_peak(device) if cuda else None
    rows, ok = [], True
    for level in (DEVICE,) + tuple(levels):  # the first pass warms up kernels and workspaces
        if cuda:  # earlier checks' record_stream frees finish; the forward's first allocation processes them
            torch.cuda.synchronize(device)
        meter = make_memory_meter(device, [*model.parameters(), *model.buffers()])
        meter.begin()
        with recompute_scope(model, level), meter.record("F"):
            received = torch.randn((seq, mbs, hidden), device=device, requires_grad=True)  # what the receive allocates
            model.set_input_tensor(received)
            output = model(batch["tokens"], batch["position_ids"], batch["attention_mask"])
        meter.track("F", output)
        measured = meter.saved_bytes["F"] + sum(meter.tracked_bytes.values())
        peak = meter.peak_bytes
        with recompute_scope(model, level):
            output.backward(torch.ones_like(output))
        meter.release("F")
        predicted = chunk_bytes(shape, pp * vpp * layers_per_stage, pp, vpp, rank, chunk, level, keep_outputs=True)
        rows.append({"level": level, "measured_bytes": int(measured), "model_bytes": float(predicted),
                     "ratio": measured / predicted if predicted else None, "meter_peak_bytes": int(peak)})
        del output, received
    rows = rows[1:]
    for row in rows:
        ok = ok and row["ratio"] is not None and abs(row["ratio"] - 1) <= METER_TOLERANCE
    record = {"meter": "cuda-allocator" if cuda else "saved-tensors", "tolerance": METER_TOLERANCE, "levels": rows}
    if cuda:
        excluded = all(row["meter_peak_bytes"] == row["measured_bytes"] for row in rows)
        untouched = torch.cuda.max_memory_allocated(device) >= peak_before
        record.update(temporaries_excluded=excluded, megatron_peak_stats_untouched=untouched)
        ok = ok and excluded and untouched
    else:
        record.update(temporaries_excluded=f"{NEEDS_CUDA} (the CPU meter counts saves only; tests/runtime/test_memory.py "
                                           "drives the CUDA meter with a stand-in of the allocator's counters)",
                      megatron_peak_stats_untouched=f"{NEEDS_CUDA} (see tests/runtime/test_memory.py)")
    return {"status": "pass" if ok else "fail", **record}


