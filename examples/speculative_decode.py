"""Speculative decoding end to end through attnplug, on a tiny random model (CPU, a few seconds).

A target runner and a draft runner live in one process, each with its own KV
cache, its own backends built through the registry, and its own forward
context. Every round the draft proposes ``k`` tokens greedily (``k`` DECODE
forwards, one child of the multi-step draft container each), the target
scores them in one TARGET_VERIFY forward, the longest matching prefix is
accepted plus the target's own next token, and the draft catches up with a
DRAFT_EXTEND forward over the accepted tokens.

The check: a third runner decodes the same tokens one at a time with DECODE
forwards (no speculation); its logits must match the target's verified
logits within fp32 tolerance, and greedy decoding must give the same tokens.

    python examples/speculative_decode.py [--attention-backend torch_native]
        [--speculative-draft-attention-backend NAME] [--speculative-attention-mode decode]
        [--num-draft-tokens 3] [--rounds 6]
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import Counter

import torch

from attnplug import (
    AttentionConfig,
    BuildContext,
    ForwardBatch,
    ForwardMode,
    LayerSpec,
    PageAllocator,
    PagedKVCache,
    default_registry,
)
from attnplug.config import add_attention_args, config_from_args
from attnplug.host import detect_host
from attnplug.forward_context import current_backend, forward_context
from attnplug.speculative import build_draft_backends, kernel_for_forward

VOCAB, HIDDEN, HEADS, KV_HEADS, HEAD_DIM, LAYERS, MAX_LEN = 48, 32, 4, 2, 8, 2, 96
TOLERANCE = 1e-4  # fp32: the two paths differ only in accumulation order


# -- the model: embeddings, attention-only layers (q/k/v/o projections), an LM head ----------------


class TinyLM:
    def __init__(self, gen: torch.Generator) -> None:
        def w(*shape: int, scale: float) -> torch.Tensor:
            return torch.randn(*shape, generator=gen) * scale

        self.embed = w(VOCAB, HIDDEN, scale=1.0)
        self.pos_embed = w(MAX_LEN, HIDDEN, scale=0.5)
        self.layers = [
            {"wq": w(HIDDEN, HEADS * HEAD_DIM, scale=HIDDEN**-0.5),
             "wk": w(HIDDEN, KV_HEADS * HEAD_DIM, scale=HIDDEN**-0.5),
             "wv": w(HIDDEN, KV_HEADS * HEAD_DIM, scale=HIDDEN**-0.5),
             "wo": w(HEADS * HEAD_DIM, HIDDEN, scale=(HEADS * HEAD_DIM) ** -0.5)}
            for _ in range(LAYERS)
        ]
        self.lm_head = w(HIDDEN, VOCAB, scale=2 * HIDDEN**-0.5)
        self.specs = [LayerSpec(layer_id=i, num_heads=HEADS, num_kv_heads=KV_HEADS, head_dim=HEAD_DIM)
                      for i in range(LAYERS)]

    def perturbed(self, noise: float, gen: torch.Generator) -> "TinyLM":
        """A draft: the same model with every weight nudged."""
        other = object.__new__(TinyLM)
        jitter = lambda t: t + noise * t.std() * torch.randn(t.shape, generator=gen)  # noqa: E731
        other.embed, other.pos_embed, other.lm_head = jitter(self.embed), self.pos_embed, jitter(self.lm_head)
        other.layers = [{k: jitter(v) for k, v in layer.items()} for layer in self.layers]
        other.specs = self.specs
        return other

    def forward(self, tokens: torch.Tensor, batch: ForwardBatch, config: AttentionConfig) -> tuple:
        # Model code: the backend serving *this* forward comes from the forward context the
        # host entered, and the kernel name from its stamps; nothing is read from globals.
        backend = current_backend()
        kernel = kernel_for_forward(batch.forward_mode, config)
        x = self.embed[tokens] + self.pos_embed[batch.positions]
        for spec, w in zip(self.specs, self.layers):
            h = torch.nn.functional.rms_norm(x, (HIDDEN,))
            q = (h @ w["wq"]).view(-1, HEADS, HEAD_DIM)
            k = (h @ w["wk"]).view(-1, KV_HEADS, HEAD_DIM)
            v = (h @ w["wv"]).view(-1, KV_HEADS, HEAD_DIM)
            o = backend.forward(q, k, v, spec, batch, save_kv_cache=True)
            x = x + o.reshape(-1, HEADS * HEAD_DIM) @ w["wo"]
        hidden = torch.nn.functional.rms_norm(x, (HIDDEN,))
        return hidden @ self.lm_head, hidden, kernel


# -- a runner: one model, one KV cache, one forward context ---------------------------------------


class Runner:
    def __init__(self, name: str, model: TinyLM, config: AttentionConfig, num_requests: int,
                 page_size: int, is_draft: bool = False) -> None:
        self.name, self.model, self.config = name, model, config
        pages_per_req = -(-MAX_LEN // page_size)
        num_pages = pages_per_req * num_requests
        self.cache = PagedKVCache(LAYERS, num_pages, KV_HEADS, HEAD_DIM, page_size=page_size,
                                  max_requests=num_requests, max_context_len=MAX_LEN)
        alloc = PageAllocator(num_pages, seed=len(name))
        for r in range(num_requests):
            self.cache.assign_pages(r, MAX_LEN, alloc.alloc(pages_per_req))
        self.ctx = BuildContext(config=config, host=detect_host(), num_heads=HEADS, num_kv_heads=KV_HEADS,
                                head_dim=HEAD_DIM, page_size=page_size, kv_cache=self.cache,
                                max_batch_size=num_requests, max_context_len=MAX_LEN, is_draft=is_draft,
                                layers=tuple(model.specs))
        self.kernels: Counter[tuple[str, str]] = Counter()

    def extend(self, backend, mode: ForwardMode, prefix: list[int], tokens: list[list[int]], **kw) -> tuple:
        reqs = list(range(len(tokens)))
        lens = [len(t) for t in tokens]
        loc = torch.cat([self.cache.slots(r, p, p + n) for r, p, n in zip(reqs, prefix, lens)])
        batch = ForwardBatch.extend(reqs, prefix, lens, loc, mode=mode, **kw)
        return self._run(backend, batch, torch.tensor([t for ts in tokens for t in ts]))

    def decode(self, backend, positions: list[int], tokens: list[int], reqs: list[int] | None = None) -> tuple:
        reqs = list(range(len(tokens))) if reqs is None else reqs
        loc = torch.cat([self.cache.slots(r, p, p + 1) for r, p in zip(reqs, positions)])
        batch = ForwardBatch.decode(reqs, [p + 1 for p in positions], loc)
        return self._run(backend, batch, torch.tensor(tokens))

    def _run(self, backend, batch: ForwardBatch, tokens: torch.Tensor) -> tuple:
        with forward_context(backend, batch, runner=self.name):  # what a host does around each forward
            backend.init_forward_metadata(batch)
            logits, hidden, kernel = self.model.forward(tokens, batch, self.config)
        self.kernels[(batch.forward_mode.value, kernel)] += 1
        return logits, hidden


def split(rows: torch.Tensor, lens: list[int]) -> list[torch.Tensor]:
    return list(torch.split(rows, lens))


# -- the speculative loop --------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_attention_args(parser)
    parser.add_argument("--num-draft-tokens", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--page-size", type=int, default=4)
    parser.add_argument("--draft-noise", type=float, default=0.15)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    config = config_from_args(args)
    if None in config.attention_backends():  # a host would run resolution; the example fills the CPU default
        config = config.replace(attention_backend="torch_native")
    k = args.num_draft_tokens
    if args.rounds * (k + 1) + k + 16 > MAX_LEN:
        parser.error(f"--rounds {args.rounds} with --num-draft-tokens {k} exceeds the context ({MAX_LEN})")
    torch.manual_seed(args.seed)
    gen = torch.Generator().manual_seed(args.seed)
    t0 = time.perf_counter()

    target_model = TinyLM(gen)
    draft_model = target_model.perturbed(args.draft_noise, gen)
    prompts = [torch.randint(0, VOCAB, (n,), generator=gen).tolist() for n in (9, 6)]
    R = len(prompts)

    registry = default_registry()
    target = Runner("target", target_model, config, R, args.page_size)
    draft = Runner("draft", draft_model, config, R, args.page_size, is_draft=True)
    target_backend = registry.build_pair(target.ctx)  # prefill and decode of the target
    spec = build_draft_backends(registry, draft.ctx, k, target_ctx=target.ctx)  # draft steps, extend, verify

    with torch.inference_mode():
        # prefill both runners; the target's last logits give the first token
        lens = [len(p) for p in prompts]
        logits, _ = target.extend(target_backend, ForwardMode.EXTEND, [0] * R, prompts)
        draft.extend(spec.extend, ForwardMode.EXTEND, [0] * R, prompts)
        seqs = [list(p) for p in prompts]
        verified: list[dict[int, torch.Tensor]] = [{} for _ in range(R)]  # position -> target logits
        for r, rows in enumerate(split(logits, lens)):
            verified[r][lens[r] - 1] = rows[-1]
            seqs[r].append(int(rows[-1].argmax()))

        accepted_counts = []
        for _ in range(args.rounds):
            n = [len(s) for s in seqs]  # caches hold positions 0 .. n-2; the last token is pending
            # 1. draft: k greedy DECODE forwards, step i served by the container's child i
            proposals = [[] for _ in range(R)]
            last = [s[-1] for s in seqs]
            for i in range(k):
                logits, _ = draft.decode(spec.step(i), [m - 1 + i for m in n], last)
                last = logits.argmax(-1).tolist()
                for r in range(R):
                    proposals[r].append(last[r])
            # 2. target: one TARGET_VERIFY forward over [pending, d1 .. dk]
            logits, hidden = target.extend(
                spec.target_verify, ForwardMode.TARGET_VERIFY, [m - 1 for m in n],
                [[s[-1]] + p for s, p in zip(seqs, proposals)], spec_num_draft_tokens=k + 1,
            )
            accepted_tokens, accepted_hidden = [], []
            for r, (rows, h) in enumerate(zip(split(logits, [k + 1] * R), split(hidden, [k + 1] * R))):
                preds = rows.argmax(-1).tolist()
                a = 0
                while a < k and preds[a] == proposals[r][a]:
                    a += 1
                for j in range(a + 1):
                    verified[r][n[r] - 1 + j] = rows[j]
                accepted_counts.append(a)
                accepted_tokens.append([seqs[r][-1]] + proposals[r][:a])
                accepted_hidden.append(h[: a + 1])
                seqs[r] += proposals[r][:a] + [preds[a]]
            # 3. draft catches up: DRAFT_EXTEND over the accepted tokens (ragged), with the
            #    target's hidden states in the sidecar buffer the way an EAGLE head would read them
            spec.extend.set_hidden_states(torch.cat(accepted_hidden))
            draft.extend(spec.extend, ForwardMode.DRAFT_EXTEND, [m - 1 for m in n], accepted_tokens)
            sidecar_rows = spec.extend.take_hidden_states().shape[0]

        # non-speculative reference: the target decoding the same tokens one DECODE at a time
        reference = Runner("reference", target_model, config, R, args.page_size)
        ref_backend = registry.build_pair(reference.ctx)
        ref_logits: list[dict[int, torch.Tensor]] = [{} for _ in range(R)]
        logits, _ = reference.extend(ref_backend, ForwardMode.EXTEND, [0] * R, prompts)
        for r, rows in enumerate(split(logits, lens)):
            ref_logits[r][lens[r] - 1] = rows[-1]
        greedy_ok = True
        for t in range(max(len(s) for s in seqs)):
            active = [r for r in range(R) if lens[r] + t < len(seqs[r]) - 1]  # requests still decoding
            if not active:
                break
            positions = [lens[r] + t for r in active]
            logits, _ = reference.decode(ref_backend, positions, [seqs[r][p] for r, p in zip(active, positions)],
                                         reqs=active)
            for r, p, row in zip(active, positions, logits):
                ref_logits[r][p] = row
                greedy_ok &= int(row.argmax()) == seqs[r][p + 1]

    max_err, compared = 0.0, 0
    for r in range(R):
        for pos, row in verified[r].items():
            max_err = max(max_err, (row - ref_logits[r][pos]).abs().max().item())
            compared += 1
    proposed = len(accepted_counts) * k
    accepted = sum(accepted_counts)
    ok = max_err <= TOLERANCE and greedy_ok and compared == sum(len(s) - len(p) for s, p in zip(seqs, prompts))

    def kernels(runner: Runner) -> str:
        return ", ".join(f"{mode}->{name} x{c}" for (mode, name), c in sorted(runner.kernels.items()))

    print("attnplug speculative decoding example")
    print(f"  config: pair={config.attention_backends()} speculative_attention_mode="
          f"{config.speculative_attention_mode} draft={config.speculative_draft_attention_backend}")
    print(f"  target runner: {kernels(target)}")
    print(f"  draft runner:  {kernels(draft)} (sidecar held {sidecar_rows} hidden rows last round)")
    print(f"  reference:     {kernels(reference)}")
    steps = sorted({spec.step(i).decode_attention_backend_str for i in range(spec.num_steps)})
    print(f"  stamps: {spec.num_steps} draft steps {steps}, draft extend "
          f"{type(spec.extend).__name__}[{spec.extend.prefill_attention_backend_str}], "
          f"target verify [{spec.target_verify.prefill_attention_backend_str}]")
    print(f"  rounds={args.rounds} k={k}: accepted {accepted}/{proposed} draft tokens "
          f"({100 * accepted / max(proposed, 1):.0f}%), generated {[len(s) - len(p) for s, p in zip(seqs, prompts)]}")
    print(f"  verified logits vs one-token DECODE: max |diff| = {max_err:.2e} over {compared} positions "
          f"(tolerance {TOLERANCE:g}); same greedy tokens: {greedy_ok}")
    print(f"  {'OK' if ok else 'MISMATCH'} in {time.perf_counter() - t0:.2f}s")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
