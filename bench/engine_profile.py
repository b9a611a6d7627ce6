"""Time a Llama-shaped transformer's forward pass on a GPU and fit the simulator's step-time
model to it (a named engine profile, docs/worker-sim.md).

The model is ``transformers``' ``LlamaForCausalLM`` built from a config with random weights
(no download), in bf16. Its weights are driven by a forward pass written here the way a
serving engine runs one step: the step's tokens (a prompt chunk and/or one token for each of
B decoding sequences) go through each layer's projections as one matrix, each layer's KV is
written into a preallocated cache, and attention reads only the context each sequence has
(prompt chunk: causal, aligned to its cached context; decode: the whole context, the query
heads of a KV head folded into one attention call). Logits are computed for the last token of
each sequence only, and the next token is the argmax. Before timing, the pass is checked
against ``LlamaForCausalLM``'s own forward on the same weights (a prompt in two chunks, then a
decode step). Each step is captured in a CUDA graph and its replays timed with CUDA events
(median of ``--reps``), as vLLM replays graphs; the eager time is kept beside it.

The grid: prompt chunks of 128-8,192 tokens after 0-16,384 cached tokens; decode batches of
1-256 sequences at 256-16,384 tokens of context (up to ``--max-kv-tokens`` in all); and mixed
steps (a chunk beside a decode batch) that check the model's additivity. The five
coefficients are fitted by :func:`bench.engine_fit.fit_step_model`.

    python -m bench.engine_profile --out bench/profiles/h200-llama-3-8b.json   # torch, transformers, a CUDA GPU
    python -m bench.engine_profile --fit bench/profiles/h200-llama-3-8b.json   # refit a file and print; no GPU
    python -m bench.engine_profile --shape tiny --device cpu --check-only     # the forward-pass check alone
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from bench.engine_fit import (
    TERMS,
    fit_step_model,
    relative_errors,
    samples_from,
)


@dataclass(frozen=True)
class ModelShape:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    rope_theta: float = 500000.0
    rms_norm_eps: float = 1e-5

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads


SHAPES: dict[str, ModelShape] = {
    # meta-llama/Meta-Llama-3-8B's config.json
    "llama-3-8b": ModelShape(128256, 4096, 14336, 32, 32, 8),
    # for the check on a CPU
    "tiny": ModelShape(512, 256, 512, 2, 8, 2, rope_theta=10000.0),
}

PREFILL_GRID = [(n, c) for n in (128, 512, 1024, 2048, 4096, 8192) for c in (0, 4096, 16384)]
DECODE_GRID = [(b, L) for b in (1, 4, 16, 64, 128, 256) for L in (256, 1024, 4096, 16384)]
MIXED_GRID = [(512, 0, 64, 1024), (2048, 0, 64, 1024), (2048, 4096, 128, 2048), (512, 0, 256, 512)]


# ---------------------------------------------------------------------------- the forward pass
class StepRunner:
    """One serving-engine step over a ``LlamaForCausalLM``'s weights (see the module doc)."""

    def __init__(self, model: Any, shape: ModelShape) -> None:
        import torch

        self.torch = torch
        self.shape = shape
        m = model.model
        self.embed = m.embed_tokens.weight
        self.norm_w = m.norm.weight
        self.lm_head = model.lm_head.weight
        self.inv_freq = m.rotary_emb.inv_freq.float()
        self.layers = []
        for layer in m.layers:
            a, p = layer.self_attn, layer.mlp
            self.layers.append(
                (
                    layer.input_layernorm.weight,
                    torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight], 0),
                    a.o_proj.weight,
                    layer.post_attention_layernorm.weight,
                    torch.cat([p.gate_proj.weight, p.up_proj.weight], 0),
                    p.down_proj.weight,
                )
            )
        self.prefill_gqa = self._flash_takes_gqa()

    def _flash_takes_gqa(self) -> bool:
        """Whether the flash kernel takes a prompt chunk's attention with fewer KV heads than
        query heads; if not, the chunk's KV heads are repeated (what the math fallback would
        otherwise materialise far larger)."""
        torch, s = self.torch, self.shape
        if not self.embed.is_cuda:
            return True
        try:
            from torch.backends.cuda import SDPAParams, can_use_flash_attention

            q = torch.empty(1, s.num_attention_heads, 64, s.head_dim, **self._like())
            k = torch.empty(1, s.num_key_value_heads, 128, s.head_dim, **self._like())
            return bool(can_use_flash_attention(SDPAParams(q, k, k, None, 0.0, True, True)))
        except Exception:  # noqa: BLE001 - an older torch: repeat the heads
            return False

    def _like(self) -> dict[str, Any]:
        return {"device": self.embed.device, "dtype": self.embed.dtype}

    def rms(self, x: Any, w: Any) -> Any:
        xf = x.float()
        xf = xf * self.torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.shape.rms_norm_eps)
        return w * xf.to(x.dtype)

    @staticmethod
    def rotate(x: Any, cos: Any, sin: Any) -> Any:
        h = x.shape[-1] // 2
        rot = x.new_empty(x.shape)
        rot[..., :h] = -x[..., h:]
        rot[..., h:] = x[..., :h]
        return x * cos + rot * sin

    def new_caches(self, batch: int, tokens: int, device: Any, dtype: Any) -> list[Any]:
        """One (K, V) pair per layer, each (batch, kv heads, tokens, head dim), random."""
        s = self.shape
        g = self.torch.Generator(device=device).manual_seed(1)
        return [
            self.torch.randn(
                2,
                batch,
                s.num_key_value_heads,
                tokens,
                s.head_dim,
                generator=g,
                device=device,
                dtype=dtype,
            )
            for _ in range(s.num_hidden_layers)
        ]

    def step(
        self,
        ids: Any,
        positions: Any,
        n: int,
        c: int,
        prefill_cache: list[Any] | None,
        b: int,
        ctx: int,
        decode_cache: list[Any] | None,
    ) -> Any:
        """``ids``/``positions``: the n prompt-chunk tokens (positions c..c+n-1), then the b
        decode tokens (position ctx each). Returns the next token of each sequence."""
        torch, s = self.torch, self.shape
        F = torch.nn.functional
        from torch.nn.attention.bias import causal_lower_right

        hq, hk, d = s.num_attention_heads, s.num_key_value_heads, s.head_dim
        group = hq // hk
        t = n + b
        x = self.embed[ids]
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        emb = torch.cat([freqs, freqs], -1)
        cos, sin = emb.cos().to(x.dtype)[:, None, :], emb.sin().to(x.dtype)[:, None, :]
        mask = causal_lower_right(n, c + n) if n else None
        for li, (ln1, wqkv, wo, ln2, wgu, wdown) in enumerate(self.layers):
            h = self.rms(x, ln1)
            qkv = F.linear(h, wqkv)
            q = self.rotate(qkv[:, : hq * d].view(t, hq, d), cos, sin)
            k = self.rotate(qkv[:, hq * d : (hq + hk) * d].view(t, hk, d), cos, sin)
            v = qkv[:, (hq + hk) * d :].view(t, hk, d)
            outs = []
            if n:
                kv = prefill_cache[li]  # (2, 1, hk, c + n, d)
                kv[0, 0, :, c : c + n] = k[:n].transpose(0, 1)
                kv[1, 0, :, c : c + n] = v[:n].transpose(0, 1)
                qp = q[:n].transpose(0, 1).unsqueeze(0)  # (1, hq, n, d)
                kk, vv = kv[0, :, :, : c + n], kv[1, :, :, : c + n]
                if self.prefill_gqa:
                    o = F.scaled_dot_product_attention(qp, kk, vv, attn_mask=mask, enable_gqa=True)
                else:
                    kk, vv = kk.repeat_interleave(group, 1), vv.repeat_interleave(group, 1)
                    o = F.scaled_dot_product_attention(qp, kk, vv, attn_mask=mask)
                outs.append(o[0].transpose(0, 1).reshape(n, hq * d))
            if b:
                kv = decode_cache[li]  # (2, b, hk, ctx + 1, d)
                kv[0, :, :, ctx] = k[n:]
                kv[1, :, :, ctx] = v[n:]
                # a decode token sees its whole context: the query heads sharing a KV head
                # become that head's query rows, one call without a mask
                qd = q[n:].view(b, hk, group, d)
                o = F.scaled_dot_product_attention(qd, kv[0], kv[1])
                outs.append(o.reshape(b, hq * d))
            x = x + F.linear(outs[0] if len(outs) == 1 else torch.cat(outs, 0), wo)
            h = self.rms(x, ln2)
            gu = F.linear(h, wgu)
            inter = s.intermediate_size
            x = x + F.linear(F.silu(gu[:, :inter]) * gu[:, inter:], wdown)
        last = []
        if n:
            last.append(x[n - 1 : n])
        if b:
            last.append(x[n:])
        h = self.rms(torch.cat(last, 0) if len(last) > 1 else last[0], self.norm_w)
        return F.linear(h, self.lm_head)  # logits; argmax is the greedy next token


