// The minimal client of docs/protocol.md: lock-step chains. Each round drafts a chain below the committed tokens,
// sends it, and commits what the verdict says (the accepted nodes, then the target's own next token), checking
// the verifier's committed length and rolling hash against its own. Whatever the drafter proposes, the committed
// tokens are the target's: a poor drafter costs rounds, never correctness.
import type { Transport } from "./transport.js";
import { decodeResponse, encodeRequest, rollingHash, type SessionResponse } from "./wire.js";

export interface Drafter {
  /** Up to ``depth`` tokens expected after ``committed`` (the prompt and the output so far, in target ids). */
  draft(committed: readonly number[], depth: number): Promise<number[]> | number[];
}

export interface Sampling {
  temperature?: number;
  topK?: number;
  topP?: number;
  minP?: number;
  seed?: number;
}

export interface GenerateOptions {
  maxNewTokens: number;
  vocabSize: number; // the drafter's ids and their fingerprint (docs/protocol.md, "Before a session")
  vocabFingerprint: string;
  depth?: number; // the chain drafted each round (default 4)
  sampling?: Sampling;
  stop?: string[]; // end the answer before the first of these (needs ``decode``)
  decode?: (tokens: number[]) => string; // the target's tokens as text
  cacheSalt?: string;
}

export interface Chunk {
  tokens: number[]; // committed by one verify forward
  text: string; // the text they add (held back while it could be the start of a stop string)
}

export interface Stats {
  tokens: number;
  verifyForwards: number;
  draftedTokens: number;
  acceptedTokens: number;
  finishReason: "stop" | "length";
}

export class ProtocolError extends Error {}

const NOT_FINISHED = "FINISH_REASON_UNSPECIFIED";

export async function* generate(
  transport: Transport, drafter: Drafter, prompt: readonly number[], options: GenerateOptions,
): AsyncGenerator<Chunk, Stats> {
  const depth = options.depth ?? 4;
  const receive = async (): Promise<SessionResponse> => decodeResponse(await transport.receive());
  transport.send(encodeRequest({ open: {
    promptTokens: prompt, vocabSize: options.vocabSize, vocabFingerprint: options.vocabFingerprint,
    sampling: options.sampling ?? {}, cacheSalt: options.cacheSalt ?? "", decodeSteps: 0,
    limits: { maxNewTokens: options.maxNewTokens, maxTreeNodes: depth, maxTreeDepth: depth },
  } }));
  const opened = (await receive()).opened;
  if (!opened) throw new ProtocolError("the verifier's first answer was not Opened");
  const chainLength = Math.max(0, Math.min(depth, opened.limits.maxTreeDepth, opened.limits.maxTreeNodes));
  const committed = [...prompt];
  const text = new TextStops(options.stop ?? [], options.decode);
  const stats: Stats = { tokens: 0, verifyForwards: 0, draftedTokens: 0, acceptedTokens: 0, finishReason: "length" };
  let hash = rollingHash(prompt);
  for (let seq = 1; ; seq++) {
    const chain = (await drafter.draft(committed, chainLength)).slice(0, chainLength);
    transport.send(encodeRequest({ draft: { sessionId: opened.sessionId, committedLen: committed.length, seq,
                                            tree: { tokens: chain, parents: chain.map((_, i) => i - 1) } } }));
    const verdict = (await receive()).verdict;
    if (!verdict || verdict.draftSeq !== seq) throw new ProtocolError(`no verdict on draft ${seq}`);
    if (verdict.accepted.some((node, i) => node !== i)) {
      throw new ProtocolError(`verdict on draft ${seq} accepts nodes ${verdict.accepted}: not a prefix of the chain`);
    }
    const fresh = verdict.accepted.map((node) => chain[node]);
    if (verdict.bonusToken >= 0) fresh.push(verdict.bonusToken);
    committed.push(...fresh);
    hash = rollingHash(fresh, hash);
    if (verdict.committedLen !== committed.length || (verdict.committedHash !== "0" && BigInt(verdict.committedHash) !== hash)) {
      throw new ProtocolError(`after draft ${seq} the verifier holds ${verdict.committedLen} committed tokens, this ` +
                              `client ${committed.length} (or another history): the session cannot go on`);
    }
    Object.assign(stats, { tokens: stats.tokens + fresh.length, verifyForwards: stats.verifyForwards + 1,
                           draftedTokens: stats.draftedTokens + chain.length,
                           acceptedTokens: stats.acceptedTokens + verdict.accepted.length });
    const { delta, stopped } = text.add(fresh);
    yield { tokens: fresh, text: delta };
    if (stopped || verdict.finishReason !== NOT_FINISHED) {
      stats.finishReason = stopped || verdict.finishReason === "FINISH_REASON_STOP" ? "stop" : "length";
      break;
    }
  }
  const rest = text.flush();
  if (rest) yield { tokens: [], text: rest };
  transport.send(encodeRequest({ close: { sessionId: opened.sessionId } }));
  if (!(await receive()).closed) throw new ProtocolError("the verifier's answer to Close was not Closed");
  return stats;
}

/** The answer's text as tokens arrive, cut before the first stop string; text that could still be the start of
 * one is held back until it cannot. */
class TextStops {
  private tokens: number[] = [];
  private emitted = 0;
  private stopped = false;
  private readonly hold: number;

  constructor(private readonly stops: string[], private readonly decode?: (tokens: number[]) => string) {
    if (stops.length && !decode) throw new TypeError("stop strings need a decode function");
    this.hold = Math.max(0, ...stops.map((s) => s.length - 1));
  }

  add(tokens: number[]): { delta: string; stopped: boolean } {
    if (!this.decode) return { delta: "", stopped: false };
    this.tokens.push(...tokens);
    const full = this.decode(this.tokens);
    const from = Math.max(0, this.emitted - this.hold);
    const hits = this.stops.map((s) => full.indexOf(s, from)).filter((i) => i >= 0);
    if (hits.length) {
      this.stopped = true;
      return { delta: this.take(full, Math.min(...hits)), stopped: true };
    }
    return { delta: this.take(full, full.length - this.hold), stopped: false };
  }

  flush(): string {
    return this.decode && this.stops.length && !this.stopped ? this.take(this.decode(this.tokens), Infinity) : "";
  }

  private take(full: string, end: number): string {
    const delta = full.slice(this.emitted, Math.max(this.emitted, Math.min(end, full.length)));
    this.emitted += delta.length;
    return delta;
  }
}
