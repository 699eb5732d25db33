// Wire <-> plain objects at the boundary: protobufjs parses the embedded proto (``tandem.v1``); the round loop sees
// plain objects with the proto's camelCase field names, never protobufjs types.
import protobuf from "protobufjs";

import { VERIFIER_PROTO } from "./verifier_proto.js";

const root = protobuf.parse(VERIFIER_PROTO).root;
const SessionRequest = root.lookupType("tandem.v1.SessionRequest");
const SessionResponse = root.lookupType("tandem.v1.SessionResponse");

export interface Verdict {
  accepted: number[];
  bonusToken: number;
  committedLen: number;
  finishReason: string; // "FINISH_REASON_UNSPECIFIED" while the generation goes on
  draftSeq: number;
  rebased: number;
  stale: boolean;
  committedHash: string; // fixed64 as a decimal string ("0": not sent)
}

export interface SessionResponse {
  opened?: { sessionId: string; limits: { maxNewTokens: number; maxTreeNodes: number; maxTreeDepth: number } };
  verdict?: Verdict;
  closed?: { sessionId: string; committedLen: number };
}

export function encodeRequest(request: Record<string, unknown>): Uint8Array {
  const problem = SessionRequest.verify(request);
  if (problem) throw new TypeError(`not a tandem.v1.SessionRequest: ${problem}`);
  return SessionRequest.encode(SessionRequest.fromObject(request)).finish();
}

export function decodeResponse(bytes: Uint8Array): SessionResponse {
  const message = SessionResponse.decode(bytes);
  const plain = SessionResponse.toObject(message, { longs: String, enums: String, defaults: true, oneofs: true });
  const kind = plain.kind as string;
  return { [kind]: plain[kind] } as SessionResponse;
}

/** A response as protobuf JSON (camelCase, defaults left out): what the recorded sessions of docs/protocol/ hold. */
export function responseJSON(bytes: Uint8Array): Record<string, unknown> {
  return SessionResponse.decode(bytes).toJSON();
}

// The committed tokens' rolling hash the verifier sends (docs/protocol.md): h = 0xCBF29CE484222325, then for each
// token t, h = (h * 0x100000001B3 + t + 1) mod 2^64.
export function rollingHash(tokens: readonly number[], from = 0xcbf29ce484222325n): bigint {
  let h = from;
  for (const t of tokens) h = (h * 0x100000001b3n + BigInt(t) + 1n) & 0xffffffffffffffffn;
  return h;
}
