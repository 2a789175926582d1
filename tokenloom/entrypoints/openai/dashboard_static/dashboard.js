// The tokenloom dashboard: reads the server's snapshot stream (dashboard/events,
// server-sent events) and draws it. Charts are uPlot; the KV block map and the
// request timelines are drawn on canvases. No network beyond this server.
"use strict";

(function () {
  const params = new URLSearchParams(location.search);
  const interval = params.get("interval") || "1";
  const KEY_STORE = "tokenloom-api-key";
  const css = getComputedStyle(document.documentElement);
  const color = (name) => css.getPropertyValue("--" + name).trim();
  const BLOCK_COLORS = ["free", "cached", "used", "shared"].map(color);
  const panels = new Map();
  let latest = null;

  // ------------------------------------------------------------ formatting

  const fmtInt = (v) => (v == null ? "-" : Math.round(v).toLocaleString("en-US"));
  const fmtMs = (s) => (s == null ? "-" : (s * 1000).toFixed(s < 0.1 ? 1 : 0));
  const fmtPct = (v) => (v == null ? "-" : (100 * v).toFixed(1) + "%");
  const fmtPcts = (p) => [p.p50, p.p90, p.p99].map(fmtMs).join(" / ") + " ms";

  function setValue(el, text, raw) {
    if (!el) return;
    el.textContent = text;
    if (raw !== undefined) el.dataset.value = raw == null ? "" : String(raw);
  }

  // ------------------------------------------------------------ the stream

  function status(state, text) {
    const el = document.getElementById("status");
    el.dataset.state = state;
    el.textContent = text;
  }

  function authHeaders() {
    const key = sessionStorage.getItem(KEY_STORE);
    return key ? { Authorization: "Bearer " + key } : {};
  }

  async function connect() {
    let response;
    try {
      response = await fetch("dashboard/events?interval=" + encodeURIComponent(interval), {
        headers: authHeaders(),
        cache: "no-store",
      });
    } catch (err) {
      status("error", "disconnected; retrying");
      setTimeout(connect, 2000);
      return;
    }
    if (response.status === 401 || response.status === 403) {
      status("error", "needs the API key");
      document.getElementById("auth").hidden = false;
      return;
    }
    if (!response.ok) {
      status("error", "error " + response.status + "; retrying");
      setTimeout(connect, 2000);
      return;
    }
    status("live", "live");
    const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
    let buffer = "";
    try {
      for (;;) {
        const { value, done } = await reader.read();
        if (done) break;
        buffer += value;
        let end;
        while ((end = buffer.indexOf("\n\n")) >= 0) {
          const event = buffer.slice(0, end);
          buffer = buffer.slice(end + 2);
          const data = event
            .split("\n")
            .filter((line) => line.startsWith("data:"))
            .map((line) => line.slice(5))
            .join("\n");
          if (data) render(JSON.parse(data));
        }
      }
    } catch (err) {
      // fall through: reconnect
    }
    status("error", "disconnected; retrying");
    setTimeout(connect, 2000);
  }

  document.getElementById("auth").addEventListener("submit", (event) => {
    event.preventDefault();
    sessionStorage.setItem(KEY_STORE, document.getElementById("api-key").value);
    document.getElementById("auth").hidden = true;
    status("connecting", "connecting");
    connect();
  });

  // ------------------------------------------------------------ rendering

  function render(snapshot) {
    latest = snapshot;
    document.getElementById("model").textContent =
      snapshot.model + (snapshot.num_engines > 1 ? " · " + snapshot.num_engines + " engine cores" : "");
    const t = snapshot.totals;
    setValue(document.getElementById("running"), fmtInt(snapshot.running), snapshot.running);
    setValue(document.getElementById("waiting"), fmtInt(snapshot.waiting), snapshot.waiting);
    setValue(document.getElementById("finished"), fmtInt(t.finished_requests), t.finished_requests);
    setValue(document.getElementById("prompt-tokens"), fmtInt(t.prompt_tokens), t.prompt_tokens);
    setValue(document.getElementById("generation-tokens"), fmtInt(t.generation_tokens), t.generation_tokens);
    setValue(document.getElementById("preemptions"), fmtInt(t.preemptions), t.preemptions);
    const hitRate = t.prefix_cache_queries ? t.prefix_cache_hits / t.prefix_cache_queries : null;
    setValue(document.getElementById("hit-rate"), fmtPct(hitRate), hitRate);
    let tps = 0;
    for (const engine of snapshot.engines) {
      const g = engine.series.generation_tps;
      if (g.length) tps += g[g.length - 1];
    }
    setValue(document.getElementById("generation-tps"), tps.toFixed(1), tps);
    setValue(document.getElementById("ttft"), fmtPcts(snapshot.ttft), snapshot.ttft.p50);
    setValue(document.getElementById("tpot"), fmtPcts(snapshot.tpot), snapshot.tpot.p50);
    for (const engine of snapshot.engines) renderEngine(engine, snapshot.time);
  }

  function panelFor(index) {
    let panel = panels.get(index);
    if (panel) return panel;
    const node = document.getElementById("engine-template").content.firstElementChild.cloneNode(true);
    node.dataset.engine = String(index);
    node.querySelector(".engine-index").textContent = String(index);
    document.getElementById("engines").appendChild(node);
    panel = { node, charts: {} };
    panels.set(index, panel);
    return panel;
  }

  function field(panel, name) {
    return panel.node.querySelector('[data-field="' + name + '"]');
  }

  function renderEngine(engine, now) {
    const panel = panelFor(engine.engine);
    setValue(field(panel, "running"), fmtInt(engine.running), engine.running);
    setValue(field(panel, "waiting"), fmtInt(engine.waiting), engine.waiting);
    setValue(field(panel, "kv"), fmtPct(engine.kv_cache_usage), engine.kv_cache_usage);
    setValue(field(panel, "steps"), fmtInt(engine.totals.steps), engine.totals.steps);
    const s = engine.series;
    const pct = (values) => values.map((v) => (v == null ? null : 100 * v));
    chart(panel, "requests", timeOpts([["running", color("prefill")], ["waiting", color("queue")]]),
      [s.t, s.running, s.waiting]);
    chart(panel, "cache", timeOpts([["KV cache %", color("used")], ["prefix hit %", color("cached")]]),
      [s.t, pct(s.kv_cache_usage), pct(s.prefix_cache_hit_rate)]);
    chart(panel, "throughput", timeOpts([["prompt tok/s", color("prefill")], ["generation tok/s", color("decode")]]),
      [s.t, s.prompt_tps, s.generation_tps]);
    batchChart(panel, engine.steps);
    blockMap(panel, engine);
    timeline(panel, engine.requests, now);
    requestTable(panel, engine.requests);
  }

  function chartWidth(panel, name) {
    const el = panel.node.querySelector('[data-chart="' + name + '"]');
    return [el, Math.max(300, el.clientWidth || 420)];
  }

  function timeOpts(series) {
    return {
      height: 170,
      scales: { x: { time: true } },
      series: [{}].concat(series.map(([label, stroke]) => ({ label, stroke, width: 1.5, spanGaps: false }))),
      axes: [{}, { size: 45 }],
    };
  }

  function chart(panel, name, opts, data) {
    let plot = panel.charts[name];
    if (!plot) {
      const [el, width] = chartWidth(panel, name);
      plot = new uPlot(Object.assign({ width }, opts), data, el);
      panel.charts[name] = plot;
    } else {
      plot.setData(data);
    }
  }

  // Stacked bars: each series is drawn as the running sum, the legend shows its own value.
  function batchChart(panel, steps) {
    const prefill = steps.prefill;
    const decode = prefill.map((v, i) => v + steps.decode[i]);
    const draft = decode.map((v, i) => v + steps.draft[i]);
    const raw = { 1: steps.draft, 2: steps.decode, 3: steps.prefill };
    const bars = uPlot.paths.bars({ size: [0.9, 40] });
    const own = (u, v, si, idx) => (idx == null ? "-" : raw[si][idx]);
    const opts = {
      height: 170,
      scales: { x: { time: false }, reqs: { auto: true } },
      series: [
        { label: "step" },
        { label: "draft", fill: color("draft"), stroke: color("draft"), paths: bars, value: own },
        { label: "decode", fill: color("decode"), stroke: color("decode"), paths: bars, value: own },
        { label: "prefill", fill: color("prefill"), stroke: color("prefill"), paths: bars, value: own },
        { label: "requests", stroke: color("fg"), width: 1, scale: "reqs" },
      ],
      axes: [{}, { size: 45, label: "tokens" }, { side: 1, scale: "reqs", grid: { show: false }, size: 35 }],
    };
    chart(panel, "batch", opts, [steps.index, draft, decode, prefill, steps.requests]);
  }

  function fitCanvas(canvas) {
    const width = canvas.clientWidth || 420;
    if (canvas.width !== width) canvas.width = width;
    return canvas.getContext("2d");
  }

  function blockMap(panel, engine) {
    const counts = engine.block_counts;
    if (counts) {
      for (const name of ["free", "cached", "used", "shared"]) {
        setValue(panel.node.querySelector('[data-count="' + name + '"]'), fmtInt(counts[name]), counts[name]);
      }
    }
    const map = engine.block_map;
    if (map == null) return;
    const canvas = panel.node.querySelector("canvas.block-map");
    const ctx = fitCanvas(canvas);
    const w = canvas.width, h = canvas.height, n = map.length;
    const cell = Math.max(1, Math.floor(Math.sqrt((w * h) / n)));
    const columns = Math.max(1, Math.floor(w / cell));
    ctx.clearRect(0, 0, w, h);
    for (let i = 0; i < n; i++) {
      ctx.fillStyle = BLOCK_COLORS[map.charCodeAt(i) - 48];
      ctx.fillRect((i % columns) * cell, Math.floor(i / columns) * cell, Math.max(1, cell - (cell > 3 ? 1 : 0)), Math.max(1, cell - (cell > 3 ? 1 : 0)));
    }
  }

  function timeline(panel, requests, now) {
    const canvas = panel.node.querySelector("canvas.timeline");
    const ctx = fitCanvas(canvas);
    const w = canvas.width, h = canvas.height;
    ctx.clearRect(0, 0, w, h);
    if (!requests.length) return;
    const rows = requests.slice().sort((a, b) => a.arrival_time - b.arrival_time);
    const start = rows[0].arrival_time;
    const span = Math.max(now - start, 1e-3);
    const x = (t) => ((t - start) / span) * (w - 4) + 2;
    const rowH = h / rows.length;
    const barH = Math.max(1, rowH - (rowH > 4 ? 2 : 0));
    rows.forEach((r, i) => {
      const y = i * rowH;
      const end = r.finish_time == null ? now : r.finish_time;
      const scheduled = r.first_scheduled_time == null ? end : r.first_scheduled_time;
      const token = r.first_token_time == null ? end : r.first_token_time;
      const phases = [[r.arrival_time, scheduled, "queue"], [scheduled, token, "prefill"], [token, end, "decode"]];
      for (const [a, b, name] of phases) {
        if (b <= a) continue;
        ctx.fillStyle = color(name);
        ctx.fillRect(x(a), y, Math.max(1, x(b) - x(a)), barH);
      }
      ctx.fillStyle = color("preempt");
      for (const p of r.preemption_times) ctx.fillRect(x(p) - 1, y, 2, barH);
    });
  }

  function requestTable(panel, requests) {
    const body = panel.node.querySelector("table.requests tbody");
    const rows = requests.slice(0, 12).map((r) => {
      const cells = [
        r.request_id,
        r.first_scheduled_time == null ? "-" : fmtMs(r.first_scheduled_time - r.arrival_time),
        r.first_token_time == null ? "-" : fmtMs(r.first_token_time - r.arrival_time),
        fmtInt(r.num_prompt_tokens),
        fmtInt(r.num_cached_tokens),
        fmtInt(r.num_generation_tokens),
        fmtInt(r.preemption_times.length),
        r.finish_reason || "running",
      ];
      const tr = document.createElement("tr");
      for (const cell of cells) {
        const td = document.createElement("td");
        td.textContent = cell;
        tr.appendChild(td);
      }
      return tr;
    });
    body.replaceChildren(...rows);
  }

  window.addEventListener("resize", () => {
    for (const panel of panels.values()) {
      for (const [name, plot] of Object.entries(panel.charts)) {
        plot.setSize({ width: chartWidth(panel, name)[1], height: 170 });
      }
    }
    if (latest) render(latest);
  });

  connect();
})();
