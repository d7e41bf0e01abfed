"""The server's address flags: llama.cpp-style --h / --p and the --host / --port that vLLM's and llama-server's users
type, one destination each."""

from frontend import cli


def test_host_and_port_in_both_spellings():
    long = cli.parser().parse_args(["--host", "0.0.0.0", "--port", "8000"])
    short = cli.parser().parse_args(["--h", "::1", "--p", "9"])
    default = cli.parser().parse_args([])
    assert (long.h, long.p) == ("0.0.0.0", 8000)
    assert (short.h, short.p) == ("::1", 9)
    assert (default.h, default.p) == ("127.0.0.1", 2000)
