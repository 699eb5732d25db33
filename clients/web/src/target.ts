// What a device needs before a session (docs/protocol.md, "Before a session"), from the gateway: the verifier's
// target, its vocabulary's size and fingerprint, context and chat template.

export interface Target {
  targetModel: string;
  engine: string;
  vocabSize: number;
  vocabFingerprint: string;
  nCtx: number;
  chatTemplate?: string;
  bosToken?: string;
  eosToken?: string;
}

/** ``GET <gateway>/v1/edge/target`` with an edge token or API key. */
export async function target(gatewayUrl: string, credential: string): Promise<Target> {
  const response = await fetch(`${gatewayUrl.replace(/\/$/, "")}/v1/edge/target`, {
    headers: { Authorization: `Bearer ${credential}` },
  });
  if (!response.ok) throw new Error(`GET /v1/edge/target: ${response.status} ${await response.text()}`);
  return (await response.json()) as Target;
}
