export { connect, SessionEnded, SUBPROTOCOL, type Transport } from "./transport.js";
export { generate, ProtocolError, type Chunk, type DepthPolicy, type Drafter, type GenerateOptions, type Sampling,
         type Stats, type DraftedTree, type TreeShape } from "./session.js";
export { bestDepth, ChainPolicy, chainRate, expectedTokens, type Physics, type PolicyOptions,
         type RoundSeen } from "./policy.js";
export { rollingHash } from "./wire.js";
export { target, type Target } from "./target.js";
export { fromTokenizerJson, loadTokenizer, type TargetTokenizer } from "./tokenizer.js";
export { OnnxDrafter, type DrafterMeta, type DrafterStats, type OrtModule } from "./onnx_drafter.js";
