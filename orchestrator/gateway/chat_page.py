"""``GET /chat``: a one-page web chat on the gateway's own OpenAI endpoint that shows speculation as it happens.

The page streams ``/v1/chat/completions`` and reads each delta's SSE event id, ``forward:drafted:accepted``, which
the gateway sets to the verify forward that committed it and the generation's drafted and accepted tokens up to it
(``gateway.Delta``): deltas of the same forward are one shaded run, so a run of several tokens is a draft the
target accepted in one forward, a lone token one the verifier decoded alone (a legend above the chat says so); the
differences between forwards are each round's drafted tokens accepted and rejected, listed under the answer as it
grows (a forward that committed no text is counted with the next that did, or, at the end of the answer, from the
final statistics). A counter shows tokens, verify forwards, tokens per forward and drafted tokens accepted and
rejected live; when the answer ends, the generation's ``tandem`` statistics (with the usage chunk): verify forwards
and how many tokens they saved, tau, drafted tokens accepted and rejected, time on the network, tokens/s, and one
line of why the draft policy chose what it chose (each mode's predicted rate, the round trip) and how to make the
gateway draft regardless.

Answers are shown as markdown (code blocks, lists, tables) while they stream, each character keeping the shading
of the forward that committed it; the answer as streamed stays underneath (``.runs``, shown with "markdown" off).
The markdown is rendered by marked and sanitised by DOMPurify (``chat_markdown.js``, bundled from clients/web's
locked packages by ``npm run chat-markdown`` and inlined here: the page loads nothing from another origin). Raw HTML
in an answer is shown as text, and the sanitiser returns DOM nodes: the page never assigns markup from an answer.

Stop aborts the stream (the gateway notices the closed connection and cancels the generation); Send is disabled
while an answer streams, so nothing is sent twice; New chat forgets the conversation. An error the server returns
(a missing key's 401, a full verifier's 503, an error event mid-stream) is shown with the server's own message.

"Draft in this browser" runs the drafter in the tab instead (``browser_drafter``: onnxruntime-web on the drafter's
self-contained export, the TypeScript client's round loop) and the verifier checks its chains over a WebSocket
session with an edge token the page mints from the key, each chain as long as the closed form
(``clients/web/src/policy.ts``) prices best on the tab's own rounds; each verdict is one run, and the answer ends
with the drafter's milliseconds per drafted token, tau and tokens/s. Static: no key is needed to load it, the API
calls it makes need one (typed into the page, kept in the tab's memory only).
"""

from pathlib import Path

# marked + DOMPurify, built by clients/web (`npm run chat-markdown`); tests/test_chat_page.py checks it is current
MARKDOWN_JS = (Path(__file__).with_name("chat_markdown.js")).read_text(encoding="utf-8")
if "</script" in MARKDOWN_JS.lower():  # (inlined in a <script> element: this would end it early)
    raise RuntimeError("chat_markdown.js contains '</script': it cannot be inlined")

# how to make the gateway draft whatever the policy predicts (named here, checked against the CLI by the tests)
FORCE_DRAFTING = "tandem serve --gateway-tree 4,16,6"

