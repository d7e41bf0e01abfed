"""The default model through the IR's numpy interpreter against transformers on the same GGUF."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def prompt_ids(smollm, hf_smollm_tokenizer):
    ours = smollm.tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True)
    theirs = hf_smollm_tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True)
    theirs = theirs["input_ids"] if isinstance(theirs, dict) or hasattr(theirs, "keys") else theirs
    assert ours == list(theirs)
    assert len(ours) == 37
    return ours


@pytest.fixture(scope="module")
def ours(smollm, prompt_ids):
    from ir.reference import ReferenceRunner

    eos = smollm.tokenizer.eos_id
    return ReferenceRunner(smollm, max_tokens=64).greedy([prompt_ids], 16, suppress=[eos])


def test_chat_prompt_ids_match_transformers(prompt_ids, smollm):
    text = smollm.tokenizer.render_chat(MESSAGES, add_generation_prompt=True)
    assert text.endswith("<|im_start|>assistant\n")
    assert "What is the capital of France?" in text


def test_step0_logits_match_transformers(ours, hf_smollm, prompt_ids):
    with torch.no_grad():
        ref = hf_smollm(torch.tensor([prompt_ids])).logits[0, -1].numpy()
    first = ours[1][0]
    # The top-2 logits of this prompt differ by only ~0.08, so 1e-3 is a bound that still means
    # something; a wrong rope, norm or permutation shows up as errors of order 1.
    assert np.abs(first - ref).max() < 1e-3
    assert first.argmax() == ref.argmax()


def test_greedy_tokens_match_transformers(ours, hf_smollm, smollm, prompt_ids):
    eos = smollm.tokenizer.eos_id
    with torch.no_grad():
        out = hf_smollm.generate(torch.tensor([prompt_ids]), max_new_tokens=16, min_new_tokens=16,
                                 do_sample=False, suppress_tokens=[eos], eos_token_id=None,
                                 pad_token_id=0)
    theirs = out[0, len(prompt_ids):].tolist()
    assert ours[0][0] == theirs
    assert len(theirs) == 16
    assert "Paris" in smollm.tokenizer.decode(theirs)


def test_batched_prompts_decode_like_alone(smollm, prompt_ids):
    """Three prompts of different lengths in one varlen batch give the tokens each gives alone."""
    from ir.reference import ReferenceRunner

    runner = ReferenceRunner(smollm, max_tokens=64)
    tok = smollm.tokenizer
    prompts = [prompt_ids, tok.encode("The quick brown fox"), tok.encode("1, 2, 3, 4,")]
    together, _ = runner.greedy(prompts, 6)
    alone = [runner.greedy([p], 6)[0][0] for p in prompts]
    assert together == alone
