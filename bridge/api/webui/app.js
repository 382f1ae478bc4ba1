// The task page of tes-slurm-bridge: plain JavaScript over the TES API, no build step.
//
// Everything a task carries (names, tags, commands, output) is shown with textContent and
// never parsed as HTML; the page's Content-Security-Policy allows no inline script either.
"use strict";

const API = new URL("../ga4gh/tes/v1/", document.baseURI);
// The page's private JSON beside TES (bridge/api/ui_data.py): counts by state, owners for admins.
const UI_DATA = new URL("../ui-data/", document.baseURI);
const STATES = ["QUEUED", "INITIALIZING", "RUNNING", "PAUSED", "COMPLETE", "EXECUTOR_ERROR",
  "SYSTEM_ERROR", "CANCELED", "PREEMPTED", "CANCELING"];
const FINAL = new Set(["COMPLETE", "EXECUTOR_ERROR", "SYSTEM_ERROR", "CANCELED", "PREEMPTED"]);
const REFRESH_MS = 5000;
const LIVE_MS = 2000;
const LIVE_TAIL_BYTES = 64 * 1024;
// The most one read of the output endpoint answers (bridge/api/resources.py).
const READ_BYTES = 1024 * 1024;
// A finished stream is shown whole up to this size; a longer one, its first and last READ_BYTES.
const SHOWN_BYTES = 2 * READ_BYTES;
// The line by which the task document says it left part of a stream out (docs/api.md).
const CUT_LINE = /^\[tes-bridge: ([0-9,]+) of ([0-9,]+) bytes left out here; the whole (stdout|stderr): GET \S+\]$/m;
const AUTH_KEY = "tes-bridge-authorization";
const WORKFLOW_PAGE_SIZE = 200;
const WORKFLOW_MAX_TASKS = 2000;
// A resubmitted task names the one it copies, as `tes-bridge task resubmit` tags it.
const RESUBMIT_TAG = "tes-bridge.resubmit_of";
const SVG_NS = "http://www.w3.org/2000/svg";

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

function zoneOf(date) {
  try {
    const parts = new Intl.DateTimeFormat(undefined, { timeZoneName: "short" }).formatToParts(date);
    const zone = parts.find((part) => part.type === "timeZoneName");
    return zone ? zone.value : "";
  } catch (_) {
    return "";
  }
}

// A time in the browser's zone, with the zone said ("2026-05-04 13:02:11 CEST").
function when(value) {
  if (!value) return "";
  const date = new Date(value);
  if (Number.isNaN(date.getTime())) return value;
  const pad = (n) => String(n).padStart(2, "0");
  const day = `${date.getFullYear()}-${pad(date.getMonth() + 1)}-${pad(date.getDate())}`;
  const time = `${pad(date.getHours())}:${pad(date.getMinutes())}:${pad(date.getSeconds())}`;
  return `${day} ${time} ${zoneOf(date)}`.trim();
}

function duration(seconds) {
  if (seconds === null || seconds === undefined || !Number.isFinite(seconds)) return "";
  if (seconds < 60) return `${seconds.toFixed(seconds < 10 ? 1 : 0)} s`;
  const minutes = Math.floor(seconds / 60);
  if (minutes < 60) return `${minutes} min ${Math.round(seconds % 60)} s`;
  return `${Math.floor(minutes / 60)} h ${minutes % 60} min`;
}

function percent(ratio) {
  return ratio === null || !Number.isFinite(ratio) ? "" : `${(ratio * 100).toFixed(ratio < 0.1 ? 1 : 0)} %`;
}

function secondsBetween(start, end) {
  const from = Date.parse(start);
  const to = Date.parse(end);
  return Number.isFinite(from) && Number.isFinite(to) ? Math.max(0, (to - from) / 1000) : null;
}

// ------------------------------------------------------------------------------ task facts
// The peak memory of an attempt. sacct's MaxRSS is sampled (JobAcctGatherFrequency): a job
// shorter than a sample has none, or 0, while its cgroup kept the true peak.
function peakMemory(meta) {
  const rss = Number(meta.slurm_max_rss_bytes || 0);
  const cgroup = Number(meta.memory_peak_bytes || 0);
  if (rss > 0) return { bytes: rss, source: "sacct MaxRSS" };
  if (cgroup > 0) return { bytes: cgroup, source: "the job's cgroup peak" };
  return { bytes: null, source: "" };
}

// What one attempt used against what the task asked for (seff's efficiencies).
function usage(task, log) {
  const meta = (log && log.metadata) || {};
  const resources = task.resources || {};
  const cores = Number(resources.cpu_cores) || 1;  // Slurm gives one CPU when none is asked
  const requested = resources.ram_gb ? Number(resources.ram_gb) * 2 ** 30 : null;  // --mem is GiB
  const ended = log && log.end_time;
  const elapsed = meta.slurm_elapsed_seconds !== undefined && Number(meta.slurm_elapsed_seconds) > 0
    ? Number(meta.slurm_elapsed_seconds)
    : secondsBetween(log && log.start_time, ended || (log && log.start_time && !FINAL.has(task.state)
      ? new Date().toISOString() : null));
  const cpu = meta.cpu_time_seconds !== undefined ? Number(meta.cpu_time_seconds) : null;
  const peak = peakMemory(meta);
  return {
    cores, requested, elapsed, cpu, peak: peak.bytes, peakSource: peak.source,
    cpuEfficiency: ended && cpu !== null && elapsed ? cpu / (cores * elapsed) : null,
    memoryEfficiency: peak.bytes && requested ? peak.bytes / requested : null,
  };
}

