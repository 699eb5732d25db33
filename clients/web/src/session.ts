// The client of docs/protocol.md, in its two modes. Lock-step: each round drafts a chain (or a tree) below the
// committed tokens, sends it and waits for its verdict. Streamed (``decodeSteps`` > 0): the verifier decodes alone
// while a draft is made and flies, and walks it along what it committed meanwhile (rebasing) before verifying the
// rest. Host-drafted (``hostDraft``): a streamed session whose verifier's host drafts the run it decodes alone (no
// drafter here: a browser tab without one, or a slow one), each verdict committing the host's accepted tokens.
// Either way the client commits what each verdict says (accepted nodes, then the target's own next token) and checks
// the verifier's committed length and rolling hash against its own: whatever the drafter proposes, the committed
// tokens are the target's; a poor drafter costs forwards, never correctness.
import { SessionEnded, type Transport } from "./transport.js";
import type { RoundSeen } from "./policy.js";
import { decodeResponse, encodeRequest, rollingHash, type SessionResponse, type Verdict } from "./wire.js";

export interface Drafter {
  /** Up to ``depth`` tokens expected after ``committed`` (the prompt and the output so far, in target ids). */
  draft(committed: readonly number[], depth: number): Promise<number[]> | number[];
  /** A tree of ``shape`` below ``committed`` (optional: a drafter without it drafts chains only). */
  draftTree?(committed: readonly number[], shape: TreeShape): Promise<DraftedTree> | DraftedTree;
  /** Where the last draft's time went, for a depth policy (optional: without it a level costs draft time / depth). */
  readonly lastDraft?: DraftTiming;
}

/** A draft tree's size: ``k`` children per expanded node (and nodes expanded per level), ``n`` nodes, ``d`` levels. */
export interface TreeShape {
  k: number;
  n: number;
  d: number;
}

/** Node i is ``tokens[i]`` below ``parents[i]``, an earlier node or -1 (the root: the last committed token);
 * siblings carry distinct tokens, in the drafter's order of preference (docs/protocol.md, "The minimal client"). */
export interface DraftedTree {
  tokens: number[];
  parents: number[];
}

export interface DraftTiming {
  catchUpMs: number; // evaluating what was committed since the last draft (it gives the first level's token) ...
  evaluated: number; // ... this many tokens (a prompt's prefill: many; a round's: the verdict's new tokens)
  levelsMs: number; // evaluating the chain's further levels ...
  levels: number; // ... this many
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
  depth?: number | DepthPolicy; // the chain drafted each round (default 4), or a policy choosing it (lock-step)
  tree?: TreeShape; // draft trees of this shape instead (the drafter's ``draftTree``)
  decodeSteps?: number; // streamed mode: tokens the verifier may decode alone while a chain flies (0: lock-step)
  hostDraft?: boolean; // the verifier's host drafts every run (streamed, no drafting here; plain decoding where the
  // verifier has no host drafter or no seat free: Opened's hostDrafter says which)
  sampling?: Sampling;
  stop?: string[]; // end the answer before the first of these (needs ``decode``)
  decode?: (tokens: number[]) => string; // the target's tokens as text
  cacheSalt?: string;
  reconnect?: () => Promise<Transport>; // a new stream when the verifier goes away: the answer resumes on it
  maxResumes?: number; // (default 3)
}

/** Chooses each round's chain length from the rounds it has seen (``ChainPolicy``: the closed form). */
export interface DepthPolicy {
  readonly maxDepth: number;
  depth(limit: number): number;
  observe(round: RoundSeen): void;
}

export interface Chunk {
  tokens: number[]; // committed by one verify forward
  text: string; // the text they add (held back while it could be the start of a stop string)
}

export interface Stats {
  tokens: number;
  verifyForwards: number;
  draftedTokens: number; // drafted nodes the verifier checked (those below rebased levels; stale drafts not counted)
  acceptedTokens: number;
  aloneTokens: number; // tokens the verifier decoded alone (streamed mode), its host's drafted tokens not counted
  hostTokens: number; // tokens the verifier's host drafted that the target took (hostDraft)
  hostDrafter: string; // the host drafter that served the last session ("": none)
  rebasedTokens: number; // chain levels matched by tokens decoded alone before the chain arrived
  staleChains: number; // drafts the verifier had decoded past
  resumes: number; // sessions re-opened on the committed history after the verifier went away
  finishReason: "stop" | "length";
}

export class ProtocolError extends Error {}

