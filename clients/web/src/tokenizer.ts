// The target's tokenizer on the device: its tokenizer.json from the gateway (GET /v1/edge/tokenizer; a GGUF
// target's vocabulary converted there, held to llama.cpp's tokenization), run by tokenizers.js.
import { Tokenizer } from "@huggingface/tokenizers";

export interface TargetTokenizer {
  vocabFingerprint: string; // the vocabulary it tokenizes into: compare with target().vocabFingerprint
  encode(text: string): number[]; // special tokens spelled in the text are matched (a rendered chat template)
  decode(tokens: number[]): string; // special tokens render as nothing
}

/** A tokenizer from a tokenizer.json's parsed contents. */
export function fromTokenizerJson(json: object, vocabFingerprint = ""): TargetTokenizer {
  const tokenizer = new Tokenizer(json, {});
  return {
    vocabFingerprint,
    encode: (text) => tokenizer.encode(text, { add_special_tokens: false }).ids,
    decode: (tokens) => tokenizer.decode(tokens, { skip_special_tokens: true, clean_up_tokenization_spaces: false }),
  };
}

/** ``GET <gateway>/v1/edge/tokenizer`` with an edge token or API key. */
export async function loadTokenizer(gatewayUrl: string, credential: string): Promise<TargetTokenizer> {
  const response = await fetch(`${gatewayUrl.replace(/\/$/, "")}/v1/edge/tokenizer`, {
    headers: { Authorization: `Bearer ${credential}` },
  });
  if (!response.ok) throw new Error(`GET /v1/edge/tokenizer: ${response.status} ${await response.text()}`);
  return fromTokenizerJson(await response.json(), response.headers.get("x-vocab-fingerprint") ?? "");
}
