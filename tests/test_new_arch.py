"""tools/new_arch: what it recognizes in real transformers configs, and that the file it writes for a decoder llama's
already covers is a working architecture (loaded from the written file, checked with check_arch)."""

from __future__ import annotations

import importlib.util

from tools import check_arch, new_arch


def test_recognizes_features():
    qwen2 = new_arch.inspect("qwen2")
    assert qwen2.flags == {"qkv_bias": True} and qwen2.llama_compatible
    assert new_arch.inspect("qwen3").flags == {"qk_norm": True}
    gemma2 = new_arch.inspect("gemma2")
    assert not gemma2.llama_compatible
    todo = "\n".join(gemma2.todo)
    for what in ("attn_logit_softcapping", "final_logit_softcapping", "query_pre_attn_scalar", "(1 + w) norms"):
        assert what in todo
    assert "model.layers.{i}.pre_feedforward_layernorm.weight" in gemma2.unmapped
    phi3 = new_arch.inspect("phi3")
    assert any("qkv_proj" in t for t in phi3.todo) and any("gate_up_proj" in t for t in phi3.todo)
    stablelm = new_arch.inspect("stablelm")
    assert stablelm.features["partial rotary"] == "0.25" and any("LayerNorm" in t for t in stablelm.todo)


def test_written_file_is_a_working_architecture(tmp_path, monkeypatch, capsys):
    assert new_arch.main(["mistral", "--name", "mistral_new", "--write", "--models-dir", str(tmp_path / "models"),
                          "--tests-dir", str(tmp_path / "tests")]) == 0
    src = tmp_path / "models" / "mistral_new.py"
    assert (tmp_path / "tests" / "test_arch_mistral_new.py").exists()
    spec = importlib.util.spec_from_file_location("mistral_new", src)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert mod.ARCH.name == "mistral_new" and mod.ARCH.hf_model_types == ("mistral",)
    import ir.models

    monkeypatch.setattr(ir.models, "registry", lambda: {"mistral_new": mod.ARCH})  # only the written one serves
    rows = check_arch.check("mistral", ["interp"], new=4)
    assert all(r.ok for r in rows), rows
    # and it will not overwrite
    assert new_arch.main(["mistral", "--name", "mistral_new", "--write", "--models-dir", str(tmp_path / "models"),
                          "--tests-dir", str(tmp_path / "tests")]) == 2


def test_gemma2_file_lists_its_todos(tmp_path):
    assert new_arch.main(["gemma2", "--write", "--models-dir", str(tmp_path), "--tests-dir", str(tmp_path)]) == 0
    text = (tmp_path / "gemma2.py").read_text()
    assert "# TODO: attn_logit_softcapping" in text and "# TODO: map tensor model.layers.{i}.pre_feedforward" in text
