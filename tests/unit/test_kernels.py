"""Each kernel against a plain dense formula (and HF's RoPE init where it exists)."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from kernels.attention import decode_attention_torch, prefill_attention_torch
from kernels.kv_cache import write_kv_torch
from kernels.linear import THIN_ROWS, linear_cpu, linear_torch
from kernels.registry import select_kernels
from kernels.rms_norm import rms_norm_torch
from kernels.rotary import apply_rope_torch, build_rope_cache, rope_attention_factor, rope_inv_freq

HKV, HQ, D, BS, NBLOCKS = 2, 4, 8, 4, 32


def dense_attention(q, k, v, q_positions, window=None, softcap=None, chunk=None):
    """q: [n, Hq, D] at q_positions; k, v: [L, Hkv, D] for positions 0..L-1."""
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    scores = torch.einsum("nhd,lhd->hnl", q, k) / math.sqrt(q.shape[-1])
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    k_pos = torch.arange(k.shape[0])
    allowed = k_pos[None, :] <= q_positions[:, None]
    if window is not None:
        allowed &= k_pos[None, :] > q_positions[:, None] - window
    if chunk is not None:
        allowed &= k_pos[None, :] // chunk == q_positions[:, None] // chunk
    scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.einsum("hnl,lhd->nhd", scores.softmax(-1), v)


def paged(seq_len: int, blocks: list[int], gen: torch.Generator):
    """A sequence's K/V written into scattered pages; returns caches and dense K/V."""
    k_cache = torch.zeros(HKV, NBLOCKS, BS, D)
    v_cache = torch.zeros(HKV, NBLOCKS, BS, D)
    k = torch.randn(seq_len, HKV, D, generator=gen)
    v = torch.randn(seq_len, HKV, D, generator=gen)
    slots = torch.tensor([blocks[p // BS] * BS + p % BS for p in range(seq_len)])
    write_kv_torch(k, v, k_cache, v_cache, slots)
    return k_cache, v_cache, k, v


def test_write_kv_places_tokens_in_their_slots():
    gen = torch.Generator().manual_seed(0)
    k_cache, v_cache, k, v = paged(6, [5, 2], gen)
    assert torch.equal(k_cache[:, 5, 3], k[3]) and torch.equal(v_cache[:, 2, 1], v[5])
    assert k_cache[:, [0, 1, 3, 4]].abs().sum() == 0


@pytest.mark.parametrize("softcap", [None, 0.7])
@pytest.mark.parametrize("context_len, n, window", [(0, 7, None), (5, 6, None), (9, 1, None), (6, 8, 5), (0, 9, 4)])
def test_prefill_attention_with_cached_prefix(context_len, n, window, softcap):
    gen = torch.Generator().manual_seed(context_len * 10 + n)
    blocks = [7, 3, 11, 0]
    k_cache, v_cache, k, v = paged(context_len + n, blocks, gen)
    q = torch.randn(n, HQ, D, generator=gen)
    out = prefill_attention_torch(
        q, k[context_len:], v[context_len:], k_cache, v_cache, torch.tensor(blocks), context_len, D**-0.5, window,
        softcap,
    )
    ref = dense_attention(q, k, v, torch.arange(context_len, context_len + n), window, softcap)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("softcap", [None, 0.7])
@pytest.mark.parametrize("window", [None, 3])
def test_decode_attention_over_ragged_batch(window, softcap):
    gen = torch.Generator().manual_seed(1)
    lengths, tables = [1, 6, 13], [[4], [9, 1], [2, 8, 6, 12]]
    k_cache = torch.zeros(HKV, NBLOCKS, BS, D)
    v_cache = torch.zeros(HKV, NBLOCKS, BS, D)
    dense = []
    for length, table in zip(lengths, tables):
        k = torch.randn(length, HKV, D, generator=gen)
        v = torch.randn(length, HKV, D, generator=gen)
        write_kv_torch(k, v, k_cache, v_cache, torch.tensor([table[p // BS] * BS + p % BS for p in range(length)]))
        dense.append((k, v))
    q = torch.randn(3, HQ, D, generator=gen)
    padded = torch.tensor([t + [0] * (4 - len(t)) for t in tables])
    out = decode_attention_torch(q, k_cache, v_cache, padded, torch.tensor(lengths), D**-0.5, window, softcap)
    for i, (k, v) in enumerate(dense):
        ref = dense_attention(q[i : i + 1], k, v, torch.tensor([lengths[i] - 1]), window, softcap)
        torch.testing.assert_close(out[i : i + 1], ref, atol=1e-5, rtol=1e-5)


def test_rms_norm_formula():
    x = torch.randn(3, 16)
    w = torch.randn(16)
    ref = w * x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
    torch.testing.assert_close(rms_norm_torch(x, w, 1e-6), ref)


def test_rope_rotates_pairs_half_apart():
    cos, sin = build_rope_cache(4, 8, 10000.0, None)
    q = torch.tensor([[[1.0, 2.0, 3.0, 4.0]]])  # [T=1, H=1, D=4]
    pos = 3
    out_q, _ = apply_rope_torch(q, q.clone(), cos[pos : pos + 1], sin[pos : pos + 1])
    inv = 1.0 / 10000.0 ** (torch.arange(0, 4, 2).float() / 4)
    angle = pos * inv
    x1, x2 = torch.tensor([1.0, 2.0]), torch.tensor([3.0, 4.0])
    expected = torch.cat([x1 * angle.cos() - x2 * angle.sin(), x2 * angle.cos() + x1 * angle.sin()])
    torch.testing.assert_close(out_q[0, 0], expected)


@pytest.mark.parametrize(
    "scaling",
    [
        {"rope_type": "linear", "factor": 4.0},
        {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
         "original_max_position_embeddings": 64},
    ],
)
def test_scaled_inv_freq_matches_transformers(scaling):
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = transformers.LlamaConfig(
        hidden_size=128, num_attention_heads=2, max_position_embeddings=512,
        rope_parameters={**scaling, "rope_theta": 10000.0},
    )
    ref, _ = ROPE_INIT_FUNCTIONS[scaling["rope_type"]](config, "cpu")
    torch.testing.assert_close(rope_inv_freq(64, 10000.0, scaling), ref.float())


@pytest.mark.parametrize("scaling", [
    {"factor": 4.0, "original_max_position_embeddings": 64},  # Qwen's, as its model cards give it
    {"factor": 40.0, "original_max_position_embeddings": 4096, "beta_fast": 16, "beta_slow": 2, "truncate": False},
    {"factor": 40.0, "original_max_position_embeddings": 4096, "mscale": 1.0, "mscale_all_dim": 0.707},  # DeepSeek's
    {"factor": 8.0, "original_max_position_embeddings": 128, "attention_factor": 1.3},
    {"factor": 0.5, "original_max_position_embeddings": 1024},  # no temperature below 1
])
def test_yarn_frequencies_and_attention_factor_match_transformers(scaling):
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    scaling = {"rope_type": "yarn", **scaling}
    for theta, head_dim in ((10000.0, 64), (1_000_000.0, 128)):
        config = transformers.LlamaConfig(hidden_size=2 * head_dim, num_attention_heads=2, max_position_embeddings=512,
                                          rope_parameters={**scaling, "rope_theta": theta})
        ref, attention_factor = ROPE_INIT_FUNCTIONS["yarn"](config, "cpu")
        torch.testing.assert_close(rope_inv_freq(head_dim, theta, scaling), ref.float())
        assert rope_attention_factor(scaling) == pytest.approx(attention_factor, rel=1e-12)
        cos, sin = build_rope_cache(head_dim, 8, theta, scaling)
        assert cos[0, 0].item() == pytest.approx(attention_factor)  # position 0: cos 1, times the factor


@pytest.mark.parametrize("partial", [1.0, 0.75])
@pytest.mark.parametrize("attention_factor", [None, 1.2])
def test_longrope_frequencies_and_attention_factor_match_transformers(partial, attention_factor):
    """The short factors within the original context, the long past it (transformers' set for a
    sequence that long), over the turned part of a head; the attention factor from the contexts' ratio."""
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    head_dim, original = 64, 256
    rotary_dim = int(head_dim * partial)
    short = [1.0 + i / 10 for i in range(rotary_dim // 2)]
    long = [1.0 + i for i in range(rotary_dim // 2)]
    config = transformers.Phi3Config(
        hidden_size=2 * head_dim, num_attention_heads=2, max_position_embeddings=4 * original,
        original_max_position_embeddings=original, partial_rotary_factor=partial,
        rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": short, "long_factor": long,
                         **({"attention_factor": attention_factor} if attention_factor else {})})
    scaling = {"rope_type": "longrope", "short_factor": short, "long_factor": long, "factor": 4.0,
               "original_max_position_embeddings": original, "attention_factor": attention_factor}
    for context, seq_len in ((original, original), (original + 1, original + 1)):
        ref, factor = ROPE_INIT_FUNCTIONS["longrope"](config, "cpu", seq_len=seq_len)
        torch.testing.assert_close(rope_inv_freq(rotary_dim, 10000.0, scaling, context), ref.float())
        assert rope_attention_factor(scaling) == pytest.approx(factor, rel=1e-12)
        cos, _ = build_rope_cache(rotary_dim, context, 10000.0, scaling)
        assert cos.shape == (context, rotary_dim) and cos[0, 0].item() == pytest.approx(factor)


def test_a_partial_rope_turns_the_first_dimensions_as_phi3s_attention_does():
    pytest.importorskip("transformers")
    from transformers.models.phi3.modeling_phi3 import apply_rotary_pos_emb

    cos, sin = build_rope_cache(12, 40, 10000.0, None)  # 12 of 16 dimensions
    q, k = torch.randn(5, 4, 16), torch.randn(5, 2, 16)
    positions = torch.tensor([0, 3, 7, 20, 39])
    out_q, out_k = apply_rope_torch(q, k, cos[positions], sin[positions])
    # transformers' layout: [batch, heads, tokens, dim], cos and sin [batch, tokens, dim].
    ref_q, ref_k = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None],
                                        cos[positions][None], sin[positions][None])
    torch.testing.assert_close(out_q, ref_q[0].transpose(0, 1))
    torch.testing.assert_close(out_k, ref_k[0].transpose(0, 1))
    assert torch.equal(out_q[..., 12:], q[..., 12:])


def test_unknown_rope_type_is_refused():
    with pytest.raises(ValueError, match="unsupported rope type 'dynamic'"):
        rope_inv_freq(8, 10000.0, {"rope_type": "dynamic"})


def test_kernel_bundle_is_chosen_once_and_unknown_backends_refused():
    assert select_kernels("cpu", backend="torch").name == "torch"
    assert select_kernels("cpu").name in ("cpu", "torch")
    with pytest.raises(ValueError, match="unknown kernel backend"):
        select_kernels("cpu", backend="cuda-graphs")


@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("num_heads, num_kv_heads", [(4, 2), (4, 4), (8, 1)])
def test_cpu_decode_kernel_matches_torch_reference(window, num_heads, num_kv_heads):
    from kernels.cpu_decode_attention import decode_attention_cpu, load_library

    if load_library() is None:
        pytest.skip("no C compiler: the cpu kernel is not built here")
    gen = torch.Generator().manual_seed(num_heads * 10 + num_kv_heads)
    k_cache = torch.randn(num_kv_heads, NBLOCKS, BS, D, generator=gen)
    v_cache = torch.randn(num_kv_heads, NBLOCKS, BS, D, generator=gen)
    lengths = torch.tensor([1, 4, 5, 17, 30])
    tables = torch.randint(0, NBLOCKS, (5, 8), generator=gen)
    q = torch.randn(5, num_heads, D, generator=gen)
    ref = decode_attention_torch(q, k_cache, v_cache, tables, lengths, D**-0.5, window)
    out = decode_attention_cpu(q, k_cache, v_cache, tables, lengths, D**-0.5, window)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    # Soft-capped scores the C kernel does not compute: it hands them to the reference.
    capped = decode_attention_cpu(q, k_cache, v_cache, tables, lengths, D**-0.5, window, 0.7)
    torch.testing.assert_close(capped, decode_attention_torch(q, k_cache, v_cache, tables, lengths, D**-0.5, window,
                                                              0.7))
    assert not torch.allclose(capped, ref, atol=1e-3)


@pytest.mark.parametrize("fp8", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_fp8_pages_hold_each_number_cast_and_attention_reads_them_cast_back(fp8):
    """--kv-cache-dtype fp8: the pages hold K/V cast to fp8 (no scales), and every attention path
    (prefill over a cached prefix, decode, the C decode kernel's fallback) computes as dense attention
    over those values. (A prompt's first chunk reads no page: it attends to its own K/V unrounded.)"""
    gen = torch.Generator().manual_seed(3)
    blocks, context_len, n = [7, 3, 11, 0], 9, 5
    k_cache, v_cache = torch.zeros(HKV, NBLOCKS, BS, D, dtype=fp8), torch.zeros(HKV, NBLOCKS, BS, D, dtype=fp8)
    k = torch.randn(context_len + n, HKV, D, generator=gen) * 4
    v = torch.randn(context_len + n, HKV, D, generator=gen) * 4
    slots = torch.tensor([blocks[p // BS] * BS + p % BS for p in range(context_len + n)])
    write_kv_torch(k, v, k_cache, v_cache, slots)
    rounded_k, rounded_v = k.to(fp8).float(), v.to(fp8).float()
    assert torch.equal(k_cache[:, 3, 1].float(), rounded_k[5]) and not torch.equal(rounded_k, k)
    q = torch.randn(n, HQ, D, generator=gen)
    out = prefill_attention_torch(q, k[context_len:], v[context_len:], k_cache, v_cache, torch.tensor(blocks),
                                  context_len, D**-0.5)
    ref = dense_attention(q, rounded_k, rounded_v, torch.arange(context_len, context_len + n))
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    table, lengths = torch.tensor([blocks, blocks]), torch.tensor([context_len, context_len + n])
    for decode in (decode_attention_torch, select_kernels("cpu").decode_attention):
        out = decode(q[:2], k_cache, v_cache, table, lengths, D**-0.5)
        for i, length in enumerate(lengths.tolist()):
            ref = dense_attention(q[i:i + 1], rounded_k[:length], rounded_v[:length], torch.tensor([length - 1]))
            torch.testing.assert_close(out[i:i + 1], ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("context_len, n", [(0, 7), (0, 11), (5, 6), (9, 1)])
def test_chunked_attention_reads_only_the_tokens_own_chunk(context_len, n):
    """Llama 4's chunked layers: a token attends to the earlier tokens of its chunk of positions."""
    gen = torch.Generator().manual_seed(context_len * 10 + n)
    blocks, chunk = [7, 3, 11, 0], 4
    k_cache, v_cache, k, v = paged(context_len + n, blocks, gen)
    q = torch.randn(n, HQ, D, generator=gen)
    out = prefill_attention_torch(q, k[context_len:], v[context_len:], k_cache, v_cache, torch.tensor(blocks),
                                  context_len, D**-0.5, chunk_size=chunk)
    ref = dense_attention(q, k, v, torch.arange(context_len, context_len + n), chunk=chunk)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    lengths = torch.tensor([context_len + n, 4, 5])  # 5: the first token of the second chunk
    q = torch.randn(3, HQ, D, generator=gen)
    for decode in (decode_attention_torch, select_kernels("cpu").decode_attention):
        out = decode(q, k_cache, v_cache, torch.tensor([blocks] * 3), lengths, D**-0.5, chunk_size=chunk)
        for i, length in enumerate(lengths.tolist()):
            ref = dense_attention(q[i:i + 1], k[:length], v[:length], torch.tensor([length - 1]), chunk=chunk)
            torch.testing.assert_close(out[i:i + 1], ref, atol=1e-5, rtol=1e-5)


def test_attention_sinks_take_their_share_of_each_softmax_and_attend_to_nothing():
    """gpt-oss's sinks: a logit per q head joins each row's softmax as one more column, its value zero."""
    gen = torch.Generator().manual_seed(9)
    blocks, context_len, n = [7, 3, 11, 0], 6, 5
    k_cache, v_cache, k, v = paged(context_len + n, blocks, gen)
    q, sinks = torch.randn(n, HQ, D, generator=gen), torch.randn(HQ, generator=gen)

    def with_sinks(q, length, positions, window=None):  # dense, the sink as a key of value zero
        group = HQ // HKV
        keys, values = k[:length].repeat_interleave(group, dim=1), v[:length].repeat_interleave(group, dim=1)
        scores = torch.einsum("nhd,lhd->hnl", q, keys) / math.sqrt(D)
        allowed = torch.arange(length)[None, :] <= positions[:, None]
        if window is not None:
            allowed &= torch.arange(length)[None, :] > positions[:, None] - window
        scores = torch.cat((scores.masked_fill(~allowed, float("-inf")),
                            sinks[:, None, None].expand(-1, q.shape[0], 1)), dim=-1)
        return torch.einsum("hnl,lhd->nhd", scores.softmax(-1)[..., :-1], values)

    _check_against_dense(q, k, v, k_cache, v_cache, blocks, context_len, with_sinks, sinks=sinks)


def _check_against_dense(q, k, v, k_cache, v_cache, blocks, context_len, dense, **option):
    """Prefill (whole, after a cached prefix, within a window) and decode (torch's and the CPU kernel's) with `option`
    against `dense(q, length, positions, window)`."""
    n = q.shape[0]
    for context, window in ((0, None), (context_len, None), (context_len, 3)):
        out = prefill_attention_torch(q, k[context:context + n], v[context:context + n], k_cache, v_cache,
                                      torch.tensor(blocks), context, D**-0.5, window, **option)
        torch.testing.assert_close(out, dense(q, context + n, torch.arange(context, context + n), window),
                                   atol=1e-5, rtol=1e-5)
    lengths = torch.tensor([context_len + n, 3])
    for decode in (decode_attention_torch, select_kernels("cpu").decode_attention):
        out = decode(q[:2], k_cache, v_cache, torch.tensor([blocks] * 2), lengths, D**-0.5, **option)
        for i, length in enumerate(lengths.tolist()):
            torch.testing.assert_close(out[i:i + 1], dense(q[i:i + 1], length, torch.tensor([length - 1])),
                                       atol=1e-5, rtol=1e-5)


def test_alibi_adds_each_heads_slope_times_the_distance_back_to_each_key():
    """BLOOM's and MPT's ALiBi, as the distance from the query (what transformers' slope times the key's position
    comes to under a softmax), with a cached prefix and a window, in prefill and decode."""
    gen = torch.Generator().manual_seed(10)
    blocks, context_len, n = [7, 3, 11, 0], 6, 5
    k_cache, v_cache, k, v = paged(context_len + n, blocks, gen)
    q, slopes = torch.randn(n, HQ, D, generator=gen), torch.rand(HQ, generator=gen)

    def with_alibi(q, length, positions, window=None):
        group = HQ // HKV
        keys, values = k[:length].repeat_interleave(group, dim=1), v[:length].repeat_interleave(group, dim=1)
        distance = (torch.arange(length)[None, :] - positions[:, None]).float()  # [n, L], <= 0 where allowed
        scores = torch.einsum("nhd,lhd->hnl", q, keys) / math.sqrt(D) + slopes[:, None, None] * distance
        allowed = distance <= 0
        if window is not None:
            allowed &= distance > -window
        return torch.einsum("hnl,lhd->nhd", scores.masked_fill(~allowed, float("-inf")).softmax(-1), values)

    _check_against_dense(q, k, v, k_cache, v_cache, blocks, context_len, with_alibi, alibi_slopes=slopes)


@pytest.mark.parametrize("rows", [1, 2, 5, THIN_ROWS, THIN_ROWS + 1])
@pytest.mark.parametrize("with_bias", [False, True])
def test_the_thin_batch_linear_is_torchs_linear(rows, with_bias):
    gen = torch.Generator().manual_seed(rows)
    x, weight = torch.randn(rows, 48, generator=gen), torch.randn(80, 48, generator=gen)
    bias = torch.randn(80, generator=gen) if with_bias else None
    out = linear_cpu(x, weight, bias)
    assert out.shape == (rows, 80) and out.is_contiguous()
    torch.testing.assert_close(out, F.linear(x, weight, bias), rtol=1e-5, atol=1e-5)
    half = x.to(torch.bfloat16), weight.to(torch.bfloat16)  # other dtypes are torch's own
    assert torch.equal(linear_cpu(*half), F.linear(*half))
    chosen = select_kernels("cpu")
    assert chosen.linear is (linear_cpu if chosen.name == "cpu" else linear_torch)
    assert select_kernels("cpu", "torch").linear is linear_torch
