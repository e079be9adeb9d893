"""Megatron's recomputation switches on the device (``recompute``): the gradients do not change and the kept bytes
fall from none to selective to full."""
from __future__ import annotations

from .common import TOLERANCE, make_batches, make_config, make_gpt, set_weights

from megatron_pipemesh.schedule.levers import BASIC_LEVERS, DEVICE, FULL, SELECTIVE  # noqa: E402 (pure)


def check_recompute(device, hidden: int = 128, seq: int = 64, mbs: int = 2, vocab: int = 256, layers: int = 2):
    """The whole-model chunk (embedding, layers, loss) at each level: same gradients, fewer kept bytes."""
    import torch

    from megatron_pipemesh.runtime.memory import make_memory_meter
    from megatron_pipemesh.runtime.recompute import recompute_scope

    model = make_gpt(make_config(layers, hidden=hidden), device, vocab, seq, pre=True, post=True)
    set_weights(model, 0)
    batch = make_batches(1, mbs, seq, vocab, device)[0]
    grads, kept = {}, {}
    for level in (DEVICE,) + BASIC_LEVERS:  # first pass: warm-up
        model.zero_grad()
        meter = make_memory_meter(device, [*model.parameters(), *model.buffers()])
        meter.begin()
        with recompute_scope(model, level), meter.record("F"):
            loss = (model(batch["tokens"], batch["position_ids"], batch["attention_mask"], labels=batch["labels"])
                    * batch["loss_mask"]).sum()
        kept[level] = int(meter.saved_bytes["F"])
        with recompute_scope(model, level):
            loss.backward()
        grads[level] = {n: p.grad.detach().float().cpu().clone() for n, p in model.named_parameters()}
    diff = max(float((grads[level][n] - g).abs().max()) / max(float(g.abs().max()), 1e-30)
               for level in (SELECTIVE, FULL) for n, g in grads[DEVICE].items())
    ok = diff <= TOLERANCE and kept[DEVICE] > kept[SELECTIVE] > kept[FULL]
    return {"status": "pass" if ok else "fail", "max_rel_grad_diff": diff, "kept_bytes": kept}


