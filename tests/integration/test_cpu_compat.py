"""apply_cpu_compat(): what it patches on CPU, nothing on CUDA, and the CPU flag list."""
import json
import subprocess
import sys
import textwrap
from pathlib import Path

from megatron_pipemesh.integration.cpu_compat import cpu_megatron_args, missing_cpu_args

REPO = Path(__file__).resolve().parents[2]


def _run(code: str) -> dict:
    prog = "import sys; sys.path.insert(0, %r)\nimport warnings; warnings.simplefilter('ignore')\n" % str(REPO)
    out = subprocess.run([sys.executable, "-c", prog + textwrap.dedent(code)],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-4000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_cpu_args_complete_and_missing_only():
    """cpu_megatron_args lists every CPU flag; missing_cpu_args keeps only those argv lacks (alternatives count)."""
    args = cpu_megatron_args()
    assert "--no-gradient-accumulation-fusion" not in args  # Megatron's default fusion runs on the CPU kernels
    for flag in ["--transformer-impl", "--use-cpu-initialization",
                 "--distributed-backend", "--no-bias-dropout-fusion", "--no-masked-softmax-fusion",
                 "--no-rope-fusion", "--no-persist-layer-norm"]:
        assert flag in args
    assert args[args.index("--distributed-backend") + 1] == "gloo"
    assert args[args.index("--transformer-impl") + 1] == "local"
    assert missing_cpu_args(args) == []
    user = ["--distributed-backend=gloo", "--transformer-impl", "local", "--no-bias-swiglu-fusion"]
    missing = missing_cpu_args(user)
    assert "--distributed-backend" not in missing and "--transformer-impl" not in missing
    assert "--no-bias-gelu-fusion" not in missing  # swiglu variant already disables bias-act fusion
    assert "--use-cpu-initialization" in missing


def test_noop_when_cuda_available():
    """With CUDA available apply_cpu_compat patches nothing and does not import megatron."""
    res = _run("""
        import json, torch
        torch.cuda.is_available = lambda: True
        orig = torch.cuda.current_device
        from megatron_pipemesh.integration.cpu_compat import apply_cpu_compat, cpu_compat_active
        print(json.dumps({"ret": apply_cpu_compat(), "active": cpu_compat_active(),
                          "same": torch.cuda.current_device is orig,
                          "megatron": "megatron" in sys.modules}))
    """)
    assert res == {"ret": False, "active": False, "same": True, "megatron": False}


def test_rng_fork_stays_quiet_on_cpu():
    """Dropout inside the RNG tracker's fork() logs no `CPU RNG state changed` warning on CPU (demo.sh printed
    1,280), while other warnings of that logger still get through and the fork still isolates the stream."""
    res = _run("""
        import inspect, json, logging, torch
        if torch.cuda.is_available():
            print(json.dumps({"skip": True})); raise SystemExit
        from megatron_pipemesh.integration.cpu_compat import RNG_FORK_WARNING, apply_cpu_compat
        assert apply_cpu_compat()
        from megatron.core.tensor_parallel import random as tp_random
        seen = []
        class Keep(logging.Handler):
            def emit(self, record):
                seen.append(record.getMessage())
        logging.getLogger().addHandler(Keep())
        tp_random.initialize_rng_tracker(force_reset=True)
        tracker = tp_random.get_cuda_rng_tracker()
        tracker.add(tp_random._MODEL_PARALLEL_RNG_TRACKER_NAME, 1234)
        before = torch.get_rng_state().clone()
        for _ in range(5):
            with tracker.fork():
                torch.nn.functional.dropout(torch.ones(64), p=0.5, training=True)
        after = torch.get_rng_state()
        logging.getLogger(tp_random.__name__).warning("another warning")
        print(json.dumps({"skip": False, "seen": seen, "restored": bool(torch.equal(before, after)),
                          "upstream": RNG_FORK_WARNING in inspect.getsource(tp_random.CudaRNGStatesTracker.fork)}))
    """)
    if res["skip"]:
        return
    assert res["upstream"], "megatron-core no longer logs this message from fork(): re-check the filter"
    assert res["seen"] == ["another warning"]
    assert res["restored"]


def test_patches_on_cpu():
    """On CPU devices, streams, RNG tracker, clipping, helpers, init and autocast map to CPU, idempotently."""
    res = _run("""
        import json, torch
        if torch.cuda.is_available():
            print(json.dumps({"skip": True})); raise SystemExit
        from megatron_pipemesh.integration.cpu_compat import apply_cpu_compat
        assert apply_cpu_compat() and apply_cpu_compat()  # idempotent
        r = {"skip": False}
        r["zeros"] = str(torch.zeros(2, device="cuda").device)
        r["tensor"] = str(torch.tensor([1.0], device=torch.cuda.current_device()).device)
        r["to"] = str(torch.ones(1).to(0).device) + "," + str(torch.ones(1).cuda().device)
        r["sync"] = torch.cuda.synchronize() is None
        s = torch.cuda.Stream(); s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            pass
        r["device_count"] = torch.cuda.device_count()
        # RNG tracker: seeded states, fork isolates them from the default generator.
        from megatron.core import tensor_parallel
        tensor_parallel.random.initialize_rng_tracker(force_reset=True)
        tr = tensor_parallel.get_cuda_rng_tracker()
        torch.manual_seed(0)
        tr.add("a", 123)
        before = torch.get_rng_state().clone()
        with tr.fork("a"):
            x = torch.rand(3)
        r["rng_restored"] = bool(torch.equal(before, torch.get_rng_state()))
        torch.manual_seed(123)
        r["rng_seeded"] = bool(torch.equal(x, torch.rand(3)))
        # Gradient clipping without the torch.cuda.FloatTensor assertion.
        from megatron.core.optimizer import optimizer as opt
        p = torch.nn.Parameter(torch.ones(4)); p.grad = torch.full((4,), 2.0)
        opt.clip_grad_by_total_norm_fp32([p], max_norm=1.0, total_norm=4.0)
        r["clipped"] = [round(float(v), 4) for v in p.grad]
        # total_num_tokens-style factory call inside megatron
        from megatron.core.datasets import utils as ds_utils
        r["compile_helpers"] = ds_utils.compile_helpers() is None
        import megatron.training.training as mt
        r["init_wrapped"] = mt.initialize_megatron.__wrapped__ is not None
        with torch.autocast("cuda", dtype=torch.bfloat16):
            y = torch.ones(2, 2) @ torch.ones(2, 2)
        r["autocast"] = str(y.dtype)
        print(json.dumps(r))
    """)
    if res["skip"]:
        return
    assert res["zeros"] == "cpu" and res["tensor"] == "cpu" and res["to"] == "cpu,cpu"
    assert res["sync"] and res["device_count"] == 1
    assert res["rng_restored"] and res["rng_seeded"]
    assert res["clipped"] == [0.5] * 4
    assert res["compile_helpers"] and res["init_wrapped"]
    assert res["autocast"] == "torch.bfloat16"


def test_torch_wgrad_kernels_accumulate_like_the_cuda_extension():
    """main_grad += grad_output^T @ input, in fp32 (16-bit inputs multiplied in fp32) and in bf16."""
    import torch

    from megatron_pipemesh.integration.cpu_compat import TorchWgradKernels

    torch.manual_seed(0)
    total_input, grad_output = torch.randn(6, 5), torch.randn(6, 3)
    main_grad = torch.ones(3, 5)
    TorchWgradKernels.wgrad_gemm_accum_fp32(total_input, grad_output, main_grad)
    assert torch.allclose(main_grad, 1 + grad_output.t() @ total_input, rtol=1e-6, atol=1e-6)
    half = torch.zeros(3, 5, dtype=torch.float32)
    TorchWgradKernels.wgrad_gemm_accum_fp32(total_input.bfloat16(), grad_output.bfloat16(), half)
    assert half.dtype == torch.float32
    assert torch.allclose(half, grad_output.bfloat16().float().t() @ total_input.bfloat16().float(), rtol=1e-6, atol=1e-6)
    low = torch.zeros(3, 5, dtype=torch.bfloat16)
    TorchWgradKernels.wgrad_gemm_accum_fp16(total_input.bfloat16(), grad_output.bfloat16(), low)
    assert low.dtype == torch.bfloat16 and torch.allclose(low.float(), grad_output.t() @ total_input, atol=0.1)


def test_gradient_accumulation_fusion_runs_megatrons_main_grad_path_on_cpu():
    """With the CPU layer, Megatron's linear layers keep --gradient-accumulation-fusion: a DDP-wrapped layer's
    backward calls the fused wgrad kernel, writes main_grad itself (no param.grad), and main_grad equals the
    unfused layer's gradient."""
    res = _run("""
        import json, os, torch
        if torch.cuda.is_available():
            print(json.dumps({"skip": True})); raise SystemExit
        from megatron_pipemesh.integration.cpu_compat import TorchWgradKernels, apply_cpu_compat
        apply_cpu_compat()
        import torch.distributed as dist
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(29000 + os.getpid() % 1000), RANK="0", WORLD_SIZE="1")
        dist.init_process_group("gloo")
        from megatron.core import parallel_state
        parallel_state.initialize_model_parallel()
        from megatron.core import tensor_parallel
        from megatron.core.model_parallel_config import ModelParallelConfig
        from megatron.core.tensor_parallel import layers
        tensor_parallel.model_parallel_cuda_manual_seed(1)
        calls = []
        original = TorchWgradKernels.wgrad_gemm_accum_fp32
        layers.fused_weight_gradient_mlp_cuda.wgrad_gemm_accum_fp32 = lambda *a: (calls.append(1), original(*a))

        def layer(fusion):
            config = ModelParallelConfig(gradient_accumulation_fusion=fusion, use_cpu_initialization=True,
                                         params_dtype=torch.float32)
            torch.manual_seed(0)
            return tensor_parallel.ColumnParallelLinear(5, 3, config=config, init_method=torch.nn.init.normal_,
                                                        bias=False, gather_output=True)
        fused, plain = layer(True), layer(False)
        fused.weight.main_grad = torch.zeros_like(fused.weight)
        fused.weight.grad_added_to_main_grad = False
        x = torch.randn(4, 2, 5)
        fused(x)[0].sum().backward()
        plain(x)[0].sum().backward()
        print(json.dumps({"skip": False, "calls": len(calls), "grad": fused.weight.grad is None or
                          bool(fused.weight.grad_added_to_main_grad),
                          "equal": bool(torch.allclose(fused.weight.main_grad, plain.weight.grad, rtol=1e-6, atol=1e-6))}))
    """)
    if res["skip"]:
        return
    assert res["calls"] == 1 and res["equal"] and res["grad"]


def test_jit_warmup_runs_only_for_the_fusions_in_use():
    """Megatron's JIT warm-up compiles fused kernels whether or not the model uses them; on CPU it is skipped when
    the fusions are off (as the CPU flags turn them) and runs as before when one is on."""
    out = _run("""
        import json, types
        from megatron_pipemesh.integration.cpu_compat import apply_cpu_compat
        assert apply_cpu_compat()
        import megatron.training.initialize as mt_init
        import megatron.training.global_vars as gv
        calls = []
        mt_init.bias_gelu = lambda bias, x: calls.append("gelu") or x
        mt_init.bias_dropout_add_fused_train = lambda xb, residual, p: calls.append("dropout_add") or residual
        base = dict(bf16=False, fp16=False, ffn_hidden_size=8, tensor_model_parallel_size=1, seq_length=4,
                    context_parallel_size=1, micro_batch_size=1, swiglu=False, sequence_parallel=False, hidden_size=2,
                    bias_gelu_fusion=False, bias_swiglu_fusion=False, bias_dropout_fusion=False)
        seen = {}
        for name, change in (("off", {}), ("gelu", {"bias_gelu_fusion": True}), ("dropout", {"bias_dropout_fusion": True})):
            gv._GLOBAL_ARGS = types.SimpleNamespace(**{**base, **change})
            calls.clear()
            mt_init.set_jit_fusion_options()
            seen[name] = sorted(set(calls))
        print(json.dumps(seen))
    """)
    assert out == {"off": [], "gelu": ["dropout_add", "gelu"], "dropout": ["dropout_add", "gelu"]}


def test_gloo_groups_run_one_worker_thread():
    """Item 14: every gloo group made once the layer is active (the world group, a new group) has one worker thread,
    a group made before it keeps torch's two, collectives still work and stay asynchronous, and the groups bind the
    interfaces of GLOO_SOCKET_IFNAME as torch's own constructor does (the bench's per-rank namespaces set it)."""
    out = _run("""
        import json, os, tempfile
        import torch, torch.distributed as dist
        store = dist.FileStore(os.path.join(tempfile.mkdtemp(), "store"), 1)
        before = dist.ProcessGroupGloo(dist.PrefixStore("before", store), 0, 1)
        from megatron_pipemesh.integration.cpu_compat import apply_cpu_compat
        assert apply_cpu_compat()
        dist.init_process_group("gloo", store=store, rank=0, world_size=1)
        group = dist.new_group([0])
        cpu = torch.device("cpu")
        threads = [g._get_backend(cpu).options._threads for g in (dist.group.WORLD, group)]
        x = torch.ones(4)
        work = dist.all_reduce(x, group=group, async_op=True)
        work.wait()
        os.environ["GLOO_SOCKET_IFNAME"] = "pipemesh-none0"  # the interface torch's own constructor would bind
        try:
            dist.new_group([0])
            missing = None
        except Exception as error:
            missing = "pipemesh-none0" in str(error)
        os.environ["GLOO_SOCKET_IFNAME"] = "lo"
        on_lo = dist.new_group([0])
        dist.all_reduce(x, group=on_lo)
        from megatron_pipemesh.integration.cpu_compat import set_gloo_worker_threads
        set_gloo_worker_threads(3)
        later = dist.new_group([0])._get_backend(cpu).options._threads
        print(json.dumps({"threads": threads, "before": before.options._threads, "sum": x.tolist(), "later": later,
                          "gloo": isinstance(group._get_backend(cpu), dist.ProcessGroupGloo), "named": missing}))
    """)
    assert out == {"threads": [1, 1], "before": 2, "sum": [1.0] * 4, "gloo": True, "named": True, "later": 3}


HEAP = textwrap.dedent("""
    import ctypes, sys
    from megatron_pipemesh.integration.cpu_compat import fixed_allocator_thresholds

    class Mallinfo2(ctypes.Structure):
        _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                          "fsmblks", "uordblks", "fordblks", "keepcost")]

    libc = ctypes.CDLL(None)
    libc.mallinfo2.restype = Mallinfo2
    libc.malloc.restype = ctypes.c_void_p
    libc.free.argtypes = [ctypes.c_void_p]
    if sys.argv[1] == "fixed":
        assert fixed_allocator_thresholds()
    size = 16 * 2 ** 20  # an activation of a few MiB, as a step allocates and frees them
    before = libc.mallinfo2()
    block = libc.malloc(size)
    ctypes.memset(block, 1, size)
    held = libc.mallinfo2()
    libc.free(block)
    after = libc.mallinfo2()
    print(held.hblkhd - before.hblkhd, after.arena - before.arena)
""")


def test_fixed_allocator_thresholds_reuse_the_pages_a_step_freed():
    """A fresh process with glibc's dynamic thresholds maps a 16 MiB block on its own and unmaps it when freed (the
    next step faults it in again); with the layer's fixed thresholds it comes from the heap, which keeps it once freed
    for the next step (glibc's mallinfo2: bytes mapped apart, the heap's size after the free)."""
    found = {}
    for mode in ("default", "fixed"):
        done = subprocess.run([sys.executable, "-c", HEAP, mode], capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr[-2000:]
        found[mode] = tuple(int(word) for word in done.stdout.split()[-2:])
    size = 16 * 2 ** 20
    mapped, kept = found["default"]
    assert mapped >= size and kept < size // 2, found
    mapped, kept = found["fixed"]
    assert mapped == 0 and kept > size // 2, found  # the heap held a little free room before
