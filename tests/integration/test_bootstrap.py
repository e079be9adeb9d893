"""prepare_megatron_import(): narrow, idempotent, inert when not needed."""
import json
import subprocess
import sys
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _run(code: str, extra_path=None) -> dict:
    env_path = [str(REPO)] + ([str(extra_path)] if extra_path else [])
    prog = "import sys; sys.path[:0] = %r\n" % env_path + textwrap.dedent(code)
    out = subprocess.run([sys.executable, "-c", prog], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-4000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_stub_only_paged_stash_when_triton_missing_and_megatron_imports():
    """Without triton only paged_stash is stubbed (never triton), megatron imports, and the fix is idempotent."""
    res = _run("""
        import importlib.util, json, warnings
        warnings.simplefilter("ignore")
        from megatron_pipemesh.integration.bootstrap import prepare_megatron_import, PAGED_STASH_MODULE
        has_triton = importlib.util.find_spec("triton") is not None
        first = prepare_megatron_import()
        second = prepare_megatron_import()
        import megatron.core
        from megatron.core.pipeline_parallel import schedules
        import megatron.training.models.gpt
        mod = sys.modules[PAGED_STASH_MODULE]
        print(json.dumps({"has_triton": has_triton, "first": first, "second": second,
                          "block": mod.GLOBAL_BLOCK_SIZE,
                          "kernels": [mod.paged_stash_copy_kernel is None, mod.paged_stash_pop_kernel is None],
                          "triton_in_modules": "triton" in sys.modules}))
    """)
    assert res["first"] == res["second"]
    assert res["block"] == 1024
    if not res["has_triton"]:
        assert res["first"]["paged_stash_stub"] is True
        assert res["kernels"] == [True, True]
        assert res["triton_in_modules"] is False  # the triton package itself is never faked
    if sys.version_info < (3, 12):
        assert res["first"]["typing_override_alias"] is True


def test_inert_when_triton_present(tmp_path):
    """With a triton package importable, no stub is registered."""
    fake = tmp_path / "triton"
    fake.mkdir()
    (fake / "__init__.py").write_text("")
    res = _run("""
        import json
        from megatron_pipemesh.integration.bootstrap import prepare_megatron_import, PAGED_STASH_MODULE
        fixes = prepare_megatron_import()
        print(json.dumps({"fixes": fixes, "registered": PAGED_STASH_MODULE in sys.modules}))
    """, extra_path=tmp_path)
    assert res["fixes"]["paged_stash_stub"] is False
    assert res["registered"] is False


def test_typing_override_untouched_on_312():
    """On Python 3.12+ typing.override is left as it is."""
    res = _run("""
        import json, typing
        sys.version_info = (3, 12, 0, "final", 0)
        had = hasattr(typing, "override")
        from megatron_pipemesh.integration import bootstrap
        bootstrap._install_typing_override()
        print(json.dumps({"had": had, "has": hasattr(typing, "override")}))
    """)
    assert res["has"] == res["had"]


def test_typing_override_alias_is_typing_extensions():
    """On Python < 3.12 typing.override becomes typing_extensions.override."""
    if sys.version_info >= (3, 12):
        return
    res = _run("""
        import json, typing, typing_extensions
        from megatron_pipemesh.integration.bootstrap import prepare_megatron_import
        prepare_megatron_import()
        print(json.dumps({"same": typing.override is typing_extensions.override}))
    """)
    assert res["same"] is True
