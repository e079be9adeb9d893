"""Reusable harness for multi-rank Megatron tests (CPU/gloo or GPU/NCCL).

Two halves:

**Launcher** (runs in the pytest process):

* :func:`run_worker` runs ``module:function(**kwargs)`` on every rank under
  ``torchrun --nproc-per-node N --standalone`` with a timeout and returns the per-rank return values
  (pickled through ``torch.save``; tensors allowed), raising :class:`WorkerError` with the tail of
  the output when a rank fails or the run times out.
* :func:`run_torchrun` runs an arbitrary script/module under torchrun and returns the completed
  process (stdout/stderr merged in ``.stdout``) — used for end-to-end entry-point tests.

**Worker helpers** (run inside each rank):

* :func:`init_parallel` — CPU compatibility layer (when there is no CUDA), process group (gloo or
  NCCL), Megatron parallel state (tp=1, pp=P, vp=V, dp=D).
* :class:`TinyGPT` — the tiny deterministic model description; :func:`build_model` builds one
  ``GPTModel`` per virtual chunk (local spec, fp32, dropout 0, untied embeddings) and sets every
  parameter from a generator seeded by its *global* name, so every PP/VP layout holds identical
  weights; optional Megatron DDP wrapping (``wrap_ddp=True``) with the hooks ``train()`` installs.
* :func:`make_data_iterators` — one iterator per chunk, each yielding the same deterministic
  micro-batches (``tokens, labels, loss_mask, attention_mask, position_ids``); each data-parallel
  replica gets its own micro-batches, so a missing or early gradient reduction shows.
* :func:`forward_step_func` — Megatron-GPT-style ``(data_iterator, model) -> (output, loss_func)``.
* :func:`run_schedule` — calls a megatron-style forward-backward function and returns the losses
  (last stage) and every parameter's gradient (``main_grad`` under DDP) keyed by a global name that
  is stable across PP layouts (``decoder.layers.<global layer index>.…``); :func:`merge_replicas`
  puts the ranks' results together, one merged result per data-parallel replica.

Example (see ``tests/runtime``/``tests/integration`` for real uses)::

    def worker(pp, vp):
        h.init_parallel(pp=pp, vp=vp)
        spec = h.TinyGPT()
        model = h.build_model(spec)
        out = h.run_schedule(get_forward_backward_func(), model, spec, num_microbatches=4)
        return out                      # one result per rank

    results = h.run_worker("tests.some_test_module:worker", nproc=2, kwargs={"pp": 2, "vp": 2})
"""
from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import json
import os
import re
import subprocess
import sys
import tempfile
import zlib
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence

REPO_ROOT = Path(__file__).resolve().parents[1]
_RESULT_DIR_ENV = "PIPEMESH_HARNESS_RESULT_DIR"


# ==================================================================================================
# Launcher side
# ==================================================================================================
class WorkerError(RuntimeError):
    """A torchrun worker failed or timed out; the message carries the output tail."""


#: Lines by which a rank that died natively says why (torchrun's summary only gives the signal).
_NATIVE_FAULT = re.compile(r"Fatal Python error|terminate called|double free|corrupt|malloc\(\)|free\(\)|"
                           r"Segmentation fault|EnforceNotMet")


def failure_excerpt(out: str, tail: int = 8000) -> str:
    """``out``'s lines that name a native fault with the Python stack after each (they are often far from the
    end, which the other ranks' tracebacks fill), then the last ``tail`` characters."""
    lines = out.splitlines()
    keep = []
    for i, line in enumerate(lines):
        if _NATIVE_FAULT.search(line):
            keep.extend(lines[i:i + 12])
    head = ("native fault:\n" + "\n".join(keep[:120]) + "\n...\n") if keep else ""
    return head + out[-tail:]


