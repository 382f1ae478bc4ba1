// The task page of tes-slurm-bridge: plain JavaScript over the TES API, no build step.
//
// Everything a task carries (names, tags, commands, output) is shown with textContent and
// never parsed as HTML; the page's Content-Security-Policy allows no inline script either.
"use strict";

const API = new URL("../ga4gh/tes/v1/", document.baseURI);
const STATES = ["QUEUED", "INITIALIZING", "RUNNING", "PAUSED", "COMPLETE", "EXECUTOR_ERROR",
  "SYSTEM_ERROR", "CANCELED", "PREEMPTED", "CANCELING"];
const FINAL = new Set(["COMPLETE", "EXECUTOR_ERROR", "SYSTEM_ERROR", "CANCELED", "PREEMPTED"]);
const REFRESH_MS = 5000;
const LIVE_MS = 2000;
const LIVE_TAIL_BYTES = 64 * 1024;
const AUTH_KEY = "tes-bridge-authorization";

const $ = (id) => document.getElementById(id);

// ------------------------------------------------------------------------------ DOM helpers
function el(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [key, value] of Object.entries(attrs)) {
    if (key === "class") node.className = value;
    else node.setAttribute(key, value);
  }
  for (const child of children) {
    if (child === null || child === undefined) continue;
    node.append(child instanceof Node ? child : String(child));  // strings become text nodes
  }
  return node;
}

function clear(node) {
  node.replaceChildren();
  return node;
}

function definitions(pairs) {
  const list = el("dl");
  for (const [term, value] of pairs) {
    if (value === undefined || value === null || value === "") continue;
    list.append(el("dt", {}, term), el("dd", {}, value));
  }
  return list;
}

function pre(text, className = "") {
  return el("pre", { class: className }, text || "");
}

function showError(message) {
  const box = $("error");
  box.textContent = message || "";
  box.hidden = !message;
}

function bytes(value) {
  const n = Number(value);
  if (!Number.isFinite(n)) return value;
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let size = n;
  let unit = 0;
  while (size >= 1024 && unit < units.length - 1) {
    size /= 1024;
    unit += 1;
  }
  return `${size.toFixed(unit ? 1 : 0)} ${units[unit]}`;
}

function when(value) {
  if (!value) return "";
  const date = new Date(value);
  return Number.isNaN(date.getTime()) ? value : date.toLocaleString();
}

// ------------------------------------------------------------------------------ the API
class AuthRequired extends Error {
  constructor(challenge) {
    super("authentication required");
    this.challenge = challenge || "";
  }
}

async function api(path, { method = "GET", params = null, body = null } = {}) {
  const url = new URL(path, API);
  for (const [key, value] of params || []) url.searchParams.append(key, value);
  const headers = { Accept: "application/json" };
  const authorization = sessionStorage.getItem(AUTH_KEY);
  if (authorization) headers.Authorization = authorization;
  if (body !== null) headers["Content-Type"] = "application/json";
  // credentials "omit": the browser adds none of its own and shows no password prompt of its
  // own on a 401; the page asks, and sends the Authorization header itself.
  const response = await fetch(url, {
    method, headers, credentials: "omit", cache: "no-store",
    body: body === null ? null : JSON.stringify(body),
  });
  if (response.status === 401) throw new AuthRequired(response.headers.get("WWW-Authenticate"));
  let answer = null;
  try {
    answer = await response.json();
  } catch (_) {
    answer = null;
  }
  if (!response.ok) {
    const message = answer && answer.message ? answer.message : response.statusText;
    throw new Error(`${method} ${url.pathname}: ${response.status} ${message}`);
  }
  return answer;
}

// ------------------------------------------------------------------------------ sign-in
function askForCredentials(challenge) {
  const bearer = /^bearer/i.test(challenge);
  $("login-basic").hidden = bearer;
  $("login-bearer").hidden = !bearer;
  $("login").dataset.scheme = bearer ? "bearer" : "basic";
  $("login").hidden = false;
  $("list-view").hidden = true;
  $("task-view").hidden = true;
  stopTimers();
}

