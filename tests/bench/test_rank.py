"""bench/rank.py: each benchmark rank pins itself first, then runs the training entry point, which installs the
activation meter once the process is prepared (the training entry point imports nothing of the bench)."""
from megatron_pipemesh.bench import activation_meter, affinity, rank
from megatron_pipemesh.training import pretrain_gpt


def test_rank_pins_then_trains_with_the_meter_after_preparation(monkeypatch):
    calls = []
    monkeypatch.setattr(affinity, "pin_from_env", lambda: calls.append("pin"))
    monkeypatch.setattr(pretrain_gpt, "main", lambda argv, on_prepared: calls.append(("train", argv, on_prepared)))
    rank.main(["--num-layers", "2"])
    assert calls == ["pin", ("train", ["--num-layers", "2"], activation_meter.install_from_env)]