def _env(extra: Optional[Dict[str, str]] = None) -> Dict[str, str]:
    env = dict(os.environ)
    path = [str(REPO_ROOT)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env["PYTHONPATH"] = os.pathsep.join(path)
    env.setdefault("OMP_NUM_THREADS", "1")
    env.setdefault("PYTHONWARNINGS", "ignore")
    env.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    # A rank killed by a native fault (SIGSEGV, glibc's abort on heap corruption) prints every thread's Python stack.
    env.setdefault("PYTHONFAULTHANDLER", "1")
    if extra:
        env.update(extra)
    return env


def torchrun_cmd(nproc: int, torchrun_args: Sequence[str] = ()) -> List[str]:
    """``python -m torch.distributed.run`` with a free rendezvous port on localhost."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
            *torchrun_args]


def run_torchrun(
    target: Sequence[str],
    nproc: int,
    timeout: float = 120.0,
    env: Optional[Dict[str, str]] = None,
    cwd: Optional[str] = None,
    torchrun_args: Sequence[str] = (),
) -> subprocess.CompletedProcess:
    """Run ``torchrun ... <target...>`` (``target`` = ``[script, args...]`` or ``["-m", mod, ...]``).

    Returns the CompletedProcess with stdout and stderr merged into ``.stdout``.  Raises
    :class:`WorkerError` on timeout (never leaves ranks running: torchrun and every rank are killed).
    ``torchrun_args`` go to torchrun itself (e.g. ``--monitor-interval 10``).
    """
    cmd = torchrun_cmd(nproc, torchrun_args) + list(target)
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=_env(env),
        cwd=cwd or str(REPO_ROOT),
        start_new_session=True,
    )
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _kill_tree(proc.pid)
        out, _ = proc.communicate()
        raise WorkerError(f"timed out after {timeout}s: {' '.join(cmd)}\n{(out or '')[-6000:]}")
    return subprocess.CompletedProcess(cmd, proc.returncode, out, "")


def run_torchrun_nodes(target: Sequence[str], nnodes: int, nproc_per_node: int, timeout: float = 300.0,
                       env: Optional[Dict[str, str]] = None) -> subprocess.CompletedProcess:
    """``nnodes`` torchrun launches of ``nproc_per_node`` ranks each on 127.0.0.1 with a static rendezvous, as
    ``nnodes`` machines would start them (each rank sees its node's LOCAL_WORLD_SIZE). Returns one
    CompletedProcess: the first non-zero return code (else 0) and every launch's output, node by node.
    Raises :class:`WorkerError` on timeout (every launch and rank killed)."""
    import socket
    import tempfile
    import time

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    cmds = [[sys.executable, "-m", "torch.distributed.run", f"--nnodes={nnodes}", f"--node-rank={node}",
             "--master-addr=127.0.0.1", f"--master-port={port}", f"--nproc-per-node={nproc_per_node}", *target]
            for node in range(nnodes)]
    logs = [tempfile.TemporaryFile(mode="w+") for _ in cmds]  # files, not pipes: no launch blocks on a full pipe
    procs = [subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, text=True, env=_env(env), cwd=str(REPO_ROOT),
                              start_new_session=True) for cmd, log in zip(cmds, logs)]
    deadline, timed_out = time.monotonic() + timeout, False
    try:
        for proc in procs:
            proc.wait(timeout=max(deadline - time.monotonic(), 0.1))
    except subprocess.TimeoutExpired:
        timed_out = True
        for proc in procs:
            _kill_tree(proc.pid)
            proc.wait()
    outputs = []
    for log in logs:
        log.seek(0)
        outputs.append(log.read())
        log.close()
    out = "".join(outputs)
    if timed_out:
        raise WorkerError(f"timed out after {timeout}s: {' '.join(cmds[0])}\n{out[-6000:]}")
    code = next((proc.returncode for proc in procs if proc.returncode), 0)
    return subprocess.CompletedProcess(cmds[0], code, out, "")


def _descendants(pid: int) -> List[int]:
    """Every process below ``pid`` (Linux /proc; [] elsewhere)."""
    children: Dict[int, List[int]] = {}
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else ():
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat", encoding="utf-8") as fh:
                    ppid = int(fh.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def _kill_tree(pid: int) -> None:
    """SIGKILL torchrun and its ranks. The ranks run in sessions of their own (torch elastic starts them
    with start_new_session), so killing torchrun's process group alone would leave them running, holding
    the output pipe open."""
    import signal

    for victim in [pid] + _descendants(pid):
        try:
            os.kill(victim, signal.SIGKILL)
        except ProcessLookupError:
            pass


def run_worker(
    func: str,
    nproc: int,
    kwargs: Optional[Dict[str, Any]] = None,
    timeout: float = 120.0,
    env: Optional[Dict[str, str]] = None,
    torchrun_args: Sequence[str] = (),
) -> List[Any]:
    """Run ``"package.module:function"`` or ``"/path/to/file.py:function"`` with ``**kwargs`` on
    ``nproc`` ranks; return the per-rank results.

    ``kwargs`` must be JSON-serialisable.  Each rank's return value is saved with ``torch.save``
    and loaded here, so it may contain tensors; the list is indexed by global rank.
    """
    import torch

    with tempfile.TemporaryDirectory(prefix="pipemesh-harness-") as tmp:
        extra = {_RESULT_DIR_ENV: tmp}
        extra.update(env or {})
        target = [str(Path(__file__).resolve()), "--call", func, "--kwargs", json.dumps(kwargs or {})]
        cp = run_torchrun(target, nproc, timeout=timeout, env=extra, torchrun_args=torchrun_args)
        if cp.returncode != 0:
            raise WorkerError(f"{func} failed with exit code {cp.returncode}:\n{failure_excerpt(cp.stdout)}")
        results = []
        for rank in range(nproc):
            path = Path(tmp) / f"rank{rank}.pt"
            if not path.exists():
                raise WorkerError(f"rank {rank} returned no result:\n{cp.stdout[-8000:]}")
            results.append(torch.load(path, weights_only=False))
        return results


def _worker_main(argv: Sequence[str]) -> None:
    import argparse

    import torch

    parser = argparse.ArgumentParser()
    parser.add_argument("--call", required=True)
    parser.add_argument("--kwargs", default="{}")
    ns = parser.parse_args(argv)
    sys.path.insert(0, str(REPO_ROOT))
    module_name, _, func_name = ns.call.rpartition(":")
    if module_name.endswith(".py"):  # a file path: import it under a private name
        spec = importlib.util.spec_from_file_location("_pipemesh_harness_target", module_name)
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module
        spec.loader.exec_module(module)
    else:
        module = importlib.import_module(module_name)
    result = getattr(module, func_name)(**json.loads(ns.kwargs))
    out_dir = os.environ.get(_RESULT_DIR_ENV)
    if out_dir:
        rank = int(os.environ.get("RANK", "0"))
        torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


# ==================================================================================================
# Worker side
# ==================================================================================================
def init_parallel(pp: int = 1, vp: Optional[int] = None, tp: int = 1, dp: Optional[int] = None,
                  seed: int = 1234, ep: int = 1) -> None:
    """Initialise torch.distributed (from torchrun's env) and Megatron's parallel state.

    On a machine without CUDA this applies the CPU compatibility layer and uses gloo.
    ``dp`` (if given) is checked against ``world_size / (tp * pp)``.
    """
    from megatron_pipemesh.integration.bootstrap import prepare_megatron_import

    prepare_megatron_import()
    import torch

    from megatron_pipemesh.integration.cpu_compat import apply_cpu_compat

    cpu = apply_cpu_compat()
    import torch.distributed as dist

    if not dist.is_initialized():
        if not cpu:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group(backend="gloo" if cpu else "nccl")
    world = dist.get_world_size()
    if world % (tp * pp):
        raise ValueError(f"world size {world} not divisible by tp*pp={tp * pp}")
    if dp is not None and dp != world // (tp * pp):
        raise ValueError(f"dp={dp} but world size {world} / (tp*pp) = {world // (tp * pp)}")

    from megatron.core import parallel_state, tensor_parallel

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vp,
        expert_model_parallel_size=ep,
    )
    torch.manual_seed(seed)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)


@dataclasses.dataclass
class TinyGPT:
    """Tiny GPT used by equivalence tests (fp32, dropout 0, no fused kernels)."""

    num_layers: int = 4
    hidden_size: int = 64
    num_attention_heads: int = 4
    seq_length: int = 32
    vocab_size: int = 128
    micro_batch_size: int = 2
    seed: int = 1234
    #: ``learned_absolute`` or ``rope``
    position_embedding_type: str = "learned_absolute"
    #: fraction of loss_mask entries that are 1 (the rest 0), to exercise masking
    loss_mask_density: float = 0.9
    #: extra TransformerConfig fields (e.g. {"overlap_p2p_comm": True, "batch_p2p_comm": False})
    config_overrides: Dict[str, Any] = dataclasses.field(default_factory=dict)
    #: mixture-of-experts layers with this many experts (0: dense), top-``moe_topk`` routing, the all-to-all dispatcher
    num_experts: int = 0
    moe_topk: int = 2


def _device():
    import torch

    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def make_config(spec: TinyGPT, **overrides):
    """TransformerConfig for ``spec`` matching the current parallel state.

    With VP > 1 and PP == 2 the stock interleaved schedule needs ``overlap_p2p_comm=True`` (both
    directions go to the same peer), which in turn forbids ``batch_p2p_comm``; this is the default
    here, as it is on Megatron's command line.
    """
    import torch
    from megatron.core import parallel_state
    from megatron.core.transformer import TransformerConfig

    pp = parallel_state.get_pipeline_model_parallel_world_size()
    vp = parallel_state.get_virtual_pipeline_model_parallel_world_size()
    kw = dict(
        num_layers=spec.num_layers,
        hidden_size=spec.hidden_size,
        num_attention_heads=spec.num_attention_heads,
        ffn_hidden_size=4 * spec.hidden_size,
        use_cpu_initialization=True,
        params_dtype=torch.float32,
        pipeline_dtype=torch.float32,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        bias_activation_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        bias_dropout_fusion=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,  # build_model turns it on with DDP (it needs DDP's main_grad)
        tensor_model_parallel_size=parallel_state.get_tensor_model_parallel_world_size(),
        pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vp,
        sequence_parallel=False,
    )
    if vp is not None and vp > 1 and pp > 1:
        kw.update(overlap_p2p_comm=True, batch_p2p_comm=False)
    if spec.num_experts:
        kw.update(num_moe_experts=spec.num_experts, moe_router_topk=spec.moe_topk, moe_token_dispatcher_type="alltoall",
                  moe_router_load_balancing_type="aux_loss", moe_aux_loss_coeff=0.01, add_bias_linear=False,
                  expert_model_parallel_size=parallel_state.get_expert_model_parallel_world_size())
    kw.update(spec.config_overrides)
    kw.update(overrides)
    return TransformerConfig(**kw)


def global_param_name(chunk, local_name: str) -> str:
    """Name of ``local_name`` in ``chunk`` as it would be in the unsplit (PP=1) model.

    ``decoder.layers.<i>.`` is rewritten to the layer's global index (``layer_number - 1``), an expert's local index
    to its global one (this expert-parallel rank's experts follow the earlier ranks'); the DDP ``module.`` prefix is
    dropped.  Embedding / final norm / output layer names are already global.
    """
    from megatron.core import parallel_state
    from megatron.core.utils import get_attr_wrapped_model

    name = local_name
    while name.startswith("module."):
        name = name[len("module."):]
    m = re.match(r"decoder\.layers\.(\d+)\.(.*)", name)
    if m:
        layers = get_attr_wrapped_model(chunk, "decoder").layers
        global_idx = layers[int(m.group(1))].layer_number - 1
        name = f"decoder.layers.{global_idx}.{m.group(2)}"
    expert = re.match(r"(.*\.local_experts\.)(\d+)\.(.*)", name)
    if expert:
        config = get_attr_wrapped_model(chunk, "config")
        local = config.num_moe_experts // parallel_state.get_expert_model_parallel_world_size()
        index = parallel_state.get_expert_model_parallel_rank() * local + int(expert.group(2))
        name = f"{expert.group(1)}{index}.{expert.group(3)}"
    return name


def _init_value(name: str, shape, seed: int):
    import torch

    gen = torch.Generator().manual_seed((zlib.crc32(name.encode()) + 7919 * seed) % (2**63))
    noise = torch.randn(shape, generator=gen, dtype=torch.float32)
    if name.endswith("bias"):
        return 0.01 * noise
    if "norm" in name or name.endswith("layer_norm_weight"):
        return 1.0 + 0.05 * noise
    return 0.02 * noise


def build_model(spec: TinyGPT, wrap_ddp: bool = False, overlap_grad_reduce: bool = False,
                config=None, ddp_options: Optional[Dict[str, Any]] = None) -> List[Any]:
    """One ``GPTModel`` per virtual chunk on this rank, weights set from their global names.

    ``wrap_ddp``: wrap each chunk in Megatron's ``DistributedDataParallel`` (fp32 grad buffer,
    chunk 0 bucketed) and install ``no_sync_func`` / ``finalize_model_grads_func`` (and, with
    ``overlap_grad_reduce``, ``grad_sync_func``) on the config as ``train()`` does.
    ``ddp_options``: further ``DistributedDataParallelConfig`` fields (e.g. the distributed optimizer's
    ``use_distributed_optimizer``, ``overlap_param_gather``, ``align_param_gather``); with overlapped and
    aligned parameter gathers ``param_sync_func`` is installed as ``train()`` does (``training.py:3544``).
    """
    import torch
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    config = config if config is not None else make_config(spec)
    # Megatron's default with DDP: the fused wgrad accumulates into DDP's main_grad (CPU kernels: cpu_compat item 12);
    # without DDP there is no main_grad to accumulate into.
    config.gradient_accumulation_fusion = wrap_ddp
    vp = parallel_state.get_virtual_pipeline_model_parallel_world_size()
    n_chunks = vp if vp is not None else 1
    chunks = []
    for v in range(n_chunks):
        vp_stage = v if vp is not None else None
        pre = parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage)
        post = parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage)
        model = GPTModel(
            config=config,
            transformer_layer_spec=get_gpt_layer_local_spec(num_experts=spec.num_experts or None,
                                                            moe_grouped_gemm=False),
            vocab_size=spec.vocab_size,
            max_sequence_length=spec.seq_length,
            pre_process=pre,
            post_process=post,
            share_embeddings_and_output_weights=False,
            position_embedding_type=spec.position_embedding_type,
            vp_stage=vp_stage,
        )
        model.vp_stage = vp_stage
        with torch.no_grad():
            for name, p in model.named_parameters():
                p.copy_(_init_value(global_param_name(model, name), tuple(p.shape), spec.seed))
        model.to(_device())
        chunks.append(model)

    if wrap_ddp:
        from megatron.core.distributed import (
            DistributedDataParallel,
            DistributedDataParallelConfig,
            finalize_model_grads,
        )

        ddp_config = DistributedDataParallelConfig(**{
            "grad_reduce_in_fp32": True, "overlap_grad_reduce": overlap_grad_reduce,
            "use_distributed_optimizer": False, **(ddp_options or {})})
        chunks = [
            DistributedDataParallel(config=config, ddp_config=ddp_config, module=m,
                                    disable_bucketing=(i > 0))
            for i, m in enumerate(chunks)
        ]
        for m in chunks:
            m.vp_stage = getattr(m.module, "vp_stage", None)
        config.no_sync_func = [m.no_sync for m in chunks]
        if len(chunks) == 1:
            config.no_sync_func = config.no_sync_func[0]
        if overlap_grad_reduce:
            config.grad_sync_func = [m.start_grad_sync for m in chunks]
            if len(chunks) == 1:
                config.grad_sync_func = config.grad_sync_func[0]
        if ddp_config.overlap_param_gather and ddp_config.align_param_gather:
            config.param_sync_func = [m.start_param_sync for m in chunks]
            if len(chunks) == 1:
                config.param_sync_func = config.param_sync_func[0]
        config.finalize_model_grads_func = finalize_model_grads
    return chunks


def make_batch(spec: TinyGPT, microbatch: int, replica: int = 0) -> Dict[str, Any]:
    """Deterministic micro-batch ``microbatch`` of data-parallel replica ``replica`` (independent of the
    pipeline layout)."""
    import torch

    gen = torch.Generator().manual_seed(spec.seed * 100003 + microbatch + 1000003 * replica)
    b, s = spec.micro_batch_size, spec.seq_length
    text = torch.randint(0, spec.vocab_size, (b, s + 1), generator=gen)
    loss_mask = (torch.rand((b, s), generator=gen) < spec.loss_mask_density).float()
    loss_mask[:, 0] = 1.0  # never an all-zero micro-batch
    attention_mask = torch.tril(torch.ones((1, 1, s, s))) < 0.5  # True = masked, as GPTDataset
    dev = _device()
    return {
        "tokens": text[:, :-1].contiguous().to(dev),
        "labels": text[:, 1:].contiguous().to(dev),
        "loss_mask": loss_mask.to(dev),
        "attention_mask": attention_mask.to(dev),
        "position_ids": torch.arange(s).unsqueeze(0).expand(b, s).contiguous().to(dev),
    }


def make_data_iterators(spec: TinyGPT, num_microbatches: int, num_chunks: int,
                        replica: Optional[int] = None) -> List[Iterator]:
    """One iterator per chunk, each yielding micro-batches 0..num_microbatches-1 of ``replica`` in order
    (default: this rank's data-parallel rank, so replicas see different data as in training).

    Every schedule runs each chunk's forwards in increasing micro-batch order, so each chunk may
    simply consume its own iterator on every forward.
    """
    if replica is None:
        replica = _data_parallel_rank()
    return [iter([make_batch(spec, j, replica) for j in range(num_microbatches)]) for _ in range(num_chunks)]


def _data_parallel_rank() -> int:
    from megatron.core import parallel_state

    return parallel_state.get_data_parallel_rank() if parallel_state.model_parallel_is_initialized() else 0


def loss_func(loss_mask, output_tensor):
    """Megatron-GPT-style loss: (sum of masked token losses, #tokens, report).

    The report holds a *clone*: the schedule divides the returned loss in place.
    """
    import torch

    losses = output_tensor.view(-1).float()
    mask = loss_mask.view(-1).float()
    loss = torch.sum(losses * mask)
    num_tokens = mask.sum().clone().detach().to(torch.int)
    return loss, num_tokens, {"lm loss": torch.cat([loss.clone().detach().view(1),
                                                    num_tokens.view(1).float()])}


def forward_step_func(data_iterator, model):
    """``(data_iterator, model) -> (output_tensor, loss_func)`` like Megatron's GPT ``forward_step``."""
    import functools

    batch = next(data_iterator)
    output = model(batch["tokens"], batch["position_ids"], batch["attention_mask"],
                   labels=batch["labels"])
    return output, functools.partial(loss_func, batch["loss_mask"])


def _zero_grads(model: Sequence[Any]) -> None:
    for chunk in model:
        if hasattr(chunk, "zero_grad_buffer"):
            chunk.zero_grad_buffer()
        for p in chunk.parameters():
            p.grad = None


def collect_grads(model: Sequence[Any]) -> Dict[str, Any]:
    """Every parameter's gradient on this rank (``main_grad`` if present) by global name, on CPU."""
    grads = {}
    for chunk in model:
        for name, p in chunk.named_parameters():
            g = getattr(p, "main_grad", None)
            if g is None:
                g = p.grad
            gname = global_param_name(chunk, name)
            grads[gname] = None if g is None else g.detach().float().cpu().clone()
    return grads


def run_schedule(
    fb_func: Callable,
    model: Sequence[Any],
    spec: TinyGPT,
    num_microbatches: int,
    forward_only: bool = False,
    data_iterators: Optional[List[Iterator]] = None,
    zero_grads: bool = True,
    **extra_kwargs,
) -> Dict[str, Any]:
    """Run one forward-backward pass with ``fb_func`` (Megatron schedule signature).

    Returns ``{"losses": [[loss_sum, num_tokens] per micro-batch] (last stage; [] elsewhere),
    "grads": {global name: tensor or None}, "rank", "pp_rank"}``.
    """
    import torch
    from megatron.core import parallel_state

    model = list(model)
    if zero_grads:
        _zero_grads(model)
    if data_iterators is None:
        data_iterators = make_data_iterators(spec, num_microbatches, len(model))
    out = fb_func(
        forward_step_func=forward_step_func,
        data_iterator=data_iterators if len(model) > 1 else data_iterators[0],
        model=model if len(model) > 1 else model[0],
        num_microbatches=num_microbatches,
        seq_length=spec.seq_length,
        micro_batch_size=spec.micro_batch_size,
        forward_only=forward_only,
        **extra_kwargs,
    )
    losses = [[float(x) for x in d["lm loss"].detach().cpu().view(-1)] for d in out]
    return {
        "losses": losses,
        "grads": {} if forward_only else collect_grads(model),
        "rank": torch.distributed.get_rank(),
        "pp_rank": parallel_state.get_pipeline_model_parallel_rank(),
        "dp_rank": parallel_state.get_data_parallel_rank(),
    }


def merge_rank_results(results: Sequence[Dict[str, Any]]) -> Dict[str, Any]:
    """Merge the per-rank :func:`run_schedule` results of one data-parallel replica (its pipeline
    ranks) into the whole model's losses and gradients; several replicas: use :func:`merge_replicas`."""
    replicas = {r.get("dp_rank", 0) for r in results}
    if len(replicas) > 1:
        raise ValueError(f"results of data-parallel replicas {sorted(replicas)}: use merge_replicas")
    losses = [r["losses"] for r in results if r["losses"]]
    grads: Dict[str, Any] = {}
    for r in results:
        for k, v in r["grads"].items():
            if k in grads:
                raise ValueError(f"parameter {k} reported by two pipeline ranks of one replica")
            grads[k] = v
    return {"losses": losses[0] if losses else [], "grads": grads}


def merge_replicas(results: Sequence[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """One :func:`merge_rank_results` per data-parallel replica, in replica order."""
    replicas = sorted({r.get("dp_rank", 0) for r in results})
    return [merge_rank_results([r for r in results if r.get("dp_rank", 0) == k]) for k in replicas]


def max_rel_diff(a, b) -> float:
    """max |a-b| / max(max|b|, tiny) — a scale-aware relative difference for whole tensors."""

    denom = max(float(b.abs().max()), 1e-30)
    return float((a - b).abs().max()) / denom


def compare_grads(got: Dict[str, Any], ref: Dict[str, Any]) -> Dict[str, float]:
    """Per-parameter :func:`max_rel_diff`; raises if the name sets differ or a grad is missing."""
    if set(got) != set(ref):
        raise AssertionError(f"parameter sets differ: only in got {sorted(set(got) - set(ref))}, "
                             f"only in ref {sorted(set(ref) - set(got))}")
    out = {}
    for k in ref:
        if got[k] is None or ref[k] is None:
            raise AssertionError(f"missing gradient for {k}")
        out[k] = max_rel_diff(got[k], ref[k])
    return out


if __name__ == "__main__":
    _worker_main(sys.argv[1:])
