"""Token trees in the packed step: each tree token's logits equal those of its root-to-token path decoded as
a plain chain, and ``move_tokens`` keeps an accepted path's keys and values as if it had been fed alone."""

from __future__ import annotations

import pytest
import torch
from plyx.attn import PagedKVCache, begin_packed_step, cache_layout, move_tokens, tree_depths
from plyx.model import TransformerLM
from plyx.specs import ModelConfig

# a Medusa-like tree of 7 tokens under the root: depth 1 {1, 2}, depth 2 {3, 4 under 1; 5 under 2}, depth 3 {6, 7}
PARENTS = [-1, 0, 0, 1, 1, 2, 3, 5]


CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (the Triton attention kernel's mask)")


def _model(device="cpu"):
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=64, max_seq_len=128)
    return TransformerLM(cfg).to(device).eval()


def _cache(model, block_size=4):
    param = next(model.parameters())
    layout = cache_layout(model.config, max_seq_len=128, block_size=block_size, num_blocks=96,
                          device=str(param.device), dtype=param.dtype)
    return PagedKVCache(layout)


def _path(parents, j):
    out = []
    while j > 0:
        out.append(j)
        j = parents[j]
    return out[::-1]


def test_tree_depths_and_bad_trees():
    assert tree_depths(PARENTS) == [0, 1, 1, 2, 2, 2, 3, 3]
    with pytest.raises(ValueError, match="root"):
        tree_depths([0, 0])
    with pytest.raises(ValueError, match="parent 3"):
        tree_depths([-1, 0, 3])


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=CUDA)])
@pytest.mark.parametrize("prefix_len", [5, 13])
@torch.inference_mode()
def test_tree_logits_equal_each_path_decoded_alone(prefix_len, device):
    model = _model(device)
    g = torch.Generator().manual_seed(prefix_len)
    prefixes = [torch.randint(0, 64, (prefix_len + 3 * r,), generator=g).tolist() for r in range(2)]
    trees = [torch.randint(0, 64, (len(PARENTS),), generator=g).tolist() for _ in range(2)]
    cache = _cache(model)
    # prefill both sequences (one packed step), then a step with a decode row, a tree row and a second tree row
    ids, pos, step = begin_packed_step(cache, [0, 1, 2], [len(prefixes[0]), len(prefixes[1]), 3],
                                       prefixes[0] + prefixes[1] + [1, 2, 3], device)
    model(ids, position_ids=pos, kv_step=step)
    tokens = [9] + trees[0] + trees[1]
    ids, pos, step = begin_packed_step(cache, [2, 0, 1], [1, len(PARENTS), len(PARENTS)], tokens, device,
                                       tree_parents={1: PARENTS, 2: PARENTS})
    depths = tree_depths(PARENTS)
    assert pos[0, 1:1 + len(PARENTS)].tolist() == [len(prefixes[0]) + d for d in depths]
    assert sum(g.tree_mask is not None for g in step.varlen) == 1  # equal trees share one group
    logits = model(ids, position_ids=pos, kv_step=step)[0]  # (N, V)
    for r in range(2):
        for j in range(len(PARENTS)):
            chain = prefixes[r] + [trees[r][i] for i in [0] + _path(PARENTS, j)]
            ref = model(torch.tensor([chain], device=device))[0, -1]  # (V,) the path decoded as a plain sequence
            got = logits[1 + r * len(PARENTS) + j]
            torch.testing.assert_close(got, ref, atol=2e-4, rtol=2e-4)


@torch.inference_mode()
def test_move_tokens_keeps_the_accepted_path():
    model = _model()
    prefix = list(range(3, 14))
    tree = [int(t) for t in torch.randint(0, 64, (len(PARENTS),), generator=torch.Generator().manual_seed(1))]
    cache = _cache(model)
    ids, pos, step = begin_packed_step(cache, [0], [len(prefix)], prefix, "cpu")
    model(ids, position_ids=pos, kv_step=step)
    ids, pos, step = begin_packed_step(cache, [0], [len(PARENTS)], tree, "cpu", tree_parents={0: PARENTS})
    model(ids, position_ids=pos, kv_step=step)
    path = _path(PARENTS, 6)  # root -> 1 -> 3 -> 6: tree slots 1, 3, 6 move to 1, 2, 3 after the root
    L = len(prefix)
    move_tokens(cache, [(0, [L + j for j in path], [L + 1 + i for i in range(len(path))])])
    cache.crop(0, L + 1 + len(path))
    # the next token after the kept path, from the cache, equals a plain forward of the whole sequence
    nxt = 17
    ids, pos, step = begin_packed_step(cache, [0], [1], [nxt], "cpu")
    got = model(ids, position_ids=pos, kv_step=step)[0, 0]
    ref = model(torch.tensor([prefix + [tree[0]] + [tree[j] for j in path] + [nxt]]))[0, -1]
    torch.testing.assert_close(got, ref, atol=2e-4, rtol=2e-4)
