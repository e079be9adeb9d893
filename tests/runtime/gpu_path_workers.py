"""Worker functions (run on every rank) for tests/runtime/test_gpu_path_ranks.py."""
from __future__ import annotations

import contextlib

from tests import megatron_harness as h


class RecordingTimers:
    """Stands in for Megatron's timers: records start/stop of each named timer."""

    def __init__(self):
        self.running = {}
        self.events = []

    def __call__(self, name, log_level=None):
        timers = self

        class Timer:
            def start(self, barrier=False):
                assert not timers.running.get(name), f"timer {name} started twice"
                timers.running[name] = True
                timers.events.append(("start", name))

            def stop(self):
                assert timers.running.get(name), f"timer {name} stopped but not started"
                timers.running[name] = False
                timers.events.append(("stop", name))

            @property
            def _started(self):  # as Megatron's Timer
                return bool(timers.running.get(name))
        return Timer()


def _install_links_with_timeout(minutes: float):
    """install() + an active PipeMesh schedule, then Megatron's initialize_model_parallel with a distributed
    timeout: the patched initializer creates the link groups. Records the links warmed up."""
    import megatron_pipemesh
    from megatron_pipemesh.integration import install, parallel_state as links
    from megatron_pipemesh.integration.flags import PipeMeshArgs
    from megatron_pipemesh.schedule.plan import RunPlan

    h.init_parallel(pp=2, vp=2)  # CPU layer, gloo world (Megatron state re-made below)
    megatron_pipemesh.install()
    install.activate(PipeMeshArgs(True, RunPlan(), 60.0))
    warmed = []
    warm_up = links._warm_up

    def recording_warm_up(groups, order):
        warmed.extend(f"{k[0]} {k[1]}->{k[2]}" for k in order if k in groups)
        warm_up(groups, order)  # sends each source rank's number and checks it arrived
    links._warm_up = recording_warm_up
    try:
        from megatron.core import parallel_state
        parallel_state.destroy_model_parallel()
        parallel_state.initialize_model_parallel(pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2,
                                                 distributed_timeout_minutes=minutes)
    finally:
        links._warm_up = warm_up
    groups = links.get_pipemesh_p2p_groups(create=False)
    import torch
    timeouts = {f"{k[0]} {k[1]}->{k[2]}": g._get_backend(torch.device("cpu")).options._timeout.total_seconds()
                for k, g in groups.items()}
    return timeouts, warmed


def failing_iteration(fail_at=((0, 2), (0, 1))):
    """Iteration 1 clean; in iteration 2 forward_step raises on rank r at its forward of
    (chunk, micro-batch) ``fail_at[r]`` (points each rank reaches without waiting for the other's failed
    work: rank 0 has sent F0.0 and F0.1 and rank 1 has posted the receive of F0.2's input); iteration 3
    clean. Returns losses/grads of 1 and 3, the errors, the timer and no_sync state after the failure,
    and the names of the profiler ranges of iteration 3."""
    import torch
    import torch.distributed as dist

    from megatron_pipemesh.integration.parallel_state import get_pipemesh_p2p_groups
    from megatron_pipemesh.runtime import PipeMeshOptions, PipeMeshSchedule
    from megatron_pipemesh.schedule import ScheduleConfig
    from megatron_pipemesh.schedule.plan import RunPlan

    timeouts, warmed = _install_links_with_timeout(minutes=3)
    spec = h.TinyGPT(num_layers=4)
    model = h.build_model(spec)
    config = model[0].config
    timers = RecordingTimers()
    depth = {"now": 0}

    @contextlib.contextmanager
    def no_sync():
        depth["now"] += 1
        try:
            yield
        finally:
            depth["now"] -= 1
    config.timers, config.no_sync_func, config.barrier_with_L1_time = timers, no_sync, False
    schedule = PipeMeshSchedule(RunPlan(ScheduleConfig(2, 2, 8, (6, 2), (4, 4))),  # no wait here is meant to time out:
                                PipeMeshOptions(p2p_timeout_s=30), p2p_groups=get_pipemesh_p2p_groups)  # room for CI
    first = h.run_schedule(schedule, model, spec, 8)

    calls = {}

    def failing_step(data_iterator, chunk):
        vp_stage = getattr(chunk, "vp_stage", None)
        index = calls.setdefault(vp_stage, 0)
        calls[vp_stage] += 1
        if [vp_stage, index] == list(fail_at[dist.get_rank()]):
            raise ValueError(f"injected failure in chunk {vp_stage} micro-batch {index}")
        return h.forward_step_func(data_iterator, chunk)

    error = None
    try:
        schedule(forward_step_func=failing_step, data_iterator=h.make_data_iterators(spec, 8, 2), model=model,
                 num_microbatches=8, seq_length=spec.seq_length, micro_batch_size=spec.micro_batch_size)
    except Exception as caught:  # noqa: BLE001 - the test inspects what each rank saw
        error = f"{type(caught).__name__}: {caught}"
    after_failure = {"timer_running": timers.running.get("forward-backward"), "no_sync_depth": depth["now"],
                     "abandoned_receives": schedule.abandoned_receives}

    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        third = h.run_schedule(schedule, model, spec, 8)
    ranges = sorted({event.name for event in profile.events() if event.name.startswith("PipeMesh ")})
    program = [record.op for record in schedule.last_stats.records]
    return {"first": first, "third": third, "error": error, "after_failure": after_failure, "ranges": ranges,
            "program": program, "link_timeouts": timeouts, "warmed": warmed,
            "timer_events": [event for event in timers.events if event[1] == "forward-backward"][-2:]}
