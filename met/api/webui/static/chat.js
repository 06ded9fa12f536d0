// met's web chat: plain JS over the server's own OpenAI API (/v1/models, /v1/chat/completions).
"use strict";

const $ = (id) => document.getElementById(id);
const SETTINGS = ["api-key", "system-prompt", "temperature", "top-p", "max-tokens", "seed"];

// Everything is kept in localStorage, so a reload (or a closed tab) loses nothing.
const store = {
  get(key, fallback) {
    try { return JSON.parse(localStorage.getItem(key)) ?? fallback; } catch { return fallback; }
  },
  set(key, value) { localStorage.setItem(key, JSON.stringify(value)); },
};

const state = {
  conversations: store.get("met.conversations", []),
  currentId: store.get("met.current", null),
  models: [],
  controller: null, // the AbortController of the reply being streamed
};

function save() {
  store.set("met.conversations", state.conversations);
  store.set("met.current", state.currentId);
}

function current() {
  return state.conversations.find((c) => c.id === state.currentId) ?? null;
}

function el(tag, props = {}, ...children) {
  const node = Object.assign(document.createElement(tag), props);
  node.append(...children.filter((c) => c != null));
  return node;
}

// ---- API -------------------------------------------------------------------------------

class ApiError extends Error {}

function api(path, options = {}) {
  const headers = { "Content-Type": "application/json" };
  const key = $("api-key").value.trim();
  if (key) headers.Authorization = `Bearer ${key}`;
  // Relative paths: the page also works behind a proxy that serves it under a prefix.
  return fetch(path, { ...options, headers });
}

// An HTTP error as the person should read it: status, the server's message, what to do.
async function httpError(response) {
  const text = await response.text();
  let message = text || response.statusText;
  try { message = JSON.parse(text).error.message ?? message; } catch { /* not JSON: as is */ }
  let hint = "";
  if (response.status === 401) hint = " — set the server's API key in ⚙ settings.";
  if (response.status === 429) {
    const after = response.headers.get("Retry-After");
    hint = after ? ` — retry in ${after} s.` : " — retry later.";
  }
  return new ApiError(`Error ${response.status}: ${message}${hint}`);
}

function notice(message) {
  $("notice").textContent = message ?? "";
  $("notice").hidden = !message;
}

async function loadModels() {
  try {
    const response = await api("v1/models");
    if (!response.ok) throw await httpError(response);
    state.models = (await response.json()).data;
    const wanted = store.get("met.model", null);
    $("model").replaceChildren(...state.models.map((m) => new Option(m.id, m.id)));
    if (state.models.some((m) => m.id === wanted)) $("model").value = wanted;
    notice(null);
  } catch (e) {
    notice(e instanceof ApiError ? e.message : `Cannot reach the server: ${e.message}`);
  }
  renderTokenCount();
}

function number(id, parse) {
  const raw = $(id).value.trim();
  return raw === "" ? undefined : parse(raw);
}

function requestBody(conversation) {
  const messages = [];
  const system = $("system-prompt").value.trim();
  if (system) messages.push({ role: "system", content: system });
  for (const m of conversation.messages.slice(0, -1)) { // the last one is the reply to come
    if (m.role === "user") messages.push({ role: "user", content: m.content });
    else if (m.content) messages.push({ role: "assistant", content: m.content });
  }
  // Empty fields are left out: the server's (model's) defaults apply.
  return {
    model: $("model").value || undefined,
    messages,
    stream: true,
    stream_options: { include_usage: true },
    temperature: number("temperature", Number),
    top_p: number("top-p", Number),
    max_tokens: number("max-tokens", (v) => parseInt(v, 10)),
    seed: number("seed", (v) => parseInt(v, 10)),
  };
}

// ---- streaming -------------------------------------------------------------------------

async function send() {
  const text = $("input").value.trim();
  if (!text || state.controller) return;
  let conversation = current();
  if (!conversation) conversation = newConversation();
  if (!conversation.messages.length) conversation.title = text.replace(/\s+/g, " ").slice(0, 48);
  conversation.messages.push({ role: "user", content: text });
  const reply = { role: "assistant", content: "", reasoning: "", tool_calls: [], chunks: 0 };
  conversation.messages.push(reply);
  $("input").value = "";
  save();
  render();
  await stream(conversation, reply);
}

