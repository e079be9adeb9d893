"""What every argument of Megatron's training parser does to the advice's prediction: the data of
:mod:`.flag_inventory`, declared once.

Every ``dest`` of ``megatron.training.arguments.add_megatron_arguments`` (megatron-core 0.19.2, and Megatron-LM main
at d98e8a6) and of PipeMesh's own flags is in exactly one table:

* :data:`PRICED`: the cost or memory term it changes, and where the costs take it in;
* :data:`NOT_PRICED`: what it would change; ``pipemesh plan`` names it when the command sets it away from Megatron's
  default, and the rows are priced without it;
* :data:`REFUSED`: a feature whose omission would make the advice wrong in kind (another kind of layer or model):
  ``pipemesh plan`` refuses a command that sets it;
* :data:`NO_COST`: it changes neither the time nor the memory of an iteration (logging, paths, cadences, seeds...),
  by reason.

Pure data: no imports.
"""

PRICED = {
    # the model's shape (planning/costs.py ModelSpec, from integration/megatron_command.read_command)
    "num_layers": "layers per stage: compute, weights, activations (ModelSpec.num_layers)",
    "encoder_num_layers": "as --num-layers, which Megatron sets from it for a GPT (ModelSpec.num_layers)",
    "hidden_size": "every term (ModelSpec.hidden_size)",
    "num_attention_heads": "attention compute and memory, TP sizes (ModelSpec.num_attention_heads)",
    "group_query_attention": "key/value widths (ModelSpec.num_query_groups)",
    "num_query_groups": "key/value widths (ModelSpec.num_query_groups)",
    "ffn_hidden_size": "MLP compute, weights, activations (ModelSpec.ffn_hidden_size)",
    "swiglu": "gated MLP: fc1 of 2f (ModelSpec.swiglu)",
    "normalization": "norm weights (RMSNorm has no bias; ModelSpec.normalization)",
    "add_bias_linear": "linear biases, and whether the MLP can be recomputed per module (ModelSpec.linear_bias)",
    "position_embedding_type": "learned position table or RoPE (ModelSpec.position_embedding)",
    "use_rotary_position_embeddings": "RoPE, as --position-embedding-type rope (ModelSpec.position_embedding)",
    "max_position_embeddings": "the learned position table's rows (ModelSpec.max_position_embeddings)",
    "untie_embeddings_and_output_weights": "the output layer's own weights, gradients and optimizer state; no "
                                           "embedding all-reduce between first and last stage (ModelSpec.tied_embeddings)",
    "seq_length": "every activation and compute term (ModelSpec.seq_length)",
    "encoder_seq_length": "as --seq-length, which Megatron sets from it for a GPT (ModelSpec.seq_length)",
    "micro_batch_size": "every activation and compute term (ModelSpec.micro_batch_size; the advice searches it)",
    "global_batch_size": "micro-batches per iteration (AdviceProblem.global_batch)",
    "vocab_size": "embedding and output layer (ModelSpec.vocab_size, padded as Megatron pads it)",
    "padded_vocab_size": "embedding and output layer (ModelSpec.vocab_size)",
    "pad_vocab_size": "whether the vocabulary is padded (ModelSpec.vocab_size)",
    "make_vocab_size_divisible_by": "the padded vocabulary per TP (AdviceProblem.vocab_multiple)",
    "vocab_file": "the vocabulary size, read from the file where --vocab-size is not given (megatron_command)",
    "merge_file": "with --vocab-file: a GPT-2 BPE vocabulary (megatron_command)",
    "tokenizer_type": "which tokenizer file gives the vocabulary size (megatron_command)",
    "tokenizer_model": "the vocabulary size, read from a tokenizer.json where --vocab-size is not given "
                       "(megatron_command)",
    "bf16": "bytes of weights, activations and transfers (ModelSpec.dtype_bytes)",
    "fp16": "bytes of weights, activations and transfers (ModelSpec.dtype_bytes)",
    "fp8": "the linear layers' GEMMs at the device's FP8 rate and their saved inputs in 1 byte (ModelSpec.fp8); "
           "refused on a GPU without FP8",
    "fp8_recipe": "which GPUs run it (mxfp8 needs Blackwell; ModelSpec.fp8)",
    "transformer_impl": "flash attention and fused norms with Transformer Engine (ModelSpec.layer_spec)",
    "hidden_dropout": "dropout masks kept for the backward (ModelSpec.hidden_dropout)",
    "attention_dropout": "dropout masks kept for the backward (ModelSpec.attention_dropout)",
    "grad_reduce_in_bf16": "gradient bytes reduced (ModelSpec.grad_bytes)",
    # the layout and the schedule
    "tensor_model_parallel_size": "compute and weights per rank, TP collectives (ClusterSpec.tp)",
    "sequence_parallel": "activations and transfers split over TP (ClusterSpec.sequence_parallel)",
    "context_parallel_size": "a 1/CP slice of the sequence per rank, the key/value exchange per layer, gradients "
                             "reduced over DP x CP (ClusterSpec.cp)",
    "cp_comm_type": "how the key/value exchange runs: p2p ring, all-to-all or all-gather (ClusterSpec.cp_comm)",
    "pipeline_model_parallel_size": "stages, pipeline transfers, bubbles (ScheduleConfig.pp)",
    "num_layers_per_virtual_pipeline_stage": "V (ScheduleConfig.vpp)",
    "num_virtual_stages_per_pipeline_rank": "V (ScheduleConfig.vpp)",
    "microbatch_group_size_per_vp_stage": "the interleaved schedule's group size (StockSetting.group_size)",
    "decoder_first_pipeline_num_layers": "layers of the first stage (LayerSplit.first)",
    "decoder_last_pipeline_num_layers": "layers of the last stage (LayerSplit.last)",
    "pipeline_model_parallel_layout": "layers of every stage (LayerSplit.layout)",
    "account_for_embedding_in_pipeline_split": "the even split counts the embedding as a layer (LayerSplit)",
    "account_for_loss_in_pipeline_split": "the even split counts the loss as a layer (LayerSplit)",
    "overlap_p2p_comm": "whether rows may interleave at PP = 2 (AdviceProblem.interleaving_at_two)",
    "pipeline_schedule": "PipeMesh's schedule (the user row's groups)",
    "forward_groups": "PipeMesh's forward groups (ScheduleConfig.forward_groups)",
    "backward_groups": "PipeMesh's backward groups (ScheduleConfig.backward_groups)",
    # data parallelism and the optimizer
    "use_distributed_optimizer": "optimizer state sharded, gradients reduce-scattered, parameters gathered "
                                 "(ClusterSpec.distributed_optimizer)",
    "overlap_grad_reduce": "gradients reduced under the backward (ClusterSpec.overlap_grad_reduce)",
    "overlap_param_gather": "parameters gathered under the forward (ClusterSpec.overlap_param_gather)",
    "distributed_backend": "the collectives' library, NCCL or gloo (ClusterSpec.collectives)",
    "clip_grad": "the optimizer step (pipemesh profile times Megatron's step(), gradient clipping included)",
    # memory levers
    "recompute_granularity": "recomputation (StockRecompute, the lever's bytes and time)",
    "recompute_method": "full recomputation's layers (StockRecompute.method)",
    "recompute_num_layers": "full recomputation's layers (StockRecompute.num_layers)",
    "recompute_modules": "selective recomputation's modules (StockRecompute.modules)",
    "recompute_activations": "selective recomputation, which Megatron sets from it (StockRecompute)",
    "checkpoint_activations": "full recomputation, which Megatron sets from it (StockRecompute)",
    "fine_grained_activation_offloading": "activation offloading (StockOffload)",
    "offload_modules": "which inputs are offloaded (StockOffload; priced for Megatron's attention modules)",
    "activation_offload_fraction": "the share offloaded (StockOffload.fraction)",
    # mixture-of-experts (ModelSpec.moe, ClusterSpec.ep / etp)
    "num_experts": "mixture-of-experts layers: expert weights, routed compute, the token dispatch (ModelSpec.moe)",
    "expert_model_parallel_size": "experts per rank, the dispatch's all-to-all over the EP group's links (ClusterSpec.ep)",
    "expert_tensor_parallel_size": "expert weights per rank (ClusterSpec.etp)",
    "moe_layer_freq": "which layers are MoE layers (MoeSpec.pattern)",
    "moe_ffn_hidden_size": "the experts' MLP width (MoeSpec.ffn_hidden_size)",
    "moe_shared_expert_intermediate_size": "shared experts' compute, weights and activations (MoeSpec.shared_ffn)",
    "moe_shared_expert_gate": "the shared experts' gate weights (MoeSpec.shared_gate)",
    "moe_router_topk": "experts per token: routed compute, activations and dispatched bytes (MoeSpec.topk)",
    "moe_grouped_gemm": "the experts' GEMM kernels' time, measured by pipemesh profile",
    "moe_token_dispatcher_type": "the dispatch's traffic: all-to-all or all-gather (MoeSpec.dispatcher; flex as all-to-all)",
    "moe_expert_capacity_factor": "with padding to capacity, the experts' computed rows (MoeSpec.capacity_factor)",
    "moe_pad_expert_input_to_capacity": "every expert computes its capacity (MoeSpec.pad_to_capacity)",
    "moe_router_load_balancing_type": "the router's balancing loss, part of the router's time (measured by pipemesh profile)",
    "moe_router_dtype": "the router's logits and probabilities kept in fp32 (MoeSpec.router_fp32)",
    "moe_permute_fusion": "the token permutation's kernel time, measured by pipemesh profile",
    "moe_router_fusion": "the router's kernel time, measured by pipemesh profile",
    # measured by pipemesh profile (analytic costs count FLOPs and bytes, which these do not change)
    "masked_softmax_fusion": "kernel time, measured by pipemesh profile (the layer is built with the command's flags)",
    "bias_gelu_fusion": "kernel time (profile) and, with the local spec's SwiGLU/GeLU, the bytes kept "
                        "(ModelSpec.bias_activation_fusion)",
    "bias_swiglu_fusion": "kernel time (profile) and the bytes the local SwiGLU keeps (ModelSpec.bias_activation_fusion)",
    "bias_dropout_fusion": "kernel time, measured by pipemesh profile",
    "apply_rope_fusion": "kernel time, measured by pipemesh profile",
    "gradient_accumulation_fusion": "kernel time, measured by pipemesh profile",
    "no_persist_layer_norm": "kernel time, measured by pipemesh profile",
    "disable_jit_fuser": "kernel time, measured by pipemesh profile",
    "gradient_reduce_div_fusion": "kernel time, measured by pipemesh profile",
    "use_te_activation_func": "kernel time, measured by pipemesh profile",
    "use_transformer_engine_op_fuser": "kernel time, measured by pipemesh profile",
    "fused_residual_rmsnorm": "kernel time, measured by pipemesh profile",
    "cross_entropy_fusion_impl": "kernel time, measured by pipemesh profile",
    # the data loader (pipemesh profile times the command's own loader; 0 without a profile)
    "data_path": "the data loader's time per micro-batch (pipemesh profile)",
    "train_data_path": "the data loader's time per micro-batch (pipemesh profile)",
    "valid_data_path": "the data loader's time per micro-batch (pipemesh profile)",
    "test_data_path": "the data loader's time per micro-batch (pipemesh profile)",
    "data_args_path": "the data loader's time per micro-batch (pipemesh profile)",
    "per_split_data_args_path": "the data loader's time per micro-batch (pipemesh profile)",
    "mock_data": "the data loader's time per micro-batch (pipemesh profile)",
    "split": "the data loader's time per micro-batch (pipemesh profile)",
    "num_workers": "the data loader's time per micro-batch (pipemesh profile)",
    "dataloader_type": "the data loader's time per micro-batch (pipemesh profile)",
    "mmap_bin_files": "the data loader's time per micro-batch (pipemesh profile)",
    "reset_position_ids": "the data loader's time per micro-batch (pipemesh profile)",
    "reset_attention_mask": "the data loader's time per micro-batch (pipemesh profile)",
    "eod_mask_loss": "the data loader's time per micro-batch (pipemesh profile)",
    "create_attention_mask_in_dataloader": "the data loader's time per micro-batch (pipemesh profile)",
    "dataloader_fast_cache_load": "the data loader's time per micro-batch (pipemesh profile)",
    "dataloader_defer_npy_index_mmap": "the data loader's time per micro-batch (pipemesh profile)",
    "dataloader_inter_document_masking": "the data loader's time per micro-batch (pipemesh profile)",
    "data_cache_path": "the data loader's time per micro-batch (pipemesh profile)",
    "per_dataset_sequences_path": "the data loader's time per micro-batch (pipemesh profile)",
    "num_dataset_builder_threads": "the data loader's time per micro-batch (pipemesh profile)",
}

