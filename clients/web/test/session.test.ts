// The client against the scripted verifier (the target counts up: the next token after t is t + 1, token t reads
// "t "), behind a gateway that relays sessions over WebSocket: tests/scripted_relay.py, started here.
import assert from "node:assert/strict";
import { spawn, type ChildProcess } from "node:child_process";
import { readFileSync } from "node:fs";
import { createInterface } from "node:readline";
import { after, before, test } from "node:test";
import { fileURLToPath } from "node:url";

import WebSocket from "ws";

import { ChainPolicy, connect, generate, rollingHash, SessionEnded, target, type Drafter } from "../src/index.js";
import { encodeRequest, responseJSON } from "../src/wire.js";

const ROOT = fileURLToPath(new URL("../../../../", import.meta.url)); // (compiled into clients/web/dist/test)
const PYTHON = process.env.TANDEM_PYTHON ?? `${ROOT}.venv/bin/python`;
const Socket = WebSocket as unknown as new (url: string, protocols: string[]) => globalThis.WebSocket;

let relay: ChildProcess;
let relayLines: AsyncIterator<string>;
let gateway: { url: string; key: string; fingerprint: string; vocab_size: number };

before(async () => {
  relay = spawn(PYTHON, ["scripted_relay.py"], { cwd: `${ROOT}tests`, stdio: ["pipe", "pipe", "inherit"] });
  relayLines = createInterface({ input: relay.stdout! })[Symbol.asyncIterator]();
  gateway = JSON.parse((await relayLines.next()).value);
});

async function restartVerifier(): Promise<void> {
  relay.stdin!.write("restart\n");
  assert.equal((await relayLines.next()).value, "restarted");
}

after(() => relay.stdin!.end());

const sessionUrl = () => gateway.url.replace("http://", "ws://") + "/v1/edge/session";
const countUp: Drafter = { draft: (committed, depth) => Array.from({ length: depth }, (_, i) => committed.at(-1)! + 1 + i) };
const alwaysWrong: Drafter = { draft: (committed, depth) => Array.from({ length: depth }, () => committed.at(-1)! + 2) };
const decode = (tokens: number[]) => tokens.map((t) => (t === 255 ? "" : `${t} `)).join("");

async function answer(drafter: Drafter, extra: Record<string, unknown> = {}, credential = gateway.key) {
  const transport = await connect(sessionUrl(), credential, Socket);
  const run = generate(transport, drafter, [1, 2, 3], {
    maxNewTokens: 16, vocabSize: gateway.vocab_size, vocabFingerprint: gateway.fingerprint, decode, ...extra });
  const tokens: number[] = [];
  let text = "";
  for (;;) {
    const next = await run.next();
    if (next.done) return { tokens, text, stats: next.value };
    tokens.push(...next.value.tokens);
    text += next.value.text;
  }
}

const counted = (from: number, n: number) => Array.from({ length: n }, (_, i) => from + i);

test("a drafter that counts up has every node accepted", async () => {
  const { tokens, text, stats } = await answer(countUp);
  assert.deepEqual(tokens, counted(4, 16));
  assert.equal(text, decode(counted(4, 16)));
  assert.equal(stats.finishReason, "length");
  assert.equal(stats.verifyForwards, 4); // 5 tokens a forward (4 accepted + the target's own) ...
  assert.equal(stats.acceptedTokens, 13); // ... then the 16th, a drafted node accepted at the length limit
});

test("a chain policy drafts deeper while every node is accepted, the answer the target's", async () => {
  const policy = new ChainPolicy({ maxDepth: 8 });
  const seen: number[] = [];
  const watching = { ...countUp, draft: (c: readonly number[], d: number) => { seen.push(d); return countUp.draft(c, d); } };
  const { tokens } = await answer(watching, { depth: policy, maxNewTokens: 48 });
  assert.deepEqual(tokens, counted(4, 48));
  assert.ok(seen.at(-2)! > seen[0], `depths ${seen}`);
  await assert.rejects(answer(countUp, { depth: policy, decodeSteps: 2 }), /lock-step/);
});

