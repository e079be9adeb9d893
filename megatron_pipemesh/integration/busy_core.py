"""One core kept computing the command's transformer layer (forward and backward, one thread) while ``pipemesh
profile`` times on another (:mod:`.profile_siblings`): the request (the command's words and the core) as one JSON line
on stdin, ``ready`` on stdout once it computes; it stops when stdin closes.
"""
from __future__ import annotations

import json
import os
import sys
import threading


def main() -> None:
    """The sibling: pin to the requested core, build the command's layer, say ``ready``, compute until stdin closes."""
    request = json.loads(sys.stdin.readline())
    os.sched_setaffinity(0, {int(request["core"])})
    stop = threading.Event()
    threading.Thread(target=lambda: (sys.stdin.read(), stop.set()), daemon=True).start()

    from .bootstrap import prepare_megatron_import

    prepare_megatron_import()
    import torch

    from .cpu_compat import apply_cpu_compat
    from .profile import ProfileSettings, command_args, start_process_group
    from .profile_models import gpt, level_args, megatron_quiet, with_main_grads
    from .profile_steps import loader_attention_mask

    apply_cpu_compat()
    torch.set_num_threads(1)
    args, _, run = command_args(request["words"], False)
    end = start_process_group(False)
    try:
        with megatron_quiet():
            model, _ = gpt(level_args(args, "none"), run.model.layer_spec, ProfileSettings(), False, pre=False,
                            post=False)
        with_main_grads(model)  # the backward accumulates into them, as under Megatron's DDP
        s, b, h = args.seq_length, args.micro_batch_size, args.hidden_size
        mask = loader_attention_mask(args, 1, torch.device("cpu"))
        hidden = torch.randn(s, b, h)
        print("ready", flush=True)
        while not stop.is_set():
            model.set_input_tensor(hidden.clone().requires_grad_(True))
            out = model(input_ids=None, position_ids=None, attention_mask=mask)
            out.backward(torch.ones_like(out) * 1e-3)
    finally:
        end()


if __name__ == "__main__":
    main()
