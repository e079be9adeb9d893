"""The ``pipemesh`` subcommands that need no GPU:

    pipemesh show --pp 4 --vpp 2 --microbatches 12 --forward-groups 8 4 --backward-groups 6 6 [--json] [--lowered]
    pipemesh simulate --pp 4 --vpp 2 --microbatches 12 --forward-groups 8 4 --backward-groups 6 6 \
        [model/cluster or cost flags] [--json] [--trace FILE] [--plot FILE.png]
    pipemesh plan --pp 4 --vpp 2 -m 12 [model/cluster flags] [--output PLAN.json]
    pipemesh plan --megatron-args "<your pretrain_gpt.py flags>" --nodes N --gpus-per-node G --nic-gbps R --gpu MODEL

One module per subcommand (:mod:`.show`, :mod:`.simulate`, :mod:`.plan`, :mod:`.megatron_args`, :mod:`.profile`), the
flags they share (:mod:`.arguments`), their place on the parser (:mod:`.parser`) and what the bench's command shares
with them (:mod:`.common`). The command's table is :mod:`..command`. Invalid input exits with code 2 and a
one-paragraph message.
"""
from __future__ import annotations

from .common import UsageError

__all__ = ["UsageError"]