test("a drafter that is always wrong costs rounds, never the answer", async () => {
  const { tokens, stats } = await answer(alwaysWrong, { depth: 3 });
  assert.deepEqual(tokens, counted(4, 16));
  assert.equal(stats.verifyForwards, 16);
  assert.equal(stats.acceptedTokens, 0);
  assert.equal(stats.draftedTokens, 48);
});

test("a stop string ends the answer before it, even across rounds", async () => {
  const { text, stats } = await answer(countUp, { stop: ["9 1"] }); // "... 8 9 10 ..."
  assert.equal(text, "4 5 6 7 8 ");
  assert.equal(stats.finishReason, "stop");
});

test("an edge token minted by the app's backend opens a session, capped at its limits", async () => {
  const minted = await (await fetch(`${gateway.url}/v1/edge-tokens`, {
    method: "POST", headers: { Authorization: `Bearer ${gateway.key}`, "Content-Type": "application/json" },
    body: JSON.stringify({ ttl_s: 60, max_new_tokens: 6 }) })).json() as { token: string };
  const { tokens } = await answer(countUp, {}, minted.token);
  assert.deepEqual(tokens, counted(4, 6));
});

test("a verifier that goes away mid-answer: the answer resumes on a new session, nothing lost or repeated", async () => {
  for (const decodeSteps of [0, 2]) {
    let restarted = false;
    const drafter: Drafter = { draft: async (committed, depth) => {
      if (!restarted && committed.length >= 3 + 8) {
        restarted = true;
        await restartVerifier();
      }
      return countUp.draft(committed, depth);
    } };
    const { tokens, stats } = await answer(drafter, {
      maxNewTokens: 24, decodeSteps, reconnect: () => connect(sessionUrl(), gateway.key, Socket) });
    assert.deepEqual(tokens, counted(4, 24));
    assert.equal(stats.resumes, 1);
  }
});

test("the target's vocabulary comes from the gateway, with the key or a token", async () => {
  const got = await target(gateway.url, gateway.key);
  assert.equal(got.vocabFingerprint, gateway.fingerprint);
  assert.equal(got.vocabSize, gateway.vocab_size);
  await assert.rejects(target(gateway.url, "not-a-key"), /401/);
});

test("a bad credential ends the session with UNAUTHENTICATED", async () => {
  await assert.rejects(answer(countUp, {}, "not-a-key"), (e: unknown) =>
    e instanceof SessionEnded && e.grpcCode === 16 && e.reason.includes("credential"));
});

test("streamed: the verifier decodes alone while chains fly, and the answer is the same", async () => {
  for (const drafter of [countUp, alwaysWrong]) {
    const { tokens, stats } = await answer(drafter, { decodeSteps: 2, maxNewTokens: 40 });
    assert.deepEqual(tokens, counted(4, 40));
    assert.ok(stats.aloneTokens > 0 && stats.verifyForwards < 40 === (drafter === countUp), JSON.stringify(stats));
    assert.equal(stats.acceptedTokens > 0, drafter === countUp);
  }
});

// a tree whose first child is always wrong and whose second (the target's token) is the one expanded, d levels deep
const secondRight: Drafter = {
  ...alwaysWrong,
  draftTree: (committed, shape) => {
    const tokens: number[] = [];
    const parents: number[] = [];
    for (let level = 0, last = committed.at(-1)!; level < shape.d && tokens.length + 2 <= shape.n; level++, last++) {
      const parent = tokens.length - 1; // the last level's right child (-1: the root)
      tokens.push(last + 2, last + 1);
      parents.push(parent, parent);
    }
    return { tokens, parents };
  },
};

