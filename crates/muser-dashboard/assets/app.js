// The Muser dashboard. Same-origin only: telemetry from /v1/telemetry/stream, sessions from
// /v1/sessions, nodes from /v1/nodes, chat streamed from /v1/chat/completions. Text reaches
// the page through textContent only. The API key, when the server asks for one, lives in this
// variable and nowhere else.
"use strict";

let apiKey = null;
const HISTORY = 120; // seconds of chart history
const tpsHistory = [];
const ttftHistory = [];
const itlHistory = [];
let lastFrameAt = 0;
let snapshot = null;
let chatSlot = null; // the last slot, once the first snapshot names the count
let chatMessages = [];
let chatAbort = null;

const $ = (id) => document.getElementById(id);

function el(tag, cls, text) {
  const e = document.createElement(tag);
  if (cls) e.className = cls;
  if (text !== undefined) e.textContent = text;
  return e;
}

// ---- HTTP -------------------------------------------------------------------------------

function headers(json) {
  const h = {};
  if (json) h["Content-Type"] = "application/json";
  if (apiKey) h["Authorization"] = "Bearer " + apiKey;
  return h;
}

class HttpError extends Error {
  constructor(status, message) {
    super(message);
    this.status = status;
  }
}

async function api(method, path, body) {
  const init = { method, headers: headers(body !== undefined), credentials: "same-origin" };
  if (body !== undefined) init.body = JSON.stringify(body);
  const r = await fetch(path, init);
  if (r.status === 401) {
    askForKey();
    throw new HttpError(401, "this server needs an API key");
  }
  if (r.status === 204) return null;
  const text = await r.text();
  let data = null;
  try {
    data = text ? JSON.parse(text) : null;
  } catch (_) {
    data = null;
  }
  if (!r.ok) {
    const msg = data && data.error ? data.error.message : r.status + " " + r.statusText;
    throw new HttpError(r.status, msg);
  }
  return data;
}

// Reads a server-sent event stream from a fetch response; calls onEvent(name, data).
async function readEvents(response, onEvent) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buf = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buf += decoder.decode(value, { stream: true });
    let cut;
    while ((cut = buf.indexOf("\n\n")) >= 0) {
      const block = buf.slice(0, cut);
      buf = buf.slice(cut + 2);
      let name = "message";
      const data = [];
      for (const line of block.split("\n")) {
        if (line.startsWith("event:")) name = line.slice(6).trim();
        else if (line.startsWith("data:")) data.push(line.slice(5).replace(/^ /, ""));
      }
      if (data.length) onEvent(name, data.join("\n"));
    }
  }
}

// ---- API key ----------------------------------------------------------------------------

let keyWaiters = [];
function askForKey() {
  const d = $("key-dialog");
  if (!d.open) d.showModal();
  return new Promise((resolve) => keyWaiters.push(resolve));
}

function setupKeyDialog() {
  $("key-button").addEventListener("click", () => askForKey());
  $("key-cancel").addEventListener("click", () => $("key-dialog").close());
  $("key-form").addEventListener("submit", () => {
    const v = $("key-input").value.trim();
    $("key-input").value = "";
    if (v) apiKey = v;
    const waiters = keyWaiters;
    keyWaiters = [];
    waiters.forEach((w) => w());
    refreshAll();
  });
}

// ---- Telemetry --------------------------------------------------------------------------

const val = (m) => (m && m.tag === "measured" && typeof m.value === "number" ? m.value : null);

function fmt(v, digits) {
  if (v === null || v === undefined) return "–";
  if (Math.abs(v) >= 1000) return Math.round(v).toLocaleString("en-US");
  return v.toFixed(digits === undefined ? 1 : digits);
}

function setText(id, text) {
  const e = $(id);
  if (e.textContent !== text) e.textContent = text;
}

function pushHistory(arr, v) {
  arr.push(v);
  while (arr.length > HISTORY) arr.shift();
}

