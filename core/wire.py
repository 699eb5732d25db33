"""Wire <-> domain conversion for the verifier protocol, used by the edge client and the cloud servicer alike.

The proto (``protos/verifier.proto``) is the only definition of wire types; ``core.messages`` holds their domain
mirror. Nothing else in Tandem builds or reads protobuf messages.
"""

from __future__ import annotations

from tandem.protos import verifier_pb2 as pb

from .messages import AdapterInfo, Constraint, DraftRequest, Finish, Limits, Opened, OpenRequest, TokenLogprobs, Verdict
from .sampling import Sampling
from .tree import DraftTree

FINISH_TO_WIRE = {
    Finish.NONE: pb.FINISH_REASON_UNSPECIFIED,
    Finish.STOP: pb.FINISH_REASON_STOP,
    Finish.LENGTH: pb.FINISH_REASON_LENGTH,
}
FINISH_FROM_WIRE = {v: k for k, v in FINISH_TO_WIRE.items()}


def tree_to_wire(tree: DraftTree) -> pb.DraftTree:
    return pb.DraftTree(tokens=tree.tokens, parents=tree.parents)


def tree_from_wire(msg: pb.DraftTree) -> DraftTree:
    return DraftTree(tuple(msg.tokens), tuple(msg.parents))


def limits_to_wire(limits: Limits) -> pb.Limits:
    return pb.Limits(
        max_new_tokens=limits.max_new_tokens, max_tree_nodes=limits.max_tree_nodes, max_tree_depth=limits.max_tree_depth
    )


def limits_from_wire(msg: pb.Limits) -> Limits:
    return Limits(msg.max_new_tokens, msg.max_tree_nodes, msg.max_tree_depth)


def sampling_to_wire(s: Sampling) -> pb.SamplingParams:
    msg = pb.SamplingParams(
        temperature=s.temperature,
        top_k=s.top_k,
        top_p=s.top_p,
        min_p=s.min_p,
        presence_penalty=s.presence_penalty,
        frequency_penalty=s.frequency_penalty,
        repetition_penalty=s.repetition_penalty,
        logit_bias=dict(s.logit_bias),
    )
    if s.seed is not None:
        msg.seed = s.seed
    return msg


def sampling_from_wire(msg: pb.SamplingParams) -> Sampling:
    return Sampling(
        temperature=msg.temperature,
        top_k=msg.top_k,
        top_p=msg.top_p,
        seed=msg.seed if msg.HasField("seed") else None,
        min_p=msg.min_p,
        presence_penalty=msg.presence_penalty,
        frequency_penalty=msg.frequency_penalty,
        repetition_penalty=msg.repetition_penalty or 1.0,
        logit_bias=tuple(sorted(msg.logit_bias.items())),
    )


def open_to_wire(req: OpenRequest) -> pb.SessionRequest:
    return pb.SessionRequest(
        open=pb.Open(
            target_model=req.target_model,
            vocab_size=req.vocab_size,
            vocab_fingerprint=req.vocab_fingerprint,
            sampling=sampling_to_wire(req.sampling),
            prompt_tokens=req.prompt,
            limits=limits_to_wire(req.limits),
            decode_steps=req.decode_steps,
            top_logprobs=req.top_logprobs,
            prior_output_tokens=req.prior_output,
            constraint=constraint_to_wire(req.constraint),
            cache_salt=req.cache_salt,
            withhold_from_teacher=req.withhold_from_teacher,
            host_draft=req.host_draft,
        )
    )


def constraint_to_wire(c: Constraint | None) -> pb.Constraint | None:
    if c is None:
        return None
    return pb.Constraint(json_schema=c.json_schema) if c.json_schema else pb.Constraint(json_object=c.json_object)


def constraint_from_wire(msg: pb.Open) -> Constraint | None:
    if not msg.HasField("constraint"):
        return None
    kind = msg.constraint.WhichOneof("kind")
    if kind == "json_schema":
        return Constraint(json_schema=msg.constraint.json_schema)
    return Constraint(json_object=msg.constraint.json_object) if kind == "json_object" else None


def open_from_wire(msg: pb.Open) -> OpenRequest:
    return OpenRequest(
        tuple(msg.prompt_tokens),
        sampling_from_wire(msg.sampling),
        limits_from_wire(msg.limits),
        msg.vocab_size,
        msg.vocab_fingerprint,
        msg.target_model,
        msg.decode_steps,
        msg.top_logprobs if msg.HasField("top_logprobs") else None,
        msg.prior_output_tokens,
        constraint_from_wire(msg),
        msg.cache_salt,
        withhold_from_teacher=msg.withhold_from_teacher,
        host_draft=msg.host_draft,
    )


