// Shared page machinery: polling while visible, the notice line, the ready flag, tables.

import { h } from "./dom.js";

export const POLL_MS = 2500;
const notice = document.getElementById("notice");

/** Runs ``refresh`` now and every ``ms`` while the tab is visible, marking the page ready
 * after each success; returns a stopper. */
export function poll(refresh, ms = POLL_MS) {
  let timer = null;
  let stopped = false;
  async function tick() {
    timer = null;
    if (stopped || document.hidden) return;
    try {
      await refresh();
      if (stopped) return; // the page changed meanwhile: this answer is stale
      showNotice(null);
      ready();
    } catch (err) {
      showNotice(`Could not refresh: ${err.message}`);
    }
    if (!stopped && !document.hidden) timer = setTimeout(tick, ms);
  }
  function onVisibility() {
    if (!document.hidden && timer === null && !stopped) tick();
  }
  document.addEventListener("visibilitychange", onVisibility);
  tick();
  return () => {
    stopped = true;
    if (timer !== null) clearTimeout(timer);
    document.removeEventListener("visibilitychange", onVisibility);
  };
}

export function showNotice(text) {
  notice.hidden = !text;
  notice.textContent = text || "";
}

/** Marks the page as fully rendered (the browser tests and the benchmark wait for it). */
export function ready() {
  if (document.body.dataset.ready === "1") return;
  document.body.dataset.ready = "1";
  performance.mark("dashboard-ready"); // bench/dashboard.py reads it
}

export function statusBadge(status) {
  return h("span", { class: `badge ${status}`, text: status });
}

export function table(headers, rows, caption) {
  return h("div", { class: "scroll" },
    h("table", {},
      caption ? h("caption", { text: caption }) : null,
      h("thead", {}, h("tr", {}, headers.map((t) => h("th", { scope: "col", text: t })))),
      h("tbody", {}, rows)));
}

