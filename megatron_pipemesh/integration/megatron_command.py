"""A user's ``pretrain_gpt.py`` command line, read by Megatron's own argument parser (``pipemesh plan --megatron-args``).

Every flag the command uses is parsed and validated as Megatron would at start-up (``add_megatron_arguments`` and
``validate_args`` of megatron-core, with PipeMesh's flags added), for the world size of the cluster being planned
for, without any process group or device: a flag Megatron does not know, or a combination it refuses, is an error
naming it before any planning starts. :func:`read_command` turns the validated namespace into what the planner
prices: the model, the layout (TP x PP x DP, V), the micro-batches, and the stock schedule and memory settings the
command runs today.
"""
from __future__ import annotations

import argparse
import ast
import contextlib
import functools
import io
import linecache
import os
import traceback
import warnings
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple, Union

from ..planning.costs import ModelSpec
from ..planning.flag_inventory import SetFlag
from ..planning.layout import LayoutError
from ..planning.memory import OFFLOAD_MODULES
from ..planning.specs import MoeSpec
from ..planning.stock import StockRecompute, StockSetting
from ..planning.stock_options import StockOffload
from .launcher import Launch, split_launch
from .vocabulary import Vocabulary, vocabulary


class CommandError(ValueError):
    """The user's command does not parse or validate; the message names the flag and how to fix it."""


def split_command(command: Union[str, Sequence[str]]) -> Tuple[List[str], List[str]]:
    """(launcher and program, the training script's flags) of ``command`` (a shell string or a list): the flags are
    what follows the program (``pretrain_gpt.py``, ``-m module`` or PipeMesh's entry point, after any launcher such
    as ``torchrun --nproc-per-node 8``), or, without a program, the command from its first flag on
    (:func:`.launcher.split_launch`)."""
    launch = split_launch(command)
    return list(launch.words), list(launch.flags)


def split_flags(command: Union[str, Sequence[str]]) -> List[str]:
    """The training script's flags of ``command`` (:func:`split_command`)."""
    return split_command(command)[1]


def megatron_parser() -> argparse.ArgumentParser:
    """Megatron's argument parser with PipeMesh's flags added, as ``pretrain_gpt.py`` builds it under ``install()``."""
    from .bootstrap import prepare_megatron_import
    from ..config import add_megatron_arguments as add_pipemesh_arguments

    prepare_megatron_import()
    # megatron-core's first import warns about every fused kernel it cannot find (Transformer Engine, Apex, absl):
    # reading a command runs none of them, and a user asking `pipemesh plan` would get twenty lines before the answer.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", category=UserWarning, module=r"megatron\.")
        from megatron.training import arguments

    return add_pipemesh_arguments(arguments.add_megatron_arguments(argparse.ArgumentParser(allow_abbrev=False)))


def option_aliases(flags: Sequence[str]) -> Dict[str, Tuple[str, ...]]:
    """Per flag of ``flags`` that Megatron's parser knows: every option string of its setting (the flags that set the
    same value, e.g. ``--num-layers-per-virtual-pipeline-stage`` and its spellings), so that rewriting a command drops
    them all."""
    return dict(_option_aliases(tuple(flags)))


@functools.lru_cache(maxsize=8)
def _option_aliases(flags: Tuple[str, ...]) -> Tuple[Tuple[str, Tuple[str, ...]], ...]:
    """:func:`option_aliases`, built once per set of flags (building Megatron's parser takes a while)."""
    parser = megatron_parser()
    by_option = {option: action for action in parser._actions for option in action.option_strings}
    out = {}
    for flag in flags:
        action = by_option.get(flag)
        if action is not None:
            same = [a for a in parser._actions if a.dest == action.dest]
            out[flag] = tuple(option for a in same for option in a.option_strings if option != flag)
    return tuple(out.items())


@contextlib.contextmanager
def _without_local_gpu(arguments):
    """Validate the command, not this machine: without CUDA here, megatron-core's validate_args would read the local
    GPU's architecture for TP > 1 or CP > 1 (``get_device_arch_version``, to demand CUDA_DEVICE_MAX_CONNECTIONS=1 of
    the launch environment before Blackwell) and its compute capability for ``--moe-grouped-gemm``
    (``torch.cuda.get_device_capability``, arguments.py:1338-1340), and fail. Where it plans, it answers as a
    Blackwell-or-later GPU, which has no such requirement; with CUDA the real answer stands."""
    import torch

    if torch.cuda.is_available():
        yield
        return
    real, capability = arguments.get_device_arch_version, torch.cuda.get_device_capability
    arguments.get_device_arch_version = lambda: 10
    torch.cuda.get_device_capability = lambda device=None: (10, 0)
    try:
        yield
    finally:
        arguments.get_device_arch_version, torch.cuda.get_device_capability = real, capability


