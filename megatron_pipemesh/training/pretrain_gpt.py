"""GPT pretraining entry point on Megatron's own training loop (``pipemesh-pretrain-gpt``).

Accepts every Megatron-LM flag (it uses Megatron's parser) plus those ``megatron_pipemesh.install()``
adds (``--pipeline-schedule``, ``--forward-groups``, ``--backward-groups``, ...), and one flag of its
own that is removed before Megatron parses the command line:

``--megatron-lm-script PATH``
    Run a Megatron-LM checkout's own ``pretrain_gpt.py`` (via ``runpy``, with its directory first on
    ``sys.path`` so ``gpt_builders.py`` / ``model_provider.py`` resolve) after the same preparation.

Preparation, in this order, before Megatron parses anything:

1. :func:`~megatron_pipemesh.integration.bootstrap.prepare_megatron_import` (triton-less stacks,
   Python 3.11);
2. without CUDA: :func:`~megatron_pipemesh.integration.cpu_compat.apply_cpu_compat` and the CPU flags
   the command line lacks (``--transformer-impl local --use-cpu-initialization --no-*-fusion
   --distributed-backend gloo``); with CUDA but without Transformer Engine: ``--transformer-impl
   local`` unless given.  So one command line works on CPU and GPU;
3. ``megatron_pipemesh.install()`` when the package provides it.

Model: ``GPTModel`` per virtual pipeline stage (``vp_stage``), Transformer Engine layer spec when
``--transformer-impl transformer_engine`` and TE is importable, else the local (pure PyTorch) spec;
MoE block spec with ``--num-experts``; MTP block with ``--mtp-num-layers``; ``--spec`` honoured.
Data: ``GPTDataset`` (``--data-path``/``--*-data-path``) or ``MockGPTDataset`` (``--mock-data``) via
``BlendedMegatronDatasetBuilder``.

Example (CPU or GPU, 2 ranks)::

    python -m megatron_pipemesh.data.prepare --output-prefix data-cache/corpus
    torchrun --nproc-per-node 2 -m megatron_pipemesh.training.pretrain_gpt \\
        --num-layers 4 --hidden-size 64 --num-attention-heads 4 --seq-length 64 \\
        --max-position-embeddings 64 --micro-batch-size 2 --global-batch-size 8 \\
        --pipeline-model-parallel-size 2 --num-layers-per-virtual-pipeline-stage 1 \\
        --train-iters 4 --lr 1e-3 --eval-iters 0 --clip-grad 1.0 \\
        --data-path data-cache/corpus --tokenizer-type NullTokenizer --vocab-size 257 --split 98,1,1
"""
from __future__ import annotations

import os
import runpy
import sys
import warnings
from typing import Callable, List, Optional, Sequence, Tuple

# the data path and the forward step are integration code, which pipemesh profile times as well
from ..integration.gpt_data import train_valid_test_datasets_provider
from ..integration.gpt_step import forward_step, loss_func

__all__ = ["main", "prepare_argv", "model_provider", "forward_step", "loss_func",
           "train_valid_test_datasets_provider"]

OWN_FLAG = "--megatron-lm-script"


# --------------------------------------------------------------------------------------------------
# Command line preparation
# --------------------------------------------------------------------------------------------------
def _pop_flag(argv: List[str], flag: str) -> Tuple[Optional[str], List[str]]:
    out: List[str] = []
    value = None
    i = 0
    while i < len(argv):
        a = argv[i]
        if a == flag:
            if i + 1 >= len(argv):
                raise SystemExit(f"error: {flag} needs a path")
            value = argv[i + 1]
            i += 2
            continue
        if a.startswith(flag + "="):
            value = a.split("=", 1)[1]
            i += 1
            continue
        out.append(a)
        i += 1
    return value, out


def _te_importable() -> bool:
    import importlib.util

    try:
        return importlib.util.find_spec("transformer_engine") is not None
    except (ImportError, ValueError):
        return False


def prepare_argv(argv: Sequence[str], cuda: Optional[bool] = None) -> List[str]:
    """Megatron argv plus the flags this machine needs and the user did not give."""
    import torch

    from megatron_pipemesh.integration.cpu_compat import _given, missing_cpu_args

    argv = list(argv)
    cuda = torch.cuda.is_available() if cuda is None else cuda
    if not cuda:
        return argv + missing_cpu_args(argv)
    if not _te_importable() and not _given(argv, "--transformer-impl"):
        return argv + ["--transformer-impl", "local"]
    return argv


def _prepare_process() -> bool:
    """Bootstrap imports, CPU layer, PipeMesh install. Returns True when running on CPU."""
    from megatron_pipemesh.integration.bootstrap import prepare_megatron_import

    prepare_megatron_import()
    import torch

    cpu = not torch.cuda.is_available()
    if cpu:
        from megatron_pipemesh.integration.cpu_compat import apply_cpu_compat

        apply_cpu_compat()
    import megatron_pipemesh

    if hasattr(megatron_pipemesh, "install"):
        megatron_pipemesh.install()
    return cpu


