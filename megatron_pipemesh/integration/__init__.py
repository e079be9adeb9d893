"""Megatron integration: import bootstrap, CPU compatibility layer and (separately) ``install()``."""
