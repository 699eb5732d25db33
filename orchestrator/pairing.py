"""Whether a drafter can draft for a target, and how well: ``tandem models check --target X --drafter Y``.

The kind of pair follows the verifier's own rule (``cloud.session.check_vocabulary``): *native* when the
vocabularies are the same, *padded* when the drafter's ids are a prefix of the target's with the same texts
(Qwen2.5 7B and up against the small models), otherwise *translated*: the tokenizers differ and the edge drafts
through text (``edge.translate``), which needs the target's tokenizer file (a GGUF's vocabulary, or a Hugging Face
tokenizer.json); without one the pair is *refused*.

Acceptance of a native or padded pair is measured the way greedy lock-step chains would see it, without running
the stack: the target decodes each prompt greedily; the drafter reads the prompt and the target's answer in one
teacher-forced pass, and ``matches[i]`` says whether its greedy choice at answer position i is the target's token.
A chain drafted at position i is accepted for as many positions as match in a row from i (each accepted token is
the target's, so the drafter's next choice is exactly the teacher-forced one), which gives tokens per verify
forward for any chain depth (``chain_tau``). A translated pair has no token-for-token agreement to count: its
chains run through an in-process verifier instead (``measure_translated``).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import Sequence

import numpy as np

PADDED, NATIVE, TRANSLATED, REFUSED = "padded", "native", "translated", "refused"


@dataclass(frozen=True)
class Pairing:
    kind: str  # NATIVE | PADDED | TRANSLATED | REFUSED
    target_ids: int
    drafter_ids: int
    detail: str  # the verifier's reason for a refused pair
    web: str = ""  # what a browser client gets of the target's tokenizer (``with_tokenizer_file``)


def pairing(target, drafter_tokenizer) -> Pairing:
    """``target``: a verifier engine; ``drafter_tokenizer``: the drafter's (``edge.drafter.Tokenizer``)."""
    from tandem.cloud.session import Refused, check_vocabulary
    n_t, n_d = target.vocab_size, drafter_tokenizer.n_vocab
    try:
        check_vocabulary(target, n_d, drafter_tokenizer.vocab_fingerprint)
    except Refused as e:
        if hasattr(target, "tokenizer_file"):  # the edge can fetch the target's tokenizer and translate
            return Pairing(TRANSLATED, n_t, n_d, str(e))
        return Pairing(REFUSED, n_t, n_d, f"{e}; the target's engine offers no tokenizer file to translate with")
    return Pairing(NATIVE if n_t == n_d else PADDED, n_t, n_d, "")


def with_tokenizer_file(p: Pairing, target) -> Pairing:
    """``p`` told what the target's tokenizer file (``tokenizer_file()``: written into the cache the first time)
    gives: a translated pair needs one; a browser client (clients/web) needs it as a ``tokenizer.json``, which
    the gateway serves for a GGUF target only when its tokenizer family converts (``core.gguf_tokenizer``).
    Python edges tokenize a GGUF target's vocabulary with llama.cpp itself, any family."""
    from tandem.core.gguf_tokenizer import UnsupportedTokenizer, family
    if p.kind == REFUSED:
        return p
    file = target.tokenizer_file() if hasattr(target, "tokenizer_file") else None
    if file is None:
        web = "none (the target's engine offers no tokenizer file)"
        if p.kind == TRANSLATED:
            return replace(p, kind=REFUSED, detail=f"{p.detail}; the target's engine offers no tokenizer file to "
                                                   "translate with", web=web)
        return replace(p, web=web)
    kind, path = file
    if kind != "gguf-vocab":
        return replace(p, web="the target's own tokenizer.json")
    try:
        return replace(p, web=f"tokenizer.json converted from the target's GGUF vocabulary ({family(path)})")
    except UnsupportedTokenizer as e:
        return replace(p, web=f"none: {e} (Python edges tokenize it with llama.cpp)")


def chain_tau(matches: Sequence[bool], depth: int) -> float:
    """Tokens per verify forward when greedy chains of ``depth`` draft an answer whose positions the drafter
    predicts as ``matches`` says: each round accepts the run of matches from where it starts (at most ``depth``)
    and commits one token more (the target's own at the first miss, or after the chain)."""
    if depth < 0:
        raise ValueError(f"chain depth must be >= 0, got {depth}")
    i, rounds, n = 0, 0, len(matches)
    while i < n:
        run = 0
        while run < depth and i + run < n and matches[i + run]:
            run += 1
        i += run + 1
        rounds += 1
    return n / rounds if rounds else 0.0


def teacher_forced_matches(drafter_model, prompt: Sequence[int], answer: Sequence[int], stand_in,
                           lora=None) -> list[bool]:
    """Whether the drafter's greedy choice at each answer position is the answer's token, the drafter reading
    the prompt and the answer itself (``stand_in`` maps the target's ids to ones the drafter has); ``lora``: a
    ``core.llama_runtime.LoraAdapter`` of the drafter to compute with."""
    from tandem.core.llama_runtime import LlamaContext
    if not answer:
        return []
    seen = stand_in(list(prompt) + list(answer[:-1]))
    ctx = LlamaContext(drafter_model, len(seen) + 8, n_seq_max=1, n_batch=256)
    try:
        if lora is not None:
            ctx.set_lora(lora)
        if len(prompt) > 1:
            ctx.prefill(seen[:len(prompt) - 1], 0)
        rows, start = [], len(prompt) - 1
        for lo in range(start, len(seen), ctx.n_batch):
            chunk = seen[lo:lo + ctx.n_batch]
            out = ctx.decode(chunk, range(lo, lo + len(chunk)), [(0,)] * len(chunk), [True] * len(chunk))
            rows.append(out.argmax(axis=1))
    finally:
        ctx.close()
    guesses = np.concatenate(rows)
    return [bool(g == t) for g, t in zip(guesses.tolist(), answer)]


