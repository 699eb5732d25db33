// A drafter on ONNX Runtime: the self-contained export (`tandem drafter export --self-contained`: model.onnx, token
// ids in, logits out for the rows asked, the KV cache as inputs and outputs; meta.json beside it) run by
// onnxruntime-web (WASM, in a browser or Node) or onnxruntime-node, whichever module the caller passes.
//
// It drafts greedy chains (the first choice at each level, fed back) or trees (edge/drafting.py's build_tree: the
// likeliest paths by the drafter's probabilities, each level's frontier evaluated in one run under a tree mask).
// Between calls it keeps the KV cache of what it has evaluated (the committed tokens and its own last chain) and, on
// the next call, keeps the longest prefix the new committed tokens share with it and evaluates only the rest: a
// verdict that accepted part of the chain costs the drafter the bonus token and nothing more (a tree's nodes are
// dropped after it is drafted: the next call evaluates the accepted path with the bonus, in one run). The cache is
// [layers, kv_heads, positions, head_dim] floats, rebuilt on each step (the graph takes it contiguous); what it
// costs is counted in ``stats``.
import type { DraftedTree, Drafter, DraftTiming, TreeShape } from "./session.js";

/** What this drafter needs of an ONNX Runtime module (onnxruntime-web's and onnxruntime-node's shape). */
export interface OrtModule {
  InferenceSession: { create(model: Uint8Array | string, options?: object): Promise<OrtSession> };
  Tensor: new (type: "int64" | "float32", data: BigInt64Array | Float32Array, dims: readonly number[]) => OrtTensor;
}

export interface OrtTensor {
  readonly data: unknown;
  readonly dims: readonly number[];
}

interface OrtSession {
  readonly inputNames: readonly string[];
  run(feeds: Record<string, OrtTensor>): Promise<Record<string, OrtTensor>>;
  release?(): Promise<void>;
}

/** The export's meta.json (the fields this drafter reads). */
export interface DrafterMeta {
  layers: number;
  kv_heads: number;
  head_dim: number;
  vocab_size: number;
  eos?: number[];
  self_contained?: boolean;
}

export interface DrafterStats {
  forwards: number; // model runs
  drafted: number; // chain tokens proposed
  evaluated: number; // committed tokens evaluated (prompt prefill and catch-up)
  draftMs: number; // time in draft(), all of it: per drafted token, the figure that compares with other drafters
  chainMs: number; // of which the chain's levels past the first (whose token the catch-up's logits give)
}

const MASKED = -1e9;

export class OnnxDrafter implements Drafter {
  readonly stats: DrafterStats = { forwards: 0, drafted: 0, evaluated: 0, draftMs: 0, chainMs: 0 };
  lastDraft?: DraftTiming;
  private cached: number[] = []; // the tokens whose keys and values the cache holds, in order
  private keys: Float32Array;
  private values: Float32Array;

  private constructor(
    private readonly ort: OrtModule, private readonly session: OrtSession, readonly meta: DrafterMeta,
    private readonly prefillChunk: number,
  ) {
    this.keys = this.values = new Float32Array(0);
  }

  /** ``model``: model.onnx's bytes (or, in Node, its path); ``meta``: meta.json's contents. */
  static async load(ort: OrtModule, model: Uint8Array | string, meta: DrafterMeta,
                    options: { prefillChunk?: number; sessionOptions?: object } = {}): Promise<OnnxDrafter> {
    for (const key of ["layers", "kv_heads", "head_dim", "vocab_size"] as const) {
      if (!Number.isInteger(meta[key]) || meta[key] <= 0) throw new TypeError(`meta.json: ${key} is ${meta[key]}`);
    }
    const session = await ort.InferenceSession.create(model, options.sessionOptions ?? {});
    if (!session.inputNames.includes("logit_rows") || !session.inputNames.includes("input_ids")) {
      throw new TypeError("not a self-contained drafter export (`tandem drafter export --self-contained`): " +
                          `its inputs are ${session.inputNames.join(", ")}`);
    }
    return new OnnxDrafter(ort, session, meta, Math.max(1, options.prefillChunk ?? 64));
  }

  async draft(committed: readonly number[], depth: number): Promise<number[]> {
    if (depth <= 0 || committed.length === 0) return [];
    const t0 = performance.now();
    const { logits: root, evaluated } = await this.catchUp(committed);
    let logits = root;
    const t1 = performance.now();
    const chain: number[] = [];
    for (;;) {
      const next = argmax(logits);
      chain.push(next);
      if (chain.length === depth || this.meta.eos?.includes(next)) break;
      logits = (await this.step([next], 0, true))[0];
    }
    const t2 = performance.now();
    this.stats.drafted += chain.length;
    this.stats.chainMs += t2 - t1;
    this.stats.draftMs += t2 - t0;
    this.lastDraft = { catchUpMs: t1 - t0, evaluated, levelsMs: t2 - t1, levels: chain.length - 1 };
    return chain;
  }

