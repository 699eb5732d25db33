// The ONNX drafter on onnxruntime-web (WASM, the browser's runtime, here in Node) and on onnxruntime-node (the native
// runtime, for Node apps) against chains and trees a Python reference computed on the same self-contained export by
// recomputing every sequence from scratch: the drafter's cache reuse (a prompt evaluated in chunks, chains accepted
// in part, whole or not at all, a new prompt sharing a prefix, trees under a tree mask) must give the same greedy
// chains and edge/drafting.py's trees. The fixture (a random-weight model) is written by tests/test_web_client.py; without
// it (npm test alone) this test is skipped.
import assert from "node:assert/strict";
import { existsSync, readFileSync } from "node:fs";
import { test } from "node:test";

import * as ortNode from "onnxruntime-node";
import * as ortWeb from "onnxruntime-web";

import { OnnxDrafter, type DrafterMeta, type OrtModule } from "../src/index.js";

const fixture = process.env.TANDEM_ONNX_DRAFTER_FIXTURE;

interface Call { committed: number[]; depth: number; chain: number[] }
interface TreeCall { committed: number[]; shape: { k: number; n: number; d: number }; tokens: number[]; parents: number[] }

const runtimes: [string, OrtModule, object][] = [
  ["onnxruntime-web", ortWeb as unknown as OrtModule, {}],
  ["onnxruntime-node", ortNode as unknown as OrtModule, { intraOpNumThreads: 1 }],
];
ortWeb.env.wasm.numThreads = 1;

for (const [name, ort, sessionOptions] of runtimes) {
  test(`on ${name}, the ONNX drafter's chains equal a cache-free reference`, { skip: !fixture || !existsSync(fixture) }, async () => {
    const { model, meta, prefillChunk, calls, trees } = JSON.parse(readFileSync(fixture!, "utf8")) as {
      model: string; meta: DrafterMeta; prefillChunk: number; calls: Call[]; trees: TreeCall[] };
    const drafter = await OnnxDrafter.load(ort, readFileSync(model), meta, { prefillChunk, sessionOptions });
    let evaluated = 0;
    for (const [i, { committed, depth, chain }] of calls.entries()) {
      assert.deepEqual(await drafter.draft(committed, depth), chain, `call ${i}`);
      assert.ok(drafter.stats.evaluated - evaluated <= committed.length, `call ${i} evaluated more than it was given`);
      evaluated = drafter.stats.evaluated;
    }
    // the first call evaluates the prompt (21); then what each verdict added past the cached chain (its bonus token,
    // 1; after a whole chain its last level too, 2), the new prompt past its shared prefix (3), the same again (its
    // last token, for the logits: 1), one more token (1): never the prompt again
    assert.equal(calls[0].committed.length, 21);
    assert.equal(drafter.stats.evaluated, 21 + 1 + 2 + 1 + 1 + 3 + 1 + 1);
    // trees (edge/drafting.py's build_tree on cache-free logits), on the cache the chains left
    for (const [i, { committed, shape, tokens, parents }] of trees.entries()) {
      assert.deepEqual(await drafter.draftTree(committed, shape), { tokens, parents }, `tree ${i}`);
    }
    assert.deepEqual(await drafter.draft(calls[4].committed, 4), calls[4].chain); // the trees' nodes left the cache
    assert.deepEqual(await drafter.draft([3], 0), []);
    await drafter.release();
  });
}

test("a meta.json without the model's dimensions is refused, naming the field", { skip: !fixture || !existsSync(fixture) }, async () => {
  const { meta } = JSON.parse(readFileSync(fixture!, "utf8")) as { meta: DrafterMeta };
  await assert.rejects(OnnxDrafter.load(ortWeb as unknown as OrtModule, new Uint8Array(0), { ...meta, layers: 0 }), /meta.json: layers is 0/);
});
