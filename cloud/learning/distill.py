"""Distilling the drafter from the target's own distributions: a LoRA adapter trained on the teacher signal
(cloud/learning/teacher.py) with a forward KL to the target's top-k (online speculative decoding, OSD).

The loss at a committed position, with the teacher's top-k log-probabilities ``l`` renormalised over the k kept
(``p = softmax(l)``: the mass past the k is unknown) and the student's log-softmax ``log q`` over its whole
vocabulary::

    KL_k(p || q) = sum_i p_i (log p_i - log q_i)        (i over the teacher's k ids)

It is >= -log Q >= 0 (Q: the student's mass on those k ids) and 0 exactly when the student puts the teacher's
renormalised probabilities on them and nothing elsewhere: the greedy drafter then proposes the target's token.

Training reads windows of at most ``max_tokens`` tokens (``windows``); the adapter is peft's LoRA on the decoder's
linear layers (the tied embedding and head stay frozen, so a VocabTrim head cut from them still fits). Training
yields: ``should_yield`` is read before every step and at every adapted projection, forward and backward, and
when it says so the step is dropped there (``Preempted``), so the compute goes back to the verifier within one
matrix product.
The torch extra; nothing here runs on the verify path.
"""
from __future__ import annotations

import copy
import logging
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

import numpy as np

from .teacher import Sample

log = logging.getLogger("tandem.cloud.distill")

LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
MASKED_LOGPROB = -1e9  # a teacher id the student's vocabulary lacks (a padded target's): weight exp(-1e9) = 0


HEAD_ROWS = 32  # judged rows the vocabulary head computes between two yield checks


class Preempted(Exception):
    """Real traffic needs the compute: the step in progress was dropped."""


@dataclass(frozen=True)
class Window:
    """A stretch of one session's text: ``rows[j]`` is the index in ``tokens`` whose next-token logits the
    teacher's ``top_ids[j]`` / ``top_logprobs[j]`` judge."""

    tokens: list[int]
    rows: np.ndarray  # [n] int64
    top_ids: np.ndarray  # [n, k] int64
    top_logprobs: np.ndarray  # [n, k] float32

    @property
    def positions(self) -> int:
        return len(self.rows)


def windows(samples: Sequence[Sample], max_tokens: int, n_vocab: int) -> list[Window]:
    """The samples' committed positions cut into windows of at most ``max_tokens`` tokens, each position with at
    least ``max_tokens // 2`` tokens of its context in its window (or all it has). Teacher ids at or past
    ``n_vocab`` (a target's padding the drafter lacks) get weight 0."""
    if max_tokens < 2:
        raise ValueError(f"max_tokens must be >= 2, got {max_tokens}")
    block = max_tokens // 2
    out = []
    for s in samples:
        n = len(s.top_ids)
        if s.first < 1 or n == 0:  # (a position needs a token before it)
            continue
        ids = np.stack(s.top_ids).astype(np.int64)
        lps = np.stack(s.top_logprobs).astype(np.float32)
        lps = np.where(ids < n_vocab, lps, MASKED_LOGPROB).astype(np.float32)
        ids = np.where(ids < n_vocab, ids, 0)
        for a in range(0, n, block):
            b = min(n, a + block)
            end = s.first + b - 1  # the last row read is end - 1, whose next token is position b - 1
            start = max(0, end - max_tokens)
            rows = np.arange(s.first + a - 1, end, dtype=np.int64) - start
            out.append(Window(list(s.tokens[start:end]), rows, ids[a:b], lps[a:b]))
    return out


def topk_forward_kl(student_logits, top_ids, top_logprobs):
    """Mean ``KL_k(p || q)`` over positions (module docstring): ``student_logits`` [n, V], ``top_ids`` [n, k],
    ``top_logprobs`` [n, k] (the teacher's log-probabilities, renormalised here). Torch tensors."""
    import torch
    logp = top_logprobs - torch.logsumexp(top_logprobs, dim=-1, keepdim=True)
    logq = torch.log_softmax(student_logits.float(), dim=-1).gather(-1, top_ids)
    return (logp.exp() * (logp - logq)).sum(-1).mean()


