// quickdraft's chat page: conversations in localStorage, answers streamed from this server's
// /v1/chat/completions with "quickdraft": {"provenance": true}, so every answer shows which
// of its tokens came from drafts the model accepted, and how fast it was.
import { escapeHtml, render } from "./markdown.js";

const $ = (sel, el = document) => el.querySelector(sel);
const SETTINGS = ["temperature", "top_p", "max_tokens", "seed"];
const INTEGER = new Set(["max_tokens", "seed"]);
const el = {
  list: $("#conversations"), title: $("#title"), messages: $("#messages"), prompt: $("#prompt"),
  send: $("#send"), stop: $("#stop"), banner: $("#banner"), settings: $("#settings"),
  model: $("#model-name"), modelInfo: $("#model-info"), drafts: $("#show-drafts"),
  keyDialog: $("#key-dialog"), key: $("#api-key"), forgetKey: $("#forget-key"),
};

// ------------------------------------------------------------------------------- storage

const store = {
  get(key, fallback) {
    try {
      const value = localStorage.getItem(`quickdraft.${key}`);
      return value === null ? fallback : JSON.parse(value);
    } catch {
      return fallback;
    }
  },
  set(key, value) {
    try {
      localStorage.setItem(`quickdraft.${key}`, JSON.stringify(value));
    } catch (err) {
      banner(`could not save in this browser's storage: ${err.message}`);
    }
  },
};

const state = {
  convs: store.get("conversations", []),
  current: store.get("current", null),
  settings: { system: "", ...store.get("settings", {}) },
  apiKey: store.get("apiKey", ""),
  model: null,
  busy: null, // {controller, conv, msg} while an answer streams
};

const save = () => store.set("conversations", state.convs);
const conv = () => state.convs.find((c) => c.id === state.current) || null;
const newId = () => `${Date.now().toString(36)}${Math.random().toString(36).slice(2, 8)}`;

function banner(text) {
  el.banner.textContent = text || "";
  el.banner.hidden = !text;
}

// ------------------------------------------------------------------------- conversations

function newConversation() {
  const c = { id: newId(), title: "New chat", created: Date.now(), updated: Date.now(), messages: [] };
  state.convs.unshift(c);
  select(c.id);
  return c;
}

function select(id) {
  state.current = id;
  store.set("current", id);
  save();
  renderSidebar();
  renderMessages();
}

function renderSidebar() {
  el.list.replaceChildren();
  const sorted = [...state.convs].sort((a, b) => b.updated - a.updated);
  for (const c of sorted) {
    const li = document.createElement("li");
    li.className = c.id === state.current ? "current" : "";
    li.dataset.id = c.id;
    li.innerHTML =
      `<span class="conv-title">${escapeHtml(c.title)}</span>` +
      `<button type="button" class="rename" title="Rename">✎</button>` +
      `<button type="button" class="delete" title="Delete">✕</button>`;
    el.list.append(li);
  }
  const current = conv();
  el.title.textContent = current ? current.title : "New chat";
  document.title = current ? `${current.title} · quickdraft` : "quickdraft";
}

function rename(li, c) {
  const input = document.createElement("input");
  input.value = c.title;
  li.querySelector(".conv-title").replaceWith(input);
  input.focus();
  input.select();
  const done = (keep) => {
    if (keep && input.value.trim()) c.title = input.value.trim();
    save();
    renderSidebar();
  };
  input.addEventListener("keydown", (e) => {
    if (e.key === "Enter") done(true);
    if (e.key === "Escape") done(false);
  });
  input.addEventListener("blur", () => done(true));
}

function remove(c) {
  if (!confirm(`Delete "${c.title}"?`)) return;
  if (state.busy && state.busy.conv === c) state.busy.controller.abort();
  state.convs = state.convs.filter((x) => x !== c);
  if (state.current === c.id) state.current = state.convs.length ? state.convs[0].id : null;
  store.set("current", state.current);
  save();
  renderSidebar();
  renderMessages();
}

