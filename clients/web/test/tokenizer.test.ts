// The target's tokenizer.json (converted from a GGUF by core/gguf_tokenizer.py) run by tokenizers.js gives
// llama.cpp's ids and text. The fixtures (one per tokenizer family: tokenizer.json and llama.cpp's ids of some
// texts), separated by the path delimiter, are written by tests/test_web_client.py from the cached vocabularies;
// without them (npm test alone, no model) this test is skipped.
import assert from "node:assert/strict";
import { existsSync, readFileSync } from "node:fs";
import { delimiter } from "node:path";
import { test } from "node:test";

import { fromTokenizerJson } from "../src/index.js";

const fixtures = (process.env.TANDEM_TOKENIZER_FIXTURE ?? "").split(delimiter).filter((f) => f);

test("tokenizers.js on the converted tokenizer.json gives llama.cpp's ids", {
  skip: !fixtures.length || !fixtures.every((f) => existsSync(f)) }, () => {
  for (const fixture of fixtures) {
    const { tokenizer, cases } = JSON.parse(readFileSync(fixture, "utf8")) as {
      tokenizer: object; cases: { text: string; ids: number[]; plain: string }[] };
    const tok = fromTokenizerJson(tokenizer);
    for (const { text, ids, plain } of cases) {
      assert.deepEqual(tok.encode(text), ids, `${fixture}: ${JSON.stringify(text)}`);
      if (ids.length) assert.equal(tok.decode(ids), plain, `${fixture}: ${JSON.stringify(text)}`);
    }
  }
});
