// The Chorus dashboard: loads /api/state, then applies the updates of /api/stream (Server-Sent Events).
"use strict";

const MAX_POINTS = 1500, RECENT = 300, MAX_EPISODES = 400, SHOWN_EPISODES = 60;
const PALETTE = ["#2f6fdf", "#e8590c", "#1f9d55", "#9c36b5", "#c2255c", "#0b7285", "#b08900", "#5c7cfa",
                 "#37b24d", "#f03e3e"];
const $ = (id) => document.getElementById(id);
const S = { steps: {}, evals: [], drops: {}, critic: [], gauges: {}, episodes: [], events: [], models: [],
            agents: {}, fields: [], started: Date.now() / 1000, live: "starting", run: "" };
const colors = {};
const color = (name) => colors[name] || (colors[name] = PALETTE[Object.keys(colors).length % PALETTE.length]);
const charts = {};
const filter = { agent: "", reward: "", version: null, kind: "" };
let episodesDirty = true, cardsDirty = true, source = null;

function decimate(points) {
  if (points.length <= MAX_POINTS) return points;
  const old = points.slice(0, points.length - RECENT), recent = points.slice(points.length - RECENT);
  const room = MAX_POINTS - RECENT, stride = Math.ceil(old.length / room);
  return old.filter((_, i) => i % stride === 0).slice(0, room).concat(recent);
}

function push(list, item) {
  list.push(item);
  return list.length > MAX_POINTS + RECENT ? decimate(list) : list;
}

// --- state ---------------------------------------------------------------------------------------------------
function load(snap) {
  S.run = snap.run; S.models = snap.models; S.agents = snap.agents; S.fields = snap.step_fields;
  S.steps = snap.steps; S.evals = snap.evals; S.drops = snap.drops; S.critic = snap.critic;
  S.gauges = snap.gauges; S.episodes = snap.episodes; S.events = snap.events; S.max = snap.max_versions;
  let t0 = snap.started;
  for (const rows of Object.values(snap.steps)) if (rows.length) t0 = Math.min(t0, rows[0][1]);
  for (const pts of Object.values(snap.gauges)) if (pts.length) t0 = Math.min(t0, pts[0].time);
  S.started = t0;
  S.models.forEach(color);
  Object.keys(S.agents).forEach(color);
  $("run").textContent = snap.run;
  const agentSel = $("f-agent");
  agentSel.length = 1;
  for (const a of Object.keys(S.agents)) agentSel.add(new Option(`${a} (${S.agents[a]})`, a));
  setLive(snap.live);
  episodesDirty = cardsDirty = true;
  Object.values(charts).forEach((c) => (c.dirty = true));
  renderEvents();
}

function apply(u) {
  switch (u.t) {
    case "step": S.steps[u.model] = push(S.steps[u.model] || [], u.row); cardsDirty = true; break;
    case "eval": S.evals.push(u.eval); S.evals.sort((a, b) => a.version - b.version || a.time - b.time); cardsDirty = true; break;
    case "drop": (S.drops[u.model] = S.drops[u.model] || {})[u.reason] = ((S.drops[u.model] || {})[u.reason] || 0) + u.count; break;
    case "critic": S.critic = push(S.critic, u.row); break;
    case "gauge": S.gauges[u.key] = push(S.gauges[u.key] || [], u.point); cardsDirty = true; break;
    case "episode":
      S.episodes.push(u.episode);
      if (S.episodes.length > MAX_EPISODES) S.episodes.splice(0, S.episodes.length - MAX_EPISODES);
      episodesDirty = true; break;
    case "event": S.events.push(u.event); if (S.events.length > 50) S.events.shift(); break;
    case "live": setLive(u.live); break;
    case "note": S.events.push({ service: "dashboard", kind: "note", time: Date.now() / 1000, text: u.text }); break;
  }
}

function setLive(live) {
  S.live = live;
  const el = $("live");
  el.textContent = live === "live" ? "live" : live === "offline" ? "run directory" : live === "finished" ? "finished" : live;
  el.className = "badge " + (live === "live" ? "live" : live === "bus gone" ? "gone" : "offline");
}

// --- series --------------------------------------------------------------------------------------------------
const xTime = () => $("xaxis").value === "time";
const F = (name) => S.fields.indexOf(name);

