// The target's tokenizer.json (converted from the default pair's GGUF by core/gguf_tokenizer.py) run by
// tokenizers.js gives llama.cpp's ids. The fixture (tokenizer.json and llama.cpp's ids of some texts) is written
// by tests/test_web_client.py from the cached model; without it (npm test alone, no model) this test is skipped.
import assert from "node:assert/strict";
import { existsSync, readFileSync } from "node:fs";
import { test } from "node:test";

import { fromTokenizerJson } from "../src/index.js";

const fixture = process.env.TANDEM_TOKENIZER_FIXTURE;

test("tokenizers.js on the converted tokenizer.json gives llama.cpp's ids", { skip: !fixture || !existsSync(fixture) }, () => {
  const { tokenizer, cases } = JSON.parse(readFileSync(fixture!, "utf8")) as {
    tokenizer: object; cases: { text: string; ids: number[]; plain: string }[] };
  const tok = fromTokenizerJson(tokenizer);
  for (const { text, ids, plain } of cases) {
    assert.deepEqual(tok.encode(text), ids, JSON.stringify(text));
    assert.equal(tok.decode(ids), plain, JSON.stringify(text));
  }
});
