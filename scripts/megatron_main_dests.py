"""Write the dests of a Megatron-LM checkout's training parser to tests/fixtures/megatron_lm_main_dests.txt, which
tests/planning/test_flag_inventory.py checks the inventory against (CI cannot reach Megatron-LM).

    PYTHONPATH=/path/to/Megatron-LM:/path/with/triton .venv/bin/python scripts/megatron_main_dests.py COMMIT

Megatron-LM main imports triton when its training arguments are imported (its SSM ops); put a triton package on the
path (``pip install --no-deps --target DIR triton``) for the import; nothing here runs it.
"""
import argparse
import sys
import warnings
from pathlib import Path

FIXTURE = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "megatron_lm_main_dests.txt"


def main() -> None:
    commit = sys.argv[1] if len(sys.argv) > 1 else "unknown"
    warnings.simplefilter("ignore")
    from megatron_pipemesh.integration.bootstrap import prepare_megatron_import

    prepare_megatron_import()
    import megatron.training.arguments as arguments

    parser = arguments.add_megatron_arguments(argparse.ArgumentParser(allow_abbrev=False))
    dests = sorted({action.dest for action in parser._actions if action.dest != "help"})
    header = (f"# dests of Megatron-LM main ({commit}) megatron.training.arguments.add_megatron_arguments: "
              "scripts/megatron_main_dests.py\n")
    FIXTURE.write_text(header + "\n".join(dests) + "\n")
    print(f"{len(dests)} dests of {arguments.__file__} -> {FIXTURE}")


if __name__ == "__main__":
    main()
