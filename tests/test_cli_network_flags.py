"""The server's address flags: llama.cpp-style --h / --p and the --host / --port that vLLM's and llama-server's users
type, one destination each; and vLLM's spellings of other flags."""

from frontend import cli


def test_host_and_port_in_both_spellings():
    long = cli.parser().parse_args(["--host", "0.0.0.0", "--port", "8000"])
    short = cli.parser().parse_args(["--h", "::1", "--p", "9"])
    default = cli.parser().parse_args([])
    assert (long.h, long.p) == ("0.0.0.0", 8000)
    assert (short.h, short.p) == ("::1", 9)
    assert (default.h, default.p) == ("127.0.0.1", 2000)


def test_vllm_spellings_of_dtype_and_eager():
    """vLLM's --dtype names and --enforce-eager mean ours; auto is the backend's choice; a wrong name is refused
    with the choices."""
    import pytest

    for text, dtype in [("bfloat16", "bf16"), ("half", "f16"), ("float16", "f16"), ("float", "f32"), ("f32", "f32"),
                        ("auto", None)]:
        assert cli.parser().parse_args(["--dtype", text]).dtype == dtype
    assert cli.parser().parse_args(["--enforce-eager"]).disable_cuda_graph
    assert not cli.parser().parse_args([]).disable_cuda_graph
    with pytest.raises(SystemExit):
        cli.parser().parse_args(["--dtype", "fp4"])