function signIn(event) {
  event.preventDefault();
  let value;
  if ($("login").dataset.scheme === "bearer") {
    value = `Bearer ${$("login-token").value.trim()}`;
  } else {
    const pair = `${$("login-user").value}:${$("login-password").value}`;
    // btoa takes Latin-1 only: encode the UTF-8 bytes (the server decodes UTF-8).
    value = `Basic ${btoa(String.fromCharCode(...new TextEncoder().encode(pair)))}`;
    sessionStorage.setItem(`${AUTH_KEY}-user`, $("login-user").value);
  }
  sessionStorage.setItem(AUTH_KEY, value);
  $("login-password").value = "";
  $("login-token").value = "";
  $("login").hidden = true;
  route();
}

function signOut() {
  sessionStorage.removeItem(AUTH_KEY);
  sessionStorage.removeItem(`${AUTH_KEY}-user`);
  location.hash = "#/";
  route();
}

function showWho() {
  const signedIn = sessionStorage.getItem(AUTH_KEY) !== null;
  const user = sessionStorage.getItem(`${AUTH_KEY}-user`);
  $("who").textContent = signedIn ? `signed in${user ? ` as ${user}` : ""}` : "";
  $("sign-out").hidden = !signedIn;
}

async function guarded(action) {
  try {
    await action();
    showError("");
  } catch (error) {
    if (error instanceof AuthRequired) {
      if (sessionStorage.getItem(AUTH_KEY)) {
        sessionStorage.removeItem(AUTH_KEY);
        showError("Those credentials were not accepted.");
      }
      askForCredentials(error.challenge);
    } else {
      showError(error.message);
    }
  }
  showWho();
}

// ------------------------------------------------------------------------------ timers
let refreshTimer = null;
let liveTimer = null;

function stopTimers() {
  clearTimeout(refreshTimer);
  clearTimeout(liveTimer);
  refreshTimer = null;
  liveTimer = null;
}

// ------------------------------------------------------------------------------ the list
const listState = { tokens: [""], page: 0, loads: 0 };

function listParams() {
  const params = [["view", "BASIC"], ["page_size", $("filter-size").value]];
  if ($("filter-state").value) params.push(["state", $("filter-state").value]);
  if ($("filter-name").value) params.push(["name_prefix", $("filter-name").value]);
  const tag = $("filter-tag").value.trim();
  if (tag) {
    const [key, ...rest] = tag.split("=");
    params.push(["tag_key", key], ["tag_value", rest.join("=")]);
  }
  const token = listState.tokens[listState.page];
  if (token) params.push(["page_token", token]);
  return params;
}

function taskRow(task) {
  const tags = Object.entries(task.tags || {}).map(([k, v]) => (v ? `${k}=${v}` : k));
  const link = el("a", { href: `#/task/${encodeURIComponent(task.id)}` }, task.name || "(no name)");
  return el("tr", { "data-id": task.id },
    el("td", { class: "name" }, link),
    el("td", { class: `state state-${task.state}` }, task.state),
    el("td", {}, when(task.creation_time)),
    el("td", { class: "tags" }, tags.join(", ")),
    el("td", { class: "id" }, task.id));
}

async function loadList() {
  const answer = await api("tasks", { params: listParams() });
  const tasks = answer.tasks || [];
  clear($("tasks").tBodies[0]).append(...tasks.map(taskRow));
  $("empty").hidden = tasks.length > 0;
  listState.tokens.length = listState.page + 1;
  if (answer.next_page_token) listState.tokens.push(answer.next_page_token);
  $("page-next").disabled = !answer.next_page_token;
  $("page-first").disabled = listState.page === 0;
  $("page-previous").disabled = listState.page === 0;
  $("page-number").textContent = `page ${listState.page + 1}`;
  listState.loads += 1;
  $("tasks").dataset.loaded = String(listState.loads);  // tells a watcher a new answer is shown
}

function scheduleList() {
  clearTimeout(refreshTimer);
  if ($("auto-refresh").checked) {
    refreshTimer = setTimeout(() => guarded(loadList).then(scheduleList), REFRESH_MS);
  }
}

function showList() {
  $("task-view").hidden = true;
  $("list-view").hidden = false;
  return guarded(loadList).then(scheduleList);
}

// ------------------------------------------------------------------------------ one task
function executorsPart(task) {
  return (task.executors || []).map((executor, index) => el("div", { class: "card" },
    el("h4", {}, `Executor ${index}`),
    definitions([
      ["Image", executor.image],
      ["Command", el("code", {}, JSON.stringify(executor.command || []))],
      ["Working directory", executor.workdir],
      ["stdin", executor.stdin], ["stdout", executor.stdout], ["stderr", executor.stderr],
      ["Environment", executor.env && Object.keys(executor.env).length
        ? pre(Object.entries(executor.env).map(([k, v]) => `${k}=${v}`).join("\n")) : ""],
      ["Ignore error", executor.ignore_error ? "yes" : ""],
    ])));
}

