"""``megatron_pipemesh.install()``: plug PipeMesh into a running Megatron without forking it.

Patches (each idempotent, each leaving ``--pipeline-schedule default`` runs untouched, each wrapper
taking ``*args, **kwargs`` and binding them to the wrapped function's own signature, so new keyword
arguments of a megatron-core patch release pass through):

1. ``megatron.training.arguments.parse_args``: chains an ``extra_args_provider`` that adds
   PipeMesh's flags (``parse_and_validate_args`` looks the function up at call time). With
   ``--yaml-cfg`` Megatron replaces the parsed flags by the YAML file's values; PipeMesh then reads
   its settings from the YAML's top-level keys (``pipeline_schedule: pipemesh``,
   ``forward_groups: [6, 2]``, ...; :func:`merge_yaml_settings`).
2. ``megatron.training.arguments.validate_args`` and, for ``--yaml-cfg``,
   ``megatron.training.yaml_arguments.validate_yaml`` (which replaces ``validate_args`` there): after
   Megatron's checks, validates PipeMesh's flags (exit 2 with one paragraph on every rank) and
   activates the PipeMesh schedule.
3. ``get_forward_backward_func`` in ``megatron.training.training`` (bound there at import, used by
   ``train()`` and ``evaluate()``), ``megatron.core.pipeline_parallel`` and its ``schedules``: return
   the PipeMesh schedule exactly where Megatron's rule returns its interleaved schedule (an explicit
   ``vp_size=None`` stays non-interleaved), else defer to Megatron's.
4. ``megatron.core.parallel_state.initialize_model_parallel``: also creates and warms up PipeMesh's
   per-link pipeline groups, with that call's timeout and NCCL options, when PipeMesh is active; with
   ``--pipemesh-shard-scope node`` checks that Megatron's distributed-optimizer instances are the nodes.
"""
from __future__ import annotations

import functools
import inspect
import itertools
import os
import warnings
from typing import Optional, Tuple

SUPPORTED = (0, 19)
"""The megatron-core release series PipeMesh is built and tested on (its patch releases share the schedule code)."""
TESTED = {"0.19.2": "the PyPI wheel megatron-core==0.19.2 (every test, CI)",
          "0.20.0": "Megatron-LM main of 2026-08-22 (d98e8a6), its own pretrain_gpt.py through --megatron-lm-script: "
                    "losses equal to its default schedule"}
"""megatron-core versions PipeMesh was run with, and how."""
_STATE = {"installed": False, "schedule": None, "args": None}


def _release(version: str) -> Tuple[int, ...]:
    """(major, minor, patch) of a version such as '0.20.0rc0' or '0.19.2+git' (missing parts are 0)."""
    numbers = []
    for part in version.split(".")[:3]:
        digits = "".join(itertools.takewhile(str.isdigit, part))
        if not digits:
            break
        numbers.append(int(digits))
    return tuple(numbers + [0] * (3 - len(numbers)))


def check_version(version: str) -> Optional[str]:
    """None for the supported series (0.19.x); a warning naming the tested versions for a newer one; RuntimeError
    with the reason for an older one, which lacks the schedule interface PipeMesh is called with."""
    series = _release(version)[:2]
    if series < SUPPORTED:
        raise RuntimeError(
            f"megatron_pipemesh needs megatron-core >= {SUPPORTED[0]}.{SUPPORTED[1]} but found {version}: older releases "
            "lack the schedule interface PipeMesh is called with (the p2p_communicator and pg_collection keywords of "
            "forward_backward_pipelining_with_interleaving, microbatch_group_size_per_vp_stage). Install a supported "
            "version, e.g. pip install --ignore-requires-python megatron-core==0.19.2")
    if series == SUPPORTED:
        return None
    tested = "; ".join(f"{v}: {how}" for v, how in TESTED.items())
    return (f"megatron_pipemesh: megatron-core {version} is newer than the supported {SUPPORTED[0]}.{SUPPORTED[1]}.x "
            f"(tested: {tested}); PipeMesh checks the schedule interface it relies on at the first call, and "
            "--pipeline-schedule default stays untouched")


def _check_version() -> str:
    from megatron.core import package_info

    version = package_info.__version__
    warning = check_version(version)
    if warning:
        warnings.warn(warning, stacklevel=3)
    return version


def reported_schedule():
    """The schedule whose statistics the training log reports: PipeMesh's, or the metered stock one."""
    return _STATE["schedule"] or _STATE.get("stock")


def _metered_stock(function):
    """Megatron's schedule wrapped by the activation meter (``--pipemesh-measure-memory`` under the stock
    schedule); one wrapper per function, so its statistics survive across iterations."""
    from ..runtime.call_meter import MeteredStockSchedule

    stock = _STATE.get("stock")
    if stock is None or stock.function is not function:
        stock = _STATE["stock"] = MeteredStockSchedule(function)
    return stock


