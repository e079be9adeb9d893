"""Command lines for one benchmark run, and running them (processes, logs, memory sampling)."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import dataclasses
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

from ..planning.costs import ModelSpec
from ..planning.defaults import MFU
from .logparse import ParsedLog

SCHEDULES = ("1f1b", "interleaved", "pipemesh", "pipemesh-auto")
"""Benchmarked schedule families: stock 1F1B (no virtual pipeline); stock interleaved with every group size
Megatron accepts (rows ``interleaved-g<g>``; g = p is depth-first, g = m breadth-first); PipeMesh with given
groups; PipeMesh planned (auto). ``depth-first`` / ``breadth-first`` select one interleaved group size."""
SCHEDULE_ALIASES = ("depth-first", "breadth-first")
STOCK_FAMILIES = ("1f1b", "interleaved")


@dataclass(frozen=True)
class ParallelConfig:
    """Pipeline x data-parallel layout of one benchmarked configuration."""

    pp: int
    dp: int = 1

    @property
    def world(self) -> int:
        return self.pp * self.dp

    @property
    def name(self) -> str:
        return f"pp{self.pp}" + (f"xdp{self.dp}" if self.dp > 1 else "")

    @staticmethod
    def parse(text: str) -> "ParallelConfig":
        match = re.fullmatch(r"pp(\d+)(?:x?dp(\d+))?", text.strip().lower())
        if not match:
            raise ValueError(f"configuration {text!r} is not of the form ppN or ppNxdpM (e.g. pp2, pp4, pp2xdp2)")
        pp, dp = int(match.group(1)), int(match.group(2) or 1)
        if pp < 2:
            raise ValueError(f"configuration {text!r}: the pipeline size must be >= 2 (interleaved and PipeMesh need it)")
        if dp < 1:
            raise ValueError(f"configuration {text!r}: the data-parallel size must be >= 1")
        return ParallelConfig(pp, dp)


@dataclass(frozen=True)
class ModelSetup:
    """The tiny GPT and the batch of every benchmarked run."""

    chunk: ModelSpec = field(default_factory=lambda: bench_gpt())
    """The GPT of one virtual chunk, as the planner prices it (``num_layers``: the layers per chunk); a run of
    ``pp`` ranks stacks ``pp * vpp`` of them (:meth:`model_spec`)."""
    microbatches: int = 8
    """m: micro-batches per iteration per data-parallel replica."""
    vpp: int = 2
    """Virtual chunks per rank for the interleaved and PipeMesh schedules."""
    warmup_iters: int = 2
    """Iterations run before the measured ones."""
    measured_iters: int = 6
    """Iterations timed."""

    def num_layers(self, pp: int) -> int:
        return pp * self.vpp * self.chunk.num_layers

    def model_spec(self, pp: int) -> ModelSpec:
        """The whole GPT of a run on ``pp`` pipeline ranks."""
        return dataclasses.replace(self.chunk, num_layers=self.num_layers(pp))

    def global_batch(self, dp: int) -> int:
        return self.microbatches * self.chunk.micro_batch_size * dp

    def tokens_per_iteration(self, dp: int) -> int:
        return self.global_batch(dp) * self.chunk.seq_length

    @property
    def train_iters(self) -> int:
        return self.warmup_iters + self.measured_iters

    def to_dict(self) -> Dict[str, int]:
        """The setup as the bench's JSON reports it."""
        chunk = self.chunk
        return {"hidden_size": chunk.hidden_size, "num_attention_heads": chunk.num_attention_heads,
                "seq_length": chunk.seq_length, "micro_batch_size": chunk.micro_batch_size,
                "microbatches": self.microbatches, "vpp": self.vpp, "layers_per_chunk": chunk.num_layers,
                "warmup_iters": self.warmup_iters, "measured_iters": self.measured_iters}


PADDED_VOCAB = 384
"""NullTokenizer vocabulary 257 padded to a multiple of 128 (Megatron's default divisor)."""


def bench_gpt(hidden_size: int = 256, num_attention_heads: int = 4, seq_length: int = 128, micro_batch_size: int = 2,
              layers: int = 1) -> ModelSpec:
    """The bench's GPT (``layers`` of it) as the planner sees it: fp32 on CPU, local layer spec, no dropout (the
    bench runs with ``--hidden-dropout 0 --attention-dropout 0``), NullTokenizer's padded vocabulary."""
    return ModelSpec(num_layers=layers, hidden_size=hidden_size, num_attention_heads=num_attention_heads,
                     seq_length=seq_length, micro_batch_size=micro_batch_size, vocab_size=PADDED_VOCAB, dtype_bytes=4,
                     grad_bytes=4, hidden_dropout=0.0, attention_dropout=0.0, layer_spec="local")