async function stream(conversation, reply) {
  state.controller = new AbortController();
  setBusy(true);
  const started = performance.now();
  let first = null;
  let last = null;
  const onChunk = (chunk) => {
    if (chunk.error) throw new ApiError(`Error: ${chunk.error.message}`); // a mid-stream failure
    if (chunk.usage) reply.usage = chunk.usage;
    for (const choice of chunk.choices ?? []) {
      const d = choice.delta ?? {};
      if (d.content || d.reasoning_content || d.tool_calls) {
        last = performance.now();
        first ??= last;
        reply.chunks += 1;
      }
      reply.content += d.content ?? "";
      reply.reasoning += d.reasoning_content ?? "";
      for (const call of d.tool_calls ?? []) mergeToolCall(reply.tool_calls, call);
      if (choice.finish_reason) reply.finish_reason = choice.finish_reason;
    }
    scheduleRender(reply);
  };
  try {
    const response = await api("v1/chat/completions", {
      method: "POST", body: JSON.stringify(requestBody(conversation)),
      signal: state.controller.signal,
    });
    if (!response.ok) throw await httpError(response);
    await readEvents(response, onChunk);
  } catch (e) {
    if (e.name === "AbortError") reply.stopped = true;
    else reply.error = e instanceof ApiError ? e.message : `Connection failed: ${e.message}`;
  } finally {
    state.controller = null;
    reply.stats = replyStats(reply, started, first, last);
    delete reply.chunks;
    save();
    render();
    setBusy(false);
  }
}

// Server-sent events: "data: {json}" blocks separated by a blank line, then "data: [DONE]".
async function readEvents(response, onChunk) {
  const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  try {
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buffer += value.replace(/\r\n/g, "\n");
      let end;
      while ((end = buffer.indexOf("\n\n")) >= 0) {
        const block = buffer.slice(0, end);
        buffer = buffer.slice(end + 2);
        for (const line of block.split("\n")) {
          if (!line.startsWith("data:")) continue;
          const data = line.slice(5).trim();
          if (data === "[DONE]") return;
          onChunk(JSON.parse(data));
        }
      }
    }
  } finally {
    reader.cancel().catch(() => {}); // after an error event too: nothing more is read
  }
  // The server always ends with [DONE], after an error event too: without it, the
  // connection broke (server stopped, proxy timeout) and the reply may be cut short.
  throw new ApiError("Error: the connection closed before the reply was complete.");
}

function mergeToolCall(calls, delta) {
  const index = delta.index ?? calls.length;
  const call = (calls[index] ??= { id: delta.id, name: "", arguments: "" });
  call.name += delta.function?.name ?? "";
  call.arguments += delta.function?.arguments ?? "";
}

// Tokens from the usage chunk; a stopped reply has none, so its chunk count stands in (≈).
function replyStats(reply, started, first, last) {
  const usage = reply.usage;
  const tokens = usage?.completion_tokens ?? reply.chunks;
  const stats = { tokens, exact: usage != null, prompt: usage?.prompt_tokens,
                  total: usage?.total_tokens };
  if (first != null) stats.ttft_ms = first - started;
  // Decode speed: the tokens after the first over the time since the first arrived.
  if (tokens > 1 && last > first) stats.tps = (tokens - 1) / ((last - first) / 1000);
  return stats;
}

function stop() {
  state.controller?.abort(); // closing the connection makes the server abort and free the KV
}

function setBusy(busy) {
  $("send").hidden = busy;
  $("stop").hidden = !busy;
}

// ---- rendering -------------------------------------------------------------------------

function markdown(text) {
  const node = el("div", { className: "markdown" });
  node.innerHTML = DOMPurify.sanitize(marked.parse(text, { gfm: true, breaks: true }));
  for (const code of node.querySelectorAll("pre code")) {
    hljs.highlightElement(code);
    const copy = el("button", { type: "button", className: "copy", textContent: "copy" });
    copy.onclick = () => navigator.clipboard?.writeText(code.textContent);
    code.parentElement.append(copy);
  }
  return node;
}

function renderMessage(m) {
  if (m.role === "user") {
    return el("div", { className: "message user" }, el("div", { className: "content", textContent: m.content }));
  }
  const node = el("div", { className: "message assistant" });
  if (m.reasoning) {
    const details = el("details", { className: "reasoning", open: !!m.reasoningOpen },
      el("summary", { textContent: m.content || m.finish_reason ? "Reasoning" : "Reasoning…" }),
      el("div", { textContent: m.reasoning }));
    details.ontoggle = () => { m.reasoningOpen = details.open; };
    node.append(details);
  }
  node.append(markdown(m.content));
  for (const call of m.tool_calls ?? []) {
    let args = call.arguments;
    try { args = JSON.stringify(JSON.parse(args), null, 2); } catch { /* partial: as is */ }
    node.append(el("div", { className: "tool-call" },
      el("strong", { textContent: `Tool call: ${call.name}` }),
      el("pre", {}, el("code", { textContent: args }))));
  }
  if (m.error) node.append(el("div", { className: "error", textContent: m.error }));
  const s = m.stats;
  if (s && (s.tokens || m.stopped)) {
    const parts = [`${s.exact ? "" : "≈"}${s.tokens} tokens`];
    if (s.tps) parts.push(`${s.tps.toFixed(1)} tok/s`);
    if (s.ttft_ms != null) parts.push(`first token ${Math.round(s.ttft_ms)} ms`);
    if (s.prompt != null) parts.push(`prompt ${s.prompt} tokens`);
    if (m.stopped) parts.push("stopped");
    else if (m.finish_reason === "length") parts.push("cut at max tokens");
    node.append(el("div", { className: "stats", textContent: parts.join(" · ") }));
  }
  return node;
}

