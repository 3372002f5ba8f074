"""Can a draft head for a model without one be trained on CPU? A feasibility measurement.

An MTP-style head (DeepSeek-V3's layout: ``enorm`` / ``hnorm``, ``eh_proj``, one decoder layer,
the model's own final norm and LM head, frozen) is trained on SmolLM2's own greedy answers to
chat prompts to predict token ``t + 2`` from the main model's final hidden state at ``t`` and the
embedding of token ``t + 1``. The decoder layer starts as a copy of the model's last layer and
``eh_proj`` passes the hidden state through. Reported: on held-out answers, how often the
head's greedy prediction equals the model's greedy token two ahead, which is the acceptance a
one-token MTP draft would have under greedy decoding; before training and every ``--every``
steps.

The answers are generated with pdserve's engine (greedy); the hidden states come from HF
transformers' forward on the same checkpoint (the engine's runs under ``inference_mode``, and
training needs none of its paging). Nothing here is wired into the engine: the trained head is
not saved.

    .venv/bin/python bench/mtp_head.py [--prompts 240] [--eval 40] [--steps 400]
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parents[1]
MODEL = REPO / ".cache" / "models" / "SmolLM2-135M-Instruct"
TOPICS = (
    *("the ocean", "volcanoes", "bread baking", "chess", "the moon", "bees", "rain", "trains"),
    *("jazz", "libraries", "glaciers", "coffee", "bicycles", "deserts", "owls", "castles"),
    *("electricity", "gardening", "maps", "clocks", "whales", "paper", "mountains", "forests"),
    *("rivers", "robots", "stars", "tea", "bridges", "music"),
)
ASKS = (
    "Write a short paragraph about {}.",
    "Explain {} to a child.",
    "List three facts about {}.",
    "Describe a day spent thinking about {}.",
    "Why do people like {}?",
    "Tell a tiny story involving {}.",
    "What is the history of {}?",
    "Give advice to someone curious about {}.",
)


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def generate(model_dir: Path, count: int, new_tokens: int) -> list[tuple[list[int], list[int]]]:
    """(prompt, greedy answer) token ids for ``count`` chat prompts."""
    from workers.engine.llm import LLM
    from workers.engine.sampling_params import SamplingParams

    llm = LLM(model_dir, detokenize=False, num_pages=1024, max_num_seqs=16)
    tokenizer = llm.engine.tokenizer
    assert tokenizer is not None
    messages = [ask.format(topic) for topic in TOPICS for ask in ASKS]
    random.Random(0).shuffle(messages)
    prompts = [
        tokenizer.apply_chat_template([{"role": "user", "content": m}]) for m in messages[:count]
    ]
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    pairs = []
    for first in range(0, len(prompts), 16):
        results = llm.generate(prompts[first : first + 16], params)
        pairs += [(list(r.prompt_token_ids), list(r.token_ids)) for r in results]
        log(f"generated {len(pairs)}/{len(prompts)} answers")
    return pairs


class Head(torch.nn.Module):
    """The MTP module over one sequence, full causal attention (training needs no pages)."""

    def __init__(self, hf: torch.nn.Module, rope_theta: float) -> None:
        super().__init__()
        config = hf.config
        self.hidden = hidden = config.hidden_size
        self.heads, self.kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = hidden // self.heads
        self.eps = config.rms_norm_eps
        self.rope_theta = rope_theta
        last = hf.model.layers[-1]

        def param(tensor: torch.Tensor) -> torch.nn.Parameter:
            return torch.nn.Parameter(tensor.detach().clone())

        self.enorm, self.hnorm = param(torch.ones(hidden)), param(torch.ones(hidden))
        eh = torch.zeros(hidden, 2 * hidden)
        eh[:, hidden:] = torch.eye(hidden)  # starts as "the hidden state, as is"
        self.eh_proj = param(eh)
        attn, mlp = last.self_attn, last.mlp
        self.ln1, self.ln2 = (
            param(last.input_layernorm.weight),
            param(last.post_attention_layernorm.weight),
        )
        self.q, self.k = param(attn.q_proj.weight), param(attn.k_proj.weight)
        self.v, self.o = param(attn.v_proj.weight), param(attn.o_proj.weight)
        self.gate, self.up = param(mlp.gate_proj.weight), param(mlp.up_proj.weight)
        self.down = param(mlp.down_proj.weight)
        self.final_norm = param(hf.model.norm.weight)
        self.embed = hf.model.embed_tokens.weight.detach()
        self.lm_head = hf.lm_head.weight.detach()

    def _rms(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * weight

    def _rope(self, x: torch.Tensor) -> torch.Tensor:
        length, half = x.shape[1], self.head_dim // 2
        inv = 1.0 / self.rope_theta ** (torch.arange(0, self.head_dim, 2).float() / self.head_dim)
        angles = torch.outer(torch.arange(length).float(), inv).repeat(1, 2)
        rotated = torch.cat([-x[..., half:], x[..., :half]], -1)
        return x * angles.cos() + rotated * angles.sin()

    def forward(self, next_tokens: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """Position ``t`` reads token ``t + 1`` and the main hidden state at ``t``."""
        length = hidden.shape[0]
        x = torch.cat(
            [self._rms(self.embed[next_tokens], self.enorm), self._rms(hidden, self.hnorm)], -1
        )
        x = F.linear(x, self.eh_proj)
        y = self._rms(x, self.ln1)
        q = F.linear(y, self.q).view(length, self.heads, self.head_dim).transpose(0, 1)
        k = F.linear(y, self.k).view(length, self.kv_heads, self.head_dim).transpose(0, 1)
        v = F.linear(y, self.v).view(length, self.kv_heads, self.head_dim).transpose(0, 1)
        groups = self.heads // self.kv_heads
        q, k = self._rope(q), self._rope(k).repeat_interleave(groups, 0)
        out = F.scaled_dot_product_attention(q, k, v.repeat_interleave(groups, 0), is_causal=True)
        x = x + F.linear(out.transpose(0, 1).reshape(length, self.hidden), self.o)
        y = self._rms(x, self.ln2)
        return x + F.linear(F.silu(F.linear(y, self.gate)) * F.linear(y, self.up), self.down)

    def logits(self, out: torch.Tensor) -> torch.Tensor:
        return F.linear(self._rms(out, self.final_norm), self.lm_head)


Example = tuple[torch.Tensor, torch.Tensor, int]  # token ids, main hidden states, prompt length


def acceptance(head: Head, examples: list[Example]) -> float:
    """Share of answer positions where the head's greedy t+2 is the model's greedy token."""
    hits = total = 0
    with torch.no_grad():
        for ids, hidden, prompt_len in examples:
            predicted = head.logits(head(ids[1:], hidden[:-1])[:-1]).argmax(-1)
            targets = ids[2:]
            answer = torch.arange(2, len(ids)) > prompt_len  # a draft of the 2nd answer token on
            hits += int((predicted == targets)[answer].sum())
            total += int(answer.sum())
    return hits / total


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, default=MODEL)
    parser.add_argument("--prompts", type=int, default=240, help="answers generated in all")
    parser.add_argument("--eval", type=int, default=40, help="of them, held out")
    parser.add_argument("--new-tokens", type=int, default=96)
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--every", type=int, default=50)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(args.threads)
    rng = random.Random(0)
    started = time.perf_counter()
    pairs = generate(args.model, args.prompts, args.new_tokens)
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
    examples: list[Example] = []
    with torch.no_grad():
        for prompt, answer in pairs:
            ids = torch.tensor([prompt + answer])
            hidden = hf(ids, output_hidden_states=True).hidden_states[-1][0]  # after the norm
            examples.append((ids[0], hidden, len(prompt)))
    log(f"hidden states of {len(examples)} sequences ({time.perf_counter() - started:.0f} s)")
    rope_theta = json.loads((args.model / "config.json").read_text())["rope_theta"]
    head = Head(hf, rope_theta)
    train, held_out = examples[: -args.eval], examples[-args.eval :]
    rows = [(0, acceptance(head, held_out))]
    optimizer = torch.optim.AdamW(head.parameters(), lr=3e-4, weight_decay=0.0)
    for step in range(1, args.steps + 1):
        loss = torch.zeros(())
        for ids, hidden, _ in rng.sample(train, 4):
            out, targets = head(ids[1:], hidden[:-1])[:-1], ids[2:]
            chosen = torch.randperm(len(targets))[:96]  # the LM head dominates: a sample
            loss = loss + F.cross_entropy(head.logits(out[chosen]), targets[chosen]) / 4
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if step % args.every == 0:
            rows.append((step, acceptance(head, held_out)))
            log(f"step {step}: loss {loss.item():.3f}, held-out acceptance {rows[-1][1]:.3f}")
    answer_tokens = sum(len(a) for _, a in pairs)
    print(
        f"# {args.model.name}: {len(train)} answers to train on ({answer_tokens} answer tokens "
        f"in all), {len(held_out)} held out, {time.perf_counter() - started:.0f} s"
    )
    print("| step | held-out greedy acceptance |\n|---|---|")
    for step, value in rows:
        print(f"| {step} | {value:.3f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
