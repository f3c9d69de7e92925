"""The block-level BlockMask build (``block_mask_from_bounds``) against ``create_block_mask``.

``create_block_mask`` evaluates ``mask_mod`` at every (query, key) pair: the slow, obviously
right reference. The block build must give the same partial and full blocks (dense block
structure and index order), the same FlexAttention output (CPU forward), and must trace
under torch.compile with a tensor window without a recompile when the window changes.
"""
import pytest
import torch
from torch.nn.attention.flex_attention import create_block_mask

import kernels
import train_gpt as T
from test_attention import random_tokens, reference_attention


def reference_block_mask(doc, window, block_size):
    B, T_ = doc.shape
    return create_block_mask(kernels.mask_mod(doc, window), B, None, T_, T_, device="cpu", BLOCK_SIZE=block_size)


def dense_blocks(num, idx):
    """int32 counts [B, 1, nq] and indices [B, 1, nq, nk] -> bool [B, 1, nq, nk] of the listed blocks."""
    nk = idx.size(-1)
    listed = torch.arange(nk) < num[..., None].long()                 # the first num[i] entries count
    dense = torch.zeros(idx.shape, dtype=torch.bool)
    return dense.scatter(-1, idx.long(), listed)


def assert_same_blocks(got, ref):
    assert got.BLOCK_SIZE == ref.BLOCK_SIZE and got.seq_lengths == ref.seq_lengths
    for num, idx in (("kv_num_blocks", "kv_indices"), ("full_kv_num_blocks", "full_kv_indices"),
                     ("q_num_blocks", "q_indices"), ("full_q_num_blocks", "full_q_indices")):
        g_num, r_num = getattr(got, num), getattr(ref, num)
        assert torch.equal(g_num, r_num), num
        assert torch.equal(dense_blocks(g_num, getattr(got, idx)), dense_blocks(r_num, getattr(ref, idx))), idx
        # the listed blocks in the same order (FlexAttention visits them in this order)
        n = getattr(got, idx).size(-1)
        used = torch.arange(n) < g_num[..., None].long()
        assert torch.equal(getattr(got, idx)[used], getattr(ref, idx)[used]), idx
    assert torch.equal(got.to_dense(), ref.to_dense())


# T multiples of the block (and two that are not, as gpu_check's tiny model has), windows with
# 0 = none, windows below, at and above the block size and beyond T, short and long documents;
# windows of k * block + 1 and k * block - 1 put a bound exactly at the window (an off-by-one fails).
CASES = [(64, 16, w, p) for w in (0, 1, 5, 15, 16, 17, 31, 40, 1000) for p in (0.0, 0.03, 0.3)] + \
        [(96, 32, 33, 0.05), (128, 8, 9, 0.02), (128, 8, 23, 0.02), (40, 16, 7, 0.1), (64, 128, 0, 0.1)]


@pytest.mark.parametrize("T_, block_size, window, p_eot", CASES)
def test_block_structure_equals_create_block_mask(T_, block_size, window, p_eot):
    seed = T_ + block_size + window + int(100 * p_eot)
    doc = T.document_ids(random_tokens((3, T_), seed=seed, p_eot=p_eot))
    ref = reference_block_mask(doc, window, block_size)
    for w in (window, torch.tensor(window)) if window else (0,):  # an int, and the schedule's 0-d tensor
        assert_same_blocks(kernels.block_mask_from_bounds(doc, w, block_size), ref)


def test_cases_cover_every_kind_of_block():
    """The random cases above hold empty, partial and full blocks (else the equality tests prove little)."""
    doc = T.document_ids(random_tokens((3, 64), seed=64 + 16 + 40 + 3, p_eot=0.03))
    m = kernels.block_mask_from_bounds(doc, 40, 16)
    n_blocks = 3 * 4 * 4
    partial, full = int(m.kv_num_blocks.sum()), int(m.full_kv_num_blocks.sum())
    assert partial > 0 and full > 0 and partial + full < n_blocks


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@pytest.mark.parametrize("window", [0, 3, 16, 23])
def test_flex_attention_output_equals_create_block_mask_and_float64(window):
    B, H, T_, D, bs = 2, 2, 64, 8, 16
    g = torch.Generator().manual_seed(window)
    q, k, v = (torch.randn(B, H, T_, D, generator=g) for _ in range(3))
    doc = T.document_ids(random_tokens((B, T_), seed=window + 1, p_eot=0.05))
    with torch.no_grad():
        got = kernels.attend(q, k, v, kernels.block_mask_from_bounds(doc, torch.tensor(window) if window else 0, bs))
        ref = kernels.attend(q, k, v, reference_block_mask(doc, window, bs))
    torch.testing.assert_close(got, ref, rtol=0, atol=0)
    torch.testing.assert_close(got.double(), reference_attention(q, k, v, kernels.attention_mask(doc, window)),
                               rtol=1e-5, atol=1e-5)


def test_build_attention_mask_uses_the_block_build():
    doc = T.document_ids(random_tokens((2, 32), seed=5, p_eot=0.1))
    assert_same_blocks(kernels.build_attention_mask(doc, 6, flex=True, block_size=8), reference_block_mask(doc, 6, 8))


def test_compiles_once_across_window_values_without_a_host_sync():
    """Traced whole (no graph break: fullgraph), one graph for every window value of a schedule."""
    torch._dynamo.reset()
    counts = torch._dynamo.testing.CompileCounter()

    def blocks(doc, window):
        m = kernels.block_mask_from_bounds(doc, window, 16)
        return m.kv_num_blocks, m.kv_indices, m.full_kv_num_blocks, m.full_kv_indices

    compiled = torch.compile(blocks, backend=counts, fullgraph=True)
    doc = T.document_ids(random_tokens((2, 64), seed=9, p_eot=0.05))
    for w in (16, 24, 40, 64):
        window = torch.tensor(w)
        ref = reference_block_mask(doc, w, 16)
        got = compiled(doc, window)
        assert torch.equal(got[0], ref.kv_num_blocks) and torch.equal(got[2], ref.full_kv_num_blocks)
    assert counts.frame_count == 1
