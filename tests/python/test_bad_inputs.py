"""Bad input to every operator, on the CPU and (where torch sees a CUDA device) on the GPU: each case
asserts the error type and that the message names the operator, the argument and, where there is one,
the offending value. The CPU fixture is float32 with head dim 16; the GPU one bfloat16 with head dim
64, which the GPU executors take, so that each case reaches the check it is about rather than a dtype
refusal. Invalid selections with trusted=True are unchecked on the GPU by contract; they run under
compute-sanitizer in tests/gpu/bad_selections.py."""
import re

import numpy as np
import pytest

import sparse_attn as sa

try:
    import torch
    HAVE_CUDA = torch.cuda.is_available()
except ImportError:
    torch, HAVE_CUDA = None, False

DEVICES = ["cpu"] + (["cuda"] if HAVE_CUDA else [])
CPU_ONLY = "cpu_only"  # in a case's marks: the GPU leaves it unchecked (trusted device lists)


class Data:
    """A small valid problem (B 1, Lq 130, Lk 300, Hq 2, Hkv 1; D 16 float32 on the CPU, D 64 bfloat16
    on the GPU) and its selections, on `device`."""

    def __init__(self, device):
        rng = np.random.default_rng(7)
        self.device = device
        self.D = D = 16 if device == "cpu" else 64
        self.p = sa.ProblemShape(1, 130, 300, 2, 1, D)
        self.q = self.on(rng.standard_normal((1, 130, 2, D)).astype(np.float32))
        self.k = self.on(rng.standard_normal((1, 300, 1, D)).astype(np.float32))
        self.v = self.on(rng.standard_normal((1, 300, 1, D)).astype(np.float32))
        self.idx = self.on(np.array([[[[0, 1, -1], [0, 2, -1]]]], np.int32))  # TileLists [1, 1, 2, 3]
        self.cnt = self.on(np.array([[[2, 2]]], np.int32))
        self.bits = self.on(np.array([[[[3], [5]]]], np.uint32))              # BlockBits [1, 1, 2, 1]
        lists = np.full((1, 1, 130, 2), -1, np.int32)
        lists[..., 0] = 0
        self.lists = self.on(lists)                                           # QueryLists
        tokens = np.full((1, 1, 130, 4), -1, np.int32)
        tokens[..., 0] = 5
        self.tokens = self.on(tokens)                                         # TokenLists
        self.thr = self.on(np.zeros((2, 2), np.float32), exact=True)
        self.qI = self.on(rng.standard_normal((1, 130, 2, D)).astype(np.float32))
        self.w = self.on(rng.standard_normal((1, 130, 2)).astype(np.float32), exact=True)
        self.kI = self.on(rng.standard_normal((1, 300, D)).astype(np.float32))

    def on(self, a, exact=False):
        """`a` on the device; on the GPU float32 becomes bfloat16 unless `exact` (thresholds, weights)."""
        if self.device == "cpu":
            return a
        t = torch.from_numpy(a).to(self.device)
        return t.to(torch.bfloat16) if a.dtype == np.float32 and not exact else t

    def np(self, a):
        if isinstance(a, np.ndarray):
            return a
        return (a.float() if a.dtype in (torch.bfloat16, torch.float16) else a).cpu().numpy()

    def edit(self, name, fn):
        """A copy of array `name` changed by fn (on numpy), on the device; float32 goes back as the
        array's own dtype was (bfloat16 on the GPU for q, k, v), any other dtype fn chose stays."""
        x = getattr(self, name)
        return self.on(fn(self.np(x).copy()), exact=self.device == "cpu" or x.dtype != torch.bfloat16)

    def noncontig(self, name):
        """Array `name` viewed with stride 2 in its last dimension (on the device itself: a copy to
        the GPU would make it contiguous)."""
        x = getattr(self, name)
        return _noncontig(x) if self.device == "cpu" else x.repeat_interleave(2, dim=-1)[..., ::2]

    def settle(self):
        """On the GPU, raises what validated calls found in the lists as they ran (they report it
        without a host round trip, at check_device_faults or the next call)."""
        if self.device != "cpu":
            torch.cuda.synchronize()
            sa.check_device_faults()


def _set(a, where, value):
    a[where] = value
    return a


def _noncontig(a):
    return np.repeat(a, 2, axis=-1)[..., ::2]