function onSnapshot(s) {
  snapshot = s;
  lastFrameAt = Date.now();
  setBadge("live", "live");
  const model = s.model || {};
  setText("model", (model.id || "model") + " · " + (model.arch || "") + " · " + (model.device || ""));
  const up = val(s.uptime_s);
  if (up !== null) setText("uptime", "up " + duration(up));

  const tps = val(s.throughput && s.throughput.tokens_per_second);
  setText("m-tps", fmt(tps));
  const lane = (s.lanes && s.lanes.local) || {};
  const ttft50 = val(lane.ttft_ms && lane.ttft_ms.p50);
  const ttft95 = val(lane.ttft_ms && lane.ttft_ms.p95);
  const itl50 = val(lane.itl_ms && lane.itl_ms.p50);
  const itl95 = val(lane.itl_ms && lane.itl_ms.p95);
  const dec50 = val(lane.decode_tok_s && lane.decode_tok_s.p50);
  setText("m-ttft", ttft50 === null ? "–" : fmt(ttft50, 0) + " ms");
  setText("m-ttft-sub", "p50 · p95 " + (ttft95 === null ? "–" : fmt(ttft95, 0) + " ms"));
  setText("m-itl", itl50 === null ? "–" : fmt(itl50, 1) + " ms");
  setText("m-itl-sub", "p50 · p95 " + (itl95 === null ? "–" : fmt(itl95, 1) + " ms"));
  setText("m-decode", dec50 === null ? "–" : fmt(dec50) + " tok/s");
  const busy = val(s.slots && s.slots.busy);
  const total = val(s.slots && s.slots.total);
  // the chat keeps to the last slot, so other clients rarely wait on it
  if (chatSlot === null && total) chatSlot = total - 1;
  setText("m-slots", busy === null ? "–" : busy + " / " + total);
  setText("m-queue", "queue " + fmt(val(s.queue && s.queue.depth), 0) + " · rejected " + fmt(val(s.queue && s.queue.rejected_total), 0));
  const occ = val(s.kv && s.kv.occupancy);
  setText("m-kv", occ === null ? "–" : fmt(occ * 100) + " %");
  setText("m-kv-sub", fmt(val(s.kv && s.kv.tokens), 0) + " / " + fmt(val(s.kv && s.kv.capacity_tokens), 0) + " tokens");

  pushHistory(tpsHistory, tps);
  pushHistory(ttftHistory, ttft50);
  pushHistory(itlHistory, itl50);
  drawChart($("chart-tps"), [{ data: tpsHistory, color: "#7c9cff", fill: true }]);
  drawChart($("chart-lat"), [
    { data: ttftHistory, color: "#f5a524" },
    { data: itlHistory, color: "#3ecf8e" },
  ]);
  renderSlots(s);
  renderCaches(s);
}

function duration(s) {
  s = Math.floor(s);
  if (s < 60) return s + " s";
  if (s < 3600) return Math.floor(s / 60) + " min";
  return Math.floor(s / 3600) + " h " + Math.floor((s % 3600) / 60) + " min";
}

function setBadge(state, text) {
  const b = $("live");
  b.dataset.state = state;
  setText("live", text);
  document.body.classList.toggle("stale", state !== "live");
}

function renderSlots(s) {
  const list = (s.slots && s.slots.list) || [];
  const box = $("slots");
  while (box.children.length > list.length) box.lastChild.remove();
  while (box.children.length < list.length) {
    const row = el("div", "slot");
    row.append(el("span", "slot-id"), el("div", "bar"), el("span", "slot-text"));
    row.children[1].append(el("div"));
    box.append(row);
  }
  list.forEach((slot, i) => {
    const row = box.children[i];
    row.classList.toggle("busy", slot.busy);
    row.children[0].textContent = "#" + slot.id + (slot.id === chatSlot ? " chat" : "");
    const cached = val(slot.n_cached) || 0;
    row.children[1].firstChild.style.width = Math.min(100, (100 * cached) / slot.n_ctx) + "%";
    row.children[2].textContent = slot.busy
      ? "generating · " + (val(slot.n_gen) || 0) + " tok"
      : cached + " / " + slot.n_ctx;
  });
  setText("slots-hint", (val(s.slots.busy) || 0) + " busy · queue " + (val(s.queue.depth) || 0));
}

function meter(barId, textId, ratio, text) {
  $(barId).style.width = ratio === null ? "0%" : Math.min(100, ratio * 100) + "%";
  setText(textId, text);
}

function renderCaches(s) {
  const occ = val(s.kv && s.kv.occupancy);
  meter("kv-bar", "kv-text", occ, occ === null ? "–" : fmt(occ * 100) + " %");
  const pc = s.prompt_cache || {};
  const reuse = val(pc.token_hit_rate);
  meter("reuse-bar", "reuse-text", reuse, reuse === null ? "–" : fmt(reuse * 100) + " %");
  const store = pc.store;
  $("store-meter").hidden = !store;
  const facts = [["Tokens reused", fmt(val(pc.cached_tokens_total), 0)]];
  if (store) {
    const hr = val(store.hit_rate);
    meter("store-bar", "store-text", hr, fmt(hr * 100) + " %");
    facts.push(["Cache memory", bytes(val(store.memory_bytes))], ["Cache disk", bytes(val(store.disk_bytes))]);
  }
  if (s.sessions) facts.push(["Sessions saved", fmt(val(s.sessions.count), 0)]);
  const dl = $("cache-facts");
  dl.replaceChildren();
  for (const [k, v] of facts) dl.append(el("dt", null, k), el("dd", null, v));
}