function stepSeries(field, opts = {}) {
  const vi = F("version"), ti = F("time"), fi = F(field);
  return S.models.map((m) => ({
    name: m + (opts.suffix || ""), color: color(m), dashed: opts.dashed, model: m,
    points: (S.steps[m] || []).map((r) => [xTime() ? r[ti] - S.started : r[vi], r[fi]]),
  }));
}

function gaugeSeries(service, field, opts = {}) {
  const out = [];
  for (const [key, points] of Object.entries(S.gauges)) {
    if (!key.startsWith(service + ".")) continue;
    const name = key.slice(service.length + 1);
    out.push({ name: (opts.prefix || "") + name + (opts.suffix || ""), dashed: opts.dashed, markers: opts.markers,
               color: color(points.length ? (points[0].model || name) : name) ,
               points: points.filter((p) => p[field] !== undefined && p[field] !== null)
                             .map((p) => [p.time - S.started, typeof opts.map === "function" ? opts.map(p) : p[field]]) });
  }
  return out;
}

function rate(points, field) {  // per-second rate of a counter between consecutive gauge points
  const out = [];
  for (let i = 1; i < points.length; i++) {
    const dt = points[i][0] - points[i - 1][0];
    if (dt > 0 && points[i][1] !== undefined && points[i - 1][1] !== undefined) out.push([points[i][0], Math.max(0, (points[i][1] - points[i - 1][1]) / dt)]);
  }
  return out;
}

function heldoutSeries() {
  const agents = new Set();
  for (const e of S.evals) Object.keys(e.pass1 || {}).forEach((a) => agents.add(a));
  const x = (e) => (xTime() ? e.time - S.started : e.version);
  const series = [...agents].map((a) => ({ name: a, color: color(a), markers: true,
    points: S.evals.filter((e) => e.pass1 && e.pass1[a] !== undefined).map((e) => [x(e), e.pass1[a]]) }));
  series.push({ name: "final answer", color: "#1d2330", dashed: true, markers: true,
    points: S.evals.filter((e) => e.final !== null && e.final !== undefined).map((e) => [x(e), e.final]) });
  return series;
}

function poolRows() {
  const rows = { slots: [], t0: 0, t1: 1, colors: {} };
  for (const [key, points] of Object.entries(S.gauges)) {
    if (!key.startsWith("trainer.") || !points.some((p) => p.slots)) continue;
    const withSlots = points.filter((p) => p.slots);
    rows.t0 = withSlots[0].time - S.started; rows.t1 = Math.max(rows.t0 + 1, Date.now() / 1000 - S.started);
    if (S.live !== "live") rows.t1 = withSlots[withSlots.length - 1].time - S.started;
    const n = Math.max(...withSlots.map((p) => p.slots.length));
    for (let s = 0; s < n; s++) {
      const segs = [];
      withSlots.forEach((p, i) => {
        const a = p.time - S.started, b = i + 1 < withSlots.length ? withSlots[i + 1].time - S.started : rows.t1;
        const holder = p.slots[s] || null;
        if (holder) rows.colors[holder] = color(holder);
        if (segs.length && segs[segs.length - 1][2] === holder) segs[segs.length - 1][1] = b; else segs.push([a, b, holder]);
      });
      rows.slots.push(segs);
    }
  }
  return rows;
}

// --- drawing -------------------------------------------------------------------------------------------------
function makeCharts() {
  const onVersion = (x) => { if (!xTime()) setVersion(Math.round(x)); else setVersionAtTime(x); };
  charts.reward = new ChorusChart.Line($("c-reward"), { onClick: onVersion });
  charts.heldout = new ChorusChart.Line($("c-heldout"), { yMin: 0, onClick: onVersion, empty: "no held-out evaluation yet" });
  charts.staleness = new ChorusChart.Line($("c-staleness"), { yMin: 0 });
  charts.depth = new ChorusChart.Line($("c-depth"), { time: true, yMin: 0 });
  charts.admit = new ChorusChart.Line($("c-admit"), { time: true, yMin: 0 });
  charts.tokens = new ChorusChart.Line($("c-tokens"), { time: true, yMin: 0 });
  charts.sync = new ChorusChart.Line($("c-sync"), { time: true, yMin: 0, empty: "no weight sync yet" });
  charts.actions = new ChorusChart.Line($("c-actions"), { time: true, yMin: 0, empty: "no actions service" });
  charts.pool = new ChorusChart.Timeline($("c-pool"), { time: true });
  charts.critic = new ChorusChart.Line($("c-critic"), { yMin: 0 });
}