el.list.addEventListener("click", (e) => {
  const li = e.target.closest("li");
  const c = li && state.convs.find((x) => x.id === li.dataset.id);
  if (!c || e.target.tagName === "INPUT") return;
  if (e.target.classList.contains("rename")) rename(li, c);
  else if (e.target.classList.contains("delete")) remove(c);
  else if (c.id !== state.current) select(c.id);
});
$("#new-chat").addEventListener("click", () => {
  const empty = state.convs.find((c) => !c.messages.length);
  if (empty) select(empty.id);
  else newConversation();
  el.prompt.focus();
});

// ------------------------------------------------------------------------------ messages

function renderMessages() {
  const c = conv();
  el.messages.replaceChildren();
  if (!c || !c.messages.length) {
    el.messages.innerHTML =
      `<div class="empty">Ask something. Answers stream with their speed, and text that came ` +
      `from accepted drafts is <span class="dr">marked like this</span>.</div>`;
    return;
  }
  c.messages.forEach((m, i) => el.messages.append(messageElement(c, m, i)));
  el.messages.scrollTop = el.messages.scrollHeight;
}

function messageElement(c, m, i) {
  const div = document.createElement("div");
  div.className = `msg ${m.role}`;
  div.dataset.index = i;
  div.innerHTML = `<div class="body"></div><div class="meta"></div>`;
  fillMessage(div, c, m, i);
  return div;
}

function fillMessage(div, c, m, i) {
  const body = $(".body", div);
  const meta = $(".meta", div);
  const last = i === c.messages.length - 1;
  const live = state.busy && state.busy.msg === m;
  div.classList.toggle("streaming", Boolean(live));
  if (m.role === "user") {
    body.textContent = m.content;
    meta.innerHTML = state.busy ? "" : `<button type="button" class="edit">Edit</button>`;
  } else {
    body.innerHTML = render(m.content, utf16Spans(m.content, m.drafts || []));
    meta.innerHTML =
      `<span class="stats">${escapeHtml(statsLine(m, live))}</span>` +
      (live ? "" : `<button type="button" class="copy-answer">Copy</button>`) +
      (live || !last ? "" : `<button type="button" class="regenerate">Regenerate</button>`);
  }
  let error = $(".error", div);
  if (m.error && !error) {
    error = document.createElement("div");
    error.className = "error";
    div.append(error);
  }
  if (error) error.textContent = m.error || "";
  if (error && !m.error) error.remove();
}

function updateLive(m) {
  const c = conv();
  const i = c ? c.messages.indexOf(m) : -1;
  const div = i >= 0 && el.messages.querySelector(`.msg[data-index="${i}"]`);
  if (!div) return;
  const stick = el.messages.scrollHeight - el.messages.scrollTop - el.messages.clientHeight < 60;
  fillMessage(div, c, m, i);
  if (stick) el.messages.scrollTop = el.messages.scrollHeight;
}

let frame = 0;
function scheduleUpdate(m) {
  if (frame) return;
  frame = requestAnimationFrame(() => {
    frame = 0;
    updateLive(m);
  });
}

// The server's offsets count code points; JS strings index UTF-16 units.
function utf16Spans(text, spans) {
  if (!spans.length || !/[\uD800-\uDBFF]/.test(text)) return spans;
  const at = [];
  let u = 0;
  for (const ch of text) {
    at.push(u);
    u += ch.length;
  }
  at.push(u);
  const map = (i) => (i < at.length ? at[i] : u + i - at.length + 1);
  return spans.map(([a, b]) => [map(a), map(b)]);
}

const fmt = (x, digits) => (Number.isFinite(x) ? x.toFixed(digits) : "–");