def activate(settings) -> None:
    """Activate (or deactivate) PipeMesh from validated :class:`~.flags.PipeMeshArgs`."""
    from ..runtime import PipeMeshOptions, PipeMeshSchedule
    from .parallel_state import get_pipemesh_p2p_groups

    _STATE["args"] = settings
    if settings.ranks_per_node:  # node scope: Megatron's hierarchical distributed optimizer, with its fix
        from .hierarchical_distopt import start_grad_sync_once_per_iteration
        start_grad_sync_once_per_iteration()
    if not settings.enabled:
        _STATE["schedule"] = None
        return

    options = PipeMeshOptions(p2p_timeout_s=settings.timeout_s, measure_memory=settings.flags.measurement.measure_memory)

    def make_schedule(plan):
        return PipeMeshSchedule(plan, options, p2p_groups=get_pipemesh_p2p_groups)

    schedule = make_schedule(settings.plan)
    if settings.replan is not None:
        from .measured import MeasuredReplanner
        schedule = MeasuredReplanner(schedule, make_schedule, settings.plan, settings.replan)
    _STATE["schedule"] = schedule
    if settings.summary and os.environ.get("RANK", "0") == "0":
        print(settings.summary, flush=True)


def _bind(function, args, kwargs) -> Optional[inspect.BoundArguments]:
    """``args``/``kwargs`` bound to ``function``'s signature with defaults applied; None if they do not fit
    (the caller then calls ``function`` unchanged, which raises its own error)."""
    try:
        bound = inspect.signature(function).bind(*args, **kwargs)
    except (TypeError, ValueError):
        return None
    bound.apply_defaults()
    return bound


def routes_to_interleaved(arguments, parallel_state) -> bool:
    """Megatron 0.19's rule for choosing its interleaved schedule, from ``get_forward_backward_func``'s
    bound arguments: both sizes None means "read parallel_state"; otherwise the given values are used as
    they are, so an explicit ``vp_size=None`` is non-interleaved."""
    collection = arguments.get("schedule_pg_collection")
    if type(collection).__name__ == "MultiModuleProcessGroupCollection":
        return False
    pp, vp = arguments.get("pp_size"), arguments.get("vp_size")
    if pp is None and vp is None:
        pp = parallel_state.get_pipeline_model_parallel_world_size()
        vp = parallel_state.get_virtual_pipeline_model_parallel_world_size()
    return pp is not None and pp > 1 and vp is not None


def _pipemesh_actions(parser):
    from .flags import SCHEDULE_FLAG

    for group in parser._action_groups:
        if any(SCHEDULE_FLAG in action.option_strings for action in group._group_actions):
            return list(group._group_actions)
    return []


def _yaml_value(action, value):
    """A YAML value for a PipeMesh flag, converted as argparse would convert the command-line text."""
    if action.nargs in ("+", "*") and not isinstance(value, (list, tuple)):
        value = str(value).split()
    convert = (lambda v: action.type(str(v))) if action.type is not None else (lambda v: v)
    value = [convert(v) for v in value] if isinstance(value, (list, tuple)) else (
        convert(value) if value is not None else None)
    if action.choices is not None and value not in action.choices:
        raise ValueError(f"{value!r} is not one of {list(action.choices)}")
    return value


def merge_yaml_settings(args, parser, argv=None) -> None:
    """Give ``args`` (Megatron's namespace built from ``--yaml-cfg``) PipeMesh's settings: YAML keys named
    like the flags' destinations (``pipeline_schedule``, ``forward_groups``, ``pipemesh_recv_lookahead``,
    ...), else the value of the flag on the command line (Megatron ignores its own flags there, PipeMesh's
    are honoured), else the flag's default. A flag given on the command line with another value than the
    YAML's is an error."""
    from .flags import PipeMeshArgumentError

    cli, _ = parser.parse_known_args(argv)
    for action in _pipemesh_actions(parser):
        flag, on_cli = action.option_strings[0], getattr(cli, action.dest, action.default)
        if hasattr(args, action.dest):
            try:
                value = _yaml_value(action, getattr(args, action.dest))
            except Exception as error:  # argparse type functions raise several kinds
                raise PipeMeshArgumentError(f"--yaml-cfg {args.yaml_cfg}: key {action.dest} (flag {flag}) is invalid: "
                                            f"{error}") from error
            if on_cli != action.default and on_cli != value:
                raise PipeMeshArgumentError(
                    f"{flag} is given on the command line ({on_cli!r}) and as {action.dest}: {value!r} in --yaml-cfg "
                    f"{args.yaml_cfg}; keep one of them")
        else:
            value = on_cli
        setattr(args, action.dest, value)


def _activate_from(args) -> None:
    from .flags import PipeMeshArgumentError, apply_megatron_options, check_pipemesh_args, fail
    from .report import announce_plan

    try:
        settings = check_pipemesh_args(args)
        apply_megatron_options(args, settings)
        activate(settings)
    except PipeMeshArgumentError as error:
        fail(error)
    announce_plan(args, settings)