NOT_PRICED = {
    # attention and layer variants
    "kv_channels": "attention width a x kv-channels instead of h: attention compute, weights and activations",
    "add_qkv_bias": "QKV biases: (h + 2 x key/value width) parameters per layer",
    "qk_layernorm": "norms of the queries and keys: small extra activations and compute per layer",
    "qk_l2_norm": "L2 norms of the queries and keys: small extra activations per layer",
    "attention_output_gate": "a gate projection per attention: h x h weights, its compute and activations",
    "softmax_type": "another softmax: attention's kernel time",
    "window_size": "sliding-window attention: less attention compute and memory than full attention",
    "window_attn_skip_freq": "which layers use sliding-window attention",
    "squared_relu": "another activation: the MLP's saved activations",
    "quick_geglu": "a gated MLP (fc1 doubles, as with --swiglu)",
    "openai_gelu": "another GeLU kernel: kernel time",
    "attention_backend": "Transformer Engine's attention kernel (priced as flash attention: unfused keeps s x s scores)",
    "flash_attention_version": "the flash-attention kernel's time",
    "use_kitchen_attention": "another attention implementation: kernel time and memory",
    "kitchen_attention_backend": "another attention implementation: kernel time and memory",
    "attention_softmax_in_fp32": "the local spec's attention scores kept in fp32: twice their bytes",
    "apply_query_key_layer_scaling": "attention scores in fp32 (Megatron sets --attention-softmax-in-fp32)",
    "fp32_residual_connection": "residual stream in fp32: more activation bytes",
    "mlp_chunks_for_training": "the MLP run in sequence chunks: less transient memory",
    "distribute_saved_activations": "full recomputation's saved inputs split over TP: less memory",
    "spec": "a custom layer spec: the costs are those of Megatron's GPT layer",
    "mtp_num_layers": "multi-token prediction: extra layers and output layers on the last stage",
    "mtp_loss_scaling_factor": "multi-token prediction's loss weight (with --mtp-num-layers)",
    "mtp_use_repeated_layer": "multi-token prediction's layers (with --mtp-num-layers)",
    "mtp_detach_heads": "multi-token prediction's gradients (with --mtp-num-layers)",
    "mtp_standalone": "multi-token prediction in a stage of its own",
    "mtp_hybrid_override_pattern": "multi-token prediction's layer pattern",
    "mtp_hsm": "multi-token prediction's heads",
    **{dest: "hyper-connections' setting (with --enable-mhc-connections)" for dest in (
        "mhc_init_gating_factor", "mhc_num_residual_streams", "mhc_recompute_layer_num", "mhc_sinkhorn_iterations")},
    "add_position_embedding": "legacy models' position embedding (GPTModel reads --position-embedding-type)",
    # mixture-of-experts settings the costs leave out
    "expert_tensor_parallel_num_weight_shards": "expert weight sharding",
    "moe_shared_expert_overlap": "shared experts overlapped with the token dispatch",
    "moe_expert_rank_capacity_factor": "tokens dropped above each expert rank's capacity",
    "moe_token_drop_policy": "which tokens are dropped",
    "moe_layer_recompute": "MoE layers recomputed: less memory, more compute",
    "moe_router_score_function": "the router's score",
    "moe_router_pre_softmax": "the router's score",
    "moe_router_topk_scaling_factor": "the router's score",
    "moe_router_num_groups": "group-limited routing",
    "moe_router_group_topk": "group-limited routing",
    "moe_router_enable_expert_bias": "the router's expert bias",
    "moe_router_bias_update_rate": "the router's expert bias",
    "moe_router_quantile_balancing_ema": "the router's balancing",
    "moe_router_force_load_balancing": "random routing",
    "moe_router_force_biased": "random routing bias",
    "moe_router_padding_for_quantization": "routing padded for quantized GEMMs",
    "moe_router_padding_for_fp8": "routing padded for FP8 GEMMs",
    "moe_input_jitter_eps": "router input noise",
    "moe_enable_deepep": "the DeepEP dispatcher",
    "moe_flex_dispatcher_backend": "the flex dispatcher's backend",
    "moe_flex_dispatcher_num_sms": "SMs given to the dispatcher",
    "moe_deepep_num_sms": "SMs given to DeepEP",
    "moe_hybridep_num_sms": "SMs given to HybridEP",
    "moe_hybridep_num_blocks_permute": "HybridEP's kernels",
    "moe_hybridep_num_blocks_unpermute": "HybridEP's kernels",
    "moe_hybridep_num_sms_preprocessing": "HybridEP's kernels",
    "moe_hybridep_pad_uneven_dispatch_inputs": "HybridEP's padding",
    "moe_permute_fusion_into_hybridep": "HybridEP's kernels",
    "moe_ncclep_static_shape": "the NCCL-EP dispatcher's buffers",
    "moe_ncclep_zero_copy": "the NCCL-EP dispatcher's buffers",
    "moe_apply_probs_on_input": "where routing probabilities apply",
    "moe_latent_size": "latent projections around the experts",
    "moe_mlp_glu_interleave_size": "the experts' GLU layout",
    "moe_shared_expert_glu_interleave_size": "the shared experts' GLU layout",
    "use_grouped_gemm_for_shared_expert": "the shared experts' GEMM kernel",
    "use_grouped_gemm_for_dense_mlp": "the dense MLP's GEMM kernel",
    "moe_single_grouped_weight": "how expert weights are stored",
    "moe_single_grouped_bias": "how expert biases are stored",
    "moe_enable_routing_replay": "routing replay",
    "moe_per_layer_logging": "per-layer MoE losses logged",
    "moe_pad_experts_for_cuda_graph_inference": "inference padding",
    "moe_paged_stash": "routed-expert activations in a paged stash",
    "moe_paged_stash_page_size": "the paged stash",
    "moe_paged_stash_buffer_size_factor_cuda": "the paged stash",
    "moe_paged_stash_buffer_size_factor_cpu": "the paged stash",
    "moe_use_upcycling": "upcycling a dense checkpoint into experts",
    "moe_upcycling_granularity": "upcycling granularity",
    "use_fused_weighted_squared_relu": "the experts' activation kernel",
    "overlap_moe_expert_parallel_comm": "the expert all-to-all overlapped with another micro-batch's compute",
    "delay_wgrad_compute": "weight gradients delayed to overlap communication",
    "overlap_dispatch_backward_with_experts_wgrad": "the experts' weight gradients delayed",
    "ep_overlap_early_attn_memory_release": "attention memory released early with EP overlap",
    "high_priority_a2a_comm_stream": "the all-to-all's stream priority",
    "moe_combine_bwd_dtype": "the expert combine's backward precision",
    "moe_dispatch_fwd_dtype": "the expert dispatch's forward precision",
    "moe_use_grouped_tensor": "how expert weights are stored",
    # precision
    "fp8_wgrad": "weight gradients in 16-bit instead of FP8: slower backward GEMMs",
    "fp8_param_gather": "parameters gathered in FP8: half the gather's bytes, FP8 weights in memory",
    "fp8_output_proj": "the output layer in FP8",
    "fp8_quantizer_factory": "a custom FP8 quantizer",
    "first_last_layers_bf16": "the first and last layers in 16-bit instead of FP8",
    "num_layers_at_start_in_bf16": "layers in 16-bit instead of FP8 (with --first-last-layers-bf16)",
    "num_layers_at_end_in_bf16": "layers in 16-bit instead of FP8 (with --first-last-layers-bf16)",
    "keep_fp8_transpose_cache": "FP8 weight transposes kept: more memory",
    "te_precision_config_file": "per-module precision",
    "reuse_grad_buf_for_mxfp8_param_ag": "MXFP8 parameter gather buffers",
    "accumulate_allreduce_grads_in_fp32": "gradient accumulation in fp32",
    "fp16_lm_cross_entropy": "the loss's logits in 16-bit: less last-stage memory",
    "cross_entropy_loss_fusion": "the fused loss keeps no fp32 copy of the logits: less last-stage memory",
    "deterministic_mode": "deterministic kernels: slower compute",
    "disable_bf16_reduced_precision_matmul": "full-precision bf16 matmul reductions: slower GEMMs",
    "batch_invariant_mode": "batch-invariant kernels: slower compute",
    "batch_invariant_backend": "batch-invariant kernels' backend (with --batch-invariant-mode)",
    "logit_dtype": "the logits' dtype: the last stage's memory",
    "enable_mhc_connections": "several residual streams (hyper-connections): more activations and compute",
    # the optimizer
    "optimizer": "another optimizer's state and step (priced as Adam's: 12 bytes of state per parameter)",
    "use_precision_aware_optimizer": "optimizer state in lower precision: less memory per parameter",
    "main_grads_dtype": "main gradients' bytes",
    "main_params_dtype": "main parameters' bytes",
    "exp_avg_dtype": "Adam's first moment's bytes",
    "exp_avg_sq_dtype": "Adam's second moment's bytes",
    "optimizer_cpu_offload": "the optimizer step on the host: device memory and host-link traffic",
    "optimizer_offload_fraction": "the share of the optimizer on the host",
    "optimizer_cuda_graph": "the optimizer step in a CUDA graph",
    "use_torch_optimizer_for_cpu_offload": "the host optimizer's implementation",
    "overlap_cpu_optimizer_d2h_h2d": "the host optimizer's copies overlapped",
    "pin_cpu_grads": "the host optimizer's gradient buffers",
    "pin_cpu_params": "the host optimizer's parameter buffers",
    "muon_momentum": "Muon's step (with --optimizer muon)",
    "muon_split_qkv": "Muon's step (with --optimizer muon)",
    "muon_nesterov": "Muon's step (with --optimizer muon)",
    "muon_scale_mode": "Muon's step (with --optimizer muon)",
    "muon_fp32_matmul_prec": "Muon's step (with --optimizer muon)",
    "muon_coefficient_type": "Muon's step (with --optimizer muon)",
    "muon_num_ns_steps": "Muon's Newton-Schulz iterations (with --optimizer muon)",
    "muon_tp_mode": "Muon's step under TP (with --optimizer muon)",
    "muon_extra_scale_factor": "Muon's step (with --optimizer muon)",
    "muon_scalar_optimizer": "Muon's step (with --optimizer muon)",
    "qk_clip": "query/key weight clipping after the step",
    "muon_use_syrk": "Muon's step (with --optimizer muon)",
    # data-parallel communication
    "num_distributed_optimizer_instances": "the distributed optimizer sharded within instances, all-reduced across "
                                           "them: more state per rank, another collective",
    "overlap_param_gather_with_optimizer_step": "the first chunk's parameter gather overlapped with the optimizer step",
    "align_grad_reduce": "each pipeline rank reduces its chunk without aligning with the others (the rows model "
                         "Megatron's aligned default)",
    "align_param_gather": "each pipeline rank gathers its chunk without aligning with the others (the rows model "
                          "Megatron's aligned default)",
    "ddp_num_buckets": "the gradient buckets' count (the rows use Megatron's default bucket size)",
    "ddp_bucket_size": "the gradient buckets' size (the rows use Megatron's default)",
    "ddp_pad_buckets_for_high_nccl_busbw": "gradient buckets padded for NCCL's bandwidth",
    "ddp_reduce_scatter_with_fp32_accumulation": "reduce-scatter accumulated in fp32",
    "ddp_param_name_patterns_for_fp32_local_accumulation": "some gradients accumulated in fp32",
    "use_megatron_fsdp": "Megatron-FSDP: parameters and gradients sharded, gathered per layer",
    "data_parallel_sharding_strategy": "Megatron-FSDP's sharding level (with --use-megatron-fsdp)",
    "outer_dp_sharding_strategy": "Megatron-FSDP's outer sharding (with --use-megatron-fsdp)",
    "megatron_fsdp_main_params_dtype": "Megatron-FSDP's main parameters' bytes",
    "megatron_fsdp_main_grads_dtype": "Megatron-FSDP's main gradients' bytes",
    "megatron_fsdp_grad_comm_dtype": "Megatron-FSDP's gradient communication bytes",
    "megatron_fsdp_enable_fine_grained_param_gather": "Megatron-FSDP's parameter gathers",
    "megatron_fsdp_max_pool_double_buffer": "Megatron-FSDP's buffers",
    "fsdp_db_use_persist_buf_on_alloc_fail": "Megatron-FSDP's buffers",
    "fsdp_double_buffer": "Megatron-FSDP's buffers",
    "fsdp_manual_registration": "Megatron-FSDP's buffer registration",
    "enable_full_sharding_in_hsdp": "hybrid sharding",
    "suggested_communication_unit_size": "Megatron-FSDP's communication unit",
    "use_torch_fsdp2": "PyTorch FSDP2: parameters and gradients sharded, gathered per layer",
    "torch_fsdp2_reshard_after_forward": "FSDP2 keeps gathered parameters after the forward",
    "nccl_ub": "NCCL user buffers: collectives' speed",
    "disable_symmetric_registration": "NCCL symmetric memory",
    "create_all_gather_group": "a separate all-gather communicator",
    "use_sharp": "in-network reductions",
    "sharp_enabled_group": "in-network reductions",
    "nccl_communicator_config_path": "NCCL's tuning",
    "high_priority_stream_groups": "communication streams' priority",
    "ddp_average_in_collective": "gradients averaged inside the collective instead of scaled before it",
    "megatron_fsdp_version": "Megatron-FSDP's implementation (with --use-megatron-fsdp)",
    "use_tp_pp_dp_mapping": "the tp-pp-dp rank order: which links data-parallel and pipeline traffic cross",
    "use_layer_wise_param_layout": "the distributed optimizer's parameter layout",
    # tensor / context parallel communication
    "tp_comm_overlap": "TP communication overlapped with GEMMs (the rows price it exposed, an upper bound)",
    "tp_comm_overlap_cfg": "how --tp-comm-overlap overlaps",
    "tp_comm_bulk_wgrad": "how --tp-comm-overlap overlaps",
    "tp_comm_bulk_dgrad": "how --tp-comm-overlap overlaps",
    "tp_comm_overlap_ag": "how --tp-comm-overlap overlaps",
    "tp_comm_overlap_rs": "how --tp-comm-overlap overlaps",
    "tp_comm_overlap_rs_dgrad": "how --tp-comm-overlap overlaps",
    "tp_comm_split_ag": "how --tp-comm-overlap overlaps",
    "tp_comm_split_rs": "how --tp-comm-overlap overlaps",
    "tp_comm_bootstrap_backend": "how --tp-comm-overlap starts",
    "symmetric_ar_type": "symmetric-memory all-reduces",
    "tensor_parallel_num_weight_shards": "weights sharded beyond TP",
    "gtp_remat_opt_in_modules": "weights sharded beyond TP, gathered again in the backward",
    "gtp_remat_nccl_ub": "weights sharded beyond TP: NCCL user buffers",
    "gtp_expert_remat_nccl_ub": "expert weights sharded beyond TP: NCCL user buffers",
    "gtp_remat_reduce_scatter_with_fp32_accumulation": "weights sharded beyond TP: fp32 reduce-scatter",
    "hierarchical_context_parallel_sizes": "hierarchical context parallelism's exchange",
    "hybrid_context_parallel": "context-parallel balancing of packed sequences",
    "max_seqlen_per_dp_cp_rank": "packed sequences per rank",
    # pipeline
    "defer_embedding_wgrad_compute": "the output layer's weight gradients deferred into the pipeline flush",
    "wgrad_deferral_limit": "micro-batches whose output-layer weight gradients are deferred",
    "overlap_p2p_comm_warmup_flush": "pipeline transfers overlapped in warm-up and flush",
    "use_ring_exchange_p2p": "another pipeline transfer kernel",
    "pipeline_model_parallel_comm_backend": "the pipeline transfers' library",
    # memory and host
    "cpu_offloading_num_layers": "activations of that many layers offloaded to the host",
    "cpu_offloading_retain_pinned_cpu_buffers": "offloading's pinned buffers kept",
    "min_offloaded_tensor_size": "which tensors fine-grained offloading moves",
    "delay_offload_until_cuda_graph": "when fine-grained offloading copies",
    "delta_offload_bytes_across_pp_ranks": "fine-grained offloading's bytes per pipeline rank",
    "fine_grained_offloading_max_inflight_offloads": "fine-grained offloading's copies in flight",
    "empty_unused_memory_level": "the allocator's cache emptied every iteration: slower iterations",
    # CUDA graphs and launch
    "cuda_graph_impl": "CUDA graphs: less launch overhead",
    "enable_cuda_graph": "CUDA graphs: less launch overhead",
    "external_cuda_graph": "CUDA graphs: less launch overhead",
    "cuda_graph_warmup_steps": "CUDA graphs' warm-up",
    "cuda_graph_modules": "which modules CUDA graphs capture",
    "cuda_graph_scope_deprecated": "which modules CUDA graphs capture",
    # the batch
    "rampup_batch_size": "the global batch grows during training (the rows price the final one)",
    "step_batch_size_schedule": "the global batch changes during training (the rows price the final one)",
    "decrease_batch_size_if_needed": "the global batch may shrink",
    "sft": "supervised fine-tuning data: variable-length sequences",
    "fake_process_group": "process groups that communicate nothing (a benchmarking aid)",
    # PipeMesh's run-time planner (the rows plan for pipemesh plan's own cluster flags)
    "pipemesh_plan": "a saved plan's groups and levers (the user row re-plans its groups)",
    "pipemesh_activation_placement": "the runtime's memory levers (the rows choose them from --host-memory-gb)",
    "pipemesh_memory_budget_gb": "the runtime's memory budget (the rows plan for the cluster's device memory)",
    "pipemesh_host_memory_gb": "the runtime's host memory (the rows use --host-memory-gb)",
    "pipemesh_sharding": "ZeRO-2/3 levels of PipeMesh's chunks: weight and gradient memory, their gathers",
    "pipemesh_shard_scope": "where PipeMesh's shards live (the node or the data-parallel group)",
    "pipemesh_recv_lookahead": "how far ahead PipeMesh posts receives",
    # experimental attention variants' sub-flags (the variant itself is refused)
    **{dest: "only with --experimental-attention-variant" for dest in (
        "dsa_indexer_n_heads", "dsa_indexer_head_dim", "dsa_indexer_topk", "dsa_indexer_topk_freq",
        "dsa_indexer_skip_topk_offset", "dsa_indexer_loss_coeff", "dsa_indexer_use_sparse_loss", "dsa_kernel_backend",
        "dsa_indexer_rope_interleaved", "dsa_indexer_rotate_activation", "dsa_indexer_scoring_relu",
        "dsa_indexer_k_norm_epsilon", "dsa_indexer_k_norm_fp32", "linear_conv_kernel_dim", "linear_key_head_dim",
        "linear_value_head_dim", "linear_num_key_heads", "linear_num_value_heads", "linear_attention_freq",
        "gdp_cutedsl_kernel", "gdp_num_chunk_states_to_recompute", "gdp_num_householder")},
    # multi-latent attention's sub-flags (MLA itself is refused)
    **{dest: "only with --multi-latent-attention" for dest in (
        "q_lora_rank", "kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim", "rotary_scaling_factor",
        "mscale", "mscale_all_dim", "cache_mla_latents", "mla_down_proj_fusion")},
    # hybrid (Mamba) models' sub-flags (hybrid models are refused)
    **{dest: "only in a hybrid (Mamba) model" for dest in (
        "mamba_state_dim", "mamba_head_dim", "mamba_num_groups", "mamba_num_heads", "use_mamba_mem_eff_path",
        "mamba_training_ssm_states_dtype", "mamba_inference_conv_states_dtype", "mamba_inference_ssm_states_dtype")},
    "fp4_recipe": "FP4's recipe (with --fp4-format)",
    "fp4_quantizer_factory": "FP4's quantizer (with --fp4-format)",
    "fp4_param_gather": "parameters gathered in FP4 (with --fp4-format)",
    "logits_save_dir": "distillation logits written every iteration",
}

