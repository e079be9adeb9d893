"""One rank of a benchmark run: the bench's instrumentation around the training entry point.

``pipemesh bench`` starts every rank as ``python -m megatron_pipemesh.bench.rank ARGS...`` (under torchrun, and
through :mod:`.rank_netns` on the per-rank network), so the training entry point knows nothing of the bench.
Before anything starts threads, the rank is pinned to its core (:func:`.affinity.pin_from_env`); then
:func:`megatron_pipemesh.training.pretrain_gpt.main` runs with ARGS and, once it has prepared the process,
installs the activation meter (:func:`.activation_meter.install_from_env`: it wraps the schedule getter that
``megatron_pipemesh.install()`` patches, so it must come after). Each is off unless the bench's environment
variable for it is set (:func:`.runner.run_env`).
"""
from __future__ import annotations

from typing import Optional, Sequence


def main(argv: Optional[Sequence[str]] = None) -> None:
    """Pin, run the training entry point with ``argv`` (default: ``sys.argv[1:]``), meter once prepared."""
    from .affinity import pin_from_env

    pin_from_env()
    from ..training.pretrain_gpt import main as pretrain
    from .activation_meter import install_from_env

    pretrain(argv, on_prepared=install_from_env)


if __name__ == "__main__":
    main()
