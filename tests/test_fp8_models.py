"""FP8 checkpoints (block-wise e4m3 with 128x128 weight_scale_inv, as DeepSeek-V3 and Qwen3-FP8 write them;
compressed-tensors float-quantized per tensor, per channel and per block), packed independently (tests/fp8_ckpt.py),
through the interpreter, MLX and the CUDA backend on CPU tensors (both dequantize at load) against transformers running
the dequantized dense model; the kept-e4m3 CUDA path on CPU tensors too, with the device gate opened, and on a GPU of
compute capability 8.9+ (skipped elsewhere: `pytest tests/test_fp8_models.py -k gpu` on an H200). Planted scale bugs
must fail the same check."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch
from backend_greedy import backend_greedy
from fp8_ckpt import Case, dequantized_reference, write_checkpoint
from int_quant_ckpt import check_interpreter, checkpoint_cache, with_quant_config
from tiny_hf import assert_close

from ir.formats import fp8_blocks, fp8_checkpoints
from ir.formats.errors import ModelFormatError
from ir.loader import load_model
from ir.reference import ReferenceRunner

CASES = {
    "blockwise": Case("fp8"),
    "ct_tensor": Case("compressed-tensors", "tensor"),
    "ct_channel": Case("compressed-tensors", "channel", bf16_scales=True),
    "ct_block": Case("compressed-tensors", "block", (64, 64)),
    "blockwise_embed": Case("fp8", embed=True),
}
PROMPT = [3, 17, 99, 5, 60, 7, 8, 9, 10, 11, 12]
STEPS = ([PROMPT, [4, 5, 6]], [PROMPT[:4], [4, 5, 6]])


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """case -> (dense transformers reference, folder), each written once."""
    return checkpoint_cache(tmp_path_factory, CASES, write_checkpoint,
                            lambda c: "compressed_tensors" if c.method == "compressed-tensors" else None)


def test_e4m3_table_is_torchs_float8_e4m3fn():
    codes = np.arange(256, dtype=np.uint8)
    np.testing.assert_array_equal(fp8_blocks.decode(codes), dequantized_reference(codes))  # NaNs in the same places


def test_fp8_linears_load_as_fp8_blocks(ckpt):
    _, folder = ckpt("blockwise")
    model = load_model(folder, progress=False)
    # 128-input blocks over rows of 192 inputs: groups of 64, the second block's scale twice; rows of 384: 128
    assert model.weights["layers.0.wq"].kind == "F8E4M3_G64" and model.weights["layers.0.w_down"].kind == "F8E4M3_G128"
    assert model.weights["embed"].kind == "F32" and not model.weights["lm_head"].quantized
    pytest.importorskip("triton")
    from backends.cuda.backend import CUDABackend

    assert CUDABackend.default_dtype(model, torch.device("cuda")) == "bf16"  # as the dense model's fp32 tensors


@pytest.mark.parametrize("name", CASES)
def test_interpreter_matches_dequantized_model(ckpt, name):
    dense, folder = ckpt(name)
    check_interpreter(folder, dense, PROMPT)


def _backend(kind: str, model):
    if kind == "mlx":
        pytest.importorskip("mlx")
        from backends.mlx.backend import MLXBackend

        return MLXBackend(model, dtype="f32", quantized=True, progress=False)
    pytest.importorskip("triton")
    from backends.cuda.backend import CUDABackend

    return CUDABackend(model, device="cpu", dtype="f32", cuda_graph=False, progress=False)


@pytest.mark.parametrize("name,kind", [("blockwise", "mlx"), ("ct_channel", "mlx"), ("blockwise", "cuda"),
                                       ("ct_tensor", "cuda")])
def test_backend_dequantizes_at_load_and_says_why(ckpt, name, kind, caplog):
    _, folder = ckpt(name)
    model = load_model(folder, progress=False)
    ref = ReferenceRunner(model, max_tokens=64, block_size=8)
    with caplog.at_level(logging.WARNING):
        b = _backend(kind, model)
    warned = [r.getMessage() for r in caplog.records if "F8E4M3" in r.getMessage()]
    assert warned and all(("MLX has no FP8" if kind == "mlx" else "CPU tensors") in w for w in warned)
    assert len(warned) == len({m.weights[p].kind for m in [model] for p in m.weights if m.weights[p].quantized})
    for prompts in STEPS:
        want_tokens, want = ref.greedy(prompts, 1)
        tokens, got = backend_greedy(b, ref, prompts, 1, 8)
        assert_close(got, want)
        assert tokens == want_tokens


def _kept_cuda(model, monkeypatch, device: str, dtype: str):
    """The CUDA backend with FP8 weights kept as e4m3 bytes (the device gate opened on CPU tensors)."""
    pytest.importorskip("triton")
    from backends.cuda import fp8_linear
    from backends.cuda.backend import CUDABackend
    from backends.cuda.weights import QuantWeight

    if device == "cpu":
        monkeypatch.setattr(fp8_linear, "no_fp8", lambda _device: None)
    paths = []
    real = fp8_linear.path
    monkeypatch.setattr(fp8_linear, "path", lambda *a: paths.append(real(*a)) or paths[-1])
    b = CUDABackend(model, device=device, dtype=dtype, cuda_graph=False, progress=False)
    if device == "cpu":
        b.runner.target = "numpy"
    kept = [p for p in b.params.values() if isinstance(p, QuantWeight)]
    assert len(kept) >= 4 and all(p.scales is not None and p.data.dtype == torch.uint8 for p in kept)
    return b, paths


# (case, the paths its linears take, logit tolerance): block scales go through the fp8 GEMV at decode (1-8 rows) and an
# exact fp32 dequantization in prefill; row-wise scales through _scaled_mm on e4m3 activations (dynamic per-row
# quantization: up to 2^-4 of a value, ~12% of these tiny random models' logits), whose arithmetic
# test_fp8_linear_is_its_definition checks exactly.
BLOCK_PATHS = {"blockwise", "gemv"}
KEPT = [("blockwise", BLOCK_PATHS, 1e-4), ("ct_channel", {"scaled_mm"}, 0.25),
        ("blockwise_embed", BLOCK_PATHS, 1e-4)]
KEPT_IDS = [name for name, _, _ in KEPT]


def _random_codes(rng, n: int, k: int) -> torch.Tensor:
    """e4m3 bytes [n, k] of normal values times 40 (every exponent), by torch's cast."""
    return (torch.from_numpy(rng.standard_normal((n, k), np.float32)) * 40).to(torch.float8_e4m3fn).view(torch.uint8)