function redraw() {
  const time = xTime();
  for (const k of ["reward", "heldout", "staleness", "critic"]) { charts[k].opts.time = time; }
  charts.reward.set(stepSeries("reward_mean"));
  charts.heldout.set(heldoutSeries());
  charts.staleness.set([...stepSeries("staleness_mean"), ...stepSeries("staleness_max", { dashed: true, suffix: " max" })
    .map((s) => ({ ...s, legend: false }))]);
  charts.depth.set(gaugeSeries("mq", "depth"));
  const admit = gaugeSeries("coordinator", "tasks_started").map((s) => ({ ...s, name: "tasks started/s", color: "#2f6fdf",
    points: rate(s.points, 1) }));
  const inflight = gaugeSeries("coordinator", "in_flight").map((s) => ({ ...s, name: "in flight", color: "#e8590c", dashed: true }));
  charts.admit.set([...admit, ...inflight]);
  charts.tokens.set(gaugeSeries("rollouter", "tokens_per_s"));
  charts.sync.set(gaugeSeries("rollouter", "sync_s", { markers: true }));
  const busy = gaugeSeries("actions", "busy_cores", { prefix: "cores in use " }).map((s) => ({ ...s, color: "#1d2330" }));
  const kinds = new Set();
  for (const [k, pts] of Object.entries(S.gauges)) if (k.startsWith("actions.")) pts.forEach((p) => Object.keys(p.queued_kinds || {}).forEach((q) => kinds.add(q)));
  const queued = [...kinds].map((kind) => ({ name: "queued " + kind, color: color("kind:" + kind), dashed: true,
    points: Object.entries(S.gauges).filter(([k]) => k.startsWith("actions.")).flatMap(([, pts]) =>
      pts.map((p) => [p.time - S.started, (p.queued_kinds || {})[kind] || 0])) }));
  charts.actions.set([...busy, ...queued]);
  const rows = poolRows();
  $("p-pool").hidden = !rows.slots.length;
  charts.pool.set(rows);
  $("p-critic").hidden = !S.critic.length;
  charts.critic.set([{ name: "value loss", color: "#9c36b5", points: S.critic.map((r) => [time ? r[1] - S.started : r[0], r[2]]) }]);
  const drops = Object.entries(S.drops).map(([m, by]) => `${m}: ` + Object.entries(by).map(([r, n]) => `${n} ${r}`).join(", "));
  $("drops").textContent = drops.length ? "dropped samples — " + drops.join("; ") : "no sample dropped";
}

function latestGauge(service, model) {
  let best = null;
  for (const [k, pts] of Object.entries(S.gauges)) {
    if (!k.startsWith(service + ".") || !pts.length) continue;
    const p = pts[pts.length - 1];
    if (model && p.model !== model) continue;
    if (!best || p.time > best.time) best = p;
  }
  return best;
}

function renderCards() {
  const el = $("cards");
  el.textContent = "";
  const lastEval = S.evals.length ? S.evals[S.evals.length - 1] : null;
  for (const m of S.models) {
    const rows = S.steps[m] || [], last = rows.length ? rows[rows.length - 1] : null;
    const mq = latestGauge("mq", m), ro = latestGauge("rollouter", m);
    const agents = Object.keys(S.agents).filter((a) => S.agents[a] === m);
    const held = lastEval ? agents.map((a) => lastEval.pass1 && lastEval.pass1[a] !== undefined ? `${a} ${lastEval.pass1[a].toFixed(3)}` : null).filter(Boolean).join(", ") : "";
    const v = last ? last[F("version")] : 0;
    const card = document.createElement("div");
    card.className = "card"; card.style.setProperty("--c", color(m)); card.dataset.model = m;
    const cells = [["version", `${v} / ${S.max}`], ["reward", last ? ChorusChart.fmt(last[F("reward_mean")]) : "–"],
      ["held-out", held || "–"], ["staleness", last ? `${ChorusChart.fmt(last[F("staleness_mean")])} (max ${last[F("staleness_max")]})` : "–"],
      ["cut at max_new_tokens", last && typeof last[F("truncated")] === "number" ? `${Math.round(100 * last[F("truncated")])}%` : "–"],
      ["mq depth", mq ? String(mq.depth) : "–"], ["tokens/s", ro && ro.tokens_per_s !== undefined ? ChorusChart.fmt(ro.tokens_per_s) : "–"]];
    const h = document.createElement("h3"); h.textContent = m; card.appendChild(h);
    const t = document.createElement("table");
    for (const [k, val] of cells) { const tr = t.insertRow(); tr.insertCell().textContent = k; tr.insertCell().textContent = val; }
    card.appendChild(t);
    const bar = document.createElement("div"); bar.className = "progress";
    const fill = document.createElement("div"); fill.style.width = Math.min(100, 100 * v / Math.max(1, S.max)) + "%";
    bar.appendChild(fill); card.appendChild(bar);
    el.appendChild(card);
  }
}

