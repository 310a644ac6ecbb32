"""The harness every GPU benchmark in bench/gpu shares: arguments, inputs, peers, timing, verification
and the JSON file.

The benchmarks call the library through its Python package only (``sparse_attn`` on torch tensors,
which runs on the current CUDA stream). The pure-Python parts here (arguments, JSON, list checks, pair
counts) import neither torch nor the package, so tests/python/test_bench_scripts.py runs them on a
machine without a GPU; everything else imports torch when it is called.

Timing (Timer): ``triton.testing.do_bench`` -- L2 flushed before every call, the median of the calls
that fit in --rep-ms after --warmup-ms of warm-up. With --sustain-ms S, the median over --samples
samples of back-to-back calls that fill at least S ms each, with no flush: the H200 holds its power
limit by lowering its clock within tens of ms, so short bursts of a power-hungry kernel run faster than
the same kernel does back to back in a model (docs/notes/kv_attention.md, the power limit).

Verification (verify_rows): before anything is timed its output is checked on sampled rows against a
float64 reference of the same selection, under the bound of docs/design.md §6: relative error at most twice
that of a plain implementation in the input precision plus 1e-3, largest element error at most twice
plain plus 1e-2.

Peers: SDPA (cuDNN and flash backends) and FlexAttention come with torch; FA4 (flash_attn.cute) and
FlashInfer are used when importable (pip --target folders on PYTHONPATH work: their .pth files are
read). An absent peer is reported as absent with the import error, never as a failure.

Useful TFLOP/s = 4 * D * (selected and visible (query head, query, key) triples) / time.
"""
import contextlib
import datetime
import json
import math
import os
import platform
import site
import subprocess
import sys
import time

BLOCK = 128  # query tile and key block
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TIMING_DEFAULTS = {"warmup_ms": 25.0, "rep_ms": 100.0, "samples": 15}
TIMING_QUICK = {"warmup_ms": 10.0, "rep_ms": 30.0, "samples": 5}


class VerificationError(Exception):
    """An output failed its check: the run stops (exit status 1) after writing what it measured."""


