"""The live sessions page: plain HTML and a small inline script polling /v1/live once a second.

Everything shown comes from agents and environments, so it is untrusted: the script only ever
sets textContent and attributes, never HTML, and images are data: URLs of base64 PNGs. The page
loads nothing from the network (no CDN) and needs no build step.

Where /v1/live answers 401 (the facade has a monitor token), the page asks for a token, keeps it
in sessionStorage (this tab only, gone when it closes) and sends it as `Authorization: Bearer`.
"""

PAGE = """<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>envserve - live sessions</title>
<style>
  :root { --fg: #1d2330; --muted: #6a7385; --line: #d9dee7; --bg: #f5f7fa; --card: #fff;
          --ok: #1f7a3f; --bad: #b3261e; --run: #285bb8; }
  * { box-sizing: border-box; }
  body { margin: 0; font: 14px/1.4 system-ui, sans-serif; color: var(--fg); background: var(--bg); }
  header.top { display: flex; gap: 1rem; align-items: baseline; flex-wrap: wrap; padding: .8rem 1.2rem;
               background: var(--card); border-bottom: 1px solid var(--line); }
  header.top h1 { font-size: 1.15rem; margin: 0; }
  #envs a { margin-right: .6rem; color: var(--run); text-decoration: none; }
  #envs a.current { font-weight: 600; text-decoration: underline; }
  #status { margin-left: auto; color: var(--muted); }
  #status.err { color: var(--bad); }
  main { padding: 1rem 1.2rem; }
  section.replica { margin-bottom: 1.6rem; }
  section.replica > h2 { font-size: 1rem; margin: 0 0 .5rem; }
  section.replica > h2 small { color: var(--muted); font-weight: normal; margin-left: .5rem; }
  .replica-error { color: var(--bad); margin: .3rem 0; }
  .empty { color: var(--muted); }
  .grid { display: grid; grid-template-columns: repeat(auto-fill, minmax(330px, 1fr)); gap: .8rem; }
  article.session { background: var(--card); border: 1px solid var(--line); border-radius: 6px; padding: .6rem; }
  article.session > header { display: flex; gap: .5rem; align-items: baseline; margin-bottom: .4rem; }
  .sid { font-family: ui-monospace, monospace; font-size: 12px; overflow: hidden; text-overflow: ellipsis;
         white-space: nowrap; flex: 1; }
  .env { color: var(--muted); }
  .state { font-size: 12px; padding: 0 .4rem; border-radius: 3px; color: #fff; background: var(--run); }
  .state.success { background: var(--ok); } .state.failed, .state.truncated { background: var(--bad); }
  .state.idle { background: var(--muted); }
  .body { display: flex; gap: .6rem; align-items: flex-start; }
  img.obs { width: 128px; height: auto; image-rendering: pixelated; border: 1px solid var(--line); }
  img.obs[hidden] { display: none; }
  pre { margin: 0; font: 12px/1.25 ui-monospace, monospace; white-space: pre-wrap; word-break: break-word;
        max-height: 14em; overflow: auto; }
  dl.nums { display: grid; grid-template-columns: repeat(4, auto); gap: 0 .6rem; margin: .4rem 0; }
  dl.nums dt { color: var(--muted); font-size: 11px; } dl.nums dd { margin: 0; font-variant-numeric: tabular-nums; }
  .last-action { background: var(--bg); padding: .3rem; max-height: 6em; }
  form#login { display: flex; gap: .5rem; align-items: baseline; flex-wrap: wrap; margin-bottom: 1rem; }
  form#login[hidden] { display: none; }
  #login-why { color: var(--muted); flex-basis: 100%; }
  #forget[hidden] { display: none; }
</style>
</head>
<body>
<header class="top">
  <h1>envserve &middot; live sessions</h1>
  <nav id="envs"></nav>
  <span id="status">loading&hellip;</span>
  <button id="forget" type="button" hidden>forget token</button>
</header>
<main>
<form id="login" hidden>
  <span id="login-why"></span>
  <label for="token">token</label>
  <input id="token" type="password" autocomplete="off" size="40">
  <button id="login-go" type="submit">watch</button>
</form>
<div id="replicas"></div>
</main>
<script>
"use strict";
const params = new URLSearchParams(location.search);
const envFilter = params.get("env") || "";
const limit = params.get("limit") || "100";
const root = document.getElementById("replicas");
const statusEl = document.getElementById("status");
const sections = new Map();  // replicaId -> {el, title, info, error, grid, cards: Map(sessionId -> card)}
const knownEnvs = new Set();
const BASE64 = /^[A-Za-z0-9+/]*={0,2}$/;
const TOKEN_KEY = "envserve-live-token";
const login = document.getElementById("login");
const tokenInput = document.getElementById("token");
const forget = document.getElementById("forget");
let timer = null;
let given = "";  // the token, where sessionStorage is off

function storedToken() {
  try { return sessionStorage.getItem(TOKEN_KEY) || given; } catch (e) { return given; }
}

function dropToken() {
  given = "";
  try { sessionStorage.removeItem(TOKEN_KEY); } catch (e) { /* nothing kept */ }
}

function askToken(why) {
  // Polling stops until a token is given: the form's submit starts it again.
  document.getElementById("login-why").textContent = why;
  login.hidden = false;
  forget.hidden = true;
  statusEl.textContent = "a token is needed";
  statusEl.className = "err";
  tokenInput.focus();
}

login.addEventListener("submit", ev => {
  ev.preventDefault();
  const t = tokenInput.value.trim();
  if (!t) return;
  given = t;
  try { sessionStorage.setItem(TOKEN_KEY, t); } catch (e) { /* storage off: kept in this page only */ }
  tokenInput.value = "";
  login.hidden = true;
  poll();
});

forget.addEventListener("click", () => {
  dropToken();
  clearTimeout(timer);
  root.replaceChildren();
  sections.clear();
  askToken("token forgotten; enter one to watch again");
});

function make(tag, cls, text) {
  const e = document.createElement(tag);
  if (cls) e.className = cls;
  if (text !== undefined) e.textContent = text;
  return e;
}

function num(x) { return (Math.round((x || 0) * 1000) / 1000).toString(); }

function section(r) {
  let s = sections.get(r.replicaId);
  if (!s) {
    const el = make("section", "replica");
    el.setAttribute("data-replica-id", r.replicaId);
    const h = make("h2");
    const title = make("span", "", r.replicaId);
    const info = make("small");
    h.append(title, info);
    const error = make("div", "replica-error");
    const grid = make("div", "grid");
    el.append(h, error, grid);
    s = {el, info, error, grid, cards: new Map(), order: ""};
    sections.set(r.replicaId, s);
  }
  return s;
}

function newCard(sessionId, replicaId) {
  const el = make("article", "session");
  el.setAttribute("data-session-id", sessionId);
  const head = make("header");
  const c = {el, png: null};
  // The section names the replica; the card shows the rest of the id (all of it on hover).
  const prefix = replicaId + "/";
  c.sid = make("span", "sid", sessionId.startsWith(prefix) ? sessionId.slice(prefix.length) : sessionId);
  c.sid.title = sessionId;
  c.env = make("span", "env");
  c.state = make("span", "state");
  head.append(c.sid, c.env, c.state);
  const body = make("div", "body");
  c.img = make("img", "obs"); c.img.alt = "observation"; c.img.hidden = true;
  c.text = make("pre", "obs-text");
  body.append(c.img, c.text);
  const dl = make("dl", "nums");
  for (const [label, key] of [["episode", "episode"], ["turn", "turn"], ["reward", "reward"], ["return", "ret"]]) {
    dl.append(make("dt", "", label));
    c[key] = make("dd", key);
    dl.append(c[key]);
  }
  c.action = make("pre", "last-action");
  el.append(head, body, dl, c.action);
  return c;
}

function fill(c, s) {
  c.env.textContent = s.envId + (s.actionFormat ? " / " + s.actionFormat : "");
  let state = "running", label = "running";
  if (!s.started) { state = "idle"; label = "not reset"; }
  else if (s.done) { state = s.success ? "success" : "failed"; label = s.success ? "solved" : "failed"; }
  else if (s.truncated) { state = "truncated"; label = "out of turns"; }
  c.state.className = "state " + state;
  c.state.textContent = label;
  c.text.textContent = s.observationText || "";
  c.episode.textContent = String(s.episode || 0);
  c.turn.textContent = String(s.turn || 0);
  c.reward.textContent = num(s.reward);
  c.ret.textContent = num(s.episodeReturn);
  c.action.textContent = s.lastAction ? "last action: " + s.lastAction : "no action yet";
  const png = s.image && s.image.png;
  if (png && BASE64.test(png)) {
    if (png !== c.png) { c.img.src = "data:image/png;base64," + png; c.png = png; }
    c.img.hidden = false;
  } else if (!png) {
    c.img.hidden = true;
  }
}

function render(body) {
  const seen = new Set();
  for (const r of body.replicas) {
    seen.add(r.replicaId);
    for (const e of r.envs || []) knownEnvs.add(e);
    const s = section(r);
    const shown = r.sessions.length;
    s.info.textContent = r.address + " \\u00b7 " + r.total + " live" + (shown < r.total ? ", showing " + shown : "") +
      (r.draining ? " \\u00b7 draining" : "");
    s.error.textContent = r.error ? r.error.code + ": " + r.error.message : "";
    const ids = r.sessions.map(x => x.sessionId).sort();
    const live = new Set(ids);
    for (const [id, c] of s.cards) if (!live.has(id)) { c.el.remove(); s.cards.delete(id); }
    for (const x of r.sessions) {
      let c = s.cards.get(x.sessionId);
      if (!c) { c = newCard(x.sessionId, r.replicaId); s.cards.set(x.sessionId, c); }
      knownEnvs.add(x.envId);
      fill(c, x);
    }
    const order = ids.join("\\n");
    if (order !== s.order) {  // re-append only when the set changed: rows stay put while they step
      for (const id of ids) s.grid.append(s.cards.get(id).el);
      s.order = order;
    }
    if (!ids.length && !s.grid.querySelector(".empty")) s.grid.append(make("div", "empty", "no live sessions"));
    if (ids.length) for (const e of s.grid.querySelectorAll(".empty")) e.remove();
    if (!s.el.isConnected) root.append(s.el);
  }
  for (const [id, s] of sections) if (!seen.has(id)) { s.el.remove(); sections.delete(id); }
  renderEnvs();
}

function renderEnvs() {
  const nav = document.getElementById("envs");
  const names = ["", ...[...knownEnvs].sort()];
  if (nav.childElementCount === names.length) return;
  nav.replaceChildren();
  for (const e of names) {
    const a = make("a", e === envFilter ? "current" : "", e || "all");
    a.href = "?" + new URLSearchParams(e ? {env: e, limit} : {limit});
    nav.append(a);
  }
}

async function poll() {
  const token = storedToken();
  try {
    const q = new URLSearchParams({images: "true", limit});
    if (envFilter) q.set("env_id", envFilter);
    const headers = token ? {"Authorization": "Bearer " + token} : {};
    const resp = await fetch("v1/live?" + q, {cache: "no-store", headers});
    const body = await resp.json();
    // 401: no token or one nobody knows; 403 with a token: one that may not watch.
    if (resp.status === 401 || (resp.status === 403 && token)) {
      dropToken();
      askToken((token ? "that token was refused: " : "this page needs a token: ") + (body.message || ""));
      return;
    }
    if (!resp.ok) throw new Error((body.code || resp.status) + ": " + (body.message || ""));
    forget.hidden = !token;
    render(body);
    statusEl.textContent = "updated " + new Date().toLocaleTimeString();
    statusEl.className = "";
  } catch (e) {
    statusEl.textContent = "error: " + e.message;
    statusEl.className = "err";
  }
  timer = setTimeout(() => poll(), 1000);
}
poll();
</script>
</body>
</html>
"""
