"""``GET /chat``: a one-page web chat on the gateway's own OpenAI endpoint that shows speculation as it happens.

The page streams ``/v1/chat/completions`` and reads each delta's SSE event id, ``forward:drafted:accepted``, which
the gateway sets to the verify forward that committed it and the generation's drafted and accepted tokens up to it
(``serving._deltas``): deltas of the same forward are one shaded run, so a run of several tokens is a draft the
target accepted in one forward, a lone token one the verifier decoded alone; the differences between forwards are
each round's drafted tokens accepted and rejected, listed under the answer as it grows (a forward that committed
no text is counted with the next that did, or, at the end of the answer, from the final statistics). A counter
shows tokens, verify forwards, tokens per forward and drafted tokens accepted and rejected live; when the answer
ends, the generation's ``tandem`` statistics
(with the usage chunk): verify forwards and how many tokens they saved, tau, drafted tokens accepted and rejected,
time on the network, tokens/s, and the draft policy's last choice with each mode's predicted rate (why).
"Draft in this browser" runs the drafter in the tab instead (``browser_drafter``: onnxruntime-web on the drafter's
self-contained export, the TypeScript client's round loop) and the verifier checks its chains over a WebSocket
session with an edge token the page mints from the key, each chain as long as the closed form
(``clients/web/src/policy.ts``) prices best on the tab's own rounds; each verdict is one run, and the answer ends
with the drafter's milliseconds per drafted token, tau and tokens/s. Static: no key is needed to load it, the API
calls it makes need one (typed into the page, kept in the tab's memory only). Text is inserted as text, never as
markup.
"""

