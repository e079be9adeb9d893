"""Training entry points built on Megatron's ``pretrain()`` (see :mod:`.pretrain_gpt`)."""