_PAGE = r"""<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>Tandem chat</title>
<style>
  *, *::before, *::after { box-sizing: border-box; }
  body { font: 15px/1.45 system-ui, sans-serif; max-width: 52rem; margin: 1.5rem auto; padding: 0 1rem; }
  header { display: flex; align-items: center; gap: 1rem; flex-wrap: wrap; }
  header h1 { margin: 0; flex: 1; }
  #legend { font-size: 13px; color: #333; }
  #legend .run { padding: 0 .2em; } #legend .lone { outline: 1px dashed #999; }
  #log { border: 1px solid #ccc; border-radius: 6px; padding: .75rem; min-height: 12rem; overflow-wrap: anywhere; }
  .user { color: #555; margin: .5rem 0; white-space: pre-wrap; }
  .answer { margin: .5rem 0 1rem; }
  .runs { white-space: pre-wrap; font-family: ui-monospace, monospace; font-size: 13px; }
  body:not(.raw) .answer .runs { display: none; }
  body.raw .answer .md { display: none; }
  .md > :first-child { margin-top: 0; } .md > :last-child { margin-bottom: 0; }
  .md pre { background: #f6f8fa; border-radius: 4px; padding: .5rem; overflow-x: auto; max-width: 100%; }
  .md code { font-family: ui-monospace, monospace; font-size: 13px; }
  .md table { display: block; overflow-x: auto; border-collapse: collapse; }
  .md td, .md th { border: 1px solid #ddd; padding: .2rem .4rem; }
  .f0 { background: #dbeafe; } .f1 { background: #fde68a; }
  .lone { background: none; }
  .stopped { color: #777; font-style: italic; }
  .answer.error { color: #b91c1c; white-space: pre-wrap; }
  #stats, #why { color: #333; margin: .5rem 0; font-variant-numeric: tabular-nums; }
  #why { font-size: 13px; }
  #why code { font-size: 12px; }
  .rounds { font-size: 12px; color: #444; margin: -.5rem 0 1rem; } .rounds ol { margin: .25rem 0; columns: 3; }
  form { display: flex; flex-direction: column; gap: .5rem; margin-top: .75rem; }
  #prompt { width: 100%; min-height: 4.5rem; padding: .4rem; font: inherit; resize: vertical; }
  .controls { display: flex; flex-wrap: wrap; align-items: center; gap: .5rem .75rem; }
  #key { flex: 1 1 10rem; min-width: 0; padding: .4rem; }
  #temperature { width: 4rem; } #max { width: 6rem; }
  .controls .buttons { margin-left: auto; display: flex; gap: .5rem; }
  button { padding: .4rem .9rem; font: inherit; }
  @media (max-width: 480px) { body { margin: .75rem auto; padding: 0 .5rem; } .rounds ol { columns: 2; } }
</style>
</head>
<body>
<header>
  <h1>Tandem</h1>
  <button id="new" type="button" title="forget this conversation and start another">New chat</button>
</header>
<p id="legend"><span class="run f0">shaded</span><span class="run f1">runs</span>: the tokens one verify forward
committed together, a draft the target accepted plus its own next token (the colours alternate from forward to
forward). <span class="run lone">Unshaded</span>: a token the verifier decoded alone. Under each answer: every
round's drafted tokens, accepted and rejected.</p>
<div id="log" aria-live="polite"></div>
<div id="stats">tokens 0 &middot; verify forwards 0</div>
<div id="why"></div>
<form id="ask">
  <textarea id="prompt" rows="3" placeholder="Ask something (Enter: send, Shift+Enter: a new line)"></textarea>
  <div class="controls">
    <input id="key" type="password" placeholder="API key (if the server has keys)" autocomplete="off">
    <input id="max" type="number" min="1" placeholder="max tokens"
      title="the answer's most tokens (empty: the server's default)">
    <label>temperature <input id="temperature" type="number" min="0" max="2" step="0.1" value="0"></label>
    <label title="the drafter runs in this tab (onnxruntime-web: WASM, or WebGPU with ?ep=webgpu); the verifier
checks its drafts over a WebSocket session (needs tandem serve --browser-drafter)"><input id="local"
type="checkbox"> draft in this browser</label>
    <label title="off: each answer as streamed, plain text"><input id="markdown" type="checkbox" checked>
      markdown</label>
    <span class="buttons">
      <button id="stop" type="button" disabled title="stop this answer (the server cancels its generation)">Stop
      </button>
      <button id="send" type="submit">Send</button>
    </span>
  </div>
</form>
<script>/*MARKDOWN*/</script>
<script>
const $ = (id) => document.getElementById(id);
const log = $("log"), stats = $("stats"), why = $("why");
const messages = [];  // the conversation, as sent to the server
let busy = null, chat = 0;  // the answer in flight (its AbortController: Stop aborts it); New chat counts up
function line(cls, text) {
  const div = document.createElement("div");
  div.className = cls;
  if (text) div.textContent = text;
  log.appendChild(div);
  return div;
}
// An HTTP error as the server words it: its JSON error's message (OpenAI's shape), else its body.
async function failure(resp) {
  const body = await resp.text().catch(() => "");
  let message = body || resp.statusText;
  try { message = JSON.parse(body).error.message || message; } catch (e) { /* not JSON: the body as it is */ }
  return new Error(`${resp.status}: ${message}`);
}
async function api(path, headers, signal, body) {
  const resp = await fetch(path, body === undefined ? {headers, signal} :
    {method: "POST", headers, signal, body: JSON.stringify(body)});
  if (!resp.ok) throw await failure(resp);
  return resp;
}
function authHeaders() {
  const headers = {"Content-Type": "application/json"}, key = $("key").value;
  if (key) headers["Authorization"] = "Bearer " + key;
  return headers;
}

// -- markdown, keeping the shading: the answer's source is its runs' text; each rendered character takes the run of
// the source character it came from. A rendered text node is matched, from where the last one ended, by the longest
// piece of it found a little ahead in the source, then the rest likewise: markup the renderer consumed (``` or **)
// is skipped over, and a character it made up (a code block's closing line break) stays unshaded.
function shadeOf(run) { return run.className.replace("run", "shade"); }
function render(answer) {
  const runs = answer.querySelector(".runs"), md = answer.querySelector(".md");
  let source = "";
  const owner = [];
  for (const run of runs.children) {
    source += run.textContent;
    for (let i = 0; i < run.textContent.length; i++) owner.push(run);
  }
  const fragment = tandemMarkdown.render(source);
  const walker = document.createTreeWalker(fragment, NodeFilter.SHOW_TEXT), nodes = [];
  while (walker.nextNode()) nodes.push(walker.currentNode);
  let at = 0;
  for (const node of nodes) {
    const text = node.data, pieces = [];
    if (!text.trim()) continue;  // the line breaks between blocks
    const put = (run, ch) => {
      const last = pieces[pieces.length - 1];
      if (last && last.run === run) last.text += ch; else pieces.push({run, text: ch});
    };
    for (let i = 0; i < text.length;) {
      const ahead = source.slice(at, at + text.length - i + 256);
      let lo = 0, hi = text.length - i;  // the longest prefix of text[i:] found ahead (binary search: monotone)
      while (lo < hi) {
        const mid = (lo + hi + 1) >> 1;
        if (ahead.indexOf(text.slice(i, i + mid)) >= 0) lo = mid; else hi = mid - 1;
      }
      const from = lo ? ahead.indexOf(text.slice(i, i + lo)) : -1;
      if (lo === 0 || (lo < 3 && from > 8)) { put(null, text[i]); i += 1; continue; }  // (a stray character)
      for (let k = 0; k < lo; k++) put(owner[at + from + k], text[i + k]);
      at += from + lo;
      i += lo;
    }
    node.replaceWith(...pieces.map(({run, text}) => {
      if (!run) return document.createTextNode(text);
      const span = document.createElement("span");
      span.className = shadeOf(run);
      span.dataset.forward = run.dataset.forward || "";
      span.textContent = text;
      return span;
    }));
  }
  md.replaceChildren(fragment);
}
const pending = new Set();
function rerender(answer) {  // at most once a frame while the answer streams
  if (pending.size === 0) requestAnimationFrame(() => { for (const a of pending) render(a); pending.clear(); });
  pending.add(answer);
}
$("markdown").addEventListener("change", (e) => document.body.classList.toggle("raw", !e.target.checked));

// -- the draft policy's reason, from the generation's statistics
const MODES = {plain: "cloud-only decoding", rounds: "lock-step drafting", draft: "streamed drafting",
               host: "drafted on the verifier's host"};
function explain(policy) {
  const rates = policy.predicted_tokens_per_s || {}, name = (m) => MODES[m] || m;
  const others = Object.entries(rates).filter(([m]) => m !== policy.mode).map(([m, r]) => `${name(m)} ${r}`);
  why.replaceChildren();
  why.append(`Draft policy: ${name(policy.mode)}` + (policy.shape ? ` (tree ${policy.shape})` : "") +
    `, predicted ${rates[policy.mode]} tokens/s` + (others.length ? ` against ${others.join(", ")}` : "") +
    ` (round trip ${policy.rtt_ms} ms; it measures the link, the verifier's and the drafter's speeds and this ` +
    `text's acceptance, and drafts only where that is faster). To draft regardless: `);
  const code = document.createElement("code");
  code.textContent = "/*FORCE*/";
  why.append(code, " (a fixed tree every round), or tandem chat --tree 4,16,6.");
  why.dataset.mode = policy.mode;
}

/*LOCAL*/
async function ask(prompt, signal, out) {  // out.text: the answer so far
  messages.push({role: "user", content: prompt});
  line("user", "> " + prompt);
  const answer = line("answer"), headers = authHeaders();
  const runs = document.createElement("div"), md = document.createElement("div");
  runs.className = "runs"; md.className = "md";
  answer.append(md, runs);
  why.replaceChildren();
  if ($("local").checked) {
    const models = await (await api("/v1/models", headers, signal)).json();
    return await askLocal(answer, runs, headers, models.data[0].id, signal, out);
  }
  const rounds = document.createElement("details"), list = document.createElement("ol");
  const summary = document.createElement("summary");
  rounds.className = "rounds";
  rounds.append(summary, list);
  let drafted = 0, accepted = 0;  // up to the last forward listed
  function round(label, upToDrafted, upToAccepted) {  // one round: the counts since the last one listed
    const d = upToDrafted - drafted, a = upToAccepted - accepted, li = document.createElement("li");
    drafted = upToDrafted; accepted = upToAccepted;
    li.textContent = `${label}: drafted ${d}, accepted ${a}, rejected ${d - a}`;
    Object.assign(li.dataset, {drafted: d, accepted: a});
    list.appendChild(li);
    summary.textContent = `rounds (${list.children.length}): drafted ${drafted}, accepted ${accepted}, ` +
      `rejected ${drafted - accepted}`;
    if (!rounds.isConnected) answer.after(rounds);
    return li;
  }
  const models = await (await api("/v1/models", headers, signal)).json();
  const most = Number($("max").value);
  const resp = await api("/v1/chat/completions", headers, signal, {
    model: models.data[0].id, messages, stream: true, stream_options: {include_usage: true},
    temperature: Number($("temperature").value), ...(most ? {max_tokens: most} : {})});
  const reader = resp.body.getReader(), decoder = new TextDecoder();
  let buffer = "", tokens = 0, forwards = new Set(), last = null, span = null, shade = 0;
  const lone = () => { if (span && span.dataset.n === "1") span.className = "run lone"; };  // decoded alone
  try {
    for (;;) {
      const {value, done} = await reader.read();
      if (done) break;
      buffer += decoder.decode(value, {stream: true});
      let end;
      while ((end = buffer.indexOf("\n\n")) >= 0) {
        const event = buffer.slice(0, end); buffer = buffer.slice(end + 2);
        let id = null, data = null;
        for (const field of event.split("\n")) {
          if (field.startsWith("id: ")) id = field.slice(4);
          else if (field.startsWith("data: ")) data = field.slice(6);
        }
        if (data === null || data === "[DONE]") continue;
        const chunk = JSON.parse(data);
        if (chunk.error) throw new Error(chunk.error.message);  // the server's own words, mid-stream
        if (chunk.tandem) {  // the generation's own statistics, with the usage chunk
          const t = chunk.tandem, n = chunk.usage.completion_tokens;
          if (t.drafted_tokens !== drafted || t.accepted_tokens !== accepted)
            round("after the text", t.drafted_tokens, t.accepted_tokens);  // e.g. a round that ended the answer
          stats.textContent = `tokens ${n} \u00b7 verify forwards ${t.verify_forwards} (${n - t.verify_forwards} ` +
            `saved) \u00b7 tau ${Number(t.tau).toFixed(2)} \u00b7 drafted ${t.drafted_tokens}: accepted ` +
            `${t.accepted_tokens}, rejected ${t.drafted_tokens - t.accepted_tokens} \u00b7 network ` +
            `${t.network_ms} ms \u00b7 ${t.tokens_per_s} tokens/s`;
          if (t.policy && t.policy.mode) {  // the draft policy's last choice, and why
            explain(t.policy);
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
          lone();
          span = document.createElement("span");
          span.className = "run f" + (shade = 1 - shade);
          span.dataset.forward = forward;
          span.title = round("forward " + forward, Number(upToDrafted), Number(upToAccepted)).textContent;
          runs.appendChild(span);
          last = forward;
          forwards.add(forward);
        }
        span.textContent += delta.content;
        span.dataset.n = String(Number(span.dataset.n || 0) + 1);
        out.text += delta.content;
        tokens += 1;
        rerender(answer);
        stats.textContent = `tokens ${tokens} \u00b7 verify forwards ${forwards.size} \u00b7 tokens per forward ` +
          `${(tokens / forwards.size).toFixed(2)} \u00b7 drafted ${drafted}: accepted ${accepted}, rejected ` +
          `${drafted - accepted} \u00b7 this round: ${span.title}`;
      }
    }
  } finally {
    lone();
    render(answer);
  }
}
async function askLocal(answer, runs, headers, model, signal, out) {
  // the device drafts, the verifier checks: a WebSocket session, closed by Stop
  local = local || loadLocal(headers, stats);
  const loaded = await local.catch((e) => { local = null; throw e; }), {edge, drafter} = loaded;
  signal.throwIfAborted();
  const minted = await (await api("/v1/edge-tokens", headers, signal, {ttl_s: 600})).json();
  const origin = location.origin, token = minted.token;
  const [target, tokenizer] = await Promise.all([edge.target(origin, token), edge.loadTokenizer(origin, token)]);
  if (target.vocabSize !== drafter.meta.vocab_size) throw new Error("the drafter's vocabulary is not the target's");
  const prompt = (await (await api("/tokenize", headers, signal, {model, messages})).json()).tokens;
  signal.throwIfAborted();
  const transport = await edge.connect(origin.replace(/^http/, "ws") + "/v1/edge/session", token);
  signal.addEventListener("abort", () => transport.close());  // the verifier's session ends with the socket
  const temperature = Number($("temperature").value), before = {...drafter.stats};
  const most = Number($("max").value) || 512;
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
  let shade = 0, n, prompted = null;  // the drafter's figures once the prompt is in (its first draft)
  try {
    for (;;) {
      const next = await run.next();
      if (next.done) { n = next.value; break; }
      prompted = prompted || {...drafter.stats};
      const span = document.createElement("span");
      span.className = next.value.tokens.length > 1 ? "run f" + (shade = 1 - shade) : "run lone";
      span.textContent = next.value.text;
      span.dataset.n = String(next.value.tokens.length);
      span.dataset.forward = String(runs.children.length + 1);
      runs.appendChild(span);
      tokens.push(...next.value.tokens);
      out.text += next.value.text;
      rerender(answer);
      stats.textContent = `tokens ${tokens.length} \u00b7 verify forwards ${runs.children.length} ` +
        "(drafted in this browser)";
    }
  } finally {
    render(answer);
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
}

// -- one answer at a time: Send waits until it ends, Stop ends it, New chat forgets the conversation
function setBusy(controller) {
  busy = controller;
  $("send").disabled = !!controller;
  $("stop").disabled = !controller;
}
$("ask").addEventListener("submit", (e) => {
  e.preventDefault();
  const input = $("prompt"), prompt = input.value;  // (as typed: code keeps its lines)
  if (busy || !prompt.trim()) return;
  input.value = "";
  const controller = new AbortController(), out = {text: ""}, mine = chat;
  setBusy(controller);
  ask(prompt, controller.signal, out).catch((err) => {
    if (!controller.signal.aborted) line("answer error", "error " + (err && err.message || err));
  }).finally(() => {
    if (busy === controller) setBusy(null);
    if (chat !== mine) return;  // New chat meanwhile: that conversation is gone
    if (controller.signal.aborted) line("stopped", "(stopped)");
    if (out.text) messages.push({role: "assistant", content: out.text});  // (a stopped answer: as far as it got)
    else {  // nothing answered: the question goes, so that the next is not sent after it ...
      messages.pop();
      if (!controller.signal.aborted && !input.value) input.value = prompt;  // ... or, after an error, it is back
    }
  });
});
$("stop").addEventListener("click", () => { if (busy) busy.abort(); });
$("new").addEventListener("click", () => {
  if (busy) { busy.abort(); setBusy(null); }
  chat += 1;
  messages.length = 0;
  log.replaceChildren();
  why.replaceChildren();
  stats.textContent = "tokens 0 \u00b7 verify forwards 0";
  $("prompt").focus();
});
$("prompt").addEventListener("keydown", (e) => {
  if (e.key === "Enter" && !e.shiftKey) { e.preventDefault(); $("ask").requestSubmit(); }
});
</script>
</body>
</html>
"""

_LOCAL = r"""let local = null;  // the in-browser drafter and the client that runs it, loaded once
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
  const meta = await (await api("/v1/edge/drafter/meta.json", headers)).json();
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
  const resp = await api("/v1/edge/drafter/model.onnx", headers);
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
}"""

PAGE = _PAGE.replace("/*LOCAL*/", _LOCAL).replace("/*FORCE*/", FORCE_DRAFTING).replace("/*MARKDOWN*/", MARKDOWN_JS)
