"""tools.synth_gguf, tools.llama_cpp and tools.bench_gguf without a GPU.

- The synthetic GGUF: a tiny one (2 layers, hidden 64) loads with our loader, and our reference interpreter's logits
  match transformers' own GGUF loader on the same file. transformers knows llama.cpp's convention independently
  (tensor names, [out, in] shapes, and the q/k row permutation it undoes itself), so agreement proves the file is
  laid out as llama.cpp's converter lays it out; a control without our un-permutation must disagree. With the real
  Llama-3 vocab metadata (from llama.cpp's vocab-only GGUF) the file loads with its tokenizer; transformers is kept
  to a small-vocab file there because its GGUF reader takes ~40 s over 128k tokens and 280k merges.
- The output parsers, on text printed with the format strings of llama-bench's and llama-batched-bench's source
  (checked verbatim against that source when llama.cpp-src.tgz is at hand), and the stage plumbing.
- The report and its plot from a results dict.
"""

from __future__ import annotations

import json
import re
import stat
import tarfile

import numpy as np
import pytest
import torch
from tiny_hf import assert_close, random_prompt

from ir.formats.gguf_file import GGUFFile
from ir.loader import load_model
from ir.reference import ReferenceRunner
from ir.weights import StoredTensor
from tools import bench_gguf, bench_gguf_report, llama_cpp, synth_gguf

TINY = synth_gguf.LlamaShape(vocab=512, hidden=64, intermediate=128, heads=4, kv_heads=2, head_dim=16, layers=2)
# Weights large enough that logits spread over several units and attention is sharp: a wrong q/k order shows.
STD = 0.25


def _src_tarball():
    return next((p for p in synth_gguf.src_tarballs() if p.is_file()), None)


@pytest.fixture(scope="module")
def vocab_file(tmp_path_factory):
    tgz = _src_tarball()
    if tgz is None:
        pytest.skip("llama.cpp-src.tgz is in neither .peers/ nor ../shared/peers")
    return synth_gguf.extract_vocab(tgz, tmp_path_factory.mktemp("vocab"))


@pytest.fixture(scope="module")
def small_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("small") / "tiny.gguf"
    return synth_gguf.write_model(path, TINY, None, std=STD, seed=3, device="cpu", progress=False)


def test_synthetic_gguf_matches_transformers(small_file):
    from transformers import AutoModelForCausalLM

    ours = load_model(small_file, progress=False)
    ref = AutoModelForCausalLM.from_pretrained(small_file.parent, gguf_file=small_file.name, dtype=torch.float32,
                                               attn_implementation="eager").eval()
    ids = random_prompt(5, 12, TINY.vocab)
    with torch.no_grad():
        want = ref(torch.tensor([ids])).logits[0].numpy()
    assert_close(ReferenceRunner(ours, max_tokens=32).prompt_logits(ids), want)

    # Control: the file's q/k rows taken as they are (llama.cpp's interleaved order) must give other logits.
    raw = GGUFFile(small_file).tensors
    for i in range(TINY.layers):
        for p, name in (("wq", "attn_q"), ("wk", "attn_k")):
            t = raw[f"blk.{i}.{name}.weight"]
            ours.weights[f"layers.{i}.{p}"] = StoredTensor(t.data, t.qtype, t.shape)
    wrong = ReferenceRunner(ours, max_tokens=32).prompt_logits(ids)
    assert np.abs(wrong - want).max() > 0.05 * np.abs(want).max()


def test_synthetic_gguf_names_and_metadata(small_file):
    import gguf

    f = GGUFFile(small_file)
    llama_names = {gguf.TENSOR_NAMES[t] for t in gguf.MODEL_TENSORS[gguf.MODEL_ARCH.LLAMA]}
    for name, t in f.tensors.items():
        base = name.removesuffix(".weight")
        assert ("blk.{bid}." + base.split(".", 2)[2] if base.startswith("blk.") else base) in llama_names, name
        assert t.qtype == ("F32" if len(t.shape) == 1 else "F16")
    loaded = load_model(small_file, progress=False)
    assert set(loaded.sources.values()) == set(f.tensors)  # every tensor of the file is bound, none is missing
    c = loaded.config
    assert (c.vocab_size, c.hidden_size, c.intermediate_size, c.num_layers, c.num_heads, c.num_kv_heads,
            c.head_dim, c.rope.theta, c.max_position_embeddings) == (512, 64, 128, 2, 4, 2, 16, 500000.0, 32768)
    emb = loaded.weights["embed"].dequantize()
    assert abs(float(emb.std()) - STD) < 0.02 * STD and abs(float(emb.mean())) < 0.01
    assert np.all(loaded.weights["final_norm"].dequantize() == 1)
    assert synth_gguf.file_bytes(TINY) == sum(t.data.nbytes for t in f.tensors.values())