def _random_x(rng, rows: int, k: int) -> torch.Tensor:
    """x [rows, k] with rows of different magnitudes (0.1-3)."""
    values = rng.standard_normal((rows, k), np.float32)
    return torch.from_numpy(values * rng.uniform(0.1, 3, (rows, 1)).astype(np.float32))


def _e4m3_rounded(x: torch.Tensor, group: int) -> np.ndarray:
    """x rounded to e4m3 per row and `group` inputs (scale amax / 448) by torch's cast, in float64: the dynamic
    activation scheme's x, independent of the engine's encoder."""
    rows, k = x.shape
    xg = x.view(rows, -1, group)
    xs = xg.abs().amax(2, keepdim=True) / 448
    return ((xg / xs).to(torch.float8_e4m3fn).double() * xs.double()).view(rows, k).numpy()


def _decoded(codes: torch.Tensor, scales: np.ndarray, group: int) -> np.ndarray:
    """W [n, k] in float64 from its e4m3 bytes and group scales, by the engine's e4m3 table."""
    n, k = codes.shape
    return fp8_blocks.dequantize(fp8_blocks.pack(codes.numpy(), scales, group), (n, k), group).astype(np.float64)


def test_fp8_gemm_path_is_its_definition(monkeypatch):
    """fp8_linear's FP8 GEMM (9+ rows on a GPU; here the DSL's numpy target on CPU tensors) against x rounded to e4m3
    per row and group of 64 by torch's cast, times W decoded by the engine's e4m3 table, in float64."""
    pytest.importorskip("triton")
    from backends.cuda import fp8_linear

    n, k, group, rows = 48, 192, 64, 11
    cuda = torch.device("cuda")  # path() only reads its type here (fp32: no row-wise _scaled_mm to ask the GPU for)
    assert [fp8_linear.path(g, (n, k), torch.float32, d, r) for g, d, r in
            ((group, cuda, rows), (group, cuda, 8), (16, cuda, rows), (group, torch.device("cpu"), rows))] == [
        "fp8_gemm", "gemv", "blockwise", "blockwise"]
    monkeypatch.setattr(fp8_linear, "path", lambda *a: "fp8_gemm")
    rng = np.random.default_rng(1)
    codes = _random_codes(rng, n, k)
    scales = rng.uniform(0.5, 2, (n, k // group)).astype(np.float32)
    x = _random_x(rng, rows, k)
    y = fp8_linear.fp8_linear(x, codes, torch.from_numpy(scales), chunk_bytes=0, target="numpy").numpy()
    want = _e4m3_rounded(x, group) @ _decoded(codes, scales, group).T
    np.testing.assert_allclose(y, want, rtol=0, atol=1e-5 * np.abs(want).max())


def test_block_scales_are_found_where_every_128_rows_share_them():
    """fp8_linear.block_scales: DeepSeek's [N / 128, K / 128] where each 128 rows' scales are one (then the blockwise
    cuBLASLt GEMM may take the weight); None where a row differs, the rows do not divide, or groups are not 128."""
    from backends.cuda import fp8_linear

    rng = np.random.default_rng(3)
    blocks = rng.uniform(0.5, 2, (3, 4)).astype(np.float32)
    scales = np.repeat(blocks, 128, axis=0)
    np.testing.assert_array_equal(fp8_linear.block_scales(scales, 512), blocks)
    odd = scales.copy()
    odd[200, 1] *= 1.5
    assert fp8_linear.block_scales(odd, 512) is None  # one row of the second block differs
    assert fp8_linear.block_scales(scales[:320], 512) is None  # 320 rows: not whole blocks
    assert fp8_linear.block_scales(np.repeat(scales, 2, axis=1), 512) is None  # groups of 64
    assert not fp8_linear.blockwise_mm(torch.device("cpu"), torch.float32)  # CPU tensors: the DSL's FP8 GEMM


def test_gpu_block_scaled_mm_is_its_definition():
    """On a Hopper GPU whose torch._scaled_mm takes DeepSeek's blockwise scales (cuBLASLt 12.9+): prefill rows of a
    128 x 128-block weight take it, against x rounded to e4m3 per row and 128 inputs by torch's cast times W decoded
    by the engine's table, in float64 (bf16 y: its rounding, and the FP8 MMA's own, ~1e-2 of max|y|)."""
    from backends.cuda import fp8_linear

    dev = torch.device("cuda")
    if not torch.cuda.is_available() or not fp8_linear.blockwise_mm(dev, torch.bfloat16):
        pytest.skip("needs a GPU whose torch._scaled_mm takes 1 x 128 and 128 x 128 scales (Hopper, CUDA 12.9+)")
    rng = np.random.default_rng(4)
    n, k, rows = 384, 512, 130  # rows: cuBLASLt's multiple of 4 padded
    codes = _random_codes(rng, n, k)
    blocks = rng.uniform(0.5, 2, (n // 128, k // 128)).astype(np.float32)
    scales = np.repeat(blocks, 128, axis=0)
    x = _random_x(rng, rows, k)
    assert fp8_linear.path(128, (n, k), torch.bfloat16, dev, rows, True) == "block_scaled_mm"
    y = fp8_linear.fp8_linear(x.to(dev, torch.bfloat16), codes.to(dev), torch.from_numpy(scales).to(dev), 0,
                              blocks=torch.from_numpy(blocks).to(dev))
    want = _e4m3_rounded(x.to(torch.bfloat16).float(), 128) @ _decoded(codes, scales, 128).T
    np.testing.assert_allclose(y.float().cpu().numpy(), want, rtol=0, atol=1e-2 * np.abs(want).max())


@pytest.mark.parametrize("group,rows,path", [(64, 5, "gemv"), (64, 9, "blockwise"), (192, 5, "scaled_mm")])
def test_fp8_linear_is_its_definition(group, rows, path):
    """fp8_linear on CPU tensors against W decoded by the engine's e4m3 table and x rounded to e4m3 row by row by
    torch (the scaled_mm path's dynamic activation scales), in float64; chunks of 16 rows for the blockwise path, the
    GEMV (the DSL's numpy target) at 5 rows."""
    pytest.importorskip("triton")
    from backends.cuda import fp8_linear

    rng = np.random.default_rng(0)
    n, k = 48, 192
    codes = _random_codes(rng, n, k)
    scales = rng.uniform(0.5, 2, (n, k // group)).astype(np.float32)
    x = _random_x(rng, rows, k)
    if path == "scaled_mm" and not fp8_linear.cpu_rowwise():
        pytest.skip("this torch's CPU _scaled_mm takes one scale per operand only (2.11; 2.13 takes rows)")
    assert fp8_linear.path(group, (n, k), torch.float32, x.device, rows) == path
    y = fp8_linear.fp8_linear(x, codes, torch.from_numpy(scales), chunk_bytes=16 * k * 4, target="numpy").numpy()
    xr = _e4m3_rounded(x, k) if path == "scaled_mm" else x.double().numpy()
    want = xr @ _decoded(codes, scales, group).T
    np.testing.assert_allclose(y, want, rtol=0, atol=1e-5 * np.abs(want).max())


# On a GPU the block cases' 9+ rows take the FP8 GEMM, x rounded to e4m3 per row and group (the checkpoints' dynamic
# activation scheme, as the scaled_mm path's per-row one): 0.128 of these tiny random models' logits on CPU tensors,
# the same to 1e-7 as torch's float8 cast of x times the dequantized W; the exact dequantized path keeps 1e-4
GPU_BLOCK_PATHS, GEMM_RTOL = {"gemv", "fp8_gemm"}, 0.2


def _check_kept(b, paths, model, path, rtol):
    ref = ReferenceRunner(model, max_tokens=64, block_size=8)
    for prompts in STEPS:
        _, want = ref.greedy(prompts, 1)
        _, got = backend_greedy(b, ref, prompts, 1, 8)
        assert_close(got.astype(np.float32), want, rtol)
    assert set(paths) == path


@pytest.mark.parametrize("name,path,rtol", KEPT, ids=KEPT_IDS)
def test_kept_fp8_path_on_cpu_tensors(ckpt, monkeypatch, name, path, rtol):
    _, folder = ckpt(name)
    model = load_model(folder, progress=False)
    b, paths = _kept_cuda(model, monkeypatch, "cpu", "f32")
    assert (getattr(b.params["embed"], "scales", None) is not None) == CASES[name].embed  # FP8 rows looked up too
    _check_kept(b, paths, model, path, rtol)


def test_kept_fp8_gemm_on_cpu_tensors(ckpt, monkeypatch):
    """The block-wise model with its 9+ row linears on the FP8 GEMM (the DSL's numpy target), as a GPU runs them."""
    from backends.cuda import fp8_linear

    real = fp8_linear.path
    monkeypatch.setattr(fp8_linear, "path", lambda g, shape, dt, _dev, rows, *blocks: real(
        g, shape, dt, torch.device("cuda"), rows))
    _, folder = ckpt("blockwise")
    model = load_model(folder, progress=False)
    b, paths = _kept_cuda(model, monkeypatch, "cpu", "f32")
    _check_kept(b, paths, model, GPU_BLOCK_PATHS, GEMM_RTOL)


@pytest.mark.parametrize("name,path,rtol", KEPT, ids=KEPT_IDS)
def test_gpu_fp8_path(ckpt, monkeypatch, name, path, rtol):
    """On a GPU of compute capability 8.9+ in bf16 (bf16's own rounding: 3e-2 at least); row-wise scales take
    _scaled_mm on Hopper (9.0+), the GEMV and FP8 GEMM paths on Ada."""
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("needs a CUDA GPU of compute capability 8.9 or higher")
    if path == BLOCK_PATHS or torch.cuda.get_device_capability() < (9, 0):
        path, rtol = GPU_BLOCK_PATHS, GEMM_RTOL
    _, folder = ckpt(name)
    model = load_model(folder, progress=False)
    b, paths = _kept_cuda(model, monkeypatch, "cuda", "bf16")
    _check_kept(b, paths, model, path, max(rtol, 3e-2))


def _scale_bug(change):
    real = fp8_checkpoints.float_tensor
    return lambda mp: mp.setattr(fp8_checkpoints, "float_tensor", lambda *a: change(real(*a).copy()))


def _double_one(s):
    s.reshape(-1)[min(1, s.size - 1)] *= 2
    return s


PLANTED = {  # a bug -> the case that must expose it
    "one block's scale wrong": ("blockwise", _scale_bug(_double_one)),
    "block rows off by one": ("blockwise", _scale_bug(lambda s: np.roll(s, 1, axis=0))),
    "block columns off by one": ("ct_block", _scale_bug(lambda s: np.roll(s, 1, axis=1))),
    "scale_inv taken as a divisor": ("blockwise", _scale_bug(lambda s: 1 / s)),
}


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # a scale inverted overflows the interpreter's activations
@pytest.mark.parametrize("bug", PLANTED)
def test_planted_bug_fails_the_check(ckpt, bug, monkeypatch):
    name, plant = PLANTED[bug]
    dense, folder = ckpt(name)
    plant(monkeypatch)
    with pytest.raises(AssertionError, match="max abs err"):
        check_interpreter(folder, dense, PROMPT)


_CT = {"quant_method": "compressed-tensors", "format": "float-quantized"}


@pytest.mark.parametrize("change,message", [
    ({"quant_method": "fp8", "fmt": "e5m2"}, "fmt 'e5m2'"),
    ({"quant_method": "fp8", "activation_scheme": "static"}, "activation_scheme 'static'"),
    ({**_CT, "config_groups": {"g": {"weights": {"type": "float", "num_bits": 8, "strategy": "group"}}}},
     "strategy 'group'"),
    ({**_CT, "config_groups": {"g": {"weights": {"type": "float", "num_bits": 4, "strategy": "tensor"}}}},
     "4-bit weights of type 'float'"),
    ({**_CT, "config_groups": {"g": {"weights": {"type": "float", "num_bits": 8, "strategy": "tensor"},
                                     "input_activations": {"dynamic": False}}}}, "static input activation scales"),
    ({"quant_method": "fp8", "weight_block_size": [128, 40]}, r"in blocks of \[128, 40\]; expected \[2, 5\]"),
])
def test_unsupported_variants_are_named(ckpt, tmp_path, change, message):
    _, folder = ckpt("blockwise")
    with_quant_config(folder, tmp_path, change)
    with pytest.raises(ModelFormatError, match=message):
        load_model(tmp_path, progress=False)
