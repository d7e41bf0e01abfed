"""Malformed and truncated model files give one line that names the file and the problem."""

from __future__ import annotations

import json
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from ir.formats.errors import ModelFormatError
from ir.formats.gguf_file import GGUFFile
from ir.formats.safetensors_file import read_safetensors
from ir.loader import load_model

ROOT = Path(__file__).resolve().parents[1]


def _one_line(err: Exception, path: Path) -> str:
    msg = str(err)
    assert "\n" not in msg
    assert str(path) in msg
    return msg


@pytest.mark.parametrize("cut, words", [
    (3, "truncated"), (20, "truncated"), (5000, "truncated"), (700_000, "truncated"),
    (2_000_000, "truncated: tensor"), (50_000_000, "truncated: tensor"),
])
def test_truncated_gguf(tmp_path, smollm_path, cut, words):
    bad = tmp_path / "cut.gguf"
    bad.write_bytes(smollm_path.read_bytes()[:cut])
    with pytest.raises(ModelFormatError) as e:
        load_model(bad, progress=False)
    assert words in _one_line(e.value, bad)


def test_gguf_bad_magic_and_version(tmp_path, smollm_path):
    head = smollm_path.read_bytes()[:4096]
    bad = tmp_path / "magic.gguf"
    bad.write_bytes(b"GGML" + head[4:])
    with pytest.raises(ModelFormatError, match="not a GGUF file"):
        GGUFFile(bad)
    bad.write_bytes(b"GGUF" + struct.pack("<I", 7) + head[8:])
    with pytest.raises(ModelFormatError, match="unsupported GGUF version 7"):
        GGUFFile(bad)


def test_gguf_unknown_tensor_type(tmp_path):
    import gguf

    path = tmp_path / "iq.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    # IQ4_XS is a real GGUF type this project does not read (yet): 256 elements in 136 bytes.
    w.add_tensor("x", np.zeros((4, 136), np.uint8), raw_dtype=gguf.GGMLQuantizationType.IQ4_XS)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ModelFormatError, match="unsupported type id"):
        GGUFFile(path)


def test_gguf_missing_tensor(tmp_path):
    import gguf

    path = tmp_path / "empty.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    for key, val in [("block_count", 1), ("context_length", 64), ("embedding_length", 8),
                     ("feed_forward_length", 16), ("attention.head_count", 2)]:
        w.add_uint32(f"llama.{key}", val)
    w.add_float32("llama.attention.layer_norm_rms_epsilon", 1e-5)
    w.add_uint32("llama.vocab_size", 10)
    w.add_tensor("token_embd.weight", np.zeros((10, 8), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ModelFormatError, match="missing tensor 'blk.0.attn_norm.weight'"):
        load_model(path, progress=False)


def _write_safetensors(path: Path, header: dict, payload: bytes) -> None:
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + payload)


def test_safetensors_errors(tmp_path):
    good = {"w": {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 16]}}
    p = tmp_path / "model.safetensors"
    _write_safetensors(p, good, np.arange(4, dtype=np.float32).tobytes())
    assert read_safetensors(p)["w"].data.tolist() == [[0, 1], [2, 3]]

    _write_safetensors(p, good, b"\0" * 8)
    with pytest.raises(ModelFormatError, match="truncated: tensor 'w'"):
        read_safetensors(p)
    p.write_bytes(struct.pack("<Q", 10**9) + b"{}")
    with pytest.raises(ModelFormatError, match="header claims"):
        read_safetensors(p)
    p.write_bytes(struct.pack("<Q", 5) + b"{oops")
    with pytest.raises(ModelFormatError, match="malformed header JSON"):
        read_safetensors(p)
    _write_safetensors(p, {"w": {"dtype": "F32", "shape": [3], "data_offsets": [0, 16]}}, b"\0" * 16)
    with pytest.raises(ModelFormatError, match="needs 12"):
        read_safetensors(p)
    p.write_bytes(b"\1\2")
    with pytest.raises(ModelFormatError) as e:
        read_safetensors(p)
    _one_line(e.value, p)


def test_folder_without_config(tmp_path):
    with pytest.raises(ModelFormatError, match="no config.json"):
        load_model(tmp_path, progress=False)
    (tmp_path / "config.json").write_text('{"model_type": "nosuch"}')
    with pytest.raises(ValueError, match="unsupported model_type 'nosuch'"):
        load_model(tmp_path, progress=False)


def test_cli_reports_one_line_not_a_traceback(tmp_path, smollm_path):
    bad = tmp_path / "cut.gguf"
    bad.write_bytes(smollm_path.read_bytes()[:1_000_000])
    r = subprocess.run([sys.executable, "-m", "tools.ir_dump", str(bad)], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2
    assert "Traceback" not in r.stderr
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and str(bad) in lines[0] and "truncated" in lines[0]