function filesPart(files, kind) {
  if (!files || files.length === 0) return [el("p", { class: "note" }, `No ${kind}.`)];
  const rows = files.map((file) => el("tr", {},
    el("td", {}, file.name || ""), el("td", {}, file.type || "FILE"),
    el("td", {}, file.path || ""),
    el("td", {}, file.url || (file.content !== undefined ? "(content)" : ""))));
  return [el("table", {},
    el("thead", {}, el("tr", {}, el("th", {}, "Name"), el("th", {}, "Type"),
      el("th", {}, "Path"), el("th", {}, "URL"))),
    el("tbody", {}, ...rows))];
}

function attemptPart(log, index) {
  const meta = log.metadata || {};
  const card = el("div", { class: "card attempt", "data-attempt": String(index + 1) },
    el("h4", {}, `Attempt ${index + 1}`),
    definitions([
      ["Slurm job", meta.slurm_job_id], ["Node", meta.slurm_node],
      ["Partition", meta.slurm_partition], ["Slurm state", meta.slurm_state],
      ["Started", when(log.start_time)], ["Ended", when(log.end_time)],
      ["Elapsed", meta.slurm_elapsed_seconds ? `${meta.slurm_elapsed_seconds} s` : ""],
      ["Max RSS", meta.slurm_max_rss_bytes ? bytes(meta.slurm_max_rss_bytes) : ""],
    ]));
  for (const [number, executor] of (log.logs || []).entries()) {
    card.append(el("h5", {}, `Executor ${number}: exit code ${executor.exit_code}`),
      definitions([["Started", when(executor.start_time)], ["Ended", when(executor.end_time)]]),
      el("p", { class: "stream-label" }, "stdout"), pre(executor.stdout, "stdout"),
      el("p", { class: "stream-label" }, "stderr"), pre(executor.stderr, "stderr"));
  }
  if ((log.outputs || []).length) {
    card.append(el("h5", {}, "Uploaded"),
      el("ul", {}, ...log.outputs.map((o) => el("li", {}, `${o.url} (${bytes(o.size_bytes)})`))));
  }
  if ((log.system_logs || []).length) {
    card.append(el("h5", {}, "System logs"), pre(log.system_logs.join("\n"), "system-logs"));
  }
  return card;
}

let current = null;  // the task shown: { id, task }

function renderTask(task) {
  $("task-name").textContent = task.name || "(no name)";
  const tags = Object.entries(task.tags || {}).map(([k, v]) => (v ? `${k}=${v}` : k));
  const resources = task.resources || {};
  clear($("task-summary")).append(...definitions([
    ["Id", task.id],
    ["State", el("span", { id: "task-state", class: `state state-${task.state}` }, task.state)],
    ["Created", when(task.creation_time)],
    ["Description", task.description],
    ["Tags", tags.join(", ")],
    ["Resources", [
      resources.cpu_cores ? `${resources.cpu_cores} CPU` : "",
      resources.ram_gb ? `${resources.ram_gb} GB RAM` : "",
      resources.disk_gb ? `${resources.disk_gb} GB disk` : "",
    ].filter(Boolean).join(", ")],
  ]).childNodes);
  const final = FINAL.has(task.state);
  $("cancel").hidden = final;
  if (final) $("cancel-confirm").hidden = true;
  clear($("executors")).append(...executorsPart(task));
  clear($("inputs")).append(...filesPart(task.inputs, "inputs"));
  clear($("outputs")).append(...filesPart(task.outputs, "outputs"));
  const attempts = (task.logs || []).map(attemptPart);
  clear($("attempts")).append(...(attempts.length ? attempts
    : [el("p", { class: "note" }, "Not started yet.")]));
}

async function loadTask(id) {
  const task = await api(`tasks/${encodeURIComponent(id)}`, { params: [["view", "FULL"]] });
  if (!current || current.id !== id) return;
  current.task = task;
  renderTask(task);
}

