"""Fixtures of the profile's tests: Megatron's args of a tiny command as ``pipemesh profile`` reads them."""
import pytest

TINY = ("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 --max-position-embeddings 32 "
        "--micro-batch-size 2 --global-batch-size 8 --train-iters 3 --lr 1e-3 --mock-data "
        "--tokenizer-type NullTokenizer --vocab-size 257")


def profile_args_of(words):
    """Megatron's args of ``words`` for one process as ``pipemesh profile`` builds them on this CPU."""
    from megatron_pipemesh.integration.megatron_command import read_command
    from megatron_pipemesh.integration.profile import as_run_here
    from megatron_pipemesh.integration.profile_models import single_rank_args

    run = read_command(as_run_here(list(words), False), world_size=1)
    args = single_rank_args(run.args)
    args.padded_vocab_size = run.model.vocab_size
    return args


def layer_pieces(args, levels):
    """(settings, the profile's layer models per recompute level, its embedding + output model, the parameters'
    dtype, the tensors the meter excludes) as the profile builds them, with main_grads."""
    from megatron_pipemesh.integration.profile import ProfileSettings
    from megatron_pipemesh.integration.profile_models import gpt, level_args, with_main_grads

    settings = ProfileSettings(warmup=1, repeats=1, max_seconds=0.0)
    layers = {str(level): gpt(level_args(args, str(level)), "local", settings, False, False, False) for level in levels}
    ends, config = gpt(level_args(args, "none"), "local", settings, False, True, True)
    exclude = [t for model, _ in layers.values() for t in with_main_grads(model)] + with_main_grads(ends)
    return settings, layers, ends, config.params_dtype, exclude


@pytest.fixture
def one_rank():
    """Megatron imported with the CPU layer applied, one thread, and a one-rank process group (stopped after)."""
    from megatron_pipemesh.integration.bootstrap import prepare_megatron_import

    prepare_megatron_import()
    import torch

    from megatron_pipemesh.integration.cpu_compat import apply_cpu_compat
    from megatron_pipemesh.integration.profile import start_process_group

    apply_cpu_compat()
    torch.set_num_threads(1)
    stop = start_process_group(False)
    try:
        yield
    finally:
        stop()


@pytest.fixture
def megatron(one_rank):
    """Megatron's args of TINY as ``pipemesh profile`` builds them, with a one-rank process group."""
    return profile_args_of(TINY.split())