def test_synthetic_gguf_with_llama3_vocab(vocab_file, tmp_path):
    """The tokenizer metadata is copied key for key, and the file loads with its Llama-3 tokenizer."""
    shape = synth_gguf.LlamaShape(hidden=64, intermediate=128, heads=4, kv_heads=2, head_dim=16, layers=2)
    path = synth_gguf.write_model(tmp_path / "v.gguf", shape, vocab_file, device="cpu", progress=False)
    src = synth_gguf.tokenizer_metadata(vocab_file)  # the vocab file's tokenizer.* keys (cached from the write)
    assert src and all(k.startswith("tokenizer.") for k in src)
    loaded = load_model(path, progress=False)
    meta = GGUFFile(path).metadata
    assert {k: meta[k] for k in src} == src and len(src["tokenizer.ggml.tokens"]) == 128256
    assert loaded.config.vocab_size == 128256 and loaded.config.bos_token_id == src["tokenizer.ggml.bos_token_id"]
    text = "Hello world, this is a synthetic Llama-3!"
    ids = loaded.tokenizer.encode(text, add_special_tokens=False)
    assert 1 < len(ids) < len(text) and loaded.tokenizer.decode(ids) == text
    with pytest.raises(ValueError, match="vocab"):
        synth_gguf.write_model(tmp_path / "w.gguf", TINY, vocab_file, device="cpu", progress=False)


# --- parsers, on the source's own formats -----------------------------------------------------------------------

# llama-batched-bench.cpp's LOG format strings (C literals, unescaped): the jsonl line in its two literal halves,
# and the Markdown table's header, rule and row.
BATCHED_JSONL = ('{"n_kv_max": %d, "n_batch": %d, "n_ubatch": %d, "flash_attn": %d, "is_pp_shared": %d, '
                 '"n_gpu_layers": %d, "n_threads": %u, "n_threads_batch": %u, ',
                 '"pp": %d, "tg": %d, "pl": %d, "n_kv": %d, "t_pp": %f, "speed_pp": %f, "t_tg": %f, "speed_tg": %f, '
                 '"t": %f, "speed": %f}\n')
BATCHED_HEAD = "|%6s | %6s | %4s | %6s | %8s | %8s | %8s | %8s | %8s | %8s |\n"
BATCHED_RULE = "|%6s-|-%6s-|-%4s-|-%6s-|-%8s-|-%8s-|-%8s-|-%8s-|-%8s-|-%8s-|\n"
BATCHED_ROW = "|%6d | %6d | %4d | %6d | %8.3f | %8.2f | %8.3f | %8.2f | %8.3f | %8.2f |\n"
# llama-bench.cpp: test::get_fields() and the printers' format strings.
BENCH_FIELDS = ("build_commit build_number cpu_info gpu_info backends model_filename model_type model_size "
                "model_n_params n_batch n_ubatch n_threads cpu_mask cpu_strict poll type_k type_v n_gpu_layers "
                "n_cpu_moe split_mode main_gpu no_kv_offload flash_attn devices tensor_split tensor_buft_overrides "
                "load_mode lazy_mode embeddings no_op_offload no_host repack fit_target fit_min_ctx n_prompt n_gen "
                "n_depth test_time avg_ns stddev_ns avg_ts stddev_ts").split()
BENCH_INT = set("build_number n_batch n_ubatch n_threads poll model_size model_n_params n_gpu_layers main_gpu "
                "n_prompt n_gen n_depth avg_ns stddev_ns no_op_offload n_cpu_moe fit_target fit_min_ctx "
                "flash_attn".split())
BENCH_BOOL = set("no_kv_offload cpu_strict embeddings no_host repack".split())
BENCH_JSONL = ('"%s": %s, ', '"samples_ns": [ %s ],', '"samples_ts": [ %s ]', "}\n")
BENCH_JSON = ('    "%s": %s,\n', '    "samples_ns": [ %s ],\n', '    "samples_ts": [ %s ]\n')


