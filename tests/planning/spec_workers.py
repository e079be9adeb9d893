"""Worker of tests/planning/test_specs.py: Megatron's built GPTs' parameter counts (one rank, CPU)."""
from __future__ import annotations

from typing import Dict

from tests import megatron_harness as h


def built_parameters(configs: Dict[str, Dict], untie: bool) -> Dict[str, int]:
    """Name -> parameters of megatron-core's GPTModel for each config (TransformerConfig fields; the local layer spec
    with the MoE layers ``moe_layer_freq`` asks for)."""
    h.init_parallel()
    import torch
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
    from megatron.core.transformer import TransformerConfig

    out = {}
    for name, config in configs.items():
        config = dict(config)
        vocab, seq = config.pop("vocab_size"), config.pop("seq_length")
        cfg = TransformerConfig(use_cpu_initialization=True, params_dtype=torch.float32, pipeline_dtype=torch.float32,
                                hidden_dropout=0.0, attention_dropout=0.0, bias_activation_fusion=False,
                                masked_softmax_fusion=False, persist_layer_norm=False, bias_dropout_fusion=False,
                                gradient_accumulation_fusion=False, **config)
        model = GPTModel(config=cfg, transformer_layer_spec=get_gpt_decoder_block_spec(cfg, use_transformer_engine=False),
                         vocab_size=vocab, max_sequence_length=seq, share_embeddings_and_output_weights=not untie)
        out[name] = sum(p.numel() for p in model.parameters())
    return out
