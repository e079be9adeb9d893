"""The GPT data path of Megatron's training loop: the datasets (``GPTDataset`` of ``--data-path`` /
``--*-data-path``, ``MockGPTDataset`` of ``--mock-data``, through ``BlendedMegatronDatasetBuilder``) and the batch each
pipeline stage takes from its loader (tokens, labels, masks and positions on the first and the last stage, nothing
between). The training entry point (:mod:`..training.pretrain_gpt`) hands them to Megatron; ``pipemesh profile`` times
them (:mod:`.profile_batch`). Megatron is imported inside the functions: its import needs
:func:`.bootstrap.prepare_megatron_import` first.
"""
from __future__ import annotations

from typing import Optional

_BATCH_KEYS = ("tokens", "labels", "loss_mask", "attention_mask", "position_ids")


def get_batch(data_iterator, vp_stage: Optional[int] = None):
    """(tokens, labels, loss_mask, attention_mask, position_ids) for this chunk; Nones in between."""
    import torch
    from megatron.core import parallel_state as mpu
    from megatron.core.utils import get_batch_on_this_cp_rank, get_batch_on_this_tp_rank
    from megatron.training import get_args

    args = get_args()
    first = mpu.is_pipeline_first_stage(ignore_virtual=vp_stage is None, vp_stage=vp_stage)
    last = mpu.is_pipeline_last_stage(ignore_virtual=vp_stage is None, vp_stage=vp_stage)
    if not (first or last):
        return None, None, None, None, None
    device = (torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available()
              else torch.device("cpu"))
    tp_rank = mpu.get_tensor_model_parallel_rank()
    batch = {}
    if tp_rank == 0:
        raw = next(data_iterator)
        batch = {k: (v.to(device, non_blocking=True) if isinstance(v, torch.Tensor) else v)
                 for k, v in raw.items()}
        for key in _BATCH_KEYS:
            batch.setdefault(key, None)
        batch.setdefault("cu_seqlens", None)
    batch = get_batch_on_this_tp_rank(
        batch,
        has_cu_seqlens=False,
        is_hybrid_cp=False,
        create_attention_mask_in_dataloader=args.create_attention_mask_in_dataloader,
        broadcast_src_rank=mpu.get_tensor_model_parallel_src_rank(),
        broadcast_group=mpu.get_tensor_model_parallel_group(),
        cp_size=args.context_parallel_size,
        tp_rank=tp_rank,
        micro_batch_size=args.micro_batch_size,
        seq_length=args.seq_length,
        mtp_on_this_rank=bool(getattr(args, "mtp_num_layers", None)) and last,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        is_pipeline_first_stage=first,
        is_pipeline_last_stage=last,
    )
    if args.context_parallel_size > 1:
        batch = get_batch_on_this_cp_rank(batch, is_hybrid_cp=False,
                                          cp_group=mpu.get_context_parallel_group())
    return tuple(batch.get(k) for k in _BATCH_KEYS)


def dataset_config(args):
    """Megatron's ``GPTDatasetConfig`` of the command's ``args`` (the fields this megatron-core knows)."""
    from megatron.core.datasets.gpt_dataset import GPTDatasetConfig
    from megatron.core.tokenizers.utils.build_tokenizer import build_tokenizer
    from megatron.training import get_tokenizer
    from megatron.training.utils import get_blend_and_blend_per_split

    tokenizer = get_tokenizer() if getattr(args, "legacy_tokenizer", False) else build_tokenizer(args)
    blend, blend_per_split = get_blend_and_blend_per_split(args)
    kwargs = dict(
        random_seed=args.seed,
        sequence_length=args.seq_length,
        blend=blend,
        blend_per_split=blend_per_split,
        split=args.split,
        num_dataset_builder_threads=args.num_dataset_builder_threads,
        path_to_cache=args.data_cache_path,
        mmap_bin_files=args.mmap_bin_files,
        tokenizer=tokenizer,
        reset_position_ids=args.reset_position_ids,
        reset_attention_mask=args.reset_attention_mask,
        eod_mask_loss=args.eod_mask_loss,
        create_attention_mask=args.create_attention_mask_in_dataloader,
    )
    # Newer fields: pass them only when this megatron-core knows them.
    import dataclasses

    known = {f.name for f in dataclasses.fields(GPTDatasetConfig)}
    for field, attr in (("multiple_validation_sets", "multiple_validation_sets"),
                        ("full_validation", "full_validation"),
                        ("object_storage_cache_path", "object_storage_cache_path"),
                        ("mid_level_dataset_surplus", "mid_level_dataset_surplus"),
                        ("allow_ambiguous_pad_tokens", "allow_ambiguous_pad_tokens"),
                        ("fast_cache_load", "dataloader_fast_cache_load"),
                        ("defer_npy_index_mmap", "dataloader_defer_npy_index_mmap")):
        if field in known and hasattr(args, attr):
            kwargs[field] = getattr(args, attr)
    return GPTDatasetConfig(**kwargs)


def train_valid_test_datasets_provider(train_val_test_num_samples, vp_stage=None):
    """GPTDataset (``--data-path``) or MockGPTDataset (``--mock-data``) for train/valid/test."""
    from megatron.core import parallel_state as mpu
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDataset, MockGPTDataset
    from megatron.training import get_args, print_rank_0
    from megatron.training.utils import is_first_or_last_pipeline_stage

    args = get_args()
    config = dataset_config(args)
    dataset_type = MockGPTDataset if args.mock_data else GPTDataset

    def is_built_on_rank():
        return (is_first_or_last_pipeline_stage(vp_stage)
                and mpu.get_tensor_model_parallel_rank() == 0)

    print_rank_0("> building train, validation, and test datasets for GPT ...")
    datasets = BlendedMegatronDatasetBuilder(dataset_type, train_val_test_num_samples,
                                             is_built_on_rank, config).build()
    print_rank_0("> finished creating GPT datasets ...")
    return datasets


train_valid_test_datasets_provider.is_distributed = True
