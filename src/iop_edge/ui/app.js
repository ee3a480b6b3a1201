"use strict";
// The queue page: reads /ui/stream with fetch (a history event, then one whole view per event; see
// docs/ui.md) and reconnects by itself. Not EventSource: it gives up for good on a non-200 answer
// (a 429 at the viewer cap, a 401 after a token change) and hides why.
(function () {
  const params = new URLSearchParams(location.search);
  const token = params.get("token") || "";
  const wall = params.get("wall") === "1";
  const HISTORY = 300; // samples the charts span: five minutes at one a second
  const RETRY_S = [0.5, 1, 2, 3]; // then every 3 s: back within 5 s of the Edge taking the page again
  const SILENT_S = 12; // the Edge writes at least every 5 s: silence this long means the stream is dead
  let history = []; // [seq, in flight, waiting, grants, refusals], oldest first

  function el(tag, text, cls) {
    const e = document.createElement(tag);
    if (text !== undefined) e.textContent = String(text);
    if (cls) e.className = cls;
    return e;
  }
  // cells(row) gives [text, class, tooltip?]: a cell with a tooltip (true: its own text) may be cut short.
  function fill(id, rows, cells) {
    const body = document.querySelector("#" + id + " tbody");
    const out = document.createDocumentFragment();
    for (const row of rows) {
      const tr = el("tr");
      for (const [text, cls, tip] of cells(row)) {
        const td = tr.appendChild(el("td", text, cls));
        if (tip) td.title = tip === true ? String(text) : tip;
      }
      out.appendChild(tr);
    }
    body.replaceChildren(out);
  }
  function note(id, part, noun) {
    document.getElementById(id).textContent = part.left_out > 0
      ? part.rows.length + " of " + part.matched + " " + noun + " shown (filter to see the rest)"
      : part.matched + " " + noun;
  }
  function figure(id, value, sub, level) {
    const f = document.getElementById(id);
    f.querySelector(".value").textContent = value;
    f.querySelector(".sub").textContent = sub;
    f.className = "figure" + (level ? " " + level : "");
  }

  // The health cell: the Edge's word (with the ejection's time left), then what the node last reported
  // of the backend when it is not "ready"; the node's reason as the tooltip.
  function health(p) {
    let text = p.health + (p.health === "ejected" && p.ejection_left > 0 ? ", " + p.ejection_left.toFixed(1) + " s left" : "");
    if (p.reported && p.reported !== "ready") text += " · " + p.reported.replace("_", " ");
    return [text, p.health, p.report_reason ? p.reported.replace("_", " ") + ": " + p.report_reason : true];
  }
  // The capacity cell's tooltip: a token budget's reservations beside the engine's own view.
  function tokens(p) {
    if (p.token_budget === null && p.kv_use === null && p.preemptions === null) return true;
    const parts = [];
    if (p.token_budget !== null) {
      parts.push("tokens reserved " + p.reserved_tokens + " of " + p.effective_token_budget +
        (p.effective_token_budget < p.token_budget ? " (cut from " + p.token_budget + " by the engine)" : ""));
    }
    if (p.kv_use !== null) {
      parts.push("engine KV " + (100 * p.kv_use).toFixed(1) + " %" +
        (p.token_budget !== null ? " (" + Math.round(p.kv_use * p.token_budget) + " tokens)" : ""));
    }
    if (p.preemptions !== null) parts.push("preemptions " + p.preemptions);
    return parts.join(" · ");
  }
  function render(view) {
    const t = view.totals, h = t.health;
    const latest = history.length ? history[history.length - 1] : null;
    figure("fig-waiting", t.queue_depth, "of " + t.max_queue, t.queue_depth >= t.max_queue ? "alarm" : t.queue_depth ? "warn" : "");
    figure("fig-flight", t.in_flight, "of " + t.capacity, t.capacity && t.in_flight >= t.capacity ? "warn" : "");
    figure("fig-refusals", latest ? latest[4] : "–", "last second", latest && latest[4] ? "alarm" : "");
    figure("fig-offline", t.offline_nodes, "of " + t.nodes + (t.nodes === 1 ? " node" : " nodes"), t.offline_nodes ? "alarm" : "");
    document.getElementById("totals").textContent =
      "providers " + t.providers + ": " + h.online + " online, " + h.offline + " offline, " +
      h.ejected + " ejected, " + h.unavailable + " unavailable, " + h.disabled + " disabled" +
      (view.panic.length ? " · panic: " + view.panic.join(", ") : "");
    fill("waiters", view.waiters.rows, (w) => [
      [w.order, "n minor"], [w.position, "n"], [w.model, "", true], [w.long ? "long" : "normal"], [w.age.toFixed(1), "n"],
      [w.attempt, "n minor"], [w.tenant, "tenant-col", true], [w.reason.replace(/_/g, " "), "reason " + w.reason, view.reasons[w.reason] || w.reason],
    ]);
    note("waiters-note", view.waiters, "waiting");
    // Tenants only when the core has them: no tenant column, filter or table otherwise.
    document.body.classList.toggle("tenanted", view.tenants.length > 0);
    fill("tenants", view.tenants, (t) => [
      [t.tenant, "", true], [t.band, "n"], [t.weight, "n minor", true], [t.waiting, "n", true],
      [t.in_flight + " / " + (t.max_in_flight === null ? "∞" : t.max_in_flight), "n", true],
      [t.max_queue === null ? "∞" : t.max_queue, "n minor", true], [(100 * t.share).toFixed(1) + " %", "n"],
    ]);
    fill("models", view.models, (m) => [
      [m.model, "", true], [m.waiting, "n", true], [m.long_waiting, "n minor", true], [m.oldest_wait.toFixed(1), "n", true],
      [m.in_flight, "n", true], [m.live_candidates + " / " + m.candidate_count, "n", true],
      [m.candidates.join(", ") + (m.candidate_count > m.candidates.length ? ", …" : ""), "minor", true],
    ]);
    fill("providers", view.providers.rows, (p) => [
      [p.node, "", true], [p.provider, "", true],
      health(p),
      [p.in_flight + " / " + p.capacity + (p.reported_capacity !== null && p.reported_capacity < p.capacity
        ? " (backend " + p.reported_capacity + ")" : "") + (p.effective_token_budget !== null &&
        p.effective_token_budget < p.token_budget ? " · budget cut" : ""), "n", tokens(p)], [p.long_in_flight + " / " + p.long_capacity, "n minor", true],
      [p.pressure + " (" + p.long_pressure + ")", "n", true],
    ]);
    note("providers-note", view.providers, "providers");
    const dl = document.getElementById("reasons");
    const reasons = Object.entries(view.reasons);
    if (dl.childElementCount !== 2 * reasons.length) { // tenants configured or removed: other reasons
      dl.replaceChildren();
      for (const [code, text] of reasons) { dl.appendChild(el("dt", code.replace(/_/g, " "))); dl.appendChild(el("dd", text)); }
    }
  }

  // ---------------------------------------------------------------- charts
  function addSamples(samples) {
    const seq = history.length ? history[history.length - 1][0] : -1;
    for (const s of samples) if (s[0] > seq) history.push(s);
    if (history.length > HISTORY) history = history.slice(-HISTORY);
  }
  let before = null; // the activity counts at the previous view
  function activity(view) {
    const counts = Object.assign({}, view.activity, { "": view.unknown_model });
    const rows = [];
    for (const [model, c] of Object.entries(counts)) {
      const b = (before && before[model]) || c; // a model first seen: no rate yet
      rows.push([model, Math.max(0, c.grants - b.grants), Math.max(0, c.refusals - b.refusals)]);
    }
    before = counts;
    fill("activity", rows, ([model, g, r]) => [model ? [model, "", true] : ["unknown model", "unknown"], [g, "n"], [r, "n"]]);
  }
  function charts() {
    draw("chart", [[1, "#1565c0"], [2, "#c62828"]]);
    draw("rates", [[3, "#2e7d32"], [4, "#ef6c00"]]);
    document.getElementById("chart").dataset.samples = String(history.length);
    const rows = history.slice(-10).reverse();
    fill("history", rows.map((s, i) => [i, ...s.slice(1)]), (s) => s.map((v) => [v, "n"]));
  }
  function draw(id, series) {
    const c = document.getElementById(id), g = c.getContext("2d");
    const ratio = window.devicePixelRatio || 1;
    const w = Math.max(1, Math.round(c.clientWidth * ratio)), h = Math.max(1, Math.round(c.clientHeight * ratio));
    if (c.width !== w || c.height !== h) { c.width = w; c.height = h; }
    g.clearRect(0, 0, w, h);
    const font = parseFloat(getComputedStyle(c).fontSize) * ratio * 0.8;
    const top = Math.max(1, ...history.map((s) => Math.max(...series.map(([k]) => s[k]))));
    const pad = font * 1.2, step = (w - 2) / (HISTORY - 1), end = history.length ? history[history.length - 1][0] : 0;
    g.font = font + "px system-ui, sans-serif"; g.fillStyle = "#777"; g.textBaseline = "top";
    g.fillText(String(top), 4, 2);
    g.textBaseline = "bottom";
    g.fillText("5 min ago", 4, h - 2);
    g.textAlign = "right"; g.fillText("now", w - 4, h - 2); g.textAlign = "left";
    for (const [k, color] of series) {
      g.strokeStyle = color; g.lineWidth = 2 * ratio; g.beginPath();
      history.forEach((s, i) => {
        const x = w - 1 - (end - s[0]) * step;
        const y = h - pad - (s[k] / top) * (h - 2 * pad);
        if (i === 0) g.moveTo(x, y); else g.lineTo(x, y);
      });
      g.stroke();
    }
  }

  // ---------------------------------------------------------------- filters
  const form = document.getElementById("filters");
  const FILTERS = ["node", "model", "health", "tenant"];
  for (const name of FILTERS) form.elements[name].value = params.get(name) || "";
  form.addEventListener("submit", (e) => {
    e.preventDefault();
    for (const name of FILTERS) {
      const v = form.elements[name].value.trim();
      if (v) params.set(name, v); else params.delete(name);
    }
    before = null;
    window.history.replaceState(null, "", "?" + params);
    connect();
  });
  document.body.classList.toggle("wall", wall);
  const toggle = document.getElementById("wall-toggle");
  const other = new URLSearchParams(params);
  if (wall) other.delete("wall"); else other.set("wall", "1");
  toggle.addEventListener("click", () => { location.search = "?" + other; }); // the token stays out of the DOM
  toggle.textContent = wall ? "normal view" : "wall mode";

  // ---------------------------------------------------------------- the stream
  // The label tells the truth at every moment: "connecting" until the first view arrives, "live"
  // while views or keep-alives keep coming, "reconnecting in N s" with the reason otherwise.
  const link = document.getElementById("link"), why = document.getElementById("why");
  let running = null; // the AbortController of the current attempt
  let failures = 0, retryAt = 0, retryTimer = null, reason = "";
  function label(text, ok, detail) {
    link.textContent = text; link.className = ok ? "ok" : "bad"; why.textContent = detail || "";
    document.body.classList.toggle("stale", !ok); // what is shown is no longer current: dimmed
  }
  function stream() {
    const query = new URLSearchParams(params);
    query.delete("token"); query.delete("wall");
    const stop = new AbortController();
    running = stop;
    label("connecting", false, reason);
    let heard = Date.now(), answered = false;
    const watchdog = setInterval(() => {
      if (Date.now() - heard > SILENT_S * 1000) stop.abort(new Error("nothing heard for " + SILENT_S + " s"));
    }, 1000);
    const headers = token ? { authorization: "Bearer " + token } : {};
    fetch("/ui/stream?" + query, { headers, cache: "no-store", signal: stop.signal })
      .then(async (response) => {
        answered = true;
        if (!response.ok) {
          let message = response.statusText;
          try { message = (await response.json()).error.message; } catch (e) { /* not JSON: keep the status text */ }
          throw new Error("refused (" + response.status + "): " + message);
        }
        const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
        let pending = "";
        for (;;) {
          const { value, done } = await reader.read();
          if (done) throw new Error("the Edge ended the stream");
          heard = Date.now();
          pending += value;
          let end;
          while ((end = pending.indexOf("\n\n")) >= 0) {
            event(pending.slice(0, end));
            pending = pending.slice(end + 2);
          }
        }
      })
      .catch((error) => {
        if (running !== stop) return; // replaced by a newer attempt (a filter change)
        let cause = String(error.message || error);
        if (stop.signal.aborted && stop.signal.reason) cause = stop.signal.reason.message; // the watchdog
        else if (error instanceof TypeError && !answered) cause = "the Edge is unreachable";
        else if (error instanceof TypeError && /network/i.test(error.message)) cause = "the connection to the Edge broke";
        retry(cause);
      })
      .finally(() => clearInterval(watchdog));
  }
  // One server-sent event: "event: history" (the series on open) or a view (no event name).
  function event(text) {
    let name = "message", data = "";
    for (const line of text.split("\n")) {
      if (line.startsWith("event:")) name = line.slice(6).trim();
      else if (line.startsWith("data:")) data += line.slice(line[5] === " " ? 6 : 5);
    }
    if (!data) return; // a keep-alive comment
    const body = JSON.parse(data);
    if (name === "history") { history = body.samples.slice(-HISTORY); charts(); return; }
    addSamples(body.recent || []);
    render(body);
    activity(body);
    charts();
    if (link.textContent !== "live") { failures = 0; reason = ""; label("live", true); }
  }
  function retry(cause) {
    const delay = RETRY_S[Math.min(failures, RETRY_S.length - 1)] * (0.75 + 0.25 * Math.random());
    failures += 1;
    reason = cause;
    retryAt = Date.now() + delay * 1000;
    clearTimeout(retryTimer);
    retryTimer = setTimeout(connect, delay * 1000);
    countdown();
  }
  function countdown() {
    if (!retryAt) return;
    const left = Math.max(0, Math.ceil((retryAt - Date.now()) / 1000));
    label("reconnecting", false, reason + " — next try in " + left + " s");
  }
  function connect() {
    clearTimeout(retryTimer);
    retryAt = 0;
    if (running) { const old = running; running = null; old.abort(); }
    stream();
  }
  connect();
  setInterval(countdown, 250);
  window.addEventListener("resize", charts);
})();