// When Slurm expects the attempt's pending job to start (squeue --start), where the server
// says it; null once the job started.
function expectedStart(log) {
  const meta = (log && log.metadata) || {};
  if (!meta.slurm_expected_start || (log && log.start_time)) return null;
  return el("span", { class: "expected-start", title: "Slurm's estimate (squeue --start)" },
    `expected ${when(meta.slurm_expected_start)}`);
}

function lastAttempt(task) {
  const logs = task.logs || [];
  return logs.length ? logs[logs.length - 1] : null;
}

// The exit code a list shows: the first executor's that failed, else 0; "" before any ended.
function exitCode(log) {
  const codes = ((log && log.logs) || []).map((executor) => executor.exit_code);
  if (!codes.length) return "";
  const failed = codes.find((code) => code !== 0);
  return String(failed === undefined ? 0 : failed);
}

// Why a final task ended as it did (`exit 42`, `TIMEOUT`, `input`, `canceled by alice`): the
// server's word, in its last attempt's metadata (bridge/core/reasons.py); "" for the others.
function reasonOf(task) {
  const log = lastAttempt(task);
  return ((log && log.metadata) || {}).reason || "";
}

// ------------------------------------------------------------------------------ the API
class AuthRequired extends Error {
  constructor(challenge) {
    super("authentication required");
    this.challenge = challenge || "";
  }
}

