"""alpha-entmax attention on the GPU against AdaSplash and dense softmax (cuDNN SDPA), in one process.

Shapes (issue 24): B = 1, D = 128, causal, bf16, H = 16 (Hq = Hkv) and the GQA shape Hq = 32 / Hkv = 8,
L in {4K, 8K, 16K, 32K}, alpha in {1.5, 2}. Per case: sparse_attn.entmax (the whole call: threshold
passes, bits, output pass, statistics read back), verified first on sampled rows against a float64
entmax computed here (tau by bisection on the float64 scores of the same bf16 inputs; relative error
at most 1e-2); the support density (pairs with nonzero weight / visible pairs) and the tile density
(active / visible tiles) it reports; dense softmax through cuDNN SDPA on the same tensors; and, where
importable, AdaSplash (PyPI adasplash 0.2.2, ../shared/peers/README.md): its v2 kernel
`adasplash(q, k, v, alpha=1.5, is_causal=True)` on [B, H, L, D] (alpha 1.5 only; K and V repeated to Hq
for the GQA shape, outside the timing), checked on the same rows (a peer that fails its check or its
call is recorded with the reason, the run goes on); with --v1, `adasplash_v1` (any
alpha, niter=10) where v2 does not run. An absent AdaSplash is reported, never a failure. The output
pass alone is timed by `sparse-attn bench entmax` (it needs the library's internal entry points).

AdaSplash's first call autotunes for 99-198 s (per shape); that call is made before timing and its
time is reported as `first_call_s`.

Real activations (--real TEXT...): instead of random inputs, the post-RoPE q and k and the v of
--model's layers (default: the first, the middle and the last) on a window of L tokens from the middle
of the first of the texts that holds L tokens (sparse_attn.model_eval.token_sequences), captured from a
forward pass through the library's dense attention; the scale is the model's. Per case the same
figures, and beside them `bits_sparse_ms`: softmax attention over the block bits this entmax call
returned (the same tiles as its output pass, with the softmax transform), the time the whole call
would approach if the threshold passes cost nothing.

The capture can run apart from the timing (the GPU machine may lack the model's files): --real with
--save-activations PATH writes the captured tensors (bf16) and their scales to a safetensors file and
exits, on a CPU when there is no GPU; --activations PATH... runs the cases on such files.

Usage: python3 bench_entmax.py [--L 4096 8192 ...] [--alphas 1.5 2] [--shapes 16/16 32/8] [--v1]
       [--real TEXT... [--model smollm2] [--layers 0 15 29] [--save-activations PATH] | --activations PATH...]
       [--json PATH] [--quick] [--no-peers] [timing options, see --help]
"""
import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import harness  # noqa: E402
from harness import VerificationError  # noqa: E402

REL_ERR_BOUND = 1e-2


def parse_shapes(text_list, ap):
    shapes = []
    for text in text_list:
        try:
            hq, hkv = (int(x) for x in text.split("/"))
        except ValueError:
            ap.error(f"--shapes: expected Hq/Hkv, got {text!r}")
        if hq < 1 or hkv < 1 or hq % hkv:
            ap.error(f"--shapes: Hq must be a positive multiple of Hkv, got {text!r}")
        shapes.append((hq, hkv))
    return shapes


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    harness.add_args(ap)
    ap.add_argument("--L", type=int, nargs="+", help="lengths Lq = Lk (default 4096 8192 16384 32768; --quick 4096 8192)")
    ap.add_argument("--alphas", type=float, nargs="+", default=[1.5, 2.0], help="alpha values (> 1)")
    ap.add_argument("--shapes", nargs="+", default=["16/16", "32/8"], help="head shapes Hq/Hkv")
    ap.add_argument("--v1", action="store_true", help="also time adasplash_v1 where v2 does not run (slow)")
    ap.add_argument("--verify-rows", type=int, default=32, help="sampled query rows per (case, head) checked")
    ap.add_argument("--real", nargs="+", metavar="TEXT",
                    help="real activations: q, k, v of --model on L tokens of these texts (.txt files or "
                         "directories) instead of random inputs (--shapes then does not apply)")
    ap.add_argument("--model", default="smollm2", help="with --real: a GGUF file, a transformers model or 'smollm2'")
    ap.add_argument("--layers", type=int, nargs="+",
                    help="with --real: the layers whose activations are used (default: first, middle, last)")
    ap.add_argument("--save-activations", metavar="PATH",
                    help="with --real: write the captured q, k, v to this safetensors file and exit (no GPU needed)")
    ap.add_argument("--activations", nargs="+", metavar="PATH",
                    help="run the cases on activations saved by --save-activations (instead of random inputs)")
    args = harness.parse(ap, argv)
    if args.layers is not None and not args.real:
        ap.error("--layers needs --real")
    if args.save_activations and not args.real:
        ap.error("--save-activations needs --real")
    if args.real and args.activations:
        ap.error("--real and --activations exclude each other")
    if args.layers is not None and any(layer < 0 for layer in args.layers):
        ap.error(f"--layers must be >= 0, got {args.layers}")
    if args.L is None:
        if args.real:  # a model's context (SmolLM2: 8192)
            args.L = [4096] if args.quick else [4096, 8192]
        else:
            args.L = [4096, 8192] if args.quick else [4096, 8192, 16384, 32768]
    if any(L < 1 for L in args.L):
        ap.error(f"--L must be positive, got {args.L}")
    if any(not a > 1.0 for a in args.alphas):
        ap.error(f"--alphas must be > 1, got {args.alphas}")
    if args.verify_rows < 1:
        ap.error(f"--verify-rows must be >= 1, got {args.verify_rows}")
    args.shapes = parse_shapes(args.shapes, ap)
    return args