function renderEvents() {
  const ol = $("events");
  ol.textContent = "";
  for (const e of S.events.slice(-12).reverse()) {
    const li = document.createElement("li");
    const when = new Date(e.time * 1000).toLocaleTimeString();
    li.textContent = `${when} ${e.service} ${e.kind}${e.model ? " (" + e.model + ")" : ""}: ${e.text || ""}`;
    ol.appendChild(li);
  }
}

// --- trajectories --------------------------------------------------------------------------------------------
function setVersion(v) {
  filter.version = v; $("f-version").value = String(v); episodesDirty = true;
  location.hash = "#trajectories";
}

function setVersionAtTime(t) {  // a point of a time axis: the version trained nearest that moment
  let best = null;
  for (const rows of Object.values(S.steps)) for (const r of rows) {
    const d = Math.abs(r[F("time")] - S.started - t);
    if (!best || d < best.d) best = { d, v: r[F("version")] };
  }
  if (best) setVersion(best.v);
}

function keep(ep, anyVersion = false) {
  if (filter.kind === "train" && ep.eval) return false;
  if (filter.kind === "eval" && !ep.eval) return false;
  let turns = ep.turns;
  if (filter.agent) turns = turns.filter((t) => t.agent === filter.agent);
  if (!turns.length) return false;
  if (!anyVersion && filter.version !== null && !turns.some((t) => t.version === filter.version)) return false;
  const r = (t) => t.reward;
  if (filter.reward === "pos" && !turns.some((t) => r(t) > 0)) return false;
  if (filter.reward === "zero" && !turns.some((t) => r(t) === 0)) return false;
  if (filter.reward === "neg" && !turns.some((t) => r(t) < 0)) return false;
  if (filter.reward === "none" && !turns.some((t) => r(t) === null || r(t) === undefined)) return false;
  return true;
}

function text(tag, cls, content) {
  const el = document.createElement(tag);
  if (cls) el.className = cls;
  el.textContent = content;
  return el;
}

// A version with no sampled episode (one task in logging.samples_every is sampled, and the page keeps the latest
// MAX_EPISODES): said so, with the nearest versions below and above that have one under the other filters.
function noEpisodeOfVersion(v) {
  const versions = new Set();
  for (const ep of S.episodes) if (keep(ep, true)) for (const t of ep.turns)
    if ((!filter.agent || t.agent === filter.agent) && typeof t.version === "number") versions.add(t.version);
  const below = Math.max(...[...versions].filter((x) => x < v)), above = Math.min(...[...versions].filter((x) => x > v));
  const div = text("div", "empty", `no sampled episode of version ${v} (one task in logging.samples_every is sampled; ` +
    `the page keeps the latest ${MAX_EPISODES})`);
  const near = [below, above].filter(Number.isFinite);
  if (!near.length) return div;
  div.appendChild(document.createTextNode("; nearest versions that have one: "));
  near.forEach((x, i) => {
    const a = text("a", "nearest", `version ${x}`);
    a.href = "#trajectories"; a.dataset.version = String(x);
    a.onclick = (e) => { e.preventDefault(); setVersion(x); };
    if (i) div.appendChild(document.createTextNode(", "));
    div.appendChild(a);
  });
  return div;
}

