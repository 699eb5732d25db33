// The chain policy: the closed form on hand-worked examples, its choices on scripted rounds, and a round loop it
// drives against the scripted verifier (through the relay the session tests start: see session.test.ts).
import assert from "node:assert/strict";
import { test } from "node:test";

import { bestDepth, ChainPolicy, chainRate, expectedTokens, type Physics, type RoundSeen } from "../src/index.js";

const close = (a: number, b: number) => assert.ok(Math.abs(a - b) < 1e-9, `${a} != ${b}`);

test("E(D) sums the chance each level is reached", () => {
  for (const [alpha, depth, want] of [
    [[0.5], 2, 1 + 0.5 + 0.25], [[1, 1, 1], 3, 4], [[0.8, 0.5], 2, 1 + 0.8 + 0.4], [[0.9], 0, 1],
    [[0.8, 0.5], 3, 1 + 0.8 + 0.4 + 0.2], // past the last depth given, its acceptance holds
  ] as [number[], number, number][]) close(expectedTokens(alpha, depth), want);
});

test("a round's rate is E(D) over drafting, the link and the forward", () => {
  const p: Physics = { catchUpMs: 10, levelMs: 10, rttMs: 20, verifyMs: (n) => 30 + 10 * n };
  close(chainRate(p, [0.9], 2), (1000 * (1 + 0.9 + 0.81)) / (10 + 10 + 20 + 60)); // 2.71 tokens / 100 ms
});

test("the best depth follows acceptance and what a level costs", () => {
  const cpu: Physics = { catchUpMs: 40, levelMs: 40, rttMs: 1, verifyMs: (n) => 100 + 20 * n }; // forwards grow
  assert.equal(bestDepth(cpu, [0.6], 8), 1); // 1.6 / 181 ms beats 1.96 / 241 ms
  // the catch-up is paid whatever the depth: dear catch-up, cheap levels: 1.96 / 226 ms beats 1.6 / 201 and
  // 2.18 / 251; were each level as dear as the catch-up, 1.96 / 281 would lose to 1.6 / 201
  assert.equal(bestDepth({ ...cpu, catchUpMs: 60, levelMs: 5 }, [0.6], 8), 2);
  assert.equal(bestDepth({ ...cpu, catchUpMs: 60, levelMs: 60 }, [0.6], 8), 1);
  const gpu: Physics = { catchUpMs: 5, levelMs: 5, rttMs: 50, verifyMs: () => 20 }; // far, flat verifier
  assert.equal(bestDepth(gpu, [0.98], 8), 8);
  assert.equal(bestDepth(gpu, [0.98], 3), 3); // never past the limit
});

const round = (over: Partial<RoundSeen>): RoundSeen => ({
  depth: 4, accepted: 4, draftMs: 4 * 5, roundMs: 70, queueMs: 0, verifyMs: 20, forwardTokens: 5, ...over });

test("chains that hold and a flat verifier take the policy deep", () => {
  const policy = new ChainPolicy();
  let depth = policy.depth(8);
  for (let i = 0; i < 12; i++) {
    policy.observe(round({ depth, accepted: depth, draftMs: 5 * depth, forwardTokens: depth + 1,
                           timing: { catchUpMs: i ? 5 : 900, evaluated: i ? 2 : 150, levelsMs: 5 * (depth - 1),
                                     levels: depth - 1 } })); // (the first round's catch-up: the prompt's)
    depth = policy.depth(8);
  }
  assert.equal(depth, 8);
  assert.ok(policy.alpha()[0] > 0.9);
  assert.equal(policy.physics().catchUpMs, 5);
});

test("chains rejected at the first level and a dear drafter take it to one level", () => {
  const policy = new ChainPolicy();
  for (let i = 0; i < 8; i++) {
    const depth = policy.depth(8);
    policy.observe(round({ depth, accepted: 0, draftMs: 40 * depth, roundMs: 150, verifyMs: 120,
                           forwardTokens: depth + 1 })); // (a drafter that does not say where its time went)
  }
  assert.equal(policy.depth(8), 1);
  assert.ok(policy.alpha()[0] < 0.3);
});

test("one forward size measured: the prior's shape scaled to it, so a deeper chain is tried once", () => {
  const policy = new ChainPolicy();
  policy.observe(round({ depth: 1, accepted: 1, draftMs: 70, roundMs: 191, verifyMs: 120, forwardTokens: 2,
                         timing: { catchUpMs: 70, evaluated: 2, levelsMs: 0, levels: 0 } }));
  close(policy.physics().verifyMs(5), (120 * (25 + 40)) / (25 + 16)); // 190 ms, not 2 x 120
  assert.ok(policy.depth(8) > 1);
  policy.observe(round({ depth: 4, accepted: 4, draftMs: 250, roundMs: 700, verifyMs: 600, forwardTokens: 5,
                         timing: { catchUpMs: 70, evaluated: 2, levelsMs: 180, levels: 3 } }));
  assert.equal(policy.depth(8), 1); // the deeper forward measured dear: back to one level
});