def build_model(shape: ModelShape, device: str, dtype: Any) -> Any:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    # ModelShape's fields are LlamaConfig's own names
    cfg = LlamaConfig(**asdict(shape), max_position_embeddings=32768, tie_word_embeddings=False)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    before = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = LlamaForCausalLM(cfg)
    finally:
        torch.set_default_dtype(before)
    return model.eval()


def check_forward(model: Any, runner: StepRunner, device: str, dtype: Any) -> dict[str, float]:
    """Our step against ``LlamaForCausalLM``'s forward on the same weights: a prompt of 48
    tokens in chunks of 32 and 16, then one decode step. The reference is the model's forward
    in float32 (the weights upcast); beside our error, the model's own forward in ``dtype``
    against the same reference (what rounding alone costs). A misplaced cache, mask or
    rotation shows as an error of order 1, not a few times the rounding."""
    import copy

    import torch

    s = runner.shape
    g = torch.Generator(device="cpu").manual_seed(7)
    ids = torch.randint(0, s.vocab_size, (49,), generator=g).to(device)
    with torch.no_grad():
        own = model(input_ids=ids[None]).logits[0].float()  # (49, vocab), in dtype
        ref_model = copy.deepcopy(model).float()
        ref = ref_model(input_ids=ids[None]).logits[0].float()
        del ref_model
        cache = runner.new_caches(1, 49, device, dtype)
        pos = torch.arange(49, device=device)
        first = runner.step(ids[:32], pos[:32], 32, 0, cache, 0, 0, None)
        second = runner.step(ids[32:48], pos[32:48], 16, 32, cache, 0, 0, None)
        # the decode step reads the same cache as a batch of one at context 48
        dcache = [kv[:, :, :, :49] for kv in cache]
        third = runner.step(ids[48:49], pos[48:49], 0, 0, None, 1, 48, dcache)

    def rel(a: Any, b: Any) -> float:
        return float((a.float() - b).norm() / b.norm())

    return {
        "chunk_1": rel(first[0], ref[31]),
        "chunk_2": rel(second[0], ref[47]),
        "decode": rel(third[0], ref[48]),
        "model_rounding": max(rel(own[i], ref[i]) for i in (31, 47, 48)),
    }