def _c_literal(s: str) -> str:
    return s.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def test_formats_are_the_sources(tmp_path):
    tgz = _src_tarball()
    if tgz is None:
        pytest.skip("llama.cpp-src.tgz is in neither .peers/ nor ../shared/peers")
    with tarfile.open(tgz, "r:gz") as tar:
        batched = tar.extractfile("llc/tools/batched-bench/batched-bench.cpp").read().decode()
        bench = tar.extractfile("llc/tools/llama-bench/llama-bench.cpp").read().decode()
    for s in (*BATCHED_JSONL, BATCHED_HEAD, BATCHED_RULE, BATCHED_ROW):
        assert f'"{_c_literal(s)}"' in batched, s
    for s in (*BENCH_JSONL, *BENCH_JSON):
        assert f'"{_c_literal(s)}"' in bench, s
    block = re.search(r"get_fields\(\) \{.*?fields = \{(.*?)\};", bench, re.S)
    assert block and re.findall(r'"(\w+)"', block.group(1)) == BENCH_FIELDS


def _bench_values(rng, n_prompt: int, n_gen: int, depth: int, samples: list[int]) -> dict[str, str]:
    """get_values() as C++ prints them: ints, bools as 0/1, std::to_string(double) as %f."""
    tok = n_prompt + n_gen
    ts = [1e9 * tok / s for s in samples]
    v = {f: "x" for f in BENCH_FIELDS}
    v.update({f: str(int(rng.integers(0, 9))) for f in BENCH_INT | BENCH_BOOL})
    v.update(model_type="llama 8B F16", gpu_info="NVIDIA H200", cpu_info="Intel(R) Xeon(R) \\uffffffc3\\uffffffa9",
             model_size=str(16060522496), n_prompt=str(n_prompt), n_gen=str(n_gen), n_depth=str(depth),
             avg_ts=f"{np.mean(ts):f}", stddev_ts=f"{np.std(ts, ddof=1):f}", avg_ns=str(int(np.mean(samples))))
    return v


def _bench_json_value(field: str, value: str) -> str:
    if field in BENCH_BOOL:
        return "false" if value == "0" else "true"
    return value if field in BENCH_INT or field in ("avg_ts", "stddev_ts") else f'"{value}"'


def _samples(rng) -> list[int]:
    return [int(x) for x in rng.integers(10**8, 10**9, 3)]


def test_parse_llama_bench_jsonl_and_json():
    rng = np.random.default_rng(0)
    tests = [(0, 128, 0), (2048, 0, 0), (0, 128, 4096)]
    made = [(t, _samples(rng)) for t in tests]
    values = [_bench_values(rng, *t, s) for t, s in made]
    jsonl = ""
    for (_, s), v in zip(made, values, strict=True):
        ts = ", ".join(f"{1e9 * (int(v['n_prompt']) + int(v['n_gen'])) / x:f}" for x in s)
        jsonl += "{" + "".join(BENCH_JSONL[0] % (f, _bench_json_value(f, v[f])) for f in BENCH_FIELDS)
        jsonl += BENCH_JSONL[1] % ", ".join(map(str, s)) + BENCH_JSONL[2] % ts + BENCH_JSONL[3]
    as_json = "[\n" + ",\n".join(
        "  {\n" + "".join(BENCH_JSON[0] % (f, _bench_json_value(f, v[f])) for f in BENCH_FIELDS)
        + BENCH_JSON[1] % ", ".join(map(str, s)) + BENCH_JSON[2] % "1.0" + "  }"
        for (_, s), v in zip(made, values, strict=True)) + "\n]\n"
    for text in (jsonl, as_json):
        got = llama_cpp.parse_bench(text)
        assert [(r.n_prompt, r.n_gen, r.n_depth) for r in got] == tests
        for r, v in zip(got, values, strict=True):
            assert r.avg_ts == pytest.approx(float(v["avg_ts"])) and r.stddev_ts == pytest.approx(float(v["stddev_ts"]))
            assert r.reps == 3 and r.model_size == 16060522496 and r.gpu_info == "NVIDIA H200"
    assert [r.test for r in llama_cpp.parse_bench(jsonl)] == ["tg128", "pp2048", "tg128 @ d4096"]