test("trees: the verdict's path runs through second choices, in lock-step and streamed, the answer the target's", async () => {
  const lockstep = await answer(secondRight, { tree: { k: 2, n: 6, d: 3 } });
  assert.deepEqual(lockstep.tokens, counted(4, 16));
  assert.equal(lockstep.stats.verifyForwards, 4); // 3 accepted (every right child) + the target's own
  assert.equal(lockstep.stats.draftedTokens, 6 * 4);
  const streamed = await answer(secondRight, { tree: { k: 2, n: 8, d: 4 }, decodeSteps: 2, maxNewTokens: 40 });
  assert.deepEqual(streamed.tokens, counted(4, 40));
  assert.ok(streamed.stats.acceptedTokens > 0 && streamed.stats.aloneTokens > 0 && streamed.stats.rebasedTokens > 0,
            JSON.stringify(streamed.stats)); // (trees walked along tokens decoded alone while they flew)
  await assert.rejects(answer(countUp, { tree: { k: 2, n: 6, d: 3 } }), /chains only/);
  await assert.rejects(answer(secondRight, { tree: { k: 2, n: 6, d: 3 }, depth: new ChainPolicy() }), /not both/);
  await assert.rejects(answer(secondRight, { tree: { k: 0, n: 6, d: 3 } }), /k, n, d >= 1/);
});

for (const name of ["lockstep", "streamed"]) test(`the recorded ${name} session of docs/protocol/ replays message for message`, async () => {
  const lines = readFileSync(`${ROOT}docs/protocol/${name}.jsonl`, "utf8").trim().split("\n").map((l) => JSON.parse(l));
  const transport = await connect(sessionUrl(), gateway.key, Socket);
  let session = "";
  for (const line of lines) {
    if (line.client) {
      const request = JSON.parse(JSON.stringify(line.client).replaceAll("<session>", session));
      transport.send(encodeRequest(request));
      continue;
    }
    const got = responseJSON(await transport.receive()) as Record<string, Record<string, unknown>>;
    const body = Object.values(got)[0];
    session ||= String(body.sessionId ?? "");
    for (const timing of ["prefillUs", "queueUs", "verifyUs", "priceUsPerToken", "tokenBudget"]) delete body[timing];
    assert.deepEqual(JSON.parse(JSON.stringify(got).replaceAll(session, "<session>")), line.verifier);
  }
  transport.close();
});

test("the rolling hash is the one the verifier sends", () => {
  assert.equal(rollingHash([1, 2, 3, 4, 5, 6, 7]), 149478723837067456n); // docs/protocol/lockstep.jsonl, first verdict
});

test("host-drafted: a client without a drafter gets the verifier's host chains, the answer the target's", async () => {
  // a verifier whose host drafts (it counts up, like the target): its own relay, beside the one above
  const hosted = spawn(PYTHON, ["scripted_relay.py", "--host"], { cwd: `${ROOT}tests`, stdio: ["pipe", "pipe", "inherit"] });
  try {
    const lines = createInterface({ input: hosted.stdout! })[Symbol.asyncIterator]();
    const gw = JSON.parse((await lines.next()).value);
    const run = async (url: string, vocab = gw) => {
      const transport = await connect(url.replace("http://", "ws://") + "/v1/edge/session", vocab.key, Socket);
      const g = generate(transport, null, [1, 2, 3], { maxNewTokens: 40, vocabSize: vocab.vocab_size,
                                                       vocabFingerprint: vocab.fingerprint, hostDraft: true });
      const tokens: number[] = [];
      for (;;) {
        const next = await g.next();
        if (next.done) return { tokens, stats: next.value };
        tokens.push(...next.value.tokens);
      }
    };
    const { tokens, stats } = await run(gw.url);
    assert.deepEqual(tokens, counted(4, 40));
    assert.equal(stats.hostDrafter, "counting-host");
    assert.ok(stats.hostTokens > 20 && stats.verifyForwards < 20, JSON.stringify(stats)); // chains, not tokens
    // a verifier without a host: the same answer, decoded alone (plain decoding)
    const plain = await run(gateway.url, gateway);
    assert.deepEqual(plain.tokens, counted(4, 40));
    assert.equal(plain.stats.hostDrafter, "");
    assert.ok(plain.stats.hostTokens === 0 && plain.stats.verifyForwards === 40, JSON.stringify(plain.stats));
  } finally {
    hosted.stdin!.end();
  }
});

test("no drafter and no host asked: refused before anything is sent", async () => {
  const transport = await connect(sessionUrl(), gateway.key, Socket);
  await assert.rejects(generate(transport, null, [1, 2, 3], {
    maxNewTokens: 4, vocabSize: gateway.vocab_size, vocabFingerprint: gateway.fingerprint }).next(), TypeError);
  transport.close();
});