class Round:
    """Up to ``epochs`` passes over ``wins`` in a seeded order, one window a step, within ``budget_s`` of step time;
    resumable: ``run`` goes on from where traffic stopped it."""

    def __init__(self, wins: Sequence[Window], epochs: int, budget_s: float, seed: int = 0):
        if epochs < 1 or not budget_s > 0:
            raise ValueError(f"a round needs epochs >= 1 and a positive budget, got {epochs}, {budget_s}")
        self.wins, self.budget_s = list(wins), budget_s
        rng = np.random.default_rng(seed)
        self.order = np.concatenate([rng.permutation(len(self.wins)) for _ in range(epochs)]) if self.wins \
            else np.zeros(0, np.int64)
        self.cursor = 0
        self.report = DistillReport()

    @property
    def done(self) -> bool:
        return self.cursor >= len(self.order) or self.report.train_s >= self.budget_s

    def run(self, distiller: "Distiller", should_yield: Callable[[], bool] = lambda: False) -> bool:
        """Steps until the round is done (True) or ``should_yield`` (False: call again when the compute is free)."""
        distiller.should_yield = should_yield
        try:
            while not self.done:
                if should_yield():
                    return False
                w = self.wins[self.order[self.cursor]]
                t0 = time.perf_counter()
                finished = distiller.step(w)
                self.report.train_s += time.perf_counter() - t0
                if not finished:
                    self.report.preempted += 1
                    self.report.preempted_at_s.append(time.perf_counter())
                    return False
                self.cursor += 1
                self.report.steps += 1
                self.report.positions += w.positions
            return True
        finally:
            distiller.should_yield = lambda: False


@dataclass
class DistillReport:
    steps: int = 0  # optimizer steps taken
    positions: int = 0  # positions those steps trained on
    preempted: int = 0  # steps dropped because traffic needed the compute
    preempted_at_s: list[float] = field(default_factory=list)  # when each was dropped (time.perf_counter)
    train_s: float = 0.0  # wall time in steps (finished or dropped)
    loss_before: float = float("nan")  # mean KL_k over the windows before training, nats
    loss_after: float = float("nan")