# ---------------------------------------------------------------------------- timing
def median_seconds(fn: Any, reps: int, warmup: int, cuda: bool) -> float:
    """Median duration of ``fn()`` over ``reps`` runs after ``warmup`` untimed ones: CUDA
    events on a GPU (the work is asynchronous), the host clock on a CPU."""
    import torch

    for _ in range(warmup):
        fn()
    if cuda:
        torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        if not cuda:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
            continue
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def time_step(
    runner: StepRunner,
    n: int,
    c: int,
    b: int,
    ctx: int,
    device: str,
    dtype: Any,
    reps: int,
) -> dict[str, Any]:
    """Median seconds of one step, eager and as a CUDA-graph replay (None where capture fails)."""
    import torch

    s = runner.shape
    g = torch.Generator(device="cpu").manual_seed(n * 7 + c * 3 + b * 11 + ctx)
    ids = torch.randint(0, s.vocab_size, (n + b,), generator=g).to(device)
    positions = torch.tensor([*range(c, c + n), *([ctx] * b)], device=device)
    pcache = runner.new_caches(1, c + n, device, dtype) if n else None
    dcache = runner.new_caches(b, ctx + 1, device, dtype) if b else None

    def run() -> Any:
        return runner.step(ids, positions, n, c, pcache, b, ctx, dcache)

    cuda = ids.is_cuda

    def timed(fn: Any) -> float:
        return median_seconds(fn, reps, warmup=2, cuda=cuda)

    out: dict[str, Any] = {}
    with torch.no_grad():
        out["eager_seconds"] = timed(run)
        graph_s: float | None = None
        try:
            if not cuda:
                raise RuntimeError("no CUDA device: eager only")
            graph = torch.cuda.CUDAGraph()
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                run()
            torch.cuda.current_stream().wait_stream(side)
            with torch.cuda.graph(graph):
                run()
            graph_s = timed(graph.replay)
            del graph
        except Exception as exc:  # noqa: BLE001 - recorded, the eager time stands
            out["graph_error"] = f"{type(exc).__name__}: {exc}"[:200]
        out["graph_seconds"] = graph_s
    return out  # its caches go with it; the caller empties the allocator's cache