def parse_megatron_command(flags: Sequence[str], world_size: int) -> argparse.Namespace:
    """Megatron's validated args for ``flags`` on ``world_size`` ranks (rank 0's view); CommandError otherwise."""
    return parse_command(flags, world_size)[0]


def changed_settings(parser: argparse.ArgumentParser, args: argparse.Namespace,
                     flags: Sequence[str]) -> Dict[str, SetFlag]:
    """dest -> its setting, for every argument ``flags`` parsed (before validation) into a value other than the
    parser's default, in the order of the parser's actions; each named by the option string the command used."""
    used = {word.split("=", 1)[0] for word in flags if word.startswith("-")}
    out: Dict[str, SetFlag] = {}
    for action in parser._actions:
        if action.dest in out or action.dest == "help" or not action.option_strings:
            continue
        value = getattr(args, action.dest, None)
        if value == action.default:
            continue
        option = next((o for o in action.option_strings if o in used), None)
        if option is None:
            continue  # another action of the same dest set it
        out[action.dest] = SetFlag(action.dest, option, value)
    return out


def parse_command(flags: Sequence[str], world_size: int) -> Tuple[argparse.Namespace, Dict[str, SetFlag]]:
    """(Megatron's validated args for ``flags`` on ``world_size`` ranks (rank 0's view), the settings the command
    changes from Megatron's defaults: :func:`changed_settings`); CommandError otherwise."""
    parser = megatron_parser()  # first: it prepares megatron's import
    from megatron.training import arguments

    try:
        with contextlib.redirect_stderr(io.StringIO()) as err:
            args, unknown = parser.parse_known_args(list(flags))
    except SystemExit:
        raise CommandError(f"Megatron's argument parser rejects the command: {err.getvalue().strip().splitlines()[-1]}")
    changed = changed_settings(parser, args, flags)
    named = [word for word in unknown if word.startswith("-")]
    if named or unknown:
        raise CommandError(f"--megatron-args: Megatron does not know {' '.join(named or unknown)} (megatron-core's "
                           "add_megatron_arguments and PipeMesh's flags were tried); fix or drop it")
    if getattr(args, "yaml_cfg", None):
        raise CommandError("--megatron-args with --yaml-cfg is not supported: pass the YAML's settings as flags")
    args.rank, args.world_size = 0, world_size
    args._is_global_batch_size_explicitly_specified = args.global_batch_size is not None
    try:
        with contextlib.redirect_stdout(io.StringIO()), warnings.catch_warnings(), _without_local_gpu(arguments):
            warnings.simplefilter("ignore")
            arguments.validate_args(args, {"tokenizer_type": "GPT2BPETokenizer"})
    except (AssertionError, ValueError, RuntimeError, TypeError) as error:
        raise CommandError(f"Megatron's validate_args rejects the command on {world_size} GPUs: "
                           f"{str(error) or failed_check(error)}") from error
    return args, changed


def failed_check(error: BaseException) -> str:
    """Where Megatron raised ``error`` when it carries no message (most of validate_args's checks are bare
    ``assert``s): ``file:line: assert <condition>`` of the last frame inside megatron, the condition read from its
    source (a check spread over several lines is joined into one); the exception's type where there is no source."""
    frames = [frame for frame in traceback.extract_tb(error.__traceback__)
              if f"{os.sep}megatron{os.sep}" in frame.filename]
    if not frames:
        return type(error).__name__
    frame = frames[-1]
    where = f"{os.path.basename(frame.filename)}:{frame.lineno}"
    statement = _statement_at(frame.filename, frame.lineno) or (frame.line or "").strip()
    return f"{where}: {statement}" if statement else f"{where}: {type(error).__name__}"


def _statement_at(filename: str, lineno: int) -> Optional[str]:
    """The source of the innermost ``assert`` spanning ``lineno`` in ``filename``, on one line (None if there is
    none or the file cannot be read)."""
    source = "".join(linecache.getlines(filename))
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return None
    checks = [node for node in ast.walk(tree)
              if isinstance(node, ast.Assert) and node.lineno <= lineno <= (node.end_lineno or node.lineno)]
    if not checks:
        return None
    check = max(checks, key=lambda node: node.lineno)
    condition = ast.get_source_segment(source, check.test) or ast.unparse(check.test)
    return "assert " + " ".join(condition.split())