class Distiller:
    """A drafter in torch with a LoRA adapter on it, trained on windows of the teacher signal. One instance per
    partition's adapter: it keeps its optimizer's state across rounds (continual distillation)."""

    def __init__(self, model, rank: int = 16, alpha: float = 32.0, lr: float = 5e-4, seed: int = 0,
                 targets: Sequence[str] = LORA_TARGETS):
        """``model``: a transformers causal LM (``load_drafter``), float32 on its device; it is wrapped, not
        copied."""
        import torch
        from peft import LoraConfig, get_peft_model
        if rank < 1 or not alpha > 0 or not lr > 0:
            raise ValueError(f"LoRA rank, alpha and lr must be positive, got {rank}, {alpha}, {lr}")
        torch.manual_seed(seed)
        self.torch = torch
        self.rank, self.alpha = rank, float(alpha)
        with warnings.catch_warnings():  # (peft asks transformers a deprecated question about checkpointing)
            warnings.simplefilter("ignore", FutureWarning)
            self.model = get_peft_model(model, LoraConfig(r=rank, lora_alpha=alpha, target_modules=list(targets),
                                                          lora_dropout=0.0, bias="none"))
        self.device = next(self.model.parameters()).device
        self.n_vocab = int(model.config.vocab_size)
        params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
        self.should_yield: Callable[[], bool] = lambda: False
        self._hook_layers()
        self._initial = self.state()

    def _check(self, *_) -> None:
        if self.should_yield():
            raise Preempted()

    def _check_in_backward(self, out) -> None:
        def check(grad):
            self._check()
            return grad

        if out.requires_grad:  # backward reaches this tensor: check there too
            out.register_hook(check)

    def _hook_layers(self) -> None:
        """``should_yield`` is read before every adapted projection and decoder layer runs, and when backward
        reaches each of their outputs: a step yields within one projection's compute (one matrix product)."""
        from peft.tuners.lora import LoraLayer

        def forward_hook(module, args, output):
            self._check_in_backward(output[0] if isinstance(output, tuple) else output)

        base = self.model.get_base_model()
        for module in [*base.model.layers, *(m for m in self.model.modules() if isinstance(m, LoraLayer))]:
            module.register_forward_pre_hook(self._check)
            module.register_forward_hook(forward_hook)

    def _loss(self, w: Window):
        """KL_k at the window's judged rows. The head (vocabulary x hidden, ~150k x 896 for the 0.5B) runs on those
        rows only, ``HEAD_ROWS`` at a time with a check before each and in backward: over every judged row at once
        it is one product as long as several layers, with no check inside."""
        t = self.torch
        base = self.model.get_base_model()
        hidden = base.model(input_ids=t.tensor([w.tokens], device=self.device)).last_hidden_state[0]
        hidden = hidden[t.from_numpy(w.rows).to(self.device)]
        top_ids = t.from_numpy(w.top_ids).to(self.device)
        top_logprobs = t.from_numpy(w.top_logprobs).to(self.device)
        total = hidden.new_zeros(())
        for a in range(0, len(w.rows), HEAD_ROWS):
            self._check()
            logits = base.lm_head(hidden[a:a + HEAD_ROWS])
            self._check_in_backward(logits)
            # (topk_forward_kl is a mean over rows: weighted by the chunk's share, the chunks sum to the mean)
            total = total + topk_forward_kl(logits, top_ids[a:a + HEAD_ROWS], top_logprobs[a:a + HEAD_ROWS]) * (
                len(logits) / len(w.rows))
        return total

    def loss(self, wins: Sequence[Window]) -> float:
        """Mean KL_k over the windows' positions (weighted by positions), nats; never yields."""
        if not wins:
            return float("nan")
        keep, self.should_yield = self.should_yield, lambda: False
        try:
            with self.torch.inference_mode():
                total = sum(float(self._loss(w)) * w.positions for w in wins)
        finally:
            self.should_yield = keep
        return total / sum(w.positions for w in wins)

    def step(self, w: Window) -> bool:
        """One optimizer step on ``w``; False when ``should_yield`` dropped it (nothing changed)."""
        self.model.train()
        try:
            self.optimizer.zero_grad(set_to_none=True)
            self._loss(w).backward()
            self.optimizer.step()
            return True
        except Preempted:
            return False
        finally:
            self.optimizer.zero_grad(set_to_none=True)
            self.model.eval()

    def state(self) -> dict:
        """The adapter's weights and its optimizer's moments (copies): one partition's training, to come back to."""
        from peft import get_peft_model_state_dict
        return {"lora": {k: v.detach().clone() for k, v in get_peft_model_state_dict(
            self.model, save_embedding_layers=False).items()},
                "optim": copy.deepcopy(self.optimizer.state_dict())}

    def load_state(self, state: dict | None) -> None:
        """Back to ``state`` (``None``: the adapter as first made, a partition's first round)."""
        from peft import set_peft_model_state_dict
        state = state or self._initial
        set_peft_model_state_dict(self.model, state["lora"])
        self.optimizer.load_state_dict(copy.deepcopy(state["optim"]))

    def lora(self) -> dict[str, tuple[np.ndarray, np.ndarray]]:
        """The adapter: Hugging Face module name (``model.layers.0.self_attn.q_proj``) -> (A [r, in], B [out, r])
        as float32 copies (not views of the weights training goes on changing), the module computing
        ``W x + (alpha / r) B A x``."""
        from peft.tuners.lora import LoraLayer
        out = {}
        for name, module in self.model.named_modules():
            if isinstance(module, LoraLayer) and "default" in module.lora_A:
                key = name.removeprefix("base_model.model.")
                out[key] = (module.lora_A["default"].weight.detach().float().cpu().numpy().copy(),
                            module.lora_B["default"].weight.detach().float().cpu().numpy().copy())
        return out


def load_drafter(source: str | Path, device: str | None = None):
    """The drafter as a float32 transformers model, from a GGUF file (transformers' GGUF loader dequantises it)
    or a Hugging Face directory."""
    import torch
    from transformers import AutoModelForCausalLM

    from tandem.core.model_id import transformers_source
    src, extra = transformers_source(source)
    dev = device or ("cuda" if torch.cuda.is_available() else "cpu")
    return AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32, **extra).to(dev).eval()
