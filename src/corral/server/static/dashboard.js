// corral's dashboard: boxes, processes, live terminals and the audit log of `corral serve`.
// The token arrives in the URL fragment (#token=...), which browsers never send to the
// server; it is kept in sessionStorage and sent as `Authorization: Bearer` on fetches and
// as `?token=` on WebSockets (browsers cannot set headers there). Data from boxes is shown
// with textContent only, never parsed as HTML.
"use strict";

const TOKEN_KEY = "corral-token";
const POLL_MS = 2000;
const state = { token: null, scope: null, box: null, pid: null, ws: null, term: null, cpu: new Map() };
const READ_ONLY = "this token is read-only: it may look, not attach a terminal or answer approvals";

const MALFORMED = "the token in the address is malformed (cut short when pasted?): open the " +
  "dashboard URL that corral serve printed, whole (it ends in #token=...)";

// The token of the address's fragment (then dropped from the address), else the tab's; a
// fragment that is not a valid escape throws MALFORMED, and the tab's token is forgotten.
function takeToken() {
  const found = /(?:^#|&)token=([^&]*)/.exec(location.hash);
  if (found) {
    history.replaceState(null, "", location.pathname + location.search);
    let token;
    try {
      token = decodeURIComponent(found[1]);
    } catch (e) {
      sessionStorage.removeItem(TOKEN_KEY);
      throw new Error(MALFORMED);
    }
    sessionStorage.setItem(TOKEN_KEY, token);
  }
  return sessionStorage.getItem(TOKEN_KEY);
}

function say(text, isError) {
  const el = document.getElementById("status");
  el.textContent = text;
  el.className = isError ? "error" : "";
}

async function api(path, options = {}) {
  const headers = Object.assign({}, options.headers || {}, {
    Authorization: "Bearer " + state.token,
  });
  const response = await fetch(path, Object.assign({}, options, { headers }));
  if (!response.ok) {
    let message = response.status + " " + response.statusText;
    try {
      const body = await response.json();
      if (body.error) message = body.error.code + ": " + body.error.message;
    } catch (e) { /* not JSON */ }
    throw new Error(message);
  }
  return response;
}

function el(tag, text, className) {
  const node = document.createElement(tag);
  if (text !== undefined && text !== null) node.textContent = String(text);
  if (className) node.className = className;
  return node;
}

function bytes(n) {
  if (n === null || n === undefined) return "-";
  const units = ["B", "KiB", "MiB", "GiB"];
  let i = 0;
  while (n >= 1024 && i < units.length - 1) { n /= 1024; i++; }
  return n.toFixed(i ? 1 : 0) + " " + units[i];
}

function limitsText(limits) {
  const parts = ["mem " + bytes(limits.memory_bytes)];
  if (limits.cpu_quota) parts.push("cpu " + limits.cpu_quota);
  if (limits.max_pids) parts.push("pids " + limits.max_pids);
  if (limits.exec_timeout_secs) parts.push("timeout " + limits.exec_timeout_secs + "s");
  return parts.join(", ");
}

function cpuText(box) {
  if (!box.stats) return "-";
  const now = performance.now() / 1000;
  const before = state.cpu.get(box.id);
  state.cpu.set(box.id, { at: now, cpu: box.stats.cpu_seconds });
  if (!before || now <= before.at) return box.stats.cpu_seconds.toFixed(2) + " s";
  const share = (box.stats.cpu_seconds - before.cpu) / (now - before.at);
  return (100 * Math.max(0, share)).toFixed(0) + "% (" + box.stats.cpu_seconds.toFixed(1) + " s)";
}

function renderBoxes(boxes) {
  const body = document.querySelector("#boxes tbody");
  body.replaceChildren();
  for (const box of boxes) {
    const row = el("tr");
    row.dataset.box = box.id;
    if (box.id === state.box) row.classList.add("selected");
    row.append(el("td", box.id), el("td", box.state));
    const labels = el("td");
    for (const [k, v] of Object.entries(box.labels)) labels.append(el("span", k + "=" + v, "label"));
    row.append(labels, el("td", box.backend), el("td", box.network));
    row.append(el("td", limitsText(box.limits)), el("td", cpuText(box)));
    const mem = box.stats ? bytes(box.stats.memory_bytes) + " / " + bytes(box.limits.memory_bytes) : "-";
    row.append(el("td", mem), el("td", box.processes), el("td", box.sessions.length));
    row.addEventListener("click", () => selectBox(box.id));
    body.append(row);
  }
  if (!boxes.length) {
    const row = el("tr");
    const cell = el("td", "no boxes", "none");
    cell.colSpan = 10;
    row.append(cell);
    body.append(row);
  }
}

async function refreshApprovals() {
  const pending = await (await api("/v1/approvals")).json();
  const list = document.getElementById("approvals");
  list.replaceChildren();
  for (const ask of pending) {
    const what = ask.tool + (ask.command_line ? ": " + ask.command_line : "");
    const item = el("li", what + (ask.reason ? " (" + ask.reason + ")" : "") + (ask.box ? " [" + ask.box + "]" : ""));
    item.dataset.approval = ask.id;
    for (const [label, approve] of [["Approve", true], ["Deny", false]]) {
      const button = el("button", label);
      button.type = "button";
      if (state.scope === "read") { button.disabled = true; button.title = READ_ONLY; }
      button.addEventListener("click", () => {
        api("/v1/approvals/" + encodeURIComponent(ask.id), {
          method: "POST",
          headers: { "Content-Type": "application/json" },
          body: JSON.stringify({ approve }),
        }).then(() => refresh()).catch((e) => say(e.message, true));
      });
      item.append(button);
    }
    list.append(item);
  }
  if (!pending.length) list.append(el("li", "none pending", "none"));
}

async function refresh() {
  if (state.scope === null) state.scope = (await (await api("/v1/info")).json()).scope;
  await refreshApprovals();
  const boxes = await (await api("/v1/boxes")).json();
  renderBoxes(boxes);
  const current = boxes.find((b) => b.id === state.box);
  if (state.box && !current) {
    const attached = Boolean(state.term);  // its terminal still shown (its socket may have gone)
    notice("box " + state.box + " was closed" + (attached ? "; its terminal was detached" : ""));
    detach();
    state.box = null;
    document.getElementById("box-section").hidden = true;
  } else if (current) {
    await refreshBox(current);
  }
  say("updated " + new Date().toLocaleTimeString(), false);
}

async function refreshBox(box) {
  const procs = await (await api("/v1/boxes/" + box.id + "/processes")).json();
  const body = document.querySelector("#processes tbody");
  body.replaceChildren();
  for (const p of procs) {
    const row = el("tr");
    row.dataset.pid = p.pid;
    if (p.pid === state.pid) row.classList.add("selected");
    row.append(el("td", p.pid), el("td", p.command), el("td", p.status), el("td", p.exit_code));
    row.addEventListener("click", () => { state.pid = p.pid; showOutput(box.id, p.pid); });
    body.append(row);
  }
  if (state.pid !== null) await showOutput(box.id, state.pid);
  // The box lists every session it holds, ended ones too: ask for each one's state.
  const sessions = await (await api("/v1/boxes/" + box.id + "/sessions")).json();
  const list = document.getElementById("sessions");
  list.replaceChildren();
  for (const session of sessions) {
    const sid = session.id;
    const item = el("li", sid);
    item.dataset.session = sid;
    if (session.closed) {
      const how = session.exit_code === null ? "" : " (exit " + session.exit_code + ")";
      item.append(el("span", " ended" + how, "none"));
      list.append(item);
      continue;
    }
    const button = el("button", state.ws && state.ws.sid === sid ? "attached" : "Attach");
    button.type = "button";
    button.dataset.session = sid;
    button.disabled = Boolean(state.ws && state.ws.sid === sid);
    if (state.scope === "read") { button.disabled = true; button.title = READ_ONLY; }
    button.addEventListener("click", () => attach(box.id, sid));
    item.append(button);
    if (state.scope === "read") item.append(el("span", "read-only token: cannot attach", "none"));
    list.append(item);
  }
  if (!sessions.length) list.append(el("li", "no sessions", "none"));
}

// One stream's output as text; where the server cut its middle (over the box's output cap)
// a marker line says how much is missing, as the library's own rendering does.
async function streamText(url) {
  const response = await api(url);
  const data = new Uint8Array(await response.arrayBuffer());
  const at = response.headers.get("x-corral-cut-at");
  const decode = (part) => new TextDecoder().decode(part);
  if (at === null) return decode(data);
  const missing = response.headers.get("x-corral-cut-bytes");
  return decode(data.subarray(0, Number(at))) +
    "\n[... " + missing + " bytes truncated: over the box's output cap, the middle is missing ...]\n" +
    decode(data.subarray(Number(at)));
}

async function showOutput(boxId, pid) {
  document.getElementById("output-of").textContent = "of pid " + pid;
  try {
    const base = "/v1/boxes/" + boxId + "/processes/" + pid + "/output?stream=";
    const out = await streamText(base + "stdout");
    const err = await streamText(base + "stderr");
    document.getElementById("output").textContent = out + (err ? "\n[stderr]\n" + err : "");
  } catch (e) {
    document.getElementById("output").textContent = e.message;
  }
}

// A note that stays until the person selects a box (the status line is rewritten every poll).
function notice(text) {
  const node = document.getElementById("notice");
  node.textContent = text;
  node.hidden = !text;
}

function selectBox(id) {
  notice("");
  if (state.box !== id) { detach(); state.pid = null; }
  state.box = id;
  document.getElementById("box-section").hidden = false;
  document.getElementById("box-id").textContent = id;
  document.getElementById("output").textContent = "";
  refresh().catch((e) => say(e.message, true));
}

function attach(boxId, sid) {
  detach();
  if (!window.Terminal) {
    say("the terminal (xterm.js) is not installed on this server: run `make vendor`", true);
    return;
  }
  const term = new window.Terminal({ cols: 100, rows: 24, convertEol: false });
  const holder = document.getElementById("terminal");
  holder.replaceChildren();
  term.open(holder);
  const scheme = location.protocol === "https:" ? "wss:" : "ws:";
  const url = scheme + "//" + location.host + "/v1/boxes/" + encodeURIComponent(boxId) +
    "/sessions/" + encodeURIComponent(sid) + "/attach?token=" + encodeURIComponent(state.token);
  const ws = new WebSocket(url);
  ws.binaryType = "arraybuffer";
  ws.sid = sid;
  const encoder = new TextEncoder();
  ws.onopen = () => {
    ws.opened = true;
    ws.send(JSON.stringify({ resize: [term.cols, term.rows] }));
    term.focus();
    say("attached to " + sid, false);
  };
  ws.onmessage = (event) => {
    term.write(typeof event.data === "string" ? event.data : new Uint8Array(event.data));
  };
  ws.onclose = (event) => {
    if (state.ws !== ws) return;
    state.ws = null;
    document.getElementById("terminal-bar").hidden = true;
    if (ws.opened) {
      term.write("\r\n[detached: " + (event.reason || event.code) + "]\r\n");
      return;
    }
    // A refused handshake shows the page nothing but code 1006: ask the API why.
    refusal(boxId, sid).then((why) => {
      if (state.term === term) term.write("[could not attach: " + why + "]\r\n");
      say("could not attach to " + sid + ": " + why, true);
    });
  };
  term.onData((data) => { if (ws.readyState === WebSocket.OPEN) ws.send(encoder.encode(data)); });
  state.ws = ws;
  state.term = term;
  document.getElementById("terminal-title").textContent = "session " + sid;
  document.getElementById("terminal-bar").hidden = false;
}

async function refusal(boxId, sid) {
  if (state.scope === "read") return READ_ONLY;
  try {
    const sessions = await (await api("/v1/boxes/" + encodeURIComponent(boxId) + "/sessions")).json();
    const found = sessions.find((s) => s.id === sid);
    if (!found) return "the session is gone";
    if (found.closed) return "the session has ended (exit status " + found.exit_code + ")";
    return "the server refused the terminal's connection";
  } catch (e) {
    return e.message;
  }
}

function detach() {
  const ws = state.ws;
  state.ws = null;
  if (ws) ws.close(1000, "detach");
  if (state.term) { state.term.dispose(); state.term = null; }
  document.getElementById("terminal").replaceChildren();
  document.getElementById("terminal-bar").hidden = true;
}

async function followAudit() {
  const pane = document.getElementById("audit");
  for (;;) {
    if (!state.token) {  // a malformed token replaced it: wait for a good one
      await new Promise((resolve) => setTimeout(resolve, POLL_MS));
      continue;
    }
    try {
      const response = await api("/v1/audit");
      const reader = response.body.getReader();
      const decoder = new TextDecoder();
      let pending = "";
      for (;;) {
        const { value, done } = await reader.read();
        if (done) break;
        pending += decoder.decode(value, { stream: true });
        let cut;
        while ((cut = pending.indexOf("\n\n")) >= 0) {
          const event = pending.slice(0, cut);
          pending = pending.slice(cut + 2);
          const data = event.split("\n").filter((l) => l.startsWith("data: ")).map((l) => l.slice(6)).join("\n");
          if (!data) continue;
          const record = JSON.parse(data);
          const { ts, sandbox, kind, ...rest } = record;
          const line = new Date(ts * 1000).toLocaleTimeString() + " " + sandbox + " " + kind + " " + JSON.stringify(rest);
          pane.textContent = (pane.textContent + line + "\n").split("\n").slice(-500).join("\n");
          pane.scrollTop = pane.scrollHeight;
        }
      }
    } catch (e) {
      say("audit stream: " + e.message, true);
    }
    await new Promise((resolve) => setTimeout(resolve, POLL_MS));
  }
}

let started = false;

function begin() {
  state.scope = null;
  try {
    state.token = takeToken();
  } catch (e) {
    state.token = null;
    say(e.message, true);
    return;
  }
  if (!state.token) {
    say("no token: open the dashboard URL that corral serve printed (it ends in #token=...)", true);
    return;
  }
  const tick = () => { if (state.token) refresh().catch((e) => say(e.message, true)); };
  tick();
  if (started) return;
  started = true;
  setInterval(tick, POLL_MS);
  followAudit();
}

function start() {
  document.getElementById("server").textContent = location.host;
  document.getElementById("detach").addEventListener("click", detach);
  // A URL with another token pasted into this tab: use it.
  window.addEventListener("hashchange", () => { if (location.hash.includes("token=")) begin(); });
  begin();
}

document.addEventListener("DOMContentLoaded", start);