REFUSED = {
    "multi_latent_attention": "multi-latent attention's projections and cache are not priced: the rows would be those "
                              "of multi-head attention",
    "experimental_attention_variant": "this attention variant's compute and memory are not priced: the rows would be "
                                      "those of softmax attention",
    "is_hybrid_model": "Mamba layers are not priced: the rows would be those of transformer layers",
    "hybrid_layer_pattern": "Mamba layers are not priced: the rows would be those of transformer layers",
    "hybrid_override_pattern": "Mamba layers are not priced: the rows would be those of transformer layers",
    "heterogeneous_layers_config_path": "layers of different shapes are not priced: the rows assume identical layers",
    "heterogeneous_layers_config_encoded_json": "layers of different shapes are not priced: the rows assume "
                                                "identical layers",
    "fp4": "FP4 GEMM rates are not in the device table: the rows would be priced at 16-bit",
}

NO_COST = {
    "run length and exit": "train_iters train_samples exit_interval exit_duration_in_mins exit_signal_handler "
                           "exit_signal exit_signal_handler_for_dataloader exit_signal_handler_for_training "
                           "iterations_to_skip skip_train",
    "learning rate and weight decay": "lr lr_decay_iters lr_decay_samples lr_decay_style lr_warmup_fraction "
                                      "lr_warmup_init lr_warmup_iters lr_warmup_samples lr_wsd_decay_iters "
                                      "lr_wsd_decay_samples lr_wsd_decay_style min_lr decoupled_lr decoupled_min_lr "
                                      "override_opt_param_scheduler start_weight_decay end_weight_decay "
                                      "use_checkpoint_opt_param_scheduler warmup weight_decay_incr_style weight_decay "
                                      "apply_wd_to_qk_layernorm no_weight_decay_cond_type freeze_all_layers",
    "optimizer numerics": "moe_aux_loss_coeff moe_z_loss_coeff adam_beta1 adam_beta2 adam_eps sgd_momentum lion_beta1 lion_beta2 qk_clip_alpha "
                          "qk_clip_threshold",
    "loss scaling": "loss_scale initial_loss_scale min_loss_scale loss_scale_window hysteresis",
    "numerics of the same work": "init_method_std embedding_init_method_std init_method_xavier_uniform "
                                 "layernorm_epsilon layernorm_zero_centered_gamma glu_linear_offset "
                                 "activation_func_clamp_value rotary_interleaved rotary_base rotary_percent "
                                 "rotary_seq_len_interpolation_factor use_rope_scaling rope_scaling_factor rope_type "
                                 "no_rope_freq mrope_section yarn_original_max_position_embeddings yarn_beta_fast "
                                 "yarn_beta_slow yarn_correction_range_round_to_int apply_residual_connection_post_"
                                 "layernorm calculate_per_token_loss clone_scatter_output_in_embedding use_mup "
                                 "mup_width_mult mup_base_hidden_size mup_embedding_mult mup_output_mult "
                                 "mup_base_head_dim mup_attn_scale_power fp8_margin fp8_interval fp8_amax_history_len "
                                 "fp8_amax_compute_algo",
    "seeds and initialization": "seed te_rng_tracker inference_rng_tracker data_parallel_random_init "
                                "perform_initialization use_cpu_initialization init_model_with_meta_device",
    "checks between iterations": "check_for_nan_in_loss_and_grad check_for_large_grads "
                                 "check_weight_hash_across_dp_replicas_interval gpu_sniff_test_interval "
                                 "train_sync_interval check_for_spiky_loss rerun_mode error_injection_rate "
                                 "error_injection_type result_rejected_tracker_filename manual_gc manual_gc_interval "
                                 "manual_gc_eval",
    "evaluation cadence": "eval_interval eval_iters eval_global_batch_size eval_micro_batch_size full_validation "
                          "multiple_validation_sets validation_set_names start_eval_at_iter test_mode",
    "checkpointing": "save load save_interval save_retain_interval no_save_optim no_save_rng no_load_optim "
                     "no_load_rng finetune pretrained_checkpoint ckpt_step use_checkpoint_args "
                     "use_mp_args_from_checkpoint_args use_tokenizer_model_from_checkpoint_args exit_on_missing_"
                     "checkpoint use_dist_ckpt_deprecated dist_ckpt_format_deprecated ckpt_format auto_detect_ckpt_"
                     "format ckpt_convert_format ckpt_convert_save ckpt_convert_update_legacy_dist_opt_format "
                     "ckpt_fully_parallel_save_deprecated ckpt_fully_parallel_save ckpt_fully_parallel_load "
                     "ckpt_fully_parallel_save_process_group ckpt_fully_parallel_load_process_group "
                     "ckpt_fully_parallel_load_exchange_algo ckpt_assume_constant_structure dist_ckpt_strictness "
                     "dist_ckpt_workers dist_ckpt_save_pre_mcore_014 dist_ckpt_optim_fully_reshardable "
                     "distrib_optim_fully_reshardable_mem_efficient load_main_params_from_ckpt async_save "
                     "async_strategy async_ckpt_cpu_priority async_ckpt_io_priority async_ckpt_use_cpu_shm "
                     "use_persistent_ckpt_worker non_persistent_save_interval non_persistent_ckpt_type "
                     "non_persistent_global_ckpt_dir non_persistent_local_ckpt_dir non_persistent_local_ckpt_algo "
                     "ckpt_load_validate_sharding_integrity strict_fsdp_dtensor_load override_ckpt_iteration "
                     "replication replication_jump replication_factor verify_integrity stream_ckpt_dequant "
                     "save_activations_interval save_dgrads_interval save_params_interval save_wgrads_interval "
                     "save_tokens_per_expert_interval ckpt_drop_redundant_extra_state "
                     "ckpt_fully_parallel_load_per_rank_objects ckpt_pg_tensors_cache_create ckpt_pg_tensors_cache_path "
                     "save_tokenizer_assets",
    "logging": "log_interval log_params_norm log_num_zeros_in_grad log_throughput log_progress timing_log_level "
               "timing_log_option barrier_with_L1_time log_timers_to_tensorboard log_validation_ppl_to_tensorboard "
               "log_memory_to_tensorboard log_world_size_to_tensorboard log_loss_scale_to_tensorboard "
               "log_max_attention_logit log_device_memory_used log_memory_interval log_energy logging_level "
               "tensorboard_dir tensorboard_log_interval tensorboard_queue_size wandb_project wandb_exp_name "
               "wandb_save_dir wandb_entity config_logger_dir moe_routing_trace_path "
               "moe_routing_trace_capture_hidden_states moe_routing_trace_capture_logits moe_routing_trace_dump_weights "
               "moe_routing_trace_max_training_iters enable_one_logger one_logger_project one_logger_run_name "
               "one_logger_async app_tag_run_name app_tag_run_version dump_param_to_param_group_map "
               "run_workload_inspector_server otel_enabled otel_service_name otel_span_groups log_straggler disable_straggler_on_startup straggler_ctrlr_port "
               "straggler_minmax_count",
    "profiling (a profiled iteration is slower; the rows price the steady state)":
        "profile use_pytorch_profiler profile_step_start profile_step_end profile_ranks record_shapes nvtx_ranges "
        "record_memory_history memory_snapshot_path pytorch_profiler_collect_shapes pytorch_profiler_collect_callstack "
        "pytorch_profiler_collect_chakra",
    "processes and fault tolerance": "local_rank lazy_mpu_init distributed_timeout_minutes "
                                     "distributed_timeout_seconds_after_init use_gloo_process_groups adlr_autoresume "
                                     "adlr_autoresume_interval flight_recorder_dump_path flight_recorder_trace_buffer_size "
                                     "flight_recorder_dump_on_timeout flight_recorder_include_stack_trace "
                                     "flight_recorder_include_only_active flight_recorder_extra_dump_on_exec "
                                     "enable_ft_package calc_ft_timeouts ft_num_warmup_iters inprocess_restart "
                                     "inprocess_max_iterations inprocess_monitor_thread_interval "
                                     "inprocess_monitor_process_interval inprocess_progress_watchdog_interval "
                                     "inprocess_heartbeat_interval inprocess_soft_timeout inprocess_hard_timeout "
                                     "inprocess_heartbeat_timeout inprocess_barrier_timeout "
                                     "inprocess_completion_timeout inprocess_last_call_wait "
                                     "inprocess_termination_grace_time inprocess_granularity "
                                     "inprocess_active_world_size inprocess_empty_cuda_cache fault_injector_ranks "
                                     "fault_injector_num_ranks fault_injector_mtti_seconds fault_injector_seed "
                                     "fault_injector_fault_types fault_injector_fault_probabilities "
                                     "fault_injector_fault_delay fault_injector_delay_start_iteration "
                                     "fault_injector_offset_seconds enable_msc disable_msc_deprecated",
    "deprecated or read by no GPT layer": "batch_size use_flash_attn deprecated_use_mcore_models model_parallel_size "
                                          "onnx_safe bert_binary_head decoder_num_layers decoder_seq_length "
                                          "relative_attention_num_buckets relative_attention_max_distance sample_rate "
                                          "mask_prob short_seq_prob enable_experimental yaml_cfg",
    "the data's content": "mid_level_dataset_surplus allow_ambiguous_pad_tokens object_storage_cache_path "
                          "phase_transition_iterations fim_data fim_rate fim_spm_rate fim_split_sample "
                          "fim_fragment_rate fim_no_prefix fim_prefix_token fim_middle_token fim_suffix_token "
                          "fim_pad_token fim_eod_token sft_tokenizer_prompt_format",
    "the tokenizer's behaviour (not its size)": "vocab_extra_ids metadata_path special_tokens tiktoken_pattern "
                                                "tiktoken_num_special_tokens tokenizer_sentencepiece_legacy "
                                                "tokenizer_sentencepiece_ignore_extra_whitespaces "
                                                "tokenizer_hf_no_use_fast tokenizer_hf_no_include_special_tokens "
                                                "trust_remote_code null_tokenizer_eod_id null_tokenizer_pad_id "
                                                "chat_template use_gigatoken",
    "inference only": "flash_decode inference_cuda_graph_scope inference_fuse_tp_communication "
                      "inference_disable_triton_nvls_kernels inference_grouped_gemm_backend "
                      "inference_moe_disable_fused_quant_kernels inference_moe_token_dispatcher_type "
                      "nccl_all_reduce_for_prefill mlp_chunks_for_prefill inference_batch_times_seqlen_threshold "
                      "inference_max_requests inference_max_seq_length inference_dynamic_batching "
                      "inference_dynamic_batching_buffer_size_gb inference_dynamic_batching_paused_buffer_size_gb "
                      "inference_dynamic_batching_block_size inference_dynamic_batching_max_requests "
                      "inference_dynamic_batching_max_tokens inference_dynamic_batching_num_cuda_graphs "
                      "inference_dynamic_batching_track_paused_request_events "
                      "inference_dynamic_batching_track_generated_token_events "
                      "inference_dynamic_batching_enable_prefix_caching "
                      "inference_dynamic_batching_prefix_caching_eviction_policy "
                      "inference_dynamic_batching_prefix_caching_coordinator_policy "
                      "inference_dynamic_batching_prefix_caching_routing_alpha "
                      "inference_dynamic_batching_prefix_caching_mamba_gb inference_dynamic_batching_unified_memory_level "
                      "inference_dynamic_batching_cuda_graph_mixed_prefill_count "
                      "inference_dynamic_batching_cuda_graph_sizing_distribution "
                      "inference_dynamic_batching_mamba_memory_ratio inference_dynamic_batching_sampling_backend "
                      "inference_dynamic_batching_logprobs_mode inference_dynamic_batching_async_sched_mode "
                      "inference_cuda_graph_max_tokens inference_cuda_graph_all_prefills inference_coordinator_port "
                      "inference_disable_ep_consensus inference_logging_step_interval inference_wandb_logging "
                      "inference_text_gen_server_logging inference_use_synchronous_zmq_collectives inference_shards "
                      "decode_only_cuda_graphs enable_chunked_prefill max_tokens_to_oom num_speculative_tokens "
                      "offset_sampling_seed_by_dp_rank use_legacy_static_engine output_bert_embeddings "
                      "bert_embedder_type",
    "reinforcement learning (not pretraining)": "perform_rl_step grpo_group_size grpo_prompts_per_step "
                                                "grpo_iterations grpo_clamp_eps_lower grpo_clamp_eps_upper "
                                                "grpo_kl_beta grpo_entropy_term_weight "
                                                "grpo_filter_groups_with_same_reward langrl_env_config "
                                                "rl_offload_optimizer_during_inference "
                                                "rl_offload_inference_model_weights_when_idle "
                                                "rl_inference_logprobs_is_correction "
                                                "rl_importance_sampling_truncation_coef rl_prompts_per_eval "
                                                "rl_use_sequence_packing rl_sequence_packing_algo "
                                                "rl_sequence_packing_max_sequences_per_bin rl_training_cuda_graphs "
                                                "rl_inference_tensor_model_parallel_size "
                                                "rl_inference_pipeline_model_parallel_size "
                                                "rl_inference_expert_model_parallel_size "
                                                "rl_inference_expert_tensor_model_parallel_size "
                                                "rl_inference_model_unified_memory_level rl_partial_rollouts "
                                                "rl_generation_lag rl_default_temperature rl_default_top_p "
                                                "rl_default_top_k rl_skip_bos_token rl_kv_cache_management_mode "
                                                "rl_persist_cuda_graphs rl_profile rl_profile_dir "
                                                "rl_verify_model_weights_swap rl_inference_parsers refit_method "
                                                "rl_consumption_granularity rl_submission_granularity "
                                                "rl_durable_rollout_bank rl_max_inflight_requests rl_rollout_bank_dir "
                                                "rl_rollout_bank_max_bytes",
    "other models' training (vision, retrieval, distillation)": "num_classes img_h img_w num_channels patch_dim "
                                                                 "classes_fraction data_per_class_fraction "
                                                                 "data_sharding head_lr_mult vision_pretraining "
                                                                 "vision_pretraining_type vision_backbone_type "
                                                                 "swin_backbone_type mask_type mask_factor "
                                                                 "iter_per_epoch dino_local_img_size "
                                                                 "dino_local_crops_number dino_head_hidden_size "
                                                                 "dino_bottleneck_size dino_freeze_last_layer "
                                                                 "dino_norm_last_layer dino_warmup_teacher_temp "
                                                                 "dino_teacher_temp dino_warmup_teacher_temp_epochs "
                                                                 "ict_head_size biencoder_projection_dim "
                                                                 "biencoder_shared_query_context_model ict_load "
                                                                 "bert_load titles_data_path query_in_block_prob "
                                                                 "use_one_sent_docs evidence_data_path "
                                                                 "retriever_report_topk_accuracies "
                                                                 "retriever_score_scaling block_data_path "
                                                                 "embedding_path indexer_batch_size "
                                                                 "indexer_log_interval logits_load_dir "
                                                                 "logits_load_decode_threads logits_load_ignore_errors "
                                                                 "logits_load_kd_loss_alpha "
                                                                 "logits_load_msc_prefetch_depth "
                                                                 "logits_load_prefetch_factor logits_save_dtype "
                                                                 "logits_save_top_k logits_save_top_p "
                                                                 "logits_save_top_p_min_k",
    "PipeMesh's run-time planner inputs and reports (pipemesh plan takes the cluster from its own flags)":
        "pipemesh_device_tflops pipemesh_mfu pipemesh_dp_gbps pipemesh_p2p_gbps pipemesh_host_link_gbps "
        "pipemesh_profile pipemesh_measure_iters pipemesh_measure_memory pipemesh_print_schedule "
        "pipemesh_ranks_per_node",
}