def ceil_div(a, b):
    return -(-a // b)


# ---- arguments --------------------------------------------------------------------------------------

def add_args(parser, peers=True):
    """The options every benchmark takes: output, size of the run, peers and timing."""
    parser.add_argument("--json", help="write the results to this file (rewritten as rows arrive)")
    parser.add_argument("--quick", action="store_true", help="fewer cases and shorter timing")
    if peers:
        parser.add_argument("--no-peers", action="store_true", help="time the library alone")
    parser.add_argument("--warmup-ms", type=float, help="do_bench warm-up per figure (default 25, 10 with --quick)")
    parser.add_argument("--rep-ms", type=float, help="do_bench timed span per figure (default 100, 30 with --quick)")
    parser.add_argument("--sustain-ms", type=float, default=0.0,
                        help="time samples of back-to-back calls filling at least this many ms each, no L2 flush "
                             "(the clock under the power limit, as in a model); default 0: do_bench")
    parser.add_argument("--samples", type=int, help="samples per figure with --sustain-ms and for part timings "
                                                    "(default 15, 5 with --quick)")
    parser.add_argument("--seed", type=int, default=1234, help="seed of the inputs and selections")
    return parser


def finish_args(parser, args):
    """Fills the timing defaults (--quick shortens them) and refuses values out of range."""
    base = TIMING_QUICK if args.quick else TIMING_DEFAULTS
    for name, value in base.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if not args.rep_ms > 0:
        parser.error(f"--rep-ms must be > 0, got {args.rep_ms}")
    if not args.warmup_ms >= 0:
        parser.error(f"--warmup-ms must be >= 0, got {args.warmup_ms}")
    if not args.sustain_ms >= 0:
        parser.error(f"--sustain-ms must be >= 0, got {args.sustain_ms}")
    if args.samples < 1:
        parser.error(f"--samples must be >= 1, got {args.samples}")
    return args


def parse(parser, argv=None):
    return finish_args(parser, parser.parse_args(argv))


# ---- run description and the JSON file --------------------------------------------------------------

def git_commit(root=ROOT):
    """HEAD of the checkout holding the benchmarks, with '-dirty' when tracked files differ. Where
    there is no git repository (a copy of the tree on a GPU machine), $GIT_COMMIT as the caller set it,
    else None."""
    try:
        head = subprocess.run(["git", "-C", root, "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10)
        if head.returncode == 0:
            dirty = subprocess.run(["git", "-C", root, "status", "--porcelain", "--untracked-files=no"],
                                   capture_output=True, text=True, timeout=10)
            return head.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")
    except (OSError, subprocess.SubprocessError):
        pass
    return os.environ.get("GIT_COMMIT")


def timing_text(args):
    if args.sustain_ms > 0:
        return (f"median of {args.samples} samples of back-to-back calls filling >= {args.sustain_ms:g} ms each, "
                f"no L2 flush, CUDA events")
    return (f"triton do_bench: L2 flushed before each call, median over {args.rep_ms:g} ms of calls after "
            f"{args.warmup_ms:g} ms of warm-up")


def run_meta(args=None, **extra):
    """What the results were measured on and how: date, commit, command, software, device."""
    meta = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "git_commit": git_commit(), "command": " ".join(sys.argv), "python": platform.python_version(),
            "useful_flops": "4 * D * selected and visible (query head, query, key) triples"}
    if args is not None:
        meta["timing"] = timing_text(args)
    torch = sys.modules.get("torch")
    if torch is not None:
        meta.update(torch=torch.__version__, cuda=torch.version.cuda)
        if torch.cuda.is_available():
            meta["device"] = torch.cuda.get_device_name()
            meta["cudnn"] = torch.backends.cudnn.version()
    sa = sys.modules.get("sparse_attn")
    if sa is not None:
        meta["sparse_attn"] = sa.build_info()
    meta.update(extra)
    return meta


def write_json(path, doc):
    """Writes doc to path through a temporary file, so a run killed mid-write leaves the last whole file."""
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(doc, f, indent=1)
    os.replace(tmp, path)


class Results:
    """meta and rows of one run, written to `path` (if any) after every row."""

    def __init__(self, path, meta):
        self.path, self.doc = path, {"meta": meta, "rows": []}

    @property
    def rows(self):
        return self.doc["rows"]

    def add(self, row, echo=True):
        self.rows.append(row)
        if echo:
            print(json.dumps(row), flush=True)
        self.save()

    def save(self):
        if self.path:
            write_json(self.path, self.doc)

    def fail(self, message):
        """Records why the run stopped early (meta.failure) with the rows measured so far."""
        self.doc["meta"]["failure"] = message
        self.save()

    @contextlib.contextmanager
    def recording_failure(self):
        """A VerificationError raised inside is recorded in the file (fail) and passed on."""
        try:
            yield self
        except VerificationError as e:
            self.fail(str(e))
            raise


def exit_status(run, args):
    """run(args) as a script's exit status: 0, or 1 with the message of a VerificationError."""
    try:
        run(args)
    except VerificationError as e:
        print("FAILED: %s" % e, file=sys.stderr)
        return 1
    return 0


def run_measurement(args, measure, table):
    """The common driver of a benchmark script: generators (GPU and CPU) from args.seed, the timer,
    the peers, the results file; measure(args, res, timer, peers, gen, cpu_gen) fills the rows,
    table(rows) prints them."""
    torch, _ = gpu_modules()
    gen = generator(args.seed)
    cpu_gen = torch.Generator().manual_seed(args.seed)
    timer = Timer(args)
    peers = Peers(enabled=not args.no_peers)
    res = Results(args.json, run_meta(args, peers=peers.status, timer=timer.method))
    with res.recording_failure():
        measure(args, res, timer, peers, gen, cpu_gen)
    print()
    print(table(res.rows))


def tflops(flop, ms):
    return flop / ms / 1e9 if ms and ms > 0 else None


# ---- TileLists on the host (nested lists): selector contracts and pair counts ------------------------

def forced_blocks(selector, t, Lq, Lk):
    """Blocks a non-causal selector keeps for Q tile t with the library's defaults: pooled forces the
    block holding key min(first query * Lk / Lq, Lk - 1); token_max reserves the blocks of the aligned
    keys clamp(i + Lk - Lq, 0, Lk - 1) of the tile's queries i."""
    Tk = ceil_div(Lk, BLOCK)
    i0, i1 = t * BLOCK, min(Lq, (t + 1) * BLOCK) - 1
    if selector.startswith("pooled"):
        return {min(i0 * Lk // Lq // BLOCK, Tk - 1)}
    aligned = lambda i: min(max(i + Lk - Lq, 0), Lk - 1)
    return set(range(aligned(i0) // BLOCK, aligned(i1) // BLOCK + 1))


def selector_list_problems(idx, cnt, Lq, Lk, top_k, selector, limit=10):
    """Problems of TileLists idx [B][G][Tq][Kmax], cnt [B][G][Tq] (nested lists) as a non-causal selector
    must write them: count min(top_k, Tk), ids ascending, distinct, in [0, Tk), -1 in the unused slots,
    the forced blocks present. At most `limit` messages; empty when all hold."""
    Tk, Tq = ceil_div(Lk, BLOCK), ceil_div(Lq, BLOCK)
    want = min(top_k, Tk)
    problems = []

    def bad(msg):
        if len(problems) < limit:
            problems.append(msg)

    if len(idx) != len(cnt):
        return ["idx holds %d batches, cnt %d" % (len(idx), len(cnt))]
    for b, (ib, cb) in enumerate(zip(idx, cnt)):
        if len(ib) != len(cb):
            bad("batch %d: idx holds %d groups, cnt %d" % (b, len(ib), len(cb)))
            continue
        for g, (ig, cg) in enumerate(zip(ib, cb)):
            if len(ig) != Tq or len(cg) != Tq:
                bad("[%d, %d]: %d / %d Q tiles, expected %d" % (b, g, len(ig), len(cg), Tq))
                continue
            for t, (row, c) in enumerate(zip(ig, cg)):
                at = "[%d, %d, %d]" % (b, g, t)
                if c != want:
                    bad("cnt%s = %d, expected min(top_k, Tk) = %d" % (at, c, want))
                    continue
                ids = row[:c]
                if any(j < 0 or j >= Tk for j in ids):
                    bad("idx%s holds an id outside [0, %d): %s" % (at, Tk, ids))
                elif any(a >= b_ for a, b_ in zip(ids, ids[1:])):
                    bad("idx%s is not strictly ascending: %s" % (at, ids))
                elif any(j != -1 for j in row[c:]):
                    bad("idx%s: slots past the count are not -1: %s" % (at, row[c:]))
                else:
                    missing = forced_blocks(selector, t, Lq, Lk) - set(ids)
                    if missing:
                        bad("idx%s lacks the forced block(s) %s: %s" % (at, sorted(missing), ids))
    return problems


def selected_pairs(idx, cnt, Lq, Lk, Hq):
    """(query head, query, key) triples that TileLists (nested lists) select, non-causal: per list, the
    tile's queries times the keys of its blocks (the last tile and block may be partial), times the
    query heads sharing the list."""
    total = 0
    for ib, cb in zip(idx, cnt):
        heads = Hq // len(cb)
        for ig, cg in zip(ib, cb):
            for t, (row, c) in enumerate(zip(ig, cg)):
                rows = min(Lq, (t + 1) * BLOCK) - t * BLOCK
                keys = sum(min(Lk, (j + 1) * BLOCK) - j * BLOCK for j in row[:c])
                total += heads * rows * keys
    return total


def dense_pairs(B, Hq, Lq, Lk, causal):
    """Visible (query head, query, key) triples of dense attention, causal aligned bottom right."""
    if not causal:
        return B * Hq * Lq * Lk
    off = Lk - Lq
    return B * Hq * sum(max(0, min(Lk, i + off + 1)) for i in range(Lq))


# ---- inputs (torch) ---------------------------------------------------------------------------------

def gpu_modules():
    """(torch, sparse_attn) with a CUDA device, or exit naming what is missing."""
    try:
        import torch
        import sparse_attn
    except ImportError as e:
        raise SystemExit(f"this benchmark needs torch and the sparse_attn package: {e}")
    if not torch.cuda.is_available():
        raise SystemExit("this benchmark needs a CUDA device (torch.cuda.is_available() is False)")
    return torch, sparse_attn


def generator(seed, device="cuda"):
    import torch
    return torch.Generator(device=device).manual_seed(seed)


def random_qkv(B, Lq, Lk, Hq, Hkv, D, gen, dtype=None):
    """q [B, Lq, Hq, D], k and v [B, Lk, Hkv, D]: standard normal values in `dtype` (bf16 by default)
    on the generator's device, drawn in that order."""
    import torch
    dt = torch.bfloat16 if dtype is None else dtype
    dev = gen.device
    q = torch.randn(B, Lq, Hq, D, device=dev, dtype=dt, generator=gen)
    k = torch.randn(B, Lk, Hkv, D, device=dev, dtype=dt, generator=gen)
    v = torch.randn(B, Lk, Hkv, D, device=dev, dtype=dt, generator=gen)
    return q, k, v


def tile_lists(B, G, Tq, Tk, nsel, pattern, gen):
    """TileLists on the generator's device: idx int32 [B, G, Tq, nsel] of distinct ascending ids drawn
    uniformly, cnt int32 [B, G, Tq] = nsel. pattern 'independent': a list per Q tile; 'pairs': Q tiles
    2t and 2t + 1 share one list."""
    import torch
    if pattern not in ("independent", "pairs"):
        raise ValueError(f"unknown list pattern {pattern!r} (independent or pairs)")
    if nsel > Tk:
        raise ValueError(f"{nsel} blocks per Q tile exceed the {Tk} KV blocks")
    ids = torch.rand(B, G, Tq, Tk, device=gen.device, generator=gen).topk(nsel, dim=3).indices
    if pattern == "pairs":
        ids[:, :, 1::2] = ids[:, :, 0:Tq - Tq % 2:2]
    idx = ids.sort(dim=3).values.to(torch.int32).contiguous()
    return idx, torch.full((B, G, Tq), nsel, dtype=torch.int32, device=gen.device)


# ---- verification -----------------------------------------------------------------------------------

def relerr(x, ref):
    """||x - ref|| / ||ref|| over whole tensors (inf where x holds a NaN or inf)."""
    import torch
    x, ref = x.double(), ref.double()
    if not torch.isfinite(x).all():
        return float("inf")
    return ((x - ref).norm() / ref.norm().clamp_min(1e-300)).item()


def err_pair(x, ref):
    """(relative error, largest element error) of x against ref."""
    x, ref = x.double(), ref.double()
    if not bool(x.isfinite().all()):
        return float("inf"), float("inf")
    return relerr(x, ref), (x - ref).abs().max().item()


def attention_rows(q, k, v, b, h, rows, keymask):
    """Attention of query rows `rows` (long tensor) of (batch b, query head h) over the keys where
    keymask (bool [len(rows), Lk]) holds: (float64 reference, plain implementation in q's dtype: P
    rounded to it before PV and the output rounded). A row without keys gives 0."""
    import torch
    Hq, D = q.shape[2], q.shape[3]
    g = h // (Hq // k.shape[2])
    dev = q.device
    rows = rows.to(dev)
    keymask = keymask.to(dev)
    s = (q[b, rows, h].double() @ k[b, :, g].double().T) / math.sqrt(D)
    p = torch.softmax(s.masked_fill(~keymask, float("-inf")), dim=1).nan_to_num(0.0)
    vv = v[b, :, g].double()
    plain = (p.to(q.dtype).double() @ vv).to(q.dtype).double()
    return p @ vv, plain


def tile_keymask(idx, cnt, b, g, rows, Lq, Lk, causal):
    """bool [len(rows), Lk]: the keys query rows `rows` see under TileLists (idx, cnt) of list group g
    (idx None: every key), causal aligned bottom right."""
    import torch
    dev = rows.device
    if idx is None:
        mask = torch.ones(len(rows), Lk, dtype=torch.bool, device=dev)
    else:
        tiles = (rows // BLOCK).tolist()
        blocks = torch.zeros(len(rows), ceil_div(Lk, BLOCK), dtype=torch.bool, device=dev)
        lists = idx[b, g].cpu()
        counts = cnt[b, g].cpu()
        for r, t in enumerate(tiles):
            blocks[r, lists[t, :int(counts[t])].long().to(dev)] = True
        mask = blocks.repeat_interleave(BLOCK, dim=1)[:, :Lk]
    if causal:
        keys = torch.arange(Lk, device=dev)
        mask &= keys[None, :] <= rows[:, None] + (Lk - Lq)
    return mask


def sample_rows(Lq, gen, n=64):
    """The first and last query and n random ones, ascending, on the CPU."""
    import torch
    picked = torch.randint(0, Lq, (n,), generator=gen).tolist()
    return torch.tensor(sorted(set(picked + [0, Lq - 1])), dtype=torch.long)


def verify_rows(out, q, k, v, keymask, gen, heads=None, n=64):
    """Checks out [B, Lq, Hq, D] (finite everywhere) on sampled rows of (batch, head) pairs `heads`
    (default: the first and the last) against attention_rows over keymask(b, h, rows) -> bool
    [len(rows), Lk]. Returns a dict: ok, all_finite, and the worst pair's relerr, maxerr,
    plain_relerr, plain_maxerr."""
    import torch
    B, Lq, Hq, _ = q.shape
    rows = sample_rows(Lq, gen, n)
    heads = heads or sorted({(0, 0), (B - 1, Hq - 1)})
    res = {"all_finite": bool(torch.isfinite(out).all().item()), "ok": True}
    worst = None
    for b, h in heads:
        ref, plain = attention_rows(q, k, v, b, h, rows, keymask(b, h, rows))
        rel, mx = err_pair(out[b, rows.to(out.device), h], ref)
        prel, pmx = err_pair(plain, ref)
        res["ok"] = res["ok"] and rel <= 2 * prel + 1e-3 and mx <= 2 * pmx + 1e-2
        if worst is None or rel > worst["relerr"]:
            worst = {"relerr": rel, "maxerr": mx, "plain_relerr": prel, "plain_maxerr": pmx}
    res.update(worst)
    res["ok"] = bool(res["ok"] and res["all_finite"])
    return res


def verify_tile_output(out, q, k, v, idx, cnt, causal, gen, what):
    """verify_rows for TileLists (idx None: dense); raises VerificationError when the check fails."""
    Lq, Lk, Hq = q.shape[1], k.shape[1], q.shape[2]
    G = idx.shape[1] if idx is not None else 1
    res = verify_rows(out, q, k, v,
                      lambda b, h, rows: tile_keymask(idx, cnt, b, h // (Hq // G), rows, Lq, Lk, causal), gen)
    if not res["ok"]:
        raise VerificationError(f"{what}: against the float64 reference {res}")
    return res


def poisoned(fn, out):
    """Fills out with NaN, runs fn (which writes out) and waits for it."""
    import torch
    out.fill_(float("nan"))
    r = fn()
    torch.cuda.synchronize()
    return r


# ---- timing -----------------------------------------------------------------------------------------

def _flush_buffer():
    import torch
    return torch.empty(256 * 1024 * 1024, dtype=torch.int8, device="cuda")


def _do_bench_fallback(fn, warmup, rep):
    """do_bench's method where triton is missing: L2 flushed (256 MB zeroed) before each call."""
    import torch
    cache = _flush_buffer()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    fn()
    torch.cuda.synchronize()
    start.record()
    for _ in range(5):
        cache.zero_()
        fn()
    end.record()
    torch.cuda.synchronize()
    est = max(start.elapsed_time(end) / 5, 1e-3)
    for _ in range(max(1, int(warmup / est))):
        fn()
    times = []
    for _ in range(max(1, int(rep / est))):
        cache.zero_()
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    times.sort()
    return times[len(times) // 2]


class Timer:
    """Times a callable that launches GPU work on the current stream; figures in ms."""

    def __init__(self, args):
        self.warmup_ms, self.rep_ms = args.warmup_ms, args.rep_ms
        self.sustain_ms, self.samples = args.sustain_ms, args.samples
        try:
            from triton.testing import do_bench
            self.do_bench = lambda fn: do_bench(fn, warmup=self.warmup_ms, rep=self.rep_ms, return_mode="median")
            self.method = "triton.testing.do_bench"
        except ImportError:
            self.do_bench = lambda fn: _do_bench_fallback(fn, self.warmup_ms, self.rep_ms)
            self.method = "do_bench method without triton (256 MB L2 flush per call)"

    def __call__(self, fn):
        return self.sustained(fn) if self.sustain_ms > 0 else self.do_bench(fn)

    def sustained(self, fn):
        import torch
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        fn()
        torch.cuda.synchronize()
        a.record()
        for _ in range(3):
            fn()
        b.record()
        b.synchronize()
        calls = max(1, math.ceil(self.sustain_ms / max(a.elapsed_time(b) / 3, 1e-3)))
        times = []
        for _ in range(self.samples):
            a.record()
            for _ in range(calls):
                fn()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b) / calls)
        times.sort()
        return times[len(times) // 2]

    def parts(self, fns):
        """Each part's median time (ms) when the parts run back to back, a CUDA event between
        consecutive parts and L2 flushed before each round (as do_bench does): where a pipeline's time
        goes beyond the parts timed alone. Also the median host time (ms) to enqueue one round: where it
        reaches the GPU time, the host sets the pace."""
        import torch
        cache = _flush_buffer()
        for _ in range(3):
            for fn in fns:
                fn()
        torch.cuda.synchronize()
        rounds = max(self.samples, 10)
        ev = [[torch.cuda.Event(enable_timing=True) for _ in range(len(fns) + 1)] for _ in range(rounds)]
        host = []
        for i in range(rounds):
            cache.zero_()
            t0 = time.perf_counter()
            ev[i][0].record()
            for j, fn in enumerate(fns):
                fn()
                ev[i][j + 1].record()
            host.append((time.perf_counter() - t0) * 1e3)
        torch.cuda.synchronize()
        med = lambda xs: sorted(xs)[len(xs) // 2]
        parts = [med([ev[i][j].elapsed_time(ev[i][j + 1]) for i in range(rounds)]) for j in range(len(fns))]
        return parts, med(host)


# ---- peers ------------------------------------------------------------------------------------------

def _read_pth_files():
    """pip --target folders on PYTHONPATH are not site folders, so their .pth files (which put some
    peers' packages on sys.path) are not read at start-up; read them. A pip-installed ninja (FlashInfer
    compiles its kernels on first use) goes on PATH where the machine has none."""
    for p in os.environ.get("PYTHONPATH", "").split(os.pathsep):
        if p and os.path.isdir(p):
            if any(f.endswith(".pth") for f in os.listdir(p)):
                site.addsitedir(p)
            ninja = os.path.join(p, "bin", "ninja")
            if os.access(ninja, os.X_OK) and not any(
                    os.access(os.path.join(d, "ninja"), os.X_OK) for d in os.environ.get("PATH", "").split(os.pathsep)):
                os.environ["PATH"] = os.path.dirname(ninja) + os.pathsep + os.environ.get("PATH", "")


def short_error(e, n=300):
    return f"{type(e).__name__}: {e}"[:n]


class Peers:
    """The peers this process can run, imported once. status: {name: version or 'absent: why'}."""

    def __init__(self, enabled=True):
        self.status, self._flex, self._fa4, self._fi = {}, None, None, None
        if not enabled:
            self.status = {"peers": "disabled (--no-peers)"}
            return
        import torch
        self.status["sdpa"] = torch.__version__
        try:
            from torch.nn.attention.flex_attention import flex_attention
            self._flex = torch.compile(flex_attention, dynamic=False)
            self.status["flex"] = torch.__version__
        except Exception as e:
            self.status["flex"] = "absent: " + short_error(e)
        _read_pth_files()
        try:
            from flash_attn.cute import flash_attn_func
            from flash_attn.cute.block_sparsity import BlockSparseTensorsTorch
            self._fa4 = (flash_attn_func, BlockSparseTensorsTorch)
            self.status["fa4"] = _version("flash-attn-4") or "importable"
        except Exception as e:
            self.status["fa4"] = "absent: " + short_error(e)
        try:
            from flashinfer.sparse import BlockSparseAttentionWrapper
            self._fi = BlockSparseAttentionWrapper
            self.status["flashinfer"] = _version("flashinfer-python") or "importable"
        except Exception as e:
            self.status["flashinfer"] = "absent: " + short_error(e)

    @property
    def enabled(self):
        return "sdpa" in self.status

    @property
    def flex(self):
        """The compiled flex_attention, or None."""
        return self._flex

    def dense(self, q, k, v, causal):
        """[(name, make)] of the dense peers on q [B, Lq, Hq, D], k, v [B, Lk, Hkv, D]: make() prepares
        the peer (outside any timing) and returns run(), whose result is the output as [B, Lq, Hq, D].
        SDPA's GQA is native where the backend takes it, else K/V are repeated to Hq once, in make()."""
        if not self.enabled:
            return []
        out = [("cudnn", _sdpa(q, k, v, causal, "CUDNN_ATTENTION")),
               ("flash", _sdpa(q, k, v, causal, "FLASH_ATTENTION"))]
        if self._fa4 is not None:
            func = self._fa4[0]
            out.append(("fa4", lambda: (lambda: func(q, k, v, causal=causal, return_lse=True)[0])))
        return out

    def tile(self, q, k, v, idx, cnt):
        """[(name, make)] of the block-sparse peers on TileLists (idx [B, G, Tq, Kmax], cnt [B, G, Tq]),
        non-causal, as dense() returns them; make() converts the lists to the peer's format."""
        if not self.enabled:
            return []
        out = []
        if self._flex is not None:
            out.append(("flex", lambda: _flex_tile(self._flex, q, k, v, idx, cnt)))
        if self._fa4 is not None:
            out.append(("fa4", lambda: _fa4_tile(self._fa4, q, k, v, idx, cnt)))
        if self._fi is not None:
            out.append(("flashinfer", lambda: _flashinfer_tile(self._fi, q, k, v, idx, cnt)))
        return out


def _version(dist):
    try:
        import importlib.metadata
        return importlib.metadata.version(dist)
    except Exception:
        return None


def _sdpa(q, k, v, causal, backend):
    """A factory: returns run() for SDPA with one backend, after a first call that picks native GQA or,
    if the backend refuses it, K/V repeated to Hq."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def make():
        be = getattr(SDPBackend, backend)
        qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        group = q.shape[2] // k.shape[2]
        for native in ((True, False) if group > 1 else (False,)):
            kk = kt if native or group == 1 else kt.repeat_interleave(group, 1)
            vv = vt if native or group == 1 else vt.repeat_interleave(group, 1)
            extra = {"enable_gqa": True} if native else {}

            def run(kk=kk, vv=vv, extra=extra):
                with sdpa_kernel(be):
                    return F.scaled_dot_product_attention(qt, kk, vv, is_causal=causal, **extra).transpose(1, 2)
            try:
                run()
                torch.cuda.synchronize()
                run.gqa = ("native" if native else "repeated") if group > 1 else "none"
                return run
            except RuntimeError:
                if not native:
                    raise
        raise AssertionError("unreachable")
    return make


def tile_block_mask(idx, cnt, Lq, Lk, Hq, q_blocks=True, table=None):
    """FlexAttention's BlockMask of TileLists: idx goes into the first slots of a [B, G, Tq, Tk] int32
    table (from_kv_blocks reads a row's first cnt entries; pass `table` to reuse one across calls),
    lists repeated over the heads of a group when G > 1. q_blocks=False skips the transposed
    (backward-only) indices where this torch allows it."""
    import torch
    from torch.nn.attention.flex_attention import BlockMask
    B, G, Tq, K = idx.shape
    if table is None:
        table = torch.zeros(B, G, Tq, ceil_div(Lk, BLOCK), dtype=torch.int32, device=idx.device)
    table[..., :K].copy_(idx.clamp_min(0))
    num = cnt
    if G > 1:
        num, table = num.repeat_interleave(Hq // G, dim=1), table.repeat_interleave(Hq // G, dim=1)
    kw = {} if q_blocks else {"compute_q_blocks": False}
    return BlockMask.from_kv_blocks(num.contiguous(), table.contiguous(), BLOCK_SIZE=BLOCK, seq_lengths=(Lq, Lk), **kw)


def _flex_tile(flex, q, k, v, idx, cnt):
    bm = tile_block_mask(idx, cnt, q.shape[1], k.shape[1], q.shape[2])
    qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    gqa = q.shape[2] != k.shape[2]
    return lambda: flex(qt, kt, vt, block_mask=bm, enable_gqa=gqa).transpose(1, 2)


def _fa4_tile(fa4, q, k, v, idx, cnt):
    """FA4's block-sparse forward: the lists split into 'full' blocks (no mask) and 'mask' blocks (the
    last, partial block of a Lk that is no multiple of 128); FA4 on sm90 needs both given. Lists
    broadcast over heads (head dim 1) when G == 1, so FA4 packs the GQA group; else repeated to Hq."""
    import torch
    func, BST = fa4
    B, G, Tq, K = idx.shape
    Hq, Lk = q.shape[2], k.shape[1]
    j = idx.long()
    valid = torch.arange(K, device=idx.device) < cnt[..., None].long()
    full = valid & ((j + 1) * BLOCK <= Lk)

    def compact(sel):
        n = sel.sum(-1).to(torch.int32)
        width = max(1, int(n.max()))
        ids = torch.where(sel, j, torch.full_like(j, 1 << 30)).sort(-1).values[..., :width]
        ids = torch.where(torch.arange(width, device=idx.device) < n[..., None].long(), ids, torch.zeros_like(ids))
        if G > 1:
            n, ids = n.repeat_interleave(Hq // G, 1), ids.repeat_interleave(Hq // G, 1)
        return n.contiguous(), ids.to(torch.int32).contiguous()

    fc, fi = compact(full)
    mc, mi = compact(valid & ~full)
    bst = BST(mask_block_cnt=mc, mask_block_idx=mi, full_block_cnt=fc, full_block_idx=fi, block_size=(BLOCK, BLOCK))
    return lambda: func(q, k, v, causal=False, block_sparse_tensors=bst, return_lse=True)[0]


def _flashinfer_tile(wrapper, q, k, v, idx, cnt):
    """FlashInfer's BlockSparseAttentionWrapper (BSR, fa3 backend): one pattern for every head and no
    batch dimension, so batches become rows: row block (b, t) -> b * Tq + t, column block (b, j) ->
    b * Tk + j. Needs one list per batch (G = Hkv = 1)."""
    import torch
    B, G, Tq, K = idx.shape
    _, Lq, Hq, D = q.shape
    Lk = k.shape[1]
    if G != 1 or k.shape[2] != 1:
        raise ValueError(f"the FlashInfer form here needs G = Hkv = 1 (got G = {G}, Hkv = {k.shape[2]})")
    if Lq % BLOCK or Lk % BLOCK:
        raise ValueError("the FlashInfer form here needs Lq and Lk multiples of 128")
    Tk = Lk // BLOCK
    valid = torch.arange(K, device=idx.device) < cnt[..., None].long()
    base = (torch.arange(B, device=idx.device) * Tk).view(B, 1, 1, 1)
    indices = (idx.long() + base)[valid].to(torch.int32)
    indptr = torch.zeros(B * Tq + 1, dtype=torch.int32, device=idx.device)
    indptr[1:] = cnt.reshape(-1).long().cumsum(0).to(torch.int32)
    w = wrapper(torch.empty(128 << 20, dtype=torch.uint8, device=q.device), backend="fa3")
    w.plan(indptr, indices, B * Lq, B * Lk, BLOCK, BLOCK, Hq, 1, D, causal=False,
           q_data_type=q.dtype, kv_data_type=k.dtype, o_data_type=q.dtype)
    qf, kf, vf = q.reshape(B * Lq, Hq, D), k.reshape(B * Lk, 1, D), v.reshape(B * Lk, 1, D)
    return lambda: w.run(qf, kf, vf).view(B, Lq, Hq, D)