# (id, operator named in the message, argument, value in the message or None, call(d), error types, marks)
CASES = [
    # ---- shapes -------------------------------------------------------------------------------
    ("dense-q-rank3", "dense", "q", "3", lambda d: sa.dense(d.q[0], d.k, d.v), sa.Error, ()),
    ("dense-k-D", "dense", "k", "8", lambda d: sa.dense(d.q, d.k[..., :8], d.v), sa.Error, ()),
    ("dense-v-Lk", "dense", "v", "299", lambda d: sa.dense(d.q, d.k, d.v[:, :299]), sa.Error, ()),
    ("dense-heads", "dense", "k", "3", lambda d: sa.dense(d.edit("q", lambda a: np.concatenate([a, a[:, :, :1]], 2)),
                                                          *(d.edit(n, lambda a: a.repeat(2, 2)) for n in "kv")),
     sa.Error, ()),
    ("dense-out-shape", "dense", "out", None, lambda d: sa.dense(d.q, d.k, d.v, out=d.q[:, :5]), sa.Error, ()),
    ("tile-cnt-shape", "tile_sparse", "tiles.cnt", None, lambda d: sa.tile_sparse(d.q, d.k, d.v, d.idx, d.cnt[..., :1]),
     sa.Error, ()),
    ("bits-words", "bits_sparse", "bits.bits", None,
     lambda d: sa.bits_sparse(d.q, d.k, d.v, d.edit("bits", lambda a: np.concatenate([a, a], -1))), sa.Error, ()),
    ("query-lists-Lq", "query_sparse", "lists.idx", "129", lambda d: sa.query_sparse(d.q, d.k, d.v, d.lists[:, :, :129]),
     sa.Error, ()),
    ("token-lists-rank", "token_sparse", "tokens.idx", "3", lambda d: sa.token_sparse(d.q, d.k, d.v, d.tokens[0]),
     sa.Error, ()),
    ("gated-thresholds", "gated", "thresholds", None, lambda d: sa.gated(d.q, d.q, d.q, d.thr[:1]), sa.Error, ()),
    ("entmax-v-shape", "entmax", "v", None, lambda d: sa.entmax(d.q, d.k, d.v[:, :5]), sa.Error, ()),
    ("pooled-k-rank", "pooled_select", "k", "3", lambda d: sa.pooled_select(d.q, d.k[0], top_k=2), sa.Error, ()),
    ("token-max-kidx", "token_max_select", "kidx", None,
     lambda d: sa.token_max_select(d.qI[:, :, :1], d.kI[:, :, None, :8], top_k=2), sa.Error, ()),
    ("lightning-w", "lightning_select", "w", None, lambda d: sa.lightning_select(d.qI, d.w[..., :1], d.kI, top_k=2),
     sa.Error, ()),
    ("t2b-cnt", "tile_lists_to_block_bits", "in.cnt", None,
     lambda d: sa.tile_lists_to_block_bits(d.idx, d.cnt[..., :1], d.p), sa.Error, ()),
    ("b2t-bits", "block_bits_to_tile_lists", "in.bits", None,
     lambda d: sa.block_bits_to_tile_lists(d.bits[:, :, :1], d.p), sa.Error, ()),
    ("q2t-lists", "query_lists_to_tile_lists", "in.idx", None,
     lambda d: sa.query_lists_to_tile_lists(d.lists[:, :, :7], d.p), sa.Error, ()),
    ("evaluate-k-shape", "evaluate_selection", "k", None,
     lambda d: sa.evaluate(d.np(d.q), d.np(d.k)[..., :8], d.np(d.v)), sa.Error, ()),
    ("validate-cnt", "validate", "tiles.cnt", None,
     lambda d: sa.validate(d.p, tiles=(d.np(d.idx), d.np(d.cnt)[..., :1])), sa.Error, ()),
    ("table-values", "ThresholdTable", "values", "5", lambda d: sa.ThresholdTable([1], 1, 2, 2, np.zeros(5, np.float32)),
     sa.Error, ()),
    # ---- dtypes and non-arrays -----------------------------------------------------------------
    ("dense-q-f64", "dense", "q", "f64", lambda d: sa.dense(d.edit("q", lambda a: a.astype(np.float64)), d.k, d.v),
     sa.Error, ()),
    ("dense-k-int", "dense", "k", "int64", lambda d: sa.dense(d.q, d.edit("k", lambda a: a.astype(np.int64)), d.v),
     sa.Error, ()),
    ("dense-q-list", "dense", "q", "list", lambda d: sa.dense([[1.0]], d.k, d.v), sa.Error, ()),
    ("dense-v-big-endian", "dense", "v", "byte order", lambda d: sa.dense(d.np(d.q), d.np(d.k), d.np(d.v).astype(">f4")),
     sa.Error, ()),
    ("tile-idx-int64", "tile_sparse", "tiles.idx", "int64",
     lambda d: sa.tile_sparse(d.q, d.k, d.v, d.edit("idx", lambda a: a.astype(np.int64)), d.cnt), sa.Error, ()),
    ("bits-int32", "bits_sparse", "bits.bits", "i32",
     lambda d: sa.bits_sparse(d.q, d.k, d.v, d.edit("bits", lambda a: a.astype(np.int32))), sa.Error, ()),
    ("query-lists-f32", "query_sparse", "lists.idx", "f32",
     lambda d: sa.query_sparse(d.q, d.k, d.v, d.edit("lists", lambda a: a.astype(np.float32))), sa.Error, ()),
    ("token-lists-u32", "token_sparse", "tokens.idx", "u32",
     lambda d: sa.token_sparse(d.q, d.k, d.v, d.edit("tokens", lambda a: a.astype(np.uint32))), sa.Error, ()),
    ("gated-thresholds-None", "gated", "thresholds", "None", lambda d: sa.gated(d.q, d.q, d.q, None), TypeError, ()),
    ("entmax-out-f16", "entmax", "out", None,
     lambda d: sa.entmax(d.q, d.k, d.v, out=d.edit("q", lambda a: a.astype(np.float16))), sa.Error, ()),
    ("lightning-w-f16", "lightning_select", "w", None,
     lambda d: sa.lightning_select(d.qI, d.edit("w", lambda a: a.astype(np.float16)), d.kI, top_k=2), sa.Error, ()),
    ("validate-shape-tuple", "validate", "shape", "tuple", lambda d: sa.validate((1, 2), bits=d.np(d.bits)),
     TypeError, ()),
    ("t2b-shape-str", "tile_lists_to_block_bits", "shape", "str",
     lambda d: sa.tile_lists_to_block_bits(d.idx, d.cnt, "p"), TypeError, ()),
    ("scale-str", "dense", "softmax_scale", "'x'", lambda d: sa.dense(d.q, d.k, d.v, softmax_scale="x"), TypeError, ()),
    ("e4m3-f64", "float_to_e4m3", "x", "float64", lambda d: sa.float_to_e4m3(np.zeros(3)), TypeError, ()),
    # the classes' constructors and methods (the class is the operator)
    ("table-budgets-str", "ThresholdTable", "budgets", "'x'", lambda d: sa.ThresholdTable("x", 1, 1, 1), TypeError, ()),
    ("table-values-str", "ThresholdTable", "values", "'v'", lambda d: sa.ThresholdTable([1], 1, 1, 1, "v"),
     TypeError, ()),
    ("table-values-int32", "ThresholdTable", "values", "int32",
     lambda d: sa.ThresholdTable([1], 1, 1, 1, np.zeros(1, np.int32)), TypeError, ()),
    ("table-at-str", "ThresholdTable", "budget", "'a'", lambda d: sa.ThresholdTable([1], 1, 1, 1).at("a", 0, 0, 0),
     TypeError, ()),
    ("table-load-int", "ThresholdTable", "path", "5", lambda d: sa.ThresholdTable.load(5), TypeError, ()),
    ("shape-B-str", "ProblemShape", "B", "'a'", lambda d: sa.ProblemShape("a", 1, 1, 1, 1, 1), TypeError, ()),
    ("shape-causal-str", "ProblemShape", "causal", "'no'", lambda d: sa.ProblemShape(1, 1, 1, 1, 1, 1, causal="no"),
     TypeError, ()),
    ("calibrator-layers-str", "Calibrator", "n_layers", "'x'", lambda d: sa.Calibrator([1], "x"), TypeError, ()),
    # ---- strides --------------------------------------------------------------------------------
    ("dense-q-last-dim", "dense", "q", "stride 2", lambda d: sa.dense(d.noncontig("q"), d.k, d.v), sa.Error, ()),
    ("tile-k-last-dim", "tile_sparse", "k", "stride 2",
     lambda d: sa.tile_sparse(d.q, d.noncontig("k"), d.v, d.idx, d.cnt), sa.Error, ()),
    ("pooled-q-last-dim", "pooled_select", "q", "stride 2",
     lambda d: sa.pooled_select(d.noncontig("q"), d.k, top_k=2), sa.Error, ()),
    ("dense-out-last-dim", "dense", "out", "stride 2",
     lambda d: sa.dense(d.q, d.k, d.v, out=d.on(np.zeros((1, 130, 2, 2 * d.D), np.float32))[..., ::2]), sa.Error, ()),
    # ---- aliasing (out overlapping an input) ------------------------------------------------------
    ("dense-out-is-q", "dense", "out", None, lambda d: sa.dense(d.q, d.q, d.q, out=d.q), sa.Error, ()),
    ("tile-out-is-k", "tile_sparse", "out", None,
     lambda d: sa.tile_sparse(d.q, d.q, d.q, d.idx[..., :1], d.cnt * 0 + 1, out=d.q), sa.Error, ()),
    ("query-out-overlaps-v", "query_sparse", "out", None,
     lambda d: (lambda buf: sa.query_sparse(d.q, buf[:, :130], buf[:, 1:], d.lists[..., :1], out=buf[:, 1:]))(
         d.on(np.ones((1, 131, 2, d.D), np.float32))), sa.Error, ()),
    ("token-out-is-v", "token_sparse", "out", None, lambda d: sa.token_sparse(d.q, d.q, d.q, d.tokens, out=d.q),
     sa.Error, ()),
    # ---- invalid selections, with and without trusted --------------------------------------------
    # trusted skips the content checks that only guard the meaning (order); the CPU still refuses
    # whatever would read out of bounds.
    *[(f"{name}-trusted{int(trusted)}", op, arg, value, call(trusted), sa.Error,
       (CPU_ONLY,) if trusted else ())
      for trusted in (False, True)
      for name, op, arg, value, call in [
          ("tile-id-past-end", "tile_sparse", "tiles.idx", "3",
           lambda t: lambda d: sa.tile_sparse(d.q, d.k, d.v, d.edit("idx", lambda a: _set(a, (0, 0, 0, 1), 3)), d.cnt,
                                              trusted=t)),
          ("tile-count-over", "tile_sparse", "tiles.cnt", "4",
           lambda t: lambda d: sa.tile_sparse(d.q, d.k, d.v, d.idx, d.edit("cnt", lambda a: _set(a, (0, 0, 1), 4)),
                                              trusted=t)),
          ("tile-count-negative", "tile_sparse", "tiles.cnt", "-1",
           lambda t: lambda d: sa.tile_sparse(d.q, d.k, d.v, d.idx, d.edit("cnt", lambda a: _set(a, (0, 0, 1), -1)),
                                              trusted=t)),
          ("query-id-negative", "query_sparse", "lists.idx", "-2",
           lambda t: lambda d: sa.query_sparse(d.q, d.k, d.v, d.edit("lists", lambda a: _set(a, (0, 0, 3, 0), -2)),
                                               trusted=t)),
          ("token-id-past-end", "token_sparse", "tokens.idx", "300",
           lambda t: lambda d: sa.token_sparse(d.q, d.k, d.v, d.edit("tokens", lambda a: _set(a, (0, 0, 9, 1), 300)),
                                               trusted=t)),
      ]],
    ("tile-unsorted", "tile_sparse", "tiles.idx", None,
     lambda d: sa.tile_sparse(d.q, d.k, d.v, d.edit("idx", lambda a: _set(a, (0, 0, 0, slice(0, 2)), [1, 0])), d.cnt),
     sa.Error, ()),
    ("bits-stray", "bits_sparse", "bits.bits", "stray bit",
     lambda d: sa.bits_sparse(d.q, d.k, d.v, d.edit("bits", lambda a: _set(a, (0, 0, 0, 0), 1 << 7))), sa.Error, ()),
    ("t2b-id-negative", "tile_lists_to_block_bits", "in.idx", "-5",
     lambda d: sa.tile_lists_to_block_bits(d.edit("idx", lambda a: _set(a, (0, 0, 1, 0), -5)), d.cnt, d.p), sa.Error, ()),
    ("b2t-kmax-small", "block_bits_to_tile_lists", "out.idx", None,
     lambda d: sa.block_bits_to_tile_lists(d.bits, d.p, kmax=1), sa.Error, ()),
    ("q2t-duplicate", "query_lists_to_tile_lists", "in.idx", None,
     lambda d: sa.query_lists_to_tile_lists(d.edit("lists", lambda a: _set(a, (0, 0, 2, 1), 0)), d.p), sa.Error, ()),
    ("validate-id", "validate", "tokens.idx", "300",
     lambda d: sa.validate(d.p, token_lists=d.np(d.edit("tokens", lambda a: _set(a, (0, 0, 0, 2), 300)))), sa.Error, ()),
    ("evaluate-id", "evaluate_selection", "lists.idx", "9",
     lambda d: sa.evaluate(d.np(d.q), d.np(d.k), d.np(d.v), query_lists=d.np(d.edit("lists", lambda a: _set(a, (0, 0, 0, 0), 9)))),
     sa.Error, ()),
    # ---- options ---------------------------------------------------------------------------------
    ("pooled-top-k-0", "pooled_select", "top_k", "0", lambda d: sa.pooled_select(d.q, d.k, top_k=0), sa.Error, ()),
    ("pooled-top-k-float", "pooled_select", "top_k", "2.5", lambda d: sa.pooled_select(d.q, d.k, top_k=2.5),
     TypeError, ()),
    ("pooled-kmax-negative", "pooled_select", "kmax", "-1", lambda d: sa.pooled_select(d.q, d.k, kmax=-1), sa.Error, ()),
    ("pooled-representatives", "pooled_select", "representatives", "3",
     lambda d: sa.pooled_select(d.q, d.k, top_k=2, representatives=3), sa.Error, ()),
    ("token-max-precision", "token_max_select", "precision", "int4",
     lambda d: sa.token_max_select(d.qI[:, :, :1], d.kI[:, :, None], top_k=2, precision="int4"), sa.Error, ()),
    ("token-max-top-k-negative", "token_max_select", "top_k", "-3",
     lambda d: sa.token_max_select(d.qI[:, :, :1], d.kI[:, :, None], top_k=-3), sa.Error, ()),
    ("token-max-format", "token_max_select", "format", "rows",
     lambda d: sa.token_max_select(d.qI[:, :, :1], d.kI[:, :, None], top_k=2, format="rows"), sa.Error, ()),
    ("lightning-groups-negative", "lightning_select", "groups", "-1",
     lambda d: sa.lightning_select(d.qI, d.w, d.kI, top_k=2, groups=-1), sa.Error, ()),
    ("lightning-kmax-negative", "lightning_select", "kmax", "-2",
     lambda d: sa.lightning_select(d.qI, d.w, d.kI, top_k=2, kmax=-2), sa.Error, ()),
    ("lightning-precision-type", "lightning_select", "precision", "5",
     lambda d: sa.lightning_select(d.qI, d.w, d.kI, top_k=2, precision=5), TypeError, ()),
    ("entmax-alpha", "entmax", "alpha", "1", lambda d: sa.entmax(d.q, d.k, d.v, alpha=1.0), sa.Error, ()),
    ("entmax-bins", "entmax", "histogram_bins", "0", lambda d: sa.entmax(d.q, d.k, d.v, histogram_bins=0), sa.Error, ()),
    ("query-merge-window", "query_sparse", "merge_window", "9",
     lambda d: sa.query_sparse(d.q, d.k, d.v, d.lists, merge_window=9), sa.Error, ()),
    ("query-partials", "query_sparse", "partials", "f8", lambda d: sa.query_sparse(d.q, d.k, d.v, d.lists, partials="f8"),
     sa.Error, ()),
    ("query-schedule", "query_sparse", "schedule", "q_centric",
     lambda d: sa.query_sparse(d.q, d.k, d.v, d.lists, schedule="q_centric"), sa.Error, ()),
    ("dense-scale-negative", "dense", "softmax_scale", "-1", lambda d: sa.dense(d.q, d.k, d.v, softmax_scale=-1.0),
     sa.Error, ()),
    ("q2t-kmax-negative", "query_lists_to_tile_lists", "kmax", "-1",
     lambda d: sa.query_lists_to_tile_lists(d.lists, d.p, kmax=-1), sa.Error, ()),
    ("table-n-heads", "ThresholdTable", "n_heads", "0", lambda d: sa.ThresholdTable([1], 1, 0, 1), sa.Error, ()),
    ("table-budget", "ThresholdTable", "budget", "5", lambda d: sa.ThresholdTable([1], 1, 1, 1).slice(5, 0), sa.Error, ()),
    ("table-budget-index", "ThresholdTable", "k", "7", lambda d: sa.ThresholdTable([1], 1, 1, 1).budget_index(7),
     sa.Error, ()),
]