// Live output: the tail of each stream of the executor that runs now, from the output
// endpoint (an executor's log enters the task document only once it has an exit code).
async function loadLive(id) {
  const task = current && current.task;
  if (!task) return;
  const done = (task.logs && task.logs.length) ? (task.logs[task.logs.length - 1].logs || []).length : 0;
  const executor = Math.min(done, Math.max((task.executors || []).length - 1, 0));
  const box = clear($("live-streams"));
  for (const stream of ["stdout", "stderr"]) {
    const answer = await api(`tasks/${encodeURIComponent(id)}/output`, {
      params: [["executor", executor], ["stream", stream], ["offset", -LIVE_TAIL_BYTES]],
    });
    if (!current || current.id !== id) return;
    box.append(el("p", { class: "stream-label" },
      `Executor ${executor} ${stream} (${bytes(answer.size)}${answer.done ? ", finished" : ""})`),
    pre(answer.text, `live-${stream}`));
  }
  $("live").hidden = false;
}

function scheduleTask(id) {
  clearTimeout(refreshTimer);
  clearTimeout(liveTimer);
  const task = current && current.task;
  if (!task) return;
  if (FINAL.has(task.state)) {
    // An executor stopped before it had an exit code (a cancel, a time limit) has no log in
    // the task document: show what it wrote, once.
    const attempts = task.logs || [];
    const logged = attempts.length ? (attempts[attempts.length - 1].logs || []).length : 0;
    const stopped = attempts.length > 0 && logged < (task.executors || []).length;
    if (stopped) guarded(() => loadLive(id));
    else $("live").hidden = true;
    // A final task whose job has not ended yet in Slurm (a cancel being carried out): its
    // final record (Slurm state, end time) follows within a few cycles.
    const last = attempts.length ? attempts[attempts.length - 1] : null;
    const jobEnding = last && (last.metadata || {}).slurm_job_id && !last.end_time;
    if (jobEnding) {
      refreshTimer = setTimeout(() => guarded(() => loadTask(id)).then(() => scheduleTask(id)),
        REFRESH_MS);
    }
    return;
  }
  const running = task.state === "RUNNING" || task.state === "INITIALIZING";
  if (running) guarded(() => loadLive(id));
  refreshTimer = setTimeout(() => guarded(() => loadTask(id)).then(() => scheduleTask(id)),
    running ? LIVE_MS : REFRESH_MS);
}

function showTask(id) {
  $("list-view").hidden = true;
  $("task-view").hidden = false;
  $("live").hidden = true;
  $("cancel-confirm").hidden = true;
  current = { id, task: null };
  return guarded(() => loadTask(id)).then(() => scheduleTask(id));
}

function cancelTask() {
  $("cancel-confirm").hidden = false;
}

function confirmCancel() {
  const id = current && current.id;
  if (!id) return;
  $("cancel-confirm").hidden = true;
  guarded(async () => {
    await api(`tasks/${encodeURIComponent(id)}:cancel`, { method: "POST", body: {} });
    await loadTask(id);
  }).then(() => scheduleTask(id));
}

// ------------------------------------------------------------------------------ routing
function route() {
  stopTimers();
  showWho();
  const match = /^#\/task\/(.+)$/.exec(location.hash);
  if (match) return showTask(decodeURIComponent(match[1]));
  current = null;
  return showList();
}

function start() {
  for (const state of STATES) $("filter-state").append(el("option", { value: state }, state));
  $("login").addEventListener("submit", signIn);
  $("sign-out").addEventListener("click", signOut);
  $("filters").addEventListener("submit", (event) => {
    event.preventDefault();
    listState.tokens = [""];
    listState.page = 0;
    stopTimers();
    showList();
  });
  $("filter-state").addEventListener("change", () => $("filter-apply").click());
  $("auto-refresh").addEventListener("change", () => (location.hash.startsWith("#/task/")
    ? null : scheduleList()));
  $("page-next").addEventListener("click", () => {
    listState.page += 1;
    stopTimers();
    showList();
  });
  $("page-first").addEventListener("click", () => {
    listState.page = 0;
    stopTimers();
    showList();
  });
  $("page-previous").addEventListener("click", () => {
    listState.page = Math.max(0, listState.page - 1);
    stopTimers();
    showList();
  });
  $("cancel").addEventListener("click", cancelTask);
  $("cancel-confirm").addEventListener("click", confirmCancel);
  window.addEventListener("hashchange", route);
  route();
}

document.addEventListener("DOMContentLoaded", start);