const NOT_FINISHED = "FINISH_REASON_UNSPECIFIED";
const LONG_RUN = 1 << 20; // "decode alone until the next draft arrives" (the session's length limit ends it first)

interface Flight {
  seq: number;
  base: number; // committed length the draft hangs below
  tree: DraftedTree; // (a chain: each node below the one before)
  draftMs: number;
  sentAt: number;
  timing?: DraftTiming;
}

export async function* generate(
  transport: Transport, drafter: Drafter | null, prompt: readonly number[], options: GenerateOptions,
): AsyncGenerator<Chunk, Stats> {
  if (!drafter && !options.hostDraft) throw new TypeError("no drafter: pass one, or hostDraft for the host's drafts");
  const state: State = {
    committed: [...prompt], hash: rollingHash(prompt), text: new TextStops(options.stop ?? [], options.decode),
    stats: { tokens: 0, verifyForwards: 0, draftedTokens: 0, acceptedTokens: 0, aloneTokens: 0, rebasedTokens: 0,
             staleChains: 0, resumes: 0, finishReason: "length", hostTokens: 0, hostDrafter: "" },
  };
  for (;;) {
    try {
      yield* session(transport, drafter, state, prompt.length, options);
      return state.stats;
    } catch (e) {
      // the verifier (or its gateway) went away: the committed history is the client's, so the answer goes on
      // in a new session on it, nothing lost or repeated (docs/protocol.md, "Limits, errors and resume")
      const gone = e instanceof SessionEnded && (e.grpcCode === UNAVAILABLE || e.code === ABNORMAL);
      if (!gone || !options.reconnect || state.stats.resumes >= (options.maxResumes ?? 3)) throw e;
      state.stats.resumes += 1;
      transport = await options.reconnect();
    }
  }
}

const UNAVAILABLE = 14;
const ABNORMAL = 1006; // the connection dropped without a close frame

interface State {
  committed: number[];
  hash: bigint;
  text: TextStops;
  stats: Stats;
}

