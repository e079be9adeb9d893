"""``pipemesh profile``: Megatron's own models of the command, as one process builds them.

The command's args (one process: TP = PP = CP = 1, no layer split) give Megatron's ``TransformerConfig``
(``core_transformer_config_from_args``) and a ``GPTModel`` of one transformer layer: a middle stage, or with the
embedding and / or the output layer and loss, at any recompute level (:func:`level_args`), with the layer spec the
command runs with here. Weights get Megatron's ``main_grad`` buffers (:func:`with_main_grads`), as DDP gives them, so
the backward accumulates as in training.
"""
from __future__ import annotations

import contextlib
import copy
import io
import logging
from typing import TYPE_CHECKING, Callable, Dict, List, Tuple

from ..schedule.levers import Lever

if TYPE_CHECKING:
    from .profile_timing import ProfileSettings


def single_rank_args(args):
    """``args`` for one process: TP = PP = CP = 1, no layer split, no sequence parallelism."""
    out = copy.copy(args)
    out.tensor_model_parallel_size = out.pipeline_model_parallel_size = out.context_parallel_size = 1
    out.virtual_pipeline_model_parallel_size = None
    out.sequence_parallel = False
    out.expert_model_parallel_size, out.expert_tensor_parallel_size = 1, 1  # every expert here: a rank's routed work
    for name in ("decoder_first_pipeline_num_layers", "decoder_last_pipeline_num_layers",
                 "pipeline_model_parallel_layout"):
        if hasattr(out, name):
            setattr(out, name, None)
    for name in ("account_for_embedding_in_pipeline_split", "account_for_loss_in_pipeline_split"):
        if hasattr(out, name):
            setattr(out, name, False)
    return out


def level_args(args, level: str, dense: bool = False):
    """``args`` with the recomputation of ``level`` (a :class:`..schedule.levers.Lever` name) and one layer: of a MoE
    command a MoE layer, or with ``dense`` its dense layer."""
    lever = Lever.parse(level)
    switches = lever.switches  # what the runtime sets for the lever, as Megatron's --recompute-* values
    out = copy.copy(args)
    out.num_layers = 1
    if getattr(out, "num_experts", None):
        out.moe_layer_freq = 1
        if dense:  # Megatron's config refuses an expert size without experts
            out.num_experts = out.moe_ffn_hidden_size = out.moe_shared_expert_intermediate_size = None
    out.recompute_granularity, out.recompute_method = switches.granularity, switches.method
    out.recompute_num_layers = switches.num_layers
    if lever.is_selective:
        out.recompute_modules = sorted(lever.modules)
    return out


def te_importable() -> bool:
    """Whether Transformer Engine can be imported here."""
    import importlib.util

    try:
        return importlib.util.find_spec("transformer_engine") is not None
    except (ImportError, ValueError):
        return False


def layer_spec(args, use_te: bool):
    """Megatron's GPT layer spec of ``args`` (Transformer Engine's or the local one; a MoE layer with --num-experts,
    its experts' GEMMs grouped with --moe-grouped-gemm where Transformer Engine runs)."""
    from megatron.core.models.gpt.gpt_layer_specs import (get_gpt_layer_local_spec,
                                                          get_gpt_layer_with_transformer_engine_spec)

    qk_l2_norm = getattr(args, "qk_l2_norm", False)
    experts = getattr(args, "num_experts", None)
    grouped = bool(getattr(args, "moe_grouped_gemm", False)) and use_te
    if use_te:
        return get_gpt_layer_with_transformer_engine_spec(experts, grouped, args.qk_layernorm,
                                                          args.multi_latent_attention, qk_l2_norm=qk_l2_norm)
    return get_gpt_layer_local_spec(experts, grouped, args.qk_layernorm, args.multi_latent_attention,
                                    normalization=args.normalization, qk_l2_norm=qk_l2_norm)


def gpt(args_of_level, run_spec: str, settings: "ProfileSettings", cuda: bool, pre: bool, post: bool):
    """(Megatron's ``GPTModel`` of ``args_of_level`` on this device, its ``TransformerConfig``): a middle stage, or
    with ``pre`` / ``post`` the embedding / the output layer and loss. With ``--bf16`` / ``--fp16`` its parameters
    are cast as Megatron's ``Float16Module`` casts the model it wraps in training (``module.bfloat16()`` /
    ``.half()``): built from the config alone, the local spec's norms stay fp32 and their fp32 output meets a 16-bit
    weight in the next linear."""
    import torch
    from megatron.core import tensor_parallel
    from megatron.core.models.gpt import GPTModel
    from megatron.training.argument_utils import core_transformer_config_from_args

    torch.manual_seed(settings.seed)
    tensor_parallel.model_parallel_cuda_manual_seed(settings.seed)
    config = core_transformer_config_from_args(args_of_level)
    spec = layer_spec(args_of_level, run_spec == "te" and te_importable())
    model = GPTModel(config=config, transformer_layer_spec=spec, vocab_size=args_of_level.padded_vocab_size,
                     max_sequence_length=args_of_level.max_position_embeddings, pre_process=pre, post_process=post,
                     parallel_output=True,
                     share_embeddings_and_output_weights=not args_of_level.untie_embeddings_and_output_weights,
                     position_embedding_type=args_of_level.position_embedding_type,
                     rotary_percent=args_of_level.rotary_percent, rotary_base=args_of_level.rotary_base)
    if config.bf16:
        model = model.bfloat16()
    elif config.fp16:
        model = model.half()
    return model.to(torch.device("cuda" if cuda else "cpu")), config


def with_main_grads(model) -> List:
    """Give every parameter an fp32 ``main_grad`` (what Megatron's DDP buffers are) and return the tensors."""
    import torch

    tensors = []
    for param in model.parameters():
        param.main_grad = torch.zeros_like(param, dtype=torch.float32)
        tensors += [param, param.main_grad]
    return tensors


def one_layer_chunks(args, build: Callable) -> Dict[str, Tuple[object, object]]:
    """Per :data:`..planning.costs.STAGE_KINDS`: a one-layer chunk of that kind built by ``build`` (``(model,
    config)``, the embedding on the first / only, the output layer on the last / only), with ``main_grad``s."""
    from ..planning.costs import STAGE_KINDS

    chunks = {}
    for kind in STAGE_KINDS:
        model, config = build(level_args(args, "none"), pre=kind in ("only", "first"), post=kind in ("only", "last"))
        with_main_grads(model)
        chunks[kind] = (model, config)
    return chunks


@contextlib.contextmanager
def megatron_quiet():
    """Megatron's INFO logs and prints kept out of the profile's progress and table while it builds its parts."""
    megatron_log = logging.getLogger("megatron.core")
    level = megatron_log.level
    megatron_log.setLevel(logging.WARNING)
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            yield
    finally:
        megatron_log.setLevel(level)