def _batched_rows(rng, pl_list, pp: int, tg: int) -> list[tuple]:
    out = []
    for pl in pl_list:
        t_pp, t_tg = float(rng.uniform(0.01, 3)), float(rng.uniform(0.1, 5))
        out.append((pp, tg, pl, pl * (pp + tg), t_pp, pl * pp / t_pp, t_tg, pl * tg / t_tg, t_pp + t_tg,
                    pl * (pp + tg) / (t_pp + t_tg)))
    return out


def test_parse_batched_bench_jsonl_and_table():
    rows = _batched_rows(np.random.default_rng(1), (1, 16, 64), 128, 128)
    head = (65536, 2048, 512, 1, 0, 99, 16, 16)
    jsonl = "\n" + "".join((BATCHED_JSONL[0] + BATCHED_JSONL[1]) % (*head, *r) for r in rows) + "\n"
    table = ("\nmain: n_kv_max = 65536, n_batch = 2048, ...\n\n"
             + BATCHED_HEAD % ("PP", "TG", "B", "N_KV", "T_PP s", "S_PP t/s", "T_TG s", "S_TG t/s", "T s", "S t/s")
             + BATCHED_RULE % (("------",) * 2 + ("----",) + ("------",) + ("--------",) * 6)
             + "".join(BATCHED_ROW % r for r in rows) + "\n")
    for text, tol in ((jsonl, 1e-6), (table, 1e-2)):
        got = llama_cpp.parse_batched(text)
        assert [(r.pp, r.tg, r.pl, r.n_kv) for r in got] == [r[:4] for r in rows]
        for g, r in zip(got, rows, strict=True):
            assert g.speed_tg == pytest.approx(r[7], abs=tol, rel=1e-6)
            assert g.speed_pp == pytest.approx(r[5], abs=tol, rel=1e-6)


FAKE_BATCHED = """#!/usr/bin/env python3
# Stands in for llama-batched-bench: the rows its source prints, and its rule that a row whose KV does not fit
# the context (-c) is skipped without a word.
import sys
a = sys.argv[1:]
def opt(name): return a[a.index(name) + 1]
c, pp, tg = int(opt("-c")), int(opt("-npp")), int(opt("-ntg"))
shared = "-pps" in a
open(sys.argv[0] + ".args", "w").write(" ".join(a))
for pl in map(int, opt("-npl").split(",")):
    need = (pp if shared else pl * pp) + pl * tg
    if need <= c:
        print(FORMAT % (c, 2048, 512, 1, int(shared), 99, 16, 16, pp, tg, pl, need, 1.0, 100.0, 2.0, pl * tg / 2.0,
                        3.0, 5.0))
"""


def test_batched_bench_command(tmp_path):
    script = tmp_path / "llama-batched-bench"
    script.write_text(FAKE_BATCHED.replace("FORMAT", repr(BATCHED_JSONL[0] + BATCHED_JSONL[1].rstrip("\n"))))
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    lc = llama_cpp.LlamaCpp(tmp_path)
    rows = lc.batched_bench(tmp_path / "m.gguf", 1024, 128, (1, 16), shared_prompt=True)
    assert [(r.pl, r.speed_tg) for r in rows] == [(1, 64.0), (16, 1024.0)]
    args = (tmp_path / "llama-batched-bench.args").read_text().split()
    assert args[args.index("-fa") + 1] == "on" and args[args.index("-ngl") + 1] == "99"
    assert args[args.index("--output-format") + 1] == "jsonl"
    assert lc.env()["LD_LIBRARY_PATH"].split(":")[0] == str(tmp_path)


# --- the plan, the merged results, the report -------------------------------------------------------------------

def test_plan_has_every_figure_once():
    args = bench_gguf.parse_args(["--stage", "report"])
    keys = [f.key for f in bench_gguf.plan(args.files, args.what, args.batches, args.contexts)]
    assert len(keys) == len(set(keys))
    want = ([f"f16 decode b{b} c128" for b in (1, 16, 64, 256)] + ["f16 prefill 2048", "q4km prefill 2048"]
            + [f"q4km decode b{b} c128" for b in (1, 16, 64)] + ["q5km decode b1 c128", "q8_0 decode b1 c128"]
            + [f"f16 decode b{b} c{c}" for b in (1, 16) for c in (128, 1024, 4096, 8192, 16384, 32768)])
    assert set(keys) == set(want)
    sub = bench_gguf.parse_args(["--stage", "ours", "--files", "f16", "--what", "curve", "--contexts", "32k",
                                 "--batches", "16"])
    assert [f.key for f in bench_gguf.plan(sub.files, sub.what, sub.batches, sub.contexts)] == ["f16 decode b16 c32768"]


