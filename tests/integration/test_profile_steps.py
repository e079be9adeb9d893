"""`integration/profile_steps.py`: each kind of chunk takes its stage's path through the forward step; what the
forward step spends outside the model is timed in the same call, the backward's is its time less the pieces', never
below 0."""
import dataclasses
import time


def test_each_kind_takes_its_stages_path_through_get_batch_and_the_state_is_restored(megatron):
    """A middle chunk takes no batch (its iterator is not touched), the first and the last take one; afterwards
    Megatron's parallel state reads the process group again (one stage)."""
    from megatron.core import parallel_state

    from megatron_pipemesh.integration.gpt_data import get_batch
    from megatron_pipemesh.integration.profile_steps import _as_stage, _batch, _training_globals

    import torch

    batch = _batch(megatron, 2, torch.device("cpu"))
    with _training_globals(megatron):
        with _as_stage("middle"):
            assert get_batch(iter(())) == (None,) * 5
        for kind in ("first", "last", "only"):
            with _as_stage(kind):
                tokens = get_batch(iter((batch,)))[0]
                assert tokens is not None and tuple(tokens.shape) == (2, 32), kind
    assert parallel_state.get_pipeline_model_parallel_world_size() == 1
    assert parallel_state.get_pipeline_model_parallel_rank() == 0


def test_the_forward_is_timed_outside_the_model_and_the_backward_less_the_pieces(megatron):
    """A model made 50 ms slower inside its forward: the forward step's part outside it stays a few ms on every kind
    (the last's loss above a middle chunk's bare layer) whatever the pieces say; the backward is the step's time less
    the pieces' (positive with pieces of 0 s, 0 and not below with pieces longer than any step)."""
    import torch

    from megatron_pipemesh.integration.profile import ProfileSettings
    from megatron_pipemesh.integration.profile_models import gpt, one_layer_chunks
    from megatron_pipemesh.integration.profile_steps import measure_step_overhead
    from megatron_pipemesh.integration.profile_timing import Timer
    from megatron_pipemesh.planning.costs import STAGE_KINDS
    from megatron_pipemesh.planning.profile import ComputePoint

    settings = ProfileSettings()
    fixed = ProfileSettings(warmup=1, repeats=3, max_seconds=0.0)
    models = one_layer_chunks(megatron, lambda args, pre, post: gpt(args, "local", settings, False, pre, post))
    for model, _ in models.values():
        model.register_forward_hook(lambda *_: time.sleep(0.05))
    zero = ComputePoint(tp=1, micro_batch_size=2, layer_forward_s=0.0, layer_backward_s=0.0, recompute_extra_s={},
                        layer_activation_bytes={}, embedding_forward_s=0.0, embedding_backward_s=0.0,
                        embedding_activation_bytes=0.0, output_forward_s=0.0, output_backward_s=0.0,
                        output_activation_bytes=0.0)
    timer = Timer(False)
    whole = measure_step_overhead(megatron, models, [zero], timer, torch.device("cpu"), fixed)[2]
    assert set(whole) == set(STAGE_KINDS)
    assert all(0 < forward < 0.02 and backward > 0 for forward, backward in whole.values()), whole
    assert whole["last"][0] > whole["middle"][0]
    long = dataclasses.replace(zero, layer_forward_s=1.0, layer_backward_s=1.0)
    pieces_longer = measure_step_overhead(megatron, models, [long], timer, torch.device("cpu"), fixed)[2]
    assert all(0 < forward < 0.02 and backward == 0.0 for forward, backward in pieces_longer.values()), pieces_longer