PAGE = """<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>Tandem chat</title>
<style>
  body { font: 15px/1.45 system-ui, sans-serif; max-width: 52rem; margin: 1.5rem auto; padding: 0 1rem; }
  #log { border: 1px solid #ccc; border-radius: 6px; padding: .75rem; min-height: 12rem; white-space: pre-wrap; }
  .user { color: #555; margin: .5rem 0; }
  .answer { margin: .5rem 0 1rem; font-family: ui-monospace, monospace; font-size: 13px; }
  .f0 { background: #dbeafe; } .f1 { background: #fde68a; }
  .lone { background: none; }
  #stats { color: #333; margin: .5rem 0; font-variant-numeric: tabular-nums; }
  .rounds { font-size: 12px; color: #444; margin: -.5rem 0 1rem; } .rounds ol { margin: .25rem 0; columns: 3; }
  form { display: flex; gap: .5rem; margin-top: .75rem; }
  #prompt { flex: 1; padding: .4rem; font: inherit; } #key { width: 12rem; padding: .4rem; }
  #temperature { width: 4rem; } #max { width: 6rem; }
</style>
</head>
<body>
<h1>Tandem</h1>
<p>Shaded runs are tokens one verify forward committed together: a draft the target accepted, plus its own next
token. Unshaded tokens the verifier decoded alone. Under each answer: every round's drafted tokens, accepted and
rejected.</p>
<div id="log"></div>
<div id="stats">tokens 0 &middot; verify forwards 0</div>
<form id="ask">
  <textarea id="prompt" rows="2" placeholder="Ask something (Shift+Enter: a new line)"></textarea>
  <input id="key" type="password" placeholder="API key (if the server has keys)" autocomplete="off">
  <input id="max" type="number" min="1" placeholder="max tokens"
    title="the answer's most tokens (empty: the server's default)">
  <label>temperature <input id="temperature" type="number" min="0" max="2" step="0.1" value="0"></label>
  <label title="the drafter runs in this tab (onnxruntime-web: WASM, or WebGPU with ?ep=webgpu); the verifier
checks its drafts over a WebSocket session (needs tandem serve --browser-drafter)"><input id="local"
type="checkbox"> draft in this browser</label>
  <button id="send" type="submit">Send</button>
</form>
<script>
const log = document.getElementById("log"), stats = document.getElementById("stats");
const messages = [];
function line(cls, text) {
  const div = document.createElement("div");
  div.className = cls;
  if (text) div.textContent = text;
  log.appendChild(div);
  return div;
}
let local = null;  // the in-browser drafter and the client that runs it, loaded once
async function loadLocal(headers, status) {
  // ?ep=webgpu: onnxruntime-web's WebGPU provider (ops it lacks run on the CPU); its WASM one otherwise
  const ep = new URLSearchParams(location.search).get("ep") || "wasm";
  if (!["wasm", "webgpu"].includes(ep)) throw new Error(`?ep=${ep}: wasm or webgpu`);
  if (ep === "webgpu" && !navigator.gpu) throw new Error("?ep=webgpu: this browser has no WebGPU");
  const ort = await import(ep === "webgpu" ? "/edge/ort/ort.webgpu.min.mjs" : "/edge/ort/ort.wasm.min.mjs");
  ort.env.wasm.wasmPaths = "/edge/ort/";
  // threads where the page is cross-origin isolated (the gateway serves it so)
  ort.env.wasm.numThreads = self.crossOriginIsolated ? Math.min(4, navigator.hardwareConcurrency || 1) : 1;
  const edge = await import("/edge/client/edge.js");
  const meta = await (await fetch("/v1/edge/drafter/meta.json", {headers})).json();
  if (meta.error) throw new Error(meta.error.message);
  const bytes = await drafterBytes(meta.export_id, headers, status);
  status.textContent = "starting the drafter";
  const options = {sessionOptions: {executionProviders: [ep]}};
  return {edge, ep, drafter: await edge.OnnxDrafter.load(ort, bytes, meta, options)};
}
// The drafter is hundreds of MB: kept in this browser's Cache Storage, fetched again only when the gateway's export
// changes (meta.json's export_id); its download shows how far it got.
async function drafterBytes(exportId, headers, status) {
  const key = "/v1/edge/drafter/model.onnx?export=" + encodeURIComponent(exportId);
  const cache = self.caches && await caches.open("tandem-drafter").catch(() => null);
  const kept = cache && await cache.match(key);
  if (kept) {
    status.textContent = "loading the drafter from this browser's cache";
    return new Uint8Array(await kept.arrayBuffer());
  }
  const resp = await fetch("/v1/edge/drafter/model.onnx", {headers});
  if (!resp.ok) throw new Error("drafter: " + resp.status + " " + await resp.text());
  const size = Number(resp.headers.get("content-length")), reader = resp.body.getReader();
  const bytes = new Uint8Array(size);  // (filled in place: a Blob this size may be kept on disk, and not come back)
  for (let got = 0;;) {
    const {value, done} = await reader.read();
    if (done) break;
    bytes.set(value, got); got += value.length;
    status.textContent = `loading the drafter: ${(got / 1e6).toFixed(0)} of ${(size / 1e6).toFixed(0)} MB`;
  }
  if (cache) {  // this export only: an older one goes (a full disk just means the next visit downloads again)
    for (const old of await cache.keys()) await cache.delete(old);
    await cache.put(key, new Response(bytes)).catch(() => null);
  }
  return bytes;
}
async function askLocal(answer, key, headers, model) {  // the device drafts, the verifier checks: a WebSocket session
  local = local || loadLocal(headers, stats);
  const loaded = await local.catch((e) => { local = null; throw e; }), {edge, drafter} = loaded;
  const post = async (path, body) => (await fetch(path, {method: "POST", headers, body: JSON.stringify(body)})).json();
  const minted = await post("/v1/edge-tokens", {ttl_s: 600});
  if (!minted.token) throw new Error("edge token: " + JSON.stringify(minted));
  const origin = location.origin, token = minted.token;
  const [target, tokenizer] = await Promise.all([edge.target(origin, token), edge.loadTokenizer(origin, token)]);
  if (target.vocabSize !== drafter.meta.vocab_size) throw new Error("the drafter's vocabulary is not the target's");
  const prompt = (await post("/tokenize", {model, messages})).tokens;
  const transport = await edge.connect(origin.replace(/^http/, "ws") + "/v1/edge/session", token);
  const temperature = Number(document.getElementById("temperature").value), before = {...drafter.stats};
  const most = Number(document.getElementById("max").value) || 512;
  // each chain's length from the closed form on this tab's own rounds (?depth=N: a fixed length instead;
  // ?tree=k,n,d: trees of that shape)
  const query = new URLSearchParams(location.search), fixed = Number(query.get("depth"));
  const [k, nodes, levels] = (query.get("tree") || "").split(",").map(Number);
  const tree = levels ? {k, n: nodes, d: levels} : undefined;
  loaded.policy = loaded.policy || new edge.ChainPolicy();
  const run = edge.generate(transport, drafter, prompt, {maxNewTokens: Math.min(most, minted.max_new_tokens),
    vocabSize: target.vocabSize, vocabFingerprint: target.vocabFingerprint,
    depth: tree ? undefined : fixed || loaded.policy, tree, decode: tokenizer.decode,
    sampling: temperature > 0 ? {temperature} : {}});
  const t0 = performance.now(), tokens = [];
  let text = "", shade = 0, n, prompted = null;  // the drafter's figures once the prompt is in (its first draft)
  for (;;) {
    const next = await run.next();
    if (next.done) { n = next.value; break; }
    prompted = prompted || {...drafter.stats};
    const span = document.createElement("span");
    span.className = next.value.tokens.length > 1 ? "run f" + (shade = 1 - shade) : "run lone";
    span.textContent = next.value.text;
    span.dataset.n = String(next.value.tokens.length);
    answer.appendChild(span);
    tokens.push(...next.value.tokens);
    text += next.value.text;
    stats.textContent = `tokens ${tokens.length} \u00b7 verify forwards ${answer.children.length} ` +
      "(drafted in this browser)";
  }
  prompted = prompted || before;
  const s = (k) => drafter.stats[k] - prompted[k], seconds = (performance.now() - t0) / 1000;
  const draftMs = s("draftMs") / Math.max(1, s("drafted")), tau = n.tokens / Math.max(1, n.verifyForwards);
  stats.dataset.promptMs = (prompted.draftMs - before.draftMs).toFixed(0);  // the prompt's prefill in the tab
  Object.assign(stats.dataset, {ep: loaded.ep, drafted: n.draftedTokens, accepted: n.acceptedTokens,
    forwards: n.verifyForwards,
    chainLength: (n.draftedTokens / Math.max(1, n.verifyForwards)).toFixed(2),
    draftMsPerToken: draftMs.toFixed(1), tau: tau.toFixed(3), tokensPerS: (n.tokens / seconds).toFixed(2)});
  answer.dataset.tokens = JSON.stringify(tokens);
  stats.textContent = `tokens ${n.tokens} \u00b7 verify forwards ${n.verifyForwards} \u00b7 tau ${tau.toFixed(2)} ` +
    `\u00b7 drafted in this browser ${n.draftedTokens} (${stats.dataset.chainLength} a draft): accepted ` +
    `${n.acceptedTokens}, rejected ` +
    `${n.draftedTokens - n.acceptedTokens} \u00b7 ${draftMs.toFixed(1)} ms a drafted token after the prompt's ` +
    `${stats.dataset.promptMs} ms \u00b7 ` +
    `${(n.tokens / seconds).toFixed(2)} tokens/s`;
  return text;
}
async function ask(prompt) {
  messages.push({role: "user", content: prompt});
  line("user", "> " + prompt);
  const answer = line("answer"), key = document.getElementById("key").value;
  if (document.getElementById("local").checked) {
    const headers = {"Content-Type": "application/json"};
    if (key) headers["Authorization"] = "Bearer " + key;
    const model = (await (await fetch("/v1/models", {headers})).json()).data[0].id;
    messages.push({role: "assistant", content: await askLocal(answer, key, headers, model)});
    return;
  }
  const rounds = document.createElement("details"), list = document.createElement("ol");
  const summary = document.createElement("summary");
  rounds.className = "rounds";
  rounds.append(summary, list);
  log.appendChild(rounds);
  let drafted = 0, accepted = 0;  // up to the last forward listed
  function round(label, upToDrafted, upToAccepted) {  // one round: the counts since the last one listed
    const d = upToDrafted - drafted, a = upToAccepted - accepted, li = document.createElement("li");
    drafted = upToDrafted; accepted = upToAccepted;
    li.textContent = `${label}: drafted ${d}, accepted ${a}, rejected ${d - a}`;
    Object.assign(li.dataset, {drafted: d, accepted: a});
    list.appendChild(li);
    summary.textContent = `rounds (${list.children.length}): drafted ${drafted}, accepted ${accepted}, ` +
      `rejected ${drafted - accepted}`;
    return li;
  }
  const headers = {"Content-Type": "application/json"};
  if (key) headers["Authorization"] = "Bearer " + key;
  const models = await (await fetch("/v1/models", {headers})).json();
  const most = Number(document.getElementById("max").value);
  const resp = await fetch("/v1/chat/completions", {method: "POST", headers, body: JSON.stringify({
    model: models.data[0].id, messages, stream: true, stream_options: {include_usage: true},
    temperature: Number(document.getElementById("temperature").value), ...(most ? {max_tokens: most} : {})})});
  if (!resp.ok) { answer.textContent = "error " + resp.status + ": " + await resp.text(); return; }
  const reader = resp.body.getReader(), decoder = new TextDecoder();
  let buffer = "", text = "", tokens = 0, forwards = new Set(), last = null, span = null, shade = 0;
  for (;;) {
    const {value, done} = await reader.read();
    if (done) break;
    buffer += decoder.decode(value, {stream: true});
    let end;
    while ((end = buffer.indexOf("\\n\\n")) >= 0) {
      const event = buffer.slice(0, end); buffer = buffer.slice(end + 2);
      let id = null, data = null;
      for (const field of event.split("\\n")) {
        if (field.startsWith("id: ")) id = field.slice(4);
        else if (field.startsWith("data: ")) data = field.slice(6);
      }
      if (data === null || data === "[DONE]") continue;
      const chunk = JSON.parse(data);
      if (chunk.error) { line("answer", "error: " + chunk.error.message); continue; }
      if (chunk.tandem) {  // the generation's own statistics, with the usage chunk
        const t = chunk.tandem, n = chunk.usage.completion_tokens;
        if (t.drafted_tokens !== drafted || t.accepted_tokens !== accepted)
          round("after the text", t.drafted_tokens, t.accepted_tokens);  // e.g. a round that ended the answer
        stats.textContent = `tokens ${n} \\u00b7 verify forwards ${t.verify_forwards} (${n - t.verify_forwards} ` +
          `saved) \\u00b7 tau ${Number(t.tau).toFixed(2)} \\u00b7 drafted ${t.drafted_tokens}: accepted ` +
          `${t.accepted_tokens}, rejected ${t.drafted_tokens - t.accepted_tokens} \\u00b7 network ` +
          `${t.network_ms} ms \\u00b7 ${t.tokens_per_s} tokens/s`;
        if (t.policy && t.policy.mode) {  // the draft policy's last choice, and why: each mode's predicted rate
          const rates = Object.entries(t.policy.predicted_tokens_per_s || {}).map(([m, r]) => `${m} ${r}`);
          stats.textContent += ` \\u00b7 policy chose ${t.policy.mode}` + (t.policy.shape ? ` ${t.policy.shape}` : "") +
            ` (predicted tokens/s: ${rates.join(", ")}; round trip ${t.policy.rtt_ms} ms)`;
          stats.dataset.mode = t.policy.mode;
        }
        stats.dataset.accepted = t.accepted_tokens;
        stats.dataset.drafted = t.drafted_tokens;
        continue;
      }
      const delta = chunk.choices && chunk.choices[0] && chunk.choices[0].delta;
      if (!delta || !delta.content) continue;
      const [forward, upToDrafted, upToAccepted] = (id || "").split(":");
      if (forward !== last) {
        if (span && span.dataset.n === "1") span.className = "run lone";  // the verifier's token alone
        span = document.createElement("span");
        span.className = "run f" + (shade = 1 - shade);
        span.dataset.forward = forward;
        span.title = round("forward " + forward, Number(upToDrafted), Number(upToAccepted)).textContent;
        answer.appendChild(span);
        last = forward;
        forwards.add(forward);
      }
      span.textContent += delta.content;
      span.dataset.n = String(Number(span.dataset.n || 0) + 1);
      text += delta.content;
      tokens += 1;
      stats.textContent = `tokens ${tokens} \\u00b7 verify forwards ${forwards.size} \\u00b7 tokens per forward ` +
        `${(tokens / forwards.size).toFixed(2)} \\u00b7 drafted ${drafted}: accepted ${accepted}, rejected ` +
        `${drafted - accepted} \\u00b7 this round: ${span.title}`;
    }
  }
  if (span && span.dataset.n === "1") span.className = "run lone";
  messages.push({role: "assistant", content: text});
}
document.getElementById("ask").addEventListener("submit", (e) => {
  e.preventDefault();
  const input = document.getElementById("prompt"), prompt = input.value;  // (as typed: code keeps its lines)
  if (!prompt.trim()) return;
  input.value = "";
  ask(prompt).catch((err) => line("answer", "error: " + err));
});
document.getElementById("prompt").addEventListener("keydown", (e) => {
  if (e.key === "Enter" && !e.shiftKey) { e.preventDefault(); document.getElementById("ask").requestSubmit(); }
});
</script>
</body>
</html>
"""