@dataclass(frozen=True)
class UserCommand:
    """What a user's command runs, as the planner prices it."""

    flags: tuple
    """The command's flags as given."""
    launcher: tuple
    """What came before the flags: the launcher and the script (empty when only flags were given)."""
    model: ModelSpec
    """The GPT the command trains."""
    tp: int
    """Tensor-parallel size."""
    pp: int
    """Pipeline-parallel size."""
    dp: int
    """Data-parallel size."""
    microbatches: int
    """Micro-batches per iteration per data-parallel replica."""
    stock: StockSetting
    """The stock schedule and recomputation the command runs (its V, group size, recompute flags)."""
    pipemesh: bool
    """The command already runs ``--pipeline-schedule pipemesh``."""
    distributed_optimizer: bool
    """``--use-distributed-optimizer``."""
    sequence_parallel: bool
    """``--sequence-parallel``."""
    grad_reduce_in_bf16: bool
    """``--grad-reduce-in-bf16`` (only then may a recommendation reduce in bf16)."""
    global_batch_size: int
    """Sequences per iteration (``--global-batch-size``, as Megatron's validation sets it)."""
    world_size: int
    """GPUs the command was validated for."""
    args: object = None
    """Megatron's validated namespace (what the recommendations' flags are checked against)."""
    cp: int = 1
    """Context-parallel size."""
    ep: int = 1
    """Expert-parallel size."""
    etp: int = 1
    """Expert tensor-parallel size (Megatron's default: TP)."""
    cp_comm: str = "p2p"
    """How the context-parallel exchange runs (``--cp-comm-type``, as the costs price it)."""
    changed: Dict[str, SetFlag] = field(default_factory=dict)
    """The settings the command changes from Megatron's defaults (:func:`changed_settings`)."""
    not_priced_here: Dict[str, str] = field(default_factory=dict)
    """dest -> what it would change, for flags the inventory prices in general but not with this command's value
    (e.g. an offloading of modules the costs do not model)."""
    vocabulary: Optional[Vocabulary] = None
    """The vocabulary before padding and where its size came from."""
    launch: Optional[Launch] = None
    """The command split at its program (:func:`.launcher.split_launch`)."""

    @property
    def vpp(self) -> int:
        """Virtual stages per rank V (1: no interleaving)."""
        return self.stock.vpp


def _recompute(args) -> StockRecompute:
    granularity = getattr(args, "recompute_granularity", None) or "none"
    if granularity == "selective":
        modules = tuple(getattr(args, "recompute_modules", None) or ())
        return StockRecompute("selective", () if modules == ("core_attn",) else modules)
    if granularity == "full":
        return StockRecompute("full", method=args.recompute_method, num_layers=args.recompute_num_layers)
    return StockRecompute()


def _moe(args) -> Optional[MoeSpec]:
    """The command's mixture-of-experts layers (None: a dense GPT)."""
    experts = getattr(args, "num_experts", None)
    if not experts:
        return None
    freq = getattr(args, "moe_layer_freq", 1)
    if isinstance(freq, (list, tuple)):
        pattern = tuple(int(x) for x in freq)
    else:
        pattern = () if freq == 1 else tuple(1 if i % freq == 0 else 0 for i in range(args.num_layers))
    return MoeSpec(num_experts=experts, topk=args.moe_router_topk,
                   ffn_hidden_size=getattr(args, "moe_ffn_hidden_size", None),
                   shared_ffn=getattr(args, "moe_shared_expert_intermediate_size", None) or 0,
                   shared_gate=bool(getattr(args, "moe_shared_expert_gate", False)), pattern=pattern,
                   dispatcher=getattr(args, "moe_token_dispatcher_type", "alltoall") or "alltoall",
                   capacity_factor=getattr(args, "moe_expert_capacity_factor", None),
                   pad_to_capacity=bool(getattr(args, "moe_pad_expert_input_to_capacity", False)),
                   router_fp32=getattr(args, "moe_router_dtype", None) == "fp32")


def _offload(args, not_priced: Dict[str, str]) -> Optional[StockOffload]:
    """The command's fine-grained activation offloading as the costs price it (Megatron's attention modules), or
    None (off; other modules are named as not priced)."""
    if not getattr(args, "fine_grained_activation_offloading", False):
        return None
    modules = tuple(getattr(args, "offload_modules", None) or ())
    if set(modules) != set(OFFLOAD_MODULES):
        not_priced["offload_modules"] = (f"offloading {' '.join(modules) or 'no modules'}: the costs model "
                                         f"--offload-modules {' '.join(OFFLOAD_MODULES)} only (priced without offloading)")
        return None
    return StockOffload(float(getattr(args, "activation_offload_fraction", 1.0) or 1.0))