function statsLine(m, live) {
  const n = m.tokens || 0;
  const drafted = m.accepted ? ` · ${m.accepted} from drafts (${Math.round((100 * m.accepted) / Math.max(n, 1))}%)` : "";
  if (m.usage) {
    const q = m.usage.quickdraft;
    const rate = q.drafted ? `${Math.round((100 * q.accepted) / q.drafted)}% of ${q.drafted} drafted accepted` : "no drafts";
    const end = m.finish === "length" ? " · stopped at max tokens" : "";
    return (
      `${m.usage.completion_tokens} tokens · ${fmt(q.tokens_per_second, 1)} tok/s · ` +
      `first token ${fmt(q.ttft_s, 2)} s · τ ${fmt(q.tau, 2)} · ${rate}${drafted}${end}`
    );
  }
  const speed = m.clientTps ? ` · ${fmt(m.clientTps, 1)} tok/s` : "";
  const ttft = m.clientTtft ? ` · first token ${fmt(m.clientTtft, 2)} s` : "";
  if (live) return n ? `${n} tokens${speed}${ttft}${drafted}` : "waiting for the first token…";
  if (m.stopped) return `stopped · ${n} tokens${speed}${ttft}${drafted}`;
  return n ? `${n} tokens${drafted}` : "";
}

el.messages.addEventListener("click", async (e) => {
  const btn = e.target.closest("button");
  const div = btn && btn.closest(".msg");
  const c = conv();
  if (!btn || !c) return;
  if (btn.classList.contains("copy")) {
    copyText($("code", btn.closest(".code")).textContent, btn);
    return;
  }
  if (!div) return;
  const i = Number(div.dataset.index);
  const m = c.messages[i];
  if (btn.classList.contains("copy-answer")) copyText(m.content, btn);
  else if (btn.classList.contains("regenerate") && !state.busy) {
    c.messages.splice(i);
    await answer(c);
  } else if (btn.classList.contains("edit") && !state.busy) editMessage(div, c, i);
});

function editMessage(div, c, i) {
  const box = document.createElement("div");
  box.className = "editing";
  box.innerHTML =
    `<textarea></textarea><div class="buttons"><button type="button" class="save">Save & send</button>` +
    `<button type="button" class="cancel">Cancel</button></div>`;
  const area = $("textarea", box);
  area.value = c.messages[i].content;
  $(".body", div).replaceWith(box);
  $(".meta", div).replaceChildren();
  area.focus();
  $(".cancel", box).addEventListener("click", renderMessages);
  const submit = async () => {
    const text = area.value.trim();
    if (!text || state.busy) return;
    c.messages.splice(i);
    c.messages.push({ role: "user", content: text });
    await answer(c);
  };
  $(".save", box).addEventListener("click", submit);
  area.addEventListener("keydown", (e) => {
    if (e.key === "Enter" && !e.shiftKey && !e.isComposing) {
      e.preventDefault();
      submit();
    }
  });
}

async function copyText(text, btn) {
  try {
    await navigator.clipboard.writeText(text);
  } catch {
    const area = document.createElement("textarea"); // no clipboard API off a secure origin
    area.value = text;
    document.body.append(area);
    area.select();
    document.execCommand("copy");
    area.remove();
  }
  const before = btn.textContent;
  btn.textContent = "Copied";
  setTimeout(() => (btn.textContent = before), 1200);
}

// ---------------------------------------------------------------------------- generation

function headers() {
  const h = { "Content-Type": "application/json" };
  if (state.apiKey) h.Authorization = `Bearer ${state.apiKey}`;
  return h;
}

function requestBody(c) {
  const messages = [];
  if (state.settings.system.trim()) messages.push({ role: "system", content: state.settings.system });
  for (const m of c.messages) {
    if (m.role === "assistant" && !m.content) continue; // failed or stopped before a token
    messages.push({ role: m.role, content: m.content });
  }
  const body = { model: state.model, messages, stream: true, quickdraft: { provenance: true } };
  for (const key of SETTINGS) {
    const raw = String(state.settings[key] ?? "").trim();
    if (raw === "") continue;
    const value = Number(raw);
    body[key] = Number.isFinite(value) ? value : raw; // the server says what is wrong with it
  }
  return body;
}

async function send(text) {
  if (state.busy || !text.trim()) return;
  const c = conv() || newConversation();
  c.messages.push({ role: "user", content: text });
  if (c.title === "New chat") c.title = text.trim().split("\n")[0].slice(0, 60);
  el.prompt.value = "";
  await answer(c);
}