function renderEpisodes() {
  const box = $("episodes");
  box.textContent = "";
  const kept = S.episodes.filter((ep) => keep(ep));
  $("ep-count").textContent = `(${kept.length} of the latest ${S.episodes.length} sampled episodes match; newest first)`;
  if (!kept.length && filter.version !== null) { box.appendChild(noEpisodeOfVersion(filter.version)); return; }
  if (!kept.length) { box.appendChild(text("div", "empty", "no episode matches (episodes are sampled every logging.samples_every tasks)")); return; }
  for (const ep of kept.slice(-SHOWN_EPISODES).reverse()) {
    const div = document.createElement("div");
    div.className = "episode"; div.dataset.task = ep.task_id;
    const head = document.createElement("div"); head.className = "head";
    head.appendChild(text("span", "q", ep.question));
    head.appendChild(text("span", "", `reference ${ep.reference}`));
    head.appendChild(text("span", ep.final_reward > 0 ? "ok" : "bad", `final reward ${ChorusChart.fmt(ep.final_reward)}`));
    head.appendChild(text("span", "muted", `${ep.eval ? "held-out" : "training"} · task ${ep.task_id} · ${new Date(ep.time * 1000).toLocaleTimeString()}`));
    div.appendChild(head);
    for (const t of ep.turns) {
      if (filter.agent && t.agent !== filter.agent) continue;
      const row = document.createElement("div"); row.className = "turn"; row.dataset.agent = t.agent;
      const who = document.createElement("div"); who.className = "who"; who.style.setProperty("--c", color(t.agent));
      who.appendChild(text("b", "", `${t.turn}. ${t.agent}`));
      who.appendChild(document.createElement("br"));
      const facts = [`model ${t.model}`, `version ${t.version ?? "–"}`, `staleness ${t.staleness ?? "–"}`,
        `reward ${t.reward === null || t.reward === undefined ? (t.reward_error ? "failed" : "–") : ChorusChart.fmt(t.reward)}`,
        `advantage ${t.advantage === null || t.advantage === undefined ? "–" : ChorusChart.fmt(t.advantage)}`];
      who.appendChild(text("span", "", facts.join("\n"))).style.whiteSpace = "pre";
      row.appendChild(who);
      const body = document.createElement("div");
      body.appendChild(text("pre", "prompt", t.prompt_tail || ""));
      body.appendChild(text("pre", "response " + (t.correct ? "ok" : ""), t.response || ""));
      if (t.reward_error) body.appendChild(text("pre", "bad", "reward error: " + t.reward_error));
      row.appendChild(body);
      div.appendChild(row);
    }
    box.appendChild(div);
  }
}

// --- wiring --------------------------------------------------------------------------------------------------
async function refresh() {
  const r = await fetch("api/state", { cache: "no-store" });
  if (!r.ok) throw new Error("state: HTTP " + r.status);
  load(await r.json());
}

function connect() {
  if (source) source.close();
  source = new EventSource("api/stream");
  source.onmessage = (e) => {
    let updates;
    try { updates = JSON.parse(e.data); } catch (err) { return; }
    updates.forEach(apply);
    Object.values(charts).forEach((c) => (c.dirty = true));
    renderEvents();
    $("updated").textContent = "updated " + new Date().toLocaleTimeString();
  };
  source.onopen = () => { refresh().catch(() => {}); };
  source.onerror = () => { if (S.live === "live") setLive("reconnecting"); };
}

function tick() {
  if (Object.values(charts).some((c) => c.dirty)) redrawAll();
  if (cardsDirty) { cardsDirty = false; renderCards(); }
  if (episodesDirty) { episodesDirty = false; renderEpisodes(); }
  requestAnimationFrame(tick);
}

function redrawAll() {
  redraw();
  Object.values(charts).forEach((c) => { c.dirty = true; c.draw(); });
}

function wire() {
  $("xaxis").onchange = () => { Object.values(charts).forEach((c) => (c.dirty = true)); };
  $("f-agent").onchange = (e) => { filter.agent = e.target.value; episodesDirty = true; };
  $("f-reward").onchange = (e) => { filter.reward = e.target.value; episodesDirty = true; };
  $("f-kind").onchange = (e) => { filter.kind = e.target.value; episodesDirty = true; };
  $("f-version").oninput = (e) => { filter.version = e.target.value === "" ? null : Number(e.target.value); episodesDirty = true; };
  $("f-clear").onclick = () => {
    Object.assign(filter, { agent: "", reward: "", version: null, kind: "" });
    $("f-agent").value = ""; $("f-reward").value = ""; $("f-version").value = ""; $("f-kind").value = "";
    episodesDirty = true;
  };
  window.addEventListener("resize", () => Object.values(charts).forEach((c) => (c.dirty = true)));
}

makeCharts();
wire();
refresh().then(() => { connect(); requestAnimationFrame(tick); }).catch((err) => {
  $("live").textContent = "cannot load the state: " + err.message;
});