def opened_to_wire(o: Opened) -> pb.SessionResponse:
    return pb.SessionResponse(
        opened=pb.Opened(
            session_id=o.session_id,
            target_model=o.target_model,
            n_ctx=o.n_ctx,
            limits=limits_to_wire(o.limits),
            prefill_us=o.prefill_us,
            cached_tokens=o.cached_tokens,
            extra_pieces=o.extra_pieces,
            adapter=adapter_to_wire(o.adapter),
            host_drafter=o.host_drafter,
            host_level_us=o.host_level_us,
        )
    )


def opened_from_wire(msg: pb.Opened) -> Opened:
    return Opened(
        msg.session_id,
        limits_from_wire(msg.limits),
        msg.prefill_us,
        msg.target_model,
        msg.n_ctx,
        msg.cached_tokens,
        tuple(msg.extra_pieces),
        adapter_from_wire(msg.adapter) if msg.HasField("adapter") else None,
        msg.host_drafter,
        msg.host_level_us,
    )


def adapter_to_wire(a: AdapterInfo | None) -> pb.AdapterInfo | None:
    return (
        None if a is None else pb.AdapterInfo(sha256=a.sha256, version=a.version, base=a.base, size_bytes=a.size_bytes)
    )


def adapter_from_wire(msg: pb.AdapterInfo) -> AdapterInfo:
    return AdapterInfo(msg.sha256, msg.version, msg.base, msg.size_bytes)


def draft_to_wire(session_id: str, d: DraftRequest) -> pb.SessionRequest:
    return pb.SessionRequest(
        draft=pb.Draft(
            session_id=session_id,
            committed_len=d.committed_len,
            tree=tree_to_wire(d.tree),
            decode_steps=d.decode_steps,
            seq=d.seq,
            assumed_tokens=d.assumed,
            node_logprobs=d.node_logp,
            host_draft=d.host_draft,
        )
    )


def draft_from_wire(msg: pb.Draft) -> DraftRequest:
    return DraftRequest(
        msg.committed_len,
        tree_from_wire(msg.tree),
        msg.seq,
        tuple(msg.assumed_tokens),
        msg.decode_steps,
        tuple(msg.node_logprobs),
        msg.host_draft,
    )


def close_to_wire(session_id: str) -> pb.SessionRequest:
    return pb.SessionRequest(close=pb.Close(session_id=session_id))


def verdict_to_wire(v: Verdict) -> pb.SessionResponse:
    return pb.SessionResponse(
        verdict=pb.Verdict(
            accepted=v.accepted,
            bonus_token=v.bonus,
            committed_len=v.committed_len,
            finish_reason=FINISH_TO_WIRE[v.finish],
            queue_us=v.queue_us,
            verify_us=v.verify_us,
            draft_seq=v.draft_seq,
            rebased=v.rebased,
            stale=v.stale,
            forward_tokens=v.forward_tokens,
            pruned_nodes=v.pruned_nodes,
            committed_hash=v.committed_hash,
            price_us_per_token=v.price_us_per_token,
            batch_sessions=v.batch_sessions,
            token_budget=v.token_budget,
            host_tokens=v.host_tokens,
            host_drafted=v.host_drafted,
            host_level_us=v.host_level_us,
            logprobs=[
                pb.TokenLogprobs(
                    token=lp.token,
                    logprob=lp.logprob,
                    top_tokens=[t for t, _ in lp.top],
                    top_logprobs=[x for _, x in lp.top],
                )
                for lp in v.logprobs
            ],
        )
    )


def verdict_from_wire(msg: pb.Verdict) -> Verdict:
    return Verdict(
        tuple(msg.accepted),
        msg.bonus_token,
        msg.committed_len,
        FINISH_FROM_WIRE[msg.finish_reason],
        msg.queue_us,
        msg.verify_us,
        msg.draft_seq,
        msg.rebased,
        msg.stale,
        msg.forward_tokens,
        tuple(TokenLogprobs(lp.token, lp.logprob, tuple(zip(lp.top_tokens, lp.top_logprobs))) for lp in msg.logprobs),
        msg.pruned_nodes,
        msg.committed_hash,
        msg.price_us_per_token,
        msg.batch_sessions,
        msg.token_budget,
        tuple(msg.host_tokens),
        msg.host_drafted,
        msg.host_level_us,
    )
