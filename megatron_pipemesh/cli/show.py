"""``pipemesh show``: each rank's op order (compute, or lowered with the transfers and syncs), as text, JSON or a
text timeline."""
from __future__ import annotations

import argparse
import json
from typing import Optional, Tuple

from ..planning.layout import LayoutError
from ..schedule.config import ScheduleConfig
from ..schedule.lower import lower
from ..schedule.validate import validate
from .arguments import config_from_args, split_from_args
from .common import UsageError


def _shown_layers(args: argparse.Namespace, config: ScheduleConfig) -> Optional[Tuple[int, ...]]:
    """Layers per stage for `show`: of a layout, or of --num-layers with the split flags (None: neither given)."""
    split = split_from_args(args)
    count = sum(split.layout) if split.layout is not None else args.num_layers
    if count is None:
        if not split.even:
            raise UsageError("the split flags need --num-layers (the layers to place). Example: --num-layers 12")
        return None
    try:
        return split.stage_layers(count, config.pp, config.vpp)
    except LayoutError as error:
        raise UsageError(str(error)) from error


def cmd_show(args: argparse.Namespace) -> int:
    from ..planning.sharding import ShardingError, parse_levels
    from ..schedule.lower import LoweringOptions

    config = config_from_args(args)
    try:
        levels = parse_levels(args.sharding, config.vpp, allow_auto=False) if args.sharding else ()
    except ShardingError as error:
        raise UsageError(str(error).replace("--pipemesh-sharding", "--sharding")) from error
    schedule = lower(config, LoweringOptions(sharding=levels or ()))
    validate(schedule)
    layers = _shown_layers(args, config)
    if args.json:
        ranks = [[str(op) for op in (program if args.lowered else schedule.compute_order(rank))]
                 for rank, program in enumerate(schedule.programs)]
        print(json.dumps({"schedule": config.describe(), "digest": schedule.digest(), "ranks": ranks,
                          **({"stage_layers": list(layers)} if layers is not None else {})}))
        return 0
    print(f"# {config.describe()}  (plan digest {schedule.digest()})")
    if layers is not None:
        print(f"# transformer layers per stage (stage = chunk * p + rank): {' '.join(map(str, layers))}")
    if args.picture:
        from ..planning.ascii import render_ascii
        from ..schedule.timeline import execute
        timeline = execute(schedule)
        print(f"# timeline with F = 1 and B = 2 time units, free communication: {timeline.makespan:g} units")
        print(render_ascii(timeline))
        return 0
    for rank in range(config.pp):
        ops = schedule.programs[rank] if args.lowered else schedule.compute_order(rank)
        print(f"rank {rank}: " + " ".join(str(op) for op in ops))
    return 0