/** One verifier session on ``state``'s committed tokens (the prompt, and on a resume what was generated too). */
async function* session(
  transport: Transport, drafter: Drafter | null, state: State, promptLength: number, options: GenerateOptions,
): AsyncGenerator<Chunk, void> {
  const policy = typeof options.depth === "object" ? options.depth : null;
  const depth: number = policy ? policy.maxDepth : (options.depth as number | undefined) ?? 4;
  const host = options.hostDraft ?? false;
  const steps = host ? LONG_RUN : options.decodeSteps ?? 0;
  const tree = options.tree;
  if (host && (policy || tree)) {
    throw new TypeError("hostDraft: the host drafts chains of its own depth (no depth policy, no tree)");
  }
  if (policy && steps > 0) throw new TypeError("a depth policy prices lock-step rounds: decodeSteps must be 0");
  if (tree && policy) throw new TypeError("a depth policy chooses chains: pass a tree shape or a policy, not both");
  if (tree && !drafter?.draftTree) throw new TypeError("this drafter drafts chains only (it has no draftTree)");
  if (tree && ![tree.k, tree.n, tree.d].every((x) => Number.isInteger(x) && x >= 1)) {
    throw new TypeError(`a tree shape needs k, n, d >= 1, got ${JSON.stringify(tree)}`);
  }
  const { committed, text, stats } = state;
  const generated = committed.length - promptLength;
  const receive = async (): Promise<SessionResponse> => decodeResponse(await transport.receive());
  transport.send(encodeRequest({ open: {
    promptTokens: committed, priorOutputTokens: generated, vocabSize: options.vocabSize,
    vocabFingerprint: options.vocabFingerprint, sampling: options.sampling ?? {}, cacheSalt: options.cacheSalt ?? "",
    decodeSteps: steps, limits: { maxNewTokens: options.maxNewTokens - generated, maxTreeNodes: tree?.n ?? depth,
                                  maxTreeDepth: tree?.d ?? depth }, hostDraft: host,
  } }));
  const opened = (await receive()).opened;
  if (!opened) throw new ProtocolError("the verifier's first answer was not Opened");
  stats.hostDrafter = opened.hostDrafter ?? "";
  const chainLength = Math.max(0, Math.min(depth, opened.limits.maxTreeDepth, opened.limits.maxTreeNodes));
  const shape = tree && { k: tree.k, n: Math.min(tree.n, opened.limits.maxTreeNodes),
                          d: Math.min(tree.d, opened.limits.maxTreeDepth) }; // (the verifier may grant less)
  let flight: Flight | null = null;
  let seq = 0;
  let alone = steps > 0; // streamed: the first token of a session comes alone
  for (;;) {
    if (flight === null && !alone && drafter) {
      const t0 = performance.now();
      let drafted: DraftedTree;
      if (shape) {
        drafted = await drafter.draftTree!(committed, shape);
      } else {
        const want = policy ? policy.depth(chainLength) : chainLength;
        const chain = (await drafter.draft(committed, want)).slice(0, want);
        drafted = { tokens: chain, parents: chain.map((_, i) => i - 1) };
      }
      const sentAt = performance.now();
      flight = { seq: ++seq, base: committed.length, tree: drafted, draftMs: sentAt - t0, sentAt,
                 timing: drafter.lastDraft };
      transport.send(encodeRequest({ draft: { sessionId: opened.sessionId, committedLen: committed.length,
                                              seq, decodeSteps: steps, tree: drafted } }));
    }
    const verdict = (await receive()).verdict;
    if (!verdict) throw new ProtocolError("expected a verdict");
    alone = host; // (a host-drafted session never drafts here: every run is the verifier's)
    if (policy && flight && verdict.draftSeq === flight.seq && !verdict.stale) {
      policy.observe({ depth: flight.tree.tokens.length, accepted: verdict.accepted.length, draftMs: flight.draftMs,
                       timing: flight.timing,
                       roundMs: performance.now() - flight.sentAt, queueMs: Number(verdict.queueUs) / 1000,
                       verifyMs: Number(verdict.verifyUs) / 1000, forwardTokens: verdict.forwardTokens });
    }
    const fresh = commitTokens(verdict, flight, committed, stats);
    if (verdict.draftSeq) flight = null;
    committed.push(...fresh);
    state.hash = rollingHash(fresh, state.hash);
    if (verdict.committedLen !== committed.length ||
        (verdict.committedHash !== "0" && BigInt(verdict.committedHash) !== state.hash)) {
      throw new ProtocolError(`the verifier holds ${verdict.committedLen} committed tokens, this client ` +
                              `${committed.length} (or another history): the session cannot go on`);
    }
    stats.tokens += fresh.length;
    stats.verifyForwards += 1;
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
  while (!(await receive()).closed);  // (verdicts already on their way are dropped)
}

/** The tokens ``verdict`` commits: one decoded alone, or the accepted nodes (a path of the tree) below the levels
 * the verifier had already committed (``rebased``: the path from the root along them) and then the target's own next
 * token. */
function commitTokens(verdict: Verdict, flight: Flight | null, committed: number[], stats: Stats): number[] {
  const bonus = verdict.bonusToken >= 0 ? [verdict.bonusToken] : [];
  if (!verdict.draftSeq) { // decoded alone, below the host's chain where its host drafted one
    const hosted = verdict.hostTokens ?? [];
    stats.aloneTokens += bonus.length;
    stats.hostTokens += hosted.length;
    return [...hosted, ...bonus];
  }
  if (!flight || verdict.draftSeq !== flight.seq) {
    throw new ProtocolError(`a verdict on draft ${verdict.draftSeq}, which is not in flight`);
  }
  if (verdict.stale) {
    stats.staleChains += 1;
    return bonus;
  }
  const { tokens, parents } = flight.tree;
  const since = committed.slice(flight.base);
  if (since.length !== verdict.rebased) {
    throw new ProtocolError(`verdict on draft ${flight.seq} says it was rebased by ${verdict.rebased} tokens; this ` +
                            `client committed ${since.length} since its base`);
  }
  let at = -1; // the root, then the node the tokens committed since the base reach
  for (const t of since) {
    at = tokens.findIndex((token, i) => parents[i] === at && token === t);
    if (at < 0) {
      throw new ProtocolError(`verdict on draft ${flight.seq} is rebased along ${since}: not a path of the draft`);
    }
  }
  const below = at;
  for (const node of verdict.accepted) {
    if (!(node >= 0 && node < tokens.length && parents[node] === at)) {
      throw new ProtocolError(`verdict on draft ${flight.seq} accepts nodes ${verdict.accepted}: not a path of ` +
                              `the draft below its rebased levels`);
    }
    at = node;
  }
  const under: boolean[] = []; // the nodes below the rebased ones: what the verifier checked
  parents.forEach((p, i) => { under[i] = p === below || (p >= 0 && under[p]); });
  stats.rebasedTokens += verdict.rebased;
  stats.draftedTokens += under.filter(Boolean).length;
  stats.acceptedTokens += verdict.accepted.length;
  return [...verdict.accepted.map((node) => tokens[node]), ...bonus];
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