function bytes(n) {
  if (n === null) return "–";
  const units = ["B", "KiB", "MiB", "GiB"];
  let i = 0;
  while (n >= 1024 && i < units.length - 1) {
    n /= 1024;
    i++;
  }
  return n.toFixed(i ? 1 : 0) + " " + units[i];
}

function drawChart(canvas, series) {
  const dpr = window.devicePixelRatio || 1;
  const w = canvas.clientWidth;
  const h = canvas.clientHeight;
  if (canvas.width !== w * dpr || canvas.height !== h * dpr) {
    canvas.width = w * dpr;
    canvas.height = h * dpr;
  }
  const g = canvas.getContext("2d");
  g.setTransform(dpr, 0, 0, dpr, 0, 0);
  g.clearRect(0, 0, w, h);
  let max = 0;
  for (const s of series) for (const v of s.data) if (v !== null && v > max) max = v;
  const top = niceMax(max);
  const left = 44;
  const bottom = h - 18;
  g.font = "11px system-ui, sans-serif";
  g.fillStyle = "#7d8597";
  g.strokeStyle = "rgba(255,255,255,0.06)";
  g.lineWidth = 1;
  for (let i = 0; i <= 3; i++) {
    const y = 8 + ((bottom - 8) * i) / 3;
    g.beginPath();
    g.moveTo(left, y);
    g.lineTo(w, y);
    g.stroke();
    g.fillText(fmt(top * (1 - i / 3), top < 10 ? 1 : 0), 4, y + 4);
  }
  g.fillText("-" + HISTORY + " s", left, h - 4);
  g.fillText("now", w - 24, h - 4);
  const x = (i) => left + ((w - left) * i) / (HISTORY - 1);
  const y = (v) => bottom - ((bottom - 8) * v) / top;
  for (const s of series) {
    const off = HISTORY - s.data.length;
    g.strokeStyle = s.color;
    g.lineWidth = 2;
    g.beginPath();
    let started = false;
    s.data.forEach((v, i) => {
      if (v === null) {
        started = false;
        return;
      }
      if (!started) g.moveTo(x(off + i), y(v));
      else g.lineTo(x(off + i), y(v));
      started = true;
    });
    g.stroke();
    if (s.fill && s.data.length > 1) {
      g.lineTo(x(off + s.data.length - 1), bottom);
      g.lineTo(x(off), bottom);
      g.closePath();
      const grad = g.createLinearGradient(0, 8, 0, bottom);
      grad.addColorStop(0, "rgba(124,156,255,0.35)");
      grad.addColorStop(1, "rgba(124,156,255,0)");
      g.fillStyle = grad;
      g.fill();
    }
  }
}

function niceMax(v) {
  if (v <= 0) return 1;
  const p = Math.pow(10, Math.floor(Math.log10(v)));
  for (const m of [1, 2, 5, 10]) if (m * p >= v * 1.1) return m * p;
  return 10 * p;
}

async function telemetryLoop() {
  for (;;) {
    try {
      const r = await fetch("/v1/telemetry/stream", { headers: headers(false), credentials: "same-origin" });
      if (r.status === 401) {
        setBadge("locked", "API key needed");
        await askForKey();
        continue;
      }
      if (!r.ok) throw new Error("telemetry " + r.status);
      await readEvents(r, (name, data) => {
        if (name === "snapshot") onSnapshot(JSON.parse(data));
      });
    } catch (_) {
      // reconnect below
    }
    setBadge("down", "disconnected");
    await new Promise((res) => setTimeout(res, 2000));
  }
}

function staleWatch() {
  setInterval(() => {
    if (!lastFrameAt) return;
    const age = (Date.now() - lastFrameAt) / 1000;
    if (age > 4 && $("live").dataset.state === "live") setBadge("stale", "stale · " + Math.round(age) + " s ago");
  }, 1000);
}

// ---- Nodes ------------------------------------------------------------------------------

async function refreshNodes() {
  const box = $("nodes");
  const none = "No nodes configured. This Muser serves alone.";
  const registry = !!(snapshot && snapshot.features && snapshot.features.node_registry);
  $("node-form").hidden = !registry;
  if (!registry) {
    box.replaceChildren(el("p", "empty", snapshot ? none : "Waiting for the server…"));
    return;
  }
  try {
    const data = await api("GET", "/v1/nodes");
    const nodes = (data && (data.data || data.nodes)) || [];
    box.replaceChildren();
    if (!nodes.length) box.append(el("p", "empty", none));
    for (const n of nodes) {
      const card = el("div", "node");
      card.append(el("span", "node-name", String(n.name || n.id || "node")), el("span", "node-state", String(n.state || n.status || "unknown")));
      box.append(card);
    }
  } catch (e) {
    box.replaceChildren(el("p", "empty", "Nodes unavailable: " + e.message));
  }
}