def _cp_comm(args, not_priced: Dict[str, str]) -> str:
    """The command's --cp-comm-type as the costs price it (:func:`.auto_plan.priced_cp_comm`), with a note where the
    command's types (one per layer, or a hierarchical one) are not what is priced."""
    from .auto_plan import priced_cp_comm

    kinds, priced = list(getattr(args, "cp_comm_type", None) or ["p2p"]), priced_cp_comm(args)
    if (args.context_parallel_size or 1) > 1 and set(kinds) != {priced}:
        not_priced["cp_comm_type"] = f"context-parallel exchange {' '.join(kinds)}: priced as {priced} for every layer"
    return priced


def read_command(command: Union[str, Sequence[str]], world_size: int,
                 dropout_mask_bytes: Optional[int] = 1) -> UserCommand:
    """Parse and validate ``command`` for ``world_size`` GPUs and describe what it runs (``dropout_mask_bytes``:
    CUDA keeps one byte per dropout mask element)."""
    from .auto_plan import layer_spec_fields, layer_split
    from .flags import microbatches_per_iteration

    launch = split_launch(command)
    launcher, flags = launch.words, launch.flags
    args, changed = parse_command(flags, world_size)
    pp, m = args.pipeline_model_parallel_size, microbatches_per_iteration(args)
    vpp = args.virtual_pipeline_model_parallel_size or 1
    cp = args.context_parallel_size or 1
    spec = layer_spec_fields(args)
    if cp > 1 and spec["layer_spec"] != "te":
        raise CommandError(f"--context-parallel-size {cp} with --transformer-impl local: megatron-core's local "
                           "attention asserts context_parallel_size == 1 (only Transformer Engine's attention runs "
                           "context parallelism); use --transformer-impl transformer_engine")
    if spec["fp8"] and spec["layer_spec"] != "te":
        raise CommandError(f"--fp8-format {args.fp8} with --transformer-impl local: FP8 runs through Transformer "
                           "Engine's linear layers; use --transformer-impl transformer_engine")
    etp = getattr(args, "expert_tensor_parallel_size", None) or args.tensor_model_parallel_size
    if getattr(args, "num_experts", None) and spec["linear_bias"] and etp != 1:
        raise CommandError(f"--num-experts with linear biases at expert tensor-parallel size {etp}: megatron-core's "
                           "TransformerConfig asserts ETP == 1 for MoE biases; give --disable-bias-linear or "
                           "--expert-tensor-parallel-size 1")
    try:
        split = layer_split(args)
        split.stage_layers(args.num_layers, pp, vpp)  # what Megatron would refuse or fail to build, named now
    except LayoutError as error:
        raise CommandError(f"--megatron-args: {error}") from error
    vocab = vocabulary(args)
    not_priced: Dict[str, str] = {}
    model = ModelSpec(num_layers=args.num_layers, hidden_size=args.hidden_size,
                      num_attention_heads=args.num_attention_heads, seq_length=args.seq_length,
                      micro_batch_size=args.micro_batch_size,
                      vocab_size=vocab.padded_for(args.tensor_model_parallel_size,
                                                  getattr(args, "make_vocab_size_divisible_by", 128) or 1,
                                                  bool(getattr(args, "pad_vocab_size", True))),
                      ffn_hidden_size=getattr(args, "ffn_hidden_size", None),
                      dtype_bytes=2 if (args.bf16 or args.fp16) else 4, dropout_mask_bytes=dropout_mask_bytes,
                      layer_split=split, moe=_moe(args), **spec)
    group = getattr(args, "microbatch_group_size_per_vp_stage", None)
    stock = StockSetting(pp, vpp, m, group if vpp > 1 and group != pp else None, _recompute(args),
                         bool(getattr(args, "grad_reduce_in_bf16", False)), offload=_offload(args, not_priced))
    return UserCommand(tuple(flags), tuple(launcher), model, args.tensor_model_parallel_size, pp, args.data_parallel_size,
                       m, stock, getattr(args, "pipeline_schedule", "default") == "pipemesh",
                       bool(args.use_distributed_optimizer), bool(args.sequence_parallel),
                       bool(getattr(args, "grad_reduce_in_bf16", False)), args.global_batch_size, world_size, args,
                       cp=cp, cp_comm=_cp_comm(args, not_priced), changed=changed, not_priced_here=not_priced,
                       ep=getattr(args, "expert_model_parallel_size", 1) or 1,
                       etp=etp,
                       vocabulary=vocab, launch=launch)
