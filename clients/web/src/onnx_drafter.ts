// A drafter on ONNX Runtime: the self-contained export (`tandem drafter export --self-contained`: model.onnx, token
// ids in, logits out for the rows asked, the KV cache as inputs and outputs; meta.json beside it) run by
// onnxruntime-web (WASM, in a browser or Node) or onnxruntime-node, whichever module the caller passes.
//
// It drafts greedy chains: the first choice at each level, fed back. Between calls it keeps the KV cache of what it
// has evaluated (the committed tokens and its own last chain) and, on the next call, keeps the longest prefix the new
// committed tokens share with it and evaluates only the rest: a verdict that accepted part of the chain costs the
// drafter the bonus token and nothing more. The cache is [layers, kv_heads, positions, head_dim] floats, rebuilt
// on each step (the graph takes it contiguous); what it costs is counted in ``stats``.
import type { Drafter, DraftTiming } from "./session.js";

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
    let keep = 0;
    while (keep < this.cached.length && keep < committed.length && this.cached[keep] === committed[keep]) keep++;
    keep = Math.min(keep, committed.length - 1); // the last committed token is evaluated for its logits
    this.truncate(keep);
    let logits: Float32Array = new Float32Array(0);
    for (let at = keep; at < committed.length; at += this.prefillChunk) {
      const chunk = committed.slice(at, Math.min(at + this.prefillChunk, committed.length));
      logits = await this.step(chunk, at + chunk.length === committed.length);
    }
    this.stats.evaluated += committed.length - keep;
    const t1 = performance.now();
    const chain: number[] = [];
    for (;;) {
      const next = argmax(logits);
      chain.push(next);
      if (chain.length === depth || this.meta.eos?.includes(next)) break;
      logits = await this.step([next], true);
    }
    const t2 = performance.now();
    this.stats.drafted += chain.length;
    this.stats.chainMs += t2 - t1;
    this.stats.draftMs += t2 - t0;
    this.lastDraft = { catchUpMs: t1 - t0, evaluated: committed.length - keep, levelsMs: t2 - t1,
                       levels: chain.length - 1 };
    return chain;
  }

  async release(): Promise<void> {
    await this.session.release?.();
  }

  /** Evaluates ``tokens`` after the cached ones; the last one's logits when ``wantLogits``. */
  private async step(tokens: number[], wantLogits: boolean): Promise<Float32Array> {
    const { layers, kv_heads: heads, head_dim: dim } = this.meta;
    const past = this.cached.length;
    const n = tokens.length;
    const mask = new Float32Array(n * (past + n));
    for (let i = 0; i < n; i++) mask.fill(MASKED, i * (past + n) + past + i + 1, (i + 1) * (past + n));
    const ids = (xs: number[]) => new this.ort.Tensor("int64", BigInt64Array.from(xs, BigInt), [xs.length]);
    const out = await this.session.run({
      input_ids: ids(tokens),
      positions: ids(tokens.map((_, i) => past + i)),
      mask: new this.ort.Tensor("float32", mask, [n, past + n]),
      past_k: new this.ort.Tensor("float32", this.keys, [layers, heads, past, dim]),
      past_v: new this.ort.Tensor("float32", this.values, [layers, heads, past, dim]),
      logit_rows: ids(wantLogits ? [n - 1] : []),
    });
    this.stats.forwards += 1;
    this.keys = splice(this.keys, out.new_k.data as Float32Array, layers * heads, past, n, dim);
    this.values = splice(this.values, out.new_v.data as Float32Array, layers * heads, past, n, dim);
    this.cached.push(...tokens);
    return out.logits.data as Float32Array;
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

function argmax(xs: Float32Array): number {
  let best = 0;
  for (let i = 1; i < xs.length; i++) if (xs[i] > xs[best]) best = i;
  return best;
}
