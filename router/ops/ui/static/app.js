/* gpupool status page: draws the router's admin JSON and refreshes itself.
 *
 * Data: GET /admin/pools (pools, instances, queues) every REFRESH_MS, /admin/accounting (top
 * runs, tenants) and /admin/history (the last hour, fetched whole once, then only newer
 * samples) every SLOW_MS, and /admin/decisions when /admin/pools says the router has a
 * rebalancer (its "rebalancer" object): a router without one gets no call that would answer
 * 404 (a browser logs each as a console error), and the pressure column, the pressure plot and
 * the decisions panel stay hidden. Same-origin calls: the browser sends the credentials it gave
 * for /ui.
 *
 * Every figure in the tables sits in a cell marked data-field="…" inside a row marked
 * data-pool="…" or data-instance="…", so a test can read what the page shows.
 * window.gpupoolUI = {refresh(), pause(), resume(), state} drives it by hand.
 */
"use strict";

(function () {
  const REFRESH_MS = 2000;
  const SLOW_MS = 5000;
  const HISTORY_WINDOW_S = 3600;

  const state = {
    pools: null, accounting: null, history: [], historyInterval: null, decisions: null,
    lastSlow: 0, timer: null, live: true, inFlight: null,
  };

  // ---------------------------------------------------------------- formatting
  const DASH = "–";
  const isNum = v => typeof v === "number" && Number.isFinite(v);
  const pct = v => isNum(v) ? (v * 100).toFixed(1) + " %" : DASH;
  const num = (v, digits) => isNum(v) ? v.toFixed(digits) : DASH;
  const int = v => isNum(v) ? String(Math.round(v)) : DASH;
  const secs = v => !isNum(v) ? DASH : v >= 10 ? v.toFixed(1) + " s" :
    v >= 1 ? v.toFixed(2) + " s" : (v * 1000).toFixed(0) + " ms";

  function node(tag, attrs, ...children) {
    const e = document.createElement(tag);
    for (const [k, v] of Object.entries(attrs || {})) {
      if (v === null || v === undefined || v === false) continue;
      if (k === "class") e.className = v;
      else if (k === "field") e.dataset.field = v;
      else e.setAttribute(k, String(v));
    }
    for (const c of children) {
      if (c === null || c === undefined) continue;
      e.append(c instanceof Node ? c : document.createTextNode(String(c)));
    }
    return e;
  }

  function meter(frac, marks, hot) {
    const m = node("span", {class: "meter"});
    const bar = node("b", {class: hot ? "hot" : null});
    bar.style.width = Math.max(0, Math.min(1, isNum(frac) ? frac : 0)) * 100 + "%";
    m.append(bar);
    for (const mark of marks || []) {
      if (!isNum(mark)) continue;
      const tick = node("i");
      tick.style.left = Math.max(0, Math.min(1, mark)) * 100 + "%";
      m.append(tick);
    }
    return m;
  }

  // ---------------------------------------------------------------- data
  async function getJson(path) {
    const resp = await fetch(path, {credentials: "same-origin", cache: "no-store"});
    if (resp.status === 404) return {absent: true};
    if (!resp.ok) {
      let message = resp.status + " " + resp.statusText;
      try { message = (await resp.json()).error.message || message; } catch (_) { /* text */ }
      throw new Error(path + ": " + message);
    }
    return {body: await resp.json()};
  }

  function latestSample() {
    return state.history.length ? state.history[state.history.length - 1] : null;
  }

  const hasRebalancer = () => Boolean(state.pools && state.pools.rebalancer);

  function describe(v) {
    if (v === null || v === undefined) return "";
    if (typeof v !== "object") return isNum(v) ? v.toFixed(2) : String(v);
    return Object.entries(v).map(([k, x]) => `${k} ${describe(x)}`).join(", ");
  }

  // ---------------------------------------------------------------- tables
  function renderPools(view) {
    const body = document.querySelector("#pools tbody");
    const pools = Object.entries(view.pools);
    const reb = view.rebalancer || null;
    const smoothed = (reb && reb.smoothed_pressure) || {};
    const showPressure = Boolean(reb);
    document.querySelectorAll(".pressure").forEach(e => { e.hidden = !showPressure; });
    const rates = (latestSample() || {rates: {}}).rates.requests_per_s || {};
    body.replaceChildren(...pools.map(([name, p]) => {
      const q = p.queue || {};
      const total = Object.keys(p.instances || {}).length;
      const pressure = isNum(smoothed[name]) ? smoothed[name] : null;
      const signals = reb && reb.pressure ? describe(reb.pressure[name]) : "";
      // the rebalancer's bounds (SRE overrides, schedules, one instance's worth) where it runs
      const inForce = reb && reb.bounds && Array.isArray(reb.bounds[name]) ? reb.bounds[name] : null;
      return node("tr", {"data-pool": name},
        node("td", {field: "name", class: "text"}, name),
        node("td", {field: "classes", class: "text"}, (p.classes || []).join(", ")),
        node("td", {title: inForce ? `bounds in force ${pct(inForce[0])} – ${pct(inForce[1])}`
          : null},
          node("span", {field: "share_frac"}, pct(p.share_frac)),
          meter(p.share_frac, inForce || [p.floor_frac, p.ceiling_frac])),
        node("td", {field: "floor_frac"}, pct(p.floor_frac)),
        node("td", {field: "ceiling_frac"}, pct(p.ceiling_frac)),
        node("td", {field: "pressure", class: "pressure" + (pressure >= 1 ? " warn" : ""),
          hidden: !showPressure, title: signals}, num(pressure, 2)),
        node("td", {field: "healthy_instances",
          class: p.healthy_instances === 0 ? "bad" : null}, `${p.healthy_instances} / ${total}`),
        node("td", {field: "queue_depth", class: q.depth > 0 ? "warn" : null},
          `${int(q.depth)} / ${int(q.max_depth)}`),
        node("td", {field: "drain_rate_per_s"}, num(q.drain_rate_per_s, 2)),
        node("td", {field: "requests_per_s"}, num(rates[name], 2)),
        node("td", {field: "slo"}, p.slo ?
          `${int(p.slo.ttft_p95_ms)} ms / ${int(p.slo.tpot_p95_ms)} ms` : DASH));
    }));
  }

  // a split engine's blocks per pool: held within its share, borrowed past it, kept for it
  // (admission.reserve: forecast); /admin/pools capacity_by_pool
  function sharing(byPool) {
    return Object.entries(byPool || {}).map(([p, c]) => `${p}: ${num(c.owned_blocks, 0)} owned` +
      `, ${num(c.borrowed_blocks, 0)} borrowed of ${num(c.share_blocks, 0)} blk share` +
      (c.reserve ? `, ${num(c.reserve.blocks, 0)} kept for it (${c.reserve.why})` : "")).join("\n");
  }

  function borrowed(byPool) {
    const total = Object.values(byPool || {}).reduce((sum, c) => sum + (c.borrowed_blocks || 0), 0);
    return total > 0 ? node("span", {field: "kv_borrowed_blocks", class: "muted"},
      ` ${int(total)} borrowed`) : "";
  }

  // the other router replicas' reservations admission counts beside this replica's own
  // (/admin/pools peer_reservations; null: not shared)
  function peerBlocks(peers) {
    return peers ? node("span", {field: "peer_kv_reserved_blocks", class: "muted"},
      ` + ${int(peers.kv_reserved_blocks)} other replicas`) : "";
  }

  function peerRunning(peers) {
    return peers ? node("span", {field: "peer_running", class: "muted"},
      ` + ${int(peers.running)}`) : "";
  }

  function peersByReplica(peers) {
    return peers ? Object.entries(peers.by_replica || {}).map(([r, byPool]) => `${r}: ` +
      Object.entries(byPool).map(([p, c]) =>
        `${p} ${int(c.kv_reserved_blocks)} blk, ${int(c.running)} running`).join(", "))
      .join("\n") : null;
  }

  function replicaSummary(replica) {
    if (!replica) return "";
    return ` · replica ${replica.id}` + (replica.shared_admission ?
      ` (${int(replica.peers_counted)} others counted)` : "");
  }

  function renderInstances(view) {
    const body = document.querySelector("#instances tbody");
    body.replaceChildren(...Object.entries(view.instances).map(([id, i]) => {
      const blocks = i.num_gpu_blocks;
      const reservedFrac = isNum(blocks) && blocks > 0 ? i.kv_reserved_blocks / blocks : null;
      const shares = Object.entries(i.pools || {}).filter(([, f]) => f > 0)
        .map(([p, f]) => `${p} ${(f * 100).toFixed(0)} %`).join(", ");
      const op = i.operating_point || {};
      const health = i.healthy ? node("span", {class: "ok"}, "healthy")
        : node("span", {class: "bad", title: i.last_error || ""}, "unhealthy");
      return node("tr", {"data-instance": id, title: i.url},
        node("td", {field: "id", class: "text"}, id),
        node("td", {field: "healthy", class: "text"}, health),
        node("td", {field: "pools", class: "text"}, shares || DASH),
        i.kv_capacity === "unknown"
          ? node("td", {field: "kv_capacity", class: "warn", title: "the engine's /metrics has no " +
              "vllm:cache_config_info: it is admitted by its operating point, without KV checks"},
              "kv_capacity: unknown")
          : node("td", {title: isNum(blocks) ? `${num(i.kv_used_blocks, 1)} of ${blocks} blocks` : ""},
              node("span", {field: "kv_usage_frac"}, pct(i.kv_usage_frac)),
              meter(i.kv_usage_frac, [0.8], i.kv_usage_frac >= 0.8)),
        node("td", {title: sharing(i.capacity_by_pool)},
          node("span", {field: "kv_reserved_blocks"}, int(i.kv_reserved_blocks)), " blk ",
          node("span", {class: "muted"}, isNum(reservedFrac) ? `(${pct(reservedFrac)})` : ""),
          borrowed(i.capacity_by_pool), peerBlocks(i.peer_reservations)),
        node("td", {field: "running"}, int(i.running)),
        node("td", {field: "waiting", class: i.waiting > 0 ? "warn" : null}, int(i.waiting)),
        node("td", {title: peersByReplica(i.peer_reservations)},
          node("span", {field: "inflight"}, int(i.inflight)), peerRunning(i.peer_reservations)),
        node("td", {},
          node("span", {field: "op_limit"}, int(op.limit)), " ",
          node("span", {class: "muted"}, op.source || "")),
        node("td", {field: "telemetry_age_s"}, isNum(i.telemetry_age_s) ?
          i.telemetry_age_s.toFixed(1) + " s" : DASH),
        node("td", {field: "preemptions_seen"}, int(i.preemptions_seen)),
        prefixCell(i.prefix_cache));
    }));
  }

  // The router's index of the engine's prefix cache (/admin/pools "prefix_cache"; null: the
  // engine publishes no KV events gpupool follows): blocks indexed and the last batch's age;
  // the counters in the title. Unusable (not connected, hashing differently): "bad"; inexact
  // (a batch lost, under-reports until the engine clears its cache): "warn".
  function prefixCell(pc) {
    if (!pc) return node("td", {field: "prefix_cached_blocks", title: "no KV events followed"}, DASH);
    const title = [
      pc.usable ? "usable" : pc.connected ? "not usable (hashes differently)" : "not connected",
      pc.exact ? "exact" : "inexact: a batch was lost, under-reports",
      `block size ${int(pc.block_size_tokens)} tokens`,
      `batches received ${int(pc.batches_received)}`,
      `replays ${int(pc.replays)}, resyncs ${int(pc.resyncs)}, restarts ${int(pc.restarts)}`,
    ].join("\n");
    return node("td", {title, class: !pc.usable ? "bad" : !pc.exact ? "warn" : null},
      node("span", {field: "prefix_cached_blocks"}, int(pc.cached_blocks)), " blk ",
      node("span", {field: "prefix_index_age_s", class: "muted"},
        isNum(pc.index_age_s) ? secs(pc.index_age_s) : DASH),
      pc.restarts + pc.resyncs > 0 ? node("span", {field: "prefix_restarts", class: "muted"},
        ` ${int(pc.restarts)} restarts, ${int(pc.resyncs)} resyncs`) : "");
  }

  function renderCost(acc) {
    const runs = acc.top_runs || [];
    document.querySelector("#top-runs tbody").replaceChildren(...(runs.length ? runs.map(r =>
      node("tr", {"data-run": r.run_id},
        node("td", {field: "run_id", class: "text", title: r.run_id},
          r.run_id.length > 28 ? r.run_id.slice(0, 27) + "…" : r.run_id),
        node("td", {field: "tenant", class: "text"}, r.tenant),
        node("td", {field: "classes", class: "text"}, (r.classes || []).join(", ")),
        node("td", {field: "requests"}, int(r.requests)),
        node("td", {field: "gpu_seconds"}, num(r.gpu_seconds, 2)),
        node("td", {field: "wall_s"}, num(r.wall_s, 1)),
        node("td", {field: "errors", class: r.errors > 0 ? "bad" : null}, int(r.errors))))
      : [node("tr", {}, node("td", {colspan: 7, class: "text muted"}, "no runs yet"))]));
    const ledger = acc.ledger || {};
    const total = ledger.gpu_seconds || 0;
    const tenants = Object.entries(ledger.by_tenant || {})
      .sort((a, b) => b[1].gpu_seconds - a[1].gpu_seconds).slice(0, 10);
    document.querySelector("#top-tenants tbody").replaceChildren(...(tenants.length ?
      tenants.map(([name, t]) => node("tr", {"data-tenant": name},
        node("td", {field: "tenant", class: "text"}, name),
        node("td", {field: "gpu_seconds"}, num(t.gpu_seconds, 2)),
        node("td", {field: "share"}, total > 0 ? pct(t.gpu_seconds / total) : DASH),
        node("td", {field: "requests"}, int(t.requests)),
        node("td", {field: "runs"}, int(t.runs))))
      : [node("tr", {}, node("td", {colspan: 5, class: "text muted"}, "no requests yet"))]));
    document.getElementById("cost-note").textContent = isNum(ledger.gpu_seconds) ?
      `${num(ledger.gpu_seconds, 1)} attributed, ${num(ledger.idle_gpu_seconds, 1)} idle` +
      ` of ${num(ledger.capacity_gpu_seconds, 1)} capacity (ledger)` : "";
  }

  function why(d) {
    // "<reason> (<who>)", with the kind first when it says more than the reason
    const head = d.kind && d.kind !== d.reason ? `${d.kind}: ${d.reason || ""}` : d.reason || "";
    return d.who ? `${head} (${d.who})` : head;
  }

  function renderDecisions(body) {
    const section = document.getElementById("decisions-section");
    const list = Array.isArray(body) ? body : body.data || body.decisions || [];
    section.hidden = false;
    const when = d => d.at_unix_s ?? d.t_s;
    const rows = list.slice().sort((a, b) => when(b) - when(a)).slice(0, 20).map(d => {
      const t = when(d);
      const move = d.move ? `${d.move.from_pool} → ${d.move.to_pool} ${pct(d.move.share_frac)}`
        : "no move";
      return node("tr", {"data-decision": ""},
        node("td", {class: "text"}, isNum(t) ? new Date(t * 1000).toLocaleTimeString() : DASH),
        node("td", {class: "text"}, move),
        node("td", {class: "text"}, why(d)),
        node("td", {class: "text"}, describe(d.smoothed_pressure)));
    });
    document.querySelector("#decisions tbody").replaceChildren(...(rows.length ? rows :
      [node("tr", {}, node("td", {colspan: 4, class: "text muted"}, "no decisions yet"))]));
  }

  // ---------------------------------------------------------------- plots
  function seriesBy(path) {
    // {key: [[t_s, value], ...]} from samples[...path][key]
    const out = {};
    for (const s of state.history) {
      let node = s;
      for (const k of path) node = node ? node[k] : undefined;
      if (!node) continue;
      for (const [key, v] of Object.entries(node)) (out[key] = out[key] || []).push([s.t_s, v]);
    }
    return Object.entries(out).sort().map(([name, points]) => ({name, points}));
  }

  function seriesOfField(group, field) {
    const out = {};
    for (const s of state.history) {
      for (const [key, v] of Object.entries(s[group] || {})) {
        (out[key] = out[key] || []).push([s.t_s, isNum(v[field]) ? v[field] : null]);
      }
    }
    return Object.entries(out).sort().map(([name, points]) => ({name, points}));
  }

  function renderPlots() {
    const plot = (id, series, opts) => window.GpupoolPlot.draw(
      document.getElementById(id), Object.assign({series}, opts));
    const percent = v => (v * 100).toFixed(0) + "%";
    plot("plot-share", seriesOfField("pools", "share_frac"), {yMax: 1, yFormat: percent});
    plot("plot-ttft", seriesBy(["latency", "ttft_p95_s"]), {yFormat: secs});
    plot("plot-tpot", seriesBy(["latency", "tpot_p95_s"]), {yFormat: secs});
    const count = v => v % 1 ? v.toFixed(1) : v.toFixed(0);
    plot("plot-queue", seriesOfField("pools", "queue_depth"), {yFormat: count, yTopAtLeast: 4});
    plot("plot-wait", seriesBy(["latency", "queue_wait_p95_s"]), {yFormat: secs});
    plot("plot-kv", seriesOfField("instances", "kv_usage_frac"), {yMax: 1, yFormat: percent});
    plot("plot-rate", seriesBy(["rates", "requests_per_s"]), {yFormat: count, yTopAtLeast: 1});
    const pressure = seriesOfField("pools", "pressure");
    const hasPressure = pressure.some(s => s.points.some(([, v]) => v !== null));
    document.getElementById("figure-pressure").hidden = !hasPressure;
    if (hasPressure) plot("plot-pressure", pressure, {yFormat: v => v.toFixed(2)});
    const first = state.history[0];
    document.getElementById("history-note").textContent = first ?
      `(${state.history.length} samples every ${state.historyInterval} s since ` +
      `${new Date(first.t_s * 1000).toLocaleTimeString()})` : "";
  }

  // ---------------------------------------------------------------- refresh
  async function refreshSlow() {
    const last = latestSample();
    const since = last ? `?since_s=${last.t_s}` : "";
    const [acc, hist, dec] = await Promise.all([
      getJson("/admin/accounting?top=10"),
      getJson("/admin/history" + since),
      hasRebalancer() ? getJson("/admin/decisions?limit=20") : Promise.resolve(null),
    ]);
    if (acc.body) { state.accounting = acc.body; renderCost(acc.body); }
    if (hist.body) {
      state.historyInterval = hist.body.interval_s;
      state.history.push(...hist.body.samples);
      const cutoff = (latestSample() || {t_s: 0}).t_s - HISTORY_WINDOW_S;
      while (state.history.length && state.history[0].t_s < cutoff) state.history.shift();
      renderPlots();
    }
    document.getElementById("decisions-section").hidden = !(dec && dec.body);
    if (dec && dec.body) {
      state.decisions = dec.body;
      renderDecisions(dec.body);
    }
  }

  async function refreshOnce() {
    const errorBox = document.getElementById("error");
    try {
      const slowDue = Date.now() - state.lastSlow >= SLOW_MS;
      const pools = await getJson("/admin/pools");
      if (pools.body) state.pools = pools.body;
      if (slowDue) { await refreshSlow(); state.lastSlow = Date.now(); }
      if (pools.body) {
        renderPools(pools.body);
        renderInstances(pools.body);
        const ratio = Object.entries(pools.body.pools)
          .map(([n, p]) => `${n} ${pct(p.share_frac)}`).join(" · ");
        document.getElementById("summary").textContent =
          `${ratio} · admission ${pools.body.admission} · allocation v${pools.body.allocation_version}`
          + rebalancerSummary(pools.body.rebalancer) + replicaSummary(pools.body.replica);
      }
      document.getElementById("updated").textContent =
        "updated " + new Date().toLocaleTimeString();
      errorBox.hidden = true;
    } catch (err) {
      errorBox.textContent = String(err.message || err);
      errorBox.hidden = false;
    }
  }

  function refresh() {
    // one refresh at a time; a call while one runs waits for it and then runs again
    const run = (state.inFlight || Promise.resolve()).then(refreshOnce);
    state.inFlight = run;
    run.finally(() => { if (state.inFlight === run) state.inFlight = null; });
    return run;
  }

  function schedule() {
    clearTimeout(state.timer);
    if (!state.live) return;
    state.timer = setTimeout(async () => { await refresh(); schedule(); }, REFRESH_MS);
  }

  function pause() { state.live = false; clearTimeout(state.timer); liveBox().checked = false; }
  function resume() { state.live = true; liveBox().checked = true; refresh().then(schedule); }
  const liveBox = () => document.getElementById("live");

  function rebalancerSummary(reb) {
    if (!reb) return "";
    const parts = [reb.enabled === false ? "rebalancer off" : reb.frozen ? "rebalancer frozen"
      : `rebalancer every ${reb.interval_s} s`];
    if (isNum(reb.moves)) parts.push(`${reb.moves} moves`);
    if (isNum(reb.cooldown_left_s) && reb.cooldown_left_s > 0) {
      parts.push(`cooldown ${reb.cooldown_left_s.toFixed(0)} s`);
    }
    const draining = Object.entries(reb.draining || {});
    if (draining.length) {
      parts.push("draining " + draining.map(([i, d]) => `${i} ${d.from_pool}→${d.to_pool}`)
        .join(", "));
    }
    if (reb.pinned_shares) parts.push("pinned");
    return " · " + parts.join(" · ");
  }

  liveBox().addEventListener("change", e => (e.target.checked ? resume() : pause()));
  window.gpupoolUI = {refresh, pause, resume, state};
  refresh().then(schedule);
})();