def test_results_merge_across_stages(tmp_path):
    fig = bench_gguf.Figure("f16", "decode", 16, 1024)
    bench_gguf.Results(tmp_path / "r.json", "llamacpp").put(fig, "llamacpp", {"tok_s": 3.0, "tool": "x"})
    later = bench_gguf.Results(tmp_path / "r.json", "ours", out=tmp_path / "out")
    later.put(fig, "ours", {"tok_s": 2.0, "tool": "y"})
    got = json.loads((tmp_path / "out" / "r.json").read_text())["figures"][fig.key]
    assert (got["ours"]["tok_s"], got["llamacpp"]["tok_s"]) == (2.0, 3.0)
    assert got["ours"]["stage"] == "ours" and got["llamacpp"]["stage"] == "llamacpp" and got["ours"]["time"]


def _results(rng) -> dict:
    figs = {}
    for f in bench_gguf.plan(list(bench_gguf.FILES), list(bench_gguf.WHAT), None, list(bench_gguf.CONTEXTS)):
        e = {"file": f.file, "kind": f.kind, "batch": f.batch, "context": f.context}
        for side in ("ours", "llamacpp"):
            e[side] = {"tok_s": float(rng.uniform(50, 5000)) * f.batch, "time": "2026-01-01T00:00:00+00:00",
                       "stage": side, "tool": side}
        figs[f.key] = e
    files = {k: {"file_bytes": 16e9, "read_bytes": 15e9, "kv_bytes_per_token": 131072, "bytes_by_type": {"F16": 1}}
             for k in bench_gguf.FILES}
    return {"figures": figs, "files": files, "env": {"copy_gbs": 4000.0, "gpu": "H200"}, "stages": [], "errors": []}


def test_report_rows_and_plot(tmp_path):
    pytest.importorskip("matplotlib")
    res = _results(np.random.default_rng(2))
    written = bench_gguf_report.write_report(res, tmp_path / "rep", out=tmp_path / "out")
    png = tmp_path / "rep" / bench_gguf_report.PLOT_NAME
    assert png in written and (tmp_path / "out" / png.name).exists()
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 20_000
    rows = {r["figure"]: r for r in json.loads((tmp_path / "rep" / "report.json").read_text())["rows"]}
    assert len(rows) == len(res["figures"])
    r = rows["F16 decode b1 @ 128"]
    fig = res["figures"]["f16 decode b1 c128"]
    assert r["ours_vs_llamacpp"] == pytest.approx(fig["ours"]["tok_s"] / fig["llamacpp"]["tok_s"])
    # batch 1 at 128 tokens: nearly all the bytes are weights, so the roofline is near bandwidth / weight bytes
    assert 0.99 < r["roofline"] / (4000e9 / 15e9) < 1
    assert rows["F16 decode b16 @ 32k"]["roofline"] < rows["F16 decode b16 @ 128"]["roofline"] / 2
    assert rows["F16 prefill 2048"]["roofline"] is None
    md = (tmp_path / "rep" / "report.md").read_text()
    assert all(f"| {name} |" in md for name in rows)


def test_mmq_choice():
    """--mmq names a variant and optionally the most rows the GEMM takes; anything else is refused by name."""
    from tools.bench_gguf import parse_args

    assert parse_args(["--stage", "ours", "--mmq", "per256:64"]).mmq == ("per256", 64)
    assert parse_args(["--stage", "ours", "--mmq", "per32"]).mmq == ("per32", None)
    assert parse_args(["--stage", "ours"]).mmq is None
    for bad in ("per64", "per256:2", "per256:x"):
        with pytest.raises(SystemExit):
            parse_args(["--stage", "ours", "--mmq", bad])


def test_kv_cache_dtype_choice():
    """--kv-cache-dtype takes the CUDA backend's caches (issue 17's 16k figure compares auto and fp8)."""
    from tools.bench_gguf import parse_args

    assert [parse_args(["--stage", "ours", "--kv-cache-dtype", d]).kv_cache_dtype for d in ("auto", "int8", "fp8")] \
        == ["auto", "int8", "fp8"]
    with pytest.raises(SystemExit):
        parse_args(["--stage", "ours", "--kv-cache-dtype", "int4"])
