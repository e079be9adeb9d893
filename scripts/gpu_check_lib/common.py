"""What every gpu_check check shares: the one-process world, the tiny GPT models and their batches, the whole-model
weights every split holds, and how a check reports that it needs CUDA."""
from __future__ import annotations

import functools
import os
import sys
import tempfile
import zlib
from pathlib import Path
from typing import Optional

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

ENTRY = REPO / "scripts" / "gpu_check.py"
"""The command-line entry (checks that run a child process start it again)."""
TOLERANCE = 1e-5
"""Largest relative gradient/loss difference accepted against the whole-model reference (fp32)."""
NEEDS_CUDA = "skipped: needs CUDA"
"""How every CUDA-only check (or part of one) is reported on a machine, or a run, without CUDA: never a pass."""


def setup(cpu_only: bool):
    """World of one process (gloo on CPU, NCCL on GPU) and Megatron's parallel state (everything size 1)."""
    from megatron_pipemesh.integration.bootstrap import prepare_megatron_import

    prepare_megatron_import()
    import torch

    use_cuda = torch.cuda.is_available() and not cpu_only
    if not use_cuda:
        from megatron_pipemesh.integration.cpu_compat import apply_cpu_compat
        apply_cpu_compat()
    import torch.distributed as dist

    if use_cuda:
        torch.cuda.set_device(0)
        torch.backends.cuda.matmul.allow_tf32 = False  # exact fp32, for comparing against the reference
        torch.backends.cudnn.allow_tf32 = False
    store = tempfile.NamedTemporaryFile(prefix="pipemesh-gpu-check-", delete=False).name
    dist.init_process_group("nccl" if use_cuda else "gloo", init_method=f"file://{store}", rank=0, world_size=1)
    from megatron.core import parallel_state, tensor_parallel

    # No gloo side groups on GPU: the box may have no usable network interface, and nothing here needs them.
    parallel_state.initialize_model_parallel(create_gloo_process_groups=not use_cuda)
    torch.manual_seed(1234)
    tensor_parallel.model_parallel_cuda_manual_seed(1234)
    return torch.device("cuda", 0) if use_cuda else torch.device("cpu")


def make_config(num_layers: int, hidden: int = 64, heads: int = 4, **overrides):
    import torch
    from megatron.core.transformer import TransformerConfig

    kw = dict(num_layers=num_layers, hidden_size=hidden, num_attention_heads=heads, ffn_hidden_size=4 * hidden,
              use_cpu_initialization=True, params_dtype=torch.float32, pipeline_dtype=torch.float32,
              hidden_dropout=0.0, attention_dropout=0.0, bias_activation_fusion=False, masked_softmax_fusion=False,
              persist_layer_norm=False, bias_dropout_fusion=False, apply_rope_fusion=False,
              gradient_accumulation_fusion=False)
    kw.update(overrides)
    return TransformerConfig(**kw)


def make_gpt(config, device, vocab: int, seq: int, pre: bool, post: bool):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    model = GPTModel(config=config, transformer_layer_spec=get_gpt_layer_local_spec(), vocab_size=vocab,
                     max_sequence_length=seq, pre_process=pre, post_process=post,
                     share_embeddings_and_output_weights=False, position_embedding_type="learned_absolute")
    return model.to(device)


def _init_value(name: str, shape):
    import torch

    gen = torch.Generator().manual_seed(zlib.crc32(name.encode()))
    noise = torch.randn(shape, generator=gen)
    if name.endswith("bias"):
        return 0.01 * noise
    if "norm" in name:
        return 1.0 + 0.05 * noise
    return 0.02 * noise


def global_name(name: str, first_layer: int) -> str:
    if name.startswith("decoder.layers."):
        index, rest = name[len("decoder.layers."):].split(".", 1)
        return f"decoder.layers.{first_layer + int(index)}.{rest}"
    return name


def set_weights(model, first_layer: int) -> None:
    """Weights from the parameter's name in the whole model, so every split holds the same model."""
    import torch

    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(_init_value(global_name(name, first_layer), tuple(p.shape)))


def make_batches(count: int, mbs: int, seq: int, vocab: int, device, first: int = 0):
    """``count`` micro-batches, the j-th from seed 4321 + first + j (another ``first`` for each iteration)."""
    import torch

    batches = []
    for j in range(first, first + count):
        gen = torch.Generator().manual_seed(4321 + j)
        text = torch.randint(0, vocab, (mbs, seq + 1), generator=gen)
        mask = (torch.rand((mbs, seq), generator=gen) < 0.9).float()
        batches.append({"tokens": text[:, :-1].contiguous().to(device), "labels": text[:, 1:].contiguous().to(device),
                        "loss_mask": mask.to(device),
                        "attention_mask": (torch.tril(torch.ones((1, 1, seq, seq))) < 0.5).to(device),
                        "position_ids": torch.arange(seq).unsqueeze(0).expand(mbs, seq).contiguous().to(device)})
    return batches


def _loss_func(loss_mask, output):
    import torch

    loss = torch.sum(output.view(-1).float() * loss_mask.view(-1))
    tokens = loss_mask.sum().to(torch.int)
    return loss, tokens, {"lm loss": torch.cat([loss.clone().detach().view(1), tokens.view(1).float()])}


def forward_step(data_iterator, model):
    batch = next(data_iterator)
    output = model(batch["tokens"], batch["position_ids"], batch["attention_mask"], labels=batch["labels"])
    return output, functools.partial(_loss_func, batch["loss_mask"])


def raise_allocator_peak(device, nbytes: int = 1 << 30) -> int:
    """Allocate and free ``nbytes`` so the allocator's peak counter is above anything a check allocates; returns
    ``max_memory_allocated`` then. A meter that reset the peak counters would leave it lower afterwards."""
    import torch

    torch.empty(nbytes, dtype=torch.uint8, device=device)
    return torch.cuda.max_memory_allocated(device)


def cores() -> int:
    """CPU cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        return os.cpu_count() or 1


def rel_diff(a: float, b: float) -> float:
    """|a - b| relative to the reference ``b``."""
    return abs(a - b) / max(abs(b), 1e-30)


def needs_cuda(device, why: str) -> Optional[dict]:
    """The skip record of a CUDA-only check on CPU (``why``: what it needs CUDA for), else None."""
    return None if device.type == "cuda" else {"status": "skip", "reason": f"{NEEDS_CUDA} ({why})"}

