"""``tandem chat`` on a terminal: one answer (a prompt given), or a multi-turn chat. Ctrl-C during an answer stops it,
and the part shown stays in the conversation; Ctrl-C on a line being typed drops the line; Ctrl-C at an empty
prompt, Ctrl-D or /quit ends the chat. The verifier is asked first (Health), before the drafter loads."""
from __future__ import annotations

import re
import signal
import sys
import time

from tandem.edge.policy.planner import PolicyConfig

from . import drafting

FIXED_TREE = "4,16,6"  # the fixed tree of --no-adaptive without --tree
LATE_CTRL_C_S = 1.0  # a Ctrl-C at the prompt this soon after an answer ended was meant to stop that answer
GREETING = ("tandem chat: type a message; /stats toggles statistics, /reset starts over, /quit (or Ctrl-D) ends; "
            "Ctrl-C stops an answer.")


def adaptive(args) -> bool:
    """Whether a chat drafts under the draft policy: as asked (``--adaptive`` / ``--no-adaptive``), else unless a
    fixed ``--tree`` was given. The policy is the default because where drafting loses it stays near cloud-only
    decoding, while a fixed tree whose drafts land and lose runs well below it (``bench.network`` on shared cores;
    issue 15)."""
    return args.adaptive if args.adaptive is not None else args.tree is None


def chat(args, address: str) -> int:
    """``tandem chat`` against the verifier at ``address``: its exit status (1: the verifier failed, 130: stopped
    by Ctrl-C)."""
    from tandem.edge.client import RemoteError, health

    try:
        health(address, timeout_s=10, tls_ca=args.tls_ca or None)
    except RemoteError as e:
        print(f"tandem chat: {_unreachable(address, e)}", file=sys.stderr)
        return 1
    conversation = _Conversation(args, _client(args, address))
    try:
        if args.prompt:
            return 0 if conversation.answer(args.prompt) else 130
        return _converse(conversation)
    except RemoteError as e:
        print(f"tandem chat: {_unreachable(address, e)}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # a second Ctrl-C during an answer: out at once
        print(flush=True)
        return 130
    finally:
        conversation.client.close()


def _client(args, address: str):
    """The edge client: the drafter (loaded now), under the draft policy or a fixed tree, paired with the target."""
    from tandem.core.tree import TreeShape
    from tandem.edge.client import EdgeClient

    drafter = drafting.load_drafter(args)
    policy = None
    if adaptive(args):
        from tandem.edge.policy import DraftPolicy, PolicyConfig
        policy = DraftPolicy(PolicyConfig() if args.shadow else PolicyConfig(shadow_depth=0), objective=args.objective)
    return drafting.paired(EdgeClient(drafter, address, TreeShape.parse(args.tree or FIXED_TREE), policy=policy,
                                      proactive=args.proactive, tls_ca=args.tls_ca or None,
                                      ngram=drafting.ngram(args.ngram)))


class _Conversation:
    """The turns so far, answered one at a time by ``client``."""

    def __init__(self, args, client):
        self.args, self.client = args, client
        self.system = [{"role": "system", "content": args.system}] if args.system else []
        self.history: list[dict] = []
        self.show_stats = args.stats or bool(args.prompt)
        self.answered_at = 0.0  # (monotonic) when the last answer ended
        self.drafting = "adaptive" if adaptive(args) else "tree " + (args.tree or FIXED_TREE)

    def answer(self, prompt: str) -> bool:
        """Stream one answer; False when Ctrl-C stopped it (what was shown stays in the conversation)."""
        from tandem.core.sampling import Sampling

        args = self.args
        self.history.append({"role": "user", "content": prompt})
        gen = self.client.generate(self.client.prompt_tokens(self.system + self.history),
                                   max_new_tokens=args.max_tokens, stop=args.stop or (),
                                   sampling=Sampling(args.temperature, args.top_k, args.top_p, args.seed, args.min_p))
        with _interruptible() as interrupted:
            for text in gen:
                print(text, end="", flush=True)
                if interrupted:  # at the next token: the generator is ours to close between tokens
                    gen.cancel()
                    break
        self.history.append({"role": "assistant", "content": gen.text})
        print(flush=True)
        stopped = bool(interrupted) and gen.finish_reason is None
        if stopped:
            print("[stopped: Ctrl-C; the answer so far stays in the conversation, /reset forgets it]", flush=True)
        elif gen.finish_reason == "length":
            print(f"[cut at --max-tokens {args.max_tokens}]", flush=True)
        if self.show_stats:
            s = gen.stats
            print(f"-- {s.generated_tokens} tokens (prompt {s.prompt_tokens}), tau {s.tau:.2f}, "
                  f"{s.tokens_per_s:.1f} tokens/s (finish: {gen.finish_reason or 'stopped'}, {s.rounds} verify "
                  f"forwards, {self.drafting})", flush=True)
            if s.policy:
                print(f"-- {explain(s.policy)}", flush=True)
        self.answered_at = time.monotonic()
        return not stopped

    def command(self, line: str) -> None:
        """A line typed at the prompt: /reset, /stats, or a message to answer."""
        if line == "/reset":
            self.history.clear()
            print("conversation cleared", flush=True)
        elif line == "/stats":
            self.show_stats = not self.show_stats
            print(f"statistics {'on' if self.show_stats else 'off'}", flush=True)
        elif line:
            self.answer(line)


def _converse(conversation: _Conversation) -> int:
    """The interactive chat, until /quit, Ctrl-D or Ctrl-C at an empty prompt."""
    _line_editing()
    print(GREETING, flush=True)
    while True:
        try:
            line = _read_line("> ").strip()
        except EOFError:
            print(flush=True)
            return 0
        except _LineDropped:  # Ctrl-C on a line with text: the text goes, as in a shell
            print(flush=True)
            continue
        except KeyboardInterrupt:  # Ctrl-C at an empty prompt ends the chat, as Ctrl-D does, unless it came just
            print(flush=True)     # as an answer ended: then it was meant for the answer
            if time.monotonic() - conversation.answered_at < LATE_CTRL_C_S:
                continue
            return 0
        if line in ("/quit", "/exit", "/bye"):
            return 0
        conversation.command(line)


class _Flag:
    """Truthy once set (Ctrl-C pressed)."""

    def __init__(self):
        self.set = False

    def __bool__(self) -> bool:
        return self.set


class _interruptible:
    """Within it, the first Ctrl-C (SIGINT) only raises the flag it yields: the answer stops at its next token. A
    second one interrupts as usual (KeyboardInterrupt), for a verifier that has stopped sending tokens."""

    def __enter__(self) -> _Flag:
        self.flag = _Flag()

        def on_sigint(signum, frame):
            if self.flag:
                raise KeyboardInterrupt
            self.flag.set = True

        self.previous = signal.signal(signal.SIGINT, on_sigint) if _main_thread() else None
        return self.flag

    def __exit__(self, *exc) -> None:
        if self.previous is not None:
            signal.signal(signal.SIGINT, self.previous)


def _main_thread() -> bool:
    import threading
    return threading.current_thread() is threading.main_thread()


class _LineDropped(Exception):
    """Ctrl-C was pressed on a line with text typed."""


def _read_line(prompt: str) -> str:
    """``input(prompt)``; Ctrl-C raises ``_LineDropped`` when text was typed on the line (the terminal's line editor
    knows it), else KeyboardInterrupt."""
    typed = [""]

    def on_sigint(signum, frame):
        typed[0] = _line_buffer()  # read while the line editor still holds the line
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGINT, on_sigint) if _main_thread() else None
    try:
        return input(prompt)
    except KeyboardInterrupt:
        if typed[0].strip():
            raise _LineDropped from None
        raise
    finally:
        if previous is not None:
            signal.signal(signal.SIGINT, previous)