def measure(target, drafter_model, chats: Sequence[Sequence[dict]], new_tokens: int,
            depths: Sequence[int] = (4, 6)) -> dict:
    """Acceptance of ``drafter_model`` (a ``core.llama_runtime.LlamaModel``) against ``target`` (a verifier
    engine of a native or padded pair) on the target's greedy answers to ``chats``, rendered by the target's chat
    template (the drafter's where the target has none) and tokenized by the drafter (the same texts)."""
    from tandem.cloud import reference
    from tandem.cloud.session import extra_pieces
    from tandem.core.chat_template import ChatTemplate
    from tandem.edge.extra_ids import ExtraIds
    extra = ExtraIds(drafter_model, extra_pieces(target, drafter_model.n_vocab))
    template = getattr(target, "chat_template", "")
    render = ChatTemplate(template, getattr(target, "bos_token", ""), getattr(target, "eos_token", "")).render \
        if template else drafter_model.chat_prompt
    matches: list[bool] = []
    per_prompt = []
    for chat in chats:
        prompt = drafter_model.tokenize(render(chat))
        answer = reference.greedy(target, prompt, new_tokens).tokens
        m = teacher_forced_matches(drafter_model, prompt, answer, extra.to_drafter)
        per_prompt.append({"tokens": len(m), "agreement": round(float(np.mean(m)), 3) if m else 0.0})
        matches += m
    return {"prompts": len(per_prompt), "tokens": len(matches),
            "agreement": round(float(np.mean(matches)), 3) if matches else 0.0,
            "chain_tau": {str(d): round(chain_tau(matches, d), 3) for d in depths},
            "per_prompt": per_prompt}


def measure_translated(target, drafter_path, chats: Sequence[Sequence[dict]], new_tokens: int,
                       depths: Sequence[int] = (4, 6)) -> dict:
    """Tokens per verify forward of greedy lock-step chains through an in-process verifier on ``target``, the
    drafter at ``drafter_path`` drafting through translation."""
    from tandem.cloud.server import serve
    from tandem.core.tree import TreeShape
    from tandem.edge.client import EdgeClient
    from tandem.edge.llama_drafter import LlamaDrafter
    from tandem.edge.planner import FixedPlanner
    srv, port = serve(target, "127.0.0.1:0", max_sessions=1)
    client = EdgeClient(LlamaDrafter(drafter_path, n_ctx=target.n_ctx), f"127.0.0.1:{port}", TreeShape(1, 4, 4),
                        stream=False)
    taus, tokens = {}, 0
    try:
        if client.pair_with_target() != TRANSLATED:
            raise RuntimeError("the client did not pair the drafter by translation")
        for depth in depths:
            generated = rounds = 0
            for chat in chats:
                gen = client.generate(client.prompt_tokens(chat), max_new_tokens=new_tokens,
                                      planner=FixedPlanner(TreeShape(1, depth, depth), False)).result()
                generated, rounds = generated + gen.stats.generated_tokens, rounds + gen.stats.rounds
            taus[str(depth)], tokens = round(generated / max(1, rounds), 3), generated
    finally:
        client.close()
        srv.stop(grace=None)
    return {"prompts": len(chats), "tokens": tokens, "agreement": None, "chain_tau": taus, "per_prompt": []}


def report(p: Pairing, acceptance: dict | None) -> str:
    if p.kind == REFUSED:
        return f"pair: {p.kind} (target {p.target_ids} ids, drafter {p.drafter_ids}): {p.detail}"
    head = {NATIVE: f"pair: native (target and drafter share {p.drafter_ids} ids)",
            PADDED: f"pair: padded (target and drafter share {p.drafter_ids} ids; {p.target_ids - p.drafter_ids} "
                    f"target ids past the drafter's, rendered by the verifier)",
            TRANSLATED: f"pair: translated (the tokenizers differ: target {p.target_ids} ids, drafter "
                        f"{p.drafter_ids}; the edge drafts through text with the target's tokenizer)"}[p.kind]
    if p.web:
        head += f"\nbrowser clients' tokenizer: {p.web}"
    if not acceptance:
        return head
    taus = ", ".join(f"chains of {d}: {t}" for d, t in acceptance["chain_tau"].items())
    if acceptance["agreement"] is None:
        return (f"{head}\nacceptance on {acceptance['prompts']} prompts x {acceptance['tokens']} answer tokens "
                f"(greedy lock-step chains through a local verifier): tokens per verify forward with {taus}")
    return (f"{head}\nacceptance on {acceptance['prompts']} prompts x {acceptance['tokens']} answer tokens "
            f"(greedy, teacher-forced): the drafter's top choice is the target's {acceptance['agreement']:.0%} of "
            f"the time; tokens per verify forward with {taus}")


def as_json(p: Pairing, acceptance: dict | None) -> dict:
    return {**asdict(p), "acceptance": acceptance}
