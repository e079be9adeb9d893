"""planning/flag_inventory.py and planning/megatron_flags.py: every argument of Megatron's training parser (and
PipeMesh's flags) is classified exactly once, so a new megatron-core release cannot add a flag the advice ignores
silently; what a command sets is named or refused."""
from pathlib import Path

import pytest

from megatron_pipemesh.planning import flag_inventory, megatron_flags
from megatron_pipemesh.planning.flag_inventory import SetFlag, classify, missing, refusal, unpriced

MAIN_DESTS = Path(__file__).resolve().parents[1] / "fixtures" / "megatron_lm_main_dests.txt"


@pytest.fixture(scope="module")
def installed_dests():
    """Every dest of the installed megatron-core's training parser with PipeMesh's flags (as ``install()`` adds them)."""
    from megatron_pipemesh.integration.megatron_command import megatron_parser

    return {action.dest for action in megatron_parser()._actions if action.dest != "help"}


def _main_dests():
    return {line.strip() for line in MAIN_DESTS.read_text().splitlines() if line.strip() and not line.startswith("#")}


def test_every_dest_of_the_installed_parser_is_classified(installed_dests):
    assert len(installed_dests) > 800
    assert missing(installed_dests) == []


def test_every_dest_of_megatron_lm_main_is_classified():
    dests = _main_dests()
    assert len(dests) > 800
    assert missing(dests) == []


def test_each_dest_is_in_one_table_and_none_is_stale(installed_dests):
    assert flag_inventory.duplicates() == []
    known = installed_dests | _main_dests()
    stale = [dest for _, table in flag_inventory.TABLES for dest in table if dest not in known]
    assert stale == []


def test_removing_one_entry_fails_the_walk(installed_dests, monkeypatch):
    """The negative case: the walk finds a dest the inventory lost."""
    trimmed = dict(megatron_flags.PRICED)
    del trimmed["untie_embeddings_and_output_weights"]
    monkeypatch.setattr(flag_inventory, "TABLES", (("priced", trimmed),) + flag_inventory.TABLES[1:])
    assert missing(installed_dests) == ["untie_embeddings_and_output_weights"]


def test_what_a_command_sets_is_priced_named_or_refused():
    assert classify("untie_embeddings_and_output_weights")[0] == "priced"
    assert classify("context_parallel_size")[0] == "priced"
    assert classify("tp_comm_overlap")[0] == "not_priced"
    assert classify("log_interval") == ("no_cost", "logging")
    changed = {"tp_comm_overlap": SetFlag("tp_comm_overlap", "--tp-comm-overlap", True),
               "qk_layernorm": SetFlag("qk_layernorm", "--qk-layernorm", True),
               "log_interval": SetFlag("log_interval", "--log-interval", 10),
               "offload_modules": SetFlag("offload_modules", "--offload-modules", ["attn_norm"])}
    found = unpriced(changed, {"offload_modules": "offloading attn_norm: not modelled"})
    assert [item.flag for item in found] == ["--tp-comm-overlap", "--qk-layernorm", "--offload-modules"]
    assert found[0].to_dict() == {"flag": "--tp-comm-overlap", "value": "",
                                  "effect": megatron_flags.NOT_PRICED["tp_comm_overlap"]}
    assert found[2].value == "attn_norm" and found[2].effect == "offloading attn_norm: not modelled"
    assert refusal(changed) is None
    assert classify("num_experts")[0] == "priced"
    mla = {"multi_latent_attention": SetFlag("multi_latent_attention", "--multi-latent-attention", True)}
    line = refusal(mla)
    assert line.startswith("--multi-latent-attention: multi-latent attention's projections") and "\n" not in line