def _params():
    for id_, op, arg, value, call, exc, marks in CASES:
        cpu_only = CPU_ONLY in marks
        marks = tuple(m for m in marks if m is not CPU_ONLY)
        yield pytest.param(op, arg, value, call, exc, cpu_only, id=id_, marks=marks)


@pytest.fixture(params=DEVICES)
def data(request):
    return Data(request.param)


def _check(fn, op, arg, value, exc):
    with pytest.raises(exc) as info:
        fn()
    message = str(info.value)
    # Options structs name the field: "options.top_k".
    assert re.match(rf"{re.escape(op)}: argument '(options\.)?{re.escape(arg)}'", message), message
    if value is not None:
        assert value in message, message
    return message


@pytest.mark.parametrize("op, arg, value, call, exc, cpu_only", list(_params()))
def test_bad_input_names_operator_argument_and_value(data, op, arg, value, call, exc, cpu_only):
    if cpu_only and data.device != "cpu":
        pytest.skip("trusted device lists are not checked (tests/gpu/bad_selections.py runs them under "
                    "compute-sanitizer)")
    _check(lambda: (call(data), data.settle()), op, arg, value, exc)


@pytest.mark.parametrize("op", ["dense", "tile_sparse", "query_sparse", "token_sparse"])
@pytest.mark.parametrize("where", ["q", "k", "v"])
def test_nan_in_gives_nan_out(data, op, where):
    """A NaN in q (its row) or in the k / v of a selected key (every row that sees it) gives NaN there;
    the other rows stay finite."""
    q, k, v = (data.np(x).copy() for x in (data.q, data.k, data.v))
    {"q": q, "k": k, "v": v}[where][0, 0, 0, 0] = np.nan
    sel = {"dense": (), "tile_sparse": (data.idx, data.cnt), "query_sparse": (data.lists,),
           "token_sparse": (data.tokens,)}[op]
    if op == "token_sparse":  # key 0 selected by every query
        sel = (data.edit("tokens", lambda a: _set(a, (..., 1), 0)),)
    out = data.np(getattr(sa, op)(data.on(q), data.on(k), data.on(v), *sel))
    rows = np.isnan(out).any(-1)
    if where == "q":
        assert rows[0, 0, 0] and rows.sum() == 1
    else:
        assert rows[0, :, :].all()


