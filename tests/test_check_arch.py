"""tools/check_arch: every model_type the registry serves, and the real configs of checkpoints people run as those
types (tests/data/hf_configs), against transformers; and the tool must fail on a wrong model."""

from __future__ import annotations

from pathlib import Path

import pytest

from tools import check_arch

CONFIGS = sorted((Path(__file__).parent / "data" / "hf_configs").glob("*.json"))


def test_every_supported_model_type_matches_transformers(capsys):
    assert check_arch.main(["--all", "--new", "6"]) == 0
    out = capsys.readouterr().out
    served, _ = check_arch.supported_model_types()
    for model_type in served:
        assert f"\n{model_type}: ours against transformers" in out
    assert "FAIL" not in out


@pytest.mark.parametrize("path", CONFIGS, ids=[p.stem for p in CONFIGS])
def test_real_configs(path):
    rows = check_arch.check(str(path), ["interp", "mlx"], new=6)
    assert rows and all(r.ok for r in rows), [r for r in rows if not r.ok]


def test_shrunken_configs_keep_their_features():
    llama = check_arch.hf_config(str(next(p for p in CONFIGS if "llama" in p.stem)), 2)
    assert llama.hidden_size == 64 and llama.num_hidden_layers == 2
    assert llama.rope_parameters["rope_type"] == "llama3" and llama.rope_parameters["rope_theta"] == 500000.0
    assert llama.rope_parameters["original_max_position_embeddings"] == 16  # scaled at the prompts' positions


def test_a_wrong_model_fails(monkeypatch, capsys):
    """A planted bug (rope theta read 2x too large) must show as failing rows and exit status 1."""
    import dataclasses

    import ir.config

    real = ir.config.hf_rope
    monkeypatch.setattr(ir.config, "hf_rope", lambda cfg, d: dataclasses.replace(real(cfg, d),
                                                                                theta=2 * real(cfg, d).theta))
    assert check_arch.main(["qwen2", "--new", "4"]) == 1
    assert "FAIL" in capsys.readouterr().out
