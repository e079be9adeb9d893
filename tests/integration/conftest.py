"""Fixtures of the profile's tests: Megatron's args of a tiny command as ``pipemesh profile`` reads them."""
import pytest

TINY = ("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 --max-position-embeddings 32 "
        "--micro-batch-size 2 --global-batch-size 8 --train-iters 3 --lr 1e-3 --mock-data "
        "--tokenizer-type NullTokenizer --vocab-size 257")


def profile_args_of(words):
    """Megatron's args of ``words`` for one process as ``pipemesh profile`` builds them on this CPU."""
    from megatron_pipemesh.integration import profile
    from megatron_pipemesh.integration.megatron_command import read_command

    run = read_command(profile._as_run_here(list(words), False), world_size=1)
    args = profile._single_rank_args(run.args)
    args.padded_vocab_size = run.model.vocab_size
    return args


@pytest.fixture
def one_rank():
    """Megatron imported with the CPU layer applied, one thread, and a one-rank process group (stopped after)."""
    from megatron_pipemesh.integration.bootstrap import prepare_megatron_import

    prepare_megatron_import()
    import torch

    from megatron_pipemesh.integration import profile
    from megatron_pipemesh.integration.cpu_compat import apply_cpu_compat

    apply_cpu_compat()
    torch.set_num_threads(1)
    stop = profile._start_process_group(False)
    try:
        yield
    finally:
        stop()


@pytest.fixture
def megatron(one_rank):
    """Megatron's args of TINY as ``pipemesh profile`` builds them, with a one-rank process group."""
    return profile_args_of(TINY.split())