MODES = {"plain": "cloud-only decoding", "rounds": "lock-step drafting", "draft": "streamed drafting",
         "host": "drafted on the verifier's host"}


def explain(policy: dict, hysteresis: float = PolicyConfig.hysteresis) -> str:
    """Why the draft policy chose what it chose, in one line (a generation's ``stats.policy``), and how to draft
    regardless. A mode predicted faster but not chosen lost to the incumbent's margin: said so."""
    rates = policy.get("predicted_tokens_per_s") or {}
    mode, name = policy.get("mode", ""), lambda m: MODES.get(m, m)
    chosen = rates.get(mode)
    others = ", ".join(f"{name(m)} {r:g}" for m, r in rates.items() if m != mode)
    line = f"policy: {name(mode)}" + (f" (tree {policy['shape']})" if policy.get("shape") else "")
    if chosen is not None:
        line += f", predicted {chosen:g} tokens/s" + (f" against {others}" if others else "")
    faster = [m for m, r in rates.items() if chosen is not None and r > chosen]
    if faster:
        line += f" (kept: another mode takes over only when {hysteresis:.0%} faster)"
    line += f"; round trip {policy.get('rtt_ms', 0):g} ms"
    return line + (f". To draft regardless: tandem chat --tree {FIXED_TREE}" if mode == "plain" else "")


def _line_buffer() -> str:
    """The text typed so far on the terminal's current line (line editing on), else empty."""
    readline = sys.modules.get("readline")
    return readline.get_line_buffer() if readline is not None else ""


def _line_editing() -> None:
    """Arrow keys and history at the prompt, where the terminal has them."""
    if sys.stdin.isatty():
        try:
            import readline  # noqa: F401  (input() uses it once imported)
        except ImportError:
            pass


def _unreachable(address: str, e) -> str:
    """What a failed gRPC call to ``address`` means for a user: an HTTP/1 server there (the REST gateway's port,
    most often) is named as such instead of gRPC's parsing error."""
    if "HTTP/2" in e.details or "http1" in e.details.lower():
        return (f"{address} is an HTTP server (the REST gateway?), not the verifier: tandem chat speaks gRPC to the "
                f"verifier; give its address with --verifier HOST:PORT (tandem serve's --grpc-port, 50051 by default)")
    return f"cannot reach the verifier at {address} ({e.code.name}: {e.details})"


def unescape(text: str) -> str:
    """A stop string as typed on a command line: backslash escapes as in Python strings (\\n, \\t, \\r, \\\\,
    \\xHH, \\uXXXX), so ``--stop "\\n\\n"`` stops at a blank line; any other backslash stays as it is."""
    simple = {"n": "\n", "t": "\t", "r": "\r", "\\": "\\", '"': '"', "'": "'"}

    def one(m: re.Match) -> str:
        e = m.group(1)
        if e[0] in "xu":
            return chr(int(e[1:], 16))
        return simple.get(e, m.group(0))

    return re.sub(r"\\(x[0-9a-fA-F]{2}|u[0-9a-fA-F]{4}|.)", one, text, flags=re.S)