async function answer(c) {
  if (!state.model && !(await loadModel(() => answer(c)))) return;
  clearFieldErrors();
  banner("");
  const m = { role: "assistant", content: "", drafts: [], tokens: 0, accepted: 0 };
  const body = requestBody(c);
  c.messages.push(m);
  c.updated = Date.now();
  const controller = new AbortController();
  state.busy = { controller, conv: c, msg: m };
  setBusy(true);
  save();
  renderSidebar();
  renderMessages();
  try {
    const res = await fetch("/v1/chat/completions", {
      method: "POST", headers: headers(), body: JSON.stringify(body), signal: controller.signal,
    });
    if (res.ok) await readAnswer(res, m);
    else await refused(res, c, m);
  } catch (err) {
    if (err.name === "AbortError") m.stopped = true;
    else if (err.name === "SyntaxError") m.error = `The server sent an event that is not JSON (${err.message}).`;
    else m.error = `The connection to the server failed (${err.message}); the conversation is kept, try again.`;
  } finally {
    state.busy = null;
    setBusy(false);
    c.updated = Date.now();
    save();
    if (conv() === c) renderMessages();
  }
}

async function readAnswer(res, m) {
  const t0 = performance.now();
  let first = 0;
  const done = await readEvents(res, (chunk) => {
    if (chunk.error) throw new ServerError(chunk.error.message);
    const choice = chunk.choices && chunk.choices[0];
    if (choice && choice.delta && choice.delta.content) {
      m.content += choice.delta.content;
      if (!first) {
        first = performance.now();
        m.clientTtft = (first - t0) / 1000;
      }
    }
    const q = chunk.quickdraft;
    if (q) {
      m.tokens += q.tokens;
      m.accepted += q.accepted;
      for (const span of q.accepted_text) addSpan(m.drafts, span);
    }
    if (first && m.tokens > 1) m.clientTps = (m.tokens - 1) / Math.max(1e-3, (performance.now() - first) / 1000);
    if (choice && choice.finish_reason) m.finish = choice.finish_reason;
    if (chunk.usage) m.usage = chunk.usage;
    scheduleUpdate(m);
  }).catch((err) => {
    if (!(err instanceof ServerError)) throw err;
    m.error = `The server stopped the answer: ${err.message}`;
    return true;
  });
  if (!done) m.error = "The server closed the connection before the answer finished; what came is kept.";
}

function addSpan(spans, [a, b]) {
  const last = spans[spans.length - 1];
  if (last && last[1] === a) last[1] = b;
  else spans.push([a, b]);
}

class ServerError extends Error {}

// Calls onChunk with each server-sent event's JSON; true once [DONE] came.
async function readEvents(res, onChunk) {
  const reader = res.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return false;
    buffer += decoder.decode(value, { stream: true });
    let cut;
    while ((cut = buffer.indexOf("\n\n")) >= 0) {
      const event = buffer.slice(0, cut);
      buffer = buffer.slice(cut + 2);
      for (const line of event.split("\n")) {
        if (!line.startsWith("data:")) continue;
        const data = line.slice(5).trim();
        if (data === "[DONE]") return true;
        onChunk(JSON.parse(data));
      }
    }
  }
}

// A refused request (4xx/5xx): the message where it belongs; the conversation stays.
async function refused(res, c, m) {
  let message = `${res.status} ${res.statusText}`;
  let param = null;
  try {
    const data = await res.json();
    if (data.error) {
      message = data.error.message || message;
      param = data.error.param;
    }
  } catch {
    // not JSON: keep the status line
  }
  if (res.status === 401) {
    c.messages.splice(c.messages.indexOf(m), 1);
    askKey(state.apiKey ? "The server refused this API key." : "", () => answer(c));
    return;
  }
  m.error = `The server refused the request (${res.status}): ${message}`;
  if (param) fieldError(param === "messages" && state.settings.system ? "messages" : param, message);
}

