"""integration/launcher.py: the launcher and program in front of a command's flags, the cluster it asks for, and the
program a PipeMesh row runs."""
import pytest

from megatron_pipemesh.integration.launcher import ENTRY_MODULE, split_launch


@pytest.mark.parametrize("command, prefix, program, sizes", [
    ("torchrun --nnodes 2 --nproc-per-node 8 pretrain_gpt.py --num-layers 2",
     ("torchrun", "--nnodes", "2", "--nproc-per-node", "8"), ("pretrain_gpt.py",), ((2, 2), 8)),
    ("python -m torch.distributed.run --nproc_per_node=4 /m/pretrain_gpt.py --num-layers 2",
     ("python", "-m", "torch.distributed.run", "--nproc_per_node=4"), ("/m/pretrain_gpt.py",), ((1, 1), 4)),
    ("srun -N 2 --ntasks-per-node=8 python pretrain_gpt.py --num-layers 2",
     ("srun", "-N", "2", "--ntasks-per-node=8", "python"), ("pretrain_gpt.py",), ((2, 2), 8)),
    ("torchrun --nnodes 1:4 --nproc-per-node 8 -m megatron_pipemesh.training.pretrain_gpt --megatron-lm-script "
     "/m/pretrain_gpt.py --num-layers 2", ("torchrun", "--nnodes", "1:4", "--nproc-per-node", "8"),
     ("-m", ENTRY_MODULE, "--megatron-lm-script", "/m/pretrain_gpt.py"), ((1, 4), 8)),
    ("--num-layers 2", (), (), (None, None)),
])
def test_the_flags_start_after_the_program(command, prefix, program, sizes):
    launch = split_launch(command)
    assert (launch.prefix, launch.program, launch.flags, launch.sizes()) == (prefix, program, ("--num-layers", "2"),
                                                                             sizes)


def test_a_pipemesh_row_runs_the_entry_point_with_the_users_script():
    stock = split_launch("torchrun --nnodes 2 --nproc-per-node 8 /m/pretrain_gpt.py --num-layers 2")
    assert stock.pipemesh_words() == ("torchrun", "--nnodes", "2", "--nproc-per-node", "8", "-m", ENTRY_MODULE,
                                      "--megatron-lm-script", "/m/pretrain_gpt.py")
    ours = split_launch("torchrun --nproc-per-node 8 -m megatron_pipemesh.training.pretrain_gpt --num-layers 2")
    assert ours.runs_pipemesh and ours.pipemesh_words() == ours.words
    assert split_launch("--num-layers 2").pipemesh_words() == ("pipemesh-pretrain-gpt",)


def test_a_launcher_for_another_cluster_is_named():
    launch = split_launch("torchrun --nnodes 2 --nproc-per-node 8 pretrain_gpt.py --num-layers 2")
    assert launch.disagreement(2, 8) is None
    assert "runs 2 node(s), and --nodes is 4" in launch.disagreement(4, 8)
    assert "runs 8 process(es) per node, and --gpus-per-node is 4" in launch.disagreement(2, 4)
    assert split_launch("torchrun --nnodes 1:4 --nproc-per-node 8 x.py --a 1").disagreement(3, 8) is None
    # torchrun's defaults: one node, one process
    assert "runs 1 node(s)" in split_launch("torchrun x.py --a 1").disagreement(2, 1)
