"""torch tensors through the package (CPU here, CUDA where available), the sparse_attn:: custom ops,
torch.compile and the Hugging Face attention function."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import sparse_attn as sa  # noqa: E402
import sparse_attn.torch as sat  # noqa: E402
from sparse_attn import reference as ref  # noqa: E402

from _util import causal_defaults, random_query_lists, random_tile_lists, random_token_lists  # noqa: E402

TOL = {torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 6e-3}

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs torch with a CUDA device")


def _qkv(B, Lq, Lk, Hq, Hkv, D, dtype=torch.float32, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    mk = lambda L, H: torch.randn(B, L, H, D, generator=g).to(dtype=dtype, device=device)  # noqa: E731
    return mk(Lq, Hq), mk(Lk, Hkv), mk(Lk, Hkv)


def _np(t):
    return t.detach().float().cpu().numpy()


def _check(out, expected, dtype):
    assert torch.isfinite(out.float()).all(), "NaN/inf in the output"
    err = ref.rel_err(_np(out), expected)
    assert err <= TOL[dtype], f"relerr {err:.3g}"


# ---- the package API with torch CPU tensors ------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_dense_allocates_torch_outputs(dtype):
    q, k, v = _qkv(2, 17, 200, 4, 1, 32, dtype)
    out, lse = sa.dense(q, k, v, causal=True, return_lse=True)
    assert isinstance(out, torch.Tensor) and out.dtype == dtype and out.shape == q.shape
    assert lse.dtype == torch.float32 and lse.shape == (2, 4, 17)
    ref_out, ref_lse = ref.attention(_np(q), _np(k), _np(v), causal=True)
    _check(out, ref_out, dtype)
    np.testing.assert_allclose(_np(lse), ref_lse, rtol=1e-5, atol=1e-5)


def test_strided_views_and_grad_inputs():
    # (B, H, L, D) tensors seen as (B, L, H, D): non-contiguous, last dim contiguous.
    g = torch.Generator().manual_seed(1)
    qh = torch.randn(1, 4, 17, 32, generator=g, requires_grad=True)
    kh, vh = torch.randn(1, 2, 150, 32, generator=g), torch.randn(1, 2, 150, 32, generator=g)
    q, k, v = qh.transpose(1, 2), kh.transpose(1, 2), vh.transpose(1, 2)
    out = sa.dense(q, k, v)
    _check(out, ref.attention(_np(q), _np(k), _np(v))[0], torch.float32)


def test_out_argument_and_sparse_executors():
    B, Lq, Lk, Hq, Hkv, D = 2, 17, 300, 4, 2, 32
    q, k, v = _qkv(B, Lq, Lk, Hq, Hkv, D)
    rng = np.random.default_rng(3)
    qn, kn, vn = _np(q), _np(k), _np(v)
    idx, cnt = random_tile_lists(rng, B, Hkv, 1, 3, kmax=3)
    out = torch.full_like(q, float("nan"))
    res = sa.tile_sparse(q, k, v, torch.from_numpy(idx), torch.from_numpy(cnt), out=out)
    assert res is out
    _check(out, ref.attention(qn, kn, vn, ref.mask_from_tile_lists(idx, cnt, Lq, Lk, Hq))[0], torch.float32)
    ql = random_query_lists(rng, B, Hkv, Lq, 3, kq=2)
    _check(sa.query_sparse(q, k, v, torch.from_numpy(ql)),
           ref.attention(qn, kn, vn, ref.mask_from_query_lists(ql, Lk, Hq))[0], torch.float32)
    tl = random_token_lists(rng, B, Hkv, Lq, Lk, kt=20)
    _check(sa.token_sparse(q, k, v, torch.from_numpy(tl)),
           ref.attention(qn, kn, vn, ref.mask_from_token_lists(tl, Lk, Hq))[0], torch.float32)


def test_selectors_return_torch_int32():
    q, k, _ = _qkv(1, 200, 700, 4, 2, 32)
    idx, cnt = sa.pooled_select(q, k, top_k=3)
    assert idx.dtype == torch.int32 and idx.shape == (1, 2, 2, 3) and cnt.shape == (1, 2, 2)
    qi = sa.token_max_select(q[..., :2, :], k, top_k=2)
    assert qi.dtype == torch.int32 and qi.shape == (1, 2, 200, 2)
    sink = sa.token_max_select(q[..., :2, :], k, top_k=2, force_block0=True)
    assert (sink[..., 0] == 0).all()


def test_lightning_op_passes_sink_keys():
    q, w, k = torch.randn(1, 40, 2, 16), torch.rand(1, 40, 2) + 0.1, torch.randn(1, 400, 16)
    got = sat.lightning_select(q, w, k, top_k=6, causal=True, precision="bf16", sink_keys=3)
    want = sa.lightning_select(_np(q), _np(w), _np(k), top_k=6, causal=True, precision="bf16", sink_keys=3)
    np.testing.assert_array_equal(got.numpy(), want)
    assert (got[0, 0, :, :3] == torch.arange(3, dtype=torch.int32)).all()  # every query sees keys 0..2


def test_bad_torch_input_raises_value_error():
    q, k, v = _qkv(1, 4, 8, 2, 1, 16)
    with pytest.raises(ValueError, match=r"dense: argument 'q'"):
        sa.dense(q.double(), k, v)
    with pytest.raises(ValueError, match=r"dense: argument 'k'"):
        sa.dense(q, k[..., :8], v)


# ---- custom ops ----------------------------------------------------------------------------------

def test_custom_ops_are_registered():
    for name in ("dense", "tile_sparse", "bits_sparse", "query_sparse", "token_sparse", "gated", "entmax",
                 "dense_out", "tile_sparse_out", "bits_sparse_out", "query_sparse_out", "token_sparse_out",
                 "pooled_select", "token_max_select", "token_max_select_tiles", "lightning_select"):
        assert hasattr(torch.ops.sparse_attn, name), name
    schema = str(torch.ops.sparse_attn.dense_out.default._schema)
    assert "Tensor(a" in schema and "!" in schema  # out and lse are declared as written


def test_custom_ops_compute_the_reference():
    B, Lq, Lk, Hq, Hkv, D = 1, 140, 300, 4, 1, 32
    q, k, v = _qkv(B, Lq, Lk, Hq, Hkv, D)
    qn, kn, vn = _np(q), _np(k), _np(v)
    out, lse = torch.ops.sparse_attn.dense(q, k, v, None, True)
    ref_out, ref_lse = ref.attention(qn, kn, vn, causal=True)
    _check(out, ref_out, torch.float32)
    np.testing.assert_allclose(_np(lse), ref_lse, rtol=1e-5, atol=1e-5)
    out2 = torch.empty_like(q)
    lse2 = torch.empty(B, Hq, Lq)
    torch.ops.sparse_attn.dense_out(q, k, v, out2, lse2, None, True)
    torch.testing.assert_close(out2, out)
    out3 = sat.dense(q, k, v, causal=True, out=torch.empty_like(q))
    torch.testing.assert_close(out3, out)
    thr = torch.full((Hq, 1), float("-inf"))
    g_out, g_lse, g_stats = sat.gated(q, k, v, thr, return_lse=True, return_kept_per_tile=True)
    _check(g_out, ref_out, torch.float32)
    np.testing.assert_allclose(_np(g_lse), ref_lse, rtol=1e-5, atol=1e-5)
    kept = g_stats["kept_per_tile"]
    assert kept.dtype == torch.int32 and kept.shape == (1, Hq, 3)  # gate tiles of 64 queries
    assert g_stats["density"] == 1.0 and int(kept.sum()) == g_stats["kept_blocks"]
    e_out, bits = sat.entmax(q, k, v, causal=True, return_block_bits=True)
    _check(e_out, ref.entmax_attention(qn, kn, vn, causal=True)[0], torch.float32)
    assert bits.shape == (1, Hq, 2, 1)


def test_torch_functions_default_to_non_causal_as_the_package_does():
    torch_defaults = causal_defaults(sat)
    assert set(torch_defaults) == set(causal_defaults(sa)) - {"sparse_attention", "problem_shape", "evaluate", "plan"}
    assert {n: d for n, d in torch_defaults.items() if d is not False} == {}


def test_gated_returns_the_same_tuple_from_both_modules():
    q, k, v = _qkv(1, 300, 300, 4, 2, 32, seed=3)
    thr = torch.tensor([-float("inf"), -float("inf"), float("inf"), float("inf")]).repeat(3, 1).T.contiguous()
    # heads 0 and 1 keep every block, heads 2 and 3 only their diagonal ones
    for return_lse in (False, True):
        for per_tile in (False, True):
            a = sa.gated(q, k, v, thr, return_lse=return_lse, return_kept_per_tile=per_tile)
            b = sat.gated(q, k, v, thr, return_lse=return_lse, return_kept_per_tile=per_tile)
            assert len(a) == len(b) == (3 if return_lse else 2)
            for x, y in zip(a[:-1], b[:-1]):
                assert torch.equal(x, y)
            sa_stats, sat_stats = a[-1], b[-1]
            assert set(sa_stats) == set(sat_stats) == {"kept_blocks", "visible_blocks", "gated_candidates",
                                                       "gated_kept", "density"} | ({"kept_per_tile"} if per_tile else set())
            for name, value in sa_stats.items():
                if name == "kept_per_tile":
                    assert torch.equal(value, sat_stats[name]) and int(value.sum()) == sa_stats["kept_blocks"]
                else:
                    assert type(value) is type(sat_stats[name]) and value == sat_stats[name], name
            assert 0 < sa_stats["gated_kept"] < sa_stats["gated_candidates"]


def test_validate_checks_torch_tensors():
    p = sa.ProblemShape(1, 300, 1000, 2, 1, 16)
    idx, cnt = (torch.from_numpy(a) for a in random_tile_lists(np.random.default_rng(2), 1, 1, p.Tq, p.Tk, kmax=4))
    sa.validate(p, tiles=(idx, cnt))
    bad = idx.clone()
    bad[0, 0, 1, 0] = 40
    with pytest.raises(ValueError, match=r"tiles\.idx.*40.*\[0, 0, 1, 0\]"):
        sa.validate(p, tiles=(bad, cnt))


def test_query_sparse_ops_take_the_merge_window():
    # The window regroups the GPU's KV-centric work and never changes the result; the ops pass it through
    # (the CPU reference gives the same bits for every accepted window) and refuse a bad one by name.
    q, k, v = _qkv(1, 96, 1024, 4, 2, 32)
    ql = torch.from_numpy(random_query_lists(np.random.default_rng(11), 1, 2, 96, 8, kq=6))
    base = sat.query_sparse(q, k, v, ql, merge_window=1)
    _check(base, ref.attention(_np(q), _np(k), _np(v), ref.mask_from_query_lists(ql.numpy(), 1024, 4))[0],
           torch.float32)
    for w in (0, 4, 8):
        assert torch.equal(sat.query_sparse(q, k, v, ql, merge_window=w), base)
        out = sat.query_sparse(q, k, v, ql, merge_window=w, out=torch.empty_like(q))
        assert torch.equal(out, base)
    with pytest.raises(ValueError, match=r"merge_window.*9"):
        sat.query_sparse(q, k, v, ql, merge_window=9)
    schema = str(torch.ops.sparse_attn.query_sparse.default._schema)
    assert "merge_window" in schema


def test_opcheck_fake_kernels():
    q, k, v = _qkv(1, 17, 200, 4, 2, 16)
    rng = np.random.default_rng(5)
    idx, cnt = (torch.from_numpy(a) for a in random_tile_lists(rng, 1, 2, 1, 2, kmax=2))
    tests = ("test_schema", "test_faketensor")
    cases = [
        (torch.ops.sparse_attn.dense.default, (q, k, v, None, False)),
        (torch.ops.sparse_attn.tile_sparse.default, (q, k, v, idx, cnt, 0.2, True, False)),
        (torch.ops.sparse_attn.dense_out.default, (q, k, v, torch.empty_like(q), torch.empty(1, 4, 17), None, True)),
        (torch.ops.sparse_attn.pooled_select.default, (q, k, 2, 3, 1, True, False, False)),
        (torch.ops.sparse_attn.entmax.default, (q, k, v, 1.5, None, False, 64)),
        (torch.ops.sparse_attn.gated.default, (q, k, v, torch.zeros(4, 1), None, 1)),
        (torch.ops.sparse_attn.query_sparse.default,
         (q, k, v, torch.from_numpy(random_query_lists(rng, 1, 2, 17, 2, kq=2)), None, False, False, "f32",
          "kv_centric", 2)),
    ]
    for op, args in cases:
        torch.library.opcheck(op, args, test_utils=tests)


def test_torch_compile_fullgraph():
    q, k, v = _qkv(1, 17, 300, 4, 2, 32)

    def f(q, k, v):
        idx, cnt = sat.pooled_select(q, k, top_k=2)
        return sat.tile_sparse(q, k, v, idx, cnt) * 2.0 + sat.dense(q, k, v, causal=True)

    try:
        compiled = torch.compile(f, backend="aot_eager", fullgraph=True)
        got = compiled(q, k, v)
    except RuntimeError as e:  # torch builds without dynamo support
        if "not supported" in str(e) or "Dynamo" in str(e):
            pytest.skip(f"torch.compile unavailable: {e}")
        raise
    torch.testing.assert_close(got, f(q, k, v))


# ---- Hugging Face --------------------------------------------------------------------------------

def test_hf_attention_function_layout():
    fn = sat.make_hf_attention()

    class Module:
        is_causal = True

    g = torch.Generator().manual_seed(2)
    query = torch.randn(2, 8, 20, 16, generator=g)
    key, value = torch.randn(2, 2, 20, 16, generator=g), torch.randn(2, 2, 20, 16, generator=g)
    out, weights = fn(Module(), query, key, value, None, scaling=0.3)
    assert weights is None and out.shape == (2, 20, 8, 16) and out.is_contiguous()
    expect, _ = ref.attention(_np(query.transpose(1, 2)), _np(key.transpose(1, 2)), _np(value.transpose(1, 2)),
                              softmax_scale=0.3, causal=True)
    _check(out, expect, torch.float32)
    with pytest.raises(ValueError, match="attention_mask"):
        fn(Module(), query, key, value, torch.ones(2, 1, 20, 20, dtype=torch.bool))


def test_hf_attention_pooled_mode_runs_tile_sparse_on_the_pooled_selection():
    fn = sat.make_hf_attention(mode="pooled", top_k=2)

    class Module:
        is_causal = True

    g = torch.Generator().manual_seed(4)
    query = torch.randn(1, 4, 600, 16, generator=g)
    key, value = torch.randn(1, 2, 600, 16, generator=g), torch.randn(1, 2, 600, 16, generator=g)
    out, _ = fn(Module(), query, key, value, None, scaling=0.25)
    q, k, v = (_np(t.transpose(1, 2)) for t in (query, key, value))
    idx, cnt = sa.pooled_select(q, k, top_k=2, force_local=True, force_block0=True, causal=True)
    mask = ref.mask_from_tile_lists(idx, cnt, 600, 600, 4)
    _check(out, ref.attention(q, k, v, mask, softmax_scale=0.25, causal=True)[0], torch.float32)
    assert ref.rel_err(_np(out), ref.attention(q, k, v, softmax_scale=0.25, causal=True)[0]) > 1e-3  # sparse
    with pytest.raises(ValueError, match="mode"):
        sat.make_hf_attention(mode="flex")


def test_hf_registration_and_tiny_llama_matches_eager():
    transformers = pytest.importorskip("transformers")
    assert sat.register_hf_attention("sparse_attn")
    from transformers import AttentionInterface
    try:
        from transformers import AttentionMaskInterface
    except ImportError:
        from transformers.masking_utils import AttentionMaskInterface
    assert "sparse_attn" in AttentionInterface._global_mapping
    assert "sparse_attn" in AttentionMaskInterface._global_mapping
    config = transformers.LlamaConfig(vocab_size=100, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    ids = torch.randint(0, 100, (2, 21))

    def use(impl):
        if hasattr(model, "set_attn_implementation"):
            model.set_attn_implementation(impl)
        else:
            model.config._attn_implementation = impl

    with torch.no_grad():
        use("eager")
        expect = model(ids).logits
        use("sparse_attn")
        got = model(ids).logits
    torch.testing.assert_close(got, expect, rtol=1e-4, atol=1e-4)


# ---- CUDA ----------------------------------------------------------------------------------------

@pytest.mark.cuda
@requires_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cuda_dense_matches_cpu_reference(dtype):
    q, k, v = _qkv(2, 300, 700, 8, 2, 128, dtype, device="cuda")
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):  # runs on the caller's current stream
        out, lse = sa.dense(q, k, v, causal=True, return_lse=True)
    stream.synchronize()
    assert out.device == q.device and out.dtype == dtype
    ref_out, ref_lse = ref.attention(_np(q), _np(k), _np(v), causal=True)
    _check(out, ref_out, dtype)
    np.testing.assert_allclose(_np(lse), ref_lse, rtol=1e-3, atol=1e-3)


def _on_cuda_or_skip(fn):
    """Runs fn; an operator whose CUDA backend this build lacks is reported as a skip that names it."""
    try:
        return fn()
    except sa.Error as e:
        if "no cuda implementation" in str(e):
            pytest.skip(str(e))
        raise


@pytest.mark.cuda
@requires_cuda
@pytest.mark.parametrize("op", ["tile_sparse", "bits_sparse", "query_sparse", "query_sparse_merged", "token_sparse",
                                "pooled_select"])
def test_cuda_sparse_executors_and_selectors(op):
    B, Lq, Lk, Hq, Hkv, D = 2, 300, 1000, 8, 2, 128
    q, k, v = _qkv(B, Lq, Lk, Hq, Hkv, D, torch.bfloat16, device="cuda")
    qn, kn, vn = _np(q), _np(k), _np(v)
    rng = np.random.default_rng(7)
    cuda = lambda a: torch.from_numpy(a).cuda()  # noqa: E731
    if op in ("tile_sparse", "bits_sparse"):
        idx, cnt = random_tile_lists(rng, B, Hkv, 3, 8, kmax=4)
        mask = ref.mask_from_tile_lists(idx, cnt, Lq, Lk, Hq)
        if op == "tile_sparse":
            out = _on_cuda_or_skip(lambda: sat.tile_sparse(q, k, v, cuda(idx), cuda(cnt), causal=True))
        else:
            bits = ref.tile_lists_to_block_bits(idx, cnt, Lk)
            out = _on_cuda_or_skip(lambda: sat.bits_sparse(q, k, v, cuda(bits.view(np.int32)).view(torch.uint32),
                                                           causal=True))
        _check(out, ref.attention(qn, kn, vn, mask, causal=True)[0], torch.bfloat16)
    elif op == "query_sparse":
        ql = random_query_lists(rng, B, Hkv, Lq, 8, kq=3)
        out = _on_cuda_or_skip(lambda: sat.query_sparse(q, k, v, cuda(ql)))
        _check(out, ref.attention(qn, kn, vn, ref.mask_from_query_lists(ql, Lk, Hq))[0], torch.bfloat16)
    elif op == "query_sparse_merged":
        # Lk = 1000: 8 blocks, three chosen per query; windows of 4 and 8 merge a query's blocks into pieces.
        ql = random_query_lists(rng, B, Hkv, Lq, 8, kq=3)
        expected = ref.attention(qn, kn, vn, ref.mask_from_query_lists(ql, Lk, Hq))[0]
        for w in (4, 8):
            out = _on_cuda_or_skip(lambda: sat.query_sparse(q, k, v, cuda(ql), partials="bf16", merge_window=w))
            _check(out, expected, torch.bfloat16)
            out2 = sat.query_sparse(q, k, v, cuda(ql), partials="bf16", merge_window=w, out=torch.empty_like(q))
            _check(out2, expected, torch.bfloat16)
    elif op == "token_sparse":
        tl = random_token_lists(rng, B, Hkv, Lq, Lk, kt=64)
        out = _on_cuda_or_skip(lambda: sat.token_sparse(q, k, v, cuda(tl), causal=True))
        _check(out, ref.attention(qn, kn, vn, ref.mask_from_token_lists(tl, Lk, Hq), causal=True)[0], torch.bfloat16)
    else:
        gi, gc = _on_cuda_or_skip(lambda: sat.pooled_select(q, k, top_k=3, causal=True))
        ci, cc = sa.pooled_select(q.cpu(), k.cpu(), top_k=3, causal=True)
        assert gi.is_cuda and torch.equal(gc.cpu(), cc)


@pytest.mark.cuda
@requires_cuda
@pytest.mark.parametrize("alpha", [1.5, 2.0, 1.25])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cuda_entmax_matches_reference_and_cpu(alpha, dtype):
    B, Lq, Lk, Hq, Hkv, D = 1, 300, 700, 8, 2, 128
    q, k, v = _qkv(B, Lq, Lk, Hq, Hkv, D, dtype, device="cuda")
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):  # runs on the caller's current stream
        out, bits, stats = sa.entmax(q, k, v, alpha=alpha, causal=True, return_block_bits=True, return_stats=True)
    stream.synchronize()
    assert out.is_cuda and out.dtype == dtype and bits.is_cuda and bits.dtype == torch.uint32
    ref_out, p = ref.entmax_attention(_np(q), _np(k), _np(v), alpha=alpha, causal=True)
    _check(out, ref_out, dtype)
    # The CPU executor on the same values: every tile it marks is marked on the GPU too.
    cpu_out, cpu_bits, cpu_stats = sa.entmax(q.cpu().float(), k.cpu().float(), v.cpu().float(), alpha=alpha,
                                             causal=True, return_block_bits=True, return_stats=True)
    u32 = lambda t: t.cpu().view(torch.int32).numpy().view(np.uint32)  # noqa: E731
    assert not np.any(u32(cpu_bits) & ~u32(bits))
    assert stats["visible_tiles"] == cpu_stats["visible_tiles"]
    assert stats["active_tiles"] >= cpu_stats["active_tiles"]
    assert stats["support"] == pytest.approx(int((p > 0).sum()), rel=1e-3, abs=4)


@pytest.mark.cuda
@requires_cuda
def test_validate_checks_the_contents_of_cuda_tensors():
    p = sa.ProblemShape(1, 300, 1000, 2, 1, 16)
    rng = np.random.default_rng(6)
    idx, cnt = random_tile_lists(rng, 1, 1, p.Tq, p.Tk, kmax=4, empty_tile=False)
    sa.validate(p, tiles=(torch.from_numpy(idx).cuda(), torch.from_numpy(cnt).cuda()))
    bad = idx.copy()
    bad[0, 0, 1, 0] = 40
    with pytest.raises(ValueError) as on_host:
        sa.validate(p, tiles=(bad, cnt))
    with pytest.raises(ValueError) as on_device:
        sa.validate(p, tiles=(torch.from_numpy(bad).cuda(), torch.from_numpy(cnt).cuda()))
    assert str(on_device.value) == str(on_host.value)
    ql = random_query_lists(rng, 1, 1, p.Lq, p.Tk, kq=3)
    ql[0, 0, 5, 0] = 8
    with pytest.raises(ValueError, match=r"lists\.idx.*\[0, 0, 5, 0\]"):
        sa.validate(p, query_lists=torch.from_numpy(ql).cuda())
    # A device array that the package does not copy (here a bare DLPack capsule) is refused, not skipped.
    with pytest.raises(ValueError, match=r"validate: argument 'lists\.idx'.*device array"):
        sa.validate(p, query_lists=torch.from_numpy(ql).cuda().__dlpack__())


@pytest.mark.cuda
@requires_cuda
def test_cuda_bits_and_tile_list_conversions_equal_the_cpu():
    p = sa.ProblemShape(B=2, Lq=300, Lk=4400, Hq=4, Hkv=2, D=128)  # Tk = 35: two words per tile
    idx, cnt = random_tile_lists(np.random.default_rng(4), 2, 2, 3, 35, kmax=9)
    bits = sa.tile_lists_to_block_bits(idx, cnt, p)
    want_idx, want_cnt = sa.block_bits_to_tile_lists(bits, p, kmax=35)
    dbits = torch.from_numpy(bits.view(np.int32)).cuda().view(torch.uint32)
    for trusted in (False, True):
        got_idx, got_cnt = sa.block_bits_to_tile_lists(dbits, p, kmax=35, trusted=trusted)
        assert got_idx.is_cuda
        np.testing.assert_array_equal(got_idx.cpu().numpy(), want_idx)
        np.testing.assert_array_equal(got_cnt.cpu().numpy(), want_cnt)
    # and back on the device: the same words as the CPU conversion of the lists
    back = sa.tile_lists_to_block_bits(torch.from_numpy(idx).cuda(), torch.from_numpy(cnt).cuda(), p)
    assert back.is_cuda
    np.testing.assert_array_equal(back.cpu().view(torch.int32).numpy().view(np.uint32), bits)
    bad = bits.copy()
    bad[1, 0, 2, 1] |= np.uint32(1 << 5)  # block 37 >= Tk
    with pytest.raises(ValueError, match=r"block_bits_to_tile_lists: argument 'in\.bits'.*stray bit 5 \(block 37\)"):
        sa.block_bits_to_tile_lists(torch.from_numpy(bad.view(np.int32)).cuda().view(torch.uint32), p)


@pytest.mark.cuda
@requires_cuda
def test_cuda_graph_capture_of_a_custom_op():
    q, k, v = _qkv(1, 256, 512, 4, 1, 128, torch.bfloat16, device="cuda")
    out = torch.empty_like(q)
    sat.dense(q, k, v, causal=True, out=out)  # warm-up outside the graph
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        sat.dense(q, k, v, causal=True, out=out)
    q.copy_(torch.randn_like(q))
    graph.replay()
    torch.cuda.synchronize()
    _check(out, ref.attention(_np(q), _np(k), _np(v), causal=True)[0], torch.bfloat16)


@pytest.mark.cuda
@requires_cuda
def test_cuda_validated_tile_sparse_captures_into_a_graph_and_defers_faults():
    """A validated (not trusted) tile_sparse call captured by torch.cuda.graph replays the eager result;
    lists made faulty after the capture give NaN in the faulty tile only, and the fault is raised by
    check_device_faults, once."""
    B, Lq, Lk, Hq, Hkv, D = 1, 300, 1000, 4, 2, 128  # Tq = 3, Tk = 8; heads 2 and 3 share list group 1
    q, k, v = _qkv(B, Lq, Lk, Hq, Hkv, D, torch.bfloat16, device="cuda")
    idx, cnt = random_tile_lists(np.random.default_rng(11), B, Hkv, 3, 8, kmax=4)
    didx, dcnt = torch.from_numpy(idx).cuda(), torch.from_numpy(cnt).cuda()
    sa.check_device_faults()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):  # eager on the capture stream first (its split-tail workspace)
        eager = _on_cuda_or_skip(lambda: sat.tile_sparse(q, k, v, didx, dcnt))
    s.synchronize()
    _check(eager, ref.attention(_np(q), _np(k), _np(v), ref.mask_from_tile_lists(idx, cnt, Lq, Lk, Hq))[0],
           torch.bfloat16)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, stream=s):
        out = sat.tile_sparse(q, k, v, didx, dcnt)
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager)
    sa.check_device_faults()

    didx[0, 1, 2, 0] = 8  # tile (0, 1, 2): block id 8 of Tk = 8, rows 256..299 of heads 2 and 3
    g.replay()
    torch.cuda.synchronize()
    faulty = torch.zeros_like(out, dtype=torch.bool)
    faulty[0, 256:300, 2:4] = True
    assert torch.isnan(out[faulty].float()).all()
    assert torch.equal(out[~faulty], eager[~faulty])
    with pytest.raises(sa.Error, match=r"^tile_sparse: argument 'tiles.idx': block id 8 at \[0, 1, 2, 0\] is out of "
                                       r"range \[0, 8\) \(found on CUDA device 0 by an earlier validated"):
        sa.check_device_faults()
    sa.check_device_faults()  # raised once


@pytest.mark.cuda
@requires_cuda
def test_cuda_graph_captures_run_of_a_plan():
    """plan() once, then run() captured in a CUDA graph: replays with new q, k, v values give the
    one-call query_sparse result (run neither allocates nor synchronises)."""
    q, k, v = _qkv(1, 1000, 3000, 8, 2, 128, torch.bfloat16, device="cuda")
    lists = torch.from_numpy(random_query_lists(np.random.default_rng(5), 1, 2, 1000, 24, kq=4)).cuda()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        plan = sa.plan(q, k, v, lists, causal=True)
        out = torch.empty_like(q)
        lse = torch.empty((1, 8, 1000), dtype=torch.float32, device="cuda")
        sa.run(plan, q, k, v, out=out, lse=lse)  # warm-up outside the capture
    stream.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        sa.run(plan, q, k, v, out=out, lse=lse)
    for seed in (6, 7):
        new = _qkv(1, 1000, 3000, 8, 2, 128, torch.bfloat16, device="cuda", seed=seed)
        for dst, src in zip((q, k, v), new):
            dst.copy_(src)
        graph.replay()
        torch.cuda.synchronize()
        expect, expect_lse = sa.query_sparse(q, k, v, lists, causal=True, return_lse=True)
        torch.testing.assert_close(out, expect)
        torch.testing.assert_close(lse, expect_lse)
