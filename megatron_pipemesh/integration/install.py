"""``megatron_pipemesh.install()``: plug PipeMesh into a running Megatron without forking it.

Patches (each idempotent, each leaving ``--pipeline-schedule default`` runs untouched):

1. ``megatron.training.arguments.parse_args``: chains an ``extra_args_provider`` that adds
   PipeMesh's flags (``parse_and_validate_args`` looks the function up at call time).
2. ``megatron.training.arguments.validate_args``: after Megatron's checks, validates PipeMesh's
   flags (exit 2 with one paragraph on every rank) and activates the PipeMesh schedule.
3. ``get_forward_backward_func`` in ``megatron.training.training`` (bound there at import, used by
   ``train()`` and ``evaluate()``), ``megatron.core.pipeline_parallel`` and its ``schedules``: return
   the PipeMesh schedule for interleaved pipelines when active, else defer to Megatron's.
4. ``megatron.core.parallel_state.initialize_model_parallel``: also creates PipeMesh's per-link
   pipeline groups when the PipeMesh schedule is active.
"""
from __future__ import annotations

import functools
import os

SUPPORTED = "0.19."
_STATE = {"installed": False, "schedule": None, "args": None}


def _check_version() -> str:
    from megatron.core import package_info

    version = package_info.__version__
    if not version.startswith(SUPPORTED):
        raise RuntimeError(
            f"megatron_pipemesh supports megatron-core {SUPPORTED}x (tested with 0.19.2) but found {version}; "
            "install a supported version, e.g. pip install --ignore-requires-python megatron-core==0.19.2")
    return version


def active_schedule():
    """The PipeMesh schedule object of this run, or None when ``--pipeline-schedule default``."""
    return _STATE["schedule"]


def reported_schedule():
    """The schedule whose statistics the training log reports: PipeMesh's, or the metered stock one."""
    return _STATE["schedule"] or _STATE.get("stock")


def _metered_stock(function):
    """Megatron's schedule wrapped by the activation meter (``--pipemesh-measure-memory`` under the stock
    schedule); one wrapper per function, so its statistics survive across iterations."""
    from ..runtime.stock_meter import MeteredStockSchedule

    stock = _STATE.get("stock")
    if stock is None or stock.function is not function:
        stock = _STATE["stock"] = MeteredStockSchedule(function)
    return stock


def activate(settings) -> None:
    """Activate (or deactivate) PipeMesh from validated :class:`~.flags.PipeMeshArgs`."""
    from ..runtime import PipeMeshSchedule
    from .parallel_state import get_pipemesh_p2p_groups

    _STATE["args"] = settings
    if not settings.enabled:
        _STATE["schedule"] = None
        return

    def make_schedule(forward_groups, backward_groups, recompute):
        options = settings.flags.executor_options(forward_groups, backward_groups, recompute, settings.timeout_s)
        return PipeMeshSchedule(options, p2p_groups=get_pipemesh_p2p_groups)

    schedule = make_schedule(settings.forward_groups, settings.backward_groups, settings.recompute)
    if settings.replan:
        from .measured import MeasuredReplanner
        replan = dict(settings.replan)
        schedule = MeasuredReplanner(
            schedule, lambda config, recompute: make_schedule(config.forward_groups, config.backward_groups, recompute),
            **replan)
    _STATE["schedule"] = schedule
    if settings.summary and os.environ.get("RANK", "0") == "0":
        print(settings.summary, flush=True)


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
    from megatron.training import arguments

    from .flags import PipeMeshArgumentError, add_pipemesh_arguments, check_pipemesh_args, fail
    from .report import announce_plan, patch_training_log

    original_parse = arguments.parse_args

    @functools.wraps(original_parse)
    def parse_args(extra_args_provider=None, ignore_unknown_args=False):
        def provider(parser):
            parser = add_pipemesh_arguments(parser)
            return extra_args_provider(parser) if extra_args_provider is not None else parser
        return original_parse(provider, ignore_unknown_args)

    original_validate = arguments.validate_args

    @functools.wraps(original_validate)
    def validate_args(args, defaults={}):
        result = original_validate(args, defaults)
        try:
            settings = check_pipemesh_args(args)
            activate(settings)
        except PipeMeshArgumentError as error:
            fail(error)
        announce_plan(args, settings)
        return result

    original_getter = schedules.get_forward_backward_func

    @functools.wraps(original_getter)
    def get_forward_backward_func(pp_size=None, vp_size=None, schedule_pg_collection=None):
        schedule = _STATE["schedule"]
        if schedule is not None:
            pp = pp_size if pp_size is not None else parallel_state.get_pipeline_model_parallel_world_size()
            vp = vp_size if vp_size is not None else parallel_state.get_virtual_pipeline_model_parallel_world_size()
            multimodule = type(schedule_pg_collection).__name__ == "MultiModuleProcessGroupCollection"
            if pp > 1 and vp is not None and not multimodule:
                return schedule
        function = original_getter(pp_size=pp_size, vp_size=vp_size, schedule_pg_collection=schedule_pg_collection)
        settings = _STATE["args"]
        if settings is not None and settings.flags.measure_memory:
            return _metered_stock(function)
        return function

    original_init = parallel_state.initialize_model_parallel

    @functools.wraps(original_init)
    def initialize_model_parallel(*args, **kwargs):
        original_init(*args, **kwargs)
        if _STATE["schedule"] is not None:
            from .parallel_state import create_pipemesh_groups
            create_pipemesh_groups()

    arguments.parse_args = parse_args
    arguments.validate_args = validate_args
    schedules.get_forward_backward_func = get_forward_backward_func
    pipeline_parallel.get_forward_backward_func = get_forward_backward_func
    parallel_state.initialize_model_parallel = initialize_model_parallel
    try:
        from megatron.training import training
        training.get_forward_backward_func = get_forward_backward_func
        patch_training_log(training)
    except ImportError:  # megatron.training absent (core-only install): nothing bound there
        pass
    _STATE["installed"] = True