def wrap_parse_args(original):
    """``parse_args`` that chains PipeMesh's flags into ``extra_args_provider`` (and, with ``--yaml-cfg``,
    merges PipeMesh's settings into the YAML namespace); any other argument passes through."""
    from .flags import PipeMeshArgumentError, add_pipemesh_arguments, fail

    @functools.wraps(original)
    def parse_args(*args, **kwargs):
        bound = _bind(original, args, kwargs)
        if bound is None or "extra_args_provider" not in bound.arguments:
            return original(*args, **kwargs)
        caller_provider, parsers = bound.arguments["extra_args_provider"], []

        def provider(parser):
            parser = add_pipemesh_arguments(parser)
            parsers.append(parser)
            return caller_provider(parser) if caller_provider is not None else parser
        bound.arguments["extra_args_provider"] = provider
        result = original(*bound.args, **bound.kwargs)
        if getattr(result, "yaml_cfg", None) is not None and parsers:
            try:
                merge_yaml_settings(result, parsers[-1])
            except PipeMeshArgumentError as error:
                fail(error)
        return result
    return parse_args


def wrap_validator(original):
    """``validate_args`` / ``validate_yaml`` followed by PipeMesh's validation and activation (of the
    namespace the validator returns: ``validate_yaml`` returns a new, flattened one)."""
    @functools.wraps(original)
    def validate(args, *rest, **kwargs):
        result = original(args, *rest, **kwargs)
        _activate_from(result if result is not None else args)
        return result
    return validate


def wrap_getter(original, parallel_state):
    """``get_forward_backward_func`` returning the active PipeMesh schedule where Megatron's rule picks
    its interleaved schedule (:func:`routes_to_interleaved`); otherwise Megatron's answer."""
    @functools.wraps(original)
    def get_forward_backward_func(*args, **kwargs):
        schedule = _STATE["schedule"]
        if schedule is not None:
            bound = _bind(original, args, kwargs)
            if bound is not None and routes_to_interleaved(bound.arguments, parallel_state):
                return schedule
        function = original(*args, **kwargs)
        settings = _STATE["args"]
        if settings is not None and settings.flags.measurement.measure_memory:
            return _metered_stock(function)
        return function
    return get_forward_backward_func


def wrap_initialize(original):
    """``initialize_model_parallel`` that then checks the node scope's groups (all ranks agree on the node size,
    each distributed-optimizer instance is one node's data-parallel ranks; exit 2 naming the rank otherwise) and
    creates and warms up the per-link groups with the call's timeout, backend and NCCL options (when PipeMesh
    is active)."""
    @functools.wraps(original)
    def initialize_model_parallel(*args, **kwargs):
        result = original(*args, **kwargs)
        settings = _STATE["args"]
        if settings is not None and settings.ranks_per_node:
            from ..runtime.sharding import check_node_groups
            from .flags import fail
            try:
                check_node_groups(settings.ranks_per_node)
            except ValueError as error:
                fail(error)
        if _STATE["schedule"] is not None:
            from .parallel_state import create_pipemesh_groups, megatron_group_options
            bound = _bind(original, args, kwargs)
            create_pipemesh_groups(**(megatron_group_options(**bound.arguments) if bound is not None else {}))
        return result
    return initialize_model_parallel


def _registering(get_megatron_optimizer):
    """Megatron's optimizer factory, remembering what it builds (the mixed-sharding memory report counts its
    state: :func:`megatron_pipemesh.runtime.sharding.optimizer_state_bytes`)."""
    if getattr(get_megatron_optimizer, "_pipemesh_registering", False):
        return get_megatron_optimizer

    @functools.wraps(get_megatron_optimizer)
    def wrapped(*args, **kwargs):
        optimizer = get_megatron_optimizer(*args, **kwargs)
        from ..runtime.sharding import register_optimizer
        register_optimizer(optimizer)
        return optimizer

    wrapped._pipemesh_registering = True
    return wrapped


def install() -> None:
    """Patch Megatron's argument parsing and schedule selection (idempotent)."""
    if _STATE["installed"]:
        return
    from .bootstrap import prepare_megatron_import

    prepare_megatron_import()
    _check_version()
    from megatron.core import parallel_state
    from megatron.core import pipeline_parallel
    from megatron.core.pipeline_parallel import schedules
    from megatron.training import arguments, yaml_arguments

    from .report import patch_training_log

    arguments.parse_args = wrap_parse_args(arguments.parse_args)
    arguments.validate_args = wrap_validator(arguments.validate_args)
    yaml_arguments.validate_yaml = wrap_validator(yaml_arguments.validate_yaml)  # --yaml-cfg bypasses validate_args
    getter = wrap_getter(schedules.get_forward_backward_func, parallel_state)
    schedules.get_forward_backward_func = getter
    pipeline_parallel.get_forward_backward_func = getter
    parallel_state.initialize_model_parallel = wrap_initialize(parallel_state.initialize_model_parallel)
    try:
        from megatron.training import training
        training.get_forward_backward_func = getter
        patch_training_log(training, reported_schedule)
        training.get_megatron_optimizer = _registering(training.get_megatron_optimizer)
    except ImportError:  # megatron.training absent (core-only install): nothing bound there
        pass
    _STATE["installed"] = True