# --------------------------------------------------------------------------------------------------
# Model
# --------------------------------------------------------------------------------------------------
def _layer_spec(args, config, use_te: bool, vp_stage: Optional[int]):
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_decoder_block_spec,
        get_gpt_layer_local_spec,
        get_gpt_layer_with_transformer_engine_spec,
    )

    if getattr(args, "spec", None) is not None:
        from megatron.core.transformer.spec_utils import import_module

        return import_module(args.spec)
    if args.num_experts:
        return get_gpt_decoder_block_spec(config, use_transformer_engine=use_te,
                                          normalization=args.normalization,
                                          qk_l2_norm=getattr(args, "qk_l2_norm", False),
                                          vp_stage=vp_stage)
    if use_te:
        return get_gpt_layer_with_transformer_engine_spec(
            args.num_experts, args.moe_grouped_gemm, args.qk_layernorm,
            args.multi_latent_attention, qk_l2_norm=getattr(args, "qk_l2_norm", False))
    return get_gpt_layer_local_spec(args.num_experts, args.moe_grouped_gemm, args.qk_layernorm,
                                    args.multi_latent_attention, normalization=args.normalization,
                                    qk_l2_norm=getattr(args, "qk_l2_norm", False))


def model_provider(pre_process: bool = True, post_process: bool = True, vp_stage: Optional[int] = None,
                   config=None, pg_collection=None):
    """Build this rank's GPT chunk for virtual stage ``vp_stage`` (``get_model`` calls it per chunk)."""
    from megatron.core.models.gpt import GPTModel
    from megatron.training import get_args, print_rank_0
    from megatron.training.argument_utils import core_transformer_config_from_args

    args = get_args()
    if getattr(args, "use_legacy_models", False):
        raise ValueError("--use-legacy-models is not supported by pipemesh-pretrain-gpt")
    if config is None:
        config = core_transformer_config_from_args(args)
    use_te = args.transformer_impl == "transformer_engine" and _te_importable()
    if args.transformer_impl == "transformer_engine" and not use_te:
        print_rank_0("> Transformer Engine is not installed: using the local layer spec")
    spec = _layer_spec(args, config, use_te, vp_stage)
    mtp_spec = None
    if getattr(args, "mtp_num_layers", None):
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_mtp_block_spec

        mtp_spec = get_gpt_mtp_block_spec(config, spec, use_transformer_engine=use_te, vp_stage=vp_stage)
    kwargs = {}
    if pg_collection is not None:
        kwargs["pg_collection"] = pg_collection
    return GPTModel(
        config=config,
        transformer_layer_spec=spec,
        vocab_size=args.padded_vocab_size,
        max_sequence_length=args.max_position_embeddings,
        pre_process=pre_process,
        post_process=post_process,
        fp16_lm_cross_entropy=args.fp16_lm_cross_entropy,
        parallel_output=True,
        share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
        position_embedding_type=args.position_embedding_type,
        rotary_percent=args.rotary_percent,
        rotary_base=args.rotary_base,
        rope_scaling=args.use_rope_scaling,
        seq_len_interpolation_factor=args.rotary_seq_len_interpolation_factor,
        mtp_block_spec=mtp_spec,
        vp_stage=vp_stage,
        **kwargs,
    )


# --------------------------------------------------------------------------------------------------
# Entry
# --------------------------------------------------------------------------------------------------
def _pretrain() -> None:
    from megatron.core.enums import ModelType
    from megatron.training import inprocess_restart, pretrain
    from megatron.training.argument_utils import pretrain_cfg_container_from_args
    from megatron.training.arguments import parse_and_validate_args

    wrapped_pretrain, store = inprocess_restart.maybe_wrap_for_inprocess_restart(pretrain)
    args = parse_and_validate_args(args_defaults={"tokenizer_type": "GPT2BPETokenizer"})
    with warnings.catch_warnings():
        # We build the model through model_provider (per vp_stage) rather than a ModelConfig.
        warnings.filterwarnings("ignore", message=".*recommended to use a ModelConfig.*")
        cfg = pretrain_cfg_container_from_args(args, model_cfg=None)
    wrapped_pretrain(cfg, train_valid_test_datasets_provider, ModelType.encoder_or_decoder,
                     forward_step, model_provider=model_provider, store=store)


def run_megatron_lm_script(script: str) -> None:
    """Run a Megatron-LM checkout's ``pretrain_gpt.py`` as ``__main__`` (prepared process)."""
    path = os.path.abspath(script)
    if not os.path.isfile(path):
        raise SystemExit(f"error: {OWN_FLAG} {script}: no such file")
    sys.path.insert(0, os.path.dirname(path))
    sys.argv[0] = path
    runpy.run_path(path, run_name="__main__")


def main(argv: Optional[Sequence[str]] = None, on_prepared: Optional[Callable[[], object]] = None) -> None:
    """Console entry ``pipemesh-pretrain-gpt``: prepare the process, then train.

    ``on_prepared``: called once the process is prepared (Megatron importable, PipeMesh installed), before
    Megatron parses the command line: where a launcher adds its own instrumentation (the bench's rank entry
    installs its activation meter here), so that this module imports no launcher."""
    argv = list(sys.argv[1:] if argv is None else argv)
    script, argv = _pop_flag(argv, OWN_FLAG)
    cpu = _prepare_process()
    if on_prepared is not None:
        on_prepared()
    argv = prepare_argv(argv, cuda=not cpu)
    sys.argv = [sys.argv[0] if sys.argv else "pipemesh-pretrain-gpt"] + argv
    if script is not None:
        run_megatron_lm_script(script)
    else:
        _pretrain()
    if cpu:
        _close_gloo_groups()


def _close_gloo_groups() -> None:
    """CPU only: wait for every rank, then destroy the process groups before the interpreter exits.

    Megatron's ``pretrain()`` returns with its groups alive; with ``--overlap-param-gather`` the last
    optimizer step leaves asynchronous all-gathers queued on the data-parallel groups. Left to interpreter
    shutdown, gloo can tear a group down under queued work and abort a rank (SIGABRT after training
    finished); destroying the groups explicitly drains their queues first. On GPUs Megatron's own exit
    path stays untouched."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