  /** A tree of ``shape`` below ``committed``, as edge/drafting.py's build_tree makes it: the root's k likeliest
   * children, then per level the children of at most k frontier nodes (the likeliest paths, among the n best so
   * far), kept to the n likeliest nodes; ranked by path log-probability, then depth, then order of making. */
  async draftTree(committed: readonly number[], shape: TreeShape): Promise<DraftedTree> {
    if (shape.d <= 0 || shape.n <= 0 || shape.k <= 0 || committed.length === 0) return { tokens: [], parents: [] };
    const t0 = performance.now();
    const { logits: root, evaluated } = await this.catchUp(committed);
    const t1 = performance.now();
    const nodes: TreeNode[] = [];
    const add = (logits: Float32Array, parent: number): number[] => topK(logits, shape.k).map(([token, logp]) => {
      const up = parent < 0 ? { logp: 0, depth: 0 } : nodes[parent];
      return nodes.push({ token, parent, logp: up.logp + logp, depth: up.depth + 1, slot: -1 }) - 1;
    });
    const rank = (a: number, b: number) => nodes[b].logp - nodes[a].logp || nodes[a].depth - nodes[b].depth || a - b;
    const best = () => nodes.map((_, i) => i).sort(rank).slice(0, shape.n);
    let frontier = add(root, -1);
    let levels = 0;
    try {
      for (let level = 1; level < shape.d && frontier.length; level++) {
        const bestN = new Set(best()); // a frontier node outside the n best can only have children ranked below it
        const expand = [...frontier].sort(rank).slice(0, shape.k).filter((i) => bestN.has(i));
        if (!expand.length) break;
        const rows = await this.stepTree(expand, nodes, committed.length);
        levels += 1;
        frontier = expand.flatMap((i, r) => add(rows[r], i));
      }
    } finally {
      // the tree's keys and values (not a sequence the next call could share a prefix with): it catches up on
      // what was committed
      this.truncate(committed.length);
    }
    const keep = best().sort((a, b) => a - b); // the order of making is topological
    const index = new Map(keep.map((c, j) => [c, j]));
    const t2 = performance.now();
    this.stats.drafted += keep.length;
    this.stats.chainMs += t2 - t1;
    this.stats.draftMs += t2 - t0;
    this.lastDraft = { catchUpMs: t1 - t0, evaluated, levelsMs: t2 - t1, levels };
    return { tokens: keep.map((c) => nodes[c].token),
             parents: keep.map((c) => nodes[c].parent < 0 ? -1 : index.get(nodes[c].parent)!) };
  }

  async release(): Promise<void> {
    await this.session.release?.();
  }

  /** Evaluates what ``committed`` adds to the longest prefix the cache shares with it (at least its last token):
   * the last token's logits, and how many tokens that took. */
  private async catchUp(committed: readonly number[]): Promise<{ logits: Float32Array; evaluated: number }> {
    let keep = 0;
    while (keep < this.cached.length && keep < committed.length && this.cached[keep] === committed[keep]) keep++;
    keep = Math.min(keep, committed.length - 1); // the last committed token is evaluated for its logits
    this.truncate(keep);
    let logits: Float32Array = new Float32Array(0);
    for (let at = keep; at < committed.length; at += this.prefillChunk) {
      const chunk = committed.slice(at, Math.min(at + this.prefillChunk, committed.length));
      logits = (await this.step(chunk, chunk.length - 1, at + chunk.length === committed.length))[0];
    }
    this.stats.evaluated += committed.length - keep;
    return { logits, evaluated: committed.length - keep };
  }

  /** Evaluates the tree nodes ``expand`` (their ancestors evaluated before them, in the cache past ``base``, the
   * committed length): each attends to the committed tokens, its ancestors and itself. Their logits, in order. */
  private async stepTree(expand: number[], nodes: TreeNode[], base: number): Promise<Float32Array[]> {
    const past = this.cached.length;
    const width = past + expand.length;
    const mask = new Float32Array(expand.length * width).fill(MASKED);
    expand.forEach((i, r) => {
      mask.fill(0, r * width, r * width + base);
      for (let a = nodes[i].parent; a >= 0; a = nodes[a].parent) mask[r * width + base + nodes[a].slot] = 0;
      mask[r * width + past + r] = 0;
      nodes[i].slot = past - base + r;
    });
    return this.step(expand.map((i) => nodes[i].token), -1, true, mask, expand.map((i) => base + nodes[i].depth - 1));
  }

