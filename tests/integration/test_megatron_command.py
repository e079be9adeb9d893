"""A user's pretrain_gpt.py command read by Megatron's own parser (integration/megatron_command.py)."""
import pytest

from megatron_pipemesh.integration.megatron_command import CommandError, failed_check, read_command, split_flags

TINY = ("torchrun --nproc-per-node 4 pretrain_gpt.py --num-layers 4 --hidden-size 64 --num-attention-heads 4 "
        "--seq-length 64 --max-position-embeddings 64 --micro-batch-size 2 --global-batch-size 16 "
        "--pipeline-model-parallel-size 2 --num-virtual-stages-per-pipeline-rank 2 --mock-data "
        "--tokenizer-type NullTokenizer --vocab-size 257 --train-iters 10 --lr 1e-3 --recompute-granularity selective")


def test_the_command_is_read_as_megatron_validates_it():
    """The layout comes from Megatron's validation for the cluster's world size (DP = 4 / PP 2), the model from the
    flags (vocabulary padded as Megatron pads it), the stock setting from the schedule and recompute flags."""
    assert split_flags(TINY)[0] == "--num-layers"
    user = read_command(TINY, world_size=4)
    assert (user.tp, user.pp, user.dp, user.microbatches) == (1, 2, 2, 4)
    assert (user.model.num_layers, user.model.hidden_size, user.model.vocab_size) == (4, 64, 384)
    assert (user.stock.vpp, user.stock.effective_group_size, user.stock.recompute.granularity) == (2, 2, "selective")
    assert not user.pipemesh and not user.distributed_optimizer


def test_unknown_flags_and_refused_commands_are_named():
    """A flag Megatron does not know is named; a layout Megatron refuses on this many GPUs says why."""
    with pytest.raises(CommandError, match="Megatron does not know --fast-mode"):
        read_command(TINY + " --fast-mode 3", world_size=4)
    with pytest.raises(CommandError, match="validate_args rejects the command on 3 GPUs"):
        read_command(TINY, world_size=3)


def test_a_bare_assertion_of_megatron_is_named_by_its_condition():
    """3 heads with hidden 256, as a new user types it: validate_args fails a bare `assert`, and the error says
    which file, line and condition (not "validate_args rejects the command on 2 GPUs: " and nothing after it), in
    read_command and in what `pipemesh plan --megatron-args` prints."""
    from tests.cli.test_commands import run

    command = TINY.replace("--hidden-size 64 --num-attention-heads 4", "--hidden-size 256 --num-attention-heads 3")
    with pytest.raises(CommandError) as error:
        read_command(command, world_size=2)
    message = str(error.value)
    assert message.startswith("Megatron's validate_args rejects the command on 2 GPUs: arguments.py:"), message
    assert message.endswith(": assert args.hidden_size % args.num_attention_heads == 0"), message
    code, _, err = run(["plan", "--nodes", "1", "--gpus-per-node", "2", "--device-memory-gib", "1", "--nic-gbps", "1",
                        "--megatron-args", command])
    assert code == 2 and "assert args.hidden_size % args.num_attention_heads == 0" in err, (code, err)


def test_a_bare_assertion_over_several_lines_is_joined(tmp_path):
    """A check written over several lines is named by its whole condition on one line, at the line that failed;
    frames outside megatron are not blamed."""
    source = tmp_path / "megatron" / "checks.py"
    source.parent.mkdir()
    source.write_text("def check(args):\n    x = 1\n    assert (\n        args.a\n        == args.b\n    )\n")
    namespace = {}
    exec(compile(source.read_text(), str(source), "exec"), namespace)
    with pytest.raises(AssertionError) as error:
        namespace["check"](type("Args", (), {"a": 1, "b": 2}))
    text = failed_check(error.value)
    assert text.startswith("checks.py:") and text.endswith(": assert args.a == args.b"), text
    with pytest.raises(AssertionError) as outside:
        assert 1 == 2
    assert failed_check(outside.value) == "AssertionError"


def test_tensor_parallel_commands_validate_without_a_local_gpu():
    """Planning a TP = 2 command on a machine without CUDA: Megatron's validate_args would read the local GPU's
    architecture; the command itself is what is validated."""
    user = read_command(TINY + " --tensor-model-parallel-size 2", world_size=8)
    assert (user.tp, user.pp, user.dp) == (2, 2, 2)


def test_reading_a_command_prints_none_of_megatrons_import_warnings():
    """In a fresh process (megatron-core not yet imported), reading a command leaves stderr free of megatron-core's
    import-time warnings about missing fused kernels (Transformer Engine, Apex), which `pipemesh plan` would print
    before its table; the same import without the filter does print them."""
    import subprocess
    import sys

    read = ("from megatron_pipemesh.integration.megatron_command import read_command; "
            f"print(read_command({TINY!r}, world_size=4).pp)")
    bare = ("from megatron_pipemesh.integration.bootstrap import prepare_megatron_import; prepare_megatron_import(); "
            "import megatron.training.arguments")
    out = subprocess.run([sys.executable, "-c", read], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip() == "2", out.stderr[-2000:]
    assert "UserWarning" not in out.stderr, out.stderr[-2000:]
    unfiltered = subprocess.run([sys.executable, "-c", bare], capture_output=True, text=True, timeout=300)
    assert "UserWarning: Apex is not installed" in unfiltered.stderr, unfiltered.stderr[-2000:]