async function api(path, { method = "GET", params = null, body = null, base = API } = {}) {
  const url = new URL(path, base);
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
  $("workflow-view").hidden = true;
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
  me = null;
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

// ------------------------------------------------------------------------------ who
let me = null;  // { user, admin } of the credentials in use, asked once

async function whoAmI() {
  if (!me) me = await api("me", { base: UI_DATA });
  return me;
}

async function ownersOf(ids) {
  if (!ids.length || !(await whoAmI()).admin) return null;
  const answer = await api("owners", { base: UI_DATA, params: ids.map((id) => ["id", id]) });
  return answer.owners || {};
}

// ------------------------------------------------------------------------------ filters
// The list's filters live in the address (#/?state=…&name=…&tag=…&size=…), so that a view can
// be bookmarked, shared and reloaded; the workflow view takes the same ones (#/workflow?…),
// and its own: the directory its files are under and a span of creation times (dir, since,
// until), which isolate one run of an engine that sends no tags (Nextflow).
const RUN_FILTERS = ["dir", "since", "until"];

function filtersFrom(query) {
  const params = new URLSearchParams(query || "");
  const size = params.get("size") || "50";
  const filters = {
    state: STATES.includes(params.get("state")) ? params.get("state") : "",
    name: params.get("name") || "",
    tag: params.get("tag") || "",
    size: /^[0-9]+$/.test(size) ? size : "50",
  };
  for (const key of RUN_FILTERS) filters[key] = params.get(key) || "";
  return filters;
}

function hashFor(view, filters) {
  const params = new URLSearchParams();
  const keys = ["state", "name", "tag", ...(view === "workflow" ? RUN_FILTERS : [])];
  for (const key of keys) if (filters[key]) params.set(key, filters[key]);
  if (filters.size && filters.size !== "50") params.set("size", filters.size);
  const query = params.toString();
  return `#/${view}${query ? `?${query}` : ""}`;
}

function formFilters() {
  return {
    state: $("filter-state").value, name: $("filter-name").value,
    tag: $("filter-tag").value.trim(), size: $("filter-size").value,
  };
}

function showFilters(filters) {
  $("filter-state").value = filters.state;
  $("filter-name").value = filters.name;
  $("filter-tag").value = filters.tag;
  if (![...$("filter-size").options].some((option) => option.value === filters.size)) {
    $("filter-size").append(el("option", { value: filters.size }, filters.size));
  }
  $("filter-size").value = filters.size;
}

function filterParams(filters, { withState = true } = {}) {
  const params = [];
  if (withState && filters.state) params.push(["state", filters.state]);
  if (filters.name) params.push(["name_prefix", filters.name]);
  if (filters.tag) {
    const [key, ...rest] = filters.tag.split("=");
    params.push(["tag_key", key], ["tag_value", rest.join("=")]);
  }
  return params;
}

function go(hash) {
  if (location.hash === hash) route();
  else location.hash = hash;  // hashchange routes
}

// ------------------------------------------------------------------------------ the list
const listState = { tokens: [""], page: 0, loads: 0, filters: filtersFrom("") };

function listParams() {
  const filters = listState.filters;
  const params = [["view", "BASIC"], ["page_size", filters.size], ...filterParams(filters)];
  const token = listState.tokens[listState.page];
  if (token) params.push(["page_token", token]);
  return params;
}

function taskRow(task, owners) {
  const tags = Object.entries(task.tags || {}).map(([k, v]) => (v ? `${k}=${v}` : k));
  const link = el("a", { href: `#/task/${encodeURIComponent(task.id)}` }, task.name || "(no name)");
  const log = lastAttempt(task);
  const used = usage(task, log);
  return el("tr", { "data-id": task.id },
    el("td", { class: "name" }, link),
    el("td", { class: `state state-${task.state}` }, task.state),
    owners ? el("td", { class: "owner" }, owners[task.id] || "") : null,
    el("td", { class: "job" }, ((log && log.metadata) || {}).slurm_job_id || ""),
    el("td", { class: "created", title: task.creation_time || "" }, when(task.creation_time)),
    el("td", { class: "duration" }, expectedStart(log) || duration(used.elapsed)),
    el("td", { class: "exit" }, exitCode(log)),
    el("td", { class: "reason" }, reasonOf(task)),
    el("td", { class: "tags" }, tags.join(", ")),
    el("td", { class: "id" }, task.id));
}

function countsPart(counts) {
  const total = Object.values(counts).reduce((sum, n) => sum + n, 0);
  const current = listState.filters.state;
  const chip = (state, label, n) => el("a", {
    class: `count${state ? ` state-${state}` : ""}${state === current ? " current" : ""}`,
    "data-state": state, href: hashFor("", { ...listState.filters, state }),
  }, `${label} `, el("b", {}, String(n)));
  return [chip("", "all", total),
    ...STATES.filter((state) => counts[state]).map((state) => chip(state, state, counts[state]))];
}

async function loadList() {
  const filters = listState.filters;
  const [answer, summary] = await Promise.all([
    api("tasks", { params: listParams() }),
    api("summary", { base: UI_DATA, params: filterParams(filters, { withState: false }) }),
  ]);
  const tasks = answer.tasks || [];
  const owners = await ownersOf(tasks.map((task) => task.id));
  $("owner-head").hidden = owners === null;
  clear($("tasks").tBodies[0]).append(...tasks.map((task) => taskRow(task, owners)));
  clear($("state-counts")).append(...countsPart(summary.counts || {}));
  $("workflow-hint").hidden = !(filters.name || filters.tag);
  $("workflow-link").setAttribute("href", hashFor("workflow", filters));
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

function showList(filters) {
  if (filters) {
    listState.filters = filters;
    listState.tokens = [""];
    listState.page = 0;
    showFilters(filters);
  }
  showOnly("list-view");
  return guarded(loadList).then(scheduleList);
}

function showOnly(id) {
  for (const view of ["list-view", "task-view", "workflow-view"]) $(view).hidden = view !== id;
}

// ------------------------------------------------------------------------------ a workflow
// The tasks that share a tag, a name prefix, or a directory and a span of creation times, as
// Nextflow's timeline report draws a run: each task's waiting and running spans on one time
// axis, and what each used of what it asked.

// A time as typed, in ms (NaN when not given): `nextflow log`'s "2026-05-04 13:02:11" is the
// browser's local time; RFC 3339 with a zone ("…Z", "…+02:00") is that zone's.
function timeFilter(text) {
  return text ? Date.parse(text.trim().replace(" ", "T")) : NaN;
}

// Whether any input or output of the task is `dir` or under it (a bare path or a file:// URL).
function under(task, dir) {
  const root = dir.replace(/\/+$/, "");
  return [...(task.inputs || []), ...(task.outputs || [])].some((item) => {
    const path = String(item.url || "").replace(/^file:\/\//, "");
    return path === root || path.startsWith(`${root}/`);
  });
}

async function workflowTasks(filters) {
  const since = timeFilter(filters.since);
  const until = timeFilter(filters.until);
  const wanted = (task) => {
    const created = Date.parse(task.creation_time);
    return !(created < since || created > until) && (!filters.dir || under(task, filters.dir));
  };
  const tasks = [];
  let token = "";
  let older = false;
  do {
    const params = [["view", "BASIC"], ["page_size", String(WORKFLOW_PAGE_SIZE)], ...filterParams(filters)];
    if (token) params.push(["page_token", token]);
    const answer = await api("tasks", { params });
    const page = answer.tasks || [];
    tasks.push(...page.filter(wanted));
    // Newest first: once a page reaches back before `since`, no later page has one.
    older = page.some((task) => Date.parse(task.creation_time) < since);
    token = answer.next_page_token || "";
  } while (token && !older && tasks.length < WORKFLOW_MAX_TASKS);
  return tasks.reverse();  // oldest first, as they were created
}

function svg(tag, attrs = {}, ...children) {
  const node = document.createElementNS(SVG_NS, tag);
  for (const [key, value] of Object.entries(attrs)) node.setAttribute(key, String(value));
  for (const child of children) node.append(child instanceof Node ? child : String(child));
  return node;
}

// Each task's spans in milliseconds: created → started (waiting), started → ended (running).
function spans(task, now) {
  const created = Date.parse(task.creation_time);
  const logs = task.logs || [];
  const first = logs.find((log) => log.start_time);
  const last = lastAttempt(task);
  const started = first ? Date.parse(first.start_time) : NaN;
  let ended = last && last.end_time ? Date.parse(last.end_time) : NaN;
  if (!Number.isFinite(ended)) ended = FINAL.has(task.state) ? NaN : now;
  return { created, started, ended };
}

function timelinePart(tasks) {
  const now = Date.now();
  const rows = tasks.map((task) => ({ task, ...spans(task, now) }))
    .filter((row) => Number.isFinite(row.created));
  if (!rows.length) return el("p", { class: "note" }, "No task to draw.");
  const t0 = Math.min(...rows.map((row) => row.created));
  const ends = rows.flatMap((row) => [row.created, row.started, row.ended]).filter(Number.isFinite);
  const t1 = Math.max(t0 + 1000, ...ends);
  const [label, width, rowHeight, top] = [240, 1000, 16, 22];
  const x = (t) => label + ((t - t0) / (t1 - t0)) * (width - label - 10);
  const height = top + rows.length * rowHeight + 4;
  const chart = svg("svg", {
    id: "timeline-chart", viewBox: `0 0 ${width} ${height}`, width: "100%", role: "img",
    "aria-label": `Timeline of ${rows.length} tasks`,
  });
  for (const fraction of [0, 0.25, 0.5, 0.75, 1]) {
    const at = x(t0 + fraction * (t1 - t0));
    chart.append(svg("line", { class: "tl-grid", x1: at, x2: at, y1: top - 6, y2: height }),
      svg("text", { class: "tl-axis", x: at, y: 12, "text-anchor": fraction === 1 ? "end" : "middle" },
        duration((fraction * (t1 - t0)) / 1000) || "0 s"));
  }
  rows.forEach((row, index) => {
    const y = top + index * rowHeight;
    const name = row.task.name || row.task.id;
    const group = svg("g", { class: "tl-row", "data-id": row.task.id });
    group.append(svg("text", { class: "tl-label", x: label - 6, y: y + 11, "text-anchor": "end" },
      name.length > 34 ? `${name.slice(0, 33)}…` : name));
    const waitEnd = Number.isFinite(row.started) ? row.started : (Number.isFinite(row.ended) ? row.ended : now);
    group.append(svg("rect", { class: "tl-queued", x: x(row.created), y: y + 2, height: rowHeight - 5,
      width: Math.max(1, x(waitEnd) - x(row.created)) },
    svg("title", {}, `${name}: waiting ${duration((waitEnd - row.created) / 1000)}`)));
    if (Number.isFinite(row.started)) {
      const end = Number.isFinite(row.ended) ? row.ended : row.started;
      group.append(svg("rect", { class: `tl-run tl-${row.task.state}`, x: x(row.started), y: y + 2,
        height: rowHeight - 5, width: Math.max(1, x(end) - x(row.started)) },
      svg("title", {}, `${name}: running ${duration((end - row.started) / 1000)} (${[row.task.state, reasonOf(row.task)].filter(Boolean).join(": ")})`)));
    }
    chart.append(group);
  });
  return chart;
}

// Requested against used per task: CPU (cores × elapsed against CPU time) and memory
// (requested against peak), each bar scaled to the largest request of its column.
function resourcePicturePart(rows) {
  const [label, width, rowHeight, top] = [240, 1000, 16, 22];
  const column = (width - label - 20) / 2;
  const cpuMax = Math.max(1e-9, ...rows.map((r) => (r.used.elapsed || 0) * r.used.cores), ...rows.map((r) => r.used.cpu || 0));
  const memMax = Math.max(1, ...rows.map((r) => r.used.requested || 0), ...rows.map((r) => r.used.peak || 0));
  const height = top + rows.length * rowHeight + 4;
  const chart = svg("svg", {
    id: "resource-chart", viewBox: `0 0 ${width} ${height}`, width: "100%", role: "img",
    "aria-label": "Requested against used CPU time and memory per task",
  });
  chart.append(svg("text", { class: "tl-axis", x: label, y: 12 }, "CPU: cores × elapsed (outline) and CPU time used (filled)"),
    svg("text", { class: "tl-axis", x: label + column + 20, y: 12 }, "Memory: requested (outline) and peak (filled)"));
  const bar = (group, left, y, value, max, kind, text) => {
    if (!value) return;
    group.append(svg("rect", { class: kind, x: left, y: y + 2, height: rowHeight - 5,
      width: Math.max(1, (value / max) * column) }, svg("title", {}, text)));
  };
  rows.forEach((row, index) => {
    const y = top + index * rowHeight;
    const name = row.task.name || row.task.id;
    const group = svg("g", { class: "res-row", "data-id": row.task.id });
    group.append(svg("text", { class: "tl-label", x: label - 6, y: y + 11, "text-anchor": "end" },
      name.length > 34 ? `${name.slice(0, 33)}…` : name));
    const u = row.used;
    bar(group, label, y, (u.elapsed || 0) * u.cores, cpuMax, "res-asked", `${name}: ${u.cores} cores × ${duration(u.elapsed)}`);
    bar(group, label, y, u.cpu, cpuMax, "res-used", `${name}: CPU time ${duration(u.cpu)} (${percent(u.cpuEfficiency)})`);
    bar(group, label + column + 20, y, u.requested, memMax, "res-asked", `${name}: ${bytes(u.requested)} requested`);
    bar(group, label + column + 20, y, u.peak, memMax, "res-used", `${name}: peak ${bytes(u.peak)} (${percent(u.memoryEfficiency)})`);
    chart.append(group);
  });
  return chart;
}

function efficiencyCell(ratio) {
  if (ratio === null || !Number.isFinite(ratio)) return el("td", { class: "efficiency" }, "");
  return el("td", { class: "efficiency" },
    el("meter", { min: "0", max: "1", low: "0.3", optimum: "1", value: String(Math.min(ratio, 1)) }),
    ` ${percent(ratio)}`);
}

function resourceRow(row) {
  const u = row.used;
  return el("tr", { "data-id": row.task.id },
    el("td", { class: "name" }, el("a", { href: `#/task/${encodeURIComponent(row.task.id)}` },
      row.task.name || "(no name)")),
    el("td", { class: `state state-${row.task.state}` }, row.task.state),
    el("td", { class: "reason" }, reasonOf(row.task)),
    el("td", {}, String(u.cores)),
    el("td", {}, duration(u.elapsed)),
    el("td", { class: "cpu-time" }, u.cpu === null ? "" : duration(u.cpu)),
    efficiencyCell(u.cpuEfficiency),
    el("td", {}, u.requested ? bytes(u.requested) : "not asked"),
    el("td", { class: "peak", title: u.peakSource }, u.peak ? bytes(u.peak) : ""),
    efficiencyCell(u.memoryEfficiency));
}

function workflowSummary(rows, filters) {
  const byState = {};
  for (const row of rows) byState[row.task.state] = (byState[row.task.state] || 0) + 1;
  const sum = (f) => rows.reduce((total, row) => total + (f(row.used) || 0), 0);
  const measured = rows.filter((row) => row.used.cpuEfficiency !== null);
  const cpuUsed = measured.reduce((t, r) => t + r.used.cpu, 0);
  const cpuAsked = measured.reduce((t, r) => t + r.used.cores * r.used.elapsed, 0);
  const memRows = rows.filter((row) => row.used.memoryEfficiency !== null);
  const memUsed = memRows.reduce((t, r) => t + r.used.peak, 0);
  const memAsked = memRows.reduce((t, r) => t + r.used.requested, 0);
  const spansAll = rows.map((row) => spans(row.task, Date.now()));
  const first = Math.min(...spansAll.map((s) => s.created));
  const last = Math.max(...spansAll.flatMap((s) => [s.started, s.ended]).filter(Number.isFinite), first);
  const what = [
    filters.tag ? `tag ${filters.tag}` : "",
    filters.name ? `names starting ${filters.name}` : "",
    filters.dir ? `files under ${filters.dir}` : "",
    filters.since ? `created from ${filters.since}` : "",
    filters.until ? `created until ${filters.until}` : "",
  ].filter(Boolean).join(", ");
  $("workflow-title").textContent = `Workflow: ${what}`;
  return [
    `${rows.length} tasks (${Object.entries(byState).map(([k, v]) => `${v} ${k}`).join(", ")})`,
    `from first creation to last end ${duration((last - first) / 1000)}`,
    `CPU time ${duration(sum((u) => u.cpu))}`,
    cpuAsked ? `CPU efficiency ${percent(cpuUsed / cpuAsked)}` : "",
    memAsked ? `memory efficiency ${percent(memUsed / memAsked)}` : "",
  ].filter(Boolean).join(" · ");
}

let workflowLoads = 0;
// The filters of the workflow shown: its own form changes the directory and the times only.
let workflowFilters = filtersFrom("");

async function loadWorkflow(filters) {
  const tasks = await workflowTasks(filters);
  const rows = tasks.map((task) => ({ task, used: usage(task, lastAttempt(task)) }));
  $("workflow-summary").textContent = workflowSummary(rows, filters);
  clear($("timeline")).append(timelinePart(tasks));
  clear($("resource-picture")).append(resourcePicturePart(rows));
  clear($("resources").tBodies[0]).append(...rows.map(resourceRow));
  workflowLoads += 1;
  $("workflow-view").dataset.loaded = String(workflowLoads);
  return tasks;
}

function showWorkflow(filters) {
  showOnly("workflow-view");
  $("workflow-back").setAttribute("href", hashFor("", filters));
  for (const key of RUN_FILTERS) $(`workflow-${key}`).value = filters[key];
  workflowFilters = filters;
  if (!filters.name && !filters.tag && !filters.dir && !filters.since) {
    showError("A workflow is the tasks of a tag or a name prefix (the list's filters), or of a "
      + "directory or a start time (above).");
    return Promise.resolve();
  }
  const again = async () => {
    let unfinished = true;
    await guarded(async () => {
      const tasks = await loadWorkflow(filters);
      unfinished = tasks.some((task) => !FINAL.has(task.state));
    });
    if (unfinished && $("auto-refresh").checked && location.hash.startsWith("#/workflow")) {
      refreshTimer = setTimeout(again, REFRESH_MS);
    }
  };
  return again();
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

// ------------------------------------------------------------------------------ executor output
// An executor's stream is shown as pieces: text, or a part marked as left out of the task
// document ({ leftOut, note }), or a line that says where bytes were left out ({ cut }).
function showPieces(node, pieces) {
  node.replaceChildren(...pieces.map((piece) => {
    if (typeof piece === "string") return document.createTextNode(piece);
    if (piece.cut !== undefined) return el("span", { class: "cut" }, piece.cut);
    return el("span", { class: "left-out", "data-note": piece.note, title: piece.note }, piece.leftOut);
  }));
}

// The task document's copy of a stream, its cut line (if any) marked.
function documentPieces(text) {
  const match = CUT_LINE.exec(text || "");
  if (!match) return [text || ""];
  // The marked line is a block of its own: without the newline that ends it.
  return [text.slice(0, match.index), { cut: match[0] }, text.slice(match.index + match[0].length + 1)];
}

const count = (n) => Number(n).toLocaleString("en-US");

function outputReader(id, where) {
  return (offset) => api(`tasks/${encodeURIComponent(id)}/output`,
    { params: [...where, ["offset", offset], ["max_bytes", READ_BYTES]] });
}

// The whole of a finished stream, from the output endpoint: null when its files are gone. The
// part the task document left out is marked in it; past SHOWN_BYTES, only its two ends.
async function wholePieces(id, where, documented) {
  const read = outputReader(id, where);
  let answer = await read(0);
  if (!answer.started) return null;
  const size = answer.size;
  if (size > SHOWN_BYTES) {
    const tail = await read(-READ_BYTES);
    const cut = `[the page shows the first ${count(answer.next_offset)} and the last `
      + `${count(size - tail.offset)} of ${count(size)} bytes: download for the whole]`;
    return [answer.text, { cut }, tail.text];
  }
  let text = answer.text;
  while (answer.next_offset < size && answer.text) {
    answer = await read(answer.next_offset);
    text += answer.text;
  }
  const match = CUT_LINE.exec(documented);
  const head = match ? documented.slice(0, match.index) : "";
  const tail = match ? documented.slice(match.index + match[0].length + 1) : "";  // after its \n
  if (!match || !text.startsWith(head) || !text.endsWith(tail) || head.length + tail.length > text.length) {
    return [text];
  }
  const note = `the task document leaves out these ${match[1]} of ${match[2]} bytes`;
  return [head, { leftOut: text.slice(head.length, text.length - tail.length), note }, tail];
}

// What a download of a stream saves: the document's copy when it is whole, else all of the
// stream from the endpoint (the copy again when its files are gone).
async function wholeText(id, where, documented) {
  if (!CUT_LINE.test(documented)) return documented;
  const read = outputReader(id, where);
  const parts = [];
  let offset = 0;
  for (;;) {
    const answer = await read(offset);
    if (!answer.started) return documented;
    parts.push(answer.text);
    if (answer.next_offset >= answer.size || answer.next_offset <= offset) return parts.join("");
    offset = answer.next_offset;
  }
}

function download(name, text) {
  const url = URL.createObjectURL(new Blob([text], { type: "text/plain;charset=utf-8" }));
  const save = el("a", { href: url, download: name });
  document.body.append(save);
  save.click();
  save.remove();
  setTimeout(() => URL.revokeObjectURL(url), 60000);
}

function downloadLink(id, where, name, documented) {
  const link = el("a", { href: "#", class: "download", "data-name": name }, "download");
  link.addEventListener("click", (event) => {
    event.preventDefault();
    link.textContent = "downloading…";
    guarded(async () => download(name, await wholeText(id, where, documented)))
      .then(() => { link.textContent = "download"; });
  });
  return link;
}

// One stream of a finished executor: its label with a download link, and its text. A copy the
// task document cut is replaced by the whole stream once read (kept: it no longer changes).
function streamPart(task, attempt, number, stream, documented) {
  const key = `${attempt}/${number}/${stream}`;
  const where = [["attempt", attempt], ["executor", number], ["stream", stream]];
  const text = el("pre", { class: stream, "data-key": key });
  const label = el("p", { class: "stream-label" }, stream);
  if (documented) {
    label.append(" · ", downloadLink(task.id, where, `${task.id}-${attempt}-${number}.${stream}.txt`, documented));
  }
  const cut = CUT_LINE.test(documented || "");
  const whole = current.whole.get(key);
  showPieces(text, whole || documentPieces(documented));
  text.dataset.whole = whole || !cut ? "yes" : "no";
  if (cut && !whole && !current.loading.has(key)) {
    current.loading.add(key);
    const shown = current;
    guarded(async () => {
      let pieces;
      try {
        pieces = await wholePieces(task.id, where, documented);
      } catch (error) {
        shown.loading.delete(key);  // read again at the next refresh
        throw error;
      }
      if (!pieces || current !== shown) return;
      shown.whole.set(key, pieces);
      const node = $("attempts").querySelector(`pre[data-key="${key}"]`);
      if (node) {
        showPieces(node, pieces);
        node.dataset.whole = "yes";
      }
    });
  }
  return [label, text];
}

// A task staged on a transfer partition: one of its transfer jobs (part: "stage_in" or
// "stage_out"), its id, state, exit code and partition from the attempt's metadata
// (bridge/poller/chain.py); "" for a task of one job.
function transferJob(meta, part) {
  const id = meta[`slurm_${part}_job_id`];
  if (!id) return "";
  const code = meta[`slurm_${part}_exit_code`];
  const partition = meta[`slurm_${part}_partition`];
  return el("span", { class: `job-${part.replace("_", "-")}` },
    [id, meta[`slurm_${part}_state`] || "submitted", code ? `exit code ${code}` : "",
     partition ? `partition ${partition}` : ""].filter(Boolean).join(", "));
}

// The --time the attempt's job got and where it came from (bridge/poller/submit/record.py).
function timeLimit(meta) {
  if (meta.slurm_time_limit) return meta.slurm_time_limit;
  return meta.slurm_job_id ? "no --time: the partition's own limit" : "";
}

function attemptPart(task, log, index) {
  const meta = log.metadata || {};
  const used = usage(task, log);
  const card = el("div", { class: "card attempt", "data-attempt": String(index + 1) },
    el("h4", {}, `Attempt ${index + 1}`),
    definitions([
      ["Stage-in job", transferJob(meta, "stage_in")],
      ["Slurm job", meta.slurm_job_id], ["Node", meta.slurm_node],
      ["Partition", meta.slurm_partition],
      ["Time limit", timeLimit(meta) ? el("span", { class: "time-limit" }, timeLimit(meta)) : ""],
      ["Slurm state", meta.slurm_state],
      ["Start", expectedStart(log)],
      ["Started", when(log.start_time)], ["Ended", when(log.end_time)],
      ["Elapsed", meta.slurm_elapsed_seconds ? `${meta.slurm_elapsed_seconds} s` : ""],
      ["Max RSS", used.peak ? el("span", { class: "max-rss", title: used.peakSource },
        `${bytes(used.peak)}${used.peakSource === "sacct MaxRSS" ? "" : ` (${used.peakSource})`}`) : ""],
      ["CPU time", used.cpu === null ? "" : `${duration(used.cpu)}`],
      ["CPU efficiency", used.cpuEfficiency === null ? "" : el("span", { class: "cpu-efficiency" },
        `${percent(used.cpuEfficiency)} (CPU time of ${used.cores} × ${duration(used.elapsed)})`)],
      ["Memory efficiency", used.memoryEfficiency === null ? "" : el("span", { class: "memory-efficiency" },
        `${percent(used.memoryEfficiency)} (peak of ${bytes(used.requested)} requested)`)],
      ["Stage-out job", transferJob(meta, "stage_out")],
    ]));
  for (const [number, executor] of (log.logs || []).entries()) {
    card.append(el("h5", {}, `Executor ${number}: exit code ${executor.exit_code}`),
      definitions([["Started", when(executor.start_time)], ["Ended", when(executor.end_time)]]),
      ...streamPart(task, index + 1, number, "stdout", executor.stdout || ""),
      ...streamPart(task, index + 1, number, "stderr", executor.stderr || ""));
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

// The task shown: { id, task, owner, whole: finished streams read whole, loading: their keys }.
let current = null;

function renderTask(task, owner) {
  $("task-name").textContent = task.name || "(no name)";
  const tags = Object.entries(task.tags || {}).map(([k, v]) => (v ? `${k}=${v}` : k));
  const resources = task.resources || {};
  const params = resources.backend_parameters || {};
  clear($("task-summary")).append(...definitions([
    ["Id", task.id],
    ["State", el("span", { id: "task-state", class: `state state-${task.state}` }, task.state)],
    ["Owner", owner ? el("span", { id: "task-owner" }, owner) : ""],
    ["Created", when(task.creation_time)],
    ["Resubmit of", (task.tags || {})[RESUBMIT_TAG] ? el("a", {
      id: "resubmit-of", href: `#/task/${encodeURIComponent(task.tags[RESUBMIT_TAG])}`,
    }, task.tags[RESUBMIT_TAG]) : ""],
    ["Description", task.description],
    // Each tag leads to the workflow of the tasks that share it.
    ["Tags", tags.length ? el("span", { id: "task-tags" }, ...tags.flatMap((tag, index) => [
      index ? ", " : "",
      el("a", { href: hashFor("workflow", { tag }), title: "timeline and resources of the tasks with this tag" }, tag),
    ])) : ""],
    ["Resources", [
      resources.cpu_cores ? `${resources.cpu_cores} CPU` : "",
      resources.ram_gb ? `${resources.ram_gb} GB RAM` : "",
      resources.disk_gb ? `${resources.disk_gb} GB disk` : "",
      resources.preemptible ? "preemptible" : "",
      (resources.zones || []).length ? `zones ${resources.zones.join(", ")}` : "",
    ].filter(Boolean).join(", ")],
    // As stored: a key this server does not support was dropped (its system log says so).
    ["Backend parameters", Object.keys(params).length ? el("span", { id: "task-backend-parameters" },
      Object.entries(params).map(([key, value]) => `${key}=${value}`).join(", ")) : ""],
  ]).childNodes);
  const final = FINAL.has(task.state);
  $("cancel").hidden = final;
  $("resubmit").hidden = false;
  if (final) $("cancel-confirm").hidden = true;
  clear($("executors")).append(...executorsPart(task));
  clear($("inputs")).append(...filesPart(task.inputs, "inputs"));
  clear($("outputs")).append(...filesPart(task.outputs, "outputs"));
  const attempts = (task.logs || []).map((log, index) => attemptPart(task, log, index));
  clear($("attempts")).append(...(attempts.length ? attempts
    : [el("p", { class: "note" }, "Not started yet.")]));
}

async function loadTask(id) {
  const task = await api(`tasks/${encodeURIComponent(id)}`, { params: [["view", "FULL"]] });
  if (!current || current.id !== id) return;
  if (current.owner === undefined) {
    const owners = await ownersOf([id]);
    current.owner = owners ? owners[id] || "" : "";
  }
  current.task = task;
  renderTask(task, current.owner);
}

// A stream's label and text, kept between refreshes so that the reader's scroll position stays:
// the text follows its end unless the reader scrolled up (back at the end, it follows again).
function liveStream(stream) {
  let text = $("live-streams").querySelector(`pre.live-${stream}`);
  if (!text) {
    const label = el("p", { class: "stream-label" });
    text = pre("", `live-${stream}`);
    text.dataset.follow = "yes";
    text.addEventListener("scroll", () => {
      const atEnd = text.scrollTop + text.clientHeight >= text.scrollHeight - 4;
      text.dataset.follow = atEnd ? "yes" : "no";
    });
    $("live-streams").append(label, text);
  }
  return { label: text.previousElementSibling, text };
}

// Live output: the tail of each stream of the executor that runs now, from the output
// endpoint (an executor's log enters the task document only once it has an exit code).
async function loadLive(id) {
  const task = current && current.task;
  if (!task) return;
  const done = (task.logs && task.logs.length) ? (task.logs[task.logs.length - 1].logs || []).length : 0;
  const executor = Math.min(done, Math.max((task.executors || []).length - 1, 0));
  for (const stream of ["stdout", "stderr"]) {
    const answer = await api(`tasks/${encodeURIComponent(id)}/output`, {
      params: [["executor", executor], ["stream", stream], ["offset", -LIVE_TAIL_BYTES]],
    });
    if (!current || current.id !== id) return;
    // Shown before it is filled: a hidden element has no height to scroll to its end.
    $("live").hidden = false;
    const { label, text } = liveStream(stream);
    label.textContent = `Executor ${executor} ${stream} (${bytes(answer.size)}${answer.done ? ", finished" : ""})`;
    if (text.textContent !== (answer.text || "")) text.textContent = answer.text || "";
    // At its end, whether the text grew or not (the output may have stopped, the executor too),
    // unless the reader scrolled up.
    if (text.dataset.follow !== "no") text.scrollTop = text.scrollHeight;
  }
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
  showOnly("task-view");
  $("live").hidden = true;
  clear($("live-streams"));
  $("cancel-confirm").hidden = true;
  $("resubmit").hidden = true;
  $("resubmit-form").hidden = true;
  current = { id, task: null, owner: undefined, whole: new Map(), loading: new Set() };
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

// ------------------------------------------------------------------------------ resubmit
// A copy of the task shown, posted as a new task (tasks never change) with the changes of the
// form, as `tes-bridge task resubmit` makes it: the server's answer to a GET without what it
// added, tagged with the task's id. The API's own rules apply: who may read the task may post
// its copy, and the copy is theirs.
const RESUBMIT_FIELDS = [
  // input, where the value goes, the backend parameters it replaces (any case)
  ["resubmit-time", "time", ["time", "time_limit", "max_time"]],
  ["resubmit-partition", "partition", ["partition"]],
  ["resubmit-cpus", "cpu_cores", null],
  ["resubmit-ram", "ram_gb", null],
];

function parameter(params, key) {
  const found = Object.keys(params).find((name) => name.toLowerCase() === key);
  return found === undefined ? "" : params[found];
}

function openResubmit() {
  const task = current && current.task;
  if (!task) return;
  const resources = task.resources || {};
  const params = resources.backend_parameters || {};
  const shown = {
    "resubmit-time": parameter(params, "time") || parameter(params, "time_limit"),
    "resubmit-partition": parameter(params, "partition"),
    "resubmit-cpus": resources.cpu_cores ?? "",
    "resubmit-ram": resources.ram_gb ?? "",
  };
  for (const [id] of RESUBMIT_FIELDS) {
    $(id).value = String(shown[id]);
    $(id).dataset.shown = $(id).value;
  }
  $("resubmit-form").hidden = false;
}

function resubmittedCopy(task) {
  const copy = Object.fromEntries(Object.entries(task)
    .filter(([key]) => !["id", "state", "creation_time", "logs"].includes(key)));
  const resources = { ...(copy.resources || {}) };
  let params = { ...(resources.backend_parameters || {}) };
  for (const [id, key, replaces] of RESUBMIT_FIELDS) {
    const value = $(id).value.trim();
    if (value === $(id).dataset.shown) continue;  // left as it was: kept
    if (replaces) {
      params = Object.fromEntries(Object.entries(params)
        .filter(([name]) => !replaces.includes(name.toLowerCase())));
      if (value) params[key] = value;
      if (key === "partition") delete resources.zones;
    } else if (value) {
      resources[key] = Number(value);
    } else {
      delete resources[key];
    }
  }
  if (Object.keys(params).length) resources.backend_parameters = params;
  else delete resources.backend_parameters;
  if (Object.keys(resources).length) copy.resources = resources;
  else delete copy.resources;
  copy.tags = { ...(copy.tags || {}), [RESUBMIT_TAG]: task.id };
  return copy;
}

function submitResubmit(event) {
  event.preventDefault();
  const task = current && current.task;
  if (!task) return;
  guarded(async () => {
    const answer = await api("tasks", { method: "POST", body: resubmittedCopy(task) });
    go(`#/task/${encodeURIComponent(answer.id)}`);
  });
}

// ------------------------------------------------------------------------------ routing
function route() {
  stopTimers();
  showWho();
  showError("");
  const match = /^#\/task\/(.+)$/.exec(location.hash);
  if (match) return showTask(decodeURIComponent(match[1]));
  current = null;
  const workflow = /^#\/workflow(?:\?(.*))?$/.exec(location.hash);
  if (workflow) return showWorkflow(filtersFrom(workflow[1]));
  const list = /^#\/?\?(.*)$/.exec(location.hash);
  return showList(filtersFrom(list ? list[1] : ""));
}

function start() {
  for (const state of STATES) $("filter-state").append(el("option", { value: state }, state));
  $("login").addEventListener("submit", signIn);
  $("sign-out").addEventListener("click", signOut);
  $("filters").addEventListener("submit", (event) => {
    event.preventDefault();
    go(hashFor("", formFilters()));
  });
  $("filter-state").addEventListener("change", () => $("filter-apply").click());
  $("auto-refresh").addEventListener("change", () => (location.hash.startsWith("#/task/")
    || location.hash.startsWith("#/workflow") ? null : scheduleList()));
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
  $("workflow-filters").addEventListener("submit", (event) => {
    event.preventDefault();
    const filters = { ...workflowFilters };
    for (const key of RUN_FILTERS) filters[key] = $(`workflow-${key}`).value.trim();
    go(hashFor("workflow", filters));
  });
  $("cancel").addEventListener("click", cancelTask);
  $("cancel-confirm").addEventListener("click", confirmCancel);
  $("resubmit").addEventListener("click", openResubmit);
  $("resubmit-close").addEventListener("click", () => { $("resubmit-form").hidden = true; });
  $("resubmit-form").addEventListener("submit", submitResubmit);
  window.addEventListener("hashchange", route);
  route();
}

document.addEventListener("DOMContentLoaded", start);
