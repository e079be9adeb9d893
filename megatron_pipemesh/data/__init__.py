"""Tiny data pipeline for examples and tests.

:mod:`megatron_pipemesh.data.prepare` (``python -m megatron_pipemesh.data.prepare``) tokenizes text
byte by byte (plus an end-of-document token, matching Megatron's ``NullTokenizer --vocab-size 257``)
into Megatron's indexed dataset format; ``corpus/`` holds a small original English corpus.
"""
