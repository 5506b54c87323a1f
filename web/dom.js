// Small DOM and formatting helpers. Server-provided text only ever goes into textContent
// or attributes through setAttribute: never into innerHTML (names are user input).

const SVG_NS = "http://www.w3.org/2000/svg";

function apply(el, attrs) {
  for (const [key, value] of Object.entries(attrs)) {
    if (value === undefined || value === null || value === false) continue;
    if (key === "text") el.textContent = String(value);
    else if (key.startsWith("on") && typeof value === "function") {
      el.addEventListener(key.slice(2), value);
    } else el.setAttribute(key, value === true ? "" : String(value));
  }
  return el;
}

function append(el, children) {
  for (const child of children.flat()) {
    if (child === undefined || child === null || child === false) continue;
    el.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
  return el;
}

/** h("a", {href: "#/runs", class: "x"}, "text", otherNode) */
export function h(tag, attrs = {}, ...children) {
  return append(apply(document.createElement(tag), attrs), children);
}

export function s(tag, attrs = {}, ...children) {
  return append(apply(document.createElementNS(SVG_NS, tag), attrs), children);
}

export function replace(el, ...children) {
  el.replaceChildren();
  return append(el, children);
}

// ---------------------------------------------------------------- formatting

export function num(x, digits = 3) {
  return x === null || x === undefined || !Number.isFinite(x) ? "–" : x.toFixed(digits);
}

export function int(x) {
  return x === null || x === undefined ? "–" : Math.round(x).toLocaleString("en-US");
}

/** 1234567 -> "1.23M"; flops(1.2e15) -> "1.20 PFLOP" */
export function si(x, unit = "") {
  if (x === null || x === undefined || !Number.isFinite(x)) return "–";
  const prefixes = ["", "k", "M", "G", "T", "P", "E"];
  let i = 0;
  let v = Math.abs(x);
  while (v >= 1000 && i < prefixes.length - 1) { v /= 1000; i += 1; }
  const sign = x < 0 ? "-" : "";
  const digits = i === 0 ? 0 : v < 10 ? 2 : v < 100 ? 1 : 0;
  return `${sign}${v.toFixed(digits)}${unit ? " " : ""}${prefixes[i]}${unit}`;
}

/** seconds -> "42 s", "3 min 5 s", "2 h 10 min" */
export function duration(seconds) {
  if (seconds === null || seconds === undefined || !Number.isFinite(seconds)) return "–";
  const t = Math.max(0, Math.round(seconds));
  if (t < 60) return `${t} s`;
  if (t < 3600) return `${Math.floor(t / 60)} min ${t % 60} s`;
  return `${Math.floor(t / 3600)} h ${Math.floor((t % 3600) / 60)} min`;
}

export function ago(iso, now = serverNow()) {
  if (!iso) return "never";
  return `${duration((now - Date.parse(iso)) / 1000)} ago`;
}

export function when(iso) {
  if (!iso) return "–";
  const d = new Date(iso);
  return d.toLocaleString("en-GB", { dateStyle: "short", timeStyle: "medium" });
}

// ---------------------------------------------------------------- the API

let clockOffsetMs = 0; // server clock minus ours, from the Date header of the last answer

export function serverNow() {
  return Date.now() + clockOffsetMs;
}

export class ApiError extends Error {
  constructor(status, code, detail) {
    super(detail);
    this.status = status;
    this.code = code;
  }
}

/** GET (or another method) /api/v1<path>; returns the JSON (null for an empty answer),
 * throws ApiError with detail. ``body``: a FormData as multipart, anything else as JSON. */
export async function api(path, { method = "GET", token = null, body = undefined } = {}) {
  const headers = { Accept: "application/json" };
  if (token) headers.Authorization = `Bearer ${token}`;
  const init = { method, headers, cache: "no-store" };
  if (body instanceof FormData) init.body = body;
  else if (body !== undefined) {
    headers["Content-Type"] = "application/json";
    init.body = JSON.stringify(body);
  }
  let response;
  try {
    response = await fetch(`/api/v1${path}`, init);
  } catch (err) {
    throw new ApiError(0, "network", `the server is unreachable (${err.message})`);
  }
  const date = Date.parse(response.headers.get("Date") || "");
  if (Number.isFinite(date)) clockOffsetMs = date - Date.now();
  const answer = await response.json().catch(() => null);
  if (!response.ok) {
    const detail = answer && answer.detail ? answer.detail : `HTTP ${response.status}`;
    throw new ApiError(response.status, answer && answer.error, detail);
  }
  return answer;
}
