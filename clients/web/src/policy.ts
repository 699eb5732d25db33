// How deep a chain to draft each round, in closed form (the lock-step case of edge/policy/closed_form.py):
//
//   a chain of D levels commits E(D) = 1 + sum_{d<=D} prod_{i<=d} alpha_i tokens in one round that takes
//   catch-up + (D - 1) * level + RTT + t_v(1 + D) ms,
//
// alpha_d being the chance the drafter's choice at depth d is the target's token, the path above it held; catch-up
// the drafter's time to evaluate what the last verdict committed (its logits give the first level's token); level
// its ms per further level; RTT the link's round trip; t_v(n) the verifier's time for a forward of n tokens.
// The depth with the best E(D) / time is drafted. Every input is measured on this client's own rounds: acceptance
// on this answer's chains (each depth's count shrunk towards the answer's pooled rate, that towards a prior), the
// verdicts' own queue and forward times, the drafter's timing (``Drafter.lastDraft``). Pure: no clock, no I/O; the round loop feeds it.

import type { DraftTiming } from "./session.js";

/** E(D): tokens one round commits with a chain of ``depth`` (the target's own next token included). */
export function expectedTokens(alpha: readonly number[], depth: number): number {
  let total = 1;
  let reach = 1;
  for (let d = 1; d <= depth; d++) {
    reach *= alpha[Math.min(d, alpha.length) - 1];
    total += reach;
  }
  return total;
}

export interface Physics {
  catchUpMs: number; // the drafter's ms before its first level's token
  levelMs: number; // its ms per further level
  rttMs: number;
  verifyMs: (tokens: number) => number; // t_v(n)
}

/** Committed tokens per second with chains of ``depth`` in lock-step rounds. */
export function chainRate(p: Physics, alpha: readonly number[], depth: number): number {
  return (1000 * expectedTokens(alpha, depth)) /
    (p.catchUpMs + (depth - 1) * p.levelMs + p.rttMs + p.verifyMs(1 + depth));
}

/** The depth in 1..``maxDepth`` with the best rate (the shallower of equals). */
export function bestDepth(p: Physics, alpha: readonly number[], maxDepth: number): number {
  let best = 1;
  for (let d = 2; d <= maxDepth; d++) if (chainRate(p, alpha, d) > chainRate(p, alpha, best) * (1 + 1e-9)) best = d;
  return best;
}

/** One lock-step round as the client saw it. */
export interface RoundSeen {
  depth: number; // chain levels sent
  accepted: number; // of them the verifier accepted
  draftMs: number; // the drafter's time for the chain ...
  timing?: DraftTiming; // ... and where it went, when the drafter says
  roundMs: number; // send to verdict
  queueMs: number; // the verdict's own figures: waiting for the forward ...
  verifyMs: number; // ... and the forward
  forwardTokens: number;
}

export interface PolicyOptions {
  maxDepth?: number; // (default 8)
  alphaPrior?: number; // acceptance assumed before a chain was scored (default 0.7)
  shrink?: number; // pseudo-tries of the pooled rate behind each depth's count (default 2)
  memory?: number; // weight of earlier chains against the next one (default 0.9)
  ewma?: number; // weight of a new time measurement (default 0.2)
}

export class ChainPolicy {
  readonly maxDepth: number;
  private readonly prior: number;
  private readonly shrink: number;
  private readonly memory: number;
  private readonly ewma: number;
  private tries: number[] = [];
  private hits: number[] = [];
  private levelMs: number | null = null;
  private catchUpMs: number | null = null;
  private rttMs = 20;
  private readonly forwardMs = new Map<number, number>(); // forward size -> its running mean

  constructor(options: PolicyOptions = {}) {
    this.maxDepth = options.maxDepth ?? 8;
    this.prior = options.alphaPrior ?? 0.7;
    this.shrink = options.shrink ?? 2;
    this.memory = options.memory ?? 0.9;
    this.ewma = options.ewma ?? 0.2;
  }

  /** The depth to draft next (at most ``limit``, what the session allows). */
  depth(limit = Infinity): number {
    return bestDepth(this.physics(), this.alpha(), Math.max(1, Math.min(this.maxDepth, limit)));
  }

  observe(r: RoundSeen): void {
    this.tries = this.tries.map((t) => t * this.memory);
    this.hits = this.hits.map((h) => h * this.memory);
    for (let d = 0; d < Math.min(r.depth, r.accepted + 1); d++) { // level d + 1 was tried iff the chain held to d
      while (this.tries.length <= d) { this.tries.push(0); this.hits.push(0); }
      this.tries[d] += 1;
      this.hits[d] += r.accepted > d ? 1 : 0;
    }
    const moved = (old: number | null | undefined, x: number) => (old == null ? x : old + this.ewma * (x - old));
    if (r.timing) {
      // a round's catch-up evaluates what its verdict committed past the chain: one or two tokens (a prompt's
      // prefill, or a resume's, is not what the next round will pay)
      if (r.timing.evaluated <= 2) this.catchUpMs = moved(this.catchUpMs, r.timing.catchUpMs);
      if (r.timing.levels > 0) this.levelMs = moved(this.levelMs, r.timing.levelsMs / r.timing.levels);
    } else if (r.depth > 0 && r.draftMs > 0) {
      this.levelMs = moved(this.levelMs, r.draftMs / r.depth); // (a drafter that does not say: all of it per level)
    }
    this.rttMs = moved(this.rttMs, Math.max(0, r.roundMs - r.queueMs - r.verifyMs));
    this.forwardMs.set(r.forwardTokens, moved(this.forwardMs.get(r.forwardTokens), r.verifyMs));
  }

  /** Acceptance at depths 1..maxDepth: each depth's count shrunk towards the pooled rate, that towards the prior. */
  alpha(): number[] {
    const sum = (xs: number[]) => xs.reduce((a, b) => a + b, 0);
    const pool = (sum(this.hits) + this.shrink * this.prior) / (sum(this.tries) + this.shrink);
    return Array.from({ length: this.maxDepth }, (_, d) =>
      ((this.hits[d] ?? 0) + this.shrink * pool) / ((this.tries[d] ?? 0) + this.shrink));
  }

  physics(): Physics {
    return { catchUpMs: this.catchUpMs ?? 0, levelMs: this.levelMs ?? 15, rttMs: this.rttMs,
             verifyMs: (n) => this.verifyMs(n) };
  }

  /** t_v(n): the measured mean at n; else, with two sizes or more measured, the least-squares line through them
   * (slope >= 0); with one, the prior's shape (25 ms + 8 ms a token) scaled to it; the prior before any. Past the
   * sizes measured this is a guess that errs towards trying a deeper chain once: that round measures the size. */
  private verifyMs(n: number): number {
    const at = this.forwardMs.get(n);
    if (at !== undefined) return at;
    const prior = (x: number) => 25 + 8 * x;
    const pts = [...this.forwardMs.entries()];
    if (pts.length === 0) return prior(n);
    if (pts.length === 1) return (pts[0][1] * prior(n)) / prior(pts[0][0]);
    const mx = pts.reduce((a, [x]) => a + x, 0) / pts.length;
    const my = pts.reduce((a, [, y]) => a + y, 0) / pts.length;
    const sxx = pts.reduce((a, [x]) => a + (x - mx) ** 2, 0);
    const slope = Math.max(0, pts.reduce((a, [x, y]) => a + (x - mx) * (y - my), 0) / sxx);
    return Math.max(1e-3, my + slope * (n - mx));
  }
}