// Enrolls a node with the code it printed: POST /v1/nodes runs preflight, model, keys,
// handoff; each step's result (or the failed step) is listed under the form.
async function addNode(e) {
  e.preventDefault();
  const steps = $("node-steps");
  const body = { name: $("node-name").value.trim(), url: $("node-url").value.trim(), code: $("node-code").value.trim() };
  $("node-code").value = "";
  $("node-add").disabled = true;
  steps.replaceChildren(el("li", "", "enrolling " + body.name + "…"));
  try {
    const r = await api("POST", "/v1/nodes", body);
    steps.replaceChildren(...(r.steps || []).map((s) => el("li", "", s.step + ": " + s.result)));
  } catch (err) {
    steps.replaceChildren(el("li", "bad", "failed: " + err.message));
  } finally {
    $("node-add").disabled = false;
    refreshNodes();
  }
}

// ---- Chat -------------------------------------------------------------------------------

function addBubble(role, text) {
  const empty = $("chat-empty");
  if (empty) empty.remove();
  const b = el("div", "bubble " + role);
  b.append(el("div", "role", role === "user" ? "You" : "Model"), el("div", "text", text));
  $("chat-log").append(b);
  $("chat-log").scrollTop = $("chat-log").scrollHeight;
  return b.lastChild;
}

function renderChat() {
  $("chat-log").replaceChildren();
  if (!chatMessages.length) {
    const p = el("p", "empty", "Ask something. Answers stream token by token.");
    p.id = "chat-empty";
    $("chat-log").append(p);
  }
  for (const m of chatMessages) addBubble(m.role === "user" ? "user" : "assistant", m.content);
}

async function sendChat(ev) {
  ev.preventDefault();
  const input = $("chat-input");
  const text = input.value.trim();
  if (!text || chatAbort || chatSlot === null) return;
  input.value = "";
  chatMessages.push({ role: "user", content: text });
  addBubble("user", text);
  const out = addBubble("assistant", "");
  out.parentElement.classList.add("streaming");
  chatAbort = new AbortController();
  $("chat-send").disabled = true;
  $("chat-stop").disabled = false;
  const started = performance.now();
  let first = null;
  let n = 0;
  let answer = "";
  let usage = null;
  try {
    const r = await fetch("/v1/chat/completions", {
      method: "POST",
      headers: headers(true),
      credentials: "same-origin",
      signal: chatAbort.signal,
      body: JSON.stringify({
        messages: chatMessages,
        stream: true,
        stream_options: { include_usage: true },
        max_tokens: 256,
        temperature: 0,
        id_slot: chatSlot,
      }),
    });
    if (r.status === 401) {
      askForKey();
      throw new Error("this server needs an API key");
    }
    if (!r.ok) {
      const body = await r.json().catch(() => null);
      throw new Error(body && body.error ? body.error.message : "HTTP " + r.status);
    }
    await readEvents(r, (_, data) => {
      if (data === "[DONE]") return;
      const chunk = JSON.parse(data);
      if (chunk.usage) usage = chunk.usage;
      const delta = chunk.choices && chunk.choices[0] && chunk.choices[0].delta;
      if (delta && delta.content) {
        if (first === null) first = performance.now();
        n++;
        answer += delta.content;
        out.textContent = answer;
        $("chat-log").scrollTop = $("chat-log").scrollHeight;
      }
    });
    chatMessages.push({ role: "assistant", content: answer });
    const ttft = first === null ? null : first - started;
    const secs = first === null ? 0 : (performance.now() - first) / 1000;
    const parts = [];
    if (ttft !== null) parts.push("first token " + fmt(ttft, 0) + " ms");
    if (secs > 0 && n > 1) parts.push(fmt((n - 1) / secs) + " tok/s");
    if (usage) {
      parts.push(usage.completion_tokens + " tokens");
      const cached = usage.prompt_tokens_details && usage.prompt_tokens_details.cached_tokens;
      if (cached) parts.push(cached + " prompt tokens reused");
    }
    setText("chat-stats", parts.join(" · "));
  } catch (e) {
    if (e.name === "AbortError") {
      if (answer) chatMessages.push({ role: "assistant", content: answer });
      else chatMessages.pop();
      setText("chat-stats", "stopped");
    } else {
      chatMessages.pop();
      out.textContent = "Error: " + e.message;
      out.parentElement.classList.add("error");
    }
  } finally {
    out.parentElement.classList.remove("streaming");
    chatAbort = null;
    $("chat-send").disabled = false;
    $("chat-stop").disabled = true;
  }
}

