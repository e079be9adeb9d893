"""One layer's forward + backward at micro-batch 2 of the Llama-style GPT (scripts/profile_repeatability.py's): wall
ms, CPU ms, minor page faults per call, pinned to core 0, with the core beside it idle, computing the layer (the
profile's sibling) and idle again. Run it under different allocator settings (MALLOC_MMAP_THRESHOLD_=...) to compare.

    .venv/bin/python scripts/profile_allocator_check.py
"""
import json
import os
import resource
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.argv = sys.argv[:1]
from megatron_pipemesh.integration.bootstrap import prepare_megatron_import
prepare_megatron_import()
import torch
from megatron_pipemesh.integration.cpu_compat import apply_cpu_compat
from megatron_pipemesh.integration.profile import ProfileSettings, command_args, start_process_group
from megatron_pipemesh.integration.profile_models import gpt, level_args, megatron_quiet, with_main_grads
from megatron_pipemesh.integration.profile_steps import loader_attention_mask
from megatron_pipemesh.integration.profile_siblings import busy_siblings
from scripts.profile_repeatability import LLAMA
CMD = os.environ.get("CMD", LLAMA).split()
apply_cpu_compat(); torch.set_num_threads(1)
args, _, run = command_args(CMD, False)
end = start_process_group(False)
with megatron_quiet():
    model, _ = gpt(level_args(args, "none"), run.model.layer_spec, ProfileSettings(), False, pre=False, post=False)
with_main_grads(model)
mask = loader_attention_mask(args, 1, torch.device("cpu"))
hidden = torch.randn(args.seq_length, 2, args.hidden_size)
def one():
    model.set_input_tensor(hidden.clone().requires_grad_(True))
    out = model(input_ids=None, position_ids=None, attention_mask=mask)
    out.backward(torch.ones_like(out) * 1e-3)
def sample(n):
    rows = []
    for _ in range(n):
        r0 = resource.getrusage(resource.RUSAGE_SELF); w0 = time.perf_counter(); c0 = time.process_time()
        one()
        w1 = time.perf_counter(); c1 = time.process_time(); r1 = resource.getrusage(resource.RUSAGE_SELF)
        rows.append((w1 - w0, c1 - c0, r1.ru_minflt - r0.ru_minflt, r1.ru_nivcsw - r0.ru_nivcsw))
    return rows
def summary(name, rows):
    wall = sorted(r[0] for r in rows); cpu = [r[1] for r in rows]
    q = lambda v, p: sorted(v)[int(p * (len(v) - 1))]
    print(json.dumps({"case": name, "malloc": os.environ.get("MALLOC_MMAP_THRESHOLD_", "default"),
        "wall_ms_median": round(statistics.median(wall) * 1e3, 2), "wall_iqr_pct": round(100 * (q(wall, .75) - q(wall, .25)) / statistics.median(wall), 1),
        "cpu_ms_median": round(statistics.median(cpu) * 1e3, 2), "minflt_per_call": statistics.median(r[2] for r in rows),
        "invol_switches": sum(r[3] for r in rows), "loadavg": open("/proc/loadavg").read().split()[:3]}), flush=True)
for _ in range(3): one()
os.sched_setaffinity(0, {0})
summary("alone (core 0 pinned, sibling idle)", sample(60))
with busy_siblings(CMD, 1):
    summary("with busy sibling on core 1", sample(60))
summary("alone again", sample(60))
end()
