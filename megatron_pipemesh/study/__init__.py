"""The paper-scale study (``pipemesh study``, ``pipemesh headroom``): PipeMesh's planner against stock Megatron's
whole option set over simulated clusters, built on the planning layer. A wing beside the product: the command line
registers it, and no product layer (schedule, planning, runtime, integration, training) imports it.

Modules: :mod:`.rows` (a study row and the costs both drivers share), :mod:`.study` (``pipemesh study``),
:mod:`.headroom` (``pipemesh headroom``).
"""
