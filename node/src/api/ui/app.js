// The dashboard's script: plain DOM, no framework, no build step. Every element is made
// with createElement and textContent: nothing peers sent (job names, histories, reasons)
// is ever parsed as HTML.
"use strict";

const csrf = document.querySelector('meta[name="csrf"]').content;
// Set once per page load: a test sees that updates arrive without a reload.
window.cannabisLoadedAt = Date.now();

let me = null;
let openJob = null;

function el(tag, text, cls) {
  const e = document.createElement(tag);
  if (text !== undefined && text !== null) e.textContent = String(text);
  if (cls) e.className = cls;
  return e;
}

function row(cells, onClick) {
  const tr = el("tr");
  for (const c of cells) {
    const td = c instanceof Node ? (() => { const t = el("td"); t.appendChild(c); return t; })() : el("td", c);
    tr.appendChild(td);
  }
  if (onClick) { tr.className = "clickable"; tr.addEventListener("click", onClick); }
  return tr;
}

function fill(id, rows, empty) {
  const body = document.getElementById(id);
  body.replaceChildren(...rows);
  if (rows.length === 0) {
    const tr = el("tr");
    const td = el("td", empty || "none", "hint");
    td.colSpan = body.parentElement.querySelectorAll("th").length;
    tr.appendChild(td);
    body.appendChild(tr);
  }
}

function set(id, text) { document.getElementById(id).textContent = text; }

function short(s) { return s && s.length > 20 ? s.slice(0, 12) + "..." + s.slice(-6) : s; }
function mib(bytes) { return (bytes / 1048576).toFixed(0) + " MiB"; }
function when(ms) { return ms ? new Date(ms).toLocaleString() : "-"; }
function money(a) { return a === null || a === undefined ? "-" : String(a); }
// A state as people read it: "done" for "done" or {"state": "done", ...}.
function label(v) {
  if (v === null || v === undefined) return "-";
  if (typeof v !== "object") return String(v);
  if (typeof v.state === "string") return v.state;
  const keys = Object.keys(v);
  return keys.length === 1 ? keys[0] : JSON.stringify(v);
}

async function api(path, options) {
  const r = await fetch(path, Object.assign({ credentials: "same-origin" }, options || {}));
  if (r.status === 401) { location.href = "/ui/login"; throw new Error("logged out"); }
  const body = await r.json().catch(() => ({}));
  if (!r.ok) throw new Error(body.error || r.statusText);
  return body;
}

function post(path, body) {
  return api(path, {
    method: "POST",
    headers: { "Content-Type": "application/json", "X-CSRF-Token": csrf },
    body: JSON.stringify(body),
  });
}

function showPulse(p) {
  const s = p.status;
  if (s) {
    me = s.address;
    set("node-address", s.address);
    set("node-peer", s.peer_id);
    set("node-version", s.version);
    set("node-peers", s.connected_peers + " connected, " + s.ads + " ads and " + s.offers + " offers in view");
    set("node-executor", s.executor || "-");
    const health = [];
    if (s.safe_mode) health.push("SAFE MODE: " + s.safe_mode);
    if (s.probing) health.push("probing what it offers");
    if (s.refused_peers) health.push(s.refused_peers + " peers refused");
    set("node-health", health.length ? health.join("; ") : "ok");
  }
  const control = document.getElementById("node-control");
  control.textContent = p.control || "no executor";
  control.className = "state-" + (p.control || "none");
  set("node-height", p.height === null ? "no ledger" : String(p.height));
  fill("jobs-body", p.jobs.map((j) => {
    const state = el("span", j.state, "state-" + j.state);
    const tr = row([short(j.job_id), j.name, state, money(j.budget), money(j.used), j.bids],
      () => { openJob = j.job_id; refreshJob(); });
    tr.id = "job-" + j.job_id;
    tr.dataset.state = j.state;
    return tr;
  }), "no jobs published from this node");
}

async function refreshJob() {
  if (!openJob) return;
  const j = await api("/v1/jobs/" + openJob);
  document.getElementById("job-detail").hidden = false;
  set("job-title", j.summary.name + " (" + j.summary.job_id + "): " + j.summary.state);
  const tasks = document.getElementById("job-tasks");
  tasks.replaceChildren();
  for (const t of j.tasks) {
    tasks.appendChild(el("p", "task " + t.name + ": " + label(t.status) +
      ", " + t.bids.length + " bids, budget " + t.budget + ", spent " + t.spent));
    const ul = el("ul");
    for (const r of t.ranks) {
      const work = r.progress ? ", work " + label(r.progress.stage) : "";
      ul.appendChild(el("li", "rank " + r.rank + " on " + short(r.worker) + " epoch " + r.epoch +
        " price " + r.price + " " + r.state + work + (r.caught ? ", WRONG by spot check" : "")));
    }
    for (const x of t.transfers || []) {
      const pct = x.total ? Math.floor((100 * x.bytes) / x.total) : 0;
      const li = el("li", "rank " + x.rank + " outputs arriving: " + pct + "% ");
      const bar = el("progress"); bar.max = 100; bar.value = pct; li.appendChild(bar);
      ul.appendChild(li);
    }
    tasks.appendChild(ul);
  }
  if (j.escrow) {
    tasks.appendChild(el("p", "escrow: " + j.escrow.locked + " locked, " + j.escrow.paid_worker +
      " paid to workers, " + j.escrow.paid_fee + " fee" + (j.escrow.refunded !== null ? ", " + j.escrow.refunded + " refunded" : "")));
  }
  if (j.evaluation && j.evaluation.report) {
    tasks.appendChild(el("p", "evaluation: " + label(j.evaluation.report.outcome)));
  }
  const ol = document.getElementById("job-history");
  ol.replaceChildren(...j.history.map((e) => el("li", when(e.at) + "  " + (e.task !== null ? "[task " + e.task + "] " : "") + e.text)));
}