function setupChat() {
  $("chat-form").addEventListener("submit", sendChat);
  $("chat-input").addEventListener("keydown", (e) => {
    if (e.key === "Enter" && !e.shiftKey) {
      e.preventDefault();
      $("chat-form").requestSubmit();
    }
  });
  $("chat-stop").addEventListener("click", () => chatAbort && chatAbort.abort());
  $("chat-clear").addEventListener("click", () => {
    if (chatAbort) chatAbort.abort();
    chatMessages = [];
    renderChat();
    setText("chat-stats", "");
  });
}

// ---- Sessions ---------------------------------------------------------------------------

function sessionStatus(text, bad) {
  const s = $("session-status");
  s.textContent = text;
  s.classList.toggle("bad", !!bad);
}

async function refreshSessions() {
  const list = $("session-list");
  try {
    const data = await api("GET", "/v1/sessions");
    list.replaceChildren();
    if (!data.data.length) list.append(el("li", "empty", "No sessions yet. Chat, then save."));
    for (const s of data.data) {
      const li = el("li", "session");
      const info = el("div", "session-info");
      info.append(
        el("span", "session-id", s.id),
        el("span", "session-meta", "rev " + s.revision + " · " + s.n_messages + " messages · " + s.n_tokens + " tokens · " + new Date(s.saved_at * 1000).toLocaleTimeString())
      );
      const restore = el("button", "small ghost", "Restore");
      restore.type = "button";
      restore.dataset.session = s.id;
      restore.addEventListener("click", () => restoreSession(s.id));
      const get = el("button", "small ghost", "Bundle");
      get.type = "button";
      get.title = "Download the encrypted bundle";
      get.addEventListener("click", () => downloadBundle(s.id));
      const actions = el("div", "session-actions");
      actions.append(restore, get);
      li.append(info, actions);
      list.append(li);
    }
  } catch (e) {
    list.replaceChildren(el("li", "empty", e.status === 404 ? "Sessions are off on this server." : "Sessions unavailable: " + e.message));
  }
}

async function saveSession() {
  if (!chatMessages.length) {
    sessionStatus("Nothing to save yet: send a message first.", true);
    return;
  }
  try {
    const s = await api("POST", "/v1/sessions", { slot: chatSlot, messages: chatMessages });
    sessionStatus("Saved " + s.id + " (" + s.n_tokens + " tokens, revision " + s.revision + ").");
    await refreshSessions();
  } catch (e) {
    sessionStatus("Save failed: " + e.message, true);
  }
}

async function restoreSession(id) {
  if (chatAbort) chatAbort.abort();
  try {
    const s = await api("POST", "/v1/sessions/" + encodeURIComponent(id) + "/restore", { slot: chatSlot });
    chatMessages = s.messages.filter((m) => typeof m.content === "string");
    renderChat();
    sessionStatus("Restored " + s.id + ": " + s.n_restored + " tokens back in slot " + s.slot + ". Continue the chat.");
  } catch (e) {
    sessionStatus("Restore failed: " + e.message, true);
  }
}

async function downloadBundle(id) {
  try {
    const r = await fetch("/v1/sessions/" + encodeURIComponent(id) + "/bundle", { headers: headers(false), credentials: "same-origin" });
    if (!r.ok) throw new Error("HTTP " + r.status);
    const url = URL.createObjectURL(await r.blob());
    const a = el("a");
    a.href = url;
    a.download = id + ".bundle";
    a.click();
    setTimeout(() => URL.revokeObjectURL(url), 1000);
  } catch (e) {
    sessionStatus("Download failed: " + e.message, true);
  }
}

// ---- Start ------------------------------------------------------------------------------

function refreshAll() {
  refreshNodes();
  refreshSessions();
}

async function start() {
  setupKeyDialog();
  setupChat();
  $("session-save").addEventListener("click", saveSession);
  $("node-form").addEventListener("submit", addNode);
  try {
    onSnapshot(await api("GET", "/v1/telemetry"));
  } catch (_) {
    // the stream below reports the state
  }
  refreshAll();
  setInterval(() => {
    if (!document.hidden) refreshNodes();
  }, 5000);
  staleWatch();
  telemetryLoop();
}

document.addEventListener("DOMContentLoaded", start);