@dataclass(frozen=True)
class AutoPlanSettings:
    """The planner's inputs for ``pipemesh-auto`` (CPU has no device description to read)."""

    memory_budget_gb: float = 8.0
    device_tflops: float = 0.05
    mfu: float = MFU
    activation_placement: str = "auto"
    """PipeMesh rows' memory levers (``--activation-placement``): 'auto' places chunk-micro-batches in host
    memory or recomputes them, 'recompute-only' only recomputes. Stock rows only recompute on CPU: Megatron's
    ``--fine-grained-activation-offloading`` works in every pipeline schedule but needs CUDA and Transformer
    Engine (``training/arguments.py:1854-1856``), and ``--cpu-offloading`` refuses pipeline parallelism
    (``transformer_config.py:1714-1717``). The study models the former for stock (:class:`..planning.stock.StockOffload`)."""
    per_rank_network: bool = True
    """The shaped network the plans and predictions see: True, a NIC per rank (a data-parallel ring runs at the rate
    per rank); False, one token bucket for all ranks (a ring of d ranks at the rate / d). See :mod:`.netns`."""


def default_groups(pp: int, m: int) -> Tuple[Tuple[int, ...], Tuple[int, ...]]:
    """A PipeMesh setting for the 'given groups' run: a large first forward group (long parameter-gather
    window), then groups of p; backward: groups of p with a large last group (long reduction window)."""
    forward = (m - pp, pp) if m - pp >= pp and m - pp != pp else (m,)
    if m >= 2 * pp:
        last = m - pp * ((m // 2) // pp) if (m // 2) >= pp else m
        first = m - last
        backward = ((first,) if first else ()) + (last,)
    else:
        backward = (m,)
    # every backward prefix must be <= the forward prefix (groups are dequeued after being enqueued)
    if backward[0] > forward[0]:
        backward = (m,)
    return forward, backward


def training_args(model: ModelSetup, config: ParallelConfig, spec, data_flags: Sequence[str],
                  run_dir: str) -> List[str]:
    """Megatron/PipeMesh flags of one run of row ``spec`` (a :class:`~.memory_fair.RunSpec`): the same model,
    data, seed and batch for every row; the row adds its schedule and memory flags (with ``--sharding`` the
    distributed optimizer and, for PipeMesh rows, ``--pipemesh-sharding`` with the planned level per chunk)."""
    if spec.family not in SCHEDULES:
        raise ValueError(f"unknown schedule family {spec.family!r}; choose from {', '.join(SCHEDULES)}")
    pp = config.pp
    args = list(data_flags) + [
        "--split", "98,1,1", "--data-cache-path", os.path.join(run_dir, "cache"),
        "--num-layers", str(model.num_layers(pp)), "--hidden-size", str(model.chunk.hidden_size),
        "--num-attention-heads", str(model.chunk.num_attention_heads), "--seq-length", str(model.chunk.seq_length),
        "--max-position-embeddings", str(model.chunk.seq_length),
        "--micro-batch-size", str(model.chunk.micro_batch_size), "--global-batch-size", str(model.global_batch(config.dp)),
        "--pipeline-model-parallel-size", str(pp),
        "--train-iters", str(model.train_iters), "--lr", "1e-3", "--min-lr", "1e-4", "--lr-decay-style", "cosine",
        "--weight-decay", "0.01", "--clip-grad", "1.0", "--log-interval", "1", "--eval-iters", "0",
        "--eval-interval", "100000", "--seed", "1234", "--num-workers", "0",
        "--timing-log-level", "2", "--timing-log-option", "all",
        # No dropout: CPU dropout keeps fp32 masks where CUDA keeps bytes; without it both keep the same tensors
        # and the activation model predicts the meter exactly.
        "--hidden-dropout", "0", "--attention-dropout", "0",
        # The CPU layer's fused-wgrad kernels return no weight gradient (megatron-core 0.19.2's DDP never sets
        # grad_added_to_main_grad, so layers.py:692-723 gives None), and with --overlap-grad-reduce DDP's hook then
        # fails on the last stage's output weight (distributed_data_parallel.py:487-489). Every row runs unfused.
        "--no-gradient-accumulation-fusion",
    ]
    sharding = tuple(spec.sharding_flags)  # --sharding: the distributed optimizer (and levels)
    if config.dp > 1 and not sharding:
        args += ["--overlap-grad-reduce"]
    if spec.family in ("pipemesh", "pipemesh-auto"):
        args += ["--num-layers-per-virtual-pipeline-stage", str(model.chunk.num_layers)]
    args += list(spec.stock_flags)  # stock: V (--num-virtual-stages-per-pipeline-rank), g, recomputation
    if spec.family in ("pipemesh", "pipemesh-auto"):
        if not spec.plan_path:
            raise ValueError(f"row {spec.name} needs a plan file")
        args += ["--pipeline-schedule", "pipemesh", "--pipemesh-plan", spec.plan_path]
    return args + list(sharding)


TRAIN_MODULE = ("-m", "megatron_pipemesh.bench.rank")
"""The bench's rank entry (:mod:`.rank`): core pinning and the activation meter around the training entry point."""


def launch_command(nproc: int, train_args: Sequence[str], prefix: Sequence[str] = (),
                   python: str = sys.executable, rank_namespaces: Optional[str] = None,
                   master_port: int = 29500, target: Sequence[str] = TRAIN_MODULE) -> List[str]:
    """torchrun of ``target`` (the bench's GPT through its rank entry; or a script) on ``nproc`` ranks, after
    ``prefix`` (e.g. ``ip netns exec NAME``). With ``rank_namespaces`` (the per-rank network's hub name) every
    worker enters its own namespace (:mod:`.rank_netns`) and meets the others at the hub's rendezvous store
    (``HUB_ADDRESS:master_port``)."""
    train = [*target, *train_args]
    if rank_namespaces is None:
        return list(prefix) + [python, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
                               *train]
    from .netns import HUB_ADDRESS

    return list(prefix) + [python, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", str(nproc),
                           "--master-addr", HUB_ADDRESS, "--master-port", str(master_port),
                           "-m", "megatron_pipemesh.bench.rank_netns", rank_namespaces, *train]


def threads_per_rank(world: int, cores: Optional[int] = None) -> Tuple[int, bool]:
    """(threads per rank, oversubscribed?) so that ranks x threads <= cores where possible."""
    cores = cores or os.cpu_count() or 1
    return max(1, cores // world), world > cores


def run_env(threads: int, base: Optional[Dict[str, str]] = None,
            cores: Optional[Sequence[int]] = None) -> Dict[str, str]:
    """Environment of every rank: threads, gloo on loopback, no CUDA, the activation meter on, and each
    rank's core when ``cores`` is given (:mod:`.affinity`)."""
    from .activation_meter import ENV_VAR as METER
    from .affinity import ENV_VAR as CORES

    env = dict(os.environ if base is None else base)
    env[METER] = "1"
    env.pop(CORES, None)
    if cores:
        env[CORES] = ",".join(map(str, cores))
    env.update({"OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads), "GLOO_SOCKET_IFNAME": "lo",
                "PYTHONWARNINGS": "ignore", "PYTHONUNBUFFERED": "1", "TORCH_NCCL_ASYNC_ERROR_HANDLING": "0"})
    env.pop("CUDA_VISIBLE_DEVICES", None)
    env["CUDA_VISIBLE_DEVICES"] = ""
    return env


@dataclass
class RunResult:
    config: str
    schedule: str
    """The row name (``1f1b``, ``interleaved-g4``, ``pipemesh``, ``pipemesh-auto``)."""
    shaped: bool
    repeat: int
    returncode: int
    wall_s: float
    log_path: str
    parsed: ParsedLog
    peak_rss_mb: Dict[int, float] = field(default_factory=dict)
    """Peak resident memory per global rank (MiB), sampled every 0.25 s."""
    error: str = ""
    activation_peak_bytes: Optional[List[Optional[int]]] = None
    """Peak activation bytes per global rank over the run's training iterations (activation meter)."""
    model_state_bytes: Optional[List[Optional[int]]] = None
    """``--sharding``: weights + gradients + optimizer state per global rank (least held while the schedule ran)."""
    peak_memory_bytes: Optional[List[Optional[int]]] = None
    """``--sharding``: peak of model state + activations per global rank over the run's training iterations."""


class _RssSampler(threading.Thread):
    def __init__(self, pid: int, interval: float = 0.25):
        super().__init__(daemon=True)
        self.pid, self.interval, self.peak = pid, interval, {}
        self._halt = threading.Event()
        self._rank_of: Dict[int, Optional[int]] = {}

    def run(self) -> None:
        try:
            import psutil
        except ImportError:  # pragma: no cover
            return
        try:
            root = psutil.Process(self.pid)
        except psutil.Error:
            return
        while not self._halt.is_set():
            try:
                children = root.children(recursive=True)
            except psutil.Error:
                break
            for child in children:
                try:
                    rank = self._rank_of.get(child.pid)
                    if rank is None:  # not cached: a process may be seen between fork and exec, so look again
                        if "torch.distributed.run" in " ".join(child.cmdline()):
                            continue
                        text = child.environ().get("RANK")
                        if text is None:
                            continue
                        rank = self._rank_of[child.pid] = int(text)
                    rss = child.memory_info().rss / 2 ** 20
                    self.peak[rank] = max(self.peak.get(rank, 0.0), rss)
                except (psutil.Error, ValueError):
                    continue
            self._halt.wait(self.interval)

    def stop(self) -> None:
        self._halt.set()


def _kill_group(proc: subprocess.Popen) -> None:
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            return
        try:
            proc.wait(timeout=5)
            return
        except subprocess.TimeoutExpired:
            continue


def run_once(cmd: Sequence[str], env: Dict[str, str], log_path: str, timeout_s: float, cwd: Optional[str] = None,
             sample_memory: bool = True) -> Tuple[int, float, Dict[int, float], str]:
    """Run ``cmd`` in its own process group with output to ``log_path``.

    Returns (exit code, wall seconds, peak RSS per rank, log text). On timeout or Ctrl-C the whole
    process group of this run (and only it) is terminated.
    """
    Path(log_path).parent.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    with open(log_path, "w", encoding="utf-8") as log:
        proc = subprocess.Popen(list(cmd), stdout=log, stderr=subprocess.STDOUT, env=env, cwd=cwd,
                                start_new_session=True)
        sampler = _RssSampler(proc.pid) if sample_memory else None
        if sampler:
            sampler.start()
        try:
            code = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            _kill_group(proc)
            code = 124
        except BaseException:
            _kill_group(proc)
            raise
        finally:
            if sampler:
                sampler.stop()
                sampler.join(timeout=2)
    wall = time.monotonic() - start
    text = Path(log_path).read_text(encoding="utf-8", errors="replace")
    return code, wall, (dict(sampler.peak) if sampler else {}), text


def run_workers(shaping, nproc: int, target: Sequence[str], args: Sequence[str], log_path: str, timeout_s: float,
                cwd: Optional[str] = None) -> Tuple[int, float, str]:
    """torchrun of ``target`` with ``args`` on ``nproc`` one-thread CPU workers, each rank in its own namespace of
    the per-rank network of ``shaping`` (a :class:`.netns.Shaping`; removed on every exit), or on the plain loopback
    (None): (exit code, wall seconds, log text)."""
    from .netns import ShapedNamespace

    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", "CUDA_VISIBLE_DEVICES": ""}
    if shaping is None:
        code, wall, _, text = run_once(launch_command(nproc, args, target=target), env, log_path, timeout_s, cwd=cwd,
                                       sample_memory=False)
        return code, wall, text
    with ShapedNamespace(shaping, ranks=nproc) as namespace:
        cmd = launch_command(nproc, args, namespace.prefix(), rank_namespaces=namespace.rank_namespaces, target=target)
        code, wall, _, text = run_once(cmd, env, log_path, timeout_s, cwd=cwd, sample_memory=False)
    return code, wall, text


def error_excerpt(text: str, lines: int = 12) -> str:
    """The last lines of a failed run's log that look like an error."""
    keep = [l for l in text.splitlines() if re.search(r"error|Error|Traceback|exception|Killed", l)]
    return "\n".join((keep or text.splitlines())[-lines:])


def prepare_data(out_dir: str, python: str = sys.executable) -> List[str]:
    """Tokenize the shipped corpus into ``out_dir/corpus``; returns Megatron's data flags."""
    prefix = os.path.join(out_dir, "corpus")
    if not (os.path.exists(prefix + ".bin") and os.path.exists(prefix + ".idx")):
        result = subprocess.run([python, "-m", "megatron_pipemesh.data.prepare", "--input",
                                 str(Path(__file__).resolve().parents[1] / "data" / "corpus"), "--output-prefix", prefix],
                                capture_output=True, text=True, env={**os.environ, "PYTHONWARNINGS": "ignore"})
        if result.returncode != 0:
            raise RuntimeError(f"data preparation failed: {result.stderr.strip()[-2000:]}")
        for line in result.stdout.splitlines():
            if line.startswith("Megatron flags:"):
                return line.split(":", 1)[1].split()
    return ["--data-path", prefix, "--tokenizer-type", "NullTokenizer", "--vocab-size", "257"]
