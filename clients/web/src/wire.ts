// Wire <-> plain objects at the boundary: @bufbuild/protobuf encodes and decodes by the proto's descriptor (embedded
// at build time, ``tandem.v1``), through proto3 JSON: the round loop sees plain objects with the proto's camelCase
// field names, never message types.
import { createFileRegistry, fromBinary, fromJson, toBinary, toJson, type JsonValue } from "@bufbuild/protobuf";
import { base64Decode } from "@bufbuild/protobuf/wire";
import { FileDescriptorSetSchema } from "@bufbuild/protobuf/wkt";

import { VERIFIER_DESCRIPTOR } from "./verifier_proto.js";

const registry = createFileRegistry(fromBinary(FileDescriptorSetSchema, base64Decode(VERIFIER_DESCRIPTOR)));
const SessionRequest = registry.getMessage("tandem.v1.SessionRequest")!;
const SessionResponse = registry.getMessage("tandem.v1.SessionResponse")!;
const RESPONSE_KINDS = SessionResponse.oneofs[0].fields.map((f) => f.jsonName);

export interface Verdict {
  accepted: number[];
  bonusToken: number;
  committedLen: number;
  finishReason: string; // "FINISH_REASON_UNSPECIFIED" while the generation goes on
  draftSeq: number;
  rebased: number;
  stale: boolean;
  committedHash: string; // fixed64 as a decimal string ("0": not sent)
  queueUs: string; // (uint64 as decimal strings)
  verifyUs: string;
  forwardTokens: number;
  hostTokens: number[]; // a step the verifier's host drafted: the tokens of its chain the target took ...
  hostDrafted: number; // ... of this many drafted (0: none; a verdict with hostLevelUs alone: no seat for you)
  hostLevelUs: string; // the host's pace per level, as it gives it to this session
}

export interface SessionResponse {
  opened?: { sessionId: string; limits: { maxNewTokens: number; maxTreeNodes: number; maxTreeDepth: number };
             hostDrafter: string }; // the verifier's host drafter for this session ("": none, or every seat taken)
  verdict?: Verdict;
  closed?: { sessionId: string; committedLen: number };
}

export function encodeRequest(request: Record<string, unknown>): Uint8Array {
  try {
    return toBinary(SessionRequest, fromJson(SessionRequest, request as JsonValue));
  } catch (e) {
    throw new TypeError(`not a tandem.v1.SessionRequest: ${(e as Error).message}`);
  }
}

/** The response's one set kind, its fields all present (defaults included), 64-bit integers as decimal strings and
 * enums by name. */
export function decodeResponse(bytes: Uint8Array): SessionResponse {
  const json = toJson(SessionResponse, fromBinary(SessionResponse, bytes), { alwaysEmitImplicit: true }) as
    Record<string, unknown>;
  const kind = RESPONSE_KINDS.find((k) => k in json);
  return kind ? ({ [kind]: json[kind] } as SessionResponse) : {};
}

/** A response as protobuf JSON (camelCase, defaults left out): what the recorded sessions of docs/protocol/ hold. */
export function responseJSON(bytes: Uint8Array): Record<string, unknown> {
  return toJson(SessionResponse, fromBinary(SessionResponse, bytes)) as Record<string, unknown>;
}

// The committed tokens' rolling hash the verifier sends (docs/protocol.md): h = 0xCBF29CE484222325, then for each
// token t, h = (h * 0x100000001B3 + t + 1) mod 2^64.
export function rollingHash(tokens: readonly number[], from = 0xcbf29ce484222325n): bigint {
  let h = from;
  for (const t of tokens) h = (h * 0x100000001b3n + BigInt(t) + 1n) & 0xffffffffffffffffn;
  return h;
}
