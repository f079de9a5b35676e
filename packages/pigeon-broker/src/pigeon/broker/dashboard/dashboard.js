// PigeonMQ dashboard: polls the admin API of the broker that served this page.
// No dependencies; the chart is drawn on a <canvas>.
(function () {
  "use strict";
  const API = "/admin/v2";
  const params = new URLSearchParams(window.location.search);
  const REFRESH_MS = Math.max(250, Number(params.get("refresh") || 2) * 1000);
  const $ = (id) => document.getElementById(id);
  // With authentication on, the API wants "Authorization: Bearer <token>".  The token is
  // kept in sessionStorage only (this tab, until it closes or "Log out"): never in
  // localStorage, a cookie or the page.
  const TOKEN_KEY = "pigeon.admin.token";
  let timer = null;

  class Unauthorized extends Error {}

  function token() { return window.sessionStorage.getItem(TOKEN_KEY); }

  // numbers, sizes and rates as the CLI writes them (units.js)
  const units = window.PigeonUnits;
  const fmt = units.number;
  const bytes = units.size;
  async function getJSON(path) {
    const headers = { Accept: "application/json" };
    const t = token();
    if (t) headers.Authorization = "Bearer " + t;
    const resp = await fetch(path, { cache: "no-store", headers: headers });
    const body = await resp.json().catch(() => null);
    if (resp.status === 401) throw new Unauthorized((body && body.message) || "401 Unauthorized");
    if (!resp.ok && !(resp.status === 503 && body && body.checks)) {
      throw new Error((body && body.message) || resp.status + " " + resp.statusText);
    }
    return body;
  }
  function cell(tr, text, cls, field) {
    const td = document.createElement("td");
    td.textContent = text;
    if (cls) td.className = cls;
    if (field) td.dataset.field = field;
    tr.appendChild(td);
    return td;
  }

  function renderHealth(h) {
    $("cluster").textContent = "cluster " + h.cluster;
    const badge = $("status");
    badge.textContent = h.status;
    badge.dataset.status = h.status;
    const tbody = $("checks").tBodies[0];
    tbody.replaceChildren();
    for (const [name, check] of Object.entries(h.checks)) {
      const tr = document.createElement("tr");
      tr.dataset.check = name;
      cell(tr, name);
      cell(tr, check.ok ? "ok" : "FAILED", check.ok ? "ok" : "failed");
      const detail = Object.entries(check).filter(([k]) => k !== "ok").map(([k, v]) => k + "=" + v).join("  ");
      cell(tr, detail);
      tbody.appendChild(tr);
    }
    const b = h.checks.bookies || {};
    $("load-bookies").textContent = (b.writable ?? "–") + " / " + (b.total ?? "–");
  }

  function renderLoad(load) {
    $("load-topics").textContent = fmt(load.topics, 0);
    $("load-connections").textContent = fmt(load.connections, 0);
    $("load-clients").textContent = fmt(load.producers, 0) + " / " + fmt(load.consumers, 0);
    $("load-rate-in").textContent = fmt(load.msg_rate_in);
    $("load-rate-out").textContent = fmt(load.msg_rate_out);
  }

  function renderTopics(topics) {
    const tbody = $("topics").tBodies[0];
    tbody.replaceChildren();
    for (const t of topics) {
      const tr = document.createElement("tr");
      tr.dataset.topic = t.topic;
      cell(tr, t.topic, "topic", "topic");
      cell(tr, fmt(t.producers, 0), "num", "producers");
      cell(tr, fmt(t.subscription_count, 0), "num", "subscriptions");
      cell(tr, fmt(t.msg_rate_in), "num", "msg_rate_in");
      cell(tr, fmt(t.msg_rate_out), "num", "msg_rate_out");
      const total = cell(tr, fmt(t.msgs_in, 0), "num", "msgs_in");
      total.dataset.value = String(t.msgs_in);
      const backlog = cell(tr, fmt(t.backlog, 0), "num", "backlog");
      backlog.dataset.value = String(t.backlog);
      cell(tr, t.persistent ? bytes(t.storage_size) : "non-persistent", "num", "storage_size");
      tbody.appendChild(tr);
    }
    $("no-topics").hidden = topics.length > 0;
  }

  function renderBookies(list) {
    const tbody = $("bookies").tBodies[0];
    tbody.replaceChildren();
    for (const b of list) {
      const tr = document.createElement("tr");
      tr.dataset.bookie = b.address;
      cell(tr, b.address, "topic");
      cell(tr, b.read_only ? "read-only" + (b.read_only_reason ? " (" + b.read_only_reason + ")" : "") : "writable",
           b.read_only ? "failed" : "ok");
      cell(tr, bytes(b.free_disk_bytes), "num");
      cell(tr, bytes(b.disk_used_bytes), "num");
      cell(tr, units.rate(b.write_bytes_per_s), "num", "write_bytes_per_s");
      cell(tr, units.rate(b.read_bytes_per_s), "num", "read_bytes_per_s");
      cell(tr, fmt(b.segments, 0), "num");
      tbody.appendChild(tr);
    }
  }

  function drawChart(samples) {
    const canvas = $("chart");
    const ratio = window.devicePixelRatio || 1;
    const width = canvas.clientWidth, height = canvas.clientHeight;
    if (canvas.width !== width * ratio || canvas.height !== height * ratio) {
      canvas.width = width * ratio;
      canvas.height = height * ratio;
    }
    const ctx = canvas.getContext("2d");
    ctx.setTransform(ratio, 0, 0, ratio, 0, 0);
    ctx.clearRect(0, 0, width, height);
    const pad = { l: 56, r: 12, t: 12, b: 24 };
    const w = width - pad.l - pad.r, h = height - pad.t - pad.b;
    const now = Date.now(), span = 300000;
    let max = 1;
    for (const s of samples) max = Math.max(max, s.msg_rate_in, s.msg_rate_out);
    max = niceCeil(max);
    ctx.strokeStyle = "#e3e6eb"; ctx.fillStyle = "#6b7280"; ctx.lineWidth = 1;
    ctx.font = "11px system-ui, sans-serif";
    for (let i = 0; i <= 4; i++) {
      const y = pad.t + h - (h * i) / 4;
      ctx.beginPath(); ctx.moveTo(pad.l, y); ctx.lineTo(pad.l + w, y); ctx.stroke();
      ctx.fillText(fmt((max * i) / 4, 0), 4, y + 4);
    }
    for (let m = 0; m <= 5; m++) {
      const x = pad.l + w - (w * m) / 5;
      ctx.fillText(m ? "-" + m + "m" : "now", x - 12, height - 6);
    }
    const xOf = (t) => pad.l + w - ((now - t) / span) * w;
    const yOf = (v) => pad.t + h - (v / max) * h;
    for (const [key, color] of [["msg_rate_in", "#2563eb"], ["msg_rate_out", "#16a34a"]]) {
      ctx.strokeStyle = color; ctx.lineWidth = 2; ctx.beginPath();
      let started = false;
      for (const s of samples) {
        if (now - s.time > span) continue;
        const x = xOf(s.time), y = yOf(s[key]);
        if (started) ctx.lineTo(x, y); else { ctx.moveTo(x, y); started = true; }
      }
      ctx.stroke();
    }
    canvas.dataset.samples = String(samples.length);
  }
  function niceCeil(v) {
    const p = Math.pow(10, Math.floor(Math.log10(v)));
    for (const m of [1, 2, 5, 10]) if (v <= m * p) return m * p;
    return 10 * p;
  }

  function showLogin(message) {
    window.clearTimeout(timer);
    timer = null;
    $("content").hidden = true;
    $("error").hidden = true;
    $("logout").hidden = true;
    $("login").hidden = false;
    $("login-error").textContent = message || "";
    $("login-error").hidden = !message;
    $("status").textContent = "log in";
    $("status").dataset.status = "unknown";
    $("token").focus();
  }

  function showContent() {
    $("login").hidden = true;
    $("content").hidden = false;
    $("logout").hidden = !token();
  }

  $("login").addEventListener("submit", (event) => {
    event.preventDefault();
    const value = $("token").value.trim();
    $("token").value = "";
    if (!value) return;
    window.sessionStorage.setItem(TOKEN_KEY, value);
    showContent();
    window.clearTimeout(timer);
    refresh();
  });

  $("logout").addEventListener("click", () => {
    window.sessionStorage.removeItem(TOKEN_KEY);
    showLogin("");
  });

  async function refresh() {
    timer = null;
    try {
      const health = await getJSON(API + "/cluster/health");
      // the open probe names no broker to a caller without valid credentials
      if (!health.brokers.length) throw new Unauthorized("authentication is required");
      const broker = health.brokers[0].broker;
      const [load, topics, bookies, throughput] = await Promise.all([
        getJSON(API + "/brokers/" + encodeURIComponent(broker) + "/load"),
        getJSON(API + "/broker-stats/topics"),
        getJSON(API + "/bookies"),
        getJSON(API + "/broker-stats/throughput"),
      ]);
      renderHealth(health);
      renderLoad(load);
      renderTopics(topics);
      renderBookies(bookies);
      drawChart(throughput);
      $("error").hidden = true;
      $("updated").textContent = "updated " + new Date().toLocaleTimeString();
      document.body.dataset.refreshed = String(Number(document.body.dataset.refreshed || 0) + 1);
      showContent();
    } catch (err) {
      if (err instanceof Unauthorized) {
        const refused = token() !== null;
        window.sessionStorage.removeItem(TOKEN_KEY);
        showLogin(refused ? "The broker refused the token: " + err.message : "");
        return;
      }
      $("error").textContent = "Cannot read the admin API: " + err.message;
      $("error").hidden = false;
      $("status").textContent = "unreachable";
      $("status").dataset.status = "unreachable";
    }
    if (timer === null && $("login").hidden) timer = window.setTimeout(refresh, REFRESH_MS);
  }
  window.addEventListener("resize", () => {
    if ($("login").hidden) getJSON(API + "/broker-stats/throughput").then(drawChart, () => {});
  });
  refresh();
})();