let pending = null; // the reply waiting for the next animation frame (one render per frame)

function scheduleRender(reply) {
  if (pending) return;
  pending = reply;
  requestAnimationFrame(() => {
    if (pending !== reply) return; // a full render() came first
    const box = $("messages");
    const atBottom = box.scrollHeight - box.scrollTop - box.clientHeight < 40;
    box.lastElementChild?.replaceWith(renderMessage(pending));
    if (atBottom) box.scrollTop = box.scrollHeight;
    pending = null;
  });
}

function render() {
  pending = null;
  const conversation = current();
  $("messages").replaceChildren(...(conversation?.messages ?? []).map(renderMessage));
  $("messages").scrollTop = $("messages").scrollHeight;
  $("conversations").replaceChildren(...state.conversations.map((c) => {
    const open = el("button", { type: "button", className: "title", textContent: c.title, title: c.title });
    open.onclick = () => { if (!state.controller) { state.currentId = c.id; save(); render(); } };
    open.ondblclick = () => rename(c);
    const ren = el("button", { type: "button", className: "rename", textContent: "✎", title: "Rename" });
    ren.onclick = () => rename(c);
    const del = el("button", { type: "button", className: "delete", textContent: "✕", title: "Delete" });
    del.onclick = () => remove(c);
    return el("li", { className: c.id === state.currentId ? "current" : "" }, open, ren, del);
  }));
  renderTokenCount();
}

function renderTokenCount() {
  const stats = current()?.messages.findLast((m) => m.stats?.total != null)?.stats;
  const max = state.models.find((m) => m.id === $("model").value)?.max_model_len;
  $("token-count").textContent = `${stats?.total ?? 0}${max ? ` / ${max}` : ""} tokens`;
}

// ---- conversations ---------------------------------------------------------------------

function newConversation() {
  const conversation = { id: crypto.randomUUID?.() ?? String(Date.now()), title: "New chat",
                         messages: [], created: Date.now() };
  state.conversations.unshift(conversation);
  state.currentId = conversation.id;
  save();
  render();
  return conversation;
}

function rename(conversation) {
  const title = prompt("Rename the conversation", conversation.title);
  if (title?.trim()) {
    conversation.title = title.trim();
    save();
    render();
  }
}

function remove(conversation) {
  if (state.controller && conversation.id === state.currentId) return;
  if (!confirm(`Delete "${conversation.title}"?`)) return;
  state.conversations = state.conversations.filter((c) => c !== conversation);
  if (state.currentId === conversation.id) state.currentId = state.conversations[0]?.id ?? null;
  save();
  render();
}

// ---- wiring ----------------------------------------------------------------------------

function init() {
  const saved = store.get("met.settings", {});
  for (const id of SETTINGS) {
    $(id).value = saved[id] ?? "";
    $(id).addEventListener("input", () => {
      store.set("met.settings", Object.fromEntries(SETTINGS.map((k) => [k, $(k).value])));
    });
  }
  $("api-key").addEventListener("change", loadModels); // a new key may unlock the model list
  $("model").onchange = () => { store.set("met.model", $("model").value); renderTokenCount(); };
  $("composer").onsubmit = (e) => { e.preventDefault(); send(); };
  $("settings").onsubmit = (e) => e.preventDefault();
  $("stop").onclick = stop;
  $("new-chat").onclick = () => { if (!state.controller) newConversation(); };
  $("toggle-settings").onclick = () => { $("settings").hidden = !$("settings").hidden; };
  // Phone width: the drawer closes on a tap anywhere in the chat, or on picking a conversation.
  $("toggle-sidebar").onclick = () => document.body.classList.toggle("sidebar-open");
  document.querySelector("main").addEventListener("click", (e) => {
    if (!e.target.closest("#toggle-sidebar")) document.body.classList.remove("sidebar-open");
  });
  $("sidebar").addEventListener("click", (e) => {
    if (e.target.closest(".title, #new-chat")) document.body.classList.remove("sidebar-open");
  });
  $("input").addEventListener("keydown", (e) => {
    if (e.key === "Enter" && !e.shiftKey && !e.isComposing) {
      e.preventDefault();
      send();
    }
  });
  document.addEventListener("keydown", (e) => { if (e.key === "Escape") stop(); });
  render();
  loadModels();
  $("input").focus();
}

init();