def ceilings(device: str) -> dict[str, float]:
    """The device's bf16 matrix rate and copy bandwidth, measured (what the fit is read against)."""
    import torch

    a = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    bm = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    src = torch.randn(1 << 30, device=device, dtype=torch.bfloat16)  # 2 GiB
    dst = torch.empty_like(src)

    def med(fn: Any) -> float:
        return median_seconds(fn, 10, warmup=3, cuda=True)

    mm = med(lambda: a @ bm)
    cp = med(lambda: dst.copy_(src))
    out = {"bf16_tflops": 2 * 8192**3 / mm / 1e12, "copy_tb_s": 2 * src.numel() * 2 / cp / 1e12}
    return out


# ---------------------------------------------------------------------------- report
def fit_report(doc: dict[str, Any]) -> str:
    samples = samples_from([r for r in doc["steps"] if r["seconds"]])
    fit = doc["fit"]
    errs = relative_errors(fit, samples)
    lines = ["fitted step-time terms:"]
    lines += [f"  {t:<18} {fit[t]:.4g}" for t in TERMS]
    lines.append(
        f"relative error over {len(samples)} steps: median {statistics.median(abs(e) for e in errs):.1%},"
        f" worst {max(abs(e) for e in errs):.1%}"
    )
    lines.append(
        f"{'chunk':>6} {'cached':>6} {'decode':>6} {'context':>7} {'measured ms':>11} {'model ms':>8} {'error':>7}"
    )
    for smp, e in zip(samples, errs, strict=True):
        lines.append(
            f"{smp.prefill_tokens:>6} {smp.prefill_context:>6} {smp.decode_seqs:>6} "
            f"{smp.decode_context:>7} {smp.seconds * 1e3:>11.2f} {smp.seconds * (1 + e) * 1e3:>8.2f} {e:>+7.1%}"
        )
    return "\n".join(lines)


