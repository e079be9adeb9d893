"""The pinned host link on a GPU (``host_link``): bandwidth each direction, one chunk's activations offloaded and
reloaded through the runtime's offloader, and how much of such a copy hides behind the chunk's compute."""
from __future__ import annotations

import contextlib
import sys

from .common import TOLERANCE, make_batches, make_config, make_gpt, set_weights


def check_host_link(device, hidden: int = 1024, heads: int = 16, seq: int = 1024, mbs: int = 2, layers: int = 2,
                    vocab: int = 1024):
    """A middle-stage chunk on the GPU: its activations offloaded and reloaded by the runtime's offloader
    (gradients unchanged), the pinned host link each direction, and how much of a copy of those bytes
    hides behind the chunk's forward and backward."""
    if device.type != "cuda":
        return {"status": "skip", "reason": "skipped: needs CUDA (pinned copies on side streams need a GPU; on CPU the "
                                            "executor_host check runs the offloader's synchronous path)"}
    import torch

    from megatron_pipemesh.runtime.host_link import measure_host_link, measure_overlap
    from megatron_pipemesh.runtime.offload import ActivationOffloader

    model = make_gpt(make_config(layers, hidden=hidden, heads=heads), device, vocab, seq, pre=False, post=False)
    set_weights(model, 1)
    batch = make_batches(1, mbs, seq, vocab, device)[0]
    generator = torch.Generator(device=device).manual_seed(7)
    received = torch.randn((seq, mbs, hidden), device=device, generator=generator)
    grad_out = torch.randn((seq, mbs, hidden), device=device, generator=generator) * 1e-3

    def forward(hooks=None):
        x = received.clone().requires_grad_(True)
        model.set_input_tensor(x)
        with torch.autograd.graph.saved_tensors_hooks(*hooks) if hooks else contextlib.nullcontext():
            out = model(batch["tokens"], batch["position_ids"], batch["attention_mask"])
        return x, out

    def grads():
        return {n: p.grad.detach().float().clone() for n, p in model.named_parameters()}

    def step():
        model.zero_grad()
        x, out = forward()
        out.backward(grad_out)

    step()  # warm-up: kernels, workspaces
    step()
    reference = grads()
    offloader = ActivationOffloader(device)
    offloader.begin([*model.parameters(), *model.buffers()])
    model.zero_grad()
    x, out = forward(offloader.hooks("c"))
    torch.cuda.synchronize(device)
    before = torch.cuda.memory_allocated(device)
    moved = offloader.offload("c", keep=(x, out))
    torch.cuda.synchronize(device)
    # Blocks freed with record_stream return to the allocator once their copy's event is processed, which the
    # next allocation does.
    torch.empty(1, device=device)
    freed = before - torch.cuda.memory_allocated(device) + 512  # the probe's own (rounded) block
    offloader.reload("c")
    offloader.wait("c")
    out.backward(grad_out)
    offloader.release("c")
    diff = max(float((g - reference[n]).abs().max()) / max(float(reference[n].abs().max()), 1e-30)
               for n, g in grads().items())
    link = measure_host_link(device)
    overlaps = {d: measure_overlap(device, step, moved, d) for d in ("d2h", "h2d")}
    planner_gbps = min(o.overlapped_gbps for o in overlaps.values())
    print(f"PipeMesh host link: d2h {link.d2h_gbps:.1f} Gbit/s, h2d {link.h2d_gbps:.1f} Gbit/s (pinned, "
          f"{link.nbytes >> 20} MiB); one chunk's activations ({moved / 2**20:.1f} MiB) next to its forward+backward "
          f"({overlaps['d2h'].compute_ms:.2f} ms): offload {100 * overlaps['d2h'].hidden_fraction:.0f}% hidden at "
          f"{overlaps['d2h'].overlapped_gbps:.1f} Gbit/s, reload {100 * overlaps['h2d'].hidden_fraction:.0f}% hidden at "
          f"{overlaps['h2d'].overlapped_gbps:.1f} Gbit/s; planner: --pipemesh-host-link-gbps {planner_gbps:.0f}",
          file=sys.stderr, flush=True)
    ok = diff <= TOLERANCE and moved > 0 and freed >= 0.9 * moved and planner_gbps > 0
    return {"status": "pass" if ok else "fail", "max_rel_grad_diff": diff, "offloaded_bytes": moved,
            "device_bytes_freed_by_offload": freed, "d2h_gbps": link.d2h_gbps, "h2d_gbps": link.h2d_gbps,
            "overlap": {d: {"compute_ms": o.compute_ms, "copy_ms": o.copy_ms, "together_ms": o.together_ms,
                            "hidden_fraction": o.hidden_fraction, "overlapped_gbps": o.overlapped_gbps}
                        for d, o in overlaps.items()},
            "planner_host_link_gbps": planner_gbps, "pool_allocations": offloader.pool.allocations}