async function refreshMarket() {
  const [ads, offers, bids, leases] = await Promise.all([
    api("/v1/market/ads"), api("/v1/market/offers"), api("/v1/market/bids"), api("/v1/leases"),
  ]);
  fill("ads-body", ads.map((a) => row([short(a.node), a.cpu_cores, mib(a.memory_bytes), a.gpus, a.adapters.join(", ")])));
  const own = ads.find((a) => a.node === me);
  const dl = document.getElementById("own-ad");
  dl.replaceChildren();
  if (own) {
    const facts = [["cores", own.cpu_cores], ["memory", mib(own.memory_bytes)], ["GPUs", own.gpus],
      ["adapters", own.adapters.join(", ")], ["isolation", own.isolation.join(", ")],
      ["prices", JSON.stringify(own.prices)], ["expires", when(own.expires_at_ms)]];
    for (const [k, v] of facts) { dl.appendChild(el("dt", k)); dl.appendChild(el("dd", v)); }
  } else {
    dl.appendChild(el("dt", "ad")); dl.appendChild(el("dd", "not published (no work taken now)"));
  }
  fill("offers-body", offers.map((o) => row([short(o.job_id), short(o.requester), money(o.budget), o.tasks, when(o.deadline_ms)])));
  fill("bids-body", bids.map((b) => row([short(b.job_id), b.task, short(b.worker), money(b.price)])));
  fill("leases-body", leases.map((l) => row([short(l.job_id), l.task, l.rank, l.lease.epoch, money(l.lease.price),
    label(l.lease.state), when(l.lease.expires_at)])));
}

async function showLog(id) {
  const pre = document.getElementById("log");
  const head = await api("/v1/exec/attempts/" + encodeURIComponent(id) + "/output/stdout?offset=0&max=1");
  const from = Math.max(0, head.size - 65536);
  const chunk = await api("/v1/exec/attempts/" + encodeURIComponent(id) + "/output/stdout?offset=" + from + "&max=65536");
  pre.hidden = false;
  pre.textContent = (from > 0 ? "(the last 64 KiB of " + head.size + " bytes)\n" : "") +
    new TextDecoder().decode(new Uint8Array(chunk.data));
}

async function refreshWork() {
  let attempts = [];
  try { attempts = await api("/v1/exec/attempts"); } catch (e) { attempts = []; }
  fill("attempts-body", attempts.slice(-20).reverse().map((a) => {
    const b = el("button", "stdout");
    b.addEventListener("click", () => showLog(a.id).catch((e) => { set("log", e.message); }));
    return row([short(a.id), label(a.state), a.reason || "", b]);
  }), "no work here yet");
}

async function refreshWallet() {
  if (!me) return;
  try {
    const b = await api("/v1/wallet/" + me);
    set("wallet-balance", String(b.balance));
    set("wallet-spendable", String(b.spendable));
    const blocks = await api("/v1/ledger/blocks?limit=10");
    fill("blocks-body", blocks.map((k) => row([k.height, when(k.time_ms), k.txs, k.compute_count, el("code", k.compute_root)])));
  } catch (e) {
    set("wallet-balance", "no ledger on this node");
  }
}

async function refreshAll() {
  await Promise.all([refreshMarket(), refreshWork(), refreshWallet(), refreshJob()].map((p) => p.catch(() => {})));
}

for (const b of document.querySelectorAll("button[data-control]")) {
  b.addEventListener("click", async () => {
    const control = b.dataset.control;
    if (!window.confirm("Set this node's work to " + control + "?")) return;
    try {
      await post("/v1/exec/control", { control });
      set("control-problem", "");
    } catch (e) {
      set("control-problem", e.message);
    }
  });
}

const events = new EventSource("/ui/events");
events.addEventListener("pulse", (m) => {
  const badge = document.getElementById("live");
  badge.textContent = "live";
  badge.className = "badge live";
  showPulse(JSON.parse(m.data));
  refreshAll();
});
events.onerror = () => {
  const badge = document.getElementById("live");
  badge.textContent = "reconnecting";
  badge.className = "badge";
};
setInterval(refreshAll, 10000);

// Logging out is a change like any other: the CSRF token goes in its header.
document.getElementById("logout-form").addEventListener("submit", async (e) => {
  e.preventDefault();
  await fetch("/ui/logout", { method: "POST", credentials: "same-origin", headers: { "X-CSRF-Token": csrf } });
  location.href = "/ui/login";
});
