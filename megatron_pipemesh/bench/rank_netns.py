"""Start one torchrun worker inside its rank's network namespace (the bench's per-rank network).

torchrun runs in the hub namespace and starts every worker as
``python -m megatron_pipemesh.bench.rank_netns NAME -m MODULE ARGS...`` (or ``NAME SCRIPT ARGS...``); this module
replaces itself (same pid, same environment, so torchrun's signals and the bench's memory sampler still reach the
worker) with ``ip netns exec NAME-r<LOCAL_RANK> python -m MODULE ARGS...`` and points gloo at the rank's NIC.
"""
from __future__ import annotations

import os
import sys
from typing import List, Optional, Sequence

from .netns import RANK_INTERFACE, exec_prefix, rank_namespace


def worker_command(name: str, local_rank: int, argv: Sequence[str], python: str = sys.executable) -> List[str]:
    """The command that runs ``python argv...`` in rank ``local_rank``'s namespace of the hub ``name``."""
    return exec_prefix(rank_namespace(name, local_rank)) + [python, *argv]


def main(argv: Optional[Sequence[str]] = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    local_rank = os.environ.get("LOCAL_RANK")
    if len(argv) < 2 or local_rank is None:
        raise SystemExit("usage (as a torchrun worker): python -m megatron_pipemesh.bench.rank_netns NAME "
                         "(-m MODULE | SCRIPT) ARGS...; it needs torchrun's LOCAL_RANK and the namespaces "
                         "pipemesh bench creates")
    # gloo advertises the address of this interface to its peers: the rank's NIC, not a loopback
    os.environ["GLOO_SOCKET_IFNAME"] = RANK_INTERFACE
    cmd = worker_command(argv[0], int(local_rank), argv[1:])
    os.execvp(cmd[0], cmd)


if __name__ == "__main__":
    main()