def measure(args: argparse.Namespace) -> dict[str, Any]:
    import torch
    import transformers

    shape = SHAPES[args.shape]
    dtype = torch.bfloat16 if args.device != "cpu" else torch.float32
    t0 = time.monotonic()
    model = build_model(shape, args.device, dtype)
    runner = StepRunner(model, shape)
    check = check_forward(model, runner, args.device, dtype)
    print(f"forward check (relative error of logits vs LlamaForCausalLM in float32): {check}")
    # ours may round differently, not worse by much; float32 on float32: rounding only
    bound = 1.5 * check["model_rounding"] + 1e-4
    passed = all(check[k] < bound for k in ("chunk_1", "chunk_2", "decode"))
    if not passed:
        print(f"WARNING: forward check over its bound {bound}: {check}", flush=True)
        if args.check_only:
            raise SystemExit(1)
    doc: dict[str, Any] = {
        "shape_name": args.shape,
        "shape": asdict(shape),
        "device": torch.cuda.get_device_name() if args.device != "cpu" else platform.processor(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "dtype": str(dtype).removeprefix("torch."),
        "forward_check": check,
        "forward_check_passed": passed,
        "prefill_attention": "flash, GQA" if runner.prefill_gqa else "KV heads repeated",
    }
    if args.check_only:
        return doc
    del model  # the runner holds the weights it needs
    if args.device != "cpu":
        doc["ceilings"] = ceilings(args.device)
        torch.cuda.empty_cache()
        print(f"device ceilings: {doc['ceilings']}", flush=True)
    grid: list[tuple[str, int, int, int, int]] = []
    kv_cap = args.max_kv_tokens
    scale = 16 if args.shape == "tiny" else 1  # a CPU dry run of the whole loop
    grid += [("prefill", n // scale, c // scale, 0, 0) for n, c in PREFILL_GRID]
    grid += [
        ("decode", 0, 0, b, L // scale) for b, L in DECODE_GRID if b * (L // scale + 1) <= kv_cap
    ]
    grid += [("mixed", n // scale, c // scale, b, L // scale) for n, c, b, L in MIXED_GRID]
    steps = []
    try:
        from tqdm import tqdm

        it = tqdm(grid, desc="steps", file=sys.stdout, mininterval=5)
    except ImportError:
        it = grid
    for kind, n, c, b, L in it:
        r = time_step(runner, n, c, b, L, args.device, dtype, args.reps)
        if args.device != "cpu":
            torch.cuda.empty_cache()
        row = {
            "kind": kind,
            "prefill_tokens": n,
            "prefill_context": c,
            "decode_seqs": b,
            "decode_context": L,
            **r,
        }
        row["seconds"] = r["graph_seconds"] or r["eager_seconds"]
        steps.append(row)
        print(json.dumps(row), flush=True)
    doc["steps"] = steps
    doc["timing"] = f"CUDA-graph replay (eager where capture failed), median of {args.reps}"
    doc["elapsed_s"] = time.monotonic() - t0
    return doc


def fit_doc(doc: dict[str, Any], fit_on: str) -> None:
    """Fit on the prefill and decode steps (``fit_on`` = 'pure') or on every step ('all');
    the mixed steps then test the model's additivity."""
    rows = [r for r in doc["steps"] if r["seconds"] and (fit_on == "all" or r["kind"] != "mixed")]
    doc["fit"] = fit_step_model(samples_from(rows))
    doc["fit_on"] = fit_on


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m bench.engine_profile",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__.split("\n\n", 1)[1],
    )
    ap.add_argument("--shape", choices=sorted(SHAPES), default="llama-3-8b")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--reps", type=int, default=10, help="timed replays per step (median)")
    ap.add_argument(
        "--max-kv-tokens",
        type=int,
        default=600_000,
        help="largest decode batch x context timed (KV memory: 128 KiB a token for llama-3-8b)",
    )
    ap.add_argument("--out", type=Path, help="write the profile (measured steps and fit) here")
    ap.add_argument("--fit", type=Path, help="refit an existing profile file and print it; no GPU")
    ap.add_argument("--fit-on", choices=("pure", "all"), default="pure", help="steps the fit uses")
    ap.add_argument("--check-only", action="store_true", help="only check the forward pass")
    args = ap.parse_args(argv)
    if args.fit:
        doc = json.loads(args.fit.read_text())
        fit_doc(doc, args.fit_on)
        print(fit_report(doc))
        return 0
    doc = measure(args)
    if args.check_only:
        print("forward check passed")
        return 0
    fit_doc(doc, args.fit_on)
    print(fit_report(doc))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(doc, indent=1) + "\n")
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
