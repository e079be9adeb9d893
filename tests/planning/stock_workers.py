"""Worker run by tests/planning/test_stock_memory.py: Megatron's own recomputation switches on a tiny model."""
from __future__ import annotations

import weakref
from typing import Dict, List

from tests import megatron_harness as h


def _saved_bytes(model, run) -> int:
    """Bytes of the storages autograd keeps for the backward after ``run()``, deduplicated,
    parameters and buffers excluded, read *after* the forward (Megatron's output-discarding
    checkpoints shrink a saved storage to 0 bytes once the forward is done)."""
    import torch

    excluded = {t.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers()]}
    aliases: List = []

    def pack(tensor):
        if not isinstance(tensor, torch.Tensor) or isinstance(tensor, torch.nn.Parameter):
            return tensor
        alias = tensor.detach()
        ptr = alias.untyped_storage().data_ptr()
        if ptr and ptr not in excluded:
            aliases.append(weakref.ref(alias))
        return alias

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        loss = run()
    live: Dict[int, int] = {}
    for ref in aliases:
        alias = ref()
        if alias is not None:
            storage = alias.untyped_storage()
            live[id(storage._cdata) if storage.data_ptr() == 0 else storage.data_ptr()] = storage.nbytes()
    return loss, sum(live.values())


def stock_recompute_memory(cases: List[Dict]):
    """For each case {'spec': TinyGPT kwargs, 'config': TransformerConfig overrides incl. Megatron's
    recompute_granularity / recompute_modules / recompute_method / recompute_num_layers}: one
    whole-model chunk (PP=1, fp32), one forward (the backward only frees what is measured here).
    Returns [(case, saved bytes, loss)]."""
    h.init_parallel(pp=1)
    import torch

    out = []
    for case in cases:
        spec = h.TinyGPT(**case.get("spec", {}))
        overrides = dict(case.get("config", {}))
        if overrides.get("activation_func") == "silu":  # JSON carries the name, the config needs the function
            overrides["activation_func"] = torch.nn.functional.silu
        config = h.make_config(spec, **overrides)
        model = h.build_model(spec, config=config)[0]
        model.train()
        batch = h.make_batch(spec, 0)

        def run():
            losses = model(batch["tokens"], batch["position_ids"], batch["attention_mask"], labels=batch["labels"])
            return (losses.float() * batch["loss_mask"]).sum()  # saves the mask, like loss_func

        loss, saved = _saved_bytes(model, run)
        out.append((case, saved, float(loss)))
    return out
