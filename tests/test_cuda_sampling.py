"""backends.cuda.sampling.TorchSampler against the engine's CPU sampler: the same seeds must give the same
tokens, the same logprobs and the same use of each request's random stream. On CPU tensors, or on the GPU
where there is one."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from backends.cuda.sampling import TorchSampler, _adjust, _host_arrays, _to_device
from core.sampler import Sampler, SampleResult, adjusted_logits, make_generator, sampling_probs
from core.sampling_params import SamplingParams
from tests.test_sampler import CHI2_CRIT_001, Seq, chi_square

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def on_device(x: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(x).to(DEVICE)


def random_params(rng: np.random.Generator, vocab: int) -> SamplingParams:
    kw: dict = {"temperature": 0.0 if rng.random() < 0.2 else float(rng.choice([0.3, 0.7, 1.0, 1.5, 3.0]))}
    if rng.random() < 0.4:
        kw["top_k"] = int(rng.choice([1, 2, 5, 40, vocab // 2, vocab - 1, vocab, vocab + 3]))
    if rng.random() < 0.4:
        kw["top_p"] = float(rng.choice([0.1, 0.5, 0.9, 0.95, rng.uniform(0.05, 1.0)]))
    if rng.random() < 0.3:
        kw["min_p"] = float(rng.choice([0.01, 0.1, 0.5, 1.0, rng.uniform(0, 0.3)]))
    if rng.random() < 0.25:  # some ids out of the vocabulary, which both samplers skip
        kw["logit_bias"] = {int(t): float(rng.uniform(-5, 5)) for t in rng.integers(-2, vocab + 2, 4)}
    if rng.random() < 0.3:
        kw["repetition_penalty"] = float(rng.choice([0.7, 1.3, 2.0]))
    if rng.random() < 0.3:
        kw["frequency_penalty"] = float(rng.uniform(-2, 2))
    if rng.random() < 0.3:
        kw["presence_penalty"] = float(rng.uniform(-2, 2))
    if rng.random() < 0.5:
        kw["logprobs"] = int(rng.integers(0, 6))
    return SamplingParams(**kw)


def random_logits(rng: np.random.Generator, n: int, vocab: int) -> np.ndarray:
    x = rng.standard_normal((n, vocab)) * rng.choice([0.5, 2.0, 5.0], (n, 1))
    ties = rng.random(n) < 0.4
    x[ties] = np.round(x[ties] * 2) / 2  # many exact ties: at top_k's edge, top_p's cut and the argmax
    for i in np.flatnonzero(rng.random(n) < 0.15):
        x[i, rng.random(vocab) < 0.5] = -np.inf
    return x.astype(np.float32)


def twin_batches(specs) -> tuple[list[Seq], list[Seq]]:
    """The same requests twice, each side with its own generators made from the same seeds."""
    def make():
        return [Seq(p, make_generator(seed), list(prompt), list(out)) for p, seed, prompt, out in specs]
    return make(), make()


def assert_same(cpu: list[SampleResult], dev: list[SampleResult]) -> None:
    assert [r.token for r in dev] == [r.token for r in cpu]
    for a, b in zip(cpu, dev, strict=True):
        if a.logprob is None:
            assert b.logprob is None and b.top_logprobs is None
            continue
        assert b.logprob == pytest.approx(a.logprob, abs=1e-4)
        assert [i for i, _ in b.top_logprobs] == [i for i, _ in a.top_logprobs]
        np.testing.assert_allclose([v for _, v in b.top_logprobs], [v for _, v in a.top_logprobs], atol=1e-4)


def run_both(logits: np.ndarray, cpu: list[Seq], dev: list[Seq]) -> list[int]:
    expected = Sampler()(logits, cpu)
    got = TorchSampler()(on_device(logits), dev)
    assert_same(expected, got)
    return [r.token for r in got]


def random_specs(rng: np.random.Generator, n: int, vocab: int) -> list:
    """(params, seed, prompt ids (some out of the vocabulary), output ids) for n requests."""
    def ids(lo: int, hi: int, most: int) -> list[int]:
        return rng.integers(lo, hi, rng.integers(0, most)).tolist()
    return [(random_params(rng, vocab), int(rng.integers(1 << 30)), ids(-1, vocab + 1, 30), ids(0, vocab, 20))
            for _ in range(n)]


@pytest.mark.parametrize(("vocab", "batches"), [(50, 150), (5000, 80), (32000, 6)])
def test_random_params_match_cpu_sampler(vocab, batches):
    # 5000 and 32000 take the CPU sampler's two-level draw and top_p's quickselect path.
    rng = np.random.default_rng(vocab)
    for _ in range(batches):
        n = int(rng.integers(1, 17))
        cpu, dev = twin_batches(random_specs(rng, n, vocab))
        run_both(random_logits(rng, n, vocab), cpu, dev)
        for a, b in zip(cpu, dev, strict=True):  # each stream was used the same number of times
            assert a.generator.random() == b.generator.random()


def test_adjusted_logits_bit_for_bit():
    # The float32/float64 steps of bias and penalties are the CPU's exactly, not just close.
    rng = np.random.default_rng(9)
    specs = [(SamplingParams(repetition_penalty=float(rng.uniform(0.5, 2)), frequency_penalty=float(rng.uniform(-2, 2)),
                             presence_penalty=float(rng.uniform(-2, 2)), logit_bias={3: 0.1, 7: -1.3, 3000: 2.2}),
              0, rng.integers(0, 4000, 50).tolist(), rng.integers(0, 4000, 300).tolist()) for _ in range(6)]
    seqs, _ = twin_batches(specs)
    logits = random_logits(rng, len(seqs), 4000)
    got = _adjust(on_device(logits), _to_device(_host_arrays(seqs, 4000), DEVICE)).cpu().numpy()
    expected = np.stack([adjusted_logits(row, seq) for row, seq in zip(logits, seqs, strict=True)])
    assert np.array_equal(got, expected)


def test_penalties_read_the_token_history_as_the_lists():
    """With a TokenHistory (as the engine gives each penalized sequence) the device reads its distinct ids and
    counts, not the token lists: bit for bit what the CPU sampler computes from the lists (out-of-vocabulary
    prompt ids included)."""
    from dataclasses import dataclass

    from core.sampler import TokenHistory

    @dataclass
    class Tracked(Seq):
        history: TokenHistory | None = None

    rng = np.random.default_rng(11)
    vocab = 3000
    specs = [(SamplingParams(repetition_penalty=1.4, frequency_penalty=float(rng.uniform(-2, 2)),
                             presence_penalty=float(rng.uniform(-2, 2))), 0,
              rng.integers(-3, vocab + 3, 40).tolist(), rng.integers(0, 60, 500).tolist()) for _ in range(5)]
    plain, _ = twin_batches(specs)
    tracked = []
    for p, _, prompt, out in specs:
        history = TokenHistory(prompt)
        for t in out:
            history.add(t)
        # the lists are poisoned: only the history may be read
        tracked.append(Tracked(p, make_generator(0), [vocab - 1] * len(prompt), [0] * len(out), history))
    logits = random_logits(rng, len(specs), vocab)
    got = _adjust(on_device(logits), _to_device(_host_arrays(tracked, vocab), DEVICE)).cpu().numpy()
    expected = np.stack([adjusted_logits(row, seq) for row, seq in zip(logits, plain, strict=True)])
    assert np.array_equal(got, expected)


def test_seeded_requests_over_many_steps():
    # Penalties follow the outputs, so one diverging token would show in every later step.
    rng = np.random.default_rng(1)
    cpu, dev = twin_batches(random_specs(rng, 8, 5000))
    for _ in range(12):
        tokens = run_both(random_logits(rng, 8, 5000), cpu, dev)
        for a, b, t in zip(cpu, dev, tokens, strict=True):
            a.output_token_ids.append(t)
            b.output_token_ids.append(t)


def test_shared_stream_is_consumed_in_row_order():
    # Rows that share one generator (as test_sampler's draw_counts does): only sampled rows draw.
    rng = np.random.default_rng(2)
    params = [SamplingParams(temperature=0), SamplingParams(temperature=0.9, top_p=0.8),
              SamplingParams(temperature=0, logprobs=2, repetition_penalty=1.5), SamplingParams(top_k=7)] * 4
    cpu_gen, dev_gen = make_generator(7), make_generator(7)
    cpu = [Seq(p, cpu_gen, [1, 2], [3]) for p in params]
    dev = [Seq(p, dev_gen, [1, 2], [3]) for p in params]
    for _ in range(5):
        run_both(random_logits(rng, len(params), 300), cpu, dev)
    assert cpu_gen.random() == dev_gen.random()


def test_ties_at_the_edges():
    flat = np.zeros((1, 10), dtype=np.float32)
    cases = ((dict(top_p=0.3), {0, 1, 2}), (dict(top_p=0.35), {0, 1, 2, 3}), (dict(min_p=1.0), set(range(10))))
    for kw, support in cases:  # uniform weights: top_p keeps the lowest ids, min_p=1 keeps all the best
        seqs = [Seq(SamplingParams(**kw), make_generator(s)) for s in range(200)]
        tokens = {r.token for r in TorchSampler()(on_device(np.repeat(flat, 200, 0)), seqs)}
        assert tokens == support, kw
    edge = np.array([[3, 3, 3, 3, 3, 1, 0, 5, -1, 3]], dtype=np.float32)  # top_k=3 keeps 7 and all six 3s
    seqs = [Seq(SamplingParams(top_k=3, temperature=3.0), make_generator(s)) for s in range(300)]
    tokens = {r.token for r in TorchSampler()(on_device(np.repeat(edge, 300, 0)), seqs)}
    assert tokens == {0, 1, 2, 3, 4, 7, 9}


@pytest.mark.parametrize(("weights", "top_p", "support"), [
    ([5, 3, 2], 0.8, {0, 1}), ([6, 3, 1], 0.9, {0, 1}), ([4, 3, 2, 1], 0.9, {0, 1, 2}),
    ([1, 2, 3, 4], 0.9, {1, 2, 3}), ([3, 3, 3, 1], 0.9, {0, 1, 2}),
])
def test_top_p_mass_exactly_reached_stops_there(weights, top_p, support):
    logits = np.log(np.array([weights] * 300, dtype=np.float32) / sum(weights))
    seqs = [Seq(SamplingParams(top_p=top_p), make_generator(s)) for s in range(300)]
    assert {r.token for r in TorchSampler()(on_device(logits), seqs)} == support


class FixedU:
    """A stand-in generator: the samplers only ever call random()."""

    def __init__(self, u: float):
        self.u = u

    def random(self) -> float:
        return self.u


@pytest.mark.parametrize(("row", "u", "token"), [
    ([-np.inf, 0.0, 0.0], 0.0, 1),  # u = 0 never lands on a token without weight
    ([0.0, 0.0, -np.inf, 0.0], 0.5, 1),  # a target on a CDF step goes to the next token
    ([0.0, 0.0, -np.inf, 0.0], 1 - 2**-53, 3),
])
def test_draw_boundaries(row, u, token):
    logits = np.array([row], dtype=np.float32)
    for sampler, x in ((Sampler(), logits), (TorchSampler(), on_device(logits))):
        assert sampler(x, [Seq(SamplingParams(), FixedU(u))])[0].token == token


def test_non_finite_rows_take_the_argmax():
    x = np.random.default_rng(3).standard_normal((4, 64)).astype(np.float32)
    x[0] = -np.inf
    x[1, 17] = np.inf
    x[2, 5] = np.nan
    x[3, ::2] = -np.inf
    specs = [(SamplingParams(temperature=1.0, top_p=0.9, top_k=5), s, [], []) for s in range(4)]
    cpu, dev = twin_batches(specs)
    assert run_both(x, cpu, dev)[:3] == [0, 17, 5]


def test_draws_follow_sampling_probs():
    rng = np.random.default_rng(4)
    row = (rng.standard_normal(50) * 1.5).astype(np.float32)
    params = SamplingParams(temperature=1.3, top_k=9, top_p=0.95, min_p=0.02, repetition_penalty=1.4,
                            presence_penalty=0.5, logit_bias={3: 2.0})
    n, gen = 20_000, make_generator(1234)
    seqs = [Seq(params, gen, [1, 2, 3], [4, 4])] * n
    tokens = [r.token for r in TorchSampler()(on_device(np.tile(row, (n, 1))), seqs)]
    counts = np.bincount(tokens, minlength=50)
    expected = sampling_probs(adjusted_logits(row, seqs[0]), params)
    assert counts[expected == 0].sum() == 0
    stat, dof = chi_square(counts[expected > 0], expected[expected > 0])
    assert stat < CHI2_CRIT_001[dof], (stat, dof)


def test_never_writes_to_the_logits():
    rng = np.random.default_rng(5)
    logits = on_device(random_logits(rng, 12, 1000))
    before = logits.clone()
    params = SamplingParams(temperature=0.8, top_p=0.9, repetition_penalty=1.5, frequency_penalty=1.0,
                            logit_bias={1: 3.0}, logprobs=3)
    TorchSampler()(logits, [Seq(params, make_generator(i), [1, 2], [3, 3]) for i in range(12)])
    TorchSampler()(logits, [Seq(SamplingParams(temperature=0))] * 12)
    assert torch.equal(logits, before)


def test_rejects_mismatched_batch():
    with pytest.raises(ValueError):
        TorchSampler()(torch.zeros(2, 8, device=DEVICE), [Seq(SamplingParams())])


@pytest.mark.parametrize("temperature", [1e-300, 1e-6])
def test_tiny_temperature_is_greedy_as_on_the_cpu(temperature):
    rng = np.random.default_rng(12)
    x = random_logits(rng, 4, 500)
    specs = [(SamplingParams(temperature=temperature, top_k=k, logprobs=2), s, [], []) for s, k in enumerate((0, 5))]
    specs += [(SamplingParams(temperature=0.7), 9, [], []), (SamplingParams(temperature=temperature), 3, [], [])]
    cpu, dev = twin_batches(specs)
    tokens = run_both(x, cpu, dev)
    assert [tokens[0], tokens[1], tokens[3]] == x[[0, 1, 3]].argmax(axis=1).tolist()
    for a, b in zip(cpu, dev, strict=True):  # greedy rows draw nothing from their streams, on either sampler
        assert a.generator.random() == b.generator.random()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_argmax_rows_is_torchs_argmax(dtype):
    """argmax_rows (the greedy argmax in 32 parts, then the first part holding the maximum) gives torch's argmax,
    the first of equal maxima: ties inside a part, across parts (in 16-bit only too), a NaN (the largest, as in
    torch), an all -inf row, a row whose only maximum sits at each part's edge; a row not split evenly takes
    torch's own pass."""
    from backends.cuda.sampling import _argmax_parts

    def argmax_rows(x):  # the GPU's two passes, on whichever device the test runs
        return _argmax_parts(x, 32)

    rng = np.random.default_rng(7)
    vocab = 32 * 600
    x = torch.from_numpy(rng.standard_normal((9, vocab)).astype(np.float32))
    x[1, [5, 9000, 9001]] = 10.0  # the same maximum in part 0 and twice in part 15
    x[2, [9001, 70]] = 10.0
    x[3, 17000] = float("nan")
    x[3, 100] = float("inf")
    x[4] = float("-inf")
    x[5, 599], x[6, 600], x[7, vocab - 1] = 50.0, 50.0, 50.0  # the last of part 0, the first of part 1, the very last
    x[8, [1234, 1235]] = torch.tensor([8.0001, 8.0002])  # apart in fp32, the same bf16 value: the first in bf16
    x = x.to(DEVICE, dtype)
    want = x.argmax(1)
    got = argmax_rows(x)
    assert torch.equal(got, want) and got.dtype == want.dtype
    assert got[1:4].tolist() == [5, 70, 17000] and got[4] == 0 and got[5:8].tolist() == [599, 600, vocab - 1]
    assert got[8] == (1234 if dtype == torch.bfloat16 else 1235)
    odd = x[:, :vocab - 1]
    assert torch.equal(argmax_rows(odd), odd.argmax(1))


def test_greedy_16bit_logits_take_no_conversion():
    """The greedy path over bf16 logits (no conversion pass) picks what the fp32 logits give, the conversion being
    exact, and leaves the caller's logits as they were."""
    rng = np.random.default_rng(8)
    logits = torch.from_numpy(rng.standard_normal((3, 32 * 512)).astype(np.float32)).to(DEVICE, torch.bfloat16)
    before = logits.clone()
    seqs = [Seq(SamplingParams(temperature=0.0)) for _ in range(3)]
    got = [r.token for r in TorchSampler()(logits, seqs)]
    assert got == logits.float().argmax(1).tolist() and torch.equal(logits, before)