def entmax_rows(q, k, v, b, h, rows, alpha, causal, scale=None):
    """float64 entmax attention of query rows `rows` (long tensor) of (b, h): [len(rows), D], and the
    number of (row, key) pairs with nonzero weight. scale: of q.k (default D^-0.5)."""
    import torch
    group = q.shape[2] // k.shape[2]
    Lq, Lk = q.shape[1], k.shape[1]
    scale = q.shape[3] ** -0.5 if scale is None else scale
    qr = q[b, rows.to(q.device), h].double()
    kk, vv = k[b, :, h // group].double(), v[b, :, h // group].double()
    a = (alpha - 1.0) * scale * (qr @ kk.T)  # [rows, Lk]
    if causal:
        ends = rows.to(q.device) + (Lk - Lq) + 1
        a = a.masked_fill(torch.arange(Lk, device=q.device)[None, :] >= ends[:, None], float("-inf"))
    hi = a.max(dim=1, keepdim=True).values
    lo = hi - 1.0
    r = 1.0 / (alpha - 1.0)
    for _ in range(100):  # sum [a - tau]_+^r is >= 1 at max - 1 and 0 at max
        mid = 0.5 * (lo + hi)
        mass = (a - mid).clamp_min(0.0).pow(r).sum(dim=1, keepdim=True)
        lo, hi = torch.where(mass >= 1.0, mid, lo), torch.where(mass >= 1.0, hi, mid)
    p = (a - lo).clamp_min(0.0).pow(r)
    p = p / p.sum(dim=1, keepdim=True)
    return p @ vv, int((p > 0).sum().item())


def check(out, q, k, v, alpha, causal, gen, n, what, scale=None):
    """Relative error of out [B, L, Hq, D] on sampled rows of every head; raises VerificationError past the bound."""
    import torch
    rows = harness.sample_rows(q.shape[1], gen, n)
    num = den = 0.0
    for h in range(q.shape[2]):
        ref, _ = entmax_rows(q, k, v, 0, h, rows, alpha, causal, scale)
        got = out[0, rows.to(out.device), h].double()
        if not bool(torch.isfinite(got).all()):
            raise VerificationError(f"{what}: NaN or inf in head {h}")
        num += (got - ref).pow(2).sum().item()
        den += ref.pow(2).sum().item()
    err = (num / max(den, 1e-300)) ** 0.5
    if not err <= REL_ERR_BOUND:
        raise VerificationError(f"{what}: relative error {err:.2e} > {REL_ERR_BOUND:g}")
    return err


class AdaSplash:
    """The optional peer: v2 (alpha 1.5, power-of-two L) and v1 (any alpha), or absent with the reason."""

    def __init__(self, enabled):
        self.v2 = self.v1 = None
        if not enabled:
            self.status = "disabled (--no-peers)"
            return
        try:
            from adasplash import adasplash, adasplash_v1
            self.v2, self.v1 = adasplash, adasplash_v1
            self.status = harness._version("adasplash") or "importable"
        except Exception as e:
            self.status = "absent: " + harness.short_error(e)

    def calls(self, alpha, L, with_v1):
        out = []
        if self.v2 is not None and alpha == 1.5 and L & (L - 1) == 0:
            out.append(("adasplash-v2", lambda qt, kt, vt: self.v2(qt, kt, vt, alpha=alpha, is_causal=True)))
        elif self.v1 is not None and with_v1:
            out.append(("adasplash-v1", lambda qt, kt, vt: self.v1(qt, kt, vt, alpha=alpha, is_causal=True, niter=10)))
        return out


def real_inputs(args, torch, device="cuda"):
    """[(label, q, k, v, scale)]: the chosen layers' activations of --model on L tokens of --real for each L
    of --L (B = 1, [1, L, H, D] bf16 on `device`), captured through the library's dense attention; the model
    is loaded once."""
    from sparse_attn import hf, model_eval
    model, tokenizer, identity = model_eval.load_model(args.model, device=device)
    layers_n = model.config.num_hidden_layers
    layers = args.layers if args.layers is not None else sorted({0, layers_n // 2, layers_n - 1})
    if any(layer >= layers_n for layer in layers):
        raise ValueError(f"--layers: {identity} has {layers_n} layers, got {layers}")
    captured = {}

    def observe(module, q, k, v, scale):
        if module.layer_idx in layers:
            captured[module.layer_idx] = tuple(t.detach().to(torch.bfloat16).contiguous() for t in (q, k, v)) + (scale,)

    hf.register_hf_attention("sparse_attn_bench_capture", "dense", observer=observe)
    model_eval.use_attention(model, "sparse_attn_bench_capture")
    cases = []
    for L in args.L:
        [(path, ids)] = model_eval.token_sequences(tokenizer, model_eval.text_files(args.real), L, 1)
        captured.clear()
        with torch.no_grad():
            model(ids.to(model.device), logits_to_keep=1)
        cases += [(f"{path.stem} layer {layer}", *captured[layer]) for layer in layers]
    del model
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    return cases


def save_activations(args):
    """--real --save-activations: capture (on the GPU if there is one, else the CPU) and write
    `<i>.q`, `<i>.k`, `<i>.v` per case with the labels and scales in the file's metadata."""
    try:
        import torch
        from safetensors.torch import save_file
    except ImportError as e:
        raise SystemExit(f"--save-activations needs torch and safetensors: {e}")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    tensors, cases = {}, []
    for label, q, k, v, scale in real_inputs(args, torch, device):
        i = len(cases)
        tensors.update({f"{i}.q": q.cpu(), f"{i}.k": k.cpu(), f"{i}.v": v.cpu()})
        cases.append({"label": label, "scale": float(scale), "L": q.shape[1]})
    save_file(tensors, args.save_activations, metadata={"model": args.model, "cases": json.dumps(cases)})
    print(f"wrote {len(cases)} cases to {args.save_activations}")
    return 0


def saved_inputs(path, torch, device="cuda"):
    """The cases of a --save-activations file: [(label, q, k, v, scale)] on `device`."""
    from safetensors import safe_open
    with safe_open(path, framework="pt") as f:
        meta = f.metadata() or {}
        try:
            cases = json.loads(meta["cases"])
        except (KeyError, ValueError) as e:
            raise ValueError(f"--activations: {path} holds no case list in its metadata ({e})")
        out = []
        for i, c in enumerate(cases):
            q, k, v = (f.get_tensor(f"{i}.{n}").to(device) for n in "qkv")
            if q.dim() != 4 or k.shape != v.shape or q.shape[:2] != k.shape[:2] or q.shape[3] != k.shape[3] \
                    or q.shape[2] % k.shape[2]:
                raise ValueError(f"--activations: {path} case {i}: shapes q {tuple(q.shape)}, k {tuple(k.shape)}, "
                                 f"v {tuple(v.shape)} do not make one attention problem")
            out.append((f"{c['label']} ({meta.get('model', '?')})", q, k, v, float(c["scale"])))
    return out


def measure(args, torch, sa, res, timer, peers, ada, check_gen, name, q, k, v, alpha, scale=None, extra=None):
    """One case: verify, then time the whole call, softmax over its bits, dense and the peers."""
    causal = True
    B, L, hq, _ = q.shape
    hkv = k.shape[2]
    out, bits, stats = sa.entmax(q, k, v, alpha=alpha, softmax_scale=scale, causal=causal, return_block_bits=True,
                                 return_stats=True)
    torch.cuda.synchronize()
    err = check(out, q, k, v, alpha, causal, check_gen, args.verify_rows, name, scale)
    visible = B * hq * L * (L + 1) // 2
    row = {"case": name, "L": L, "Hq": hq, "Hkv": hkv, "D": q.shape[3], "alpha": alpha, "rel_err": err,
           "support_density": stats["support"] / visible,
           "tile_density": stats["active_tiles"] / max(1, stats["visible_tiles"]), **(extra or {}),
           "sparse_attn_ms": timer(lambda: sa.entmax(q, k, v, alpha=alpha, softmax_scale=scale, causal=causal,
                                                    out=out))}
    row["bits_sparse_ms"] = timer(lambda: sa.bits_sparse(q, k, v, bits, softmax_scale=scale, causal=causal))
    row["sparse_attn_dense_ms"] = timer(lambda: sa.dense(q, k, v, softmax_scale=scale, causal=causal))
    for peer, make in peers.dense(q, k, v, causal):
        if peer == "cudnn":  # timed only (its scale is D^-0.5 whatever `scale` is)
            row["cudnn_dense_ms"] = timer(make())
    # AdaSplash takes no scale: it runs (and is checked) where the scale is D^-0.5.
    calls = ada.calls(alpha, L, args.v1) if scale is None or abs(scale - q.shape[3] ** -0.5) < 1e-9 else []
    if calls:
        group = hq // hkv
        qt = q.transpose(1, 2).contiguous()
        kt = k.repeat_interleave(group, 2).transpose(1, 2).contiguous()
        vt = v.repeat_interleave(group, 2).transpose(1, 2).contiguous()
        for peer, fn in calls:
            try:
                t0 = time.time()
                o = fn(qt, kt, vt)
                torch.cuda.synchronize()
                row[f"{peer}_first_call_s"] = time.time() - t0
                row[f"{peer}_rel_err"] = check(o.transpose(1, 2), q, k, v, alpha, causal, check_gen,
                                               args.verify_rows, f"{name} {peer}")
                row[f"{peer}_ms"] = timer(lambda: fn(qt, kt, vt))
                row[f"speedup_vs_{peer}"] = row[f"{peer}_ms"] / row["sparse_attn_ms"]
            except Exception as e:  # a peer's failure (verification included) is recorded
                row[f"{peer}_error"] = harness.short_error(e)
        del qt, kt, vt
    res.add(row)
    del out, bits


def run(args):
    torch, sa = harness.gpu_modules()
    gen = harness.generator(args.seed)
    check_gen = torch.Generator().manual_seed(args.seed + 1)
    timer = harness.Timer(args)
    peers = harness.Peers(not args.no_peers)
    ada = AdaSplash(not args.no_peers)
    res = harness.Results(args.json, harness.run_meta(
        args, timer=timer.method, peers=dict(peers.status, adasplash=ada.status),
        rel_err_bound=REL_ERR_BOUND, inputs="real" if args.real or args.activations else "random"))
    with res.recording_failure():
        if args.real or args.activations:
            cases = (real_inputs(args, torch) if args.real else
                     [c for path in args.activations for c in saved_inputs(path, torch)])
            for label, q, k, v, scale in cases:
                for alpha in args.alphas:
                    name = f"entmax real {label} L={q.shape[1]} H={q.shape[2]}/{k.shape[2]} alpha={alpha:g}"
                    measure(args, torch, sa, res, timer, peers, ada, check_gen, name, q, k, v, alpha, scale,
                            {"inputs": label, "scale": scale})
            return
        B, D = 1, 128
        for hq, hkv in args.shapes:
            for alpha in args.alphas:
                for L in args.L:
                    q, k, v = harness.random_qkv(B, L, L, hq, hkv, D, gen)
                    name = f"entmax L={L} H={hq}/{hkv} alpha={alpha:g}"
                    measure(args, torch, sa, res, timer, peers, ada, check_gen, name, q, k, v, alpha)
                    del q, k, v
                    torch.cuda.empty_cache()


def main(argv=None):
    args = parse_args(argv)
    if args.save_activations:
        return save_activations(args)
    return harness.exit_status(run, args)


if __name__ == "__main__":
    sys.exit(main())
