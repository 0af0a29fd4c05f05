"""Incremental detokenisation of a streamed completion: the events' text is the whole decode, piece by piece."""

from __future__ import annotations

import random

import pytest
from plyx.serve import SamplingParams
from plyx.serve._completion import Completion
from plyx.serve._tokenizer import TokenizerView


def _byte_level():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    corpus = ["héllo wörld, the quick brown fox", "naïve café — 日本語のテキスト", "0123456789 !?"] * 10
    tok.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=400, special_tokens=["<|endoftext|>"],
                                                        show_progress=False,
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return tok


def _metaspace():
    """A SentencePiece-style tokenizer: the decoder strips the leading space of a sequence's first token."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Sequence([decoders.ByteFallback(), decoders.Metaspace()])
    corpus = ["hello world the quick brown fox", "naïve café 日本語", "a b c d e f g"] * 10
    specials = ["<unk>", "<s>"] + [f"<0x{b:02X}>" for b in range(256)]
    tok.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=400, special_tokens=specials, show_progress=False))
    return tok


@pytest.mark.parametrize("make", [_byte_level, _metaspace])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_streamed_text_is_the_whole_decode(make, seed):
    tok = TokenizerView(make())
    vocab = tok.vocab_size
    rng = random.Random(seed)
    ids = [rng.randrange(1, vocab) for _ in range(300)]  # random ids: broken UTF-8 sequences, leading spaces
    params = SamplingParams(max_new_tokens=len(ids), ignore_eos=True)
    c = Completion(request_index=0, index=0, prompt_ids=[1], params=params, stop_ids=[], context=10_000,
                   tokenizer=tok, seq_id=0, generator=None)
    streamed = ""
    for i, t in enumerate(ids):
        event = c.add([t])
        streamed += event.text
        whole = tok.decode(ids[:i + 1])
        # as decoding everything each token would: all but a trailing incomplete character, which waits
        assert streamed == (whole if c.finished else whole.rstrip("\ufffd"))
    assert c.finished and streamed == tok.decode(ids) == c.output().text


@pytest.mark.parametrize("seed", range(6))
def test_block_add_equals_token_by_token(seed):
    """``add`` of a block (one scan for the first stop id, ``_add_plain``) gives what taking its tokens one at a
    time gives (``_add_each``, the grammar and stop-string path): the tokens kept, finish and stop reasons, text,
    log-probs, and no event after the end; blocks of random sizes, stop ids and length limits."""
    from plyx.serve import TokenLogprob

    tok = TokenizerView(_byte_level())
    rng = random.Random(seed)
    stops = rng.sample(range(1, 60), rng.randrange(0, 3))
    params = SamplingParams(max_new_tokens=rng.randrange(1, 60), ignore_eos=True, logprobs=0 if seed % 2 else None)
    context = rng.choice([30, 10_000])  # 30: the context, not max_new_tokens, may be the limit

    def make():
        return Completion(request_index=0, index=1, prompt_ids=[1], params=params, stop_ids=stops,
                          context=context, tokenizer=tok, seq_id=0, generator=None)

    block, each = make(), make()
    for _ in range(40):
        tokens = [rng.randrange(1, 120) for _ in range(rng.randrange(0, 17))]
        lps = [TokenLogprob(t, -rng.random(), ()) for t in tokens] if params.logprobs is not None else None
        got, want = block.add(tokens, lps), each._add_each(tokens, lps)
        assert got == want
    assert block.output() == each.output()
    assert block.finished and block.finish_reason in ("stop", "length")
