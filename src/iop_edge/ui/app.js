"use strict";
// The queue page: one EventSource on /ui/stream, each event a whole view (see docs/ui.md).
(function () {
  const params = new URLSearchParams(location.search);
  const HISTORY = 300; // samples kept for the chart: five minutes at one a second
  const history = [];
  let last = null;

  function el(tag, text, cls) {
    const e = document.createElement(tag);
    if (text !== undefined) e.textContent = String(text);
    if (cls) e.className = cls;
    return e;
  }
  function fill(id, rows, cells) {
    const body = document.querySelector("#" + id + " tbody");
    const out = document.createDocumentFragment();
    for (const row of rows) {
      const tr = el("tr");
      for (const [text, cls] of cells(row)) tr.appendChild(el("td", text, cls));
      out.appendChild(tr);
    }
    body.replaceChildren(out);
  }
  function note(id, part, noun) {
    document.getElementById(id).textContent = part.left_out > 0
      ? part.rows.length + " of " + part.matched + " " + noun + " shown (filter to see the rest)"
      : part.matched + " " + noun;
  }

  function render(view) {
    const t = view.totals, h = t.health;
    document.getElementById("totals").textContent =
      "waiting " + t.queue_depth + "/" + t.max_queue + " · in flight " + t.in_flight + "/" + t.capacity +
      " · providers " + t.providers + ": " + h.online + " online, " + h.offline + " offline, " +
      h.ejected + " ejected, " + h.unavailable + " unavailable, " + h.disabled + " disabled" +
      (view.panic.length ? " · panic: " + view.panic.join(", ") : "");
    fill("waiters", view.waiters.rows, (w) => [
      [w.order, "n"], [w.position, "n"], [w.model], [w.long ? "long" : "normal"], [w.age.toFixed(1), "n"],
      [w.attempt, "n"], [w.tenant, "tenant-col"], [view.reasons[w.reason] || w.reason, "reason " + w.reason],
    ]);
    note("waiters-note", view.waiters, "waiting");
    // Tenants only when the core has them: no tenant column, filter or table otherwise.
    document.body.classList.toggle("tenanted", view.tenants.length > 0);
    fill("tenants", view.tenants, (t) => [
      [t.tenant], [t.band, "n"], [t.weight, "n"], [t.waiting, "n"],
      [t.in_flight + " / " + (t.max_in_flight === null ? "∞" : t.max_in_flight), "n"],
      [t.max_queue === null ? "∞" : t.max_queue, "n"], [(100 * t.share).toFixed(1) + " %", "n"],
    ]);
    fill("models", view.models, (m) => [
      [m.model], [m.waiting, "n"], [m.long_waiting, "n"], [m.oldest_wait.toFixed(1), "n"], [m.in_flight, "n"],
      [m.live_candidates + " / " + m.candidate_count, "n"],
      [m.candidates.join(", ") + (m.candidate_count > m.candidates.length ? ", …" : "")],
    ]);
    fill("providers", view.providers.rows, (p) => [
      [p.node], [p.provider],
      [p.health === "ejected" ? "ejected, " + p.ejection_left.toFixed(1) + " s left" : p.health, p.health],
      [p.in_flight + " / " + p.capacity, "n"], [p.long_in_flight + " / " + p.long_capacity, "n"],
      [p.pressure, "n"], [p.long_pressure, "n"],
    ]);
    note("providers-note", view.providers, "providers");
    const dl = document.getElementById("reasons");
    const reasons = Object.entries(view.reasons);
    if (dl.childElementCount !== 2 * reasons.length) { // tenants configured or removed: other reasons
      dl.replaceChildren();
      for (const [code, text] of reasons) { dl.appendChild(el("dt", code)); dl.appendChild(el("dd", text)); }
    }
  }

  let before = null; // the activity counts at the previous sample
  function sample() {
    if (last === null) return;
    const counts = last.activity || {};
    const rates = {};
    let grants = 0, refusals = 0;
    for (const [model, c] of Object.entries(counts)) {
      const b = (before && before[model]) || c; // a model first seen: no rate yet
      const r = [Math.max(0, c.grants - b.grants), Math.max(0, c.refusals - b.refusals)];
      rates[model] = r; grants += r[0]; refusals += r[1];
    }
    before = counts;
    history.push([last.totals.in_flight, last.totals.queue_depth, grants, refusals]);
    if (history.length > HISTORY) history.shift();
    draw("chart", [[0, "#1565c0"], [1, "#c62828"]]);
    draw("rates", [[2, "#2e7d32"], [3, "#ef6c00"]]);
    const rows = history.slice(-10).reverse();
    fill("history", rows.map((s, i) => [i, ...s]), (s) => s.map((v) => [v, "n"]));
    fill("activity", Object.entries(rates), ([model, r]) => [[model], [r[0], "n"], [r[1], "n"]]);
  }
  function draw(id, series) {
    const c = document.getElementById(id), g = c.getContext("2d");
    g.clearRect(0, 0, c.width, c.height);
    const top = Math.max(1, ...history.map((s) => Math.max(...series.map(([k]) => s[k]))));
    for (const [k, color] of series) {
      g.strokeStyle = color; g.lineWidth = 2; g.beginPath();
      history.forEach((s, i) => {
        const x = c.width - (history.length - 1 - i) * (c.width / HISTORY);
        const y = c.height - 4 - (s[k] / top) * (c.height - 8);
        if (i === 0) g.moveTo(x, y); else g.lineTo(x, y);
      });
      g.stroke();
    }
  }

  const form = document.getElementById("filters");
  const FILTERS = ["node", "model", "health", "tenant"];
  for (const name of FILTERS) form.elements[name].value = params.get(name) || "";
  form.addEventListener("submit", (e) => {
    e.preventDefault();
    for (const name of FILTERS) {
      const v = form.elements[name].value.trim();
      if (v) params.set(name, v); else params.delete(name);
    }
    history.length = 0;
    before = null;
    window.history.replaceState(null, "", "?" + params);
    connect();
  });

  let source = null;
  const link = document.getElementById("link");
  function connect() {
    if (source) source.close();
    source = new EventSource("/ui/stream?" + params);
    source.onopen = () => { link.textContent = "live"; link.className = "ok"; };
    source.onerror = () => { link.textContent = "reconnecting"; link.className = "bad"; };
    source.onmessage = (e) => { last = JSON.parse(e.data); render(last); };
  }
  connect();
  setInterval(sample, 1000);
})();