def test_mixed_devices_are_refused_naming_both():
    torch_ = pytest.importorskip("torch")
    import sparse_attn.torch as sat
    q = torch_.zeros((1, 8, 2, 16), device="meta")
    k = torch_.zeros((1, 8, 1, 16))
    with pytest.raises(sa.Error, match=r"dense: argument 'k': is on cpu but 'q' is on meta"):
        sat.dense(q, k, k)
    with pytest.raises(sa.Error, match=r"tile_sparse: argument 'q': expected 4 dimensions, got shape \[8, 1, 16\]"):
        sat.tile_sparse(k[0], k, k, torch_.zeros((1, 1, 1, 1), dtype=torch_.int32),
                        torch_.zeros((1, 1, 1), dtype=torch_.int32))
    with pytest.raises(sa.Error, match=r"lightning_select: argument 'groups': must be >= 1, got -1"):
        sat.lightning_select(torch_.zeros((1, 8, 2, 16)), torch_.zeros((1, 8, 2)), torch_.zeros((1, 8, 16)),
                             top_k=2, groups=-1)


def test_threshold_file_errors_name_the_file(tmp_path):
    path = tmp_path / "t.safetensors"
    path.write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{}")
    with pytest.raises(sa.Error) as info:
        sa.load_thresholds(path)
    assert re.match(r"ThresholdTable: argument '[^']*t\.safetensors'", str(info.value)), str(info.value)