  /** Evaluates ``tokens`` after the cached ones (causally, unless ``mask`` and ``positions`` say otherwise): the
   * logits of the row ``row`` (-1: of every row) when ``wantLogits``. */
  private async step(tokens: number[], row: number, wantLogits: boolean, mask?: Float32Array,
                     positions?: number[]): Promise<Float32Array[]> {
    const { layers, kv_heads: heads, head_dim: dim, vocab_size: vocab } = this.meta;
    const past = this.cached.length;
    const n = tokens.length;
    if (!mask) {
      mask = new Float32Array(n * (past + n));
      for (let i = 0; i < n; i++) mask.fill(MASKED, i * (past + n) + past + i + 1, (i + 1) * (past + n));
    }
    const rows = !wantLogits ? [] : row >= 0 ? [row] : tokens.map((_, i) => i);
    const ids = (xs: number[]) => new this.ort.Tensor("int64", BigInt64Array.from(xs, BigInt), [xs.length]);
    const out = await this.session.run({
      input_ids: ids(tokens),
      positions: ids(positions ?? tokens.map((_, i) => past + i)),
      mask: new this.ort.Tensor("float32", mask, [n, past + n]),
      past_k: new this.ort.Tensor("float32", this.keys, [layers, heads, past, dim]),
      past_v: new this.ort.Tensor("float32", this.values, [layers, heads, past, dim]),
      logit_rows: ids(rows),
    });
    this.stats.forwards += 1;
    this.keys = splice(this.keys, out.new_k.data as Float32Array, layers * heads, past, n, dim);
    this.values = splice(this.values, out.new_v.data as Float32Array, layers * heads, past, n, dim);
    this.cached.push(...tokens);
    const logits = out.logits.data as Float32Array;
    return rows.map((_, r) => logits.subarray(r * vocab, (r + 1) * vocab));
  }

  private truncate(length: number): void {
    if (length >= this.cached.length) return;
    const { layers, kv_heads: heads, head_dim: dim } = this.meta;
    this.keys = splice(this.keys, new Float32Array(0), layers * heads, length, 0, dim, this.cached.length);
    this.values = splice(this.values, new Float32Array(0), layers * heads, length, 0, dim, this.cached.length);
    this.cached.length = length;
  }
}

/** [rows, had, dim] (its first ``keep`` positions of each row) then [rows, added, dim] per row: a new
 * [rows, keep + added, dim]. */
function splice(old: Float32Array, add: Float32Array, rows: number, keep: number, added: number, dim: number,
                had = keep): Float32Array {
  const out = new Float32Array(rows * (keep + added) * dim);
  for (let r = 0; r < rows; r++) {
    out.set(old.subarray(r * had * dim, (r * had + keep) * dim), r * (keep + added) * dim);
    out.set(add.subarray(r * added * dim, (r + 1) * added * dim), (r * (keep + added) + keep) * dim);
  }
  return out;
}

interface TreeNode {
  token: number;
  parent: number; // an earlier node, or -1 (the root: the last committed token)
  logp: number; // log-probability of the path from the root, under the drafter
  depth: number;
  slot: number; // where its keys and values sit in the cache past the committed tokens (-1: not evaluated)
}

/** The ``k`` likeliest tokens and their log-probabilities, likeliest first (ties: the lower id first). */
function topK(logits: Float32Array, k: number): [number, number][] {
  const top: number[] = [];
  let max = -Infinity;
  for (let i = 0; i < logits.length; i++) {
    max = Math.max(max, logits[i]);
    if (top.length === k && !(logits[i] > logits[top[k - 1]])) continue;
    let at = top.length; // after the tokens it does not beat (a tie keeps the lower id first)
    while (at > 0 && logits[i] > logits[top[at - 1]]) at--;
    top.splice(at, 0, i);
    if (top.length > k) top.pop();
  }
  let sum = 0;
  for (let i = 0; i < logits.length; i++) sum += Math.exp(logits[i] - max);
  const lse = max + Math.log(sum);
  return top.map((i) => [i, logits[i] - lse]);
}

function argmax(xs: Float32Array): number {
  let best = 0;
  for (let i = 1; i < xs.length; i++) if (xs[i] > xs[best]) best = i;
  return best;
}
