"""``pipemesh bench``: measured side-by-side comparison of PipeMesh and stock Megatron schedules.

Runs the same small GPT pretraining (``megatron_pipemesh.training.pretrain_gpt`` through the bench's rank
entry under ``torch.distributed.run``, CPU + gloo) once per schedule and repeat, round-robin, on a network
shaped by ``tc`` (an emulated slow cloud network: by default every rank in its own namespace behind its own NIC,
or all ranks on one shaped loopback), plus the same runs unshaped (the limit). Parses Megatron's own log (iteration
time, per-rank timers), reports a table / JSON / PNG and calibrates the simulator against the measurements.

Modules: :mod:`.netns` (namespace and ``tc`` commands), :mod:`.logparse` (Megatron log text),
:mod:`.runner` (command lines, processes, memory sampling), :mod:`.rank` (each rank's entry: core pinning
(:mod:`.affinity`) and the activation meter (:mod:`.activation_meter`) around the training entry point),
:mod:`.report` (aggregation, table, JSON, chart), :mod:`.calibrate` (measured costs -> simulator), :mod:`.cli`
(the ``bench`` subcommand); :mod:`.demo_summary` (``scripts/demo.sh``'s PipeMesh-against-stock summary of two
training logs).
"""
