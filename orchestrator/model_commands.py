"""Offline tooling of the models: ``tandem models fetch|list|check`` (provisioning the pinned pair, and whether a
drafter can draft for a target) and ``tandem drafter export|vocabtrim`` (an ONNX drafter and its head vocabulary)."""
from __future__ import annotations

import sys
from pathlib import Path

from . import models
from .drafting import threads


def models_list(args) -> int:
    for m in models.status():
        print(f"{m['role']:11} {m['name']:40} {m['bytes'] / 2**30:5.2f} GiB  {m['state']:12} {m['file']}")
    return 0


def models_fetch(args) -> int:
    if args.name:
        print(f"{args.name}: {models.fetch(args.name)}")
        return 0
    roles = models.ROLES if args.role == "all" else (args.role,)
    for role in roles:
        path = models.fetch(role)
        print(f"{role}: {path}")
    return 0


def models_check(args) -> int:
    """Whether --drafter can draft for --target (the verifier's own rule), and its acceptance on a few prompts."""
    import json

    from tandem.cloud.engines import load_engine
    from tandem.core.llama_runtime import LlamaModel

    from . import datasets, pairing
    target_path = models.resolve(args.target, "target")
    drafter_path = models.resolve(args.drafter, "drafter")
    drafter = LlamaModel(drafter_path)
    engine = load_engine("torch" if target_path.is_dir() else "llama.cpp", model_path=target_path, n_ctx=4096,
                         **({} if target_path.is_dir() else {"n_threads": args.threads or threads(),
                                                              "max_sessions": 1}))
    pair = pairing.with_tokenizer_file(pairing.pairing(engine, drafter), engine)
    acceptance = None
    if pair.kind != pairing.REFUSED and args.prompts > 0:
        chats = [datasets.humaneval_messages(p) for p in datasets.humaneval(args.prompts)]
        chats += datasets.sharegpt(args.prompts)
        acceptance = pairing.measure_translated(engine, drafter_path, chats, args.tokens) \
            if pair.kind == pairing.TRANSLATED else pairing.measure(engine, drafter, chats, args.tokens)
    print(pairing.report(pair, acceptance))
    if args.json:
        Path(args.json).write_text(json.dumps(pairing.as_json(pair, acceptance), indent=1))
    return 1 if pair.kind == pairing.REFUSED else 0



def drafter_export(args) -> int:
    from tandem.edge.export.onnx_export import ExportError, export
    try:
        print(export(models.resolve(args.drafter, "drafter"), args.quant, force=args.force,
                     self_contained=args.self_contained))
    except ExportError as e:
        print(f"tandem drafter export: {e}", file=sys.stderr)
        return 2
    return 0


def drafter_vocabtrim(args) -> int:
    """Choose a VocabTrim head vocabulary: ranked by the declared corpus (orchestrator.calibration) plus the target's
    own outputs on calibration prompts; sized by ``--k``, by calibration ``--coverage``, or (default) as the smallest
    K covering ``--heldout-coverage`` of the target's tokens on prompts the ranking did not see (two folds)."""
    from collections import Counter

    from .calibration import corpus_counts, k_by_coverage, merge
    from .datasets import calibration_chats
    from tandem.cloud import reference
    from tandem.cloud.engines.llama_engine import LlamaVerifierEngine
    from tandem.edge import vocabtrim

    engine = LlamaVerifierEngine(models.resolve(args.target, "target"), n_ctx=4096, n_threads=args.threads or
                                 threads(), max_sessions=1)
    tok = engine.model
    corpus, meta = corpus_counts(tok, progress=lambda m: print(f"\r[vocabtrim] corpus {m}  ", end="",
                                                                file=sys.stderr, flush=True))
    print(f"\n[vocabtrim] corpus: {meta['tokens']} tokens, {meta['distinct']} distinct ids", file=sys.stderr)
    prompts = [tok.tokenize(tok.chat_prompt(c)) for c in calibration_chats(args.code_prompts, args.chat_prompts)]
    per_prompt: list[list[int]] = []
    for i, p in enumerate(prompts):
        per_prompt.append(reference.greedy(engine, p, args.max_new_tokens).tokens)
        print(f"\r[vocabtrim] target outputs {i + 1}/{len(prompts)}", end="", file=sys.stderr, flush=True)
    print(file=sys.stderr)
    outputs = [t for o in per_prompt for t in o]
    counts = merge(corpus, Counter(outputs))
    eog = [t for t in range(tok.n_vocab) if tok.is_eog(t)]
    k = args.k
    if k is None and args.coverage is None:
        k = k_by_coverage(corpus, per_prompt, args.heldout_coverage)
        if k is None:
            print(f"tandem drafter vocabtrim: no K reaches {args.heldout_coverage} of the target's outputs",
                  file=sys.stderr)
            return 1
        print(f"[vocabtrim] K = {k}: the smallest head holding {args.heldout_coverage} of the target's tokens on "
              "prompts its ranking did not see (two folds)", file=sys.stderr)
    ids = vocabtrim.choose(counts, k=k, coverage=None if k else args.coverage, always=eog, fill_below=tok.n_vocab)
    vocabtrim.save(ids, args.out, counts=counts)
    print(f"{len(ids)} ids; target outputs covered {vocabtrim.coverage(ids, outputs):.4f}: {args.out}")
    return 0

