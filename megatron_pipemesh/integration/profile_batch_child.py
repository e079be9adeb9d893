"""The one-process child in which rank 0 of a multi-rank ``pipemesh profile`` times the data loader
(:func:`.profile_batch.measure_batch_s_apart`): the request (the command's words, the pause per micro-batch size,
the profile's settings) as JSON on stdin; on stdout's last line ``{"samples": {size: [seconds, ...]}, "stable":
{size: bool}}``, or ``{"error": message}`` where building the data path or taking a batch raised.
"""
from __future__ import annotations

import json
import sys


def main() -> None:
    """Read the request, time the loader in a one-rank process group of its own, print the answer."""
    request = json.loads(sys.stdin.read())
    from .bootstrap import prepare_megatron_import

    prepare_megatron_import()
    import torch

    from .profile import command_args, start_process_group
    from .profile_models import megatron_quiet
    from .profile_batch import measure_batch_s
    from .profile_timing import ProfileSettings

    cuda = torch.cuda.is_available()
    if not cuda:
        from .cpu_compat import apply_cpu_compat

        apply_cpu_compat()
        torch.set_num_threads(1)
    try:
        args = command_args(request["words"], cuda)[0]
        stop = start_process_group(cuda)
        try:
            with megatron_quiet():
                found = measure_batch_s(args, {int(k): float(v) for k, v in request["pauses"].items()},
                                        ProfileSettings(**request["settings"]))
        finally:
            stop()
    except Exception as error:  # the user's data path, tokenizer or loader: the parent quotes it in a note
        print(json.dumps({"error": f"{type(error).__name__}: {error}"}), flush=True)
        return
    print(json.dumps({"samples": {str(size): timed.columns[0] for size, timed in found.items()},
                      "stable": {str(size): timed.stable for size, timed in found.items()}}), flush=True)


if __name__ == "__main__":
    main()