function fieldError(param, message) {
  const slot = el.settings.querySelector(`.field-error[data-for="${CSS.escape(param)}"]`);
  if (!slot) return;
  slot.textContent = message;
  const input = el.settings.querySelector(`[name="${CSS.escape(param === "messages" ? "system" : param)}"]`);
  if (input) input.classList.add("invalid");
  showSettings(true);
}

function clearFieldErrors() {
  el.settings.querySelectorAll(".field-error").forEach((s) => (s.textContent = ""));
  el.settings.querySelectorAll(".invalid").forEach((i) => i.classList.remove("invalid"));
}

function setBusy(busy) {
  el.send.hidden = busy;
  el.stop.hidden = !busy;
}

el.stop.addEventListener("click", () => {
  if (state.busy) state.busy.controller.abort(); // the server frees the sequence at its next step
});

el.prompt.addEventListener("keydown", (e) => {
  if (e.key === "Enter" && !e.shiftKey && !e.isComposing) {
    e.preventDefault();
    send(el.prompt.value);
  }
});
$("#composer").addEventListener("submit", (e) => {
  e.preventDefault();
  send(el.prompt.value);
});

// ------------------------------------------------------------------------------ settings

function showSettings(open) {
  el.settings.hidden = !open;
  $("#settings-toggle").setAttribute("aria-expanded", String(open));
}

$("#settings-toggle").addEventListener("click", () => showSettings(el.settings.hidden));
for (const key of ["system", ...SETTINGS]) {
  const input = $(`#set-${key}`);
  input.value = state.settings[key] ?? "";
  input.addEventListener("input", () => {
    state.settings[key] = input.value;
    store.set("settings", state.settings);
    input.classList.remove("invalid");
    const slot = el.settings.querySelector(`.field-error[data-for="${key === "system" ? "messages" : key}"]`);
    if (slot) slot.textContent = "";
  });
  if (INTEGER.has(key)) input.setAttribute("inputmode", "numeric");
}

el.drafts.checked = store.get("showDrafts", true);
document.body.classList.toggle("hide-drafts", !el.drafts.checked);
el.drafts.addEventListener("change", () => {
  document.body.classList.toggle("hide-drafts", !el.drafts.checked);
  store.set("showDrafts", el.drafts.checked);
});

// ------------------------------------------------------------------------------- API key

function askKey(why, then) {
  el.key.value = "";
  el.keyDialog.returnValue = "";
  el.keyDialog.onclose = () => {
    if (el.keyDialog.returnValue !== "ok" || !el.key.value) return;
    state.apiKey = el.key.value;
    store.set("apiKey", state.apiKey);
    el.forgetKey.hidden = false;
    if (then) then();
  };
  el.keyDialog.showModal();
  if (why) banner(why);
}

el.forgetKey.hidden = !state.apiKey;
el.forgetKey.addEventListener("click", () => {
  state.apiKey = "";
  store.set("apiKey", "");
  el.forgetKey.hidden = true;
});

// The served model's name (and context) from /v1/models; true once known. Under --api-key a
// 401 asks for the key, then loads again and calls `retry` (what was waiting for the model).
async function loadModel(retry) {
  let res;
  try {
    res = await fetch("/v1/models", { headers: headers() });
  } catch (err) {
    banner(`Cannot reach the server (${err.message}).`);
    return false;
  }
  if (res.status === 401) {
    askKey(state.apiKey ? "The server refused the saved API key." : "", async () => {
      if ((await loadModel(retry)) && retry) retry();
    });
    return false;
  }
  if (!res.ok) {
    banner(`The server answered ${res.status} to /v1/models.`);
    return false;
  }
  const card = (await res.json()).data[0];
  state.model = card.id;
  el.model.textContent = card.id;
  el.modelInfo.textContent = `context ${card.max_model_len} tokens`;
  banner("");
  return true;
}

// ---------------------------------------------------------------------------------- start

if (state.current && !conv()) state.current = null;
renderSidebar();
renderMessages();
loadModel();
el.prompt.focus();
