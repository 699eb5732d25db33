"""Recorded example sessions for ``docs/protocol.md``: the messages a client sends and the verifier answers, as
protobuf JSON, one per line, recorded against the scripted verifier (``tandem serve --engine scripted``: the next
token after t is t + 1, token t reads "t "). Session ids are replaced by ``<session>`` and timings (``*_us``) left out;
everything else is what the verifier said. ``tests/test_protocol_examples.py`` records them again and compares.

Write them again after a protocol change:  .venv/bin/python tests/protocol_examples.py --write
"""
from __future__ import annotations

import json
import queue
import sys
from pathlib import Path

import grpc
from google.protobuf import json_format

from tandem.cloud.engines.scripted_engine import ScriptedEngine
from tandem.cloud.server import serve
from tandem.protos import verifier_pb2 as pb
from tandem.protos import verifier_pb2_grpc as pb_grpc

OUT = Path(__file__).resolve().parent.parent / "docs" / "protocol"
TIMINGS = ("prefill_us", "queue_us", "verify_us", "price_us_per_token", "token_budget")  # measured: they vary


def chain(tokens: list[int]) -> pb.DraftTree:
    return pb.DraftTree(tokens=tokens, parents=[-1] + list(range(len(tokens) - 1)))


def lockstep(fp: str) -> list[tuple[pb.SessionRequest, int]]:
    """The minimal client: chains (one wrong at the end, one tree with a wrong sibling), an empty draft, LENGTH."""
    def draft(seq, committed_len, tree):
        return pb.SessionRequest(draft=pb.Draft(committed_len=committed_len, seq=seq, tree=tree))
    return [
        (pb.SessionRequest(open=pb.Open(vocab_size=256, vocab_fingerprint=fp, prompt_tokens=[1, 2, 3],
                                        sampling=pb.SamplingParams(temperature=0.0),
                                        limits=pb.Limits(max_new_tokens=16, max_tree_nodes=8, max_tree_depth=8))), 1),
        (draft(1, 3, chain([4, 5, 6])), 1),  # every node the target's: 3 accepted and the bonus token 7
        (draft(2, 7, chain([8, 9, 42])), 1),  # 42 is not the target's 10: 2 accepted, bonus 10
        (draft(3, 10, pb.DraftTree(tokens=[20, 11, 12, 13], parents=[-1, -1, 1, 2])), 1),  # 20 | 11 -> 12 -> 13
        (draft(4, 14, pb.DraftTree()), 1),  # an empty tree: one plain decoding step
        (draft(5, 15, chain([16, 17, 18, 19, 20])), 1),  # the 16th new token ends it: LENGTH
        (pb.SessionRequest(close=pb.Close()), 1),
    ]


def streamed(fp: str) -> list[tuple[pb.SessionRequest, int]]:
    """decode_steps: the verifier decodes alone while drafts fly; a draft made on older text is rebased or stale."""
    def draft(seq, committed_len, tree, **kw):
        return pb.SessionRequest(draft=pb.Draft(committed_len=committed_len, seq=seq, tree=tree, decode_steps=2,
                                                **kw))
    return [
        (pb.SessionRequest(open=pb.Open(vocab_size=256, vocab_fingerprint=fp, prompt_tokens=[1, 2, 3],
                                        decode_steps=3, sampling=pb.SamplingParams(temperature=0.0),
                                        limits=pb.Limits(max_new_tokens=14, max_tree_nodes=8, max_tree_depth=8))),
         4),  # Opened, then the first token and 2 more decoded alone: 4 5 6 (committed_len 6)
        (draft(1, 4, chain([5, 6, 7, 8, 9])), 3),  # drafted below "4": rebased over 5 6, verifies 7 8 9, +2 alone
        (draft(2, 10, chain([11, 77])), 3),  # drafted below "10", the verifier is at 12: 77 is off its path: stale
        (draft(3, 15, chain([16, 17]), assumed_tokens=[14, 15]), 1),  # assumed what it committed: verified
        (pb.SessionRequest(close=pb.Close()), 1),
    ]


SESSIONS = {"lockstep": lockstep, "streamed": streamed}


def record(name: str, address: str) -> list[dict]:
    """Run one example session against the verifier at ``address``; every message in order, normalised."""
    with grpc.insecure_channel(address) as ch:
        stub = pb_grpc.VerifierStub(ch)
        fp = stub.Health(pb.HealthRequest(), timeout=10).vocab_fingerprint
        requests: queue.SimpleQueue = queue.SimpleQueue()
        responses = stub.Session(iter(requests.get, None), timeout=30)
        out, session = [], ""
        for request, answers in SESSIONS[name](fp):
            for field in ("draft", "close"):
                if request.HasField(field):
                    getattr(request, field).session_id = session
            requests.put(request)
            out.append({"client": _json(request, session)})
            for _ in range(answers):
                response = next(responses)
                session = session or response.opened.session_id
                out.append({"verifier": _json(response, session)})
        requests.put(None)
        return out


def _json(message, session: str) -> dict:
    text = json.dumps(json_format.MessageToDict(message)).replace(session or "\0", "<session>")
    data = json.loads(text)
    for body in data.values():
        for key in TIMINGS:  # (protobuf JSON names are camelCase)
            first, *rest = key.split("_")
            body.pop(first + "".join(w.title() for w in rest), None)
    return data


def recorded(name: str) -> list[dict]:
    return [json.loads(line) for line in (OUT / f"{name}.jsonl").read_text().splitlines()]


def main(argv: list[str]) -> int:
    server, port = serve(ScriptedEngine(), "127.0.0.1:0")
    try:
        for name in SESSIONS:
            lines = record(name, f"127.0.0.1:{port}")
            if "--write" in argv:
                OUT.mkdir(parents=True, exist_ok=True)
                (OUT / f"{name}.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
            else:
                print(f"# {name}", *map(json.dumps, lines), sep="\n")
    finally:
        server.stop(grace=None)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
