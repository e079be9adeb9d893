"""megatron_pipemesh: PipeMesh's elastic pipeline schedule for Megatron-LM.

``megatron_pipemesh.install()`` adds ``--pipeline-schedule {default,pipemesh}``,
``--forward-groups`` and ``--backward-groups`` to Megatron's parser and routes schedule selection;
the pure layers (``megatron_pipemesh.schedule``, ``megatron_pipemesh.planning``) and the
``pipemesh`` command need neither torch nor Megatron.
"""
__version__ = "0.1.0"


def install() -> None:
    """Patch a running Megatron (argument parser + schedule selection). Idempotent."""
    from .integration.install import install as _install

    _install()
