"""The planning defaults every surface shares: declared here once, imported where used.

Pure: no torch.
"""
from __future__ import annotations

MFU = 0.45
"""Fraction of a device's peak dense FLOP/s the transformer layers reach (a given or known peak; a rate measured
here is already an achieved one and is used at 1)."""

DEFAULT_HOST_LINK_GBPS = 200.0
"""Device-host copy bandwidth per rank and direction (Gbit/s) when nothing is measured: PCIe 4.0 x16
moves 31.5 GB/s raw per direction (16 GT/s x 16 lanes x 128/130); pinned-memory cudaMemcpyAsync reaches
about 25 GB/s of it (CUDA's bandwidthTest on A100/L40S-class servers), i.e. 200 Gbit/s."""

MEMORY_MARGIN = 0.10
"""Fraction of device memory a plan leaves free by default (allocator fragmentation, communication buffers,
workspace): the budget is the free (training) or total (planning) memory minus this share."""

SEARCH_SECONDS = 60.0
"""How long ``pipemesh plan --megatron-args`` searches the layouts unless told (``--search-seconds``; 0: to the end):
it then answers with the best rows found and the bound of what it left."""

ANSWER_MARGIN_S = 2.0
"""Of ``--search-seconds``, the part the search leaves to what surrounds it, so that the answer is out that long after
the command started: the interpreter's start before the search's clock (0.2-0.3 s here), and after the search, ending
its workers (0.1-0.3 s) and printing the rows and exiting with torch loaded (1.2-1.4 s on a 2-core machine)."""
